"""The profile suite on a tiny checkpoint: every batched step is found and taken apart, and the parts add up."""

from __future__ import annotations

import pytest

from benchmarks.studies.step_profile import (
    GROUP_LABELS,
    GROUP_ORDER,
    ProfileOptions,
    operator_group,
    render_markdown,
    run_profile,
)


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("aten::mm", "weights"),
        ("aten::_weight_int8pack_mm", "weights"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("aten::index_put_", "cache"),
        ("aten::rms_norm", "other operators"),
        ("## Call CompiledFxGraph fpq6ezzmn7lhhap2ico32gqasx64klkvhqr4mwj75uojznzgtvx5 ##", "generated kernels"),
        ("TorchDynamo Cache Lookup", "graph entry"),
    ],
)
def test_operators_are_grouped_by_what_they_do(name, group):
    assert operator_group(name) == group


def test_each_decode_step_is_taken_apart_into_operators_that_add_up_to_it(tiny_model_dir):
    options = ProfileOptions(context_tokens=[48], agents=[1, 3], weights=["native"], new_tokens=6, model=tiny_model_dir)
    result = run_profile(options)
    assert [(r["agents"], r["context_tokens"]) for r in result.rows] == [(1, 48), (3, 48)]
    for row in result.rows:
        assert row["steps"] >= 5  # the first token comes from the admission, the others from decode steps
        groups = row["groups_ms"]
        assert groups["weights"] > 0 and groups["attention"] > 0
        assert sum(groups.values()) == pytest.approx(row["step_ms_mean"])  # outside operators is the rest
        assert groups["outside operators"] >= 0
        assert "aten::mm" in row["top_operators_ms"] or "aten::addmm" in row["top_operators_ms"]
    markdown = render_markdown(result)
    eager_groups = set(GROUP_ORDER) - {"generated kernels", "graph entry"}
    assert all(f"{GROUP_LABELS.get(group, group)} ms" in markdown for group in eager_groups)
    assert "generated kernels" not in markdown  # no column for what an eager step has none of
    assert "| native | 48 | 3 |" in markdown  # the weights column names the setting, not the group's time


def test_a_compiled_step_is_taken_apart_into_its_generated_kernels_and_library_calls(tiny_model_dir):
    options = ProfileOptions(
        context_tokens=[48], agents=[1], weights=["native"], new_tokens=6, model=tiny_model_dir, compile_decode=True
    )
    result = run_profile(options)
    (row,) = result.rows
    groups = row["groups_ms"]
    # Inductor's kernels, dynamo's guards, and the matrix products that stay library calls:
    assert groups["generated kernels"] > 0 and groups["graph entry"] > 0 and groups["weights"] > 0
    assert sum(groups.values()) == pytest.approx(row["step_ms_mean"])
    assert "generated kernels ms" in render_markdown(result) and "Compiled decode steps" in render_markdown(result)
