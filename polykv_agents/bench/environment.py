"""What every benchmark figure states: the machine, the software, the model and its dtype, and the commit
of the code that measured it."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import torch
import transformers

from polykv_agents.bench.provenance import Provenance
from polykv_agents.kernels import native_kernel


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class RunInfo(Provenance):
    """Where and with what a suite ran, and which code (:class:`Provenance`)."""

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
    native_kernels: bool | None = None
    """Whether the native attention kernel served: a CPU model, the kernel built and not switched off by
    ``POLYKV_AGENTS_KERNELS=0``; ``None``: recorded before the kernel existed."""

    @classmethod
    def collect(cls, model) -> RunInfo:
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
            native_kernels=model.device.type == "cpu" and native_kernel("grouped_attention") is not None,
            **Provenance.of_this_process().model_dump(),
        )

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
        return f"{machine} Model: {self.model} ({self.dtype}).{self._kernels_sentence()} {self.commit_sentence()}"

    def _kernels_sentence(self) -> str:
        if self.native_kernels is None:
            return ""  # recorded before the native kernel existed
        return " Native attention kernel: " + ("on." if self.native_kernels else "off (the PyTorch path).")
