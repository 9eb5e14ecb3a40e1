"""bench.py: its commands parse and refuse the way the other CLIs do, and the existing tables still run on tiny
settings."""
import pytest
import torch
import typer
from typer.testing import CliRunner

import bench
import train

runner = CliRunner()


def invoke(*args):
    return runner.invoke(bench.app, [str(a) for a in args])


def flags(app):
    """Every option name of every command of a Typer app (one command: its own)."""
    cmd = typer.main.get_command(app)
    commands = cmd.commands.values() if hasattr(cmd, "commands") else [cmd]
    return {opt for c in commands for p in c.params for opt in (*p.opts, *p.secondary_opts)}


def test_one_flag_name_per_idea_shared_with_train():
    ours = flags(bench.app)
    assert not ours & {"--batch", "--models", "--preset", "--dir", "--out", "--ckpt"}
    for flag in ("--batch-size", "--seq-len", "--model", "--device", "--dtype", "--compile"):
        assert flag in ours, flag
    # the ideas both CLIs have are spelled as train.py spells them
    assert {"--batch-size", "--seq-len", "--model", "--device", "--compile", "--total-batch-size"} <= flags(train.app)


@pytest.mark.parametrize("args", [
    ["kernels", "--dtype", "float32"],  # the old spelling of fp32
    ["kernels", "--device", "tpu"],
    ["kernels", "--batch", "2"],  # renamed --batch-size
    ["train", "--model", "2b"],
    ["train", "--models", "tiny"],  # renamed --model, repeatable
    ["ckpt", "--model", "nope"],
])
def test_bad_choices_exit_2(args):
    assert invoke(*args).exit_code == 2


@pytest.mark.parametrize("args,message", [
    (["kernels", "--seq-len", 100, "--chunk-size", 64], "--seq-len 100 must be a multiple of --chunk-size 64"),
])
def test_bad_values_get_one_paragraph_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and message in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output


def test_existing_tables_still_run_on_tiny_settings(tmp_path):
    runs = [
        ["kernels", "--batch-size", 1, "--seq-len", 32, "--heads", 2, "--headdim", 16, "--d-state", 16,
         "--chunk-size", 16, "--reps", 1, "--no-recurrent", "--device", "cpu", "--dtype", "fp32"],
        ["data", "--tokens", 100_000, "--seq-len", 64, "--batch-size", 4, "--reps", 1, "--per-call", 1, "--no-prepare",
         "--workdir", tmp_path / "data"],
        ["ckpt", "--params", 4e6, "--reps", 1, "--workdir", tmp_path],
        ["train", "--model", "tiny", "--steps", 1, "--warmup", 0, "--device", "cpu"],
    ]
    threads = torch.get_num_threads()
    for args in runs:
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output)
        assert "machine: " in result.output
    assert torch.get_num_threads() == threads  # bench.py data gives the cores back
