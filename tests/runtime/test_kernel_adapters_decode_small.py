"""The decode small-op adapters with Triton kernels (the interpreter on CPU tensors, in a fresh process: it must be
on before triton is imported) against the ops' references: index_scores (indexer_topk.triton_scores) and linear
with a bf16 weight (linear_bf16), dequant_fp8 (act_quant.triton_dequant, bit for bit), scatter_rows
(cache_rows, exactly); and the executor's first-call check on outputs with masked (-inf) entries."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from deepinfer.runtime import cuda_executor as cx

_SCRIPT = r"""
import torch
from deepinfer.ir.registry import get_op
from deepinfer.runtime import kernel_adapters as ka

ka.EMULATE = True
from deepinfer.codegen.kernels import indexer_topk as it

calls = []
_kernel = it.triton_scores
it.triton_scores = lambda *a, **k: calls.append(1) or _kernel(*a, **k)
g = torch.Generator().manual_seed(0)
q, w = torch.randn(9, 32, 128, generator=g), torch.randn(9, 32, generator=g) / 6
keys = torch.randn(70, 128, generator=g)
pos = torch.arange(130, 139)
attrs = {"ratio": 2, "scale": 0.088}
a = ka.adapter_for("indexer_topk", "index_scores")
call = ka.Call("index_scores", attrs, [q, w, keys, pos], ["q", "w", "k", "p"], [False] * 4, {"precision": "tf32x3"})
assert a.keys(call) == []
s = a.run(call, [])[0]
ref = get_op("index_scores").run([q, w, keys, pos], attrs)[0]
assert calls, "the kernel did not run"
fin = torch.isfinite(ref)
visible = sum(min((p + 1) // 2, 70) for p in range(130, 139))
assert torch.equal(fin, torch.isfinite(s)) and int(fin.sum()) == visible
assert ((s - ref)[fin].abs().max() / ref[fin].abs().max()).item() < 1e-6

from deepinfer.codegen.kernels import linear_bf16

lin_calls = []
_linear = linear_bf16.triton_linear
linear_bf16.triton_linear = lambda *a, **k: lin_calls.append(1) or _linear(*a, **k)
x, wb = torch.randn(3, 2, 320, generator=g), (torch.randn(48, 320, generator=g) / 9).bfloat16()
a = ka.adapter_for("linear_bf16", "linear")
call = ka.Call("linear", {}, [x, wb, None], ["x", "w", "b"], [False, True, False], {"splits": 5, "block_k": 64})
assert a.keys(call) == [] and a._cfg(call).splits == 5
y = a.run(call, [])[0]
ref = get_op("linear").run([x, wb, None], {})[0]
assert lin_calls and y.shape == ref.shape == (3, 2, 48)
assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-6
bad = ka.Call("linear", {}, [x, wb, None], ["x", "w", "b"], [False, True, False], {"splits": 3, "block_k": 64})
try:
    a.keys(bad)
    raise SystemExit("a split that does not divide K must decline")
except ka.Decline:
    pass

from deepinfer.ir import dtypes as dt
from deepinfer.codegen.kernels import act_quant

dq_calls = []
_dq = act_quant.triton_dequant
act_quant.triton_dequant = lambda *a, **k: dq_calls.append(1) or _dq(*a, **k)
xq = (torch.randn(3, 8, 256, generator=g) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
sq = dt.float_to_e8m0(2.0 ** torch.randint(-20, 5, (3, 8, 2), generator=g).float())
a = ka.adapter_for("act_quant", "dequant_fp8")
attrs = {"group": 128, "dtype": dt.f32}
call = ka.Call("dequant_fp8", attrs, [xq, sq], ["q", "s"], [False, False], {})
assert a.keys(call) == []
y = a.run(call, [])[0]
assert dq_calls and torch.equal(y, get_op("dequant_fp8").run([xq, sq], attrs)[0]), "dequant bit for bit"

from deepinfer.codegen.kernels import cache_rows

sc_calls = []
_sc = cache_rows.triton_scatter_rows
cache_rows.triton_scatter_rows = lambda *a, **k: sc_calls.append(1) or _sc(*a, **k)
cache, rows = torch.randn(30, 4, 8, generator=g), torch.randn(5, 4, 8, generator=g)
idx = torch.tensor([3, -1, 29, 0, 7])
a = ka.adapter_for("cache_rows", "scatter_rows")
call = ka.Call("scatter_rows", {}, [cache, idx, rows], ["c", "i", "r"], [False] * 3, {})
assert a.keys(call) == []
out = a.run(call, [])[0]
assert sc_calls and torch.equal(out, get_op("scatter_rows").run([cache, idx, rows], {})[0]), "scatter exactly"
print("ok")
"""


def test_adapter_matches_the_op_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_ADAPTER_INTERPRET": "1",
           "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_first_call_check_compares_masked_scores():
    """The same -inf on both sides leaves the comparison; a finite value against -inf, or a NaN, still fails it."""
    ref = torch.tensor([[1.0, 2.0, float("-inf")], [0.5, float("-inf"), float("-inf")]])
    ok = ref.clone()
    ok[0, 0] = 1.001
    assert cx._rel_err(ok, ref) < 1e-3 and cx._rel_l2(ok, ref) < 1e-3
    bad = ref.clone()
    bad[1, 1] = 0.0
    assert not cx._rel_err(bad, ref) <= cx.VERIFY_TOL
    nan = ref.clone()
    nan[0, 1] = float("nan")
    assert not cx._rel_err(nan, ref) <= cx.VERIFY_TOL
