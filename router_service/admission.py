"""Admission bounds of the router: how many requests may be in flight (by the memory a queued one holds) and how
long a text prompt may be before it is refused untokenized."""
from __future__ import annotations

from tokenizers import Tokenizer

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
