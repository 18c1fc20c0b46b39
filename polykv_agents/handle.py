"""Compatibility path of :class:`~polykv_agents.pool.handle.PoolHandle`.

LangGraph checkpoints written before 0.2 name the class by this module path; keeping it importable
lets those threads resume. New code imports it from :mod:`polykv_agents.pool` (or the package root).
"""

from __future__ import annotations

from polykv_agents.pool.handle import PoolHandle

__all__ = ["PoolHandle"]
