"""The serving time study: the compute thread's jobs are each recorded once, named, clipped to the measured window,
and a served run's steps account for every token its workflows decoded."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.studies import serve_time
from benchmarks.studies.compute_timeline import ComputeTimeline, Job, where_time_goes
from benchmarks.studies.serve_time_side import measure_with_timeline
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import SuiteResult
from polykv_agents.model import compute_thread
from polykv_agents.model.compute_thread import run_on_compute_thread
from polykv_agents.runtime.admission import Admission
from polykv_agents.runtime.scheduler import BatchScheduler

GRAPHS = Path(__file__).resolve().parents[3] / "langgraph.json"


def _outer() -> int:
    return run_on_compute_thread(_inner) + 1  # from the compute thread: runs inline, part of this job


def _inner() -> int:
    return 41


def test_a_job_is_recorded_once_by_its_name_and_the_library_is_restored_after():
    chunk, emit = Admission.chunk, BatchScheduler._emit
    with ComputeTimeline() as timeline:
        assert run_on_compute_thread(_outer) == 42
    (job,) = timeline.jobs
    assert job.label == "_outer" and job.end >= job.start
    assert "run" not in vars(compute_thread._COMPUTE)  # the method again, not the wrapper
    assert Admission.chunk is chunk and BatchScheduler._emit is emit
    run_on_compute_thread(_outer)
    assert len(timeline.jobs) == 1  # nothing is recorded once it is left


def test_jobs_are_clipped_to_the_window_and_summed_by_kind():
    jobs = [
        Job(start=0.0, end=2.0, label="document prefill"),
        Job(start=2.0, end=3.0, label="step", prompt_tokens=30, sampled_tokens=2),
        Job(start=3.5, end=4.0, label="step", sampled_tokens=4),
        Job(start=4.0, end=9.0, label="step", sampled_tokens=4),
    ]
    time = where_time_goes(jobs, start=1.0, end=5.0)
    assert time["kinds"]["document prefill"]["seconds"] == pytest.approx(1.0)
    assert time["kinds"]["prompt steps"] == {"seconds": 1.0, "jobs": 1, "prompt_tokens": 30, "sampled_tokens": 2}
    assert time["kinds"]["decode steps"]["seconds"] == pytest.approx(1.5)
    assert time["kinds"]["decode steps"]["sampled_tokens"] == 8
    assert time["busy_s"] == pytest.approx(3.5) and time["idle_s"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["at_once", "one_after_another"])
def test_a_served_runs_steps_account_for_every_token_its_workflows_decoded(tiny_model_dir, mode):
    # Texts of its own: a pool this process built for another test would not be prefilled again.
    request = {
        "mode": mode, "graph": "document_review", "graphs": str(GRAPHS),
        "texts": [f"{mode} alpha beta gamma " * 20, f"{mode} one two three " * 20], "context": 32, "roles": 2,
        "max_tokens": 3, "model": tiny_model_dir,
    }  # fmt: skip
    measured = measure_with_timeline(request)
    time = measured["time"]
    kinds = time["kinds"]
    assert kinds["document prefill"]["seconds"] > 0 and kinds["pool compression"]["seconds"] > 0
    assert kinds["prompt steps"]["prompt_tokens"] > 0 and kinds["decode steps"]["jobs"] > 0
    sampled = sum(figures["sampled_tokens"] for figures in kinds.values())
    # Within a token or two, not exactly: a step that straddles the window's edge counts whole (the warm-up's last
    # can still be finishing after its workflow returned), and a call's consumer can stop before its last token.
    assert sampled == pytest.approx(sum(run["output_tokens"] for run in measured["runs"]), abs=2)
    assert time["busy_s"] + time["idle_s"] == pytest.approx(measured["wall_s"])
    assert 0 < time["busy_s"] <= measured["wall_s"]


def test_the_server_mode_is_refused_with_what_to_run_instead():
    with pytest.raises(ValueError, match="not one of"):
        serve_time.ServeTimeOptions(modes=["server"])


def _row(workflows: int, mode: str, wall: float = 10.0) -> dict:
    time = {
        "wall_s": wall, "busy_s": wall - 1.0, "idle_s": 1.0,
        "kinds": {
            "document prefill": {"seconds": 3.0, "jobs": 4, "prompt_tokens": 0, "sampled_tokens": 0},
            "prompt steps": {"seconds": 2.0, "jobs": 5, "prompt_tokens": 1000, "sampled_tokens": 10},
            "decode steps": {"seconds": 4.0, "jobs": 8, "prompt_tokens": 0, "sampled_tokens": 120},
        },
    }  # fmt: skip
    return {
        "workflows": workflows, "mode": mode, "wall_s": wall, "output_tokens": 130, "aggregate_tok_s": 130 / wall,
        "latency_p50_s": 10.0, "latency_p95_s": 10.0, "ttft_p50_s": 1.0, "ttft_p95_s": 1.0, "rss_peak_bytes": 2**30,
        "runs": [], "time": time,
    }  # fmt: skip


def test_the_table_splits_each_run_and_the_block_shows_the_runs_at_once(tmp_path):
    info = RunInfo(
        machine="Linux x86_64", cpu="cpu", cpu_count=2, torch_threads=2, device="cpu", torch="2", transformers="5",
        python="3.11", model="m", dtype="bfloat16", date="2026-12-06",
    )  # fmt: skip
    rows = [_row(2, "at_once"), _row(2, "one_after_another", wall=20.0)]
    settings = {"context": 2048, "roles": 15, "max_tokens": 32, "graph": "document_review"}
    result = SuiteResult(suite="serve_time", info=info, settings=settings, rows=rows, summary=serve_time.shares(rows))
    assert result.summary["at_once_2_prefill_share"] == pytest.approx(0.5)
    assert result.summary["at_once_2_decode_tok_s"] == pytest.approx(30.0)
    serve_time.write_serve_time(result, tmp_path)
    table = (tmp_path / "serve_time.md").read_text()
    assert "| 2 | in process, at once | 10.0 s | 13.0 | 3.0 s | 2.0 s: 1,000 tok, 500 tok/s, 200.0/step |" in table
    assert "4.0 s: 120 tok, 30 tok/s, 15.0/step | 1.0 s | 1,024 MiB |" in table
    block = serve_time.langgraph_block(result)["serve_time"]
    assert block.count("\n| 2 |") == 1 and "| 2 | 20.0 s |" not in block  # the run at once only
    assert "| 2 | 10.0 s | 5.0 s (50%) | 4.0 s (40%) | 30 | 15.0 |" in block
