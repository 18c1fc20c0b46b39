"""StopAwareDetokenizer: streamed pieces, multi-token stop strings, held-back prefixes, UTF-8."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_tokenizer

from polykv_agents.sampling.text_stream import StopAwareDetokenizer

REPLACEMENT_CHAR = "\ufffd"


def _ids(text: str) -> list[int]:
    return tiny_tokenizer()(text, add_special_tokens=False).input_ids


def _decode(ids: list[int]) -> str:
    return tiny_tokenizer().decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _stream(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], StopAwareDetokenizer]:
    """Push ``ids`` one by one as the agent does (stop pushing once stopped), then finish."""
    detok = StopAwareDetokenizer(tiny_tokenizer(), stop)
    pieces = []
    for token in ids:
        pieces.append(detok.push(token))
        if detok.stopped:
            break
    pieces.append(detok.finish())
    return pieces, detok


def _reference(ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    """Brute force: the first prefix of ``ids`` whose text contains a stop ends the answer, right
    before the earliest stop occurrence in that text; with no stop the answer is all the text."""
    for k in range(1, len(ids) + 1):
        text = _decode(ids[:k])
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return text[: min(hits)], True
    return _decode(ids), False


def test_tokenizer_is_byte_level_and_round_trips() -> None:
    """Sanity check of the fixture the other tests rely on: multi-byte characters become several
    tokens, and decoding the ids gives the text back."""
    text = "café 日本"
    ids = _ids(text)
    assert _decode(ids) == text
    assert len(ids) > len(text)
    assert REPLACEMENT_CHAR in _decode(ids[:4])  # "caf" + the first byte of "é"


@pytest.mark.parametrize(
    "text", ["The quick brown fox jumps over the lazy dog.", "Keys: 8 bits; values: 3 bits!", "x", ""]
)
def test_without_stops_pieces_concatenate_to_the_decoded_text(text: str) -> None:
    """Nothing is lost or duplicated: every character is released exactly once."""
    ids = _ids(text)
    pieces, detok = _stream(ids)
    assert "".join(pieces) == _decode(ids) == text
    assert not detok.stopped
    # Without stops nothing is held back: the text is released as it is decoded.
    assert pieces[-1] == ""


def test_multi_token_stop_ends_the_answer_right_before_it() -> None:
    """``<END>`` spans five tokens; the answer is the text before it, and later tokens are ignored."""
    stop = "<END>"
    assert len(_ids(stop)) > 1
    ids = _ids("Answer: 42<END> trailing text")
    pieces, detok = _stream(ids, (stop,))
    assert "".join(pieces) == "Answer: 42"
    assert detok.stopped
    assert detok.push(_ids("more")[0]) == ""
    assert detok.finish() == ""


def test_pushes_after_the_stop_return_nothing() -> None:
    """Feeding every token (as a caller that ignores ``stopped`` would) still yields only the text
    before the stop."""
    detok = StopAwareDetokenizer(tiny_tokenizer(), ["<END>"])
    pieces = [detok.push(token) for token in _ids("ok<END>ignored <END> also ignored")]
    pieces.append(detok.finish())
    assert "".join(pieces) == "ok"
    assert detok.stopped


def test_prefix_of_a_stop_is_held_back_then_released() -> None:
    """While the text ends with a prefix of the stop string ("f", "fo", "fox"), that prefix is not
    shown (it may become the stop); once the stop fails to materialise it is released, so nothing
    is lost."""
    stop = ("fox!",)
    detok = StopAwareDetokenizer(tiny_tokenizer(), stop)
    shown = ""
    for token in _ids("the fox"):
        shown += detok.push(token)
    assert shown == "the "
    for token in _ids(" jumps"):
        shown += detok.push(token)
    assert shown == "the fox jumps"
    assert detok.finish() == ""
    assert not detok.stopped


def test_held_back_prefix_is_released_by_finish() -> None:
    """If generation ends while a stop prefix is held back, ``finish`` releases it."""
    detok = StopAwareDetokenizer(tiny_tokenizer(), ["###"])
    shown = "".join(detok.push(token) for token in _ids("done ##"))
    assert shown == "done "
    assert detok.finish() == "##"
    assert detok.finish() == ""  # idempotent


def test_each_push_releases_exactly_what_cannot_start_a_stop() -> None:
    """After every push the shown text is the decoded text minus its longest suffix that is a
    proper prefix of a stop string (and nothing while a character is incomplete)."""
    stop = ("bax", "c!")
    detok = StopAwareDetokenizer(tiny_tokenizer(), stop)
    ids = _ids("abba cab bac abab ba")
    shown, was_held = "", False
    for k, token in enumerate(ids, start=1):
        shown += detok.push(token)
        text = _decode(ids[:k])
        held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        assert shown == text[: len(text) - held], (k, text, shown)
        was_held = was_held or held > 0
    assert was_held  # the hold-back path was exercised
    assert not detok.stopped


def test_stop_at_the_very_start_gives_an_empty_answer() -> None:
    """A stop made of the first tokens ends the answer before anything was shown."""
    pieces, detok = _stream(_ids("STOP rest of the answer"), ("STOP",))
    assert all(piece == "" for piece in pieces)
    assert detok.stopped


def test_earliest_of_several_stops_wins() -> None:
    """With several stop strings the answer ends before whichever appears first."""
    pieces, _ = _stream(_ids("alpha. beta! gamma"), ("!", "."))
    assert "".join(pieces) == "alpha"


def test_special_tokens_are_not_part_of_the_text() -> None:
    """Special tokens (e.g. ChatML markers) decode to nothing and cannot trigger or hide a stop."""
    tok = tiny_tokenizer()
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = [*_ids("hi"), im_start, *_ids(" there")]
    pieces, _ = _stream(ids, ("im_start",))
    assert "".join(pieces) == "hi there"


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("café au lait", ()),
        ("日本語のテキスト and more", ()),
        ("prix: 5€ — fin", ("fin",)),
        ("naïve 日本 stop here", ("本 s",)),
        ("emoji 🙂 ok", ("🙂",)),
    ],
)
def test_multi_byte_characters_are_never_split(text: str, stop: tuple[str, ...]) -> None:
    """Characters of 2–4 UTF-8 bytes span several byte-level tokens; no piece may contain the
    replacement character that a partial byte sequence decodes to, and the characters arrive
    whole."""
    ids = _ids(text)
    assert _decode(ids) == text
    pieces, _ = _stream(ids, stop)
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)
    expected, _ = _reference(ids, stop)
    assert "".join(pieces) == expected


@settings(max_examples=80, deadline=None)
@given(
    text=st.text(alphabet="ab .é日", max_size=14),
    stops=st.lists(st.text(alphabet="ab .é日", min_size=1, max_size=4), min_size=1, max_size=3),
    use_substring=st.booleans(),
    data=st.data(),
)
def test_streaming_equals_the_whole_text_cut_at_the_first_stop(
    text: str, stops: list[str], use_substring: bool, data: st.DataObject
) -> None:
    """For any text and stops (often a substring of the text), the streamed pieces concatenate to
    the brute-force answer, ``stopped`` says whether a stop occurred, and no piece contains a
    broken character. With one stop string the answer is simply the text before its first
    occurrence."""
    if use_substring and text:
        start = data.draw(st.integers(0, len(text) - 1))
        end = data.draw(st.integers(start + 1, min(len(text), start + 4)))
        stops = [*stops, text[start:end]]
    ids = _ids(text)
    pieces, detok = _stream(ids, tuple(stops))
    expected, stopped = _reference(ids, tuple(stops))
    assert "".join(pieces) == expected
    assert detok.stopped is stopped
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)

    single = stops[-1]
    pieces, detok = _stream(ids, (single,))
    cut = text.find(single)
    assert "".join(pieces) == (text if cut < 0 else text[:cut])
    assert detok.stopped is (cut >= 0)


@pytest.mark.parametrize(
    "text",
    ['<tool_call>{"name": "f", "arguments": {"q": "café 日本 a"}}</tool_call>', "<tool_call>aaa", "<"],
)
def test_a_structured_answer_is_never_cut_and_keeps_its_characters_whole(text: str) -> None:
    """tool_choice="auto": an answer that opens a call is released as it comes, stops ignored, and a character
    split over byte-level tokens is held until it is whole (never a replacement character)."""
    detok = StopAwareDetokenizer(tiny_tokenizer(), ("a", "é", "}"), structured_opening="<tool_call>")
    pieces = [detok.push(token) for token in _ids(text)]
    pieces.append(detok.finish())
    assert "".join(pieces) == text and not detok.stopped
    assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_a_plain_text_answer_under_a_structured_opening_still_stops() -> None:
    detok = StopAwareDetokenizer(tiny_tokenizer(), ("日",), structured_opening="<tool_call>")
    pieces = []
    for token in _ids("The café 日本."):
        pieces.append(detok.push(token))
        if detok.stopped:
            break
    assert "".join(pieces) == "The café " and detok.stopped
