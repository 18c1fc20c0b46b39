"""How a model stores its weights: ``native`` (its dtype), or weight-only ``int8`` / ``int4`` for faster decoding;
``auto`` (every loader's default) picks one for the machine (:func:`resolve_weights`).

Quantizing swaps every ``nn.Linear`` of the model for an
:class:`~polykv_agents.model.quantized_linear.Int8Linear` or
:class:`~polykv_agents.model.quantized_linear.Int4Linear`; activations, attention and the KV cache keep the
model's dtype. With ``int4`` the output layer is int8, as GGUF's 4-bit files keep it at 8 bits or more (the
embedded model's is Q8_0): a first run of ``python -m benchmarks weights`` with a 4-bit output layer measured
+5.7% perplexity against the native model, ten times what the committed run measures with it in int8, and
reading it in int8 takes no longer at one row.

A plain input embedding reads int8 codes too, the tied output layer's where the two are tied
(:class:`~polykv_agents.model.quantized_embedding.Int8Embedding`), so no bf16 copy of the vocabulary stays beside
them. The model's fingerprint stays the native model's (the embedding keeps the sample the fingerprint reads): a
pool does not depend on how the weights are stored, so one pool serves a model in every ``weights`` setting
(``python -m benchmarks weights`` measures the perplexity of each model with a pool built by the native model and
with one it built itself).

The kernels are CPU kernels, so ``int8`` and ``int4`` are for models on the CPU; elsewhere use ``native``.
"""

from __future__ import annotations

import logging
import os
from typing import Literal, get_args

import torch
from torch import nn
from transformers import PreTrainedModel

from polykv_agents.model.heap import release_free_heap
from polykv_agents.model.int8_tiles import kernel_runs
from polykv_agents.model.mapped_pages import file_mappings, release_mapped_pages
from polykv_agents.model.quantized_embedding import Int8Embedding
from polykv_agents.model.quantized_linear import Int4Linear, Int8Linear, int4_supported

logger = logging.getLogger(__name__)

Weights = Literal["native", "int8", "int4"]
"""How the weights are stored: in the model's dtype, or weight-only int8 / int4."""

WEIGHTS: tuple[str, ...] = get_args(Weights)

WeightsChoice = Literal["auto", "native", "int8", "int4"]
"""What a caller may ask for: a stored form, or ``auto`` (:func:`resolve_weights`)."""

WEIGHTS_ENV_VAR = "POLYKV_WEIGHTS"
"""Environment variable: the stored form ``auto`` means (``native``, ``int8`` or ``int4``), for every load that
does not name one."""

_ATTRIBUTE = "_polykv_weights"


def check_weights(weights: object) -> Weights:
    """``weights`` checked against :data:`WEIGHTS` (a stored form; ``auto`` goes through :func:`resolve_weights`)."""
    if weights not in WEIGHTS:
        msg = f"weights must be one of {', '.join(map(repr, WEIGHTS))}, got {weights!r}"
        raise ValueError(msg)
    return weights  # type: ignore[return-value]


def check_weights_choice(weights: object, name: str = "weights") -> str:
    """``weights`` checked as a caller's choice: ``auto`` or a stored form (:data:`WEIGHTS`); the error names
    where it came from (``name``: the argument, or an environment variable)."""
    if weights != "auto" and weights not in WEIGHTS:
        msg = f"{name} must be 'auto' or one of {', '.join(map(repr, WEIGHTS))}, got {weights!r}"
        raise ValueError(msg)
    return weights  # type: ignore[return-value]


def resolve_weights(weights: object, dtype: torch.dtype | None, device: torch.device | str) -> Weights:
    """The stored form ``weights`` means for a model in ``dtype`` on ``device``.

    ``auto``: ``$POLYKV_WEIGHTS`` where it is set; else ``int8`` where the native int8 kernel runs
    (:func:`~polykv_agents.model.int8_tiles.kernel_runs`: a bfloat16 model on a CPU with AMX tiles, or a float32 model
    on a CPU with AVX-512 or AVX2), else ``native``. On the tiles, int8 weights decode faster than the native ones for 1
    to 16 agents, make the process smaller and change perplexity by +0.13% [-0.12, +0.38], the int8 input embedding
    included (``benchmarks/results/issue42/int8_matmul_embedding.json``), and task scores on two model families by at
    most 2 items in 70, measured before the embedding read int8 codes (``benchmarks/results/issue42/weights_tasks``;
    docs/RUNTIME.md, "Which weights by default"). In float32, the kernel's vector path took one step's products in about
    half the time of the float32 weights at 1 to 16 rows, a quarter of the weights' bytes
    (``benchmarks/results/issue42/fp32_int8.json``; docs/RUNTIME.md, the same section). On both paths a row's result
    does not depend on the other rows of its step. Without the kernel, PyTorch's int8 kernel is slower than bfloat16
    above a few rows and runs a scalar loop on float32 rows, so the model keeps its weights.

    Raises:
        ValueError: An unknown name, here or in ``POLYKV_WEIGHTS``.
    """
    if check_weights_choice(weights) != "auto":
        return weights  # type: ignore[return-value]
    pinned = os.environ.get(WEIGHTS_ENV_VAR, "").strip()
    if pinned and check_weights_choice(pinned, WEIGHTS_ENV_VAR) != "auto":
        return pinned  # type: ignore[return-value]
    return "int8" if dtype is not None and kernel_runs(dtype, device) else "native"


def weights_of(model: PreTrainedModel) -> Weights:
    """How ``model``'s weights are stored (``native`` unless :func:`quantize_weights` changed them)."""
    return getattr(model, _ATTRIBUTE, "native")


def quantize_weights(model: PreTrainedModel, weights: Weights) -> int:
    """Store ``model``'s linear layers as ``weights`` (in place); returns how many layers were swapped. The output
    layer is int8 in every quantized setting, and a plain ``nn.Embedding`` input embedding reads int8 codes: the
    tied output layer's, or its own (:class:`~polykv_agents.model.quantized_embedding.Int8Embedding`).

    Layers the int4 kernel cannot take (shapes, see :func:`~polykv_agents.model.quantized_linear.int4_supported`)
    and layers that are not ``nn.Linear`` (GPT-2's ``Conv1D``) stay native; a warning counts them.

    Raises:
        ValueError: An unknown ``weights``, a model that is not on the CPU, or one already quantized
            differently.
    """
    weights = check_weights(weights)
    current = weights_of(model)
    if weights == current:
        return 0
    if current != "native":
        msg = f"this model's weights are already {current}; load a fresh copy to store them as {weights}"
        raise ValueError(msg)
    if model.device.type != "cpu":
        msg = f"weights={weights!r} runs on CPU kernels and this model is on {model.device}; use weights='native'"
        raise ValueError(msg)
    output = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = output is not None and embedding is not None and embedding.weight is output.weight
    swapped, kept = 0, 0
    mappings = file_mappings()  # read once: the checkpoint's mappings do not change while layers are swapped
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not nn.Linear:
                    kept += _is_weight_layer(child)
                    continue
                if weights == "int8" or child is output:
                    setattr(parent, name, Int8Linear(child))
                elif int4_supported(child):
                    setattr(parent, name, Int4Linear(child))
                else:
                    kept += 1
                    continue
                swapped += 1
                _release_unless_held(model, child.weight, mappings)  # a tied weight (the embedding's) is still read
                release_free_heap()
        if type(embedding) is nn.Embedding:  # a subclass may compute more than a lookup (Gemma scales its rows)
            head = model.get_output_embeddings()
            shared = head if tied and isinstance(head, Int8Linear) else None
            model.set_input_embeddings(Int8Embedding(embedding, shared))
            _release_unless_held(model, embedding.weight, mappings)
            release_free_heap()
    setattr(model, _ATTRIBUTE, weights)
    if kept:
        name = type(model).__name__
        logger.warning("%d weight layer(s) of %s stay native: the %s kernel cannot take them", kept, name, weights)
    return swapped


def _release_unless_held(model: PreTrainedModel, weight: torch.Tensor, mappings: list[tuple[int, int]]) -> None:
    """Give back the checkpoint pages of a replaced ``weight`` (:func:`release_mapped_pages`) unless a tensor of
    ``model`` still starts at its address (a tied or shared weight, still read)."""
    address = weight.data_ptr()
    if all(t.data_ptr() != address for t in [*model.parameters(), *model.buffers()]):
        release_mapped_pages(weight, mappings)


def _is_weight_layer(module: nn.Module) -> int:
    """1 for a projection this module swap does not handle (GPT-2's ``Conv1D``), else 0."""
    return int(type(module).__name__ == "Conv1D")
