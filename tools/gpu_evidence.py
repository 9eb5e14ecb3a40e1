"""What mamba3-lite's GPU path does: shown without a GPU, timed beside the official layer on one.

    python tools/gpu_evidence.py compile   # each Triton kernel of a layer, compiled for sm_80, sm_90
    python tools/gpu_evidence.py compile --arch sm_80 --arch sm_89 --arch sm_90 --dtype bf16 \
        --dtype fp32 --resets --triton-path /tmp/triton36   # every config, under two Tritons
    python tools/gpu_evidence.py compile --configs candidates  # the launch configs kernels.py tunes
    python tools/gpu_evidence.py traffic   # the bytes the fused mixer region moves, vs the minimum
    python tools/gpu_evidence.py memory    # training state per GPU, DDP and --fsdp; a step's peak
    python tools/gpu_evidence.py official DIR --json official.json  # on a GPU: theirs beside ours

With --official DIR (a checkout of state-spaces/mamba), compile and traffic show the official
Mamba-3 kernels beside ours; official DIR times that layer beside ours on a CUDA GPU, the one
command here that needs one (bench.py gpu's layer and timing). compile and traffic run a layer
through Triton's interpreter on CPU tensors and reach into Triton's and torch's internals (the
interpreter's loads and stores, the JIT's specializer, the active driver, the dispatcher): that is
why they live here, apart from the benchmarks, and why a Triton upgrade may break them while it
leaves the model alone. memory predicts a GPU rank's training state from the shapes and measures a
step's peak on 2 CPU ranks.
"""
import collections
import contextlib
import dataclasses
import enum
import importlib
import io
import json
import multiprocessing
import os
import re
import resource
import socket
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path
from typing import List, Optional
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's modules, for the CLI
if __name__ == "__main__" and sys.argv[1:2] != ["official"]:
    # traffic counts through Triton's interpreter, which is chosen when triton is first imported;
    # compile runs its two steps in processes of their own, one interpreted and one not (official
    # runs the compiled kernels on a GPU)
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import typer  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import kernels as K  # noqa: E402
import train  # noqa: E402
from bench import TORCH_DTYPE, DType, console, forward_backward, gpu_layer  # noqa: E402
from bench import layer_times, machine, print_table, say  # noqa: E402
from data import cli_errors  # noqa: E402
from model import PRESETS, Mamba3LM, Mamba3Mixer, ModelConfig  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  pretty_exceptions_enable=False, help=__doc__.split("\n")[0])
Official = typer.Option(None, exists=True, file_okay=False,
                        help="A checkout of state-spaces/mamba: its Mamba-3 SISO layer's kernels too.")


def check_official(official: Optional[Path], named: str = "--official "):
    if official and not (official / "mamba_ssm" / "ops" / "triton" / "mamba3").is_dir():
        raise ValueError(f"{named}{official} is not a checkout of state-spaces/mamba with Mamba-3 "
                         "(it has no mamba_ssm/ops/triton/mamba3)")


def official_package(src):
    """state-spaces/mamba's package at src, its submodules importable without its __init__'s."""
    package = types.ModuleType("mamba_ssm")
    package.__path__ = [str(Path(src) / "mamba_ssm")]
    return package


def official_layer(Mamba3, cfg, **kwargs):
    # cfg's widths (the official defaults, expand 2 and half the state dims turned, are ours)
    return Mamba3(d_model=cfg.d_model, d_state=cfg.d_state, headdim=cfg.headdim,
                  ngroups=cfg.ngroups, chunk_size=cfg.chunk_size, **kwargs)


def layer_config(heads: int, ngroups: int = 1, mimo_rank: int = 1):
    """The 440m preset's mixer with `heads` heads and `ngroups` groups (d_model follows; P, N, C and
    the angles unchanged). The in_proj row, every kernel's token stride, is a multiple of 16
    elements exactly when heads is, as at 440m's 32: the JIT specializes on that, so 16 heads
    compile the same, and 24 (the 180m preset's) without that specialization. With mimo_rank R,
    a chunk keeps its 64 rows: 64 / R tokens."""
    cfg = PRESETS["440m"]
    return dataclasses.replace(cfg, d_model=heads * cfg.headdim // cfg.expand, ngroups=ngroups,
                               mimo_rank=mimo_rank)


@contextlib.contextmanager
def official_mamba3(src: Path):
    """state-spaces/mamba's Mamba3 layer class from a checkout at src, made to run on CPU tensors
    through Triton's interpreter, so that its bytes count and its launches record as ours do. Its
    package is imported without its __init__ (which imports transformers); what it asks of a CUDA
    device is answered for an H100 (compute capability 9.0, 132 SMs, by which its RMS norm's
    backward splits its rows); its cos, sin and tanh approximations (PTX inline assembly, which the
    interpreter cannot run) become plain functions, the same bytes; autotuning runs the first config
    (the configs differ in warps, stages, register caps and, in two elementwise kernels, tile
    length: the same bytes); its checks that tensors are on CUDA pass. All is undone on exit."""
    from triton.runtime.autotuner import Autotuner

    def tanh(x):  # e^-2|x| lies in (0, 1]: no overflow
        e = tl.exp(-2.0 * tl.abs(x))
        return tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)

    def scratch(size, alignment, stream):  # the memory a TMA descriptor asks for
        return torch.empty(size, dtype=torch.int8)

    # (plain functions: the interpreter runs a kernel as Python, triton.language's functions on numpy)
    standins = {"cos_approx": lambda x: tl.cos(x), "sin_approx": lambda x: tl.sin(x),
                "tanh_approx": tanh, "sech2_approx": lambda x: 1.0 - tanh(x) * tanh(x),
                "_alloc_fn": scratch, "_triton_alloc_fn": scratch}
    device, prune = torch.cuda.device, Autotuner.prune_configs
    h100 = types.SimpleNamespace(multi_processor_count=132)
    patches = [(torch.cuda, "device", lambda i: contextlib.nullcontext() if i is None else device(i)),
               (torch.cuda, "get_device_capability", lambda *args: (9, 0)),
               (torch.cuda, "get_device_properties", lambda *args: h100),
               (torch.Tensor, "is_cuda", property(lambda self: True)),
               (Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, {"mamba_ssm": official_package(src)}))
        for target, name, value in patches:
            stack.enter_context(mock.patch.object(target, name, value))
        try:
            from mamba_ssm.modules.mamba3 import Mamba3
        except ImportError as e:
            raise ImportError(f"--official: the Mamba-3 layer in {src} does not import here ({e}); "
                              "install what it needs") from e
        ops = [m for n, m in sys.modules.items() if n.startswith("mamba_ssm.ops.triton.mamba3.")]
        for module in ops:
            for name in standins.keys() & vars(module).keys():
                stack.enter_context(mock.patch.object(module, name, standins[name]))
        yield Mamba3


# -----------------------------------------------------------------------------
# traffic: the bytes the region moves, counted without a GPU


class Traffic:
    """Bytes moved and calls made, by who ("triton KERNEL", "eager OP"), and the outputs of our
    custom ops (mamba3::NAME) by name."""

    def __init__(self):
        self.bytes, self.calls = collections.Counter(), collections.Counter()
        self.outputs, self.kernel = {}, None

    def total(self):
        return sum(self.bytes.values())

    def count(self, who):
        return sum(n for k, n in self.calls.items() if k.startswith(who))


@contextlib.contextmanager
def kernel_bytes(traffic: Traffic):
    """Inside, every kernel Triton's interpreter runs adds the bytes of the elements its loads and
    stores touch to traffic: masked-off lanes are not counted (the interpreter runs a descriptor's
    block load or store as a masked one of its in-bounds elements)."""
    import triton.runtime.interpreter as I

    load, store = I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store
    run = I.InterpretedFunction.run

    def add(ptrs, mask):
        if traffic.kernel is not None:
            n = int(np.broadcast_to(mask.data, ptrs.data.shape).sum())
            traffic.bytes["triton " + traffic.kernel] += n * ptrs.get_element_ty().primitive_bitwidth // 8

    def counted_load(self, ptrs, mask, *args, **kwargs):
        add(ptrs, mask)
        return load(self, ptrs, mask, *args, **kwargs)

    def counted_store(self, ptrs, value, mask, *args, **kwargs):
        add(ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    def counted_run(self, *args, **kwargs):
        traffic.kernel = self.fn.__name__
        traffic.calls["triton " + traffic.kernel] += 1
        try:
            with _disable_current_modes():  # the interpreter's copies to and from the host move nothing
                return run(self, *args, **kwargs)
        finally:
            traffic.kernel = None

    with mock.patch.object(I.InterpreterBuilder, "create_masked_load", counted_load), \
            mock.patch.object(I.InterpreterBuilder, "create_masked_store", counted_store), \
            mock.patch.object(I.InterpretedFunction, "run", counted_run):
        yield


def tensors(tree):
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def nbytes(t):  # a broadcast (stride 0) dimension is one element in memory
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n


def aliases(out, inputs):  # whether a view (or an op that may alias its input, .to) did
    storages = {t.untyped_storage().data_ptr() for t in tensors(inputs)}
    return all(t.untyped_storage().data_ptr() in storages for t in tensors(out))


class EagerBytes(TorchDispatchMode):
    """Adds every eager aten op's bytes to traffic: those of its tensor inputs and outputs. A view
    moves nothing, nor does a .to that returns its input; an allocation writes nothing; copy_, fill_
    and zero_ only write their destination. Our custom ops run their implementation inside the mode
    (redispatched below autograd), so that the eager ops around their launches count too."""

    WRITES_ONLY = {"copy_", "fill_", "zero_"}
    MOVES_NOTHING = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                     "detach", "lift_fresh"}

    def __init__(self, traffic: Traffic):
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == "mamba3":
            with EagerBytes(self.traffic):
                cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                out = self.traffic.outputs[name] = func.redispatch(cpu, *args, **kwargs)
            return out
        out = func(*args, **kwargs)
        if (func.namespace != "aten" or name in self.MOVES_NOTHING
                or (func.is_view and aliases(out, (args, kwargs)))):
            return out
        inputs = (args[1:], kwargs) if name in self.WRITES_ONLY else (args, kwargs)
        self.traffic.bytes["eager " + name] += sum(nbytes(t) for t in tensors(out) + tensors(inputs))
        self.traffic.calls["eager " + name] += 1
        return out


@contextlib.contextmanager
def counting():
    """`with counting() as traffic:` the bytes the Triton kernels and eager ops inside move."""
    traffic = Traffic()
    with kernel_bytes(traffic), EagerBytes(traffic):
        yield traffic


def count_region(region, inputs, dout):
    """(forward, backward) Traffic of out = region() and of the gradients of inputs, given dout."""
    with counting() as fwd:
        out = region()
    with counting() as bwd:
        torch.autograd.grad(out, inputs, dout)
    return fwd, bwd


def official_region(src: Path, cfg, zx, dout):
    """The official Mamba-3 SISO layer's name (with mamba_ssm's version) and its region's count_region
    on zx, from the checkout at src."""
    with official_mamba3(src) as Mamba3:
        theirs = official_layer(Mamba3, cfg)
        if theirs.num_rope_angles != cfg.n_angles:
            raise ValueError(f"the official layer turns {theirs.num_rope_angles} pairs at d_state "
                             f"{cfg.d_state}, ours {cfg.n_angles}: not the same computation")
        theirs.in_proj, theirs.out_proj = torch.nn.Identity(), torch.nn.Identity()
        counts = count_region(lambda: theirs(zx), [zx] + list(theirs.parameters()), dout)
    version = re.search(r'__version__ = "(.*)"', (src / "mamba_ssm" / "__init__.py").read_text())
    return f"official Mamba-3 SISO (mamba_ssm {version[1] if version else '?'})", counts


@app.command()
def traffic(
    batch_size: int = typer.Option(1, min=1, help="B"),
    seq_len: int = typer.Option(256, min=1, help="L"),
    heads: int = typer.Option(4, min=1, help="H"),
    headdim: int = typer.Option(64, min=1, help="P"),
    d_state: int = typer.Option(128, min=2, help="N"),
    ngroups: int = typer.Option(1, min=1, help="G"),
    chunk_size: int = typer.Option(64, min=16, help="C, in rows (C / R tokens)"),
    mimo_rank: int = typer.Option(1, "--mimo-rank", min=1, help="R (MIMO)"),
    dtype: DType = typer.Option("bf16", help="in_proj's output dtype."),
    official: Optional[Path] = Official,
):
    """Bytes one layer's mixer region (in_proj's output -> out_proj's input) moves, forward and
    backward, counted without a GPU.

    Triton's interpreter counts the kernels' loads and stores, a dispatch mode every eager op's
    inputs and outputs; in_proj and out_proj are left out. Next to the compulsory minimum: each
    input read once (the backward reads them again: they are what it saves), each output written
    once, what the fused path saves besides its inputs (the per-chunk states and phases) written and
    read once, the incoming gradient read once and each gradient written once. Contrast: the eager
    PyTorch path (kernels.mixer_torch, what the fused kernels replace), and with --official the official Mamba-3 SISO layer (its Triton
    kernels and eager glue) on the same input, counted the same way."""
    with cli_errors(ValueError, ImportError):
        check_official(official)
        if not triton.knobs.runtime.interpret:
            raise ValueError("traffic counts through Triton's interpreter: run it as python "
                             "tools/gpu_evidence.py traffic, or with TRITON_INTERPRET=1")
    cfg = ModelConfig(d_model=heads * headdim // 2, headdim=headdim, d_state=d_state,
                      ngroups=ngroups, chunk_size=chunk_size, n_layer=1, vocab_size=256,
                      mimo_rank=mimo_rank)
    torch.manual_seed(0)
    mixer = Mamba3Mixer(cfg)
    mixer.in_proj, mixer.out_proj = torch.nn.Identity(), torch.nn.Identity()  # the region alone
    names = ["dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias", "D"]
    params = [getattr(mixer, n) for n in names + ["mimo_x", "mimo_z", "mimo_o"] * (mimo_rank > 1)]
    B, L = batch_size, seq_len
    zx = (torch.randn(B, L, sum(mixer.split)) * 0.5).to(TORCH_DTYPE[dtype]).requires_grad_()
    dout = torch.randn(B, L, cfg.d_inner).to(zx.dtype)
    kw = dict(headdim=headdim, ngroups=ngroups, n_angles=cfg.n_angles, chunk_size=cfg.chunk_tokens,
              A_floor=cfg.A_floor, eps=cfg.norm_eps, mimo=tuple(params[6:]) or None)
    fused, glue = "fused (kernels.mixer_triton)", "eager PyTorch (kernels.mixer_torch)"
    counts = {fused: count_region(lambda: K.mixer_triton(zx, *params[:6], **kw), [zx] + params,
                                  dout),
              glue: count_region(lambda: K.mixer_torch(zx, *params[:6], **kw, impl="torch")[0],
                                 [zx] + params, dout)}
    if official:
        with cli_errors(ValueError, ImportError):
            name, theirs = official_region(official, cfg, zx, dout)
        counts[name] = theirs

    # the compulsory minimum, from the tensors themselves (the gradients are the inputs' size)
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    _, states, phase = counts[fused][0].outputs["mixer_fwd"]
    inputs, saved, out = size(zx, *params), size(states, phase), size(dout)
    minimum = (inputs + out + saved, inputs + saved + out + inputs)
    rows = [["compulsory minimum", f"{minimum[0] / 1e6:.3f}", f"{minimum[1] / 1e6:.3f}",
             f"{sum(minimum) / 1e6:.3f}", "1.00x", "", ""]]
    for name, (fwd, bwd) in counts.items():
        total = fwd.total() + bwd.total()
        rows.append([name, f"{fwd.total() / 1e6:.3f}", f"{bwd.total() / 1e6:.3f}", f"{total / 1e6:.3f}",
                     f"{total / sum(minimum):.2f}x", f"{fwd.count('triton')}/{bwd.count('triton')}",
                     f"{fwd.count('eager')}/{bwd.count('eager')}"])
    shape = (f"B{B} L{L} H{heads} P{headdim} N{d_state} G{ngroups} S{cfg.n_angles} C{chunk_size}"
             + (f" R{mimo_rank}" if mimo_rank > 1 else ""))
    print_table(f"mixer region traffic, MB ({shape} {dtype}; in_proj and out_proj excluded)",
                ["path", "fwd MB", "bwd MB", "total MB", "vs minimum", "launches fwd/bwd",
                 "eager ops fwd/bwd"], rows)
    fwd, bwd = counts[fused]
    who = sorted(fwd.bytes.keys() | bwd.bytes.keys(), key=lambda k: -(fwd.bytes[k] + bwd.bytes[k]))
    print_table("the fused path, by kernel or op (MB)", ["kernel / op", "fwd", "bwd"],
                [[k, f"{fwd.bytes[k] / 1e6:.3f}", f"{bwd.bytes[k] / 1e6:.3f}"] for k in who])
    ours = fwd.total() + bwd.total()
    for name in [name for name in counts if name.startswith("official")]:
        ratio = sum(t.total() for t in counts[name]) / ours
        console.print(f"the fused path moves {ratio:.2f}x fewer bytes than the {name}")
    console.print(f"saved for the backward besides the inputs: states {size(states) / 1e6:.3f} MB, "
                  f"phases {size(phase) / 1e6:.3f} MB. machine: {machine()}")


# -----------------------------------------------------------------------------
# compile: what a GPU's compiler makes of the kernels, without a GPU
#
# First, one mixer layer runs forward and backward on CPU tensors through Triton's interpreter, and
# every kernel launch is recorded the way the JIT sees it: the kernel, its arguments (tensors by
# dtype and 16-byte alignment, numbers by value: the JIT specializes on both) and the launch
# keywords (constexprs, num_warps, num_stages). Nothing here names a kernel: whatever the layer
# launches is what gets compiled. Then, in a process where Triton is not interpreted, each launch
# goes to its kernel's own JITFunction.warmup for a GPU target that is not here, so Triton
# specializes and compiles it (through ptxas to a cubin) exactly as that launch on that GPU would.

ARCHS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_100": 100, "sm_120": 120}
Arch = enum.Enum("Arch", {name: name for name in ARCHS}, type=str)
DTypes = enum.Enum("DTypes", {name: name for name in TORCH_DTYPE}, type=str)  # (repeatable: an Enum)
LAUNCH_OPTIONS = ("num_warps", "num_stages")  # launch keywords that are not constexprs


def describe(value, where: str):
    """A launch argument as the JIT's specializer sees it, in JSON terms."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    dtype = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
    if isinstance(value, torch.Tensor):
        return {"tensor": dtype(value), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, TensorDescriptor):  # a TMA descriptor: its base's dtype and its block
        return {"descriptor": dtype(value.base), "shape": list(value.shape),
                "strides": list(value.strides), "block_shape": list(value.block_shape)}
    if isinstance(value, tl.dtype):
        return {"tl": str(value)}
    if isinstance(value, tl.constexpr):
        value = value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which compile cannot describe to the "
                    "compiler")


@contextlib.contextmanager
def recording_launches():
    """Inside, every launch of every @triton.jit kernel Triton's interpreter runs is recorded (and
    still runs): yields the list of distinct launches, each the kernel's module and qualified name,
    its args and kwargs as describe() gives them. Needs a process whose Triton is interpreted
    (TRITON_INTERPRET=1 before triton is imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("recording Triton launches needs Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    launches, seen, launch = [], set(), InterpretedFunction.run

    def record(kernel, *args, grid, warmup, **kwargs):  # kernel[grid](...), autotuners: all end here
        name = kernel.fn.__qualname__
        described = {"module": kernel.fn.__module__, "name": name,
                     "args": [describe(a, f"{name} argument {i}") for i, a in enumerate(args)],
                     "kwargs": {k: describe(v, f"{name} argument {k}") for k, v in kwargs.items()}}
        key = json.dumps(described, sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(described)
        return launch(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    with mock.patch.object(InterpretedFunction, "run", record):
        yield launches


def capture_launches(batch_size=1, seq_len=128, heads=32, dtype="bf16", resets=False,
                     ngroups=1, mimo_rank=1) -> list:
    """Every distinct Triton kernel launch of one mixer layer (layer_config(heads, ngroups)),
    forward and backward, on the Triton path under autocast to dtype (none for fp32), as train.py
    runs it; with resets, documents start every 50 tokens (as train.py --reset-at-eos marks them).
    Each launch is labelled with its config ("bf16", "bf16+resets", ...)."""
    torch.manual_seed(0)
    cfg = layer_config(heads, ngroups, mimo_rank)
    mixer = Mamba3Mixer(cfg)
    u = torch.randn(batch_size, seq_len, cfg.d_model, requires_grad=True)
    reset = None
    if resets:
        reset = torch.zeros(batch_size, seq_len, dtype=torch.bool)
        reset[:, 5::50] = True
    with recording_launches() as launches, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast's notes on mixed-dtype rms_norm
        with torch.autocast("cpu", dtype=TORCH_DTYPE[dtype], enabled=dtype != "fp32"):
            y = mixer(u, reset=reset, impl="triton")
        y.backward(torch.randn_like(y))
    config = dtype + ("+resets" if resets else "") + (f" R={mimo_rank}" if mimo_rank > 1 else "")
    return [dict(launch, config=config) for launch in launches]


def capture_official_launches(src: str, batch_size=1, seq_len=128, heads=32, dtype="bf16") -> list:
    """capture_launches for the official Mamba-3 SISO layer at src (official_mamba3) with
    layer_config(heads)'s widths, its region alone. An autotuned kernel is launched once per config
    of its autotuner that has num_stages 1 (warps and register caps; on a GPU the autotuner picks by
    speed): compile_launches compiles each, and the table shows the one that spills least."""
    cfg = layer_config(heads)
    with official_mamba3(Path(src)) as Mamba3, recording_launches() as launches:
        torch.manual_seed(0)
        theirs = official_layer(Mamba3, cfg)
        zx = torch.randn(batch_size, seq_len, theirs.in_proj.out_features, dtype=TORCH_DTYPE[dtype],
                         requires_grad=True)
        theirs.in_proj, theirs.out_proj = torch.nn.Identity(), torch.nn.Identity()
        y = theirs(zx)
        torch.autograd.grad(y, [zx, *theirs.parameters()], torch.randn_like(y))
        tuners = [getattr(importlib.import_module(l["module"]), l["name"]) for l in launches]
    expanded = []
    for launch, tuner in zip(launches, tuners):
        for config in [c for c in getattr(tuner, "configs", []) if c.num_stages == 1] or [None]:
            kwargs = dict(launch["kwargs"])
            if config is not None:  # this config's warps, cap and tile in place of the first one's
                kwargs = {k: v for k, v in kwargs.items() if k not in (*LAUNCH_OPTIONS, "maxnreg")}
                kwargs.update({k: v for k, v in config.all_kwargs().items() if v is not None})
            expanded.append(dict(launch, kwargs=kwargs))
    return expanded


def stand_in(value):
    """A described argument back as something the JIT's specializer takes: a MockTensor at an
    address that is 16-byte aligned or not, a tl dtype, or the number itself."""
    from triton.runtime.jit import MockTensor
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, dict) and "tensor" in value:
        pointer = MockTensor(getattr(torch, value["tensor"]))
        pointer.data_ptr = (lambda: 0) if value["aligned"] else (lambda: 8)
        return pointer
    if isinstance(value, dict) and "descriptor" in value:
        base = MockTensor(getattr(torch, value["descriptor"]))
        base.data_ptr = lambda: 0
        return TensorDescriptor(base, value["shape"], value["strides"], value["block_shape"])
    return tl.dtype(value["tl"]) if isinstance(value, dict) else value


def jit_function(module: str, name: str):
    """The JITFunction behind a kernel's module and qualified name (through autotune, heuristics)."""
    from triton.runtime.jit import JITFunction

    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def compile_one(launch: dict, arch: int) -> tuple:
    """(binary's hash, figures) of one launch compiled for compute capability arch: registers and
    spill bytes as ptxas -v reported them while Triton built the cubin, shared memory from the
    kernel's metadata, whether its Triton IR has a tl.dot, its PTX's wgmma count, and the
    seconds the compile took."""
    args = [stand_in(a) for a in launch["args"]]
    kwargs = {k: stand_in(v) for k, v in launch["kwargs"].items()}
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as log:
        kernel = jit_function(launch["module"], launch["name"]).warmup(*args, grid=(1,), **kwargs)
    seconds = time.perf_counter() - t0
    registers = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    if not (registers and spills):
        raise RuntimeError(f"no ptxas -v report to read registers and spills from (got "
                           f"{log.getvalue()[:200]!r})")
    meta = kernel.metadata
    return kernel.hash, dict(registers=int(registers[1]), spill_stores=int(spills[1]),
                             spill_loads=int(spills[2]), shared=meta.shared, num_warps=meta.num_warps,
                             num_stages=meta.num_stages, dot="tt.dot" in kernel.asm["ttir"],
                             wgmma=kernel.asm["ptx"].count("wgmma.mma_async"),
                             seconds=round(seconds, 1))


# launch options that `compile --configs candidates` tries on top of each of our kernels' default,
# beside kernels.TUNE's: none changes a result bit (kernels.TUNE says why); fits() says which fit
CANDIDATES = {"_mixer_fwd": [{"num_stages": 2}], "_mixer_bwd": [{"num_stages": 2}, {"maxnreg": 255}],
              "_sum_heads": [{"num_warps": 2}, {"num_warps": 8}, {"num_stages": 1}]}
Configs = enum.Enum("Configs", {n: n for n in ("default", "tuned", "candidates")}, type=str)


def launch_configs(kernel: str, major: int, constexprs: dict, configs: str) -> list:
    """(name, launch options) of each config of one of our kernels on compute capability major to
    compile: kernels.py's default ("default"), the others its tuner times ("tuned") and, for
    "candidates", CANDIDATES's that it does not ("candidate"). [] for a kernel not ours."""
    if kernel not in CANDIDATES:
        return []
    default, *tuned = K.launch_configs(kernel, major, constexprs)
    out = [("default", default)] + ([("tuned", o) for o in tuned] if configs != "default" else [])
    if configs == "candidates":
        out += [("candidate", default | extra) for extra in CANDIDATES[kernel]]
    unique = {}
    for name, options in out:  # a candidate kernels.py already has is that one
        unique.setdefault(json.dumps(options, sort_keys=True), (name, options))
    return list(unique.values())


def compile_launches(launches: list, archs: list, official: Optional[str] = None,
                     configs: str = "default") -> list:
    """Each launch (capture_launches' output) compiled for each compute capability in archs (80 is
    sm_80), our kernels with the launch options kernels.py gives them on that GPU (its default, or
    each config `configs` names: launch_configs): a row per distinct binary (compile_one's figures,
    or the error), with this Triton's version. Needs a process whose Triton is not interpreted, and
    leaves Triton's active driver answering for the last target: run it in a process of its own
    (run_isolated). No GPU needed."""
    from triton.backends.compiler import GPUTarget

    if triton.knobs.runtime.interpret:
        raise RuntimeError("compile_launches needs Triton not interpreted: TRITON_INTERPRET=0")
    if official:  # the official kernels' modules, importable here
        sys.modules.setdefault("mamba_ssm", official_package(official))
    rows, seen = [], set()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope():
        triton.knobs.compilation.always_compile = True  # no cache: ptxas runs and logs each binary
        triton.knobs.nvidia.dump_ptxas_log = True
        for arch in archs:
            # what JITFunction.warmup asks of the driver, answered for this target (one kernel cache
            # per device: one per target here)
            target = GPUTarget("cuda", arch, 32)
            triton.runtime.driver.set_active(types.SimpleNamespace(
                get_current_target=lambda: target, get_current_device=lambda: target.arch,
                get_current_stream=lambda device: 0))
            for i, launch in enumerate(launches):
                constexprs = {k: v for k, v in launch["kwargs"].items()
                              if k not in (*LAUNCH_OPTIONS, "maxnreg")}
                ours = launch_configs(launch["name"], arch // 10, constexprs, configs)
                for tune, options in ours or [("", {})]:
                    run = dict(launch, kwargs=constexprs | options) if ours else launch
                    row = {"launch": i, "arch": arch, "kernel": launch["name"],
                           "constexprs": constexprs, "config": launch.get("config", ""),
                           "triton": triton.__version__, "tune": tune, "options": options,
                           "maxnreg": run["kwargs"].get("maxnreg")}
                    try:
                        binary, figures = compile_one(run, arch)
                        if (arch, binary) not in seen:  # the same specialization: the same binary
                            seen.add((arch, binary))
                            rows.append(dict(row, hash=binary, **figures))
                    except Exception as e:  # a kernel that does not compile: a finding, in its row
                        rows.append(dict(row, error=f"{type(e).__name__}: {e}".strip()))
    return rows


def run_isolated(function: str, interpret: bool, timeout: Optional[float] = None,
                 triton_path: Optional[str] = None, **kwargs):
    """gpu_evidence.<function>(**kwargs) in a fresh Python whose Triton is interpreted or not (the
    choice is made when triton is first imported, so it takes a process of its own), and is the one
    in the directory triton_path if given (first on that process's path only); arguments and result
    travel as JSON."""
    code = ("import contextlib, json, sys, gpu_evidence\n"
            "request = json.load(sys.stdin)\n"
            "with contextlib.redirect_stdout(sys.stderr):  # only the result goes to stdout\n"
            "    result = getattr(gpu_evidence, request['function'])(**request['kwargs'])\n"
            "json.dump(result, sys.stdout)\n")
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    if triton_path:
        env["PYTHONPATH"] = os.pathsep.join([str(triton_path)] + env.get("PYTHONPATH", "").split(
            os.pathsep)).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          input=json.dumps({"function": function, "kwargs": kwargs}),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"gpu_evidence.{function} failed in its subprocess:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def compile_table(rows: list) -> list:
    """compile_launches' rows as table rows, sorted by Triton version, config, launch order and
    architecture. Each row also gets a "label" for the summary: kernel, config and Triton. The
    config column adds the kernels' chunk C and the products' precision where not "ieee"."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    rows.sort(key=lambda r: (r["triton"], configs.index(r["config"]), r["launch"], r["arch"]))
    table = []
    for r in rows:
        r["label"] = f"{r['kernel']} ({r['config']}, triton {r['triton']})"
        c = r["constexprs"]
        config = " ".join([r["config"]] + ([f"C={c['C']}"] if "C" in c else [])
                          + ([c["PREC"]] if c.get("PREC", "ieee") != "ieee" else []))
        row = [r["triton"], config, r["kernel"], f"sm_{r['arch']}"]
        if "error" in r:
            table.append(row + ["[red]failed[/red]", r["error"].splitlines()[0], "", "", "", ""])
            continue
        spills = f"{r['spill_stores']} / {r['spill_loads']}"
        wgmma = ("-" if r["arch"] != 90 or not r["dot"] else
                 f"yes ({r['wgmma']})" if r["wgmma"] else "[red]no[/red]")
        maxnreg = r.get("maxnreg") or c.get("maxnreg")
        launch = f"{r['num_warps']} / {r['num_stages']}" + (f" / {maxnreg}" if maxnreg else "")
        launch += f" ({r['tune']})" if r.get("tune") not in (None, "", "default") else ""
        table.append(row + [launch, r["registers"],
                            spills if spills == "0 / 0" else f"[red]{spills}[/red]",
                            f"{r['shared'] / 1024:.1f}", wgmma, r["seconds"]])
    return table


def official_table(rows: list) -> list:
    """compile_launches' rows of the official kernels as table rows: per kernel and arch, the config
    that spills least, and how many configs were compiled."""
    best = {}
    for r in (r for r in rows if "error" not in r):
        key = r["kernel"], r["arch"]
        if key not in best or r["spill_stores"] < best[key]["spill_stores"]:
            best[key] = dict(r, configs=best.get(key, {}).get("configs", 0))
        best[key]["configs"] += 1
    return [[kernel, f"sm_{arch}", r["configs"], r["num_warps"], r["maxnreg"] or "-",
             r["registers"], f"{r['spill_stores']} / {r['spill_loads']}",
             f"yes ({r['wgmma']})" if r["wgmma"] else "-"]
            for (kernel, arch), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


# the shared memory a block may have (opt-in), KiB, by architecture: what a binary must fit
SHARED_KIB = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}


def fits(row: dict, default: dict) -> bool:
    """Whether a config's binary may join kernels.TUNE: shared memory within what a block may have
    on its arch (sm_89: 99 KiB) or the default's, and at most a quarter more spill bytes (+64)."""
    return (row["shared"] <= max(default["shared"], SHARED_KIB[row["arch"]] * 1024)
            and row["spill_stores"] <= 1.25 * default["spill_stores"] + 64)


def tune_table(rows: list) -> list:
    """compile_launches' rows of our kernels' other configs, per kernel, compute capability major
    and launch options beyond the default: the worst spill stores (furthest above a quarter more)
    and shared memory against the default's over every Triton, arch and config compiled, whether that fits everywhere, and
    whether kernels.TUNE has it (it should, exactly when it fits)."""
    ok = [r for r in rows if "error" not in r and r.get("tune")]
    default = {(r["triton"], r["launch"], r["arch"]): r for r in ok if r["tune"] == "default"}
    worst = {}
    for r in (r for r in ok if r["tune"] != "default"):
        d = default[r["triton"], r["launch"], r["arch"]]
        extra = {k: v for k, v in r["options"].items() if d["options"].get(k) != v}
        key = r["kernel"], r["arch"] // 10, json.dumps(extra, sort_keys=True)
        w = worst.setdefault(key, dict(binaries=0, fits=True, spills=(-1e9, 0, 0), shared=(0, 0)))
        w["binaries"] += 1
        w["fits"] &= fits(r, d)
        over = r["spill_stores"] - 1.25 * d["spill_stores"]  # the worst: furthest above the bar
        w["spills"] = max(w["spills"], (over, r["spill_stores"], d["spill_stores"]))
        w["shared"] = max(w["shared"], (r["shared"] // 1024, d["shared"] // 1024))
    table = []
    for (kernel, major, extra), w in sorted(worst.items()):
        kept = json.loads(extra) in K.TUNE.get((kernel, major), [])
        cell = "yes" if kept else "no"
        if kept and not w["fits"]:  # the evidence and kernels.py disagree
            cell = f"[red]{cell}[/red]"
        table.append([kernel, f"{major}.x", extra, w["binaries"],
                      "{} ({})".format(*w["spills"][1:]), "{} ({})".format(*w["shared"]),
                      "yes" if w["fits"] else "no", cell])
    return table


def summary(rows: list) -> list:
    """The lines under the compile table: whether the targets are met, and where not."""
    ok = [r for r in rows if "error" not in r]
    spilled = sorted((r for r in ok if r["spill_stores"] or r["spill_loads"]),
                     key=lambda r: -r["spill_stores"])
    worst = ", ".join(f"{r['label']} on sm_{r['arch']}: {r['spill_stores']} B" for r in spilled[:3])
    lines = ["target, no spills on any architecture: " + (
        f"NOT met in {len(spilled)} of {len(ok)} binaries (the most: {worst})" if spilled else "met")]
    over = [f"{r['label']} on sm_{r['arch']} ({r['shared'] / 1024:.0f} KiB)" for r in ok
            if r["shared"] > SHARED_KIB[r["arch"]] * 1024]
    lines.append("target, shared memory within what a block may have (99 KiB on sm_86/sm_89, 163 "
                 "on sm_80, 227 on sm_90): " + (f"NOT met ({', '.join(over)})" if over else "met"))
    dots = [r for r in ok if r["arch"] == 90 and r.get("dot")]
    missing = [r["label"] for r in dots if not r["wgmma"]]
    if dots:
        lines.append("target, wgmma on sm_90: " + (f"NOT met, no wgmma in {', '.join(missing)} "
                                                   f"({len(dots) - len(missing)} of {len(dots)} "
                                                   "kernels with a tl.dot use it)" if missing else "met"))
    return lines + ["registers and spill bytes: ptxas -v as Triton ran it for each cubin; shared "
                    "memory: the compiled kernel's metadata; wgmma: wgmma.mma_async instructions in "
                    "the PTX (SASS: HGMMA); compile s: this machine's seconds for the binary"]


@app.command("compile")
def compile_(
    arch: List[Arch] = typer.Option(["sm_80", "sm_90"], help="A GPU architecture to compile for; "
                                    "repeat for several."),
    batch_size: int = typer.Option(1, min=1, help="B of the layer run that captures the launches."),
    seq_len: int = typer.Option(128, min=1, help="L of that run (any multiple of 1024 gives "
                                "exactly the binaries of L 2048, at eight times the capture time)."),
    heads: int = typer.Option(32, min=1, help="H of that run (the 440m layer has 32, the 180m one "
                              "24; P, N and C are always 440m's)."),
    ngroups: int = typer.Option(1, min=1, help="G of that run (it must divide H)."),
    mimo_rank: int = typer.Option(1, "--mimo-rank", min=1, help="R of that run (MIMO; a chunk "
                                  "keeps 64 rows, 64 / R tokens)."),
    dtype: List[DTypes] = typer.Option(["bf16"], help="Autocast dtype of that run, as train.py "
                                      "--dtype (fp32: none); repeat for several."),
    resets: bool = typer.Option(False, "--resets", help="Each --dtype also with resets (documents "
                                "starting inside the chunks, as with train.py --reset-at-eos)."),
    triton_path: List[Path] = typer.Option([], exists=True, file_okay=False, help="A directory "
                                           "holding another Triton (pip install --target DIR "
                                           "triton==3.6.0): compile under it too, first on the "
                                           "path of the compiling process only; repeat for "
                                           "several."),
    configs: Configs = typer.Option("default", help="Our kernels' launch configs to compile: "
                                    "kernels.py's default, every one its tuner times (tuned), or "
                                    "those and the candidates it leaves out (candidates)."),
    json_path: Optional[Path] = typer.Option(None, "--json", dir_okay=False,
                                             help="Also write every row's figures there, as JSON."),
    official: Optional[Path] = Official,
):
    """Every Triton kernel a Mamba-3 layer launches, compiled for sm_80 / sm_90 on this machine: no
    GPU needed.

    One mixer layer with the 440m layer's widths (P 64, N 128, chunk 64) runs forward and backward
    through Triton's interpreter on CPU tensors, which records every kernel launch, once per
    config (--dtype, --resets); each is then compiled with Triton's own compiler for each --arch
    exactly as kernels.py launches it there (its launch options per architecture), under the
    installed Triton and each --triton-path. Reports registers, spill bytes, shared memory, on
    sm_90 whether the code uses wgmma, and the compile's seconds. Targets: **no spills on any
    architecture, shared memory within each architecture's limit, wgmma on sm_90**. With
    --official, the official layer's kernels at the same widths, each in every config its
    autotuner has with num_stages 1, the one that spills least shown."""
    with cli_errors(ValueError):
        if "nvidia" not in triton.backends.backends:
            raise ValueError(f"this Triton build ({triton.__version__}) has no NVIDIA backend to "
                             "compile with")
        check_official(official)
        if heads % ngroups:
            raise ValueError(f"--ngroups {ngroups} must divide --heads {heads}")
    archs = [ARCHS[a.value] for a in arch]
    run = dict(batch_size=batch_size, seq_len=seq_len, heads=heads)
    t0 = time.perf_counter()
    launches = [launch for d in dict.fromkeys(d.value for d in dtype) for r in ([False, True] if resets else [False])
                for launch in run_isolated("capture_launches", True, dtype=d, resets=r,
                                           ngroups=ngroups, mimo_rank=mimo_rank, **run)]
    # a launch that two configs share (the same arguments: _sum_heads with and without resets) is
    # one binary, compiled once under the first config's name
    unique = {}
    for launch in launches:
        unique.setdefault(json.dumps({k: v for k, v in launch.items() if k != "config"},
                                     sort_keys=True), launch)
    launches = list(unique.values())
    t1 = time.perf_counter()
    rows = []
    for path in [None] + [str(p) for p in triton_path]:
        rows += run_isolated("compile_launches", False, triton_path=path, launches=launches,
                             archs=archs, configs=configs.value)
    t2 = time.perf_counter()
    cfg = layer_config(heads, ngroups, mimo_rank)
    print_table(f"Triton kernels of one mixer layer (P{cfg.headdim} N{cfg.d_state} G{ngroups} "
                f"R{mimo_rank}, "
                f"chunk {cfg.chunk_size}; launches captured at B{batch_size} L{seq_len} H{heads}), "
                "compiled offline", ["triton", "config", "kernel", "arch", "warps / stages / maxnreg",
                                     "registers", "spill st / ld bytes", "shared KiB", "wgmma",
                                     "compile s"], compile_table(rows))
    console.print(f"{len(launches)} distinct launches captured in {t1 - t0:.0f} s, compiled in "
                  f"{t2 - t1:.0f} s")
    for line in summary(rows):
        console.print(line)
    if configs.value != "default":
        print_table("our kernels' other launch configs against their default, the worst over every "
                    "binary above", ["kernel", "GPU", "options", "binaries",
                                     "spill stores (default)", "shared KiB (default)", "fits",
                                     "in kernels.TUNE"],
                    tune_table(rows))
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1) + "\n")
    failed = [r for r in rows if "error" in r]
    if official:
        launches = run_isolated("capture_official_launches", True, src=str(official),
                                dtype=dtype[0].value, **run)
        theirs = run_isolated("compile_launches", False, launches=launches, archs=archs,
                              official=str(official))
        failed += [r for r in theirs if "error" in r]
        print_table("the official Mamba-3 SISO layer's kernels at the same widths: per kernel, the "
                    "config with the fewest spill bytes", ["kernel", "arch", "configs", "warps",
                                                           "maxnreg", "registers",
                                                           "spill st / ld bytes", "wgmma"],
                    official_table(theirs))
    versions = ", ".join(dict.fromkeys(r["triton"] for r in rows))
    console.print(f"machine: {machine()}, triton {versions}, no GPU used")
    if failed:
        raise typer.Exit(1)


# -----------------------------------------------------------------------------
# memory: what a GPU rank holds with DDP and with --fsdp, from the shapes, and measured on CPU ranks


def state_bytes(lm, world: int, fsdp: bool) -> int:
    """Weights, gradients and AdamW's 2 moments per rank, train.PARAM_BYTES a float32 weight;
    FSDP2 splits each tensor's rows into `world` equal chunks, the last one padded."""
    return train.PARAM_BYTES["adamw"] * sum(-(-p.shape[0] // world) * p[0].numel() if fsdp else p.numel()
                    for p in lm.parameters())


def peak_added(rank: int, port: int, args: list, peaks):
    """One rank as torchrun starts it, running train.py `args`: the memory it adds, into peaks."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    sys.stdout = open(os.devnull, "w")  # (rank 0's log; errors go to stderr)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with contextlib.suppress(SystemExit):
        train.app(args)
    peaks[rank] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024  # (kB)


@app.command()
def memory(batch_size: int = typer.Option(1, min=1, help="Sequences per rank, measured step.")):
    """Training state per rank with DDP and with --fsdp; a `small` step's peak on 2 CPU ranks.

    The state from the tensors' shapes, each preset at 1, 2 and 8 ranks; the peak is what
    `train.py --model small --dry-run` adds to each rank's memory, measured both ways."""
    rows = []
    for name in PRESETS:
        with torch.device("meta"):
            lm = Mamba3LM(PRESETS[name])
        group = max(sum(p.numel() for p in lm.blocks[0].parameters()), lm.embed.weight.numel())
        sizes = [state_bytes(lm, 1, False)] + [state_bytes(lm, w, True) for w in (1, 2, 8)]
        rows.append([name, f"{lm.num_params() / 1e6:,.0f}M"]
                    + [f"{b / 1e9:.2f}" for b in sizes + [8 * group]])
    print_table("parameters + gradients + AdamW moments per rank, GB, float32 (on top: "
                "activations; with FSDP, the weights and gradients of the block or root gathered)",
                ["preset", "params", "DDP, any world", "FSDP 1", "FSDP 2", "FSDP 8", "gathered"],
                rows)
    L, ctx, rows = train.RECIPES["small"]["seq_len"], multiprocessing.get_context("fork"), []
    args = ["--data", "synthetic", "--model", "small", "--batch-size", str(batch_size), "--dry-run",
            "--total-batch-size", str(2 * batch_size * L), "--device", "cpu", "--dtype", "fp32"]
    for fsdp in (False, True):
        with socket.socket() as s:  # a free port for the two to meet on
            s.bind(("127.0.0.1", 0))
            peaks, port = ctx.Array("d", 2), s.getsockname()[1]
        ranks = [ctx.Process(target=peak_added, args=(r, port, args + ["--fsdp"] * fsdp, peaks))
                 for r in (0, 1)]
        [p.start() for p in ranks], [p.join() for p in ranks]
        rows.append(["--fsdp" if fsdp else "DDP", f"{max(peaks) / 1e6:,.0f}"])
    print_table(f"train.py {' '.join(args)} on 2 ranks: MB", ["", "peak added, larger rank"], rows)
    console.print(f"machine: {machine()}")


# -----------------------------------------------------------------------------
# official: the official layer timed beside ours, on a GPU


def official_on_gpu(official: Path, cfg, u, dy):
    """The official layer of cfg's widths, run once on its kernels; None, said why, if it fails."""
    from triton.runtime.autotuner import Autotuner
    # from here on every Triton autotuner takes its first config (theirs: 234, not done in 10 min)
    prune = Autotuner.prune_configs
    Autotuner.prune_configs = lambda tuner, kwargs: prune(tuner, kwargs)[:1]
    sys.modules.setdefault("mamba_ssm", official_package(official))
    try:
        from mamba_ssm.modules.mamba3 import Mamba3
        theirs = official_layer(Mamba3, cfg, device="cuda")
        forward_backward(theirs, u, dy)
        return theirs
    except Exception as e:  # a contender that does not run is a finding: shown, then ours timed
        say(f"the official layer in {official} did not run here: {type(e).__name__}: {e}")


@app.command("official")
def official_times(
    checkout: Path = typer.Argument(..., exists=True, file_okay=False, metavar="DIR",
                                    help="A checkout of state-spaces/mamba with Mamba-3."),
    batch_size: int = typer.Option(8, min=1, help="B of the layer timed."),
    seq_len: int = typer.Option(2048, min=1, help="L of the layer timed."),
    reps: int = typer.Option(20, min=1, help="Interleaved repetitions of the layer timings."),
    json_path: Optional[Path] = typer.Option(None, "--json", dir_okay=False,
                                             help="Also write every figure there, as JSON."),
):
    """On a CUDA GPU: the official Mamba-3 SISO layer's forward + backward time beside ours.

    bench.py gpu's 440m layer and its timing (both scan paths, the projections alone, the HBM
    roofline), the official layer of the same widths timed with them; its autotuners take their
    first config, ours tune as always. Exits 1 when the official layer does not run."""
    with cli_errors(ValueError):
        check_official(checkout, named="")
        if not torch.cuda.is_available():
            raise ValueError("official times the layers on a CUDA GPU and torch sees none here")
        if triton.knobs.runtime.interpret:
            raise ValueError("official times the compiled kernels: run it without "
                             "TRITON_INTERPRET=1")
    mixer, u, dy, shape = gpu_layer(batch_size, seq_len)
    theirs = official_on_gpu(checkout, mixer.cfg, u, dy)
    out = {"machine": machine(), "triton": triton.__version__, "shape": shape,
           "official": str(checkout), "layer_times": layer_times(mixer, u, dy, reps, theirs, shape)}
    if theirs is not None:
        times = out["layer_times"]
        ratio = times["triton"]["layer_ms"] / times["official"]["layer_ms"]
        say(f"the Triton path's layer takes {ratio:.2f}x the official's time")
    if json_path:
        json_path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    console.print(f"machine: {out['machine']}, triton {out['triton']}")
    if theirs is None:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
