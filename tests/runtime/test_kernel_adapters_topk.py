"""TopKEntriesAdapter (issue 8): topk_entries through topk_select's exact program, its set put back in the op's
order. The oracle is the op's torch reference; the comparison is exact (indices, order and -1 padding)."""

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


def test_two_level_topk_declines():
    call = topk_call(2, 256, 16)
    call.args[1] = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ka.Decline, match="candidate blocks"):
        ka.adapter_for("topk_select", "topk_entries").keys(call)


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
