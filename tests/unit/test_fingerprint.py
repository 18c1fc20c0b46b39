"""Model fingerprints are memoised, the memo notices weights, dtype and vocabulary changing, and the
identity a pool checks leaves the dtype out (fp32 and bf16 copies of one model read one pool)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_llama

from polykv_agents.model.fingerprint import check_same_model, model_fingerprint
from polykv_agents.pool.shared_pool import SharedKVPool


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


def test_fp32_and_bf16_copies_are_one_model_for_a_pool(tiny_tok):
    """One pool, one digest, for both dtypes: the weights hash is over a bf16-rounded sample."""
    fp32 = tiny_llama(seed=1)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    a, b = model_fingerprint(fp32, tiny_tok), model_fingerprint(bf16, tiny_tok)
    assert (a.dtype, b.dtype) == ("float32", "bfloat16")
    assert a.mismatches(b) == []
    ids = torch.arange(3, 40)
    assert (
        SharedKVPool.prefill_tokens(fp32, tiny_tok, ids).digest
        == SharedKVPool.prefill_tokens(bf16, tiny_tok, ids).digest
    )
    check_same_model(a, bf16, tiny_tok)  # no error


def test_other_weights_still_differ_after_rounding(tiny_tok):
    """Rounding to bf16 must not blur two checkpoints together."""
    assert (
        model_fingerprint(tiny_llama(seed=1), tiny_tok).weights_sha
        != model_fingerprint(tiny_llama(seed=2), tiny_tok).weights_sha
    )


def test_an_fp16_reader_is_told_to_use_the_pool_s_dtype(tiny_tok):
    fp32 = tiny_llama(seed=1)
    fp16 = copy.deepcopy(fp32).to(torch.float16)
    with pytest.raises(ValueError, match="built by a float32 model and this one is float16"):
        check_same_model(model_fingerprint(fp32, tiny_tok), fp16, tiny_tok)
