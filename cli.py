"""The ``deepinfer`` command.

    deepinfer compile | run | tune | bench | inspect | make-checkpoint   (each with --help)

User errors (a DeepInferError) print one line and exit 2; ``--debug`` shows the traceback. A subcommand
that is not built yet says so in one line and exits 2; nothing prints made-up results.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

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
    from deepinfer.runtime.plan import bind_weights

    return bind_weights(plan)


def _compile(args: argparse.Namespace):
    from deepinfer.compiler import compile_model
    from deepinfer.passes.convert_fp4_to_fp8 import describe_act_groups

    kw = {"kernels": getattr(args, "kernels", "none"), "jobs": getattr(args, "jobs", None),
          "moe_format": getattr(args, "moe_format", "g32"),
          "max_model_len": getattr(args, "max_model_len", None)}  # fmt: skip
    res = compile_model(_default_model(args.model), args.target, seed=args.seed, dump_ir=args.dump_ir, **kw)
    g = res.plan.graph
    slowest = ", ".join(f"{name} {sec:.2f} s" for name, sec in res.slowest_passes)
    print(
        f"compiled {res.plan.model} for {res.plan.target}: graph built in {res.build_s:.2f} s, "
        f"{res.n_passes} passes in {res.passes_s:.2f} s"
        + (f" (slowest: {slowest})" if slowest else "")
        + f", {res.nodes_before} -> {len(g.nodes)} nodes"
    )
    if describe_act_groups(g.meta):  # how the FP4 experts became FP8 (the plan's record; the runtime applies it)
        print(describe_act_groups(g.meta))
    if res.kernels_summary:
        print(f"{res.kernels_summary} (kernel step {res.kernels_s:.1f} s)")
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
    try:
        print(f"wrote plan {write_plan(plan, args.output, overwrite=args.overwrite)}")
    finally:  # the kernels were staged in a temporary directory (compile_model); the plan has its own copy
        if plan.kernels_dir and Path(plan.kernels_dir).name.startswith("deepinfer-kernels-"):
            shutil.rmtree(plan.kernels_dir, ignore_errors=True)
    return 0


def _run_requests(args: argparse.Namespace) -> list[dict]:
    """The requests to run: --prompt (each a user message) or --input JSONL (one object a line: "prompt",
    "messages" or "prompt_token_ids", plus any SamplingParams field, e.g. "max_tokens", "temperature")."""
    import json

    if args.input:
        try:
            lines = [ln for ln in open(args.input, encoding="utf-8").read().splitlines() if ln.strip()]
        except OSError as e:
            raise DeepInferError(f"--input {args.input}: {e.strerror}") from None
        reqs = []
        for n, line in enumerate(lines, 1):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise DeepInferError(f"{args.input}:{n}: bad JSON: {e.msg}") from None
            if not isinstance(doc, dict):
                raise DeepInferError(f"{args.input}:{n}: expected a JSON object")
            reqs.append(doc)
        return reqs
    return [{"prompt": p} for p in (args.prompt or ["What is the capital of France?"])]


def _request_prompt(req: dict):
    if "prompt" in req and isinstance(req["prompt"], str) and req["prompt"]:
        return [{"role": "user", "content": req["prompt"]}]  # a CLI prompt is a user turn, in the chat format
    for key in ("prompt_token_ids", "messages", "prompt"):
        if key in req:
            return req[key]
    return []


def _request_params(req: dict, args: argparse.Namespace):
    from deepinfer.runtime.sampler import SamplingParams

    fields = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.sampling_seed}  # fmt: skip
    fields.update({k: v for k, v in req.items() if k not in ("prompt", "messages", "prompt_token_ids", "id")})
    unknown = sorted(set(fields) - set(SamplingParams.__dataclass_fields__))
    if unknown:
        return _UnknownFields(f"unknown request field(s) {', '.join(unknown)}")  # this request fails alone
    return SamplingParams(**fields)


def _unknown_fields_type():
    from deepinfer.runtime.sampler import InvalidRequestError, SamplingParams

    class UnknownFields(SamplingParams):
        def __init__(self, message: str):
            super().__init__()
            self.message = message

        def validate(self) -> None:
            raise InvalidRequestError(self.message)

    return UnknownFields


def _UnknownFields(message: str):  # noqa: N802 (a class made on first use: the runtime imports torch)
    return _unknown_fields_type()(message)


def _progress(total: int) -> Callable[[int, int], None]:
    import time

    t0 = time.perf_counter()

    def show(done: int, _total: int) -> None:
        width = 30
        fill = width * done // max(total, 1)
        rate = done / max(time.perf_counter() - t0, 1e-9)
        end = "\n" if done == total else ""
        print(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests, {rate:.2f} req/s", end=end,
              file=sys.stderr, flush=True)  # fmt: skip

    return show


def cmd_run(args: argparse.Namespace) -> int:
    import time

    from deepinfer.ir.printer import summary
    from deepinfer.runtime.engine import LLM

    if args.max_tokens <= 0:
        raise DeepInferError(f"--max-tokens must be positive, got {args.max_tokens}")
    reqs = _run_requests(args)
    if args.plan:
        from deepinfer.runtime.plan import load_plan

        plan = load_plan(args.plan)  # a plan runs on the target it was compiled for
        from deepinfer.codegen.plan_kernels import usable_cores

        jobs = usable_cores() if args.prebuild_jobs is None else args.prebuild_jobs
        llm = LLM(plan=plan, target=plan.target, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  cuda_graphs=not args.no_cuda_graphs, prebuild_jobs=jobs,
                  batched_decode=False if args.no_batched_decode else None,
                  graph_warmup=False if args.no_graph_warmup else None)  # fmt: skip
    else:
        args.target, args.dump_ir = "cpu", None
        plan = _compile(args)
        llm = LLM(plan=plan, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len)  # fmt: skip
    print(f"\nmodel: {llm.plan.model} ({llm.weights_source})")
    print(summary(llm.plan.graph))
    t0 = time.perf_counter()
    progress = _progress(len(reqs)) if args.input else None
    outs = llm.generate([_request_prompt(r) for r in reqs], [_request_params(r, args) for r in reqs], progress)
    wall = time.perf_counter() - t0
    failed = [o for o in outs if o.finish_reason == "error"]
    if args.output:
        _write_outputs(args.output, reqs, outs)
    else:
        for req, out in zip(reqs, outs):
            if out.finish_reason != "error":
                _print_output(req, out)
    _print_summary(outs, wall, args.output)
    if llm.weights_source.startswith("random"):
        print("\nnote: random weights generate noise; pass --model DIR (or DEEPINFER_HF_MODEL_DIR) for a checkpoint")
    for o in failed:
        print(f"deepinfer run: error: request {o.index}: {o.error}", file=sys.stderr)
    llm.close()
    return 2 if failed else 0


def _print_output(req: dict, out) -> None:
    shown = req.get("prompt", req.get("messages", req.get("prompt_token_ids")))
    print(f"\nprompt ({len(out.prompt_token_ids)} tokens): {shown!r}")
    print(f"output ({len(out.token_ids)} tokens): {out.text!r}")
    print(f"token ids: {out.token_ids}")
    tpot = f"; tpot {out.tpot_s * 1000:.0f} ms" if out.tpot_s else ""
    print(f"finish: {out.finish_reason}; ttft {out.ttft_s * 1000:.0f} ms{tpot}")


def _write_outputs(path: str, reqs: list[dict], outs) -> None:
    import json

    with open(path, "w", encoding="utf-8") as f:
        for req, o in zip(reqs, outs):
            row = {"index": o.index, "id": req.get("id"), "text": o.text, "token_ids": o.token_ids,
                   "finish_reason": o.finish_reason, "error": o.error, "num_prompt_tokens": len(o.prompt_token_ids),
                   "ttft_s": o.ttft_s, "tpot_s": o.tpot_s}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def _print_summary(outs, wall: float, output: str | None) -> None:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    gen = sum(len(o.token_ids) for o in outs)
    where = f"; wrote {output}" if output else ""
    print(f"\n{len(outs)} requests: {prompt} prompt + {gen} generated tokens in {wall:.2f} s "
          f"({(prompt + gen) / wall:.1f} tok/s, {gen / wall:.1f} generated tok/s){where}")  # fmt: skip


def cmd_tune(args: argparse.Namespace) -> int:
    from deepinfer.codegen.tuner import tune_target

    return tune_target(args.target, args.kernels)


def cmd_bench(args: argparse.Namespace) -> int:
    """The real-dims V4.1 slice benchmark (benchmarks/bench_slice.py); one-line error without CUDA."""
    import importlib.util
    from pathlib import Path

    import torch

    if args.target != "sm90":
        raise DeepInferError(f"bench runs on sm90 (an H200) today, not {args.target!r}")
    if args.preset == "real" and not torch.cuda.is_available():
        raise DeepInferError("bench needs a CUDA device (an H200 for sm90; --preset tiny is the CPU smoke mode); "
                             "this machine has none")  # fmt: skip
    path = Path(__file__).resolve().parent / "benchmarks" / "bench_slice.py"
    spec = importlib.util.spec_from_file_location("bench_slice", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_slice", mod)  # what the module's own imports and pickling expect
    spec.loader.exec_module(mod)
    mod.run_from_args(args)
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
    c.add_argument("--kernels", default="bound", choices=("none", "bound", "all"),
                   help="kernel artifacts to build into the plan (GPU/NPU targets): none, the bound nodes' kernels "
                   "at the plan's buckets (default), or all runtime row buckets")  # fmt: skip
    c.add_argument("-j", "--jobs", type=int, default=None,
                   help="kernel build processes (default: the cores this process may use)")  # fmt: skip
    c.add_argument("--max-model-len", type=int, default=None,
                   help="sm90: the engine's max_model_len the kernels are built for (cache sizes fix some kernel "
                   "shapes; default: min(the model's max positions, 4096), the engine's default); the plan records "
                   "it and `deepinfer run` uses it")  # fmt: skip
    c.add_argument("--moe-format", default="g32", choices=("g32", "w128", "g128"),
                   help="sm90: the FP4 experts as FP8 -- g32: 32x32 weight blocks, 1x32 activations (the model's "
                   "numbers, default); w128: 128x128 blocks (exactness checked at load), 1x32 activations (the same "
                   "numbers); g128: w128 + 1x128 activations at prefill buckets only (faster prefill GEMMs, not "
                   "exact: codegen/kernels/act_quant.py)")  # fmt: skip
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="run a compiled plan (no plan: compile and run the tiny model on CPU)")
    r.add_argument("plan", nargs="?", help="plan directory")
    r.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    r.add_argument("--input", help="prompts.jsonl")
    r.add_argument("--output", help="out.jsonl")
    r.add_argument("--model", default=None, help="model name, name:preset, or checkpoint directory "
                   "(default: $DEEPINFER_HF_MODEL_DIR, else the built-in tiny preset)")
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--sampling-seed", type=int, default=None, help="seed of every request's sampler")
    r.add_argument("--max-num-seqs", type=int, default=16, help="requests per step")
    r.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    r.add_argument("--seed", type=int, default=0, help="seed of the random weights when no checkpoint is given")
    r.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output); default: the plan's (compile --max-model-len), else "
                   "min(the model's max positions, 4096)")  # fmt: skip
    r.add_argument("--prebuild-jobs", type=int, default=None,
                   help="sm90 plans: build the kernels the engine looks up in this many processes before the first "
                   "request (default: the cores this process may use; 0: each at its first call)")  # fmt: skip
    r.add_argument("--no-cuda-graphs", action="store_true",
                   help="sm90 plans: run decode steps eagerly instead of replaying CUDA graphs")  # fmt: skip
    r.add_argument("--no-batched-decode", action="store_true",
                   help="sm90 plans: decode each sequence with its own one-sequence steps instead of one batched "
                   "step for all (the default; also DEEPINFER_BATCHED_DECODE=0)")  # fmt: skip
    r.add_argument("--no-graph-warmup", action="store_true",
                   help="sm90 plans: capture each decode batch size's CUDA graph at its first use, inside a request, "
                   "instead of all at startup (the default; also DEEPINFER_GRAPH_WARMUP=0)")  # fmt: skip
    r.set_defaults(func=cmd_run)

    t = sub.add_parser("tune", help="autotune kernels for a target and fill the tuning database")
    t.add_argument("--target", default="sm90", choices=TARGETS)
    t.add_argument("--kernels", nargs="*", help="kernel families to tune (default: all)")
    t.set_defaults(func=cmd_tune)

    b = sub.add_parser("bench", help="benchmark a V4.1-Flash slice against torch and the hardware limit")
    b.add_argument("--target", default="sm90", choices=TARGETS)
    b.add_argument("--layers", default="0,2,3,20,21,24", help="real layer ids of the slice (no Engram layers)")
    b.add_argument("--batches", default="1,16,64,256", help="decode token counts")
    b.add_argument("--context", default="4096", help="cached tokens for decode (comma list, e.g. 4096,32768)")
    b.add_argument("--experts", default="fp8", choices=("fp8", "fp4"), help="expert format (fp4: W4A8 kernels)")
    b.add_argument("--prefill", type=int, default=8192, help="prefill tokens (0: none)")
    b.add_argument("--reps", type=int, default=5)
    b.add_argument("--budget-s", type=float, default=480.0, help="stop starting new cases after this")
    b.add_argument("--jobs", type=int, default=0, help="pre-build kernels in this many processes")
    b.add_argument("--no-torch-compile", action="store_true")
    b.add_argument("--graphs", choices=("on", "off"), default="on",
                   help="decode rows also as per-layer CUDA graphs (runtime/layer_graphs.py)")  # fmt: skip
    b.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                   help="torch.compile mode of the per-layer straight-line baseline")  # fmt: skip
    b.add_argument("--compile-batches", default="", help="decode batches with the torch.compile baseline (default all)")
    b.add_argument("--preset", choices=("real", "tiny"), default="real",
                   help="tiny: CPU smoke mode (tiny dims, kernel stand-ins, emulated graphs)")  # fmt: skip
    b.add_argument("--out", default=os.environ.get("OUT") or "bench_slice_out", help="JSON + PNG go here")
    b.set_defaults(func=cmd_bench)

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
