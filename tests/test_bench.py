"""bench.py: its commands parse and refuse the way the other CLIs do, the existing tables still
run on tiny settings, and what of the GPU check runs without a GPU: the compulsory byte count,
the Triton vs torch layer check and timing (through the interpreter). The GPU evidence of
tools/gpu_evidence.py is tests/test_tools.py's."""
import dataclasses
import types

import pytest
import torch
import typer
from typer.testing import CliRunner

import bench
import train
from model import PRESETS, Mamba3LM, Mamba3Mixer

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
    for flag in ("--batch-size", "--seq-len", "--model", "--device", "--dtype", "--compile",
                 "--total-batch-size"):
        assert flag in ours, flag
    # the ideas both CLIs have are spelled as train.py spells them
    assert {"--batch-size", "--seq-len", "--model", "--device", "--compile",
            "--total-batch-size"} <= flags(train.app)


@pytest.mark.smoke
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


@pytest.mark.parametrize("args", [["gpu", "--reps", 0], ["gpu", "--train-steps", -1],
                                  ["data", "--batch-size", 0]])
def test_out_of_range_values_exit_2(args):
    result = invoke(*args)
    assert (result.exit_code == 2 and "Invalid value" in result.output
            and "Traceback" not in result.output)


def test_bad_combinations_get_one_paragraph_and_exit_2():
    result = invoke("kernels", "--seq-len", 100, "--chunk-size", 64)
    assert result.exit_code == 2
    assert result.output == ("error: --seq-len 100 must be a multiple of --chunk-size 64 "
                             "for the baseline\n")


@pytest.mark.smoke
def test_gpu_refuses_cleanly_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("gpu")
    assert result.exit_code == 2
    assert (result.output.startswith("error: ") and "CUDA" in result.output
            and result.output.count("\n") == 1)
    result = invoke("kernels", "--device", "cuda")
    assert (result.exit_code == 2 and "--device cuda" in result.output
            and result.output.count("\n") == 1)


def test_existing_tables_still_run_on_tiny_settings(tmp_path):
    runs = [
        ["kernels", "--batch-size", 1, "--seq-len", 32, "--heads", 2, "--headdim", 16,
         "--d-state", 16, "--chunk-size", 16, "--reps", 1, "--no-recurrent", "--device", "cpu",
         "--dtype", "fp32"],
        ["data", "--tokens", 100_000, "--seq-len", 64, "--batch-size", 4, "--reps", 1,
         "--per-call", 1, "--no-prepare", "--workdir", tmp_path / "data"],
        ["ckpt", "--params", 4e6, "--reps", 1, "--workdir", tmp_path],
        ["train", "--model", "tiny", "--steps", 1, "--warmup", 0, "--device", "cpu"],
    ]
    threads = torch.get_num_threads()
    for args in runs:
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output)
        assert "machine: " in result.output
    assert torch.get_num_threads() == threads  # bench.py data gives the cores back


def test_region_bytes_counts_the_region_tensors():
    # the analytic count against the sizes of the real tensors: the in_proj output (read forward
    # and again backward, its gradient written), the gated output (written, its gradient read),
    # the parameters between
    cfg = dataclasses.replace(PRESETS["small"], ngroups=2, rope_fraction=0.75)
    mixer = Mamba3Mixer(cfg)
    B, L = 3, 10
    a = mixer.in_proj(torch.zeros(B, L, cfg.d_model)).to(torch.bfloat16)
    gated = torch.zeros(B, L, cfg.d_inner, dtype=torch.bfloat16)
    params = sum(p.numel() * p.element_size() for name, p in mixer.named_parameters()
                 if "proj" not in name)
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    assert bench.region_bytes(cfg, B, L) == {"forward": size(a) + size(gated) + params,
                                             "backward": 2 * size(a) + size(gated) + 2 * params}
    assert (bench.region_bytes(cfg, B, L, act_bytes=4)["forward"]
            == 2 * (size(a) + size(gated)) + params)


@pytest.mark.interpreter
# CPU autocast on rms_norm
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("dtype,resets", [("bf16", False), ("bf16", True), ("fp32", False)])
def test_the_gpu_layer_check_passes_through_the_interpreter(dtype, resets):
    # bench.py gpu's comparison, on CPU tensors: the Triton path (interpreted) and, in bf16,
    # the torch path in bf16 autocast against the fp32 torch path, every tensor within the
    # command's tolerances
    cfg = dataclasses.replace(PRESETS["440m"], d_model=32)  # the 440m layer with 1 head
    torch.manual_seed(0)
    mixer = Mamba3Mixer(cfg)
    u, dy = torch.randn(1, 80, cfg.d_model), torch.randn(1, 80, cfg.d_model)
    reset = torch.zeros(1, 80, dtype=torch.bool)
    reset[0, [10, 63, 64]] = resets
    rows = bench.check_layer(mixer, u, dy, dtype, reset if resets else None)
    assert [r[0] for r in rows] == ["y", "u"] + [name for name, _ in mixer.named_parameters()]
    for name, shape, torch_err, triton_err, between, tol, passed in rows:
        assert passed and 0 < triton_err <= tol, (name, triton_err, between, tol)
        assert (torch_err is None and between is None) == (dtype == "fp32")


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_the_gpu_layer_timing_takes_another_layer_as_a_contender():
    # tools/gpu_evidence.py official times the official layer beside ours: here a second layer of
    # ours stands in
    cfg = dataclasses.replace(PRESETS["440m"], d_model=64)
    mixer, other = Mamba3Mixer(cfg), Mamba3Mixer(cfg)
    u, dy = torch.randn(1, 64, cfg.d_model), torch.randn(1, 64, cfg.d_model)
    paths = {"torch", "triton", "official"}
    figures = bench.layer_times(mixer, u, dy, reps=1, official=other)
    assert paths <= set(figures) and figures["projections_ms"] > 0
    assert all(figures[path]["layer_ms"] > 0 for path in paths)
    assert other.in_proj.weight.grad is not None  # its forward and backward ran
    assert set(bench.layer_times(mixer, u, dy, reps=1)) == {"torch", "triton", "projections_ms",
                                                             "region_bytes", "hbm_bytes_per_s"}


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_the_prefill_timing_runs_both_paths_through_the_interpreter():
    # bench.py gpu's prefill table on CPU tensors: a one-layer model of two heads (the interpreter
    # runs a program per head), both paths timed, their last logits close (bf16 autocast)
    cfg = dataclasses.replace(PRESETS["tiny"], n_layer=1, d_model=16)
    torch.manual_seed(0)
    lm = Mamba3LM(cfg).eval()
    figures = bench.prefill_times(lm, [(1, 24)], reps=1)
    row = figures["B1 L24"]
    assert row["torch_tok_per_s"] > 0 and row["triton_tok_per_s"] > 0
    assert row["logits_apart"] <= 3e-2


CHILD = """
import json, sys, time
print("noise", flush=True)
print("BENCH " + json.dumps({"ready": 1.5}), flush=True)
sys.stdin.readline()
if sys.argv[1] == "hang":
    time.sleep(60)
print("BENCH " + json.dumps({"steps": 3}), flush=True)
"""


@pytest.mark.parametrize("how", ["ok", "hang", "crash"])
def test_the_training_run_is_heard_stopped_at_its_deadline_or_reported(how, tmp_path):
    # bench.py gpu's training process says "BENCH {json}" lines: ready, then (once told to go) its
    # figures; one that runs past the deadline is stopped, one that dies is reported with
    # its stderr
    import subprocess
    import sys
    import time

    code = CHILD if how != "crash" else "import sys; sys.exit('no GPU here')"
    child = subprocess.Popen([sys.executable, "-c", code, how], text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "w+"))
    child.log = open(tmp_path / "err")
    t0 = time.monotonic()
    first = bench.child_says(child, t0 + 30)
    if how == "crash":
        assert "exited with 1" in first["error"] and "no GPU here" in first["error"]
        return
    assert first == {"ready": 1.5}
    last = bench.child_says(child, time.monotonic() + 2, go=True)
    if how == "ok":
        assert last == {"steps": 3} and child.wait(10) == 0
    else:
        assert "ran past the time budget" in last["error"] and time.monotonic() - t0 < 20


def test_the_gpu_check_writes_every_figure_as_json(monkeypatch, tmp_path):
    # the command's flow with the GPU work stood in for: the checks in order, the training run
    # told to go after the layer timings, every figure in the JSON, a failed check named and exit 1
    rows = [("y", (8, 2048, 1024), 1e-3, 2e-3, 1e-3, 3e-2, True)]
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda p: None)
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None: torch.zeros(*shape))
    monkeypatch.setattr(bench, "machine", lambda: "a test")
    monkeypatch.setattr(bench, "Mamba3Mixer",
                        lambda cfg: types.SimpleNamespace(cuda=lambda: "mixer"))
    monkeypatch.setattr(bench, "gpu_resets", lambda B, L: "resets")
    monkeypatch.setattr(bench, "check_layer",
                        lambda mixer, u, dy, dtype, reset: calls.append((dtype, reset))
                        or (rows if reset is None else [rows[0][:-1] + (False,)]))
    monkeypatch.setattr(bench, "layer_times",
                        lambda *a, **kw: calls.append("times") or {"triton": {"layer_ms": 2.0}})
    monkeypatch.setattr(bench, "start_train_child",
                        lambda steps, accum: calls.append(("child", steps, accum)) or "child")
    monkeypatch.setattr(bench, "gpu_model", lambda: "model")
    monkeypatch.setattr(bench, "prefill_times",
                        lambda lm, shapes, reps: calls.append(("prefill", lm))
                        or {"B1 L8192": {"speedup": 3.0}})
    said = iter([{"ready": 60.0}, {"steps": 10, "tokens_per_step": 16384, "tok_per_s": 1e5,
                                   "ms_per_step": 160, "mfu": 0.3, "peak_memory_gb": 40.0}])
    monkeypatch.setattr(bench, "child_says",
                        lambda child, deadline, go=False: calls.append(("says", go)) or next(said))
    result = invoke("gpu", "--json", tmp_path / "gpu.json", "--total-batch-size", 32768)
    assert result.exit_code == 1, result.output
    assert calls == [("child", 10, 2), ("bf16", None), ("bf16", "resets"), ("fp32", None),
                     ("says", False), "times", ("says", True), ("prefill", "model")]
    figures = __import__("json").loads((tmp_path / "gpu.json").read_text())
    assert figures["failed"] == ["bf16 with resets"] and "FAILED: bf16 with resets" in result.output
    assert figures["checks"]["bf16"] == [{"tensor": "y", "shape": [8, 2048, 1024],
                                          "torch_vs_fp32": 1e-3, "triton_vs_fp32": 2e-3,
                                          "triton_vs_torch": 1e-3, "tolerance": 3e-2,
                                          "passed": True}]
    assert (figures["train"]["tok_per_s"] == 1e5
            and figures["layer_times"] == {"triton": {"layer_ms": 2.0}}
            and figures["prefill"] == {"B1 L8192": {"speedup": 3.0}})
    assert list(figures["elapsed_s"]) == ["check bf16", "check bf16 with resets", "check fp32",
                                          "training run compiled", "layer timings", "training run",
                                          "prefill"]


def test_the_gpu_check_refuses_a_batch_that_is_not_whole_micro_batches(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = invoke("gpu", "--total-batch-size", 20000)
    assert (result.exit_code == 2
            and result.output.startswith("error: --total-batch-size 20000 must be a multiple"))


def test_the_eval_table_runs_on_tiny_settings():
    # The harness against the plain forward, and python eval.py on the offline stand-in task.
    result = invoke("eval", "--model", "tiny", "--docs", 2, "--throughput-docs", 1, "--reps", 1)
    assert result.exit_code == 0, result.output
    assert "vs forward" in result.output and "harness" in result.output
    assert "bench_hellaswag_shaped" in result.output and "acc_norm" in result.output
    assert "stand-in for hellaswag" in result.output and "machine: " in result.output


def test_the_stand_in_task_has_hellaswags_shape():
    docs = bench.choice_docs(200)
    assert len(docs) == 200
    for doc in docs:
        assert len(doc["choices"]) == 4 and doc["label"] in range(4)
        lengths = [len(c.split()) for c in doc["choices"]]
        assert max(lengths) <= 2 * min(lengths)
        assert len(doc["query"].split()) > max(lengths)
