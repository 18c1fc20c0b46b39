"""Token ids in, text pieces out, ending before the first stop sequence.

Text is re-decoded from all generated ids at each step (answers are short, and this is what keeps
multi-byte characters and multi-token stop strings right). A piece is released only once it can
no longer turn out to be the start of a stop sequence, so streaming and non-streaming calls
return the same text. An answer that opens with ``structured_opening`` (a tool call) is never cut by a
stop sequence: its grammar decides where it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

_INCOMPLETE_CHAR = "\ufffd"  # what a partial UTF-8 sequence decodes to


class StopAwareDetokenizer:
    """Incremental detokenizer that holds back possible stop-sequence prefixes."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = (), *, structured_opening: str | None = None
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._structured_opening = structured_opening
        self._token_ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already released
        self.stopped = False
        """True once a stop sequence appeared; later tokens are ignored."""

    def _text(self) -> str:
        return self._tokenizer.decode(self._token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that starts some stop sequence."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _is_structured(self, text: str) -> bool:
        """``text`` opens (or may still open) the structured answer, to which stop sequences never apply."""
        opening = self._structured_opening
        return opening is not None and (text.startswith(opening) or opening.startswith(text))

    def _release(self, end: int, text: str) -> str:
        piece = text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return piece

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that is now safe to show (maybe empty)."""
        if self.stopped:
            return ""
        self._token_ids.append(token_id)
        text = self._text()
        stops_apply = bool(self._stop) and not self._is_structured(text)
        if stops_apply:
            # A stop can only start in the unreleased tail or straddle its border.
            search_from = max(0, self._emitted - max(map(len, self._stop)) + 1)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._release(min(hits), text)
        if text.endswith(_INCOMPLETE_CHAR):
            return ""
        return self._release(len(text) - (self._held_back(text) if stops_apply else 0), text)

    def finish(self) -> str:
        """Release what was held back once generation ends without a stop sequence."""
        if self.stopped:
            return ""
        text = self._text()
        return self._release(len(text), text)
