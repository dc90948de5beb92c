"""deepinfer: a compiler-driven inference toolkit for DeepSeek-V4.1-Flash and V4-Flash.

    from deepinfer import LLM, SamplingParams
    llm = LLM(model="deepseek-v4-flash", target="cpu")     # or LLM(plan="PLAN_DIR")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

__version__ = "0.1.0"

from deepinfer.errors import DeepInferError  # noqa: E402

__all__ = ["LLM", "DeepInferError", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # the runtime pulls in torch; load it on first use so `import deepinfer` (and the CLI's --help) stays light
    if name == "LLM" or name == "RequestOutput":
        from deepinfer.runtime import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from deepinfer.runtime.sampler import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
