"""The shared-step profile on a tiny checkpoint: steps over several pools are found and taken apart, per attention
path, and the native kernel's groups cost fewer operator calls than the PyTorch path's."""

from __future__ import annotations

import os

import pytest
from native_kernels import require_native_kernel

from benchmarks.studies.shared_step_profile import (
    SharedStepOptions,
    langgraph_block,
    render_markdown,
    run_shared_step_profile,
)
from polykv_agents.kernels import SWITCH


@pytest.fixture(scope="module")
def result(tiny_model_dir):
    require_native_kernel("grouped_attention")
    options = SharedStepOptions(context_tokens=48, rows=4, pools=[1, 3], new_tokens=6, model=tiny_model_dir)
    before = os.environ.get(SWITCH)
    measured = run_shared_step_profile(options)
    assert os.environ.get(SWITCH) == before  # the study leaves the switch as it found it
    return measured


def test_steps_over_several_pools_are_taken_apart_per_attention_path(result):
    found = {(r["pools"], r["path"], r["step"]) for r in result.rows}
    assert {(1, "native", "one pool"), (1, "pytorch", "one pool")} <= found
    assert {(3, "native", "shared"), (3, "pytorch", "shared")} <= found
    assert not any(r["pools"] == 1 and r["step"] == "shared" for r in result.rows)  # one pool never shares
    for row in result.rows:
        groups = row["groups_ms"]
        assert groups["weights"] > 0 and groups["attention"] > 0  # the kernel's calls count as attention
        assert sum(groups.values()) == pytest.approx(row["step_ms_mean"])
    assert result.run_info.native_kernels is True  # the switch was restored before the record


def test_the_kernel_takes_each_pools_attention_operators_out_of_a_shared_step(result, tiny_model_dir):
    from transformers import AutoConfig

    calls = {(r["pools"], r["path"]): r["operator_calls_per_step"] for r in result.rows if r["step"] == "shared"}
    # Three pools: the PyTorch path runs a prefix part, a suffix part and a merge per pool and layer, each several
    # operators; the kernel one call per layer for all of them. Counted as a difference, not a ratio: the step's
    # other operators (the int8 embedding's lookup, the sampling) are the same on both paths.
    layers = AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    assert calls[(3, "pytorch")] - calls[(3, "native")] >= 3 * 3 * layers


def test_the_docs_show_the_step_over_the_most_pools_per_path(result):
    markdown = render_markdown(result)
    assert "| 3 | native | shared |" in markdown and "| 3 | pytorch | shared |" in markdown
    block = langgraph_block(result)
    assert "| 1 (4) | native |" in block and "| 3 (4) | pytorch |" in block
    assert "Native attention kernel: on." in markdown
