"""How much a model amplifies accumulation-order-sized differences at its kernels' number formats (CPU).

    python3 benchmarks/format_sensitivity.py [--model deepseek-v4.1-flash:tiny] [--prompts 3] [--extra 40]

The sm90 plan's graph runs with every bound kernel replaced by its torch emulation (same bf16/FP8 operands,
reference math: runtime/kernel_adapters.emulated_kernel), teacher-forced over a few prompts, once as is and
once with every node output multiplied by (1 + 1e-6 N(0, 1)) (gpu_e2e.perturbed_executor). Printed per prompt:
the max |logit difference|, its share of the logit range, and the share of positions whose top-2 margin exceeds
twice that position's difference ("decisive"). A model whose difference is a large share of the range is
chaotic at these formats: no two implementations that sum in another order can agree on its greedy tokens
(gpu_e2e.py's end-to-end check measures the same envelope on the H200 and holds the kernels to it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4.1-flash:tiny")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--extra", type=int, default=40, help="tokens appended to each prompt (teacher-forced)")
    args = ap.parse_args(argv)

    import gpu_e2e as g

    from deepinfer.compiler import compile_model
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache, restack_experts
    from deepinfer.runtime.plan import bind_weights

    ka.EMULATE = True  # the emulated kernels take CPU tensors
    plan = compile_model(args.model, "sm90").plan
    params, _ = bind_weights(plan)
    restack_experts(plan.graph, params)
    exact = GraphExecutor(plan.graph, params, kernels=KernelCache(builder=ka.emulated_kernel), verify=False)
    perturbed = g.perturbed_executor(plan.graph, params)
    torch.manual_seed(0)
    for p in g.eq_prompts()[4 : 4 + args.prompts]:
        seq = p + [(7 * i + 3) % 1000 for i in range(args.extra)]
        lf = exact.run(g._teacher_inputs(plan.graph, seq, "cpu"))[0].float()
        ln = perturbed.run(g._teacher_inputs(plan.graph, seq, "cpu"))[0].float()
        err = (ln - lf).abs().amax(-1)
        rng = float(lf.amax() - lf.amin())
        top2 = lf.topk(2, -1).values
        decisive = float(((top2[:, 0] - top2[:, 1]) > 2 * err).float().mean())
        print(f"{args.model} {len(seq)} tokens: max |diff| {float(err.max()):.4f}, logit range {rng:.2f} "
              f"({float(err.max()) / rng:.1%}), decisive positions {decisive:.0%}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
