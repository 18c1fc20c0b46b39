"""Suite output files and the RSS sampler."""

from __future__ import annotations

import json
import mmap
import time

import matplotlib.pyplot as plt
import pytest

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Column, SuiteResult, column, markdown_table, write_suite
from polykv_agents.bench.rss import PeakRss


def _result(tiny_model) -> SuiteResult:
    rows = [{"context_tokens": 600, "ratio": 2.8431}, {"context_tokens": 2048, "ratio": 2.8402}]
    return SuiteResult(suite="demo", info=RunInfo.collect(tiny_model), settings={"repetitions": 3}, rows=rows)


def test_markdown_table_renders_each_row_with_its_format():
    rows = [{"a": 1, "b": 0.12345}]
    table = markdown_table(rows, [column("A", "a"), column("B", "b", "{:.2f}"), Column("C", lambda r: "x")])
    assert table.splitlines() == ["| A | B | C |", "|---|---|---|", "| 1 | 0.12 | x |"]


def test_write_suite_writes_json_markdown_and_plots(tmp_path, tiny_model):
    figure, axis = plt.subplots()
    axis.plot([1, 2], [3, 4])
    written = write_suite(
        _result(tiny_model), tmp_path, title="Demo", columns=[column("ratio", "ratio", "{:.2f}")],
        figures={"line": figure}, notes=["A note."],
    )  # fmt: skip
    assert [p.name for p in written] == ["demo.json", "demo.md", "demo_line.png"]
    assert json.loads(written[0].read_text())["rows"][1]["ratio"] == 2.8402
    markdown = written[1].read_text()
    assert "| 2.84 |" in markdown and "A note." in markdown and "![demo_line](demo_line.png)" in markdown
    assert "torch threads" in markdown and "float32" in markdown  # the conditions are stated
    assert written[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert SuiteResult.load(written[0]) == _result(tiny_model)


def test_peak_rss_sees_a_transient_allocation():
    with PeakRss() as baseline:
        pass
    with PeakRss() as rss:
        # Fresh pages straight from the OS: after a full test run, the C allocator can serve a tensor this size
        # from memory the process already holds, which raises no RSS at all.
        size = 256 * 2**20
        with mmap.mmap(-1, size) as block:
            for offset in range(0, size, mmap.PAGESIZE):
                block[offset] = 1  # touched, so resident
            time.sleep(0.05)  # ten sampling intervals, whatever else competes for the cores
    assert rss.peak_bytes - baseline.peak_bytes > 200 * 2**20


@pytest.mark.parametrize(("threads", "said"), [(1, "1 torch thread,"), (2, "2 torch threads,")])
def test_a_caption_opens_with_the_machine_then_the_model(tiny_model, threads, said):
    info = RunInfo.collect(tiny_model).model_copy(update={"torch_threads": threads, "dtype": "bfloat16"})
    opening = info.machine_and_model()
    assert opening.startswith(f"Machine: {info.machine}, {info.cpu}, {said} torch {info.torch}. Model: ")
    assert opening.endswith(f"Model: {info.model} (bfloat16).{info._kernels_sentence()} {info.commit_sentence()}")
    kernel_said = {True: " Native attention kernel: on.", False: " Native attention kernel: off (the PyTorch path).",
                   None: ""}[info.native_kernels]  # fmt: skip
    assert info._kernels_sentence() == kernel_said
