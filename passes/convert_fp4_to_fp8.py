"""Quantisation (phase 1): FP4 experts -> FP8 at load time, for targets whose matrix units lack FP4 (SM90).

The checkpoint stores routed experts as packed FP4 E2M1 with one ue8m0 scale per 32 inputs of a row
(MODEL_SPEC §4.3). Hopper's tensor cores have no FP4 path, so on `sm90` the experts run as block-scaled FP8
E4M3 (the `moe_experts` "fp8" format, one ue8m0 scale per `block` x `block` tile, as the dense weights).
The pass retypes the expert parameters (same checkpoint names), switches the ops to FP8, and records the
conversion in ``graph.meta["param_conversions"]``: the runtime applies :func:`fp4_to_fp8_block` (named there)
to the tensors it loads, or calls :func:`apply_param_conversions`.

Exactness. An FP4 value is c * 2^e, c in {0, 0.5, 1, 1.5, 2, 3, 4, 6} (at most two significant bits), e the
group's scale exponent. The FP8 block scale is 2^E with E = (largest group exponent in the block) - 6, so the
block's largest value is at most 6 * 2^6 = 384 <= 448 (no saturation) and the code is c * 2^(e-E). E4M3 holds
every number m * 2^p with m < 16 and p >= -9 (its subnormal step is 2^-9), so the code is exact whenever its
lowest set bit is >= 2^-9: always when e >= E - 8, i.e. when every group in the block is within 14 binades
(2^14) of the block's largest group scale. Real and random checkpoints have a spread of a few binades, so the
conversion is exact there (tests check it bit for bit); beyond 14 binades the smallest codes of the small
groups round to the E4M3 grid (round to nearest even) or flush to zero. Groups that are all zero do not count.
"""

from __future__ import annotations

import importlib

import torch

from deepinfer.codegen.targets import TARGETS
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.ir import dtypes as dt
from deepinfer.ir.graph import Graph, TensorType
from deepinfer.passes.pipeline import register_pass

FN = "deepinfer.passes.convert_fp4_to_fp8:fp4_to_fp8_checked"
FP4_GROUP = 32
MOE_ACT_META = "moe_act_groups"  # graph.meta key: {"decode": g, "prefill": g, "weight_block": b}
PREFILL_ACT_GROUPS = (0, 128)  # prefill_act_group option: 0 = the model's group at every bucket
# `deepinfer compile --moe-format` (compiler.default_pipeline): this pass's options per named format. g32: the model's
# blocks and 1x32 activations; w128: 128x128 weight blocks, 1x32 activations everywhere (the same numbers); g128:
# w128 plus 1x128 activations at prefill buckets (not exact: codegen/kernels/act_quant.py states the deviation).
MOE_FORMATS = {"g32": {}, "w128": {"block": 128}, "g128": {"block": 128, "prefill_act_group": 128}}


def fp4_to_fp8_block(w: torch.Tensor, scale: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed FP4 [N, K/2] with e8m0 [N, K/32] -> (E4M3 [N, K], e8m0 [ceil(N/block), ceil(K/block)]); no check
    (see fp4_to_fp8_checked)."""
    codes, big, _ = _convert(w, scale, block)
    return codes, big


Converted = tuple[torch.Tensor, torch.Tensor]


def fp4_to_fp8_checked(w: torch.Tensor, scale: torch.Tensor, block: int, name: str = "") -> Converted:
    """fp4_to_fp8_block, raising CheckpointError when a value does not survive the conversion exactly (a block
    whose live groups span more than 14 binades: module doc)."""
    codes, big, inexact = _convert(w, scale, block)
    if inexact:
        what = f"{name} " if name else ""
        remedy = f"compile with convert_fp4_to_fp8 block={FP4_GROUP}"
        if block <= FP4_GROUP:
            remedy = "no FP8 block holds it exactly: keep the FP4 experts (the W4A8 programs; convert pass off)"
        raise CheckpointError(
            f"convert_fp4_to_fp8: {what}[{w.shape[0]}, {2 * w.shape[1]}] is not exact in {block}x{block} FP8 blocks "
            f"({inexact} values off the E4M3 grid: a block's FP4 group scales span > 14 binades); {remedy}"
        )
    return codes, big


def _convert(w: torch.Tensor, scale: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(codes, block scales, number of values the E4M3 cast changed)."""
    vals = dt.fp4_to_float(w)  # [N, K]
    n, k = vals.shape
    exp = dt.e8m0_to_float(scale).log2().round()  # [N, K/32], exact integers
    live = vals.unflatten(-1, (-1, FP4_GROUP)).ne(0).any(-1)  # groups with a nonzero code
    exp_el = exp.repeat_interleave(FP4_GROUP, 1)  # per element
    nb, kb = -(-n // block), -(-k // block)
    pad = torch.full((nb * block, kb * block), -1e9, device=vals.device)
    pad[:n, :k] = torch.where(live.repeat_interleave(FP4_GROUP, 1), exp_el, torch.tensor(-1e9, device=vals.device))
    top = pad.view(nb, block, kb, block).amax(dim=(1, 3))  # largest live group exponent per block
    big = (top - 6).clamp(-127, 127)
    big = torch.where(top < -1e8, torch.zeros_like(big), big)  # an all-zero block: any scale, take 2^0
    big_el = big.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    want = vals * torch.exp2(exp_el - big_el)  # exact in fp32: a 2-bit code times a power of two
    codes = want.to(torch.float8_e4m3fn)
    inexact = int(codes.float().ne(want).sum())
    return codes, dt.float_to_e8m0(torch.exp2(big)), inexact


def apply_param_conversions(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as the converted graph wants them (a new dict; the loaded ones are not changed)."""
    out = dict(tensors)
    for conv in meta.get("param_conversions", []):
        module, fn_name = conv["fn"].split(":")
        fn = getattr(importlib.import_module(module), fn_name)
        for wname, sname in conv["params"]:
            if fn is fp4_to_fp8_checked:
                out[wname], out[sname] = fn(tensors[wname], tensors[sname], conv["block"], wname)
            else:
                out[wname], out[sname] = fn(tensors[wname], tensors[sname], conv["block"])
    return out


def _lacks_fp4(target: str) -> bool:
    if target not in TARGETS:
        raise ConfigError(f"convert_fp4_to_fp8: unknown target {target!r} (known: {', '.join(TARGETS)})")
    dtypes = TARGETS[target].dtypes
    return "float8_e4m3" in dtypes and "float4_e2m1" not in dtypes


@register_pass("convert_fp4_to_fp8")
def convert_fp4_to_fp8(g: Graph, target: str | None = None, block: int | None = None,
                       prefill_act_group: int = 0) -> Graph:  # fmt: skip
    """FP4 experts -> block-scaled FP8 for a target without FP4 matrix units (sm90); no target: no change.
    block: the FP8 weight block (default: the node's, the model's activation group); prefill_act_group: the
    experts' activation group at prefill buckets (0: the model's; 128: the labelled g128 option, module doc)."""
    if prefill_act_group not in PREFILL_ACT_GROUPS:
        raise ConfigError(f"convert_fp4_to_fp8: prefill_act_group {prefill_act_group} is not one of "
                          f"{PREFILL_ACT_GROUPS}")  # fmt: skip
    if target is None or not _lacks_fp4(target):
        return g
    pairs: list[list[str]] = []
    retyped: dict[tuple, tuple[TensorType, TensorType]] = {}  # every expert of a layer has the same shapes
    for n in g.nodes:
        if n.op != "moe_experts" or n.attrs["fmt"] != "fp4":
            continue
        b = block or n.attrs["block"]
        _record_act_groups(g, n.attrs["block"], b, prefill_act_group)
        for i in range(0, len(n.inputs) - 3, 2):
            w, s = n.inputs[3 + i], n.inputs[4 + i]
            key = (w.shape, b)
            if key not in retyped:
                rows, cols = w.shape[0], w.shape[1] * 2
                retyped[key] = TensorType(dt.f8e4m3, (rows, cols)), TensorType(dt.e8m0, (-(-rows // b), -(-cols // b)))
            w.type, s.type = retyped[key]
            pairs.append([w.name, s.name])
        n.attrs = {**n.attrs, "fmt": "fp8", "block": b}
        g.meta.setdefault("param_conversions", [])
        convs = g.meta["param_conversions"]
        if not convs or convs[-1]["fn"] != FN or convs[-1]["block"] != b:
            convs.append({"fn": FN, "block": b, "params": []})
        convs[-1]["params"] += pairs
        pairs = []
    return g


def _record_act_groups(g: Graph, act_group: int, block: int, prefill_act_group: int) -> None:
    """graph.meta[MOE_ACT_META]: the experts' activation groups per bucket kind and the weight block. The model's
    group (the node's block before conversion) at decode always; at prefill too unless the g128 option is on."""
    if prefill_act_group and (block % prefill_act_group or prefill_act_group % act_group):
        raise ConfigError(
            f"convert_fp4_to_fp8: prefill_act_group {prefill_act_group} needs a weight block that is "
            f"a multiple of it (block={block}), and must be a multiple of the model's {act_group}"
        )
    rec = {"decode": act_group, "prefill": prefill_act_group or act_group, "weight_block": block}
    old = g.meta.get(MOE_ACT_META)
    if old is not None and old != rec:
        raise ConfigError(f"convert_fp4_to_fp8: MoE layers with different activation groups ({old} vs {rec})")
    g.meta[MOE_ACT_META] = rec


def describe_act_groups(meta: dict) -> str:
    """One line for reports: how the converted experts' activations are quantised (empty: no conversion)."""
    rec = meta.get(MOE_ACT_META)
    if not rec:
        return ""
    line = (f"MoE experts: FP8 {rec['weight_block']}x{rec['weight_block']} weight blocks; activations 1x"
            f"{rec['decode']} at decode")  # fmt: skip
    if rec["prefill"] == rec["decode"]:
        return line + " and prefill (exact: the model's groups)"
    return line + f", 1x{rec['prefill']} at prefill buckets (option prefill_act_group={rec['prefill']}: not exact)"
