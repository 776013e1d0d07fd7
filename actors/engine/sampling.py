"""Sampling parameters: what a request asks of the sampler (`actors.engine.sampler`), validated."""
from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field

from actors.kv.profile_choice import AUTO as KV_PROFILE_AUTO
from actors.moe.gating import POLICIES

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # top alternatives per token at most (`logprobs`, `prompt_logprobs`), as OpenAI's API
MAX_LOGIT_BIAS = 300  # `logit_bias` entries at most, as OpenAI's API
LOGIT_BIAS_LIMIT = 100.0  # a bias is in [-100, 100], as OpenAI's API
PENALTY_LIMIT = 2.0  # presence / frequency penalties are in [-2, 2], as OpenAI's API and vLLM
# KV quantization profile names a request may give: the calibration domain ("prose", "code") or "auto".
# No path separators, so a request can only pick among the profiles the ranks loaded, never name a file.
MAX_KV_PROFILE_LEN = 64
_KV_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_kv_profile_name(value) -> None:
    """Check the form of a request's `kv_profile` (None passes): a string of 1-64 letters, digits, `_`, `-`,
    `.`, starting with a letter or digit. Whether the cluster serves that profile is `check_kv_profile`'s job.

    Raises:
        ValueError: naming `kv_profile`, the value (shortened) and the rule.
    """
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"kv_profile={value!r:.80} must be a string (a profile name or 'auto'), "
                         f"not {type(value).__name__}")
    if len(value) > MAX_KV_PROFILE_LEN or not _KV_PROFILE_NAME.fullmatch(value):
        raise ValueError(f"kv_profile={value!r:.80} must be a profile name of 1-{MAX_KV_PROFILE_LEN} letters, "
                         "digits, '_', '-' or '.', starting with a letter or digit (e.g. 'prose', 'code', 'auto')")


def parse_logit_bias(v) -> dict[int, float] | None:
    """`logit_bias` as {token id: bias}: keys ints or decimal strings (JSON object keys), biases numbers in
    [-100, 100], 300 entries at most; None stays None. Ids against the vocabulary: `router_service.admission`.

    Raises:
        ValueError: naming `logit_bias`, the bad key or bias and the limit.
    """
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError(f"logit_bias: must map token ids to biases, not {type(v).__name__}")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: {len(v)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for k, b in v.items():
        if isinstance(k, bool) or not (isinstance(k, int) and k >= 0 or isinstance(k, str) and re.fullmatch(r"\d{1,10}", k)):
            raise ValueError(f"logit_bias: key {k!r:.40} is not a token id (an integer >= 0)")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias: the bias of token {k} is {b!r:.40}; it must be a number in "
                             f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        out[int(k)] = float(b)
    return out


@functools.lru_cache(maxsize=16)
def served_kv_profiles(model_dir: str, kv_bits: int | None, kv_profile: str | None = None,
                       kv_extra_bits: tuple[int, ...] = ()) -> tuple[str, ...]:
    """Names of the KV quantization profiles ranks started with (`kv_bits`, `kv_profile` engine options) load.

    Resolved exactly as the ranks resolve them (`actors.kv.profiles.load_served_profiles`, same model folder
    and options; `kv_extra_bits` widths are named "<name>-<b>bit"), once per argument tuple (the profiles are a few KiB per layer). Returns () for a full-precision
    KV cache (`kv_bits` None).

    Raises:
        ValueError: the options name no loadable profile (the ranks would have failed to start, too).
    """
    if kv_bits is None:
        return ()
    from actors.kv.profiles import load_served_profiles

    profiles, _ = load_served_profiles(model_dir, kv_bits, kv_profile, tuple(kv_extra_bits))
    return tuple(sorted(profiles))


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to pick each next token of one request (vLLM-compatible names).

    temperature: 0 means greedy (so does anything below `actors.engine.sampler.GREEDY_BELOW_TEMPERATURE`, 1e-5,
    as in vLLM); otherwise in (0, 100]. top_k: 0 or -1 disables, else >= 1.
    top_p: in (0, 1]. max_tokens: output tokens at most, >= 1 (0: only the prompt is run, for its
    `prompt_logprobs`; no token is sampled). seed: per-request RNG seed (None: random).
    stop: strings that end generation (not included in the text). stop_token_ids: extra ids that end
    it (included in token_ids only if they are not EOS; their text never is). ignore_eos: keep going past EOS (benchmarks).
    gating: this request's gating policy (`actors.moe.gating.POLICIES`), None = the deployment's.
    kv_profile: this request's KV quantization profile (a calibrated profile name such as "prose" or "code", or
    "auto": chosen from the prompt text by `actors.kv.profile_choice.choose_profile`); None = the deployment's
    default (`--kv-profile`). Only a quantized KV cache (`--kv-bits`) has profiles: there, a name the ranks did
    not load is an error; on a full-precision cache any name but "auto" is an error (`check_kv_profile`).
    logprobs: per output token, its log-probability and those of the `logprobs` (0-20) most probable tokens;
    None = off. prompt_logprobs: the same for every prompt token but the first (vLLM's extension); None = off.
    Both are log_softmax of the model's raw logits in fp32 (before temperature / top-k / top-p, vLLM's default
    `raw_logprobs`), computed on the rank (`actors.engine.logprobs`).
    Logit controls (`actors.engine.penalties`, applied on the rank before temperature / top-k / top-p and greedy
    argmax; logprobs stay raw): logit_bias: token id -> bias in [-100, 100] added to its logit (300 entries at
    most); min_tokens: EOS (unless ignore_eos), `stop_token_ids` and stop strings cannot end the output before
    min_tokens tokens (<= max_tokens); repetition_penalty (> 0, 1 = off; vLLM / HF CTRL semantics over prompt +
    output tokens): a seen token's logit is divided by it if > 0, else multiplied; presence_penalty and
    frequency_penalty (in [-2, 2], OpenAI semantics over the generated tokens): logit -= presence * (count > 0)
    + frequency * count.
    grammar: constrained decoding (`actors.engine.grammar`): an llguidance grammar (JSON text, compiled and checked
    at the router's edge from `response_format` / `tools`); each token is drawn from the tokens it allows, EOS
    only where it accepts, and the output ends ("stop") when it is complete. Not with ignore_eos or min_tokens
    (the grammar decides where the output ends). None = off.

    Raises:
        ValueError: naming the field, its value and the allowed range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    gating: str | None = None
    kv_profile: str | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.gating is not None and self.gating not in POLICIES:
            raise ValueError(f"gating={self.gating!r} must be one of {', '.join(POLICIES)}")
        check_kv_profile_name(self.kv_profile)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (self.temperature == self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature={self.temperature} must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1, 0 (disabled) or >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be an integer >= 0 (0: the prompt only)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name}={k!r} must be an integer in [0, {MAX_LOGPROBS}] (or None: off)")
        self._check_controls()
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    def _check_controls(self) -> None:
        """Ranges of the logit controls (`actors.engine.penalties`); ids against the vocabulary are the router's
        check (`router_service.admission`). Raises ValueError naming the field, the value and the limit."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise ValueError(f"{name}={v!r} must be a number in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp < float("inf"):
            raise ValueError(f"repetition_penalty={rp!r} must be a finite number > 0 (1: off)")
        mt = self.min_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 <= mt <= self.max_tokens:
            raise ValueError(f"min_tokens={mt!r} must be an integer in [0, max_tokens={self.max_tokens}]")
        self.logit_bias = parse_logit_bias(self.logit_bias)
        if self.grammar is not None:
            if not isinstance(self.grammar, str) or not self.grammar:
                raise ValueError(f"grammar must be a non-empty string (an llguidance grammar), not {self.grammar!r:.40}")
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise ValueError(f"{name}={getattr(self, name)!r} cannot be combined with a grammar (response_format "
                                     "or tools): the grammar decides where the output ends")

    @property
    def has_logit_controls(self) -> bool:
        """Whether any logit control is on (`actors.engine.penalties` state is kept for this request)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def check_kv_profile(self, model_dir: str, engine_options: dict) -> None:
        """Check `kv_profile` against the profiles a cluster serves (`model_dir` and its ranks' `engine_options`,
        i.e. `kv_bits` and the default `kv_profile`); None always passes.

        Raises:
            ValueError: `kv_profile=...` is not served (names the served profiles), or names a profile while the
                KV cache is full precision ("auto" is accepted there and does nothing).
        """
        name = self.kv_profile
        if name is None:
            return
        bits = engine_options.get("kv_bits")
        served = served_kv_profiles(model_dir, bits, engine_options.get("kv_profile"),
                                    tuple(engine_options.get("kv_extra_bits") or ()))
        if bits is None:
            if name != KV_PROFILE_AUTO:
                raise ValueError(f"kv_profile={name!r} needs a quantized KV cache; this deployment keeps the KV "
                                 "cache in full precision (start it with --kv-bits 2, 3 or 4, or engine_options.kv_bits in the Serve "
                                 "config's cluster_options), so only null or "
                                 "'auto' is accepted")
            return
        if name != KV_PROFILE_AUTO and name not in served:
            raise ValueError(f"kv_profile={name!r} is not served; available: {', '.join(served)} or auto")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)
