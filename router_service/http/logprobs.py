"""Logprobs and echo in the OpenAI response shapes, from the rank's `TokenLogprob` entries
(`actors.engine.messages.TokenOutput.logprobs` / `prompt_logprobs`: [logprob, rank, top_ids, top_logprobs]).

Completions (`logprobs` k): `choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`; each
top_logprobs entry maps token text -> logprob for the k most probable tokens and the chosen one (so up to k + 1,
as OpenAI's legacy API and vLLM); `text_offset` is each token's character offset in the choice's `text`
(cumulative lengths of the token texts, as vLLM). With `echo`, the prompt's tokens come first, the first with
null logprob and null top_logprobs. Chat (`logprobs: true`, `top_logprobs` k): `choices[i].logprobs.content[]` =
{token, logprob, bytes, top_logprobs: the k most probable as {token, logprob, bytes}}. vLLM's `prompt_logprobs`
extension: a list with one entry per prompt token (the first null), {token id: {logprob, rank, decoded_token}} for
the prompt token and the top-k. Values are the rank's log_softmax of the raw logits (fp32, before temperature,
top-k, top-p); -inf is sent as -9999.0 (JSON has no infinity; vLLM does the same).

Token text: `tokenizer.decode([id])` (special tokens included; a token that is part of a UTF-8 character decodes
to U+FFFD, its `bytes` are exact: the byte-level table of `actors.engine.detokenizer.token_bytes`).
"""
from __future__ import annotations

from tokenizers import Tokenizer

from actors.engine.detokenizer import token_bytes

_FLOOR = -9999.0
_TEXTS: dict[int, tuple[Tokenizer, list[str]]] = {}


def _lp(x: float) -> float:
    return x if x > _FLOOR else _FLOOR  # also maps nan to the floor


class TokenTexts:
    """Text and bytes of token ids for one tokenizer; the whole-vocabulary text table is decoded once (first
    use) and shared by every request."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        hit = _TEXTS.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            n = tokenizer.get_vocab_size(with_added_tokens=True)
            hit = _TEXTS[id(tokenizer)] = (tokenizer, tokenizer.decode_batch([[i] for i in range(n)],
                                                                            skip_special_tokens=False))
        self.texts = hit[1]
        self.table = token_bytes(tokenizer)

    def text(self, i: int) -> str:
        return self.texts[i] if 0 <= i < len(self.texts) else self.tok.decode([i], skip_special_tokens=False)

    def bytes(self, i: int) -> list[int]:
        b = self.table[i] if self.table is not None and 0 <= i < len(self.table) else b""
        return list(b or self.text(i).encode("utf-8"))


def completion_logprobs(tt: TokenTexts, ids: list[int], entries: list, k: int, offset: int = 0) -> dict:
    """The completions `logprobs` object of tokens `ids` with their entries (None: a first prompt token), top-k
    `k`; `offset`: the text offset of the first token (the length of the text before it)."""
    tokens, lps, tops, offs = [], [], [], []
    for t, e in zip(ids, entries):
        s = tt.text(t)
        tokens.append(s)
        offs.append(offset)
        offset += len(s)
        if e is None:
            lps.append(None), tops.append(None)
            continue
        lps.append(_lp(e[0]))
        top = {tt.text(i): _lp(v) for i, v in zip(e[2][:k], e[3][:k])}
        top.setdefault(s, _lp(e[0]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(tt: TokenTexts, ids: list[int], entries: list, k: int) -> list[dict]:
    """The chat `logprobs.content` items of tokens `ids` with their entries, top-k `k`."""
    return [{"token": tt.text(t), "logprob": _lp(e[0]), "bytes": tt.bytes(t),
             "top_logprobs": [{"token": tt.text(i), "logprob": _lp(v), "bytes": tt.bytes(i)}
                              for i, v in zip(e[2][:k], e[3][:k])]}
            for t, e in zip(ids, entries)]


def vllm_prompt_logprobs(tt: TokenTexts, ids: list[int], entries: list, k: int) -> list:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {str(id): {logprob, rank, decoded_token}}
    for the prompt token, then its top-k (`k`)."""
    out: list = []
    for t, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": _lp(e[0]), "rank": e[1], "decoded_token": tt.text(t)}}
        for r, (i, v) in enumerate(zip(e[2][:k], e[3][:k]), 1):
            d.setdefault(str(i), {"logprob": _lp(v), "rank": r, "decoded_token": tt.text(i)})
        out.append(d)
    return out


class ChoiceView:
    """What one choice's response adds to its text: the echoed prompt, logprobs, vLLM's prompt_logprobs.

    Args:
        tt: token texts. chat: chat shape (else completions). k: top alternatives per output token (None: no
            logprobs). echo: the prompt (`prompt_text`, its ids `prompt_ids`) comes first (completions).
        prompt_k: vLLM's `prompt_logprobs` (None: off).
    Non-streamed: `add` every output, then `fill` the choice. Streamed: `chunks` per output.
    """

    def __init__(self, tt: TokenTexts, *, chat: bool, k: int | None, echo: bool, prompt_k: int | None,
                 prompt_text: str, prompt_ids: list[int]):
        self.tt, self.chat, self.k, self.echo, self.prompt_k = tt, chat, k, echo, prompt_k
        self.prompt_text, self.prompt_ids = prompt_text, prompt_ids
        self.ids: list[int] = []
        self.entries: list = []
        self.prompt_entries: list | None = None
        self.offset = 0  # text offset of the next streamed token
        self.started = False

    def add(self, o) -> None:
        """Record one `TokenOutput` of this choice."""
        self.ids += o.token_ids
        self.entries += o.logprobs or []
        if o.prompt_logprobs is not None:
            self.prompt_entries = o.prompt_logprobs

    def _logprobs(self, ids: list[int], entries: list, prompt: bool):
        """The `logprobs` value of these tokens (completions object, or chat {"content": [...]}), None if off."""
        if self.k is None:
            return None
        if self.chat:
            return {"content": chat_logprobs(self.tt, ids, entries, self.k)}
        if prompt:
            ids, entries = self.prompt_ids + ids, (self.prompt_entries or [None] * len(self.prompt_ids)) + entries
        lp = completion_logprobs(self.tt, ids, entries, self.k, self.offset)
        self.offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if ids else self.offset
        return lp

    def prompt_logprobs(self) -> list | None:
        """vLLM's `prompt_logprobs` of this choice (None: not asked, or not arrived)."""
        if self.prompt_k is None or self.prompt_entries is None:
            return None
        return vllm_prompt_logprobs(self.tt, self.prompt_ids, self.prompt_entries, self.prompt_k)

    def fill(self, choice: dict, text_key: str = "text") -> dict:
        """Complete a non-streamed choice in place (echo prefix, `logprobs`, and for completions
        `prompt_logprobs`: a chat response has it once, at the top, as vLLM's); returns it."""
        if self.echo:
            choice[text_key] = self.prompt_text + choice[text_key]
        choice["logprobs"] = self._logprobs(self.ids, self.entries, self.echo)
        if self.prompt_k is not None and not self.chat:
            choice["prompt_logprobs"] = self.prompt_logprobs()
        return choice

    def chunks(self, index: int, o) -> list[dict]:
        """The streamed choice objects of one output: with echo, first the prompt's (its text and logprobs);
        then the output's text, its tokens' logprobs and finish reason. Empty when there is nothing to say."""
        out = []
        if not self.started:
            self.started = True
            if o.prompt_logprobs is not None:
                self.prompt_entries = o.prompt_logprobs
            if self.echo:
                out.append({"index": index, "text": self.prompt_text,
                            "logprobs": self._logprobs([], [], True), "finish_reason": None})
        if o.token_ids or o.text or o.finish_reason is not None:
            lp = self._logprobs(o.token_ids, o.logprobs or [], False) if o.token_ids else None
            body = {"delta": {"content": o.text} if o.text else {}} if self.chat else {"text": o.text}
            out.append({"index": index, **body, "logprobs": lp, "finish_reason": o.finish_reason})
        return out
