"""Memory planning (phase 5): lifetimes, buffer reuse, workspaces and a peak-memory report at one bucket.

    g = plan_memory(g, T=4096, max_len=65536)
    g.meta["memory"]  -> bytes for weights, caches, inputs and the activation arena; each buffer's offset

Sizes are the graph's symbolic shapes evaluated at the bucket: T from the option (else the graph's bucket,
else 1), each compressed-cache length C<m> = ceil(max_len / m), any other symbol = max_len.

- Weights are the parameters, as stored (packed FP4 counts its bytes). Caches are the graph inputs listed in
  ``meta["caches"]``; a stateful op's new state is written in place (the verifier guarantees the old
  version is dead), so it aliases its input and is not an activation. Other inputs (tokens, positions) are io.
- Activations: every other node output. ``reshape`` is a view (aliases its input, extending its lifetime).
  A buffer lives from its producer to its last reader (through views); graph outputs live to the end.
- Workspaces: scratch a node needs while it runs (lifetime: that node only), from the kernel binding when
  phase 4 ran: the MoE's permuted tokens and intermediates, the gathered KV rows of attention on torch_ref,
  split-K partials. Estimates from the buffers the kernels allocate, not measured.
- Reuse: greedy by size (largest first), each buffer at the lowest offset of one arena that no buffer live
  at the same time occupies (first fit). ``live_max`` (the most bytes live at one time) is the lower bound
  any placement needs; the arena size is what this one needs.
"""

from __future__ import annotations

import math
import re

from deepinfer.errors import ConfigError
from deepinfer.ir.graph import Graph, Node, Value
from deepinfer.ir.registry import get_op
from deepinfer.ir.shapes import evaluate
from deepinfer.passes.pipeline import register_pass

VIEWS = {"reshape"}
ALIGN = 256
MOE_OPS = {"moe_experts": 3, "moe_experts_local": 3, "moe_grouped_experts": 9}
ATTENTION = {"sparse_attention": (0, 3, 5), "fused_attention": (0, 4, 6)}  # q, win_idx, cmp_idx positions


def _env(g: Graph, t: int, max_len: int) -> dict[str, int]:
    syms: set[str] = set()
    for v in [*g.inputs, *g.params]:
        for d in v.shape:
            if not isinstance(d, int):
                syms |= d.free_symbols
    env = {}
    for s in syms:
        m = re.fullmatch(r"C(\d+)", s)
        env[s] = -(-max_len // int(m.group(1))) if m else max_len
    return env | {"T": t}


def nbytes(v: Value, env: dict) -> int:
    return math.prod(evaluate(d, env) for d in v.shape) * v.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _binding(g: Graph, node: Node) -> dict:
    rec = g.meta.get("kernels", {}).get("nodes", {}).get(node.outputs[0].name)
    return next(iter(rec["buckets"].values())) if rec else {"family": "torch_ref"}


def workspace(g: Graph, node: Node, env: dict) -> int:
    """Scratch bytes while ``node`` runs (see the module docstring)."""
    shape = lambda v: [evaluate(d, env) for d in v.shape]  # noqa: E731
    if node.op in MOE_OPS:
        (t, d), k = shape(node.inputs[0]), shape(node.inputs[2])[1]
        inter = shape(node.inputs[MOE_OPS[node.op]])[0]
        # permuted tokens (fp8 + scales), gate/up and activation (bf16), the fp32 rows before the un-permute
        return t * k * (d + d // 32 * 4 + 3 * inter * 2 + d * 4)
    if node.op in ATTENTION and _binding(g, node)["family"] == "torch_ref":
        q, *idx = (node.inputs[i] for i in ATTENTION[node.op])
        t, h, d = shape(q)
        k = sum(shape(i)[1] for i in idx if i is not None)
        return t * k * (d + h) * 4  # the gathered rows and the logits, fp32
    cfg = _binding(g, node).get("config") or {}
    if cfg.get("split_k", 1) > 1:
        return cfg["split_k"] * nbytes(node.outputs[0], env) // node.outputs[0].dtype.itemsize * 4
    return 0


class _Buffers:
    """Activation buffers: size, first and last step; views and in-place writes resolve to a root value."""

    def __init__(self, g: Graph, env: dict):
        self.g, self.env = g, env
        self.root: dict[str, str] = {}
        self.size: dict[str, int] = {}
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.persistent = {v.name for v in [*g.inputs, *g.params]}

    def define(self, i: int, node: Node) -> None:
        opdef = get_op(node.op)
        for k, o in enumerate(node.outputs):
            src = node.inputs[opdef.writes[k]] if k in opdef.writes else None
            if src is None and node.op in VIEWS:
                src = node.inputs[0]
            if src is not None:  # an alias: in-place state write or a view
                self.root[o.name] = self.root.get(src.name, src.name)
                continue
            self.root[o.name] = o.name
            self.size[o.name], self.start[o.name], self.end[o.name] = _aligned(nbytes(o, self.env)), i, i

    def use(self, i: int, v: Value) -> None:
        r = self.root.get(v.name, v.name)
        if r in self.end:
            self.end[r] = max(self.end[r], i)


def lifetimes(g: Graph, env: dict) -> _Buffers:
    bufs = _Buffers(g, env)
    for i, node in enumerate(g.nodes):
        for v in node.inputs:
            if v is not None:
                bufs.use(i, v)
        bufs.define(i, node)
    for v in g.outputs:
        bufs.use(len(g.nodes), v)
    return bufs


def place(buffers: list[tuple[str, int, int, int]]) -> tuple[dict[str, int], int]:
    """Greedy by size, first fit: (name, size, start, end) -> offsets and the arena size."""
    placed: list[tuple[int, int, int, int]] = []  # offset, size, start, end
    offsets: dict[str, int] = {}
    for name, size, s, e in sorted(buffers, key=lambda b: (-b[1], b[2], b[0])):
        busy = sorted((o, o + sz) for o, sz, s2, e2 in placed if s2 <= e and s <= e2)
        off = 0
        for lo, hi in busy:
            if off + size <= lo:
                break
            off = max(off, hi)
        offsets[name] = off
        placed.append((off, size, s, e))
    return offsets, max((o + sz for o, sz, _, _ in placed), default=0)


def live_max(buffers: list[tuple[str, int, int, int]], steps: int) -> int:
    delta = [0] * (steps + 2)
    for _, size, s, e in buffers:
        delta[s] += size
        delta[e + 1] -= size
    best = cur = 0
    for d in delta:
        cur += d
        best = max(best, cur)
    return best


@register_pass("plan_memory")
def plan_memory(g: Graph, *, T: int | None = None, max_len: int = 8192) -> Graph:
    """Plan activation buffers at one bucket; graph.meta["memory"] holds the report and the offsets."""
    t = T if T is not None else g.meta.get("bucket", {}).get("T", 1)
    if isinstance(t, bool) or not isinstance(t, int) or t < 1 or max_len < 1:
        raise ConfigError(f"plan_memory: T and max_len must be positive integers, got T={t!r}, max_len={max_len!r}")
    env = _env(g, t, max_len)
    bufs = lifetimes(g, env)
    buffers = [(n, bufs.size[n], bufs.start[n], bufs.end[n]) for n in bufs.size]
    ws = [(f"{node.outputs[0].name}.workspace", _aligned(w), i, i)
          for i, node in enumerate(g.nodes) if (w := workspace(g, node, env))]  # fmt: skip
    offsets, arena = place(buffers + ws)
    caches = {e["name"] for e in g.meta.get("caches", [])}
    g.meta["memory"] = {
        "T": t,
        "symbols": {k: v for k, v in sorted(env.items()) if k != "T"},
        "weights": sum(nbytes(p, env) for p in g.params),
        "weights_by_kind": _weights_by_kind(g, env),
        "caches": sum(nbytes(v, env) for v in g.inputs if v.name in caches),
        "io": sum(nbytes(v, env) for v in g.inputs if v.name not in caches),
        "activations": arena,
        "live_max": live_max(buffers + ws, len(g.nodes)),
        "no_reuse": sum(b[1] for b in buffers + ws),
        "workspace_max": max((b[1] for b in ws), default=0),
        "buffers": len(buffers),
        "workspaces": len(ws),
        "offsets": offsets,
    }
    m = g.meta["memory"]
    m["peak"] = m["weights"] + m["caches"] + m["io"] + m["activations"]
    return g


def _weights_by_kind(g: Graph, env: dict) -> dict[str, int]:
    """Routed experts, Engram tables (host-offload candidates) and the rest."""
    out = {"experts": 0, "engram_tables": 0, "other": 0}
    for p in g.params:
        kind = "experts" if ".experts." in p.name else "engram_tables" if ".engram.embed." in p.name else "other"
        out[kind] += nbytes(p, env)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB" if n >= 2**30 else f"{n / 2**20:10.3f} MiB"


def format_memory_report(g: Graph) -> str:
    m = g.meta["memory"]
    rows = [("weights", m["weights"])] + [(f"  {k}", n) for k, n in m["weights_by_kind"].items()]
    rows += [("caches", m["caches"]), ("inputs", m["io"])]
    rows += [("activations (arena)", m["activations"]), ("  live at once (bound)", m["live_max"])]
    rows += [("  without reuse", m["no_reuse"]), ("  largest workspace", m["workspace_max"]), ("peak", m["peak"])]
    head = f"memory at T={m['T']} ({', '.join(f'{k}={v}' for k, v in m['symbols'].items())})"
    return "\n".join([head] + [f"  {name:<24}{_gib(n)}" for name, n in rows])
