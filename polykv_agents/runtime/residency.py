"""Which residency the ``auto`` runtime gives a pool's shared prefix: the faster one for this model on this machine.

With the native kernel reading the pool as stored through AMX tiles, the ``compressed`` prefix decodes about as fast
as the decoded one, for one agent and for fifteen, holds only the pool, and starts a cold call sooner (no prefix to
decode). Without the tiles (no AMX, or not bfloat16) the kernel's vector path over the stored pool is several times
slower than PyTorch's fused attention over a decoded prefix for many agents: there the decoded prefix stays. Compiled
decode steps exist for the decoded prefix only, so an engine that compiles keeps it too. Measured side by side by
``python -m benchmarks.probes.residency``; docs/RUNTIME.md ("Attention over the pool as stored") has the figures.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from polykv_agents.pool.shared_pool import SharedKVPool
from polykv_agents.runtime.grouped_attention import tiles_available
from polykv_agents.runtime.shared_prefix import Residency
from polykv_agents.runtime.stored_prefix import has_stored_form

TILE_HEAD_DIM = 64
"""The tile path computes heads whose dim is a multiple of this."""


def reads_stored_pool_fast(model: PreTrainedModel, pool: SharedKVPool) -> bool:
    """Whether the kernel reads ``pool`` as stored through AMX tiles for ``model``: a bfloat16 model on the CPU, a
    head dim the tiles cover, codecs with a stored form (the default int8 keys and TurboQuant values), and a CPU and
    OS that give the tiles."""
    if model.device.type != "cpu" or model.dtype != torch.bfloat16 or pool.num_layers == 0:
        return False
    head_dim = pool.layers[0].keys.shape[-1]
    stored = all(has_stored_form(layer) for layer in pool.layers)
    return stored and head_dim % TILE_HEAD_DIM == 0 and tiles_available()


def auto_residency(model: PreTrainedModel, pool: SharedKVPool, *, compiled_steps: bool) -> Residency:
    """The residency ``runtime="auto"`` uses for ``pool``: ``compressed`` where the stored pool is read as fast
    (:func:`reads_stored_pool_fast`) and decode steps are not compiled, else ``decompressed``."""
    return "compressed" if not compiled_steps and reads_stored_pool_fast(model, pool) else "decompressed"
