"""How much a model amplifies accumulation-order-sized differences at its kernels' number formats (CPU).

    python3 benchmarks/format_sensitivity.py [--model deepseek-v4.1-flash:tiny] [--weights random|trained]
        [--prompts 3] [--extra 40] [--only-op OP[,OP...] | --by-op] [--flips]

The sm90 plan's graph runs with every bound kernel replaced by its torch emulation (same bf16/FP8 operands,
reference math: runtime/kernel_adapters.emulated_kernel), teacher-forced over a few prompts, once as is and
once with every node output multiplied by (1 + 1e-6 N(0, 1)) (gpu_e2e.perturbed_executor). Printed per prompt:
the max |logit difference|, its share of the logit range, and the share of positions whose top-2 margin exceeds
twice that position's difference ("decisive"). A model whose difference is a large share of the range is
chaotic at these formats: no two implementations that sum in another order can agree on its greedy tokens
(gpu_e2e.py's end-to-end check measures the same envelope on the H200 and holds the kernels to it).

Diagnosis: ``--only-op`` perturbs only the outputs of those op kinds; ``--by-op`` does that for every op kind
with floating outputs, one line each; ``--flips`` also counts the discrete decisions that differ between the
two runs (integer outputs -- MoE routing, index / candidate top-k, compared as sets -- and FP8 codes) per op
kind, and names the first node whose output moved by more than 1% of its scale.
``--weights peaked`` uses models/peaked_weights.py's weights (and its task's sequences) instead of the preset's
seeded random ones; ``--greedy`` continues each prompt with the formats path's own greedy tokens instead.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEQ_EXTRA_STRIDE = (7, 3)  # teacher-forced continuation token i = (7 i + 3) % 1000


def load(model: str, weights: str = "random", **peaked_kw):
    """The sm90 plan of ``model``, its CPU parameters (experts restacked as the grouped kernel reads them) and,
    for ``weights="peaked"``, the task written into them (models/peaked_weights.py; else None)."""
    from deepinfer.compiler import compile_model
    from deepinfer.runtime.cuda_executor import restack_experts
    from deepinfer.runtime.plan import bind_weights

    plan = compile_model(model, "sm90").plan
    params, _ = bind_weights(plan)
    task = None
    if weights == "peaked":
        from deepinfer.models.peaked_weights import peaked_weights

        params, task = peaked_weights(params, **peaked_kw)
    restack_experts(plan.graph, params)
    return plan, params, task


def recorded_run(ex, feeds) -> tuple[torch.Tensor, dict]:
    """Logits and every node's outputs (name -> (op, outputs)) of one run of ``ex``."""
    rec: dict = {}
    orig = ex._run_node

    def hook(step, args, attrs, t):
        outs = orig(step, args, attrs, t)
        rec[step.outputs[0]] = (step.node.op, [o.detach().clone() if torch.is_tensor(o) else o for o in outs])
        return outs

    ex._run_node = hook
    try:
        logits = ex.run(feeds)[0].float()
    finally:
        del ex._run_node
    return logits, rec


def discrete_flips(rec_a: dict, rec_b: dict) -> tuple[Counter, str]:
    """Per op kind: rows of integer outputs that differ as sets (routing / top-k choices) and FP8 codes that
    differ; and the first node (graph order) whose floating output moved by more than 1% of its max."""
    flips: Counter = Counter()
    first = ""
    for name, (op, outs_a) in rec_a.items():
        for x, y in zip(outs_a, rec_b[name][1]):
            if not torch.is_tensor(x) or x.shape != y.shape or x.numel() == 0:
                continue
            if x.dtype in (torch.int32, torch.int64):
                xs, ys = (x.sort(-1).values, y.sort(-1).values) if x.dim() else (x, y)
                rows = (xs != ys).reshape(-1, xs.shape[-1] if xs.dim() else 1).any(-1)
                flips[f"{op} rows"] += int(rows.sum())
            elif x.dtype == torch.float8_e4m3fn:
                flips[f"{op} fp8 codes"] += int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
            elif x.is_floating_point() and not first:
                d = float((x.float() - y.float()).abs().max())
                if d > 0.01 * float(x.float().abs().max().clamp_min(1e-30)):
                    first = f"{name} ({op}): {d:.3g} of max {float(x.float().abs().max()):.3g}"
    return flips, first or "none above 1%"


def sensitivity(plan, params, seqs: list[tuple[list[int], int]], ops=None, eps: float = 1e-6,
                flips: bool = False) -> dict:  # fmt: skip
    """The formats path against itself with a relative ``eps`` perturbation of ``ops``' outputs (all ops when
    None), teacher-forced over ``seqs`` ((tokens, prompt length) pairs): worst |logit difference| and its share
    of the logit range, the share of decisive continuation positions (from the prompt's last one on: the
    positions greedy decoding reads), flips."""
    import gpu_e2e as g

    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import GraphExecutor, KernelCache

    ka.EMULATE = True  # the emulated kernels take CPU tensors
    try:
        exact = GraphExecutor(plan.graph, params, kernels=KernelCache(builder=ka.emulated_kernel), verify=False)
        perturbed = g.perturbed_executor(plan.graph, params, eps=eps, ops=ops)
        torch.manual_seed(0)
        diffs, shares, decisive, body, counts, firsts = [], [], [], [], Counter(), []
        for seq, plen in seqs:
            lf, rec_f = recorded_run(exact, g._teacher_inputs(plan.graph, seq, "cpu"))
            ln, rec_n = recorded_run(perturbed, g._teacher_inputs(plan.graph, seq, "cpu"))
            err = (ln - lf).abs().amax(-1)[plen - 1:]
            lf = lf[plen - 1:]
            diffs.append(float(err.max()))
            body.append(float((lf - embedding_only_logits(params, seq[plen - 1:])).abs().amax(-1).median()))
            shares.append(float(err.max()) / float(lf.amax() - lf.amin()))
            top2 = lf.topk(2, -1).values
            decisive.append(float(((top2[:, 0] - top2[:, 1]) > 2 * err).float().mean()))
            if flips:
                c, first = discrete_flips(rec_f, rec_n)
                counts.update(c)
                firsts.append(first)
    finally:
        ka.EMULATE = False
    return {"diffs": diffs, "shares": shares, "decisive": decisive, "body": body, "flips": counts, "first": firsts}


def embedding_only_logits(params: dict, tokens: list[int]) -> torch.Tensor:
    """The logits the model would give if its layers added nothing to the residual stream: the head applied to
    the final RMSNorm of each token's embedding. Their distance to the real logits is how much the layers
    (attention, MoE, Engram, mHC) move the prediction."""
    e = params["embed.weight"][torch.tensor(tokens)].float()
    h = e / e.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * params["norm.weight"].float()
    return h @ params["head.weight"].float().T


def probe_seqs(vocab: int, n_prompts: int, extra: int, task=None) -> list[tuple[list[int], int]]:
    """The 5th, 6th, ... of gpu_e2e's equality prompts, each continued by ``extra`` tokens: a fixed stride
    pattern for random weights, the task's own continuation for peaked weights (what greedy decoding feeds);
    with each prompt's length."""
    import gpu_e2e as g

    a, b = SEQ_EXTRA_STRIDE
    if task is not None:
        return [(p + task.continuation(p, extra), len(p)) for p in task.prompts(g.EQ_PROMPT_LENS)[4:4 + n_prompts]]
    return [(p + [(a * i + b) % min(1000, vocab) for i in range(extra)], len(p))
            for p in g.eq_prompts(vocab=vocab)[4:4 + n_prompts]]  # fmt: skip


def own_greedy(plan, params, prompt: list[int], n: int) -> list[int]:
    """``prompt`` followed by the formats path's own ``n`` greedy tokens (emulated kernels, decoded one token at a
    time through the runner, as gpu_e2e.direct_greedy does on the GPU)."""
    import gpu_e2e as g

    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import CudaRunner, KernelCache

    ka.EMULATE = True
    try:
        runner = CudaRunner(plan.graph, params, device="cpu", kernels=KernelCache(builder=ka.emulated_kernel),
                            verify=False, max_model_len=len(prompt) + n + 8, cuda_graphs=False)  # fmt: skip
        return prompt + g.direct_greedy(runner, plan.graph, prompt, n, len(prompt) + n + 8)
    finally:
        ka.EMULATE = False


def float_ops(plan) -> list[str]:
    """Op kinds that have a floating output (the ones a perturbation can touch), in first-appearance order."""
    seen: dict = {}
    for n in plan.graph.nodes:
        if any(str(v.dtype) in ("f32", "bf16") for v in n.outputs):
            seen.setdefault(n.op, None)
    return list(seen) or sorted({n.op for n in plan.graph.nodes})


def _line(label: str, r: dict) -> str:
    s = ", ".join(f"{x:.3f} ({y:.1%})" for x, y in zip(r["diffs"], r["shares"]))
    d = ", ".join(f"{x:.0%}" for x in r["decisive"])
    b = ", ".join(f"{x:.2f}" for x in r["body"])
    return (f"{label}: max |logit diff| (share of the logit range) {s}; decisive continuation positions {d}; "
            f"layers move the logits by (median over positions of max |logits - embedding-only logits|) {b}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4.1-flash:tiny")
    ap.add_argument("--weights", choices=("random", "peaked"), default="random")
    ap.add_argument("--embed-gain", type=float, default=None, help="peaked weights: embed_gain (default: the module's)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--extra", type=int, default=40, help="tokens appended to each prompt (teacher-forced)")
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--only-op", default="", help="comma list of op kinds whose outputs are perturbed")
    ap.add_argument("--by-op", action="store_true", help="one line per op kind, perturbing only that kind")
    ap.add_argument("--flips", action="store_true", help="count differing routing / top-k / FP8 decisions")
    ap.add_argument("--greedy", action="store_true",
                    help="continue each prompt with the formats path's own greedy tokens (what gpu_e2e feeds)")
    args = ap.parse_args(argv)

    kw = {"embed_gain": args.embed_gain} if args.embed_gain is not None else {}
    plan, params, task = load(args.model, args.weights, **kw)
    vocab = int(plan.graph.outputs[0].shape[-1])
    seqs = probe_seqs(vocab, args.prompts, args.extra, task)
    if args.greedy:
        seqs = [(own_greedy(plan, params, s[:n], args.extra), n) for s, n in seqs]
    print(f"{args.model} ({args.weights} weights), eps {args.eps:g}, sequences of {[len(s) for s, _ in seqs]} tokens",
          flush=True)  # fmt: skip
    groups = [[op] for op in float_ops(plan)] if args.by_op else [args.only_op.split(",") if args.only_op else None]
    for ops in groups:
        r = sensitivity(plan, params, seqs, ops=set(ops) if ops else None, eps=args.eps, flips=args.flips)
        print(_line(",".join(ops) if ops else "all ops", r), flush=True)
        if args.flips:
            print("   flips: " + (", ".join(f"{k} {v}" for k, v in sorted(r["flips"].items()) if v) or "none"))
            print("   first node moved > 1%: " + " | ".join(r["first"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
