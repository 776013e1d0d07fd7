"""Incremental detokenization with stop strings.

Text is released only when it is final: never a partial UTF-8 character (no U+FFFD from a
character split across tokens) and never a suffix that could still become the start of a stop
string. The concatenation of all released deltas equals the final text exactly.
"""
from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    """Per-sequence state: `add(token_id) -> (delta_text, stopped)`; `flush() -> delta_text`."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self.tok = tokenizer
        self.stop = list(stop or [])
        self.ids: list[int] = []
        self.text = ""  # decoded text so far (complete characters only)
        self.sent = 0  # chars of `text` already released
        self.stopped = False
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def add(self, token_id: int) -> tuple[str, bool]:
        self.ids.append(token_id)
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return "", False  # wait for the rest of the character
        self.text = full
        if self.stop:
            # search only the region that could contain a new match
            start = max(0, self.sent - self._max_stop)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._release(len(self.text)), True
            hold = self._held_suffix()
            return self._release(len(self.text) - hold), False
        return self._release(len(self.text)), False

    def _held_suffix(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def flush(self) -> str:
        """At the end of the sequence: release whatever is held (no stop string matched).

        A character left incomplete by the last token (cut by max_tokens) can never complete, so
        the final text is exactly `tokenizer.decode(ids)`, trailing U+FFFD included.
        """
        if not self.stopped and self.ids:
            self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        return self._release(len(self.text))
