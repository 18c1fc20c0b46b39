"""Is a committed result still the output of the code in this checkout? A suite's figures are stale when a
file it measures changed after the commit its JSON names.

Data flow: a suite's rendered results carry the :class:`~polykv_agents.bench.provenance.Provenance` of each
run -> :func:`changed_sources` lists the files matched by the suite's :data:`SUITE_SOURCES` whose content in
the working tree is not in that commit's tree (by git blob hash, so a file moved unchanged still counts as
the same) -> :func:`stale_note` words the mark the docs print under the section.

Content is compared with the working tree, not with HEAD: the docs rendered just before a commit then equal
the docs rendered from that commit, and a commit that changes measured code without re-rendering makes the
render test fail (its committed docs lack the mark the renderer now prints).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import subprocess
from collections.abc import Sequence
from pathlib import Path

from polykv_agents.bench.provenance import Provenance

_CORE = ("polykv_agents/codecs/**", "polykv_agents/pool/**", "polykv_agents/config.py")
"""The compression itself: every suite measures it."""
_RUNTIME = (
    *_CORE, "polykv_agents/runtime/**", "polykv_agents/kernels/**", "polykv_agents/model/**",
    "polykv_agents/sampling/**", "polykv_agents/agent.py", "polykv_agents/engine*.py",
)  # fmt: skip
"""Decoding: what timings and generated answers depend on."""
_GRAPH = (*_RUNTIME, "polykv_agents/chat/**", "polykv_agents/graph/**", "polykv_agents/prompting/**", "graphs/**")
"""The LangChain and LangGraph layer over the runtime."""

SUITE_SOURCES: dict[str, tuple[str, ...]] = {
    "memory": (*_RUNTIME, "polykv_agents/bench/memory.py"),  # the default runtime's residency decides its KV
    "quality": (*_CORE, "polykv_agents/eval/**", "polykv_agents/bench/quality.py"),
    "tasks": (*_RUNTIME, "polykv_agents/eval/**", "polykv_agents/prompting/**", "polykv_agents/bench/tasks.py"),
    "speed": (*_RUNTIME, "polykv_agents/bench/speed.py"),
    "agents": (*_RUNTIME, "polykv_agents/bench/agents.py"),
    "dtype": (*_RUNTIME, "benchmarks/studies/dtypes.py"),
    "weights": (*_RUNTIME, "benchmarks/studies/weights.py"),
    "compile": (*_RUNTIME, "benchmarks/studies/compiled.py"),
    "profile": (*_RUNTIME, "benchmarks/studies/step_profile.py"),
    "shared_step_profile": (
        *_RUNTIME,
        "benchmarks/studies/shared_step_profile.py",
        "benchmarks/studies/step_profile.py",
        "benchmarks/studies/crew.py",
    ),
    "admission": (*_RUNTIME, "benchmarks/studies/admission.py"),
    "reuse": (*_RUNTIME, "benchmarks/studies/reuse.py"),
    "blocks": (*_GRAPH, "benchmarks/studies/blocks.py"),
    "ablation": (*_CORE, "polykv_agents/eval/**", "benchmarks/studies/ablation.py"),
    "frontier": (*_CORE, "polykv_agents/eval/**", "benchmarks/studies/frontier.py"),
    "peer": (*_CORE, "polykv_agents/eval/**", "benchmarks/studies/peer*.py"),
    "graph_e2e": (*_GRAPH, "benchmarks/studies/graph_e2e.py"),
    "peers": (
        *_GRAPH,
        "benchmarks/studies/peers.py",
        "benchmarks/studies/llama*.py",
        "benchmarks/studies/ours_side.py",
        "benchmarks/studies/side_process.py",
        "benchmarks/studies/graph_e2e.py",
    ),
    "serve": (*_GRAPH, "polykv_agents/bench/serve*.py"),
    "serve_peers": (
        *_GRAPH,
        "polykv_agents/bench/serve*.py",
        "benchmarks/studies/serve_peers.py",
        "benchmarks/studies/serve_record_side.py",
        "benchmarks/studies/llama*.py",
        "benchmarks/studies/recording.py",
        "benchmarks/studies/side_process.py",
    ),
    "serve_time": (
        *_GRAPH,
        "polykv_agents/bench/serve*.py",
        "benchmarks/studies/serve_time*.py",
        "benchmarks/studies/compute_timeline.py",
        "benchmarks/studies/side_process.py",
    ),
    "load_soak": (*_GRAPH, "benchmarks/studies/load*.py", "benchmarks/studies/soak.py"),
    "grammar_overhead": (*_GRAPH, "benchmarks/studies/grammar_overhead.py"),
    "ray_scale_out": (*_GRAPH, "polykv_agents/distributed/**", "benchmarks/studies/ray_scale_out.py"),
    "sizes": (
        *_GRAPH,
        "benchmarks/studies/sizes.py",
        "benchmarks/studies/peers.py",  # its row functions make our rows' medians
        "benchmarks/studies/ours_side.py",
        "benchmarks/studies/graph_e2e.py",
        "benchmarks/studies/side_process.py",
        "benchmarks/studies/llama_server.py",  # a server row measured with our rows (--peers-from, --llama-server)
        "benchmarks/real_shapes.py",
    ),
    # Rows borrowed from an earlier run (--peers-from): llama.cpp's processes replaying recorded calls, on files
    # made from the same model folder. Our package is not among them: it changes what is replayed, not the work.
    "sizes.peers": ("benchmarks/studies/llama*.py", "benchmarks/studies/side_process.py", "benchmarks/real_shapes.py"),
}
"""Suite name -> the files whose code its figures depend on, as :mod:`fnmatch` patterns over paths from the
repository root (``*`` crosses folders) (a documented registry: filled here, never changed at run time)."""


def blob_hash(path: Path) -> str:
    """git's object id of the file's bytes (``git hash-object``)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@functools.cache
def _blobs_at(root: Path, commit: str) -> frozenset[str] | None:
    """Every blob in ``commit``'s tree; ``None`` when this clone does not have the commit."""
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--format=%(objectname)", commit],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip
    return frozenset(listing.stdout.split()) if listing.returncode == 0 else None


def _tracked(root: Path) -> list[str]:
    """Tracked files and new ones not yet added (but not ignored): the files the next commit will hold, so that
    docs rendered before ``git add`` equal the docs rendered from the commit."""
    command = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, check=True).stdout.split("\n")


def changed_sources(root: Path, commit: str, patterns: Sequence[str]) -> list[str] | None:
    """The tracked files matched by ``patterns`` whose content is in no file of ``commit``'s tree (sorted);
    ``None`` when the commit is not in this clone."""
    blobs = _blobs_at(root, commit)
    if blobs is None:
        return None
    matched = {path for path in _tracked(root) if path and any(fnmatch.fnmatchcase(path, p) for p in patterns)}
    return sorted(p for p in matched if (root / p).is_file() and blob_hash(root / p) not in blobs)


def stale_note(root: Path, suite: str, runs: Sequence[Provenance]) -> str | None:
    """One Markdown line saying why the suite's figures may not be this code's, or ``None`` when every run's
    commit is known and none of the suite's sources changed since."""
    patterns = SUITE_SOURCES.get(suite)
    if patterns is None:
        msg = f"suite {suite!r} names no sources in benchmarks/staleness.py SUITE_SOURCES: add them"
        raise KeyError(msg)
    commits = sorted({run.git_commit for run in runs if run.git_commit})
    if not runs or any(run.git_commit is None for run in runs):
        return "**Stale?** A run behind this section names no commit: which code it measured is unknown."
    changed: set[str] = set()
    for commit in commits:
        files = changed_sources(root, commit, patterns)
        if files is None:
            return f"**Stale?** Commit {commit[:10]} is not in this clone's history: re-run to tie it to this code."
        changed |= set(files)
    if not changed:
        return None
    shown = ", ".join(f"`{path}`" for path in sorted(changed)[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    at = ", ".join(c[:10] for c in commits)
    return f"**Stale:** measured at {at}; {len(changed)} file(s) it measures changed since: {shown}{more}."
