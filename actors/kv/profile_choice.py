"""Which KV quantization profile a request uses: a loaded name, or the `auto` rule on the prompt text.

The `auto` rule (`choose_profile`): a prompt is code when at least `CODE_CHAR_THRESHOLD` of its characters
are code punctuation (`CODE_CHARS`) or indentation spaces (runs of >= 2 spaces after a newline). Costs one
pass over the prompt text; on the held-out slices it separates the domains by a wide margin (prose ~1.4%,
Python ~23%; of 300-character chunks, ~1% of prose and ~98% of code score >= 0.06).
Contract: the result is always one of the loaded names; an unknown requested name raises ValueError. Plain
Python: importing it pulls in neither torch nor the kernels.
"""
from __future__ import annotations

import re

AUTO = "auto"
# Apostrophes, hyphens and colons are left out: verse and prose use them often.
CODE_CHARS = frozenset("{}[]()<>=;_#*/\\|&^%$@`~+\"")
CODE_CHAR_THRESHOLD = 0.06
_INDENT = re.compile(r"\n( {2,}|\t+)")


def code_fraction(text: str) -> float:
    """Fraction of `text`'s characters that look like code: CODE_CHARS plus indentation after newlines."""
    if not text:
        return 0.0
    n = sum(1 for c in text if c in CODE_CHARS)
    n += sum(len(m.group(1)) for m in _INDENT.finditer(text))
    return n / len(text)


def choose_profile(requested: str | None, available: list[str], default: str, text: str | None = None) -> str:
    """The profile a sequence uses.

    Args:
        requested: the request's profile name, "auto", or None (use `default`).
        available: names of loaded profiles.
        default: the engine's default name or "auto".
        text: the prompt text, needed only for "auto" (None counts as prose).
    Returns:
        A name from `available`. `auto` picks "code" when code_fraction(text) >= CODE_CHAR_THRESHOLD and
        a "code" profile exists, else "prose" if it exists, else the first available name.
    Raises:
        ValueError: the requested name is not available.
    """
    name = requested or default
    if name != AUTO:
        if name not in available:
            raise ValueError(f"kv_profile={name!r} is not loaded; available: {sorted(available)} or 'auto'")
        return name
    if text is not None and "code" in available and code_fraction(text) >= CODE_CHAR_THRESHOLD:
        return "code"
    if "prose" in available:
        return "prose"
    return sorted(available)[0]
