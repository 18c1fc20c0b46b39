"""Why the library runs its tensor work on one thread, measured: a forward's cost before and after a second
thread of the process has run tensor work of its own (see :mod:`polykv_agents.model.compute_thread`).

Each measurement runs in a fresh process, because the slow-down it shows lasts for the life of the process:

    python benchmarks/studies/openmp_teams.py REQUEST.json RESULT.json

The child loads the model (on the compute thread, as the library does), times one forward over ``[N, 1]``
tokens on the compute thread (median after a warm-up), runs one such forward on a second thread (which
starts a second OpenMP team) that then stays alive, idle, as an executor's threads do, and times the
compute thread's forward again. Request: ``{"model", "dtype",
"batch_size", "repetitions"}``; result: ``{"ms_one_team", "ms_after_second_team"}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.studies.side_process import run_side

TEAMS_SIDE = Path(__file__)


def team_rows(model: str | None, *, dtypes: Sequence[str], batch_sizes: Sequence[int], repetitions: int) -> list[dict]:
    """One ``kind="teams"`` row per (dtype, batch size), each measured in a fresh process."""
    rows = []
    for dtype in dtypes:
        for batch in batch_sizes:
            request = {"model": model, "dtype": dtype, "batch_size": batch, "repetitions": repetitions}
            rows.append({"kind": "teams", "dtype": dtype, "batch_size": batch, **_in_fresh_process(request)})
    return rows


def _in_fresh_process(request: dict, timeout_s: float = 900) -> dict:
    return run_side(TEAMS_SIDE, request, what="the OpenMP team measurement", timeout_s=timeout_s)


def main(request_path: str, result_path: str) -> None:
    import torch

    from polykv_agents.bench.stats import median_after_warmup
    from polykv_agents.engine import load_model
    from polykv_agents.model.compute_thread import run_on_compute_thread

    request = json.loads(Path(request_path).read_text())
    model, _ = load_model(request["model"], dtype=request["dtype"])
    ids = torch.ones(request["batch_size"], 1, dtype=torch.long)

    def forward_ms() -> float:
        with torch.inference_mode():  # grad mode is per thread: every thread here sets its own
            started = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            return 1000 * (time.perf_counter() - started)

    def on_compute_thread() -> float:
        return run_on_compute_thread(forward_ms)  # timed inside: the hand-over is not the forward's cost

    repetitions = request["repetitions"]
    one_team = median_after_warmup(repetitions, on_compute_thread)
    # The second thread stays alive, as an executor's or a server's threads do: a thread's team lives as
    # long as the thread, and libgomp counts its helpers until then.
    ran, done = threading.Event(), threading.Event()

    def second_thread() -> None:
        forward_ms()
        ran.set()
        done.wait()

    second = threading.Thread(target=second_thread, name="second-team", daemon=True)
    second.start()
    ran.wait()
    after = median_after_warmup(repetitions, on_compute_thread)
    done.set()
    second.join()
    Path(result_path).write_text(json.dumps({"ms_one_team": one_team, "ms_after_second_team": after}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
