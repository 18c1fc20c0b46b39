"""Model fingerprints are memoised, and the memo notices weights, dtype and vocabulary changing."""

from __future__ import annotations

import copy

import torch
from tiny_models import tiny_llama

from polykv_agents.model.fingerprint import model_fingerprint


def test_fingerprint_is_memoised_while_nothing_changes(tiny_tok):
    model = tiny_llama(seed=1)
    assert model_fingerprint(model, tiny_tok) is model_fingerprint(model, tiny_tok)


def test_memo_notices_weights_changed_in_place(tiny_tok):
    model = tiny_llama(seed=1)
    before = model_fingerprint(model, tiny_tok)
    with torch.no_grad():
        model.get_input_embeddings().weight[0, 0] += 1.0
    after = model_fingerprint(model, tiny_tok)
    assert after.weights_sha != before.weights_sha


def test_memo_notices_a_dtype_change(tiny_tok):
    model = tiny_llama(seed=1)
    before = model_fingerprint(model, tiny_tok)
    assert model_fingerprint(model.to(torch.bfloat16), tiny_tok).dtype != before.dtype


def test_memo_notices_added_tokens(tiny_tok):
    model, tokenizer = tiny_llama(seed=1), copy.deepcopy(tiny_tok)
    before = model_fingerprint(model, tokenizer)
    tokenizer.add_tokens(["<polykv-test-token>"])
    after = model_fingerprint(model, tokenizer)
    assert after.vocab_size == before.vocab_size + 1
    assert after.tokenizer_sha != before.tokenizer_sha


def test_two_tokenizers_on_one_model_get_their_own_fingerprints(tiny_tok):
    model, other = tiny_llama(seed=1), copy.deepcopy(tiny_tok)
    other.add_tokens(["<polykv-other>"])
    assert model_fingerprint(model, tiny_tok).tokenizer_sha != model_fingerprint(model, other).tokenizer_sha
