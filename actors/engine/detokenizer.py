"""Incremental detokenization with stop strings.

Text is released only when it is final: never a partial UTF-8 character (no U+FFFD from a
character split across tokens) and never a suffix that could still become the start of a stop
string. The concatenation of all released deltas equals the final text exactly, and equals
`tokenizer.decode(ids, skip_special_tokens=True)`.

Byte-level tokenizers (GPT-2 / Qwen / Llama-3 style: a `ByteLevel` decoder) decode each new token in O(1):
`tokenizer.decode` is a lossy UTF-8 decode of the concatenated bytes of the tokens (special tokens skipped),
so the detokenizer keeps a per-id bytes table (built once per tokenizer, checked against
`tokenizer.decode([id])` for every id) and feeds it to Python's UTF-8 decoder, incrementally (same
replacement of invalid bytes as the tokenizers library's lossy decode: one U+FFFD per maximal invalid
subpart). Other tokenizers decode the whole sequence again per token.
"""
from __future__ import annotations

import json
from codecs import utf_8_decode as _utf8_decode

from tokenizers import Tokenizer

_TABLES: dict[int, tuple[Tokenizer, list[bytes] | None]] = {}  # id(tokenizer) -> (tokenizer kept alive, table)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (`bytes_to_unicode`), character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer: Tokenizer) -> list[bytes] | None:
    """Bytes of every token id of a byte-level tokenizer (b"" for special tokens, which decoding skips), or
    None when the tokenizer's decoder is not `ByteLevel` or any id's bytes do not decode as
    `tokenizer.decode([id], skip_special_tokens=True)` does. Built once per tokenizer object."""
    hit = _TABLES.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    table = _build_table(tokenizer)
    _TABLES[id(tokenizer)] = (tokenizer, table)
    return table


def _build_table(tokenizer: Tokenizer) -> list[bytes] | None:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    chars = _byte_level_chars()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    table = []
    for i in range(n):
        s = tokenizer.id_to_token(i)
        if s is None or i in special:
            table.append(b"")
        elif all(c in chars for c in s):
            table.append(bytes(chars[c] for c in s))
        else:  # what the ByteLevel decoder does with a token outside its alphabet (an added token)
            table.append(s.encode("utf-8"))
    ref = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=True)
    if any(b.decode("utf-8", "replace") != r for b, r in zip(table, ref)):
        return None
    return table


def take_token(seq, tok: int, eos: set[int], max_model_len: int) -> tuple[list[int], str, str | None]:
    """Apply one sampled token to `seq` (an `actors.engine.scheduler.Sequence`): the per-sequence rules of a step.

    EOS (unless `params.ignore_eos`) ends it with "stop" and is not emitted; a `stop_token_ids` id ends it
    with "stop" and is emitted (it joins `output_ids`) without its text (vLLM's `include_stop_str_in_output=False`
    default); otherwise the token joins `output_ids` and its detokenizer, and a stop string ends it with "stop",
    reaching `max_tokens` or `max_model_len` with "length". A sequence with a grammar (`seq.grammar`) advances it
    first and ends with "stop" when it is complete. At the end, the text held back is released (`flush`).

    Raises:
        ValueError: the grammar rejects the token (the caller fails that request alone).

    Returns:
        (token ids to emit, text delta, finish reason or None).
    """
    p, detok = seq.params, seq.detok
    if tok in eos and not p.ignore_eos:
        return [], ("" if detok.stopped else detok.flush()), "stop"
    complete = seq.grammar is not None and seq.grammar.advance(tok)
    seq.output_ids.append(tok)
    if p.stop_token_ids and tok in p.stop_token_ids:
        return [tok], detok.flush(), "stop"
    text, stopped = detok.add(tok)
    if stopped or complete:
        reason = "stop"
    elif len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= max_model_len:
        reason = "length"
    else:
        return [tok], text, None
    if not detok.stopped:
        text += detok.flush()
    return [tok], text, reason


class IncrementalDetokenizer:
    """Per-sequence state: `add(token_id) -> (delta_text, stopped)`; `flush() -> delta_text`. Stop strings are
    looked for once more than `min_tokens` tokens were added (vLLM's `min_tokens`): the text of the first
    min_tokens tokens is released as it comes, and a stop string ending there does not stop."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, min_tokens: int = 0):
        self.tok = tokenizer
        self.stop = list(stop or [])
        self.min_tokens, self.added = min_tokens, 0
        self._floor = 0  # a stop string must end after this char: the text of the first min_tokens tokens
        self.ids: list[int] = []  # token ids so far, kept only without a bytes table (whole re-decodes)
        self.text = ""  # decoded text so far (complete characters only); with stop strings only (else unused)
        self.sent = 0  # chars of `text` already released
        self.stopped = False
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._table = token_bytes(tokenizer)
        self._bytes = b""  # the start of a character whose remaining bytes have not come yet
        self._pending = ""  # decoded, not yet final (it ends with U+FFFD, which a later byte may still explain)

    def add(self, token_id: int) -> tuple[str, bool]:
        self.added += 1
        if self._table is None:
            self.ids.append(token_id)
            return self._add_full()
        table = self._table
        data = self._bytes + table[token_id] if 0 <= token_id < len(table) else self._bytes
        piece, used = _utf8_decode(data, "replace", False)  # an incomplete last character stays in the bytes
        self._bytes = data[used:]
        pending = self._pending + piece if self._pending else piece
        if self._bytes or pending.endswith("\ufffd"):
            self._pending = pending  # wait for the rest of the character (as decode's trailing U+FFFD says)
            return "", False
        self._pending = ""
        if not self.stop:
            return pending, False
        self.text += pending
        return self._after_text()

    def _add_full(self) -> tuple[str, bool]:
        """The per-token path of a tokenizer without a bytes table: decode the whole sequence again."""
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return "", False  # wait for the rest of the character
        self.text = full
        if not self.stop:
            return self._release(len(self.text)), False
        return self._after_text()

    def _after_text(self) -> tuple[str, bool]:
        """`text` grew: end at the first stop string, else release all but a possible stop string's start."""
        if self.added <= self.min_tokens:
            self._floor = len(self.text)
            return self._release(len(self.text)), False
        # search only the region that could contain a new match
        start = max(0, self.sent - self._max_stop)
        hits = [i for s in self.stop if (i := self.text.find(s, max(start, self._floor - len(s) + 1))) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text)), True
        hold = self._held_suffix()
        return self._release(len(self.text) - hold), False

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
        if self.stopped:
            return self._release(len(self.text))
        if self._table is not None:
            rest = self._pending + _utf8_decode(self._bytes, "replace", True)[0]
            self._bytes = b""
            self._pending = ""
            if not self.stop:
                return rest
            self.text += rest
        elif self.ids:
            self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        return self._release(len(self.text))
