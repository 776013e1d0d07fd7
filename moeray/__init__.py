"""moeray: expert-parallel MoE serving on Ray.

The Python API for programs:

    from moeray import LLM, SamplingParams
    llm = LLM(model="models/tiny-moe", ranks=2)
    outs = llm.generate(["To be, or not to be"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].text)  # or, as in vLLM, outs[0].outputs[0].text
    llm.shutdown()
"""
from actors.engine.sampling import SamplingParams
from moeray.api import LLM
from router_service.stream import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
