"""tools/gpu_evidence.py: the GPU path's evidence that needs no GPU. Its commands refuse bad input
the way the other CLIs do, the launch recorder describes launches as the JIT specializes them, the
byte counter sees the kernels and the eager ops, the official layer runs through the interpreter
with every patch undone after, its timing beside ours runs with the GPU work stood in, and (slow)
every kernel the layer launches compiles for sm_90."""
import os
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("triton")  # the tools are Triton's, on a machine where it imports
TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import gpu_evidence as G  # noqa: E402

runner = CliRunner()


def invoke(*args):
    return runner.invoke(G.app, [str(a) for a in args])


@pytest.mark.smoke
@pytest.mark.parametrize("args", [
    ["compile", "--arch", "sm_70"], ["compile", "--dtype", "bfloat16"],
    ["compile", "--configs", "all"], ["traffic", "--dtype", "float32"],
])
def test_bad_choices_exit_2(args):
    assert invoke(*args).exit_code == 2


@pytest.mark.smoke
@pytest.mark.parametrize("args", [["compile", "--heads", 0], ["traffic", "--chunk-size", 8]])
def test_out_of_range_values_exit_2(args):
    result = invoke(*args)
    assert (result.exit_code == 2 and "Invalid value" in result.output
            and "Traceback" not in result.output)


@pytest.mark.interpreter
def test_recording_describes_launches_as_the_jit_specializes_them():
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr, DT: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, (tl.load(x_ptr + i, mask=i < n) * factor).to(DT), mask=i < n)

    base = torch.arange(40, dtype=torch.float32)
    x, y = base[:17], torch.zeros(33, dtype=torch.bfloat16)[1:]  # y starts 2 bytes into its buffer
    with G.recording_launches() as launches:
        for _ in range(2):  # the same launch twice is one launch
            scale[(2,)](x, y, 17, 2.0, BLOCK=16, DT=tl.bfloat16, num_warps=2)
    assert torch.equal(y[:17], (x * 2).to(torch.bfloat16))  # it still ran
    assert launches == [{"module": __name__,
                         "name": "test_recording_describes_launches_as_the_jit_specializes_them"
                                 ".<locals>.scale",
                         "args": [{"tensor": "float32", "aligned": True},
                                  {"tensor": "bfloat16", "aligned": False}, 17, 2.0],
                         "kwargs": {"BLOCK": 16, "DT": {"tl": "bf16"}, "num_warps": 2}}]


def test_compile_configs_are_kernels_pys_and_the_candidates_once_each():
    import kernels as K

    tiles = K._mixer_tiles(64, 64, 128, torch.bfloat16)
    default, *tuned = K.launch_configs("_mixer_bwd", 8, tiles)
    assert G.launch_configs("_mixer_bwd", 8, tiles, "default") == [("default", default)]
    assert (G.launch_configs("_mixer_bwd", 8, tiles, "tuned")
            == [("default", default)] + [("tuned", o) for o in tuned])
    # the sm_8x backward's default has maxnreg 255 already: that candidate is the default itself
    candidates = G.launch_configs("_mixer_bwd", 8, tiles, "candidates")
    assert default["maxnreg"] == 255 and len({str(o) for _, o in candidates}) == len(candidates)
    assert [o for name, o in candidates if name == "candidate"] == [
        default | extra for extra in G.CANDIDATES["_mixer_bwd"]
        if default | extra not in [default, *tuned]]
    assert G.launch_configs("mamba3_siso_fwd_kernel", 9, tiles, "candidates") == []  # not ours


def test_a_config_fits_by_its_spills_and_shared_memory_and_the_table_checks_kernels_py(monkeypatch):
    monkeypatch.setattr(G.K, "TUNE", {("_mixer_bwd", 9): [{"num_stages": 2}],
                                      ("_mixer_bwd", 8): [{"num_stages": 2}]})
    row = lambda tune, options, spills, shared, arch=90, launch=0: dict(  # noqa: E731
        kernel="_mixer_bwd", triton="3.9.0", launch=launch, arch=arch, tune=tune, options=options,
        spill_stores=spills, shared=shared * 1024)
    default = {"num_warps": 8, "num_stages": 1}
    rows = [row("default", default, 2812, 72),
            row("candidate", default | {"num_stages": 2}, 2592, 82),
            row("candidate", default | {"maxnreg": 255}, 3600, 72),  # 28% more spills
            row("default", default, 100, 80, arch=89, launch=1),
            # sm_89: 99 KiB
            row("candidate", default | {"num_stages": 2}, 100, 100, arch=89, launch=1)]
    assert (G.fits(rows[1], rows[0]) and not G.fits(rows[2], rows[0])
            and not G.fits(rows[4], rows[3]))
    table = {(r[0], r[1], r[2]): r[3:] for r in G.tune_table(rows)}
    assert table["_mixer_bwd", "9.x", '{"num_stages": 2}'] == [
        1, "2592 (2812)", "82 (72)", "yes", "yes"]
    assert table["_mixer_bwd", "9.x", '{"maxnreg": 255}'] == [
        1, "3600 (2812)", "72 (72)", "no", "no"]
    assert table["_mixer_bwd", "8.x", '{"num_stages": 2}'][-2:] == [
        "no", "[red]yes[/red]"]  # disagree


@pytest.mark.slow
def test_every_kernel_the_layer_launches_compiles_for_sm90():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile with")
    # 16 heads: the same binaries as the 440m layer's 32 (the token stride's divisibility by 16 is
    # what the JIT specializes on), in half the interpreter's time
    launches = G.capture_launches(batch_size=1, seq_len=128, heads=16)
    assert launches and all(isinstance(launch["name"], str) for launch in launches)
    assert any(a == {"tensor": "bfloat16", "aligned": True}
               for launch in launches for a in launch["args"])
    # one launch again with its first tensor 8 bytes off: Triton specializes on alignment, so the
    # stand-in that carries it must give another binary
    first = next(i for i, a in enumerate(launches[0]["args"])
                 if isinstance(a, dict) and "tensor" in a)
    shifted = dict(launches[0], args=list(launches[0]["args"]))
    shifted["args"][first] = dict(shifted["args"][first], aligned=False)
    # the backward (ptxas' longest) in a process beside the rest's: one core each
    launches.append(shifted)
    parts = [[x for x in launches if (x["name"] == "_mixer_bwd") == bwd] for bwd in (True, False)]
    with ThreadPoolExecutor(2) as pool:
        rows = sum(pool.map(lambda part: G.run_isolated(
            "compile_launches", False, timeout=300, launches=part, archs=[90]), parts), [])
    assert not [r for r in rows if "error" in r], [r["error"] for r in rows if "error" in r]
    assert len(rows) == len(launches) and len({r["hash"] for r in rows}) == len(rows)
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["arch"] == 90
    # every kernel with a tl.dot gets wgmma on sm_90
    assert all(r["wgmma"] for r in rows if r["dot"]), \
        [r["kernel"] for r in rows if r["dot"] and not r["wgmma"]]
    # The fused forward fits the register file at the 440m shape (aligned or not); the backward
    # still spills (its tiles at P 64, N 128, C 64 do not fit); the figures are in BENCHMARKS.md.
    # No more spilling than today:
    limit = {"_mixer_fwd": 0, "_mixer_bwd": 2812, "_sum_heads": 0}
    for r in rows:
        assert r["spill_stores"] <= limit.get(r["kernel"], 0), (r["kernel"], r["spill_stores"])


def test_traffic_counts_the_fused_path_against_the_compulsory_minimum():
    # a small layer through the interpreter: the counter must see the kernels' loads and stores and
    # the eager ops, so that the fused path lies above the minimum and far below the eager glue
    result = invoke("traffic", "--seq-len", 40, "--heads", 2, "--headdim", 16, "--d-state", 16,
                    "--chunk-size", 16, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    ratios = {row.split("│")[1].strip(): float(row.split("│")[5].strip().rstrip("x"))
              for row in result.output.splitlines()
              if row.count("│") >= 7 and row.split("│")[5].strip().endswith("x")}
    assert ratios["compulsory minimum"] == 1.0
    fused = next(v for k, v in ratios.items() if k.startswith("fused"))
    eager = next(v for k, v in ratios.items() if k.startswith("eager"))
    assert 1.0 < fused < eager, ratios


@pytest.mark.parametrize("command", ["traffic", "compile"])
def test_an_official_directory_that_is_not_a_mamba_checkout_is_refused(command, tmp_path):
    result = invoke(command, "--official", tmp_path)
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert (result.output.startswith("error: --official")
            and "not a checkout of state-spaces/mamba" in result.output)


def test_the_official_timing_refuses_a_directory_that_is_not_a_mamba_checkout(tmp_path):
    result = invoke("official", tmp_path)
    assert result.exit_code == 2 and result.output == (
        f"error: {tmp_path} is not a checkout of state-spaces/mamba "
        "with Mamba-3 (it has no mamba_ssm/ops/triton/mamba3)\n")


def test_the_official_timing_refuses_cleanly_without_cuda_or_with_the_interpreter(
        monkeypatch, tmp_path):
    import triton
    (tmp_path / "mamba_ssm" / "ops" / "triton" / "mamba3").mkdir(parents=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = invoke("official", tmp_path)
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert result.output.startswith("error: ") and "CUDA" in result.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # its timing is of compiled kernels
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    result = invoke("official", tmp_path)
    assert (result.exit_code == 2 and result.output.count("\n") == 1
            and "TRITON_INTERPRET" in result.output)


@pytest.mark.parametrize("runs", [True, False])
def test_the_official_timing_times_theirs_beside_ours_and_exits_1_when_theirs_does_not_run(
        runs, monkeypatch, tmp_path):
    # the command's flow with the GPU work stood in for: bench.py gpu's layer, the official one
    # built on its widths, both timed together, every figure in the JSON
    import json
    import triton
    (tmp_path / "mamba_ssm" / "ops" / "triton" / "mamba3").mkdir(parents=True)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(G, "machine", lambda: "a test")
    mixer = types.SimpleNamespace(cfg="440m")
    monkeypatch.setattr(G, "gpu_layer",
                        lambda B, L: calls.append(("layer", B, L)) or (mixer, "u", "dy", "B2 L64"))
    monkeypatch.setattr(G, "official_on_gpu",
                        lambda src, cfg, u, dy: calls.append(("theirs", src, cfg))
                        or ("theirs" if runs else None))
    times = {"triton": {"layer_ms": 3.0}} | ({"official": {"layer_ms": 2.0}} if runs else {})
    monkeypatch.setattr(G, "layer_times", lambda *a: calls.append(a) or times)
    result = invoke("official", tmp_path, "--batch-size", 2, "--seq-len", 64, "--reps", 3,
                    "--json", tmp_path / "o.json")
    assert result.exit_code == (0 if runs else 1), result.output
    assert calls == [("layer", 2, 64), ("theirs", tmp_path, "440m"),
                     (mixer, "u", "dy", 3, "theirs" if runs else None, "B2 L64")]
    figures = json.loads((tmp_path / "o.json").read_text())
    assert (figures["layer_times"] == times and figures["shape"] == "B2 L64"
            and figures["official"] == str(tmp_path))
    assert ("takes 1.50x the official's time" in result.output) == runs


OFFICIAL_KERNEL = '''
import torch
import triton
import triton.language as tl


@triton.jit
def tanh_approx(x):  # PTX, as the official kernels have it: the interpreter cannot run this
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tanh_approx(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def tanh(x):
    assert x.is_cuda, "All tensors must be on CUDA"
    assert torch.cuda.get_device_capability(x.device)[0] >= 8
    y = torch.empty_like(x)
    with torch.cuda.device(x.device.index):
        _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y
'''

OFFICIAL_LAYER = '''
import torch
from mamba_ssm.ops.triton.mamba3.kernel import tanh


class Mamba3(torch.nn.Module):
    def forward(self, u):
        return tanh(u)
'''

OFFICIAL_CHECK = """
import sys, torch, gpu_evidence
from pathlib import Path
capability, x = torch.cuda.get_device_capability, torch.linspace(-3, 3, 20)
with gpu_evidence.official_mamba3(Path(sys.argv[1])) as Mamba3:
    torch.testing.assert_close(Mamba3()(x), torch.tanh(x))
assert not x.is_cuda and torch.cuda.get_device_capability is capability
assert not any(name == "mamba_ssm" or name.startswith("mamba_ssm.") for name in sys.modules)
print("ok")
"""


def test_the_official_layer_runs_through_the_interpreter_and_the_patches_are_undone(tmp_path):
    # a stand-in checkout with what the real one needs patched: an __init__ that must not run, a PTX
    # tanh, CUDA asserts and device queries; inside official_mamba3 its layer runs on CPU tensors,
    # and after it nothing stays. In a process of its own: the dropped modules' kernels outlive it,
    # and Triton's bindings would say so at exit
    package = tmp_path / "mamba_ssm"
    (package / "ops" / "triton" / "mamba3").mkdir(parents=True)
    (package / "modules").mkdir()
    (package / "__init__.py").write_text("raise ImportError('the package __init__ must not run')\n")
    (package / "ops" / "triton" / "mamba3" / "kernel.py").write_text(OFFICIAL_KERNEL)
    (package / "modules" / "mamba3.py").write_text(OFFICIAL_LAYER)
    done = subprocess.run([sys.executable, "-c", OFFICIAL_CHECK, str(tmp_path)], cwd=TOOLS,
                          capture_output=True, text=True,
                          env=dict(os.environ, TRITON_INTERPRET="1"), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
