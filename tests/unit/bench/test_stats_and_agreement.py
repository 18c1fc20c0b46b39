"""Summaries and answer-agreement metrics give the textbook values."""

from __future__ import annotations

import pytest

from polykv_agents.bench.stats import mean_interval
from polykv_agents.eval.agreement import exact_match, normalized_tokens, token_f1


def test_mean_interval_matches_the_student_t_interval():
    interval = mean_interval([1.0, 2.0, 3.0])
    # mean 2, standard error 1/sqrt(3), t(0.975, df=2) = 4.3027
    assert interval.mean == pytest.approx(2.0)
    assert interval.high - interval.mean == pytest.approx(4.3027 / 3**0.5, rel=1e-4)
    assert (interval.min, interval.max, interval.n) == (1.0, 3.0, 3)
    assert not interval.excludes_zero
    assert mean_interval([1.0, 1.1, 0.9, 1.05]).excludes_zero


def test_one_sample_has_a_zero_width_interval_and_none_is_an_error():
    interval = mean_interval([0.5])
    assert interval.low == interval.high == 0.5
    with pytest.raises(ValueError, match="at least one sample"):
        mean_interval([])


def test_answers_are_normalised_before_comparison():
    assert normalized_tokens("The Cat, sat!") == ["cat", "sat"]
    assert exact_match("The answer is 42.", "answer is 42")
    assert not exact_match("answer is 41", "answer is 42")


def test_token_f1():
    assert token_f1("red green blue", "red green blue") == 1.0
    assert token_f1("red green", "red green blue yellow") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert token_f1("cat", "dog") == 0.0
    assert token_f1("", "") == 1.0
    assert token_f1("", "dog") == 0.0


def test_sweep_intervals_are_over_documents_with_seeds_averaged_within_each():
    from polykv_agents.bench.sweep import delta_fields, per_document_means

    samples = [
        {"document": 1, "seed": 0, "delta_pct": 3.0},
        {"document": 0, "seed": 0, "delta_pct": 1.0},
        {"document": 0, "seed": 1, "delta_pct": 2.0},
        {"document": 1, "seed": 1, "delta_pct": 5.0},
        {"document": 2, "seed": 0, "delta_pct": 0.0},
        {"document": 2, "seed": 1, "delta_pct": -1.0},
    ]
    assert per_document_means(samples) == [1.5, 4.0, -0.5]
    fields = delta_fields(samples)
    assert fields["documents"] == 3  # not 6: seeds of one document are not independent samples
    assert fields["delta_pct_mean"] == pytest.approx(5.0 / 3)
    assert (fields["delta_pct_min"], fields["delta_pct_max"]) == (-0.5, 4.0)
    # The t-interval of three documents is wider than that of the six samples taken as independent.
    six = mean_interval([s["delta_pct"] for s in samples])
    assert fields["delta_pct_ci_high"] - fields["delta_pct_ci_low"] > six.high - six.low


def test_median_after_warmup_drops_the_first_call():
    from polykv_agents.bench.stats import median_after_warmup

    values = iter([100.0, 3.0, 1.0, 2.0])
    assert median_after_warmup(3, lambda: next(values)) == 2.0  # the 100 s warm-up is not a sample


def test_median_call_seconds_times_each_call_after_its_warm_ups():
    import time

    from polykv_agents.bench.stats import median_call_seconds

    calls = []

    def run():
        calls.append(1)
        time.sleep(0.01 if len(calls) > 2 else 0.2)  # the two warm-ups are slow and left out

    seconds = median_call_seconds(run, 5, warmups=2)
    assert len(calls) == 7 and 0.009 < seconds < 0.1
