"""Where a model runs. ``device="auto"`` picks CUDA, then Apple's MPS, then the CPU.

A device this torch build or machine does not have is refused here, with what to do, before anything is
loaded: otherwise the first tensor moved there fails deep inside torch (``device="cuda"`` on a CPU-only
build raised a bare ``AssertionError: Torch not compiled with CUDA enabled``).
"""

from __future__ import annotations

import torch

AUTO = "auto"


class DeviceNotAvailableError(ValueError):
    """The asked device does not exist in this process (no such hardware, or a torch build without it)."""


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return backend is not None and backend.is_available()


def auto_device() -> str:
    """What ``auto`` means here: ``cuda`` if torch sees a GPU, else ``mps``, else ``cpu``."""
    if torch.cuda.is_available():
        return "cuda"
    if _mps_available():
        return "mps"
    return "cpu"


def resolve_device(device: str | torch.device) -> str:
    """A device name this process can use: ``auto`` resolved, the others checked.

    Raises:
        DeviceNotAvailableError: An unknown name, or a device this machine or torch build lacks; the message
            says which device would work.
    """
    if isinstance(device, str) and device.strip().lower() == AUTO:
        return auto_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        msg = f"device={device!r} is not a device name; use 'auto', 'cpu', 'cuda', 'cuda:1', 'mps', ..."
        raise DeviceNotAvailableError(msg) from e
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "torch sees no CUDA GPU"
            msg = f"device={device!r} is not available: {build}. Use device='cpu', or 'auto' (here: {auto_device()!r})"
            raise DeviceNotAvailableError(msg)
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            msg = f"device={device!r} is not available: torch sees {torch.cuda.device_count()} CUDA GPU(s)"
            raise DeviceNotAvailableError(msg)
    elif parsed.type == "mps" and not _mps_available():
        msg = (
            f"device={device!r} is not available on this machine. Use device='cpu', or 'auto' (here: {auto_device()!r})"
        )
        raise DeviceNotAvailableError(msg)
    return str(parsed)
