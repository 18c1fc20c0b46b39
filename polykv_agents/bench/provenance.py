"""Which code produced a result: the git commit of the checkout the package runs from, and whether its
source had uncommitted changes.

Data flow: :func:`source_commit` asks git about the repository that holds the imported ``polykv_agents``
(an editable install or a checkout on ``sys.path``) -> :class:`~polykv_agents.bench.environment.RunInfo`
stores it with every result -> the renderer compares the suite's sources at that commit with the working
tree and marks a section whose code changed since as stale.

An installed wheel has no repository: then the commit is ``None`` and the package version says what ran.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel

import polykv_agents

GENERATED_PATHS = ("benchmarks/results", "benchmarks/journals", "docs", "README.md")
"""What a benchmark run itself writes or regenerates: changes there do not make the measured code dirty
(``benchmarks/run_all.sh`` runs one suite after another, each writing its results before the next starts)."""


class SourceCommit(NamedTuple):
    """HEAD's full hash, and whether tracked files other than :data:`GENERATED_PATHS` differ from it."""

    commit: str
    dirty: bool


class Provenance(BaseModel):
    """Which code produced a result; :class:`~polykv_agents.bench.environment.RunInfo` extends it."""

    package_version: str | None = None
    """``polykv_agents.__version__`` of the code that ran (``None``: recorded before it was)."""
    git_commit: str | None = None
    """The full hash of the checkout's HEAD when the suite ran; ``None``: not run from a git checkout."""
    dirty: bool | None = None
    """The checkout's code (everything but results and docs) had uncommitted changes; ``None``: unknown."""
    commit_source: Literal["recorded", "inferred"] = "recorded"
    """``inferred``: the result predates commit recording, and :attr:`git_commit` is the commit that brought
    its JSON into the repository (the code then is the nearest known to the code that ran)."""

    @classmethod
    @functools.cache
    def of_this_process(cls) -> Provenance:
        """The checkout as this process first asked (cached): the code it imported. A suite asks before it
        measures, so that edits made while it runs do not count as its code."""
        source = source_commit()
        return cls(package_version=polykv_agents.__version__, git_commit=source and source.commit,
                   dirty=source and source.dirty)  # fmt: skip

    def commit_sentence(self) -> str:
        """Which code ran, for captions: the short commit and whether it had uncommitted changes."""
        if self.git_commit is None:
            version = f" (polykv_agents {self.package_version})" if self.package_version else ""
            return f"Commit: unknown, not run from a git checkout{version}."
        short = self.git_commit[:10]
        if self.commit_source == "inferred":
            return f"Commit: {short} (inferred: the commit that added this JSON; the run predates commit recording)."
        changes = {True: ", with uncommitted changes", False: "", None: ", uncommitted changes unknown"}[self.dirty]
        return f"Commit: {short}{changes}."


def commit_sentences(records: Sequence[Provenance]) -> str:
    """The caption sentence of several runs: each distinct commit once, in order."""
    return " ".join(dict.fromkeys(record.commit_sentence() for record in records))


def repository_root() -> Path | None:
    """The root of the git checkout the imported package lives in; ``None`` for an installed wheel."""
    package_dir = Path(polykv_agents.__file__).resolve().parent
    root = _git(package_dir, "rev-parse", "--show-toplevel")
    if root is None:
        return None
    # A wheel installed into a virtualenv inside some checkout is not that checkout's code: the package
    # must be the checkout's own tracked polykv_agents/.
    if (Path(root) / "polykv_agents").resolve() != package_dir:
        return None
    return Path(root)


def source_commit(root: Path | None = None) -> SourceCommit | None:
    """HEAD and whether the measured code has uncommitted changes; ``None`` outside a checkout or without git."""
    root = root or repository_root()
    if root is None:
        return None
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return None
    excluded = [f":(exclude){path}" for path in GENERATED_PATHS]
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    return SourceCommit(commit=commit, dirty=bool(status))


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine: the result says commit unknown
        return None
    return done.stdout.strip() if done.returncode == 0 else None
