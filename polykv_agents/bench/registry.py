"""The package's benchmark suites, in the order docs/RESULTS.md shows them: what ``polykv-agents bench`` offers.
They measure a user's own model and deployment (memory, quality, tasks, speed, agents, serve).

The repository's studies (peers, ablations, probes of one design choice) live in its ``benchmarks/`` package, which
is not installed; ``benchmarks/registry.py`` lists them with these, and ``python -m benchmarks``,
``benchmarks/render_results.py`` and ``benchmarks/run_all.sh`` read that list.

To add a suite: write ``polykv_agents/bench/<name>.py`` with its options, its ``run``, ``write`` and ``render``
and a module-level ``SUITE`` (see :class:`polykv_agents.bench.suite.Suite`), then add the module here and to
``benchmarks/registry.py``. Suite modules import their heavy dependencies (matplotlib, scipy) inside ``run``
and ``write``, so that listing them stays cheap.
"""

from __future__ import annotations

from polykv_agents.bench import agents, memory, quality, serve, speed, tasks
from polykv_agents.bench.suite import Suite

SUITES: dict[str, Suite] = {
    module.SUITE.name: module.SUITE for module in (memory, quality, tasks, speed, agents, serve)
}
"""Suite name -> suite (a documented registry: filled once, here, never changed at run time)."""
