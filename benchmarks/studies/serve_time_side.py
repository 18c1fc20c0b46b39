"""One (N, mode) of ``bench serve``, with the compute thread's timeline (``python -m benchmarks serve_time``), in a
fresh process of its own:

    python benchmarks/studies/serve_time_side.py REQUEST.json RESULT.json

Request: a serve worker's (:func:`polykv_agents.bench.serve.worker_request`; mode ``at_once`` or
``one_after_another``). Result: the serve worker's own result (per workflow latency, TTFT and output tokens; wall
time; peak RSS) and ``"time"``, where the compute thread's time went during the measured wall time
(:func:`benchmarks.studies.compute_timeline.where_time_goes`). The warm-up workflow the worker runs first is
outside that window.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def measure_with_timeline(request: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.studies.compute_timeline import ComputeTimeline, where_time_goes
    from polykv_agents.bench.serve_worker import measure

    if request["mode"] == "server":
        msg = "serve_time times this process's compute thread: the server mode's engine runs in another process"
        raise ValueError(msg)
    with ComputeTimeline() as timeline:
        result = measure(request)
        # The measured runs are the last wall_s seconds before measure returned (it then reads only VmHWM).
        end = time.perf_counter()
    return {**result, "time": where_time_goes(timeline.jobs, end - result["wall_s"], end)}


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    Path(result_path).write_text(json.dumps(measure_with_timeline(request)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
