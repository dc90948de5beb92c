"""mHC hyper-connections: `pre` (mixes, Sinkhorn, collapse) and `post` (MODEL_SPEC §2.2, §2.3).

pre, per token, X = n_hc (4) residual streams of D channels, x̃ = flatten(X) in fp32:
    mixes = (x̃ @ fnᵀ) · rsqrt(mean(x̃²) + eps)                     fn [24, 4D]
    pre   = sigmoid(mixes[0:4]·scale0 + base[0:4]) + hc_eps
    post  = 2·sigmoid(mixes[4:8]·scale1 + base[4:8])
    C     = softmax_k(mixes[8:24]·scale2 + base[8:24] as [j, k]) + hc_eps, then columns, then
            (iters-1) x (rows, columns) normalisation
    y     = Σ_i p_i · X_i   with p = the PREVIOUS sublayer's pre (V4.1 "pre from previous sublayer")

Because V4.1 collapses with the previous pre, mixes, the RMS and the collapse all come out of ONE read
of X: the kernel streams D in chunks, and for each chunk and stream it feeds the tensor cores (fp32
inputs → tf32 MMA on GPU) and accumulates y. The 4x4 Sinkhorn runs per token at the end. (V4, which
collapses with its own pre, needs a second pass over X: call `post`-style collapse separately.)

post:  X'_k = post_k · y + Σ_j C[j, k] · X_j          (the residual mix sums over the FIRST index of C)
"""

from dataclasses import dataclass

import torch

from deepinfer.codegen.kernels._common import Mem

FAMILY = "hyper_connection"
N_HC = 4
N_MIX = (2 + N_HC) * N_HC  # 24
MIX_PAD = 32  # MMA N dimension: fn is zero-padded to 32 rows at weight-load time


@dataclass(frozen=True)
class Config:
    block_m: int = 64
    block_k: int = 64
    threads: int = 128


def config_space(T_: int, D: int) -> list[Config]:
    return [Config(bm, bk, t) for bm in (16, 32, 64) for bk in (64, 128, 256) for t in (128, 256) if D % bk == 0]


def pad_fn(fn: torch.Tensor) -> torch.Tensor:
    """fn [24, 4D] -> [32, 4D] with zero rows (done once when weights are loaded)."""
    out = fn.new_zeros(MIX_PAD, fn.shape[1])
    out[:N_MIX] = fn
    return out


def _tail_macro(mem: Mem, K4: int, eps: float, hc_eps: float, iters: int):
    """TileLang macro tail(mix, sq, rows, row0, Base, Scale, Pre, Post, Comb): the end of hc_pre for `rows` tokens
    from their raw mixes [rows, 32] and sums of squares [rows] (fragments): the RMS scale, then per token (serial,
    one thread each) the gates and the Sinkhorn-normalised 4x4 mix. The 4x4 mix lives in 16 registers (a local
    array indexed only by unrolled loops): held in shared memory, every one of the 20 Sinkhorn iterations was a
    chain of dependent shared loads and stores (H200: the split pair's finish kernel took 25 us, nearly all here)."""
    import tilelang.language as T

    n = N_HC

    @T.macro
    def normalise_cols(c):
        for k in T.unroll(n):
            tot = c[k] + c[n + k] + c[2 * n + k] + c[3 * n + k] + hc_eps
            for j in T.unroll(n):
                c[j * n + k] = c[j * n + k] / tot

    @T.macro
    def coefficients(m_s, Base, Scale, i, row0, Pre, Post, Comb):
        """Per-token scalar tail of hc_pre: gates and the Sinkhorn-normalised 4x4 mix (serial, one thread)."""
        c = T.alloc_local((n * n,), "float32")
        for j in T.unroll(n):
            Pre[row0 + i, j] = T.sigmoid(m_s[i, j] * Scale[0] + Base[j]) + hc_eps
            Post[row0 + i, j] = 2.0 * T.sigmoid(m_s[i, n + j] * Scale[1] + Base[n + j])
        for j in T.unroll(n):  # row softmax over k
            for k in T.unroll(n):
                c[j * n + k] = m_s[i, 8 + j * n + k] * Scale[2] + Base[8 + j * n + k]
            mx = T.max(T.max(c[j * n], c[j * n + 1]), T.max(c[j * n + 2], c[j * n + 3]))
            for k in T.unroll(n):
                c[j * n + k] = T.exp(c[j * n + k] - mx)
            tot = c[j * n] + c[j * n + 1] + c[j * n + 2] + c[j * n + 3]
            for k in T.unroll(n):
                c[j * n + k] = c[j * n + k] / tot + hc_eps
        normalise_cols(c)
        for _ in T.serial(iters - 1):
            for j in T.unroll(n):
                tot = c[j * n] + c[j * n + 1] + c[j * n + 2] + c[j * n + 3] + hc_eps
                for k in T.unroll(n):
                    c[j * n + k] = c[j * n + k] / tot
            normalise_cols(c)
        for j in T.unroll(n * n):
            Comb[row0 + i, j] = c[j]

    @T.macro
    def tail(mix, sq, rows, row0, Base, Scale, Pre, Post, Comb):
        # via shared memory: sq and mix come from different thread layouts (reduce vs MMA)
        r_s = mem.shared((rows,), "float32")
        for i in mem.par(rows):
            r_s[i] = T.rsqrt(sq[i] / K4 + eps)
        m_s = mem.shared((rows, MIX_PAD), "float32")
        for i, j in mem.par(rows, MIX_PAD):
            m_s[i, j] = mix[i, j] * r_s[i]
        # the 4x4 Sinkhorn is a few hundred serial flops per token: one thread per token
        if mem.cpu:
            for i in T.serial(rows):
                coefficients(m_s, Base, Scale, i, row0, Pre, Post, Comb)
        else:
            tx = T.get_thread_binding()
            if tx < rows:
                coefficients(m_s, Base, Scale, tx, row0, Pre, Post, Comb)

    return tail


def _stream_macro(mem: Mem, D: int, bm: int, bK: int, act: str, xdt: str | None = None):
    """TileLang macro stream_channels(X, Fn, Pprev, Y, mix, rs, row0, d_first, n_chunks): for n_chunks chunks of bK
    channels from d_first, the 4 streams' tiles of rows row0.. feed the mixes (tf32 MMA on GPU, into `mix`) and the
    sums of squares (into `rs`), and each chunk's collapse (sum over streams of p_prev * X) is written to Y --
    hc_pre's one read of X. The caller allocates mix [bm, 32] and rs [bm] (what it reads afterwards).
    xdt: X's and Y's dtype in memory when it is not `act` (fp32: rounded to `act` on load and on store, so the
    values are the act program's; the sums of squares may be reduced in another order: TileLang may infer another
    fragment layout around an fp32 tile -- H200: not bitwise equal, within 1e-6)."""
    import tilelang.language as T

    xdt = xdt or act

    def as_act(v):
        return T.cast(T.cast(v, act), "float32") if xdt != act else T.cast(v, "float32")

    @T.macro
    def stream_channels(X, Fn, Pprev, Y, mix, rs, row0, d_first, n_chunks):
        x_s = mem.shared((bm, bK), xdt)
        xf_s = mem.shared((bm, bK), "float32")
        fn_s = mem.shared((MIX_PAD, bK), "float32")
        p_s = mem.shared((bm, N_HC), "float32")
        sq = mem.fragment((bm, bK), "float32")
        y = mem.fragment((bm, bK), "float32")
        T.clear(mix)
        T.clear(sq)
        T.copy(Pprev[row0, 0], p_s)
        for dk in T.serial(n_chunks):
            T.clear(y)
            for s in T.serial(N_HC):
                T.copy(X[row0, s * D + d_first + dk * bK], x_s)
                T.copy(Fn[0, s * D + d_first + dk * bK], fn_s)
                for i, c in mem.par(bm, bK):
                    xf_s[i, c] = as_act(x_s[i, c])
                T.gemm(xf_s, fn_s, mix, transpose_B=True)  # tf32 on GPU
                for i, c in mem.par(bm, bK):
                    sq[i, c] += xf_s[i, c] * xf_s[i, c]
                    y[i, c] += p_s[i, s] * xf_s[i, c]
            for i, c in mem.par(bm, bK):
                Y[row0 + i, d_first + dk * bK + c] = T.cast(as_act(y[i, c]) if xdt != act else y[i, c], xdt)
        T.reduce_sum(sq, rs, dim=1)

    return stream_channels


def pre_program(T_: int, D: int, *, eps: float, hc_eps: float, iters: int, target: str, cfg: Config = Config()):
    """prim_func(X [T, 4D] act, Fn [32, 4D] f32, Base [24], Scale [3], Pprev [T, 4] f32,
    Y [T, D] act, Pre [T, 4], Post [T, 4], Comb [T, 16] f32; Comb[t, 4j+k] = C[j, k])."""
    import tilelang.language as T

    bm, bK = cfg.block_m, cfg.block_k
    assert D % bK == 0
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    K4 = N_HC * D

    tail = _tail_macro(mem, K4, eps, hc_eps, iters)
    stream_channels = _stream_macro(mem, D, bm, bK, act)

    @T.prim_func
    def hc_pre(
        X: T.Tensor((T_, K4), act),
        Fn: T.Tensor((MIX_PAD, K4), "float32"),
        Base: T.Tensor((N_MIX,), "float32"),
        Scale: T.Tensor((3,), "float32"),
        Pprev: T.Tensor((T_, N_HC), "float32"),
        Y: T.Tensor((T_, D), act),
        Pre: T.Tensor((T_, N_HC), "float32"),
        Post: T.Tensor((T_, N_HC), "float32"),
        Comb: T.Tensor((T_, N_HC * N_HC), "float32"),
    ):
        with T.Kernel(T.ceildiv(T_, bm), threads=cfg.threads) as bx:
            mix = mem.fragment((bm, MIX_PAD), "float32")
            rs = mem.fragment((bm,), "float32")
            stream_channels(X, Fn, Pprev, Y, mix, rs, bx * bm, 0, D // bK)
            tail(mix, rs, bm, bx * bm, Base, Scale, Pre, Post, Comb)

    return hc_pre


def pre_split_programs(T_: int, D: int, *, eps: float, hc_eps: float, iters: int, target: str, splits: int = 20,
                       cfg: Config = Config(16, 64, 128), finish_rows: int = 16, finish_threads: int = 128,
                       io: str = ""):  # fmt: skip
    """hc_pre for few tokens (decode), as two kernels: pre_program gives a CTA all D channels of block_m tokens, so
    at 64 tokens ONE CTA walks 4 x D serially (~0.23 ms on the H200 whatever block_m). Here a CTA owns
    D / splits channels of block_m tokens -- grid (T / block_m, splits) -- and writes its partial mixes and sum of
    squares; its collapse columns of Y are complete (a channel's collapse needs no other channel). The finish
    kernel, finish_rows tokens per CTA, sums the partials in split order (deterministic: no atomics; the (token,
    column) sums spread over finish_threads threads), applies the RMS and runs the per-token Sinkhorn, one thread per
    token. Numerically the same function as pre_program up to the order of the channel sums.

    partial: prim_func(X [T, 4D] act, Fn [32, 4D] f32, Pprev [T, 4] f32, Y [T, D] act, Pm [splits, T, 32] f32,
                       Psq [splits, T] f32)
    finish:  prim_func(Pm, Psq, Base [24], Scale [3], Pre [T, 4], Post [T, 4], Comb [T, 16] f32)
    io "float32": X and Y fp32 in memory with the act (bf16) program's values (rounded on load and store; the
    partial reductions' order may differ, see _stream_macro)."""
    import tilelang.language as T

    bm, bK, bt = cfg.block_m, cfg.block_k, finish_rows
    assert D % splits == 0 and (D // splits) % bK == 0, f"D={D} must split into {splits} chunks of block_k={bK}"
    assert T_ % bm == 0 and T_ % bt == 0, f"rows {T_} must be a multiple of block_m={bm} and finish_rows={bt}"
    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    K4, per = N_HC * D, D // splits
    xdt = "float32" if io == "float32" else act
    tail = _tail_macro(mem, K4, eps, hc_eps, iters)
    stream_channels = _stream_macro(mem, D, bm, bK, act, xdt)

    @T.prim_func
    def hc_pre_partial(
        X: T.Tensor((T_, K4), xdt),
        Fn: T.Tensor((MIX_PAD, K4), "float32"),
        Pprev: T.Tensor((T_, N_HC), "float32"),
        Y: T.Tensor((T_, D), xdt),
        Pm: T.Tensor((splits, T_, MIX_PAD), "float32"),
        Psq: T.Tensor((splits, T_), "float32"),
    ):
        with T.Kernel(T_ // bm, splits, threads=cfg.threads) as (bx, sp):
            mix = mem.fragment((bm, MIX_PAD), "float32")
            rs = mem.fragment((bm,), "float32")
            stream_channels(X, Fn, Pprev, Y, mix, rs, bx * bm, sp * per, per // bK)
            for i in mem.par(bm):
                Psq[sp, bx * bm + i] = rs[i]
            for i, j in mem.par(bm, MIX_PAD):
                Pm[sp, bx * bm + i, j] = mix[i, j]

    @T.prim_func
    def hc_pre_finish(
        Pm: T.Tensor((splits, T_, MIX_PAD), "float32"),
        Psq: T.Tensor((splits, T_), "float32"),
        Base: T.Tensor((N_MIX,), "float32"),
        Scale: T.Tensor((3,), "float32"),
        Pre: T.Tensor((T_, N_HC), "float32"),
        Post: T.Tensor((T_, N_HC), "float32"),
        Comb: T.Tensor((T_, N_HC * N_HC), "float32"),
    ):
        with T.Kernel(T_ // bt, threads=finish_threads) as bx:
            # the partials summed in split order, (row, column) pairs across the threads: one thread per row
            # walking splits x 33 loads serially cost ~2 us per split on the H200 (67 us at 20 splits, 110 at 40)
            acc = mem.fragment((bt, MIX_PAD), "float32")
            sq = mem.fragment((bt,), "float32")
            T.clear(acc)
            T.clear(sq)
            for q in T.unroll(splits):  # unrolled: every split's loads in flight together, the adds in order
                for i, j in mem.par(bt, MIX_PAD):
                    acc[i, j] += Pm[q, bx * bt + i, j]
                for i in mem.par(bt):
                    sq[i] += Psq[q, bx * bt + i]
            tail(acc, sq, bt, bx * bt, Base, Scale, Pre, Post, Comb)

    return hc_pre_partial, hc_pre_finish


def pre_partial_program(T_: int, D: int, *, eps: float, hc_eps: float, iters: int, target: str, splits: int,
                        cfg: Config = Config(16, 64, 128), finish_rows: int = 16, io: str = ""):
    """The first kernel of pre_split_programs (one prim_func per built kernel)."""
    return pre_split_programs(T_, D, eps=eps, hc_eps=hc_eps, iters=iters, target=target, splits=splits, cfg=cfg,
                              finish_rows=finish_rows, io=io)[0]  # fmt: skip


def pre_finish_program(T_: int, D: int, *, eps: float, hc_eps: float, iters: int, target: str, splits: int,
                       cfg: Config = Config(16, 64, 128), finish_rows: int = 16, io: str = ""):
    """The second kernel of pre_split_programs (io: the pair's, for one key set; the finish reads no X)."""
    return pre_split_programs(T_, D, eps=eps, hc_eps=hc_eps, iters=iters, target=target, splits=splits, cfg=cfg,
                              finish_rows=finish_rows, io=io)[1]  # fmt: skip


def post_program(T_: int, D: int, *, target: str, block_m: int = 1, block_d: int = 512, threads: int = 128,
                 io: str = ""):  # fmt: skip
    """prim_func(X [T, 4, D] act, Y [T, D] act, Post [T, 4], Comb [T, 16], Out [T, 4, D] act).
    io "float32": X, Y and Out fp32 in memory with the act (bf16) program's numbers (rounded on load and store)."""
    import tilelang.language as T

    mem = Mem(target)
    act = "float32" if mem.cpu else "bfloat16"
    xdt = "float32" if io == "float32" else act
    bm, bD = block_m, block_d
    assert D % bD == 0

    def load(v):
        return T.cast(T.cast(v, act) if xdt != act else v, "float32")

    @T.prim_func
    def hc_post(
        X: T.Tensor((T_, N_HC, D), xdt),
        Y: T.Tensor((T_, D), xdt),
        Post: T.Tensor((T_, N_HC), "float32"),
        Comb: T.Tensor((T_, N_HC * N_HC), "float32"),
        Out: T.Tensor((T_, N_HC, D), xdt),
    ):
        with T.Kernel(D // bD, T.ceildiv(T_, bm), threads=threads) as (bx, by):
            for i, k, d in mem.par(bm, N_HC, bD):
                t = by * bm + i
                e = bx * bD + d
                mixed = (
                    Comb[t, k] * load(X[t, 0, e])
                    + Comb[t, N_HC + k] * load(X[t, 1, e])
                    + Comb[t, 2 * N_HC + k] * load(X[t, 2, e])
                    + Comb[t, 3 * N_HC + k] * load(X[t, 3, e])
                )
                Out[t, k, e] = T.cast(T.cast(Post[t, k] * load(Y[t, e]) + mixed, act), xdt)

    return hc_post


# ---------------------------------------------------------------------------------------------- reference


def coefficients_reference(mixes: torch.Tensor, base, scale, hc_eps: float, iters: int):
    """(pre [T, 4], post [T, 4], C [T, 4, 4]) from normalised mixes [T, 24], exactly as MODEL_SPEC §2.2."""
    n = N_HC
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    c = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    c = torch.softmax(c, dim=-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


def pre_reference(x, fn, base, scale, p_prev, eps: float, hc_eps: float, iters: int):
    """x [T, 4, D] -> (y [T, D] in x.dtype, pre, post, C [T, 4, 4]); collapse with p_prev (V4.1)."""
    xf = x.float().flatten(1)
    mixes = (xf @ fn.float().T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    pre, post, c = coefficients_reference(mixes, base.float(), scale.float(), hc_eps, iters)
    y = (p_prev.float().unsqueeze(-1) * x.float()).sum(1).to(x.dtype)
    return y, pre, post, c


def post_reference(x, y, post, c):
    """X'_k = post_k·y + Σ_j C[j,k]·X_j, i.e. post⊗y + Cᵀ·X."""
    mixed = torch.einsum("tjk,tjd->tkd", c.float(), x.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


def post_reference_loops(x, y, post, c):
    """Independent oracle for post: explicit loops in float64, C indexed [j, k] as written in the spec."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(N_HC):
            out[t, k] = post[t, k].double() * y[t].double()
            for j in range(N_HC):
                out[t, k] += c[t, j, k].double() * x[t, j].double()
    return out


def pre_roofline(T_: int, D: int, act_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): read X once + fn, write y; 2·24·4D flops of mixes + collapse."""
    return float(T_ * N_HC * D * act_bytes + 4 * N_MIX * N_HC * D + T_ * D * act_bytes), float(
        T_ * (2 * N_MIX * N_HC * D + 2 * N_HC * D + 3 * N_HC * D)
    )


def post_roofline(T_: int, D: int, act_bytes: int = 2) -> tuple[float, float]:
    """(bytes, flops): read X and y, write X'."""
    return float(act_bytes * T_ * D * (2 * N_HC + 1) + 80 * T_), float(T_ * N_HC * D * 10)


# ---------------------------------------------------------------------------------------------- ascend


def ascend_post_program(T_: int, D: int, *, block_d: int = 1024, num_cores: int = 32):
    """Ascend 950 hc post (vector cores): one (token, D-chunk) tile per step, SIMT over (k, d)."""
    import tilelang.ascend.language as T

    bD = block_d
    assert D % bD == 0
    n_chunks = D // bD

    @T.prim_func
    def hc_post_ascend(
        X: T.Tensor((T_, N_HC, D), "bfloat16"),
        Y: T.Tensor((T_, D), "bfloat16"),
        Post: T.Tensor((T_, N_HC), "float32"),
        Comb: T.Tensor((T_, N_HC * N_HC), "float32"),
        Out: T.Tensor((T_, N_HC, D), "bfloat16"),
    ):
        with T.Kernel(num_cores) as bx:
            x_ub = T.alloc_shared((N_HC, bD), "bfloat16")
            y_ub = T.alloc_shared((bD,), "bfloat16")
            o_ub = T.alloc_shared((N_HC, bD), "bfloat16")
            p_ub = T.alloc_shared((N_HC,), "float32")
            c_ub = T.alloc_shared((N_HC * N_HC,), "float32")
            for tile in T.Persistent([T_ * n_chunks], num_cores, bx):
                t, d0 = tile // n_chunks, tile % n_chunks * bD
                T.copy(X[t, 0:N_HC, d0 : d0 + bD], x_ub)
                T.copy(Y[t, d0 : d0 + bD], y_ub)
                T.copy(Post[t, 0:N_HC], p_ub)
                T.copy(Comb[t, 0 : N_HC * N_HC], c_ub)
                with T.SimtVF(threads=128):
                    for k, d in T.Parallel(N_HC, bD):
                        mixed = (
                            c_ub[k] * T.cast(x_ub[0, d], "float32")
                            + c_ub[N_HC + k] * T.cast(x_ub[1, d], "float32")
                            + c_ub[2 * N_HC + k] * T.cast(x_ub[2, d], "float32")
                            + c_ub[3 * N_HC + k] * T.cast(x_ub[3, d], "float32")
                        )
                        o_ub[k, d] = T.cast(p_ub[k] * T.cast(y_ub[d], "float32") + mixed, "bfloat16")
                T.copy(o_ub, Out[t, 0:N_HC, d0 : d0 + bD])

    return hc_post_ascend
