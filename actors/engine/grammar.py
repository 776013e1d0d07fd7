"""Constrained decoding on the rank: a request's grammar (`SamplingParams.grammar`, compiled from a JSON schema at
the router's edge) masks the tokens its next token may be, in the batched sampler, and advances with every token.

Library: llguidance (MIT; Rust core with Python bindings, one abi3 wheel of 3 MB, no runtime dependency: no torch,
no transformers; the `guidance` backend of vLLM's structured output, and llama.cpp's). It computes each mask at
run time (an Earley parser over a derivative-based lexer walking the token trie), so a schema compiles in about
a millisecond with nothing precomputed per schema and vocabulary; it fixes whitespace (`whitespace_flexible` off,
fixed separators), and reports schema errors in words. Measured against the other two on PyPI
(bench/grammar_libs.py, tiny-moe's 4096-token byte-level BPE, BENCHMARKS.md "Structured output"): xgrammar
0.2.9 (Apache-2.0) masks 2-5x faster per token (0.02-0.08 vs 0.15-0.37 ms) because it precompiles per schema
(8-22 ms a schema here, growing with the vocabulary), and needs transformers, triton and apache-tvm-ffi at run
time (torch>=1.10: it would keep 2.13.0); outlines-core 0.2.14 (Apache-2.0, no dependency) builds a regex DFA
index over the whole vocabulary per schema (27-60 ms here), wants the tokens as bytes mapped by hand and has no
JSON-aware error messages. Every request may bring its own schema (compiled at the router and on the rank), so
llguidance's millisecond compile and empty dependency list win over xgrammar's faster mask: at ~0.2 ms a token
it adds ~10-35% to a 16-stream decode step of the tiny shipped model (bench/structured.py); the share shrinks as
the forward grows, while the mask grows with the vocabulary (not measured here beyond 4096 tokens).

Method, per step (`apply_grammar_masks`): the rows with a grammar get their matcher's next-token bitmask (one
bit per token id, [G, ceil(V / 32)] int32, filled by `LLExecutor` for all rows in one call), unpacked to [G, V]
bool; disallowed logits become -inf (the sampler then gives them weight exactly 0). EOS is in the mask only
where the grammar accepts; once the grammar is complete (nothing can follow) the sequence ends with "stop"
(`GrammarState.advance`, called by `actors.engine.detokenizer.take_token`). A matcher in an error state, or a
mask that allows nothing, fails its request alone.
Shape legend: B = rows of the step, G = rows with a grammar, W = 32-bit words per mask, V = vocab.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

# the JSON compiler's options, applied over the schema's own `x-guidance` (so a client cannot turn them off):
# no free whitespace, json.dumps' separators; every output of a bounded schema then ends in a bounded token count
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1 << 20  # a compiled grammar (the schema inside it, as JSON text) at most
COMPILED_GRAMMARS = 64  # pristine matchers kept per process (`_compiled`), a few KiB to a few MiB each
GRAMMAR_THREADS = 1  # llguidance's mask threads per rank: masks of a few ms at most; the rank's cores do the forward

_lock = threading.Lock()
_executor = None


def _llg():
    import llguidance  # imported on first use: a deployment that never constrains pays nothing

    return llguidance


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...] = ()):
    """llguidance's view of a tokenizer: `tokenizer_json` (a `tokenizer.json` path), `vocab_size` ids (the
    model's logits width; ids past the tokenizer's are never allowed), `eos` the ids the mask allows where the
    grammar accepts (empty: the tokenizer's own end token, enough to check grammars). Built once per argument
    tuple (~30 ms for 4096 tokens, ~1 s for 150k)."""
    with open(tokenizer_json, encoding="utf-8") as f:
        text = f.read()
    return _llg().LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos) or None)


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar (JSON text) of a JSON schema (a dict), with `JSON_OPTIONS`. The schema itself is
    checked by `check_grammar`. Raises ValueError: the schema is not a JSON object."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")
    return _llg().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def check_grammar(grammar: str, tokenizer=None) -> None:
    """Raise ValueError with llguidance's words when `grammar` does not compile (an unknown type, a bad `$ref`,
    a bad regex `pattern`, an unsupported keyword) or is longer than MAX_GRAMMAR_CHARS; `tokenizer`:
    `load_tokenizer`'s (None: the grammar alone). The verdicts of recent grammars are kept (`_verdict`), so the
    router's admission checking again what the HTTP edge checked costs a lookup."""
    if not isinstance(grammar, str) or len(grammar) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters")
    err = _verdict(grammar, tokenizer)
    if err:
        raise ValueError(err)


@functools.lru_cache(maxsize=COMPILED_GRAMMARS)
def _verdict(grammar: str, tokenizer) -> str:
    is_error, msgs = _llg().LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return "; ".join(msgs)[:500] if is_error else ""


@functools.lru_cache(maxsize=COMPILED_GRAMMARS)
def _compiled(tokenizer, grammar: str):
    """A pristine matcher of `grammar` (never advanced: `GrammarState` takes deep copies), one per recent grammar,
    so the `n` choices of a request, and requests that repeat a schema, compile it once."""
    return _llg().LLMatcher(tokenizer, grammar, log_level=0)


class GrammarState:
    """One sequence's grammar: an llguidance matcher over `tokenizer` (`load_tokenizer`'s) for `grammar`.
    Never raises when built: a grammar that fails to compile leaves `error` set, and the sampler fails the request
    at its first step (the router checks grammars at admission, so this is a rank-side bug or a bypassed router)."""

    __slots__ = ("matcher", "error")

    def __init__(self, tokenizer, grammar: str):
        self.matcher, self.error = None, None
        try:
            m = _compiled(tokenizer, grammar)
            if m.is_error():
                self.error = f"the grammar does not compile: {m.get_error()[:300]}"
            else:
                self.matcher = m.deep_copy()  # ~3 us, where compiling again takes ~1 ms
        except Exception as e:  # noqa: BLE001 - kept for the request's error, never the step's
            self.error = f"the grammar does not compile: {e!r:.300}"

    def advance(self, token: int) -> bool:
        """Consume the sampled `token`; returns whether the grammar is complete (only EOS may follow).
        Raises ValueError: the grammar rejects the token (it was not in the mask) or is in an error state."""
        if self.matcher is None:
            raise ValueError(self.error or "no grammar")
        if not self.matcher.consume_token(token):
            raise ValueError(f"the grammar rejected token {token}: {self.matcher.get_error()[:300]}")
        return self.matcher.is_stopped()


def grammar_state(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...], grammar: str) -> GrammarState:
    """A sequence's `GrammarState` over `load_tokenizer(tokenizer_json, vocab_size, eos)`. Never raises: a tokenizer
    the library cannot load leaves the state's `error` set (the request fails at its first step, not the rank)."""
    try:
        tok = load_tokenizer(tokenizer_json, vocab_size, eos)
    except Exception as e:  # noqa: BLE001
        s = GrammarState.__new__(GrammarState)
        s.matcher, s.error = None, f"the grammar library could not load the tokenizer: {e!r:.300}"
        return s
    return GrammarState(tok, grammar)


def _get_executor():
    global _executor
    with _lock:
        if _executor is None:
            _executor = _llg().LLExecutor(num_threads=GRAMMAR_THREADS)
        return _executor


def allowed_tokens(states: list[GrammarState], V: int) -> np.ndarray:
    """The next-token masks of `states` (all without `error`), [G, V] bool (True: allowed), in one batched
    call. Raises (ValueError, RuntimeError) on a matcher the library refuses; the caller then goes row by row."""
    W = (V + 31) // 32
    bm = np.zeros((len(states), W), dtype=np.int32)
    _get_executor().unsafe_compute_mask_ptr([(s.matcher, j) for j, s in enumerate(states)], bm.ctypes.data,
                                            W * 4, len(states))
    # bit b of word w is token 32 w + b (little-endian words: byte k of a word holds bits 8k .. 8k + 7)
    return np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)


def apply_grammar_masks(x: np.ndarray, rows: list[int], states: list[GrammarState], errors: dict[int, str]) -> None:
    """Set the disallowed logits of each grammar row of x [B, V] (fp32, in place) to -inf, batched over `rows`
    (their `states`). A row whose grammar is in an error state, whose mask allows no token, or whose matcher the
    batched call refuses (then each row is computed alone) gets its message in `errors` and is left as it is."""
    V = x.shape[1]
    ok = []
    for i, s in zip(rows, states):
        if s.matcher is None or s.matcher.is_error():
            errors[i] = s.error or f"the grammar is in an error state: {s.matcher.get_error()[:300]}"
        else:
            ok.append((i, s))
    if not ok:
        return
    try:
        masks = allowed_tokens([s for _, s in ok], V)
    except Exception:  # noqa: BLE001 - find the row the library refuses
        masks = np.ones((len(ok), V), dtype=bool)
        for j, (i, s) in enumerate(ok):
            try:
                masks[j] = allowed_tokens([s], V)[0]
            except Exception as e:  # noqa: BLE001
                errors[i] = f"the grammar's token mask failed: {e!r:.300}"
    for j, (i, s) in enumerate(ok):
        if i not in errors and not masks[j].any():
            errors[i] = "the grammar allows no next token"
    r = np.asarray([i for i, _ in ok], dtype=np.int64)
    x[r] = np.where(masks, x[r], np.float32(-np.inf))
