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
        (["run", "some-plan-dir"], "not built yet"),
        (["run", "--model", "no-such-model"], "no-such-model"),
        (["compile"], "not built yet"),
    ],
)
def test_run_bad_input_is_one_line_exit_2(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in _one_line_error(capsys)
