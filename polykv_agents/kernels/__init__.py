"""Native CPU kernels, compiled on first use with torch's ``cpp_extension`` (g++ and ninja), each with a pure-PyTorch
path that is used wherever the kernel cannot be built or is switched off.

``grouped_attention``: cascade attention for several groups of rows in one call. A step that serves several pools
(:mod:`polykv_agents.runtime.model_steps`) has one group per pool; in PyTorch each group costs about 170 small
operations per layer (the prefix part, the suffix part, the log-sum-exp merge, their masks and casts), and the
fused CPU attention kernel, made for long query blocks, is slow for the few queries per kv head a decode step has
(``python -m benchmarks serve_time`` and ``profile`` measured both). The kernel reads each group's prefix once
per kv head for all of that group's queries, in chunks spread over the threads, and merges each query's parts in
a fixed order, so a row's result does not depend on which other groups share its step.

``int8_linear``: the product of bfloat16 rows with int8 weights on AMX tiles, reading each weight once for all rows
(:mod:`polykv_agents.model.int8_tiles`), and of float32 rows with the same weights on AVX-512 or AVX2 vectors (its
vector path, ``int8_vectors.h``); where neither runs, ``weights="int8"`` keeps PyTorch's int8 kernel.

Set ``POLYKV_AGENTS_KERNELS=0`` to use the PyTorch path only, ``POLYKV_AGENTS_TILES=0`` to keep the kernels but not
their AMX tile products (then ``runtime="auto"`` keeps a decoded prefix, :mod:`polykv_agents.runtime.residency`,
and int8 weights keep PyTorch's kernel).
The first use builds the kernel once into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default under the
user's cache directory): about 30 s on 2 cores, announced as a warning on the ``polykv_agents.kernels`` logger
while it runs; a build that fails is logged once and the PyTorch path is used.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SWITCH = "POLYKV_AGENTS_KERNELS"
"""Environment variable: ``0`` (or ``off``, ``false``) keeps every kernel off."""

_SOURCES = Path(__file__).parent
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

BUILD_NOTICE_SECONDS = 3.0
"""A kernel's load that takes longer than this is a build: it is then announced on the logger (once)."""
_BUILDING = "building the native kernel %r once (about 30 s on 2 cores; cached for later runs)"

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


TILES_SWITCH = "POLYKV_AGENTS_TILES"
"""Environment variable: ``0`` (or ``off``, ``false``) keeps the kernels' AMX tile products off, the vector path on."""


def switched_on(variable: str) -> bool:
    """Whether the switch ``variable`` is on: unset, or anything but ``0``/``off``/``false``/``no``."""
    return os.environ.get(variable, "1").strip().lower() not in {"0", "off", "false", "no"}


def kernel_tiles_available(name: str) -> bool:
    """Whether the kernel ``name`` is built and multiplies on AMX tiles here (its ``tiles_available()``: a build
    for a CPU with AMX, tiles granted by the OS), and ``POLYKV_AGENTS_TILES`` does not switch them off."""
    if not switched_on(TILES_SWITCH):
        return False
    kernel = native_kernel(name)
    return kernel is not None and kernel.tiles_available()


def kernels_enabled() -> bool:
    """Whether native kernels may be used (``POLYKV_AGENTS_KERNELS`` is not ``0``/``off``/``false``)."""
    return switched_on(SWITCH)


def _build(name: str) -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load, verify_ninja_availability

        verify_ninja_availability()
    except Exception as e:  # no ninja, or a torch without cpp_extension: the PyTorch path serves
        logger.warning("native kernel %r not available (%s); using the PyTorch path", name, e)
        return None
    # Loading a kernel built before takes well under a second; only a build (the first use, or new sources) is
    # announced, once it is clearly under way, so that a first call's wait is explained.
    notice = threading.Timer(BUILD_NOTICE_SECONDS, logger.warning, (_BUILDING, name))
    notice.daemon = True
    notice.start()
    try:
        return load(f"polykv_{name}", [str(_SOURCES / f"{name}.cpp")], extra_cflags=_FLAGS, verbose=False)
    except Exception as e:  # no compiler, or one that rejects the flags: the PyTorch path serves
        logger.warning("native kernel %r failed to build (%s); using the PyTorch path", name, e)
        return None
    finally:
        notice.cancel()


def build_for_instructions(name: str, flags: list[str]) -> ModuleType:
    """The kernel ``name`` built again with extra compiler ``flags`` (say ``-mno-avx512f``: what a CPU with AVX2 only
    runs), as its own module beside the usual one: how tests and probes check and time another CPU's path here.

    Raises:
        RuntimeError: No toolchain, or a build that fails (the message says why).
    """
    from torch.utils.cpp_extension import load

    suffix = "".join(c if c.isalnum() else "_" for c in "".join(flags))
    return load(f"polykv_{name}_{suffix}", [str(_SOURCES / f"{name}.cpp")], extra_cflags=[*_FLAGS, *flags])


def native_kernel(name: str) -> ModuleType | None:
    """The compiled module of the kernel ``name`` (``polykv_agents/kernels/<name>.cpp``), built on first use;
    ``None`` where kernels are switched off or it cannot be built (then the caller's PyTorch path serves)."""
    if not kernels_enabled():
        return None
    if name not in _loaded:
        with _lock:
            if name not in _loaded:
                _loaded[name] = _build(name)
    return _loaded[name]
