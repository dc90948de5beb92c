"""RoPE: interleaved partial rotary embedding on the last `rope_dim` channels (MODEL_SPEC §2.6-2.7, §2.10).

    Y[t, h, :D-r]        = X[t, h, :D-r]                       (the "nope" channels, copied)
    Y[t, h, D-r+2i]      = e * cos - o * sin                   e = X[t, h, D-r+2i], o = X[t, h, D-r+2i+1]
    Y[t, h, D-r+2i+1]    = e * sin + o * cos                   cos/sin = CosSin[Pos[t], i], CosSin[Pos[t], r/2+i]

X [T, H, D] bf16, Pos [T] int32, CosSin [P, r] fp32 (cos | sin halves), Y [T, H, D] bf16. `inverse` uses
the conjugate rotation (sin -> -sin), which the attention output needs at the query position (§2.10). T may be
symbolic (T_=None): one build then serves every token count (the runtime's key has no row count).

The cos/sin come from a table (`cos_sin_table`) built once per model with the op's own frequency formula
(ir.ops.attention.rope_inv_freq, YaRN included) in fp32, rather than from sin/cos in the kernel: positions
reach 10^6 and nvcc's fast-math sincos is far off at such angles, while the table makes the kernel compute
exactly the reference's products. Memory-bound: one read and one write of X, plus r*4 bytes per token.
"""

from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem

FAMILY = "rope"


@dataclass(frozen=True)
class Config:
    block_t: int = 4  # tokens per block
    threads: int = 128


def config_space(T_: int, H: int) -> list[Config]:
    return [Config(bt, th) for bt in (1, 2, 4, 8) for th in (128, 256) if bt * H * 32 >= th]


def cos_sin_table(max_pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_pos, r] fp32: cos(p * f_i) for i < r/2, then sin(p * f_i), with the reference's fp32 angle."""
    angle = torch.arange(max_pos, dtype=torch.float32).unsqueeze(-1) * inv_freq.float()
    return torch.cat([angle.cos(), angle.sin()], dim=-1).contiguous()


def program(T_: int | None, H: int, D: int, P: int, *, rope_dim: int, inverse: bool, target: str,
            cfg: Config = Config(), io: str = ""):  # fmt: skip
    """prim_func(X [T, H, D], Pos [T] int32, CosSin [P, r] fp32, Y [T, H, D]) for cpu | sm90 | sm100.

    T_=None: the token count is symbolic (any T, no padding; the grid is ceil(T / block_t) CTAs).
    io "float32": X and Y are fp32 in memory with the bf16 kernel's numbers (X rounded to bf16 on load, Y the
    bf16-rounded result widened): the graph's fp32 activations without a cast launch on either side."""
    import tilelang.language as T

    T_ = T.dynamic("T") if T_ is None else T_
    r, half = rope_dim, rope_dim // 2
    assert r % 2 == 0 and r <= D
    bt, nope = cfg.block_t, D - rope_dim
    mem = Mem(target)
    dt = "float32" if mem.cpu else "bfloat16"
    mdt = "float32" if io == "float32" else dt  # X's and Y's dtype in memory
    sign = -1.0 if inverse else 1.0

    def rounded(v):
        """v as the bf16 kernel sees / writes it, in X's memory dtype."""
        return T.cast(T.cast(v, dt), mdt) if mdt != dt else T.cast(v, dt)

    @T.prim_func
    def rope(
        X: T.Tensor((T_, H, D), mdt),
        Pos: T.Tensor((T_,), "int32"),
        CosSin: T.Tensor((P, r), "float32"),
        Y: T.Tensor((T_, H, D), mdt),
    ):
        with T.Kernel(T.ceildiv(T_, bt), threads=cfg.threads) as bx:
            for t, h, i in mem.par(bt, H, half):
                tok = bx * bt + t
                if tok < T_:
                    p = Pos[tok]
                    c = CosSin[p, i]
                    s = CosSin[p, half + i] * sign
                    e = T.cast(rounded(X[tok, h, nope + 2 * i]), "float32")
                    o = T.cast(rounded(X[tok, h, nope + 2 * i + 1]), "float32")
                    Y[tok, h, nope + 2 * i] = rounded(e * c - o * s)
                    Y[tok, h, nope + 2 * i + 1] = rounded(e * s + o * c)
            if nope > 0:
                for t, h, j in mem.par(bt, H, nope):
                    tok = bx * bt + t
                    if tok < T_:
                        Y[tok, h, j] = rounded(X[tok, h, j])

    return rope


def reference(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rope_dim: int, inverse: bool = False):
    """Torch reference on the same table: fp32 rotation, cast back to x's dtype."""
    half = rope_dim // 2
    cs = table[positions.long()]  # [T, r]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    if inverse:
        sin = -sin
    rot = x[..., -rope_dim:].float()
    e, o = rot[..., 0::2], rot[..., 1::2]
    out = torch.stack([e * cos - o * sin, e * sin + o * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], out.to(x.dtype)], dim=-1)


def roofline(T_: int, H: int, D: int, rope_dim: int, elem_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): X read once, Y written once, positions and one table row per token."""
    return float(2 * T_ * H * D * elem_bytes + T_ * (4 + 4 * rope_dim)), 6.0 * T_ * H * (rope_dim // 2)
