"""`LLM`: start (or join) Ray, bring up the EP cluster and router, generate, shut down."""
from __future__ import annotations

import logging
import os

import ray

from actors.engine.sampling import SamplingParams, served_kv_profiles
from cluster.config import ClusterConfig
from cluster.launcher import EPCluster
from router_service.router import Router
from router_service.stream import RequestOutput, RequestStream

log = logging.getLogger("moeray")


class LLM:
    """An expert-parallel cluster serving one model.

    Args:
        model: folder with config.json, *.safetensors, tokenizer.json (default: the shipped tiny-moe).
        ranks: EP world size (default 2 on CPU, one per GPU on CUDA).
        address: Ray cluster address; else RAY_ADDRESS; else a private local Ray is started and
            stopped by `shutdown()`.
        kv_bits: quantize the KV cache to 2, 3 or 4 bits per element (None: full precision); shorthand for
            `engine_options={"kv_bits": ...}`.
        kv_profile: the deployment's default KV quantization profile (a name in `<model>/kv_profiles`, "auto",
            a profile path or folder; None: "auto"). A request's `SamplingParams.kv_profile` overrides it for that
            request (`kv_profiles` lists the names a request may give).
        **cluster_kw: any `ClusterConfig` field (dtype, max_model_len, max_num_seqs, kv_cache_bytes,
            placement_timeout_s: seconds to wait for Ray to place the ranks, default 300, ...).
    Raises:
        ValueError: bad configuration (names the field). `cluster.node_groups.PlacementTimeoutError` (a
            TimeoutError): the ranks were not placed within placement_timeout_s (the message says what was asked
            for and what the cluster has); a Ray this call started is shut down again.
    """

    def __init__(self, model: str | None = None, ranks: int | None = None, address: str | None = None,
                 max_queue: int | None = None, kv_bits: int | None = None, kv_profile: str | None = None, **cluster_kw):
        if model is not None:
            cluster_kw["model"] = model
        if ranks is not None:
            cluster_kw["ranks"] = ranks
        if kv_bits is not None or kv_profile is not None:
            opts = dict(cluster_kw.get("engine_options") or {})
            opts.update({k: v for k, v in (("kv_bits", kv_bits), ("kv_profile", kv_profile)) if v is not None})
            cluster_kw["engine_options"] = opts
        self.config = ClusterConfig.auto(**{k: v for k, v in cluster_kw.items() if v is not None})
        self._started_ray = False
        self._chat_template = None  # loaded on the first `chat`
        if not ray.is_initialized():
            addr = address or os.environ.get("RAY_ADDRESS")
            if addr:
                ray.init(address=addr, log_to_driver=False)
            else:
                need = self.config.ranks * self.config.num_cpus_per_rank
                # "local": a private cluster even when a `ray start` on this machine recorded one (ray.init()'s
                # default would join it, and refuse num_cpus there)
                ray.init(address="local", num_cpus=max(2, int(need + 1.999)), include_dashboard=False,
                         log_to_driver=False)
                self._started_ray = True
        try:
            self.cluster = EPCluster(self.config)
        except BaseException:
            if self._started_ray:
                ray.shutdown()
            raise
        self.router = Router(self.cluster, max_queue=max_queue)

    @property
    def kv_profiles(self) -> tuple[str, ...]:
        """KV quantization profile names a request may put in `SamplingParams.kv_profile` (besides "auto");
        () when the KV cache is full precision."""
        opts = self.config.engine_options
        return served_kv_profiles(self.config.model, opts.get("kv_bits"), opts.get("kv_profile"),
                                  tuple(opts.get("kv_extra_bits") or ()))

    def generate(self, prompts: str | list, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids), in order. A rejected prompt (e.g. a
        `kv_profile` the cluster does not serve) gets `finish_reason == "error"` with the reason; the others
        are served."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.router.generate(prompts, params or SamplingParams())

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of {"role", "content"} dicts) or to each of
        several, as vLLM's `LLM.chat`: the model's chat template (tokenizer_config.json `chat_template`, else
        `router_service.chat_template.DEFAULT_CHAT_TEMPLATE`) renders each conversation with the generation
        prompt and `tools` (OpenAI tool definitions, `{"type": "function", "function": {"name", ...}}`, rendered
        into every conversation as vLLM's `LLM.chat(tools=...)` does: the model sees them; no tool-call parsing),
        and that text is the request's `prompt`.
        Raises:
            ValueError: a message is not a dict with string `role` and `content` (names it, e.g.
                `messages[0][1].content`), a tool is not a function definition with a string name (names it,
                e.g. `tools[0].function.name`), or the template rejects the conversation."""
        from router_service.chat_template import load_chat_template

        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if not convs:
            raise ValueError("messages is empty: give one conversation or a list of them")
        for i, conv in enumerate(convs):
            if not isinstance(conv, list) or not conv:
                raise ValueError(f"messages[{i}] must be a non-empty list of {{'role', 'content'}} dicts")
            for j, m in enumerate(conv):
                for k in ("role", "content"):
                    if not isinstance(m, dict) or not isinstance(m.get(k), str):
                        raise ValueError(f"messages[{i}][{j}].{k} must be a string")
        for i, t in enumerate(tools or []):
            fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}].function.name must be a string (a tool is "
                                 "{'type': 'function', 'function': {'name': ...}})")
        if self._chat_template is None:
            self._chat_template = load_chat_template(self.config.model)
        # a template's own refusal raises InvalidRequestError, a ValueError naming `messages`
        return self.generate([self._chat_template.render(conv, tools) for conv in convs], params)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestStream:
        """Submit one prompt; iterate the returned stream for token outputs as they are produced."""
        return self.router.submit(prompt, params or SamplingParams())

    def stats(self) -> dict:
        return self.router.stats()

    def shutdown(self) -> None:
        self.router.close()
        if self._started_ray:
            ray.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
