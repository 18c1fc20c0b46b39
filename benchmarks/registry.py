"""Every benchmark suite, in the order docs/RESULTS.md shows them: the package's own
(:data:`polykv_agents.bench.registry.SUITES`, what ``polykv-agents bench`` offers) and the repository's studies.
``python -m benchmarks``, ``benchmarks/render_results.py`` and ``benchmarks/run_all.sh`` read this list.

To add a study: write ``benchmarks/studies/<name>.py`` with its options, its ``run``, ``write`` and ``render``
and a module-level ``SUITE`` (see :class:`polykv_agents.bench.suite.Suite`) whose command is
``python -m benchmarks <name>``, then add the module here.
"""

from __future__ import annotations

from benchmarks.studies import (
    ablation,
    admission,
    blocks,
    compiled,
    dtypes,
    frontier,
    grammar_overhead,
    graph_e2e,
    load_soak,
    peer,
    peers,
    ray_scale_out,
    reuse,
    serve_peers,
    serve_time,
    shared_step_profile,
    sizes,
    step_profile,
    weights,
)
from polykv_agents.bench import agents, memory, quality, serve, speed, tasks
from polykv_agents.bench.registry import SUITES as PACKAGE_SUITES
from polykv_agents.bench.suite import Suite

_MODULES = (
    memory, quality, tasks, speed, dtypes, weights, compiled, step_profile, shared_step_profile, admission, reuse,
    blocks, ablation, frontier, peer, agents, graph_e2e, peers, sizes, serve, serve_peers, serve_time, load_soak,
    grammar_overhead, ray_scale_out,
)  # fmt: skip
SUITES: dict[str, Suite] = {module.SUITE.name: module.SUITE for module in _MODULES}
"""Suite name -> suite (a documented registry: filled once, here, never changed at run time)."""

assert PACKAGE_SUITES.items() <= SUITES.items(), "a suite of the package is missing from benchmarks/registry.py"
