"""Render docs/RESULTS.md and the generated sections of README.md and docs/*.md from benchmarks/results/.

    python benchmarks/render_results.py

Measures nothing: every registered suite (``polykv_agents.bench.registry``) reads its JSON, rewrites its
Markdown and plots, and returns what the docs include (``polykv_agents.bench.render``).
"""

from __future__ import annotations

from pathlib import Path

from polykv_agents.bench.render import render_docs

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    changed = render_docs(ROOT)
    print("\n".join(f"wrote {path.relative_to(ROOT)}" for path in changed) or "docs up to date")
