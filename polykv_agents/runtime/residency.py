"""Which residency the ``auto`` runtime gives a pool's shared prefix: the faster one for this model on this machine.

Measured on an Intel Xeon VM with AMX (2 cores, SmolLM2-135M in bfloat16, a 4,096-token document; commands in
docs/RUNTIME.md): with the native kernel reading the pool as stored through AMX tiles, the ``compressed`` prefix
decodes as fast as the decoded one for 15 agents (129.6 against 130.7 tok/s) and faster for one (19.6 against 19.0),
holds only the pool, and starts a cold call in 0.10 s instead of 0.27-0.33 s (no prefix to decode). Without the
tiles (no AMX, or not bfloat16), the kernel's vector path over the stored pool took 2.2 ms per layer for 15 agents
where PyTorch's fused attention over the decoded prefix took 0.5 ms: there the decoded prefix stays the default.
Compiled decode steps exist for the decoded prefix only, so an engine that compiles keeps it too.
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
