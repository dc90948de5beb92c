"""Logits only for the sampled rows (passes/select_logit_rows.py): the selected rows are the head of those rows,
the engine's prefill computes one row (none for a chunk that does not end the prompt), and generation is the
same token for token as with every row's logits."""

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.ir import interpreter
from deepinfer.ir.builder import GraphBuilder
from deepinfer.ir.interpreter import concrete_attrs
from deepinfer.ir.registry import get_op
from deepinfer.models import deepseek_v41
from deepinfer.passes.pattern import clone_graph
from deepinfer.passes.select_logit_rows import (
    ROWS_INPUT,
    head_entry,
    head_rows,
    row_indices,
    rows_graph,
    select_logit_rows,
)
from deepinfer.runtime.cuda_executor import plan_steps
from deepinfer.runtime.session import Session, allocate_caches

from .conftest import compile_tiny, prompts_of_lengths, v41_tiny_config

T = 9


@pytest.fixture(scope="module")
def compact_v41():
    cfg = v41_tiny_config()
    parsed = deepseek_v41.parse_config(cfg)
    keep = parsed.window + parsed.dspark_block_size  # the smallest keep the model allows
    return compile_tiny("deepseek-v4.1-flash", cfg, mode="compact", keep_tokens=keep)


def _feeds(g, t: int) -> dict:
    return {"tokens": torch.arange(3, 3 + t) * 7 % 500, "positions": torch.arange(t), **allocate_caches(g, 32)}


def _run_with_head_inputs(g, feeds: dict, params: dict) -> tuple[list, dict]:
    """The unselected graph's outputs, and its head entry's row inputs by name."""
    entry = head_entry(g)
    probe = clone_graph(g)
    extra = [v for v in probe.nodes[g.nodes.index(entry)].inputs if v is not None and v.kind != "param"]
    probe.outputs = probe.outputs + extra
    outs = interpreter.run(probe, feeds, params)
    return outs[: len(g.outputs)], dict(zip([v.name for v in extra], outs[len(g.outputs) :]))


def _head_by_hand(g, head_inputs: dict, params: dict, rows: list[int]) -> torch.Tensor:
    """The oracle: the head entry's inputs at ``rows``, then the head's nodes one by one through their ops'
    references."""
    at = g.nodes.index(head_entry(g))
    vals = {k: v[rows] for k, v in head_inputs.items()}
    vals.update(params)
    for node in g.nodes[at:]:
        if all(v is None or v.name in vals for v in node.inputs):
            args = [None if v is None else vals[v.name] for v in node.inputs]
            vals.update(zip([o.name for o in node.outputs], get_op(node.op).run(args, concrete_attrs(node, {}))))
    return vals[g.outputs[0].name]


@pytest.mark.parametrize("which", ["tiny_v4", "tiny_v41", "compact_v41"])
def test_selected_rows_are_the_head_of_those_rows(which, request):
    model = request.getfixturevalue(which)
    g = model.plan.graph
    sel = select_logit_rows(g)
    assert [v.name for v in sel.inputs][-1] == ROWS_INPUT and sel.outputs[0].shape[0] == sel.inputs[-1].shape[0]
    assert [v.name for v in sel.outputs] == [v.name for v in g.outputs] and len(sel.nodes) > len(g.nodes)
    t = 30 if which == "compact_v41" else T  # compact: longer than keep_tokens, so the head sees the tail only
    feeds = _feeds(g, t)
    full, head_inputs = _run_with_head_inputs(g, feeds, model.params)
    n = head_rows(sel, t)
    assert n == full[0].shape[0] and (n < t) == (which == "compact_v41")
    for rows in ([n - 1], [0, 4, 4, 2]):
        outs = interpreter.run(sel, {**feeds, ROWS_INPUT: torch.tensor(rows)}, model.params)
        assert torch.equal(outs[0], _head_by_hand(g, head_inputs, model.params, rows)), rows
        # against every row's logits: the head GEMMs' sums depend on the row count (ulps), the tokens do not
        torch.testing.assert_close(outs[0], full[0][rows], rtol=0, atol=1e-5 * float(full[0].abs().max()))
        assert torch.equal(outs[0].argmax(-1), full[0][rows].argmax(-1))
        assert all(torch.equal(a, b) for a, b in zip(outs[1:], full[1:])), "caches and other outputs unchanged"
    empty = interpreter.run(sel, {**feeds, ROWS_INPUT: torch.zeros(0, dtype=torch.long)}, model.params)
    assert empty[0].shape == (0, full[0].shape[1])


def test_row_indices_count_from_the_end_and_check_the_range(tiny_v41):
    sel = select_logit_rows(tiny_v41.plan.graph)
    assert row_indices(sel, 5).tolist() == [0, 1, 2, 3, 4]
    assert row_indices(sel, 5, [-1, 0, -5]).tolist() == [4, 0, 0]
    assert row_indices(sel, 5, []).tolist() == []
    with pytest.raises(DeepInferError, match="5 logits rows"):
        row_indices(sel, 5, [5])
    assert select_logit_rows(sel) is sel  # already selecting


def test_a_graph_without_a_head_keeps_every_row():
    b = GraphBuilder("headless")
    b.output(b.neg(b.input("tokens", "f32", ["T", 4]), name="logits"))
    g, why = rows_graph(b.build())
    assert why is not None and "no hc_head/hc_collapse node before the logits" in why
    assert ROWS_INPUT not in [v.name for v in g.inputs]
    cfg = deepseek_v41.parse_config(v41_tiny_config())
    _, why = rows_graph(deepseek_v41.build_dspark_graph(cfg, weights="float"))  # every draft row is used
    assert why is not None and "not the logits" in why


def test_mtp_head_and_sm90_plans_are_found(tiny_v4):
    from deepinfer.compiler import compile_model
    from deepinfer.models import deepseek_v4

    mtp = deepseek_v4.build_mtp_graph(deepseek_v4.TINY_CONFIGS["tiny"], weights="float")
    assert head_entry(mtp).op == "hc_head" and select_logit_rows(mtp).outputs[0].shape[0].op == "sym"
    for model in ("deepseek-v4-flash:tiny", "deepseek-v4.1-flash:tiny"):  # the sm90 pipeline's fusions keep it
        g = compile_model(model, "sm90").plan.graph
        steps = plan_steps(select_logit_rows(g))
        head = [s.node.op for s in steps if s.rows]
        assert head[0] == "index_select" and head[-1] == "linear" and steps[-1].rows, (model, head)


def test_executor_without_logit_rows_computes_every_row(tiny_v41):
    """Callers that feed the plan's inputs by name (benchmarks, teacher-forced checks) keep [T, vocab]."""
    from deepinfer.runtime.cuda_executor import CudaRunner

    runner = CudaRunner(tiny_v41.plan.graph, tiny_v41.params, device="cpu")
    feeds = _feeds(tiny_v41.plan.graph, 5)
    assert runner.exec.has_rows and runner.exec.run(feeds)[0].shape[0] == 5
    assert runner.forward(feeds["tokens"], feeds["positions"], dict(list(feeds.items())[2:]))[0].shape[0] == 5


def test_session_rows_and_default(tiny_v4):
    prompt = prompts_of_lengths([T], seed=5)[0]
    full = Session(tiny_v4.graph, tiny_v4.params, max_len=16).forward(prompt)
    assert full.shape[0] == T  # default: every row, through the graph as given
    last = Session(tiny_v4.graph, tiny_v4.params, max_len=16).forward(prompt, logit_rows=[-1])
    assert last.shape[0] == 1 and torch.equal(last.argmax(-1), full[-1:].argmax(-1))


class _HeadRows:
    """Records the rows every head step the executor runs produces (the logit_rows gather and what follows)."""

    def __init__(self, ex):
        self.seen: list[tuple[str, int]] = []
        inner = ex._run_node

        def spy(step, args, attrs, t):
            outs = inner(step, args, attrs, t)
            if step.rows:
                self.seen.append((step.node.op, int(outs[0].shape[0])))
            return outs

        ex._run_node = spy


def _reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding from every row's logits (the graph as given: no row selection)."""
    s = Session(model.graph, model.params, max_len=len(prompt) + n)
    out = [int(s.forward(prompt)[-1].argmax())]
    while len(out) < n:
        out.append(int(s.forward([out[-1]])[-1].argmax()))
    return out


@pytest.mark.parametrize("runner", ["interpreter", "cuda_executor_on_cpu"])
def test_engine_prefill_computes_only_the_sampled_row(tiny_v41, runner):
    from deepinfer.runtime.cuda_executor import CudaRunner

    prompts = prompts_of_lengths([21, 6], seed=9)
    llm = LLM(plan=tiny_v41.plan, params=tiny_v41.params, max_num_batched_tokens=8, max_model_len=32,
              enable_prefix_caching=False)  # fmt: skip
    if runner == "cuda_executor_on_cpu":  # the sm90 runner's dispatch and decode slots, references only
        llm.executor.runner = CudaRunner(tiny_v41.plan.graph, tiny_v41.params, device="cpu", max_model_len=32)
        heads = _HeadRows(llm.executor.runner.exec)
    shapes: list[tuple[int, int]] = []
    real = llm.executor.runner.forward_device if runner != "interpreter" else llm.executor.runner.forward

    def forward(tokens, positions, caches, **kw):
        logits, new = real(tokens, positions, caches, **kw)
        shapes.append((len(tokens), logits.shape[0]))
        return logits, new

    setattr(llm.executor.runner, "forward_device" if runner != "interpreter" else "forward", forward)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_reference_greedy(tiny_v41, p, 4) for p in prompts]
    items = [(end - start, int(samples)) for step in llm.batch_log for _, start, end, samples in step[:-1]]
    if runner == "cuda_executor_on_cpu":
        items = [it for it in items if it[0] > 1]  # single-token items go through the decode slots
    # one row where the item samples (the end of a prompt, a decode step), none for a chunk inside a prompt
    assert shapes == items and (8, 0) in shapes, (shapes, items)
    if runner == "cuda_executor_on_cpu":
        assert heads.seen and {rows for _, rows in heads.seen} == {1}  # L=0 chunks launch no head step
        assert {op for op, _ in heads.seen} >= {"index_select", "hc_collapse", "linear"}
        assert llm.executor.runner.graphs.batches > 0  # the decode slots (with their static logit_rows) ran


def test_batched_decode_of_a_selecting_graph(tiny_v41):
    from deepinfer.runtime.batched_decode import BatchedDecoder

    g = tiny_v41.plan.graph
    plain = BatchedDecoder(g, tiny_v41.params, device="cpu", max_model_len=16, compiled=False)
    sel = BatchedDecoder(select_logit_rows(g), tiny_v41.params, device="cpu", max_model_len=16, compiled=False)
    tokens, positions = [5, 9, 13], [0, 0, 0]
    want, _ = plain.step(tokens, positions, plain.allocate(3))
    got, _ = sel.step(tokens, positions, sel.allocate(3))
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_runner_prefill_rows(sm90_tiny):
    """The sm90 runner with kernels: a prefill's last row alone (the head at the decode bucket's kernels) is every
    row's last row to kernel rounding; no rows launches no head step."""
    from deepinfer.runtime import kernel_adapters as ka
    from deepinfer.runtime.cuda_executor import CudaRunner, KernelCache

    head_families = {"linear_bf16", "rmsnorm_quant"}

    def head_kernels_only(key):  # the layers' kernels are other tests' business: keep this test's builds few
        if key.family not in head_families:
            raise ka.Decline("not a head kernel")
        return ka.build_kernel(key)

    plan, params = sm90_tiny
    runner = CudaRunner(plan.graph, params, max_model_len=64, kernels=KernelCache(builder=head_kernels_only))
    heads = _HeadRows(runner.exec)
    tokens = torch.tensor(prompts_of_lengths([40], seed=4, vocab=120000)[0])
    positions = torch.arange(40)
    full, _ = runner.forward(tokens, positions, allocate_caches(runner.graph, 64, device="cuda"))
    last, _ = runner.forward(tokens, positions, allocate_caches(runner.graph, 64, device="cuda"), logit_rows=[-1])
    n_seen = len(heads.seen)
    assert runner.exec.stats.per_node["logits"] == "compiled linear_bf16", runner.report()  # the decode LM head
    none, _ = runner.forward(tokens, positions, allocate_caches(runner.graph, 64, device="cuda"), logit_rows=[])
    assert full.shape[0] == 40 and last.shape[0] == 1 and none.shape == (0, full.shape[1])
    assert len(heads.seen) == n_seen and {rows for _, rows in heads.seen} == {1, 40}, heads.seen
    scale = float(full[-1].abs().max())
    assert float((last[0] - full[-1]).abs().max()) <= 2e-2 * scale, runner.report()
    assert float(full[-1][int(last[0].argmax())]) >= float(full[-1].max()) - 2e-2 * scale  # the same token, or a tie
    assert not [k for k in runner.exec.kernels.failed if k.family in head_families], runner.report()
