"""The repository's benchmarks, beside the package and not installed with it: the studies that compare this
project with its peers or probe one of its design choices (:mod:`benchmarks.studies`), the registry of every
suite (:mod:`benchmarks.registry`: the package's own suites and the studies, in the order of docs/RESULTS.md),
their command line (``python -m benchmarks <suite>``, ``python -m benchmarks plan``) and the renderer of the docs
from the committed results (:mod:`benchmarks.render`, run by ``python benchmarks/render_results.py``).

Run from the repository root: some studies read its ``langgraph.json`` and ``graphs/``.
"""
