"""candidate_blocks (V4.1's first indexer level) on codegen/kernels/candidate_blocks.py: exact against the op's
reference (ir/ops/v41.py CandidateBlocks) in Triton's interpreter -- ties (few distinct values, -0.0 next to +0.0),
+-inf and subnormal scores, rows with no visible entry (position 0 at ratio > 1, padding rows at -1), fewer visible
blocks than topk_blocks, partial last blocks, every level of the selection's ladder and the long rows' merge --
the columns past a row's visible limit never read, the sm_90a build (no spills), and on an H200 the real dims (2048
blocks of 8) at B1 / B64 / B256 in and out of a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from deepinfer.codegen.kernels import candidate_blocks as cb
from deepinfer.ir.ops.v41 import CandidateBlocks
from tests.codegen._triton_aot import compile_sm90, spill_free


def scores(kind: str, t: int, c: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "rand":
        return torch.randn(t, c, generator=g)
    if kind == "ties":  # a few values: whole blocks tie; -0.0 beside +0.0 (equal to torch's sort)
        s = torch.randint(-2, 3, (t, c), generator=g).float()
        return torch.where((s == 0) & (torch.rand(t, c, generator=g) < 0.5), -0.0, s)
    if kind == "limits":  # +inf, the largest finite, subnormals, both zeros, -inf among randoms
        special = torch.tensor([float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 0.0, -0.0, float("-inf")])
        pick = special[torch.randint(0, 8, (t, c), generator=g)]
        return torch.where(torch.rand(t, c, generator=g) < 0.3, pick, torch.randn(t, c, generator=g))
    raise ValueError(kind)


def visible(s: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """The op's contract: -inf past each row's visible columns (index_scores writes them so)."""
    lim = (pos.long() + 1) // ratio
    return s.masked_fill(torch.arange(s.shape[1])[None, :] >= lim[:, None], float("-inf"))


def check(s, pos, *, ratio, k, block, cfg=None):
    want = CandidateBlocks.reference(visible(s, pos, ratio), pos, ratio=ratio, topk_blocks=k, block=block)
    got = cb.triton_candidate_blocks(visible(s, pos, ratio), pos, ratio=ratio, topk_blocks=k, block=block, cfg=cfg)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("kind", ["rand", "ties", "limits"])
@pytest.mark.parametrize("ratio, block", [(1, 8), (2, 8), (4, 3)])
def test_matches_the_reference(interpret, kind, ratio, block):
    """Rows: nothing visible (padding -1, position 0 at ratio > 1), one entry, a partial block, fewer visible
    blocks than k, more (k of them chosen), the whole cache. C = 301: a partial last block (the default config:
    every row one sort)."""
    c, k = 301, 24
    pos = torch.tensor([-1, 0, 1, 9 * ratio, 60 * ratio + 1, 200 * ratio, c * ratio - 1])
    check(scores(kind, len(pos), c, seed=ratio * 10 + block), pos, ratio=ratio, k=k, block=block)


@pytest.mark.parametrize("kind", ["rand", "ties", "limits"])
@pytest.mark.parametrize("scan", [8, 64])
def test_every_ladder_level_and_the_long_rows(interpret, kind, scan):
    """k = 12 (KP 16): a ladder 4, 8 and rows past it of up to k visible blocks (every one a winner) and more (the
    radix select), merged from sorted chunks of 4; scans of 8 blocks (many loop steps, one ending exactly at a
    row's end) or 64. "ties": the k-th score shared by many blocks (the lowest ids of them win)."""
    c, block, k = 1000, 4, 12
    cfg = cb.Config(bnb=16, chunk=8, sort_warps=2, smallest=4, merge_chunk=4, scan=scan)
    nvis = torch.tensor([0, 3, 5, 8, 9, 12, 13, 16, 17, 32, 33, 64, 65, 112, 160, 250])
    check(scores(kind, len(nvis), c, seed=3), nvis * block - 1, ratio=1, k=k, block=block, cfg=cfg)


def test_signed_zero_blocks_tie(interpret):
    """Blocks whose maximum is -0.0 or +0.0 tie (torch's sort: ties to the lower id), below positive blocks and
    above negative ones; the newest block is first whatever its score."""
    s = torch.tensor([[-0.0, -1.0, 0.0, -2.0, -0.0, -0.0, 3.0, -5.0, -0.0, -3.0, -4.0, -0.0, -7.0, 0.0]])
    got = cb.triton_candidate_blocks(s, torch.tensor([13]), ratio=1, topk_blocks=7, block=2)
    assert got.tolist() == [[6, 3, 0, 1, 2, 4, 5]]
    check(s, torch.tensor([13]), ratio=1, k=7, block=2)


def test_fewer_blocks_in_the_cache_than_k(interpret):
    """nb = 5 < k = 40: the sort is 8 keys and the rest of each row is padding."""
    s = scores("ties", 3, 37, seed=5)
    check(s, torch.tensor([36, 3, 20]), ratio=1, k=40, block=8)


def test_columns_past_the_limit_never_count(interpret):
    """Anything past a row's visible columns (a scores kernel bound fill False leaves them unwritten): NaN or huge
    values there change neither the op's reference nor its sync-free form (both masked by the positions since
    session 10: the old reference took 1e30 blocks first) nor the kernel's ids (it never reads them)."""
    from deepinfer.runtime.cuda_graphs import candidate_blocks as sync_free

    s, pos = scores("rand", 4, 512, seed=7), torch.tensor([0, 63, 64, 300])
    past = torch.arange(512)[None, :] > pos[:, None]
    garbage = torch.where(torch.arange(4)[:, None] % 2 == 0, float("nan"), 1e30).expand(4, 512)
    dirty = torch.where(past, garbage, s)
    kw = dict(ratio=1, topk_blocks=16, block=8)
    want = CandidateBlocks.reference(visible(s, pos, 1), pos, **kw)
    assert torch.equal(CandidateBlocks.reference(dirty, pos, **kw), want)
    assert torch.equal(sync_free(dirty, pos, **kw), want)
    for cfg in (cb.default_config(4, 512, 8, 16), cb.Config(chunk=8, smallest=4, merge_chunk=4, scan=16)):
        assert torch.equal(cb.triton_candidate_blocks(dirty, pos, cfg=cfg, **kw), want), cfg  # (short rows, long rows)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="scores \\[T, C\\] and positions \\[T\\]"):
        cb.triton_candidate_blocks(torch.zeros(8), torch.zeros(1, dtype=torch.long), ratio=1, topk_blocks=2, block=4)
    with pytest.raises(ValueError, match="must be powers of two"):
        cb.check_config(4096, 8, 512, cb.Config(scan=1000))


def test_configs():
    """The real dims: 512 blocks (mml 4096) sort at once, rows of 8192 (mml 65536) are merged; every config of the
    space is valid and the default comes first."""
    d4, d64 = cb.default_config(64, 4096, 8, 2048), cb.default_config(64, 65536, 8, 2048)
    assert (d4.chunk, d64.chunk, d64.merge_chunk, d64.scan, d64.sort_warps) == (512, 512, 512, 2048, 4)
    for c in (4096, 65536, 1 << 20):
        space = cb.config_space(64, c, 8, 2048)
        assert space[0] == cb.default_config(64, c, 8, 2048) and len(set(space)) == len(space)
        for cfg in space:
            cb.check_config(c, 8, 2048, cfg)
    assert cb.roofline(4096 * 64, 64, 2048) == 4 * 4096 * 64 + 8 * 64 * 2048


def test_compiles_for_hopper_without_spills():
    """The default selection of a 4k cache (sorts of 256 / 512 keys, 4 warps) and of a longer one (+ the winners,
    scans of 2048), the block maxima, and the long rows' chunk sort (512 keys) and merge (4 chunks x 10 steps)."""
    sig = {"bmax_ptr": "*fp32", "pos_ptr": "*i64", "best_ptr": "*i64", "out_ptr": "*i64", "C": "i32", "NB": "i32",
           "ratio": "i32"}  # fmt: skip
    for long in (False, True):
        ptx, report = compile_sm90("deepinfer.codegen.kernels.candidate_blocks", "select_jit", sig,
                                   dict(BLOCK=8, K=2048, KP=2048, CH=512, LADDER=2, LONG=long, SCAN=2048),
                                   num_warps=4)  # fmt: skip
        assert ".target sm_90a" in ptx and spill_free(report), report
    sig = {"s_ptr": "*fp32", "s_stride": "i64", "pos_ptr": "*i64", "bmax_ptr": "*fp32", "C": "i32", "NB": "i32",
           "ratio": "i32"}  # fmt: skip
    ptx, report = compile_sm90("deepinfer.codegen.kernels.candidate_blocks", "block_max_jit", sig,
                               dict(BLOCK=8, BLKP=8, BNB=256), num_warps=4)  # fmt: skip
    assert ".target sm_90a" in ptx and spill_free(report), report
    common = dict(BLOCK=8, K=2048, KP=2048, CH=512, MC=512)
    sig = {"pos_ptr": "*i64", "best_ptr": "*i64", "sorted_ptr": "*i64", "C": "i32", "ratio": "i32"}
    ptx, report = compile_sm90("deepinfer.codegen.kernels.candidate_blocks", "chunk_sort_jit", sig, common,
                               num_warps=4)  # fmt: skip
    assert ".target sm_90a" in ptx and spill_free(report), report
    sig = {"pos_ptr": "*i64", "sorted_ptr": "*i64", "out_ptr": "*i64", "C": "i32", "ratio": "i32"}
    ptx, report = compile_sm90("deepinfer.codegen.kernels.candidate_blocks", "merge_jit", sig,
                               dict(common, RT=128, STEPS=10), num_warps=4)  # fmt: skip
    assert ".target sm_90a" in ptx and spill_free(report), report


def test_the_adapter_runs_the_kernel(interpret, monkeypatch):
    """runtime/kernel_adapters' CandidateBlocksAdapter: no TileLang key, the kernel's ids (under the interpreter when
    the adapters may use it), else the sync-free torch form -- the reference's ids both ways."""
    from deepinfer.runtime import kernel_adapters as ka

    monkeypatch.setattr(ka, "EMULATE", True)
    launched = []
    real = cb.triton_candidate_blocks
    monkeypatch.setattr(cb, "triton_candidate_blocks", lambda *a, **k: launched.append(k["cfg"]) or real(*a, **k))
    pos = torch.tensor([-1, 5, 120, 299])
    s = visible(scores("ties", 4, 300, seed=11), pos, 2)
    attrs = {"ratio": 2, "topk_blocks": 16, "block": 8}
    want = CandidateBlocks.reference(s, pos, **attrs)
    adapter = ka.adapter_for("candidate_blocks", "candidate_blocks")
    call = ka.Call("candidate_blocks", attrs, [s, pos], ["s", "p"], [False, False], {})
    assert adapter.keys(call) == []
    assert torch.equal(adapter.run(call, [])[0], want) and not launched  # (torch: the adapters' interpreter is off)
    monkeypatch.setenv(ka.ADAPTER_INTERPRET_ENV, "1")
    assert torch.equal(adapter.run(call, [])[0], want) and launched == [cb.default_config(4, 300, 8, 16)]
    with pytest.raises(ka.Decline, match="scores \\[T, C\\] and positions \\[T\\]"):
        adapter.keys(ka.Call("candidate_blocks", attrs, [s, pos[:2]], ["s", "p"], [False, False], {}))


def test_the_v41_candidate_source_is_bound_to_the_kernel():
    """select_kernels binds layer 20's candidate_blocks (tiny V4.1: its candidate source) to the family at every
    bucket on sm90; the cpu target keeps the reference, with the reason."""
    from deepinfer.models import deepseek_v41 as m41
    from deepinfer.models.presets import preset_config
    from deepinfer.passes.pattern import clone_graph
    from deepinfer.passes.select_kernels import select_kernels

    g = m41.build_graph(m41.parse_config(preset_config("deepseek-v4.1-flash", "tiny")))
    (node,) = [n for n in g.nodes if n.op == "candidate_blocks"]
    name = node.outputs[0].name
    bound = select_kernels(clone_graph(g), target="sm90").meta["kernels"]["nodes"][name]["buckets"]
    for b in bound.values():
        assert b["family"] == "candidate_blocks" and b["shape"]["k"] == node.attrs["topk_blocks"], b
    cpu = select_kernels(clone_graph(g), target="cpu").meta["kernels"]
    assert {b["family"] for b in cpu["nodes"][name]["buckets"].values()} == {"torch_ref"}
    assert "Triton on CUDA" in cpu["fallback"]["candidate_blocks"]


@pytest.mark.gpu
@pytest.mark.parametrize("ctx, c", [(4096, 4096), (4096, 65536), (65536, 65536)])
def test_h200_real_dims_and_cuda_graph(ctx, c):
    """2048 blocks of 8, ratio 1 (layer 20) at B1 / B64 / B256: the ids equal the reference's eagerly and when
    replayed from a CUDA graph (no host read: the capture would fail) on new scores and positions."""
    for b in (1, 64, 256):  # (off CUDA the gpu mark skips it with its reason: tests/conftest.py)
        g = torch.Generator(device="cuda").manual_seed(b)
        pos = torch.tensor([ctx - 1 - (i % 3) * 997 for i in range(b)], device="cuda")
        s = torch.relu(torch.randn(b, c, device="cuda", generator=g)).round(decimals=1)  # (ties)
        s = s.masked_fill(torch.arange(c, device="cuda")[None, :] > pos[:, None], float("-inf"))
        kw = dict(ratio=1, topk_blocks=2048, block=8)
        assert torch.equal(cb.triton_candidate_blocks(s, pos, **kw), CandidateBlocks.reference(s, pos, **kw)), b
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cb.triton_candidate_blocks(s, pos, **kw)
        s.copy_(torch.randn(b, c, device="cuda", generator=g).masked_fill(s == float("-inf"), float("-inf")))
        pos.sub_(1)
        s.masked_fill_(torch.arange(c, device="cuda")[None, :] > pos[:, None], float("-inf"))
        graph.replay()
        assert torch.equal(out, CandidateBlocks.reference(s, pos, **kw)), b
