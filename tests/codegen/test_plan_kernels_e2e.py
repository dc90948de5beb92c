"""The H200 e2e pre-builds what `deepinfer compile` derives (benchmarks/gpu_e2e.compiler_keys): on the CPU, the
sm90 engine with emulated kernels (batched decode, prefix-cache prompt splits) and the direct one-sequence loop
ask their KernelCache for no kernel outside that prediction -- on the H200 each such kernel is a serial
TileLang build inside the engine's step (session 7: 13 top-k builds, ~150 s)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_e2e as ge  # noqa: E402

PROMPT_LENS = (3, 18)  # 18 = one full 16-row block + 2: the engine splits it there (prefix caching)
TOKENS = 2


def test_engine_and_direct_loop_need_no_kernel_the_compiler_missed(monkeypatch):
    from deepinfer.compiler import compile_model
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.sampler import SamplingParams

    plan = compile_model("deepseek-v4.1-flash:tiny", "sm90").plan
    params, _, _ = ge.model_inputs(plan, "random")
    prompts = [[(7 * i + n) % 500 + 2 for i in range(n)] for n in PROMPT_LENS]
    max_len = max(PROMPT_LENS) + TOKENS + 8
    monkeypatch.setattr(ka, "EMULATE", True)
    llm, _ = ge.emulated_engine(plan, params, max_len, len(prompts))
    llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
    runner = llm.executor.runner
    assert runner.batched_off is None, runner.batched_off  # the batched decode step ran (the engine's default)
    bs = llm.kv.block_size if llm.kv.enable_prefix_caching else 0
    assert bs and max(PROMPT_LENS) > bs, "the prompt split is part of what is checked"
    # the direct loop on the split prompt (its tokens may differ from the engine's: random weights, batched
    # rounding at B = 2; not compared here): every row's logits, one-token steps
    ge.direct_greedy(runner, plan.graph, prompts[-1], TOKENS, max_len, bs)
    asked = set(runner.exec.kernels.build_s)
    predicted, _ = ge.compiler_keys(plan, prompts, TOKENS, max_len, bs)
    assert len(asked) > 10, sorted(k.describe() for k in asked)
    assert ge.lazy_builds(runner.exec.kernels, predicted, "test")["lazy_builds"] == 0, sorted(
        k.describe() for k in asked - set(predicted)
    )
