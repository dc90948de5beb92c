"""The ``deepinfer`` command.

    deepinfer compile | run | tune | bench | inspect | make-checkpoint   (each with --help)

User errors (a DeepInferError) print one line and exit 2; ``--debug`` shows the traceback. A subcommand
that is not built yet says so in one line and exits 2; nothing prints made-up results.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from deepinfer.errors import DeepInferError, NotBuiltError

MODELS = ("deepseek-v4.1-flash", "deepseek-v4-flash")
TARGETS = ("cpu", "sm90", "sm100", "ascend950")


# ---------------------------------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from deepinfer.ir.load import load_any
    from deepinfer.ir.printer import print_graph, summary

    g = load_any(args.file)
    if not args.summary_only:
        sys.stdout.write(print_graph(g))
    print(summary(g))
    return 0


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    try:
        from deepinfer.models.checkpoint import make_checkpoint
    except ImportError:
        raise NotBuiltError("make-checkpoint is not built yet (models/checkpoint.py, issue 3)") from None
    path = make_checkpoint(args.model, args.preset, args.out, seed=args.seed)
    print(f"wrote {args.model} ({args.preset}) checkpoint to {path}")
    return 0


def _default_model(spec: str | None) -> str | None:
    """The model to use when none is named: the default one, or V4-Flash while the V4.1 graph is not built."""
    if spec is not None or os.environ.get("DEEPINFER_HF_MODEL_DIR"):
        return spec
    from deepinfer.models import DEFAULT_MODEL, get_model

    try:
        get_model(DEFAULT_MODEL)
        return None
    except ImportError:
        print(f"note: the {DEFAULT_MODEL} graph is not built yet; using deepseek-v4-flash")
        return "deepseek-v4-flash"


def _plan_weights(plan) -> tuple[dict, str]:
    from deepinfer.models.checkpoint import load_checkpoint, random_weights
    from deepinfer.models.presets import weight_block_size

    if "checkpoint" in plan.weights:
        return load_checkpoint(plan.weights["checkpoint"], plan.graph.params), plan.weights["checkpoint"]
    seed = int(plan.weights.get("random_seed", 0))
    block = weight_block_size(plan.config)
    source = f"random weights (seed {seed}) in the checkpoint formats"
    return random_weights(plan.graph.params, seed, block=block), source


def _compile(args: argparse.Namespace):
    from deepinfer.compiler import compile_model

    res = compile_model(_default_model(args.model), args.target, seed=args.seed, dump_ir=args.dump_ir)
    g = res.plan.graph
    print(
        f"compiled {res.plan.model} for {res.plan.target}: graph built in {res.build_s:.2f} s, "
        f"{len(res.plan.report.splitlines()) - 2} passes in {res.passes_s:.2f} s, "
        f"{res.nodes_before} -> {len(g.nodes)} nodes"
    )
    if getattr(args, "verbose", True):
        print(res.plan.report)
    if args.dump_ir:
        print(f"IR after every pass: {args.dump_ir}")
    return res.plan


def cmd_compile(args: argparse.Namespace) -> int:
    from deepinfer.runtime.plan import write_plan

    if not args.output:
        raise DeepInferError("compile needs -o PLAN_DIR")
    plan = _compile(args)
    print(f"wrote plan {write_plan(plan, args.output, overwrite=args.overwrite)}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from deepinfer.ir.printer import summary
    from deepinfer.models.tokenizer import encode_chat, get_tokenizer
    from deepinfer.runtime.plan import load_plan
    from deepinfer.runtime.session import greedy_generate

    if args.max_tokens <= 0:
        raise DeepInferError(f"--max-tokens must be positive, got {args.max_tokens}")
    prompts = args.prompt or ["What is the capital of France?"]
    if any(not p for p in prompts):
        raise DeepInferError("empty prompt")
    if args.plan:
        plan = load_plan(args.plan)
        if plan.target != "cpu":
            raise DeepInferError(f"plan {args.plan} was compiled for {plan.target}; this runtime runs 'cpu' plans")
    else:
        args.target, args.dump_ir = "cpu", None
        plan = _compile(args)
    params, source = _plan_weights(plan)
    tok = get_tokenizer()
    print(f"\nmodel: {plan.model} ({source})")
    print(summary(plan.graph))
    for prompt in prompts:
        ids = encode_chat([{"role": "user", "content": prompt}])
        res = greedy_generate(plan.graph, params, ids, args.max_tokens, stop_ids=(tok.eos_id,))
        print(f"\nprompt ({len(ids)} tokens): {prompt!r}")
        print(f"output ({len(res.output_ids)} tokens): {tok.decode(res.output_ids)!r}")
        print(f"token ids: {res.output_ids}")
        print(
            f"prefill {res.prefill_s * 1000:.0f} ms; decode {res.decode_tok_s:.1f} tok/s "
            "(CPU: the ops' torch references run one by one; compiled kernels come with issue 6)"
        )
    if source.startswith("random"):
        print("\nnote: random weights generate noise; pass --model DIR (or DEEPINFER_HF_MODEL_DIR) for a checkpoint")
    return 0


def _not_built(what: str, issue: int) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise NotBuiltError(f"`deepinfer {what}` is not built yet (issue {issue})")

    return run


# ---------------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer",
        description="Compile DeepSeek-V4.1-Flash / V4-Flash to a plan and run it.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a model to a plan directory for a target")
    c.add_argument("--model", default=None, help="model name, name:preset, or checkpoint directory "
                   "(default: $DEEPINFER_HF_MODEL_DIR, else the built-in tiny preset)")
    c.add_argument("--target", default="cpu", choices=TARGETS)
    c.add_argument("-o", "--output", help="plan directory to write")
    c.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR")
    c.add_argument("--seed", type=int, default=0, help="seed of the random weights when no checkpoint is given")
    c.add_argument("--overwrite", action="store_true", help="replace an existing plan directory")
    c.add_argument("-v", "--verbose", action="store_true", help="print every pass with its time and changes")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="run a compiled plan (no plan: compile and run the tiny model on CPU)")
    r.add_argument("plan", nargs="?", help="plan directory")
    r.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    r.add_argument("--input", help="prompts.jsonl")
    r.add_argument("--output", help="out.jsonl")
    r.add_argument("--model", default=None, help="model name, name:preset, or checkpoint directory "
                   "(default: $DEEPINFER_HF_MODEL_DIR, else the built-in tiny preset)")
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--seed", type=int, default=0, help="seed of the random weights when no checkpoint is given")
    r.set_defaults(func=cmd_run)

    t = sub.add_parser("tune", help="autotune kernels for a target and fill the tuning database")
    t.add_argument("--target", default="sm90", choices=TARGETS)
    t.add_argument("--kernels", nargs="*", help="kernel families to tune (default: all)")
    t.set_defaults(func=_not_built("tune", 6))

    b = sub.add_parser("bench", help="benchmark a V4.1-Flash slice against torch and the hardware limit")
    b.add_argument("--target", default="sm90", choices=TARGETS)
    b.set_defaults(func=_not_built("bench", 8))

    i = sub.add_parser("inspect", help="print a graph (.dil text, .json, .onnx) or a plan directory")
    i.add_argument("file")
    i.add_argument("--summary-only", action="store_true", help="only the summary lines")
    i.set_defaults(func=cmd_inspect)

    m = sub.add_parser("make-checkpoint", help="write a random checkpoint in the real tensor format")
    m.add_argument("--model", default=MODELS[0], choices=MODELS)
    m.add_argument("--preset", default="tiny")
    m.add_argument("--out", required=True, help="directory to write")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_checkpoint)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except DeepInferError as e:
        if args.debug:
            raise
        print(f"deepinfer {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
