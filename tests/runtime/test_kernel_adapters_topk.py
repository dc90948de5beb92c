"""TopKEntriesAdapter (issue 8): topk_entries through topk_select's exact program, its set put back in the op's
order, with and without the op's positions (has_pos); the index scores adapters' check_view. The oracle is the op's
torch reference; the comparison is exact (indices, order and -1 padding)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka


def topk_call(t: int, c: int, k: int, seed: int = 0) -> ka.Call:
    """Indexer-like scores: ReLU ties (many exact zeros and repeated values), -inf past a causal limit per row."""
    g = torch.Generator().manual_seed(seed)
    s = torch.relu(torch.randn(t, c, generator=g)).round(decimals=1)
    lim = torch.randint(k // 2, c + 1, (t,), generator=g)
    s[torch.arange(c) >= lim.unsqueeze(1)] = float("-inf")
    return ka.Call("topk_entries", {"topk": k, "block": 1}, [s, None], ["s", "blocks"], [False, False], {}, {})


def reference(call: ka.Call) -> torch.Tensor:
    return get_op("topk_entries").run(call.args, call.attrs)[0]


def run_adapter(call: ka.Call, builder) -> torch.Tensor:
    adapter = ka.adapter_for("topk_select", "topk_entries")
    return adapter.run(call, [builder(key) for key in adapter.keys(call)])[0]


@pytest.fixture(autouse=True)
def _emulate(monkeypatch):
    monkeypatch.setattr(ka, "EMULATE", True)


@pytest.mark.parametrize("t", [1, 3, 8])
def test_emulated_select_gives_the_reference_indices(t):
    call = topk_call(t, 256, 32, seed=t)
    got, ref = run_adapter(call, ka.emulated_kernel), reference(call)
    assert got.dtype == ref.dtype == torch.int64 and torch.equal(got, ref)


def test_the_set_order_is_what_the_adapter_fixes():
    """The kernel's ascending-column set is not the op's order: without _score_order the indices differ."""
    from deepinfer.codegen.kernels import topk_select

    call = topk_call(4, 256, 32)
    assert not torch.equal(topk_select.reference(call.args[0], 32), reference(call))


def test_on_the_c_target_program():
    call = topk_call(2, 256, 16, seed=7)
    assert torch.equal(run_adapter(call, ka.c_target_kernel), reference(call))


@pytest.mark.parametrize("c", [257, 258, 259])
def test_columns_not_a_multiple_of_4(c):
    """The indexer's C is its compressed count + 1 (2049 / 4097 at 4096 tokens: declined before): the adapter pads
    the rows with -inf columns to topk_cols(C) (a power of two here; a multiple of 4 for the kernel's float4 rows) --
    never taken, so the op's indices
    exactly, the last real column (made the row's largest score) included; emulated and on the c-target program."""
    call = topk_call(3, c, 32, seed=c)
    call.args[0][0, c - 1] = 1e3
    adapter = ka.adapter_for("topk_select", "topk_entries")
    assert adapter.keys(call)[0].args[1] == 512
    ref = reference(call)
    assert ref[0, 0] == c - 1
    assert torch.equal(run_adapter(call, ka.emulated_kernel), ref)
    assert torch.equal(run_adapter(call, ka.c_target_kernel), ref)


def test_decode_columns_share_few_kernels():
    """C grows by one every `ratio` decoded tokens: the kernels are keyed on topk_cols(C), so a whole decode builds a
    handful of them (keyed on C itself it built one every few tokens), and every C still gets at least its columns,
    a multiple of 4, within the chunk the program takes for C anyway (a power of two up to 8192, then +4096 at most)."""
    adapter = ka.adapter_for("topk_select", "topk_entries")
    widths = {}
    for c in list(range(16, 9000, 7)) + [16385, 32769, 65536]:
        s = torch.zeros(1, c)
        call = ka.Call("topk_entries", {"topk": 16, "block": 1}, [s, None], ["s", "blocks"], [False, False], {}, {})
        cp = adapter.keys(call)[0].args[1]
        assert cp >= c and cp % 4 == 0 and (cp < 2 * c if c > 4 else cp <= 8), (c, cp)
        assert cp - c < 4096 or cp == 1 << (c - 1).bit_length(), (c, cp)
        widths[cp] = c
    assert sorted(widths) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 20480, 36864, 65536]


def test_padded_columns_never_taken_at_a_power_of_two():
    """Rows with fewer than k visible columns: the pad's -inf columns come back as -1, as the op's own."""
    call = topk_call(2, 70, 64, seed=3)
    assert ka.adapter_for("topk_select", "topk_entries").keys(call)[0].args[1] == 128
    assert torch.equal(run_adapter(call, ka.emulated_kernel), reference(call))


# ---------------------------------------------------------------------------------------------- with positions
# topk_entries with the op's positions (issues 6/8): topk_select built with has_pos and the op's ratio, so a row's
# columns past (p+1)//ratio are never read. The scores past that limit hold garbage here (the largest values: what
# a scores kernel that does not write them may leave); the oracle is the op's reference on the same call.


def positions_call(t: int, c: int, k: int, ratio: int, seed: int = 0) -> ka.Call:
    """ReLU-like tied scores; positions from 'nothing visible yet' to the whole cache; garbage past each limit."""
    g = torch.Generator().manual_seed(seed)
    s = torch.relu(torch.randn(t, c, generator=g)).round(decimals=1)
    pos = torch.randint(-1, c * ratio, (t,), generator=g)
    pos[-1] = ratio - 2  # (p+1)//ratio = 0: no visible entry
    pos[0] = c * ratio - 1  # every column visible
    dead = torch.arange(c)[None, :] >= ((pos + 1) // ratio)[:, None]
    s = s.masked_fill(dead, 1e30)
    return ka.Call("topk_entries", {"topk": k, "block": 1, "ratio": ratio}, [s, None, pos],
                   ["s", "blocks", "positions"], [False, False, False], {}, {})  # fmt: skip


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_the_kernel_is_keyed_with_positions_and_the_ratio(ratio):
    key = ka.adapter_for("topk_select", "topk_entries").keys(positions_call(2, 64, 8, ratio))[0]
    kw = dict(key.kwargs)
    assert kw["has_pos"] is True and kw["ratio"] == ratio


def test_without_positions_the_old_kernel():
    call = positions_call(2, 64, 8, 2)
    call.args = call.args[:2]  # a graph stored before the positions input
    kw = dict(ka.adapter_for("topk_select", "topk_entries").keys(call)[0].kwargs)
    assert kw["has_pos"] is False and kw["ratio"] == 1


@pytest.mark.parametrize("t, c, ratio", [(1, 64, 1), (3, 100, 2), (8, 256, 4)])
def test_emulated_select_with_positions_gives_the_reference_indices(t, c, ratio):
    """Rows padded to a power of two (t 3), columns to topk_cols(C) (C 100): padding rows see nothing."""
    call = positions_call(t, c, 16, ratio, seed=t + c)
    got, ref = run_adapter(call, ka.emulated_kernel), reference(call)
    assert torch.equal(got, ref)
    assert (ref[-1] == -1).all() if t > 1 else (ref[0] >= 0).all()


def test_the_garbage_would_win_without_positions():
    """Mutation check of the oracle: read without positions, the dead columns' values are taken."""
    call = positions_call(3, 100, 16, 2, seed=5)
    blind = get_op("topk_entries").run(call.args[:2], {"topk": 16, "block": 1})[0]
    assert not torch.equal(blind, reference(call))


def test_with_positions_on_the_c_target_program():
    call = positions_call(3, 130, 16, 2, seed=9)
    assert torch.equal(run_adapter(call, ka.c_target_kernel), reference(call))


@pytest.mark.parametrize("op", ["index_scores", "batched_index_scores"])
def test_scores_check_view_without_fill_compares_the_visible_columns(op):
    """The scores adapters' check_view (what a first-call check compares): bound with "fill": False the dead columns
    hold garbage, and the view puts the op's -inf back there -- the reference's values exactly; with fill, as is."""
    g = torch.Generator().manual_seed(2)
    b, h, di, c, ratio = 3, 4, 16, 40, 2
    q, w = torch.randn(b, h, di, generator=g), torch.randn(b, h, generator=g)
    keys = torch.randn(b * c if op.startswith("batched") else c, di, generator=g)
    pos = torch.tensor([0, 17, 79])
    args, attrs = [q, w, keys, pos], {"ratio": ratio, "scale": di**-0.5}
    ref = get_op(op).run(args, attrs)[0]
    garbage = ref.masked_fill(ref == float("-inf"), 7.0)
    adapter = ka.adapter_for("indexer_topk", op)
    nofill = ka.Call(op, attrs, args, ["q", "w", "k", "p"], [False] * 4, {"fill": False}, {})
    assert torch.equal(adapter.check_view(nofill, [garbage])[0], ref)
    filled = ka.Call(op, attrs, args, ["q", "w", "k", "p"], [False] * 4, {}, {})
    assert adapter.check_view(filled, [garbage])[0] is garbage


def two_level_call(t: int, c: int, k: int, nb: int, block: int, ratio: int = 1, seed: int = 0) -> ka.Call:
    """positions_call's scores with candidate blocks: real ids in random order, -1 padding, an out-of-range id and
    a repeated one (neither is a candidate: the op's block mask)."""
    call = positions_call(t, c, k, ratio, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    n = -(-c // block)
    blocks = torch.stack([torch.randperm(n, generator=g)[:nb] for _ in range(t)])
    blocks[:, -1] = -1
    blocks[0, -2] = n + 3
    blocks[-1, 1] = blocks[-1, 0]
    call.args[1] = blocks
    call.attrs["block"] = block
    return call


@pytest.mark.parametrize("t, c, nb, block", [(3, 256, 6, 8), (4, 130, 5, 4), (1, 64, 4, 4)])
def test_two_level_gathers_the_candidate_columns(t, c, nb, block):
    """Fewer candidate columns than the row: the program runs on the nb*block gathered columns (has_pos off: the
    invisible ones are -inf there) and the set is mapped back -- the op's indices exactly, emulated."""
    call = two_level_call(t, c, 8, nb, block, ratio=2, seed=c + nb)
    key = ka.adapter_for("topk_select", "topk_entries").keys(call)[0]
    assert key.args[1] == ka.topk_cols(nb * block) and dict(key.kwargs)["has_pos"] is False
    ref = reference(call)
    assert torch.equal(run_adapter(call, ka.emulated_kernel), ref) and (ref >= 0).any()


def test_two_level_with_more_candidate_columns_than_the_row_masks_it():
    """nb*block >= C (a short cache): the whole row with the columns outside the blocks -inf, read with positions."""
    call = two_level_call(3, 64, 8, 20, 4, ratio=1, seed=4)
    key = ka.adapter_for("topk_select", "topk_entries").keys(call)[0]
    assert key.args[1] == 64 and dict(key.kwargs)["has_pos"] is True
    assert torch.equal(run_adapter(call, ka.emulated_kernel), reference(call))


def test_two_level_on_the_c_target_program():
    for call in (two_level_call(2, 256, 8, 6, 8, ratio=2, seed=1), two_level_call(2, 64, 8, 20, 4, seed=2)):
        assert torch.equal(run_adapter(call, ka.c_target_kernel), reference(call))


_TRITON_ORDER = """
import torch
import test_kernel_adapters_topk as t
from deepinfer.runtime import kernel_adapters as ka
ka.EMULATE = True
ka._score_order = None  # the torch order must not run
for call in (t.positions_call(3, 100, 16, 2, seed=5), t.two_level_call(3, 256, 8, 6, 8, ratio=2, seed=6)):
    assert torch.equal(t.run_adapter(call, ka.emulated_kernel), t.reference(call))
print("ok")
"""


def test_the_set_put_in_order_by_the_triton_launch():
    """On CUDA the adapter orders the set with indexer_topk.triton_set_order (here in Triton's interpreter, in a
    process that starts with it on): the op's indices, one- and two-level."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", ka.ADAPTER_INTERPRET_ENV: "1",
           "PYTHONPATH": os.path.dirname(__file__)}  # fmt: skip
    env.pop(ka.TOPK_ORDER_ENV, None)
    proc = subprocess.run([sys.executable, "-c", _TRITON_ORDER], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_one_row_symbolic_program_serves_every_row_count():
    """`program` keys carry no rows (built with T_ None): calls of 1, 3 and 8 rows share one kernel (one c-target
    build here), each with its own scratch, each the op's indices."""
    calls = [positions_call(t, 100, 16, 2, seed=t) for t in (1, 3, 8)]
    adapter = ka.adapter_for("topk_select", "topk_entries")
    keys = {adapter.keys(call)[0] for call in calls}
    assert len(keys) == 1 and next(iter(keys)).args == (None, 128)
    kernel = ka.c_target_kernel(next(iter(keys)))
    cache: dict = {}
    for call in calls:
        call.cache = cache
        assert torch.equal(adapter.run(call, [kernel])[0], reference(call))
