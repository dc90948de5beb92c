"""The pass manager: pipelines as data, the registry, errors naming the pass and node, the report."""

from __future__ import annotations

import pytest

from deepinfer.errors import ConfigError, VerificationError
from deepinfer.ir.builder import GraphBuilder
from deepinfer.passes.pipeline import PHASES, Pipeline, all_passes, register_pass, run_pipeline


def _graph():
    b = GraphBuilder("g")
    x = b.input("x", "f32", ["T", 4])
    b.silu(x)  # dead
    b.output(b.add(b.exp(x), b.exp(x)))
    return b.build()


@register_pass("test_break_types")
def _break(g):
    """Declares a wrong output type: the verifier must catch it and name this pass and the node."""
    n = g.nodes[-1]
    n.outputs[0].type = n.outputs[0].type.with_shape([1])
    return g


@register_pass("test_count_nodes")
class _CountNodes:
    """A class pass with an option."""

    def __init__(self, scale: int = 1):
        self.scale = scale

    def __call__(self, g):
        g.meta["counted"] = len(g.nodes) * self.scale
        return g


def test_default_pipeline_runs_and_reports():
    g = _graph()
    out, report = run_pipeline(g)
    assert [n.op for n in out.nodes] == ["exp", "add"] and len(g.nodes) == 4
    assert [r.phase for r in report.records][:4] == ["canonicalize"] * 4
    dce = report.records[0]
    assert (dce.name, dce.nodes_before, dce.nodes_after, dce.removed) == ("dce", 4, 3, {"silu": 1})
    text = report.format()
    assert "cse" in text and "-1 exp" in text and text.splitlines()[-1].startswith("total")


def test_phases_are_numbered_and_configurable():
    assert PHASES[0] == "canonicalize" and PHASES[2] == "fuse" and PHASES[5] == "plan_memory"
    pipe = Pipeline.from_config({"phases": {"0": ["dce"], "fuse": [["test_count_nodes", {"scale": 10}]]}})
    assert pipe.steps() == [("canonicalize", "dce", {}), ("fuse", "test_count_nodes", {"scale": 10})]
    out, _ = run_pipeline(_graph(), pipe)
    assert out.meta["counted"] == 30
    base = Pipeline.default().with_phase(2, [{"pass": "test_count_nodes"}])
    assert base.phases["canonicalize"] == Pipeline.default().phases["canonicalize"]
    assert Pipeline.from_config(base.to_config()) == base
    assert {"dce", "cse", "fold_constants", "specialize_shapes", "fuse_swiglu"} <= set(all_passes())


def test_unknown_pass_is_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        run_pipeline(_graph(), {"phases": {"fuse": ["fuse_everything"]}})
    assert "unknown pass 'fuse_everything'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown phase 'optimise'"):
        Pipeline.from_config({"phases": {"optimise": ["dce"]}})
    with pytest.raises(ConfigError, match="phase 9 does not exist"):
        Pipeline.from_config({"phases": {9: ["dce"]}})
    with pytest.raises(ConfigError, match="not a pass name"):
        Pipeline.from_config({"phases": {0: [3]}})


def test_a_pass_that_breaks_the_graph_is_named_with_the_node():
    with pytest.raises(VerificationError) as e:
        run_pipeline(_graph(), {"phases": {0: ["dce", "test_break_types"]}})
    msg = str(e.value)
    assert "after pass 'test_break_types'" in msg and "= add" in msg and "\n" not in msg


def test_registering_a_name_twice_fails():
    with pytest.raises(ConfigError, match="registered twice"):
        register_pass("dce")(lambda g: g)
