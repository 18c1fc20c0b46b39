"""Results name the code that produced them; paired task comparisons rest on their discordant items."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.provenance import repository_root, source_commit
from polykv_agents.bench.stats import exact_sign_test, paired_comparison

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "speed.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    return tmp_path


@needs_git
def test_source_commit_is_head_and_clean(checkout):
    assert source_commit(checkout) == (_git(checkout, "rev-parse", "HEAD"), False)


@needs_git
def test_a_changed_source_file_makes_the_run_dirty(checkout):
    (checkout / "code.py").write_text("x = 2\n")
    assert source_commit(checkout).dirty


@needs_git
def test_results_written_by_earlier_suites_do_not(checkout):
    (checkout / "benchmarks" / "results" / "speed.json").write_text('{"rows": []}\n')
    (checkout / "untracked.py").write_text("new\n")
    assert not source_commit(checkout).dirty


@needs_git
def test_this_checkout_is_found():
    root = repository_root()
    assert root is not None and (root / "polykv_agents" / "bench" / "provenance.py").exists()


def test_no_checkout_means_no_commit(tmp_path):
    assert source_commit(tmp_path) is None


def _info(**fields) -> RunInfo:
    base = dict(
        machine="Linux x86_64", cpu="cpu", cpu_count=2, torch_threads=2, device="cpu", torch="2", transformers="5",
        python="3", model="m", dtype="bfloat16", date="2026-12-04",
    )  # fmt: skip
    return RunInfo(**(base | fields))


def test_captions_name_the_commit():
    commit = "0123456789abcdef" * 2 + "01234567"
    assert "Commit: 0123456789." in _info(git_commit=commit, dirty=False).machine_and_model()
    assert "with uncommitted changes" in _info(git_commit=commit, dirty=True).commit_sentence()
    assert "inferred" in _info(git_commit=commit, commit_source="inferred").commit_sentence()
    assert "unknown" in _info(package_version="0.1.0").commit_sentence()


def test_collect_records_this_checkouts_head(tiny_model):
    info = RunInfo.collect(tiny_model)
    source = source_commit()
    assert (info.git_commit, info.dirty) == ((source.commit, source.dirty) if source else (None, None))


def test_sign_test_matches_the_binomial_distribution():
    assert exact_sign_test(0, 5) == pytest.approx(2 / 32)
    assert exact_sign_test(3, 11) == pytest.approx(0.057373046875)  # scipy.stats.binomtest(3, 14).pvalue
    assert exact_sign_test(7, 7) == 1.0
    assert exact_sign_test(0, 0) == 1.0


def test_sparse_differences_get_an_interval_that_is_not_zero_width():
    # 800 items, 14 discordant: the case where Student-t printed "+0.0 (+0.0 to +0.0)"-like cells.
    differences = [0.0] * 786 + [100.0] * 3 + [-100.0] * 11
    comparison = paired_comparison(differences)
    assert (comparison.better, comparison.worse, comparison.n) == (3, 11, 800)
    assert comparison.mean == pytest.approx(-1.0)
    assert comparison.low < -1.0 < comparison.high < 0  # around the mean, and wider than a point
    assert comparison.high - comparison.low > 1.0


def test_bootstrap_is_reproducible_and_centered():
    differences = [1.0, -2.0, 0.0, 3.0, 0.5, -1.0, 2.0, 0.0]
    first, second = paired_comparison(differences), paired_comparison(differences)
    assert first == second
    assert first.low < first.mean < first.high
    assert paired_comparison([0.0] * 20).model_dump() | {"resamples": 0} == {
        "mean": 0.0, "low": 0.0, "high": 0.0, "n": 20, "better": 0, "worse": 0, "sign_test_p": 1.0,
        "confidence": 0.95, "resamples": 0,
    }  # fmt: skip


def test_no_pairs_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        paired_comparison([])
