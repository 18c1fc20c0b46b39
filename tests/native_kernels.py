"""Tests of the native kernels: where they must build, and where a missing toolchain only skips."""

from __future__ import annotations

import os

import pytest

from polykv_agents.kernels import native_kernel


def require_native_kernel(name: str) -> None:
    """Skip a test of the native kernel ``name`` where it cannot be built; on CI (g++ and ninja) fail instead."""
    if native_kernel(name) is None:
        if os.environ.get("CI"):
            pytest.fail(f"the native {name} kernel did not build on CI, which has g++ and ninja")
        pytest.skip(f"no C++ toolchain for the native {name} kernel: the PyTorch path serves")
