"""What every benchmark figure states: the machine, the software, the model and its dtype, and the commit
of the code that measured it."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Literal

import torch
import transformers
from pydantic import BaseModel

import polykv_agents
from polykv_agents.bench.provenance import source_commit


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class RunInfo(BaseModel):
    """Where and with what a suite ran."""

    machine: str
    cpu: str
    cpu_count: int
    torch_threads: int
    device: str
    torch: str
    transformers: str
    python: str
    model: str
    dtype: str
    date: str
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
    def collect(cls, model) -> RunInfo:
        source = source_commit()
        return cls(
            machine=f"{platform.system()} {platform.machine()}",
            cpu=_cpu_name(),
            cpu_count=os.cpu_count() or 0,
            torch_threads=torch.get_num_threads(),
            device=str(model.device),
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            model=str(getattr(model.config, "name_or_path", "") or type(model).__name__).split("/")[-1],
            dtype=str(model.dtype).removeprefix("torch."),
            date=datetime.date.today().isoformat(),
            package_version=polykv_agents.__version__,
            git_commit=source.commit if source else None,
            dirty=source.dirty if source else None,
        )

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

    def sentence(self) -> str:
        """One line for captions: machine, model and dtype."""
        return (
            f"{self.machine}, {self.cpu_count} cores ({self.torch_threads} torch threads), {self.device}; "
            f"{self.model}, {self.dtype}; torch {self.torch}, transformers {self.transformers}"
        )

    def machine_and_model(self) -> str:
        """The two sentences that open a Markdown caption: the machine and software, then the model and dtype."""
        threads = f"{self.torch_threads} torch thread{'s' if self.torch_threads != 1 else ''}"
        machine = f"Machine: {self.machine}, {self.cpu}, {threads}, torch {self.torch}."
        return f"{machine} Model: {self.model} ({self.dtype}). {self.commit_sentence()}"
