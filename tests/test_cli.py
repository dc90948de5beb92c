"""The `deepinfer` command: help for every subcommand, one-line errors with exit code 2."""

import subprocess
import sys

import pytest

from deepinfer.cli import build_parser, main

SUBCOMMANDS = ["compile", "run", "tune", "bench", "inspect", "make-checkpoint"]


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_has_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0
    assert f"usage: deepinfer {sub}" in capsys.readouterr().out


def test_parser_lists_all_subcommands():
    text = build_parser().format_help()
    for sub in SUBCOMMANDS:
        assert sub in text


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_missing_file_is_one_line_exit_2(capsys, tmp_path):
    missing = tmp_path / "nope.json"
    assert main(["inspect", str(missing)]) == 2
    assert str(missing) in _one_line_error(capsys)


def test_debug_shows_the_traceback(tmp_path):
    from deepinfer.errors import DeepInferError

    with pytest.raises(DeepInferError):
        main(["--debug", "inspect", str(tmp_path / "nope.json")])


def test_console_script_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "deepinfer.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "make-checkpoint" in r.stdout


def test_run_without_plan_generates_with_the_tiny_model(capsys):
    assert main(["run", "--model", "deepseek-v4-flash", "--max-tokens", "3", "--prompt", "Hello"]) == 0
    out = capsys.readouterr().out
    assert "output (3 tokens)" in out and "token ids: [" in out
    assert "graph 'deepseek_v4'" in out


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["run", "--max-tokens", "0"], "--max-tokens must be positive"),
        (["run", "--model", "deepseek-v4-flash", "--prompt", ""], "empty prompt"),
        (["run", "no-such-plan-dir"], "no-such-plan-dir: no plan here"),
        (["run", "--model", "no-such-model"], "no-such-model"),
        (["compile"], "compile needs -o PLAN_DIR"),
        (["tune"], "no CUDA GPU on this machine"),
        (["bench"], "needs a CUDA device"),
    ],
)
def test_run_bad_input_is_one_line_exit_2(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in _one_line_error(capsys)


def test_compile_then_run_the_plan_equals_run_without_a_plan(tmp_path, capsys):
    plan, dump = tmp_path / "plan", tmp_path / "ir"
    argv = ["--model", "deepseek-v4-flash", "--max-tokens", "3", "--prompt", "Hi"]
    assert main(["compile", "--model", "deepseek-v4-flash", "-o", str(plan), "--dump-ir", str(dump), "-v"]) == 0
    out = capsys.readouterr().out
    assert "fuse_swiglu" in out and "wrote plan" in out
    assert (plan / "plan.json").is_file() and (dump / "00-input-graph.dil").is_file()
    assert main(["run", str(plan), *argv[2:]]) == 0
    from_plan = capsys.readouterr().out
    assert main(["run", *argv]) == 0
    direct = capsys.readouterr().out
    ids = [line for line in from_plan.splitlines() if line.startswith("token ids")]
    assert ids and ids == [line for line in direct.splitlines() if line.startswith("token ids")]
    # the plan is also something `inspect` prints
    assert main(["inspect", str(plan), "--summary-only"]) == 0
    assert "graph 'deepseek_v4'" in capsys.readouterr().out  # (the fused op names follow the pipeline)
    # an existing plan is not overwritten silently
    assert main(["compile", "--model", "deepseek-v4-flash", "-o", str(plan)]) == 2
    assert "already exists" in _one_line_error(capsys)


def test_run_rejects_a_plan_for_an_unsupported_target_or_missing_fields(tmp_path, capsys):
    import json

    plan = tmp_path / "plan"
    assert main(["compile", "--model", "deepseek-v4-flash", "-o", str(plan)]) == 0
    capsys.readouterr()
    doc = json.loads((plan / "plan.json").read_text())
    (plan / "plan.json").write_text(json.dumps({**doc, "target": "ascend950"}))
    assert main(["run", str(plan)]) == 2  # the runtime has no Ascend executor
    assert "ascend950" in _one_line_error(capsys)
    del doc["model"]
    (plan / "plan.json").write_text(json.dumps(doc))
    assert main(["run", str(plan)]) == 2
    assert "model: missing field" in _one_line_error(capsys)


def test_run_input_jsonl_to_output_jsonl_with_progress_and_summary(tmp_path, capsys):
    import json

    plan = tmp_path / "plan"
    assert main(["compile", "--model", "deepseek-v4-flash", "-o", str(plan)]) == 0
    lines = [
        {"prompt": "Hello"},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "temperature": 0.7, "seed": 3},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0},  # bad: this request alone fails
        {"prompt": "Bye", "colour": "red"},  # unknown field: this request alone fails
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert main(["run", str(plan), "--input", str(inp), "--output", str(out), "--max-tokens", "3"]) == 2
    cap = capsys.readouterr()
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["finish_reason"] for r in rows][:2] != ["error", "error"] and len(rows) == 4
    assert len(rows[1]["token_ids"]) <= 2 and rows[0]["ttft_s"] > 0
    assert "max_tokens must be a positive" in rows[2]["error"] and "colour" in rows[3]["error"]
    assert "4/4 requests" in cap.err and "request 2:" in cap.err
    assert "4 requests:" in cap.out and "tok/s" in cap.out


@pytest.mark.parametrize("flag, key", [("--no-batched-decode", "batched_decode"),
                                       ("--no-graph-warmup", "graph_warmup")])
def test_run_engine_switches_reach_the_engine(monkeypatch, capsys, flag, key):
    """`run PLAN --no-batched-decode` builds the engine with batched_decode=False (the one-sequence decode steps),
    `--no-graph-warmup` with graph_warmup=False (decode buckets captured at first use); without the flag the
    engine's default, None (on unless DEEPINFER_BATCHED_DECODE=0 / DEEPINFER_GRAPH_WARMUP=0)."""
    from types import SimpleNamespace

    from deepinfer.errors import DeepInferError
    from deepinfer.runtime import engine
    from deepinfer.runtime import plan as plan_mod

    seen: list[dict] = []

    def engine_spy(**kw):
        seen.append(kw)
        raise DeepInferError("stopped after the engine's arguments")

    monkeypatch.setattr(plan_mod, "load_plan", lambda path: SimpleNamespace(target="sm90"))
    monkeypatch.setattr(engine, "LLM", engine_spy)
    for flags, want in (([], None), ([flag], False)):
        assert main(["run", "a-plan", "--prompt", "Hi", *flags]) == 2
        assert "stopped after the engine's arguments" in _one_line_error(capsys)
        assert seen[-1][key] is want and seen[-1]["cuda_graphs"] is True


def test_sm90_plan_compiles_here_and_refuses_to_run_without_a_gpu(tmp_path, capsys):
    plan = tmp_path / "plan90"
    # --kernels none: building the bound kernels with nvcc takes ~2 min on CI's 2 cores and is covered by
    # tests/codegen/test_plan_kernels.py; this test is about the CLI path and the run-time refusal
    assert main(["compile", "--model", "deepseek-v4-flash", "--target", "sm90", "-o", str(plan), "-v",
                 "--kernels", "none"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "select_kernels" in out and "convert_fp4_to_fp8" in out
    assert main(["run", str(plan), "--max-tokens", "2"]) == 2
    assert "CUDA" in _one_line_error(capsys)


def test_compile_moe_format_g128_is_recorded_in_the_plan_and_printed(tmp_path, capsys):
    """--moe-format g128 (sm90): the FP4 experts as 128x128 FP8 blocks, 1x32 activations at decode and 1x128 at
    prefill -- the line printed, the record in the written plan's graph (the runtime's GraphExecutor applies it)."""
    from deepinfer.runtime.plan import load_plan

    plan = tmp_path / "plan_g128"
    argv = ["compile", "--model", "deepseek-v4.1-flash", "--target", "sm90", "-o", str(plan), "--kernels", "none"]
    assert main([*argv, "--moe-format", "g128"]) == 0
    out = capsys.readouterr().out
    assert "FP8 128x128 weight blocks; activations 1x32 at decode, 1x128 at prefill" in out and "not exact" in out
    loaded = load_plan(plan)
    assert loaded.graph.meta["moe_act_groups"] == {"decode": 32, "prefill": 128, "weight_block": 128}
    assert {n.attrs["block"] for n in loaded.graph.nodes if n.op == "moe_grouped_experts"} == {128}


@pytest.mark.parametrize("target", ["cpu", "sm100"])
def test_compile_moe_format_off_sm90_is_a_one_line_error(target, tmp_path, capsys):
    assert main(["compile", "--target", target, "--moe-format", "w128", "-o", str(tmp_path / "p"),
                 "--kernels", "none"]) == 2  # fmt: skip
    assert "--moe-format w128 applies to sm90" in _one_line_error(capsys)


def test_compile_model_refuses_a_moe_format_next_to_an_explicit_pipeline():
    from deepinfer.compiler import compile_model, default_pipeline
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="explicit pipeline"):
        compile_model(None, "sm90", pipeline=default_pipeline("sm90").to_config(), moe_format="g128")
