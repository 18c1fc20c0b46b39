"""Benchmarks behind ``polykv-agents bench``: every benchmark is a :class:`~.suite.Suite` (a module of its own,
listed in :mod:`.registry`) with a pydantic options model, ``run``, ``write`` and ``render``; :mod:`.render`
renders docs/RESULTS.md and the docs' generated sections from the committed results alone."""
