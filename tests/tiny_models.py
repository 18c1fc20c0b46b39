"""Tiny random-initialised models and an in-memory tokenizer for fast tests (no downloads)."""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A ChatML template with tool support in the Hermes format (tools in the first system turn, calls as <tool_call>
# blocks, results as <tool_response> user turns), written for these tests in the way Qwen-style templates work.
HERMES_TOOLS_TEMPLATE = (
    "{% set rest = messages %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% set rest = messages[1:] %}"
    "{% endif %}"
    "{{ 'You may call these tools:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson + '\n' }}{% endfor %}"
    '{{ \'</tools>\nFor each call, answer with <tool_call>\n{"name": <name>, "arguments": <arguments>}\n\''
    " + '</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in rest %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Shared caches let many agents read one document.",
    "Keys are quantised to eight bits; values use a rotated three-bit codebook. Planner, critic, summarizer.",
    "0123456789 !?.,;:'\"()[]{}<>/\\|@#$%^&*-_=+~` abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (~300 tokens) with ChatML special tokens and template."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_hermes_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`tiny_tokenizer` with :data:`HERMES_TOOLS_TEMPLATE` (a chat template with tool support)."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = HERMES_TOOLS_TEMPLATE
    return tokenizer


def tiny_llama(
    *,
    head_dim: int = 16,
    num_layers: int = 2,
    seed: int = 0,
    vocab_size: int = 320,
    initializer_range: float = 0.02,
    max_positions: int = 1024,
) -> LlamaForCausalLM:
    """A 2-layer GQA Llama with random weights. A larger ``initializer_range`` (e.g. 0.3) makes its answers
    depend strongly on the prompt, which tests of cross-talk between agents need."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=initializer_range,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 2
    return model


def tiny_sensitive_llama(*, seed: int = 1) -> LlamaForCausalLM:
    """:func:`tiny_llama` with large random weights (``initializer_range=0.3``): its greedy answers depend
    strongly on the prompt, so an answer given to the wrong agent, or decoded from another row's cache, shows.
    Tests that compare several agents' outputs use it, and check them with :func:`assert_pairwise_distinct`."""
    return tiny_llama(seed=seed, initializer_range=0.3)


def assert_pairwise_distinct(outputs: Sequence) -> None:
    """Fail unless every two of ``outputs`` differ. Comparing batched outputs with sequential ones only
    sees rows swapped, mixed or misaligned if the expected outputs are different to begin with."""
    for i, j in itertools.combinations(range(len(outputs)), 2):
        assert outputs[i] != outputs[j], (
            f"expected outputs {i} and {j} are equal ({outputs[i]!r}): the test cannot tell these rows apart; "
            "use tiny_sensitive_llama() or more different prompts"
        )


SLIDING_WINDOW = 64
"""Window of the tiny sliding-window families: documents in tests are shorter, answers run past it."""

_IDS = {"vocab_size": 320, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 1024}
_GQA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _family_configs() -> dict[str, PretrainedConfig]:
    """One tiny config per architecture family, each with the trait that family is tested for."""
    return {
        "llama": LlamaConfig(**_GQA, num_key_value_heads=2, **_IDS),  # GQA
        "qwen2": Qwen2Config(**_GQA, num_key_value_heads=2, **_IDS),  # bias on q/k/v projections
        "mistral": MistralConfig(
            **_GQA, num_key_value_heads=2, head_dim=16, sliding_window=SLIDING_WINDOW, **_IDS
        ),  # sliding window on every layer
        "phi3": Phi3Config(
            hidden_size=192,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            original_max_position_embeddings=1024,
            **_IDS,
        ),  # head_dim 96, fused qkv projection
        "gemma2": Gemma2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=SLIDING_WINDOW,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **_IDS,
        ),  # head_dim 256, soft-capping, alternating sliding and global layers
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **_IDS),  # MHA, Conv1D c_attn layout
    }


FAMILIES = tuple(_family_configs())


def tiny_gemma3() -> PreTrainedModel:
    """A tiny random Gemma 3 text model (the second model family's architecture): sliding layers with a local
    RoPE base, then one global layer (Gemma 3: five to one), q/k norms, one kv head of 256. Kept out of :data:`FAMILIES`
    because moving keys (compose, blocks) refuses its per-layer-type RoPE."""
    from transformers import Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=256,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], **_IDS,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model


def tiny_causal_lm(family: str, *, seed: int = 0) -> PreTrainedModel:
    """A tiny random-initialised model of ``family`` (one of :data:`FAMILIES`), in fp32, no download."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_family_configs()[family]).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model
