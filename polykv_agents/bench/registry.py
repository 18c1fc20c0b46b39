"""Every benchmark suite, in the order docs/RESULTS.md shows them: the one list that
``polykv-agents bench``, ``benchmarks/render_results.py`` and ``benchmarks/run_all.sh`` read.

To add a benchmark: write ``polykv_agents/bench/<name>.py`` with its options, its ``run``, ``write`` and
``render`` and a module-level ``SUITE`` (see :class:`polykv_agents.bench.suite.Suite`), then add the
module here. Suite modules import their heavy dependencies (Ray, LangGraph, matplotlib) inside ``run``
and ``write``, so that listing them stays cheap.
"""

from __future__ import annotations

from polykv_agents.bench import (
    ablation,
    admission,
    agents,
    blocks,
    compiled,
    dtypes,
    frontier,
    grammar_overhead,
    graph_e2e,
    load_soak,
    memory,
    peer,
    peers,
    quality,
    ray_scale_out,
    reuse,
    speed,
    step_profile,
    tasks,
    weights,
)
from polykv_agents.bench.suite import Suite

_MODULES = (
    memory, quality, tasks, speed, dtypes, weights, compiled, step_profile, admission, reuse, blocks, ablation,
    frontier, peer, agents, graph_e2e, peers, load_soak, grammar_overhead, ray_scale_out,
)  # fmt: skip
SUITES: dict[str, Suite] = {module.SUITE.name: module.SUITE for module in _MODULES}
"""Suite name -> suite (a documented registry: filled once, here, never changed at run time)."""
