"""Render docs/RESULTS.md and the generated sections of README.md and docs/*.md from benchmarks/results/.

    python benchmarks/render_results.py

Measures nothing: every registered suite (``benchmarks/registry.py``) reads its JSON, rewrites its Markdown and
plots, and returns what the docs include (``benchmarks/render.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# A script's import path starts at its own folder; `benchmarks` is a package of the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.render import render_docs

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    changed = render_docs(ROOT)
    print("\n".join(f"wrote {path.relative_to(ROOT)}" for path in changed) or "docs up to date")
