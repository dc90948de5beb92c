"""The ``deepinfer`` command.

    deepinfer compile | run | tune | bench | inspect | make-checkpoint   (each with --help)

User errors (a DeepInferError) print one line and exit 2; ``--debug`` shows the traceback. A subcommand
that is not built yet says so in one line and exits 2; nothing prints made-up results.
"""

from __future__ import annotations

import argparse
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


def _load_model(spec: str | None, seed: int):
    """(model name, graph, params, where the weights came from) for a model name, name:preset, or directory."""
    from deepinfer.models import get_model
    from deepinfer.models.checkpoint import load_checkpoint, random_weights, resolve_model
    from deepinfer.models.presets import weight_block_size

    name, config, ckpt = resolve_model(spec)
    try:
        mod = get_model(name)
    except ImportError:
        if spec is not None or ckpt is not None:
            raise NotBuiltError(f"the {name} graph is not built yet") from None
        print(f"note: the {name} graph is not built yet; running deepseek-v4-flash instead")
        name, config, ckpt = resolve_model("deepseek-v4-flash")
        mod = get_model(name)
    graph = mod.build_graph(mod.parse_config(config))
    if ckpt is not None:
        return name, graph, load_checkpoint(ckpt, graph.params), str(ckpt)
    weights = random_weights(graph.params, seed, block=weight_block_size(config))
    return name, graph, weights, f"random weights (seed {seed}) in the checkpoint formats"


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from deepinfer.ir.printer import summary
    from deepinfer.models.tokenizer import get_tokenizer
    from deepinfer.runtime.session import greedy_generate

    if args.plan:
        raise NotBuiltError("running a compiled plan is not built yet (issue 7); `deepinfer run` without a plan "
                            "runs the built-in tiny model through the interpreter")
    if args.max_tokens <= 0:
        raise DeepInferError(f"--max-tokens must be positive, got {args.max_tokens}")
    t0 = time.perf_counter()
    name, graph, params, source = _load_model(args.model, args.seed)
    build_s = time.perf_counter() - t0
    tok = get_tokenizer()
    prompts = args.prompt or ["What is the capital of France?"]
    print(f"model: {name} ({source}); graph built and weights ready in {build_s:.2f} s")
    print(summary(graph))
    for prompt in prompts:
        if not prompt:
            raise DeepInferError("empty prompt")
        from deepinfer.models.tokenizer import encode_chat

        ids = encode_chat([{"role": "user", "content": prompt}])
        res = greedy_generate(graph, params, ids, args.max_tokens, stop_ids=(tok.eos_id,))
        print(f"\nprompt ({len(ids)} tokens): {prompt!r}")
        print(f"output ({len(res.output_ids)} tokens): {tok.decode(res.output_ids)!r}")
        print(f"token ids: {res.output_ids}")
        print(
            f"prefill {res.prefill_s * 1000:.0f} ms; decode {res.decode_tok_s:.1f} tok/s "
            "(CPU interpreter: the reference path, not the compiled plan)"
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
    c.add_argument("--model", default=MODELS[0], help="model name, preset, or checkpoint directory")
    c.add_argument("--target", default="cpu", choices=TARGETS)
    c.add_argument("-o", "--output", help="plan directory to write")
    c.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR")
    c.set_defaults(func=_not_built("compile", 5))

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
