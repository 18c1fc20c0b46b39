"""The bytes of each token in a chat answer's logprobs: a token that is part of a character reports its own bytes
(the expected bytes here come from the text's UTF-8, never from the tokenizer's tables)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from polykv_agents.chat.logprobs import openai_logprobs, token_bytes
from polykv_agents.sampling.logprobs import TokenLogprob

REPLACEMENT = "\ufffd".encode()
TEXT = "é€ costs 3<|im_end|>"


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE: a few characters, and ``<0x00>`` .. ``<0xFF>`` for everything else."""
    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)} | {"▁": 256, "a": 257, "b": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_byte_level_tokens_that_are_part_of_a_character_report_their_own_bytes(tiny_tok):
    ids = tiny_tok(TEXT, add_special_tokens=False).input_ids
    assert tiny_tok.decode(ids[:1]) == "\ufffd"  # the tiny vocabulary splits é into its two bytes
    assert token_bytes(tiny_tok, ids[:2]) == [bytes([byte]) for byte in "é".encode()]
    assert b"".join(token_bytes(tiny_tok, ids)) == TEXT.encode()  # special token included, as its text


def test_every_byte_that_utf8_text_can_hold_maps_back(tiny_tok):
    """Characters of one to four bytes: every lead and continuation byte of UTF-8, through the whole alphabet."""
    three_bytes = [0x800, *range(0x1000, 0x10000, 0x1000)]  # lead bytes E0 .. EF
    four_bytes = [0x10000, *range(0x40000, 0x110000, 0x40000)]  # lead bytes F0 .. F4
    text = "".join(map(chr, [*range(1, 0x800), *three_bytes, *four_bytes]))
    assert {*text.encode()} == {*range(1, 0xC0), *range(0xC2, 0xF5)}  # all but NUL and what UTF-8 never holds
    assert b"".join(token_bytes(tiny_tok, tiny_tok(text, add_special_tokens=False).input_ids)) == text.encode()


def test_sentencepiece_byte_tokens_report_the_byte_they_stand_for():
    tok = _byte_fallback_tokenizer()
    ids = tok("aé€b", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["a", "<0xC3>", "<0xA9>", "<0xE2>", "<0x82>", "<0xAC>", "b"]
    assert token_bytes(tok, ids) == [b"a", *(bytes([byte]) for byte in "é€".encode()), b"b"]


def test_openai_logprobs_give_each_token_and_each_alternative_its_own_bytes(tiny_tok):
    ids = tiny_tok(TEXT, add_special_tokens=False).input_ids
    logprobs = [TokenLogprob(t, -1.0, ((t, -1.0), (ids[0], -2.0))) for t in ids]
    content = openai_logprobs(logprobs, tiny_tok)["content"]
    assert b"".join(bytes(item["bytes"]) for item in content) == TEXT.encode()
    assert content[0]["token"] == "\ufffd" and bytes(content[0]["bytes"]) == "é".encode()[:1]
    assert all(bytes(item["bytes"]) != REPLACEMENT for item in content)
    assert all(item["top_logprobs"][1]["bytes"] == content[0]["bytes"] for item in content)
