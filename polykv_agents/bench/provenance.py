"""Which code produced a result: the git commit of the checkout the package runs from, and whether its
source had uncommitted changes.

Data flow: :func:`source_commit` asks git about the repository that holds the imported ``polykv_agents``
(an editable install or a checkout on ``sys.path``) -> :class:`~polykv_agents.bench.environment.RunInfo`
stores it with every result -> the renderer compares the suite's sources at that commit with the working
tree and marks a section whose code changed since as stale.

An installed wheel has no repository: then the commit is ``None`` and the package version says what ran.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

import polykv_agents

GENERATED_PATHS = ("benchmarks/results", "benchmarks/journals", "docs", "README.md")
"""What a benchmark run itself writes or regenerates: changes there do not make the measured code dirty
(``benchmarks/run_all.sh`` runs one suite after another, each writing its results before the next starts)."""


class SourceCommit(NamedTuple):
    commit: str
    """The full hash of HEAD."""
    dirty: bool
    """Tracked files other than :data:`GENERATED_PATHS` differ from HEAD."""


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
