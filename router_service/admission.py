"""Admission at the router's edge: how many requests may be in flight (by the memory a queued one holds), how
long a text prompt may be before it is refused untokenized, and the prompt checks every front door shares
(`PromptAdmission`)."""
from __future__ import annotations

from tokenizers import Tokenizer

from actors.engine.grammar import check_grammar, load_tokenizer
from actors.engine.sampling import SamplingParams
from router_service.errors import InvalidRequestError

# The admission bound by default: requests in flight (running + queued) per Router before OverloadedError, set by
# the memory a queued request holds. A queued request keeps its prompt token ids as Python ints on the router and
# on its rank (plus the request message): about QUEUED_TOKEN_BYTES per prompt token, at most max_model_len tokens.
# QUEUE_MEMORY_BYTES of that gives 4096 requests at max_model_len 1024; never fewer than MIN_MAX_QUEUE.
QUEUE_MEMORY_BYTES = 256 << 20
QUEUED_TOKEN_BYTES = 64
MIN_MAX_QUEUE = 256


def default_max_queue(max_model_len: int) -> int:
    """Requests in flight per Router by default: QUEUE_MEMORY_BYTES // (max_model_len * QUEUED_TOKEN_BYTES), at
    least MIN_MAX_QUEUE. Requests beyond the ranks' `max_num_seqs` wait in the ranks' schedulers (FIFO) instead of
    being refused, as vLLM queues them."""
    return max(MIN_MAX_QUEUE, QUEUE_MEMORY_BYTES // (max(max_model_len, 1) * QUEUED_TOKEN_BYTES))


def max_prompt_chars(tokenizer: Tokenizer, max_model_len: int) -> int:
    """Characters a prompt may have before it is refused untokenized: a token never spells more characters than
    its longest vocabulary entry (byte-level BPE: one character per byte), so a longer text surely exceeds
    `max_model_len` tokens; doubled for normalizers that drop characters. Tokenizing holds the GIL (seconds for
    megabytes), which would stall every other stream of the process: this bound keeps that work proportional to
    what can be served."""
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return 2 * max_model_len * max(longest, 1)


class PromptAdmission:
    """The prompt checks of a router: tokenizing within bounds, token ids in the vocabulary, prompt + max_tokens
    within the context window, the KV profile loadable.

    Args:
        tokenizer: the model's tokenizer. vocab_size: ids at most vocab_size - 1. cfg: the cluster's config
            (`max_model_len`, `model`, `engine_options`).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cfg):
        self.tokenizer, self.vocab_size, self.cfg = tokenizer, vocab_size, cfg
        self.max_prompt_chars = max_prompt_chars(tokenizer, cfg.max_model_len)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of `prompt` (text or ids). Raises InvalidRequestError naming the field (`prompt`,
        `max_tokens`, `logit_bias` ids outside the vocabulary, `kv_profile`, a `grammar` that does not compile),
        the value and the limit."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "prompt is empty")
            ids = self.encode(prompt, "prompt")
        else:
            ids = list(prompt)
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if bad:
                raise InvalidRequestError("prompt", f"prompt token id {bad[0]} out of range [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty (0 tokens)")
        L = self.cfg.max_model_len
        if len(ids) >= L:
            raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; the context window is {L}")
        if len(ids) + params.max_tokens > L:
            raise InvalidRequestError("max_tokens", f"max_tokens={params.max_tokens} exceeds the context window "
                                                    f"({L} - {len(ids)} prompt tokens = {L - len(ids)})")
        bad = next((t for t in params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("logit_bias", f"logit_bias: token id {bad} out of range [0, {self.vocab_size})")
        try:  # against the KV profiles the ranks loaded (same model folder and engine options; cached)
            params.check_kv_profile(self.cfg.model, self.cfg.engine_options)
        except ValueError as e:
            raise InvalidRequestError("kv_profile", str(e)) from e
        if params.grammar is not None:  # every front door's (the HTTP edge checked its own already: a lookup)
            try:
                check_grammar(params.grammar, load_tokenizer(f"{self.cfg.model}/tokenizer.json", self.vocab_size))
            except ValueError as e:
                raise InvalidRequestError("grammar", f"grammar: does not compile: {e}") from e
        return ids

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """Token ids of `text`, refused untokenized when it has more than `max_prompt_chars` characters.

        Raises:
            InvalidRequestError: naming `field`, the length and the limit.
        """
        if len(text) > self.max_prompt_chars:
            raise InvalidRequestError(field, f"{field} has {len(text)} characters; the context window is "
                                             f"{self.cfg.max_model_len} tokens, which no text over "
                                             f"{self.max_prompt_chars} characters fits")
        return self.tokenizer.encode(text).ids
