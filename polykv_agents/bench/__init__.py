"""Benchmarks behind ``polykv-agents bench``: every benchmark is a :class:`~.suite.Suite` (a module of its own,
listed in :mod:`.registry`) with a pydantic options model, ``run``, ``write`` and ``render``. The repository's
studies and the renderer of its docs live in its ``benchmarks/`` package (not installed)."""
