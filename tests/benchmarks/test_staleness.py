"""A rendered section says when the code it measured changed after its runs' commit."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.registry import SUITES
from benchmarks.render import mark_stale
from benchmarks.staleness import SUITE_SOURCES, changed_sources, stale_note
from polykv_agents.bench.provenance import Provenance
from polykv_agents.bench.suite import Rendered

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _commit(root, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return _git(root, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "polykv_agents" / "codecs").mkdir(parents=True)
    (tmp_path / "polykv_agents" / "codecs" / "int8.py").write_text("BITS = 8\n")
    (tmp_path / "polykv_agents" / "other.py").write_text("unrelated = True\n")
    return tmp_path, _commit(tmp_path, "measured here")


def _run(commit: str | None) -> Provenance:
    return Provenance(git_commit=commit, dirty=False)


def test_unchanged_sources_are_not_stale(repo):
    root, commit = repo
    (root / "polykv_agents" / "other.py").write_text("unrelated = False\n")  # not a memory source
    assert stale_note(root, "memory", [_run(commit)]) is None


def test_a_changed_source_is_named(repo):
    root, commit = repo
    (root / "polykv_agents" / "codecs" / "int8.py").write_text("BITS = 7\n")
    note = stale_note(root, "memory", [_run(commit)])
    assert note is not None and note.startswith("**Stale:**") and "`polykv_agents/codecs/int8.py`" in note


def test_a_file_moved_unchanged_is_the_same_code(repo):
    root, commit = repo
    _git(root, "mv", "polykv_agents/codecs/int8.py", "polykv_agents/codecs/keys.py")
    _commit(root, "moved")
    assert changed_sources(root, commit, SUITE_SOURCES["memory"]) == []


def test_runs_without_a_known_commit_are_flagged(repo):
    root, _ = repo
    assert "names no commit" in stale_note(root, "memory", [_run(None)])
    assert "not in this clone" in stale_note(root, "memory", [_run("0" * 40)])


def test_every_suite_names_its_sources():
    assert set(SUITES) <= set(SUITE_SOURCES)


def test_the_mark_goes_under_the_command_and_above_each_block():
    rendered = Rendered(results=["## Speed", "", "Produced by `x`.", "table"], blocks={"speed": "figures"})
    marked = mark_stale(rendered, "**Stale:** why")
    assert marked.results == ["## Speed", "", "Produced by `x`.", "", "**Stale:** why", "table"]
    assert marked.blocks == {"speed": "**Stale:** why\n\nfigures"}
    assert mark_stale(rendered, None) is rendered


def test_a_part_borrowed_from_an_earlier_run_is_checked_against_its_own_sources(repo):
    from benchmarks.render import suite_stale_note

    root, _ = repo
    side = root / "benchmarks" / "studies" / "llamacpp_side.py"
    side.parent.mkdir(parents=True)
    side.write_text("REPLAY = 1\n")
    earlier = _commit(root, "the peers' rows measured here")
    (root / "polykv_agents" / "codecs" / "int8.py").write_text("BITS = 7\n")  # our code, not the peers'
    later = _commit(root, "our rows measured here")
    rendered = Rendered(provenance=[_run(later)], parts={"peers": [_run(earlier)]})
    assert suite_stale_note(root, "sizes", rendered) is None
    assert suite_stale_note(root, "sizes", Rendered(provenance=[_run(earlier)])) is not None  # ours would be stale
    side.write_text("REPLAY = 2\n")
    note = suite_stale_note(root, "sizes", rendered)
    assert note is not None and "`benchmarks/studies/llamacpp_side.py`" in note and note.endswith("(its peers rows).")
