"""Every suite (the package's and the studies) renders from the committed results; the rendered docs/RESULTS.md
and the docs' generated sections equal the committed ones byte for byte."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.registry import SUITES
from benchmarks.render import (
    GENERATED_DOCS,
    blocks_of,
    fill_generated,
    generated_names,
    render_suites,
    results_markdown,
)
from polykv_agents.bench.registry import SUITES as PACKAGE_SUITES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """Every suite rendered from a copy of the committed results (rendering rewrites Markdown and plots), marked
    stale against this checkout's history: a change to measured code without re-rendering fails the tests below."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.stdout.strip() != "false":
        pytest.skip("needs a full git clone: the docs mark results whose code changed since their commit")
    results = tmp_path_factory.mktemp("results")
    shutil.copytree(RESULTS, results, dirs_exist_ok=True)
    return render_suites(results, ROOT)


def _docs() -> list[Path]:
    return [p for pattern in GENERATED_DOCS for p in sorted(ROOT.glob(pattern)) if p.name != "RESULTS.md"]


def test_every_suite_renders_from_the_committed_results(rendered):
    assert set(rendered) == set(SUITES)  # every suite has committed results, and renders them
    for name, suite in rendered.items():
        assert suite.results or suite.blocks, f"{name} renders nothing the docs include"


def test_rendered_results_md_is_byte_identical_to_the_committed_one(rendered):
    committed = (ROOT / "docs" / "RESULTS.md").read_bytes()
    assert results_markdown(rendered).encode("utf-8") == committed


def test_generated_doc_sections_are_current_and_every_block_is_used(rendered):
    blocks = blocks_of(rendered)
    used = []
    for doc in _docs():
        text = doc.read_text(encoding="utf-8")
        assert fill_generated(text, blocks, where=str(doc)) == text, f"{doc}: run python benchmarks/render_results.py"
        used += generated_names(text)
    assert sorted(used) == sorted(blocks), "a rendered block is in no doc, or in several"


def test_fill_generated_replaces_only_the_section_body_and_refuses_unknown_names():
    text = "a\n<!-- BEGIN generated: x -->\nold\n<!-- END generated: x -->\nb\n"
    assert fill_generated(text, {"x": "new\n"}) == "a\n<!-- BEGIN generated: x -->\nnew\n<!-- END generated: x -->\nb\n"
    with pytest.raises(ValueError, match="'x'"):
        fill_generated(text, {"y": "new"})


def test_each_section_names_the_command_that_runs_its_suite(rendered):
    """The package's suites run from the installed CLI; the studies from a checkout (`python -m benchmarks`)."""
    for name, suite in rendered.items():
        commands = [line for line in suite.results if line.startswith("Produced by `")]
        program = "polykv-agents bench" if name in PACKAGE_SUITES else "python -m benchmarks"
        assert all(line.startswith(f"Produced by `{program} {name}") for line in commands), (name, commands)
