"""Chat templates: a checkpoint's Jinja `chat_template` (or a plain default) rendered in a sandbox, shared by
`/v1/chat/completions` and `LLM.chat`.

Tools reach the template as transformers' `apply_chat_template(tools=...)` passes them: `tools`, a list of
OpenAI tool definitions (`{"type": "function", "function": {"name", "description", "parameters"}}`), or None;
`tojson` is transformers' (no HTML escaping; `indent`, `separators`, `sort_keys`, `ensure_ascii`). The default
template renders them first, as a system block, one line per function:

    System: Tools:
    - get_weather: forecast; parameters: {"type": "object", "properties": {...}}
    - ping; no parameters
"""
from __future__ import annotations

import json
import os

from router_service.errors import InvalidRequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}System: Tools:\n{% for t in tools %}{% set f = t.function %}- {{ f.name }}"
    "{{ ': ' ~ f.description if f.description else '' }}"
    "{{ '; parameters: ' ~ (f.parameters | tojson) if f.parameters else '; no parameters' }}\n"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' chat-template `tojson` (Jinja's own escapes <, >, & and ' for HTML)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A Jinja chat template rendered in an immutable sandbox (templates come with checkpoints).

    Args:
        source: template text. bos_token / eos_token: strings the template may use.
    Raises (from `render`):
        InvalidRequestError: the template rejects the conversation (`raise_exception`) or fails.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = "default"):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise InvalidRequestError("messages", msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source)
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text of `messages` (dicts with `role`, `content`, maybe `name`) and `tools` (OpenAI tool
        definitions as dicts, or None: no tools), with the generation prompt."""
        try:
            return self.template.render(messages=messages, tools=tools or None, add_generation_prompt=True,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem, not a 500
            raise InvalidRequestError("messages", f"chat template failed: {type(e).__name__}: {e}") from e


def load_chat_template(model_dir: str) -> ChatTemplate:
    """The checkpoint's chat template (tokenizer_config.json `chat_template`; a list of named templates
    picks `default`), else `DEFAULT_CHAT_TEMPLATE`."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    cfg: dict = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)

    def tok(name):
        v = cfg.get(name) or ""
        return v.get("content", "") if isinstance(v, dict) else str(v)

    src = cfg.get("chat_template")
    if isinstance(src, list):
        src = next((t.get("template") for t in src if t.get("name") == "default"), None)
    if src:
        return ChatTemplate(src, tok("bos_token"), tok("eos_token"), origin=path)
    return ChatTemplate(DEFAULT_CHAT_TEMPLATE, tok("bos_token"), tok("eos_token"))
