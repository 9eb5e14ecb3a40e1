"""Benchmarks for mamba3-lite: throughput against baselines run in the same process.

    python bench.py kernels   # or data, ckpt, train: the scan, the loader, checkpoints, steps
    python bench.py all       # those four; gpu (on a CUDA GPU): the Triton layer, then train.py

Timings are medians of interleaved repetitions (A, B, C, A, B, C, ...): a noisy machine slows every
contender alike. The GPU evidence that needs no GPU, and the official layer's timing beside ours,
are tools/gpu_evidence.py's.
"""
import dataclasses
import enum
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_model, save_model

import ckpt as C
import data as D
import kernels as K
import train
from model import PRESETS, Mamba3LM, Mamba3Mixer, bf16_native, peak_flops, pick_device

# (markdown: the help joins each paragraph's lines and wraps them at the terminal's width)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  pretty_exceptions_enable=False, help=__doc__.split("\n")[0])
console = Console(width=None if os.isatty(1) else 140)
ROOT = Path(__file__).resolve().parent

# the choices, spelled as train.py spells them
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["bf16", "fp16", "fp32"]
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Preset = enum.Enum("Preset", {name: name for name in PRESETS}, type=str)  # an Enum: --model repeats

# -----------------------------------------------------------------------------
# timing and tables


def machine() -> str:
    info = Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""
    cpu = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    cpu = cpu[1].strip() if cpu else platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads{gpu}"


def timed(fn, n: int = 1) -> float:
    """Mean seconds of n calls of fn, a GPU synchronized before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


def time_interleaved(fns: dict, reps: int, warmup: int = 1, n: int = 1) -> dict:
    """Median seconds per call of each fn, n calls a timing, round-robin so load slows all alike."""
    times = {name: [] for name in fns}
    for _ in range(warmup + reps):
        for name, fn in fns.items():
            times[name].append(timed(fn, n))
    return {name: float(np.median(ts[warmup:])) for name, ts in times.items()}


def print_table(title: str, columns: list, rows: list):
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        table.add_row(*[str(v) for v in r])
    console.print(table)


def say(text: str):  # as is: paths and error messages are no rich markup
    console.print(text, markup=False, highlight=False)

# -----------------------------------------------------------------------------
# bench.py kernels


def segsum_minimal(a):
    """(..., T) -> (..., T, T): sum of a over (j, i], -inf above the diagonal (masked cumsum)."""
    T = a.shape[-1]
    a = a[..., None].repeat(*([1] * a.dim()), T)
    below = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    a = a.masked_fill(~below, 0).cumsum(dim=-2)
    return a.masked_fill(~(below | torch.eye(T, dtype=torch.bool, device=a.device)), float("-inf"))


def ssd_minimal(x, q, k, log_a, trapezoid, chunk_size):
    """The baseline: a Mamba-2-paper-style minimal SSD (segsum masks and four einsums) with
    Mamba-3's trapezoid = (gamma, beta): weights w_s = gamma_s + beta_{s+1}, the gamma diagonal."""
    (gamma, beta), C = trapezoid, chunk_size  # no initial state; L a multiple of C
    B, L, H, P = x.shape
    c = L // C
    w = gamma + F.pad(beta[:, 1:], (0, 0, 0, 1))
    X, Q, K = (t.reshape(B, c, C, H, -1) for t in (x, q, k))
    A = log_a.reshape(B, c, C, H).permute(0, 3, 1, 2)  # (B, H, c, C)
    w, g = w.reshape(B, c, C, H), gamma.reshape(B, c, C, H)
    A_cs = A.cumsum(-1)
    # 1. outputs within each chunk (the diagonal blocks), then the own-token correction gamma - w
    Lmat = segsum_minimal(A).exp()
    Y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Q, K, Lmat, X * w[..., None])
    Y = Y + ((g - w)[..., None] * (Q * K).sum(-1, keepdim=True)) * X
    # 2. each chunk's final state
    decay_states = (A_cs[..., -1:] - A_cs).exp()
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", K, decay_states, X * w[..., None])
    # 3. states passed between chunks
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = segsum_minimal(F.pad(A_cs[..., -1], (1, 0))).exp()
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    states, final = states[:, :-1], states[:, -1]
    # 4. states to outputs
    Y = Y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Q, states, A_cs.exp())
    return Y.reshape(B, L, H, P), final


@app.command()
def kernels(
    batch_size: int = typer.Option(2, min=1, help="B"),
    seq_len: int = typer.Option(1024, min=1, help="L (a multiple of C, for the baseline)"),
    heads: int = typer.Option(8, min=1, help="H"),
    headdim: int = typer.Option(64, min=1, help="P"),
    d_state: int = typer.Option(64, min=1, help="N"),
    chunk_size: int = typer.Option(64, min=1, help="C"),
    dtype: DType = typer.Option("fp32", help="Dtype of x, q, k (log_a, gamma, beta stay fp32)."),
    device: Device = typer.Option("auto", help="auto picks cuda when torch sees a GPU."),
    reps: int = typer.Option(25, min=1, help="Interleaved repetitions per path."),
    recurrent: bool = typer.Option(True, help="Also time the token-by-token recurrence (slow)."),
):
    """The scan: fwd and fwd+bwd time of every ssd path vs a minimal-SSD baseline (the 440m layer on
    a GPU: **--batch-size 8 --seq-len 2048 --heads 32 --d-state 128 --dtype bf16**)."""
    B, L, H, P, N, C = batch_size, seq_len, heads, headdim, d_state, chunk_size
    with D.cli_errors(ValueError):
        dev = pick_device(device)
        if L % C:
            raise ValueError(f"--seq-len {L} must be a multiple of --chunk-size {C} for the "
                             "baseline")
    torch.manual_seed(0)
    xqk = torch.randn(B, L, H, P), *torch.randn(2, B, L, H, N) * N**-0.5
    inputs = [t.to(dev, TORCH_DTYPE[dtype]).requires_grad_() for t in xqk]  # log_a, gamma, beta:
    inputs += [(s * torch.randn(B, L, H).abs()).to(dev).requires_grad_() for s in (-0.1, .05, .05)]
    dy = torch.randn(B, L, H, P).to(dev, inputs[0].dtype)

    def timings(paths: dict, reps: int, warmup: int = 1) -> dict:
        fns = {}
        for name, fn in paths.items():  # fwd+bwd by autograd.grad: no .grad accumulation timed
            fns[name, "fwd"] = lambda fn=fn: torch.no_grad()(fn)(*inputs)
            fns[name, "fwd+bwd"] = lambda fn=fn: torch.autograd.grad(fn(*inputs)[0], inputs, dy)
        return time_interleaved(fns, reps, warmup)
    base, rec = "minimal SSD (baseline)", "recurrent (oracle)"
    times = timings({base: lambda *t: ssd_minimal(*t[:4], t[4:], C),  # t[4:]: (gamma, beta)
                     "torch (chunked)": lambda *t: K.ssd(*t, chunk_size=C, impl="torch")}, reps)
    if recurrent:  # the slow one in a group of its own, fewer times
        times |= timings({rec: lambda *t: K.ssd(*t, impl="recurrent")}, max(3, reps // 5), 0)
    fwd, both = ({name: t for (name, p), t in times.items() if p == k} for k in ("fwd", "fwd+bwd"))
    rows = [[name, f"{fwd[name] * 1e3:.2f}", f"{both[name] * 1e3:.2f}",
             f"{fwd[name] / fwd[base]:.2f}x", f"{both[name] / both[base]:.2f}x",
             f"{both[rec] / both[name]:.0f}x" if recurrent else "-"] for name in fwd]
    print_table(f"ssd  B{B} L{L} H{H} P{P} N{N} C{C} {dtype} on {dev}",
                ["path", "fwd ms", "fwd+bwd ms", "fwd vs baseline", "fwd+bwd vs baseline",
                 "faster than recurrence"], rows)
    console.print(f"machine: {machine()}")

# -----------------------------------------------------------------------------
# bench.py data


def nanogpt_get_batch(path, starts, L):
    # nanoGPT's train.py get_batch: re-create the memmap every batch, one astype + stack per row
    data = np.memmap(path, dtype=np.uint16, mode="r")
    x = torch.stack([torch.from_numpy(data[i : i + L].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + L].astype(np.int64)) for i in starts])
    return x, y


def window_pieces(shards, shard_starts, s, n):
    """[(shard, lo, hi, column)] covering tokens [s, s + n) of the shards' stream."""
    k, done, out = int(np.searchsorted(shard_starts, s, side="right")) - 1, 0, []
    while done < n:
        lo = s + done - shard_starts[k]
        hi = min(len(shards[k]), lo + n - done)
        out.append((shards[k], lo, hi, done))
        done, k = done + hi - lo, k + 1
    return out


def copy_windows(pieces, B, L):
    # each window's pieces (addresses found in advance) copied into a fresh (B, L+1) int64 buffer
    g = np.empty((B, L + 1), np.int64)
    for b, window in enumerate(pieces):
        for shard, lo, hi, col in window:
            g[b, col : col + hi - lo] = shard[lo:hi]
    return g


def bench_loaders(path, L, B, reps, per_call):
    """Seconds per batch of each loader on the stream at `path`; the token-id check's once-cost."""
    source = D.open_tokens(path)
    shards, starts = source.tokens, source.starts  # every contender reads these same maps
    W = (source.num_tokens - 1) // L
    n = min(W // B, (reps + 2) * per_call)

    def contender(seed, batch_fn, prepare=lambda ids: (ids * L).tolist()):  # window ids -> starts
        # Each its own random windows (a permutation, as the loader draws them): windows another
        # contender has just copied would be cache-warm, and flatter it. prepare: outside the timer.
        ids = np.random.default_rng(seed).permutation(W)[: n * B].reshape(n, B)
        batches = itertools.cycle([prepare(b) for b in ids])
        return lambda: batch_fn(next(batches))
    if len(shards) == 1:  # one file: one strided gather of all the rows, then the conversion
        view = np.lib.stride_tricks.as_strided(shards[0], (W, L + 1), (2 * L, 2), writeable=False)
        limit = contender(1, lambda ids: view[ids].astype(np.int64), lambda ids: ids)
    else:  # many files: one slice copy per piece of a window, converting as it copies
        limit = contender(1, lambda pieces: copy_windows(pieces, B, L), lambda ids: [
            window_pieces(shards, starts, s, L + 1) for s in (ids * L).tolist()])
    # As train.py does, arm the check of each file's token ids at its first read: it runs once per
    # file, so the steady state pays nothing for it; its one-time cost is timed here. Arming it
    # scans every page (these raw files record no id range), so that all contenders run in the
    # steady state (first touches of a fresh map cost a page fault each, whoever makes them).
    D.check_vocab(source, 1 << 16)
    check = timed(lambda: source.windows(np.arange(W), L))  # every window, so every file, once
    loader = D.Batches(source, D.BatchConfig(L, B, B, seed=0))  # each batch dropped, as in training
    times = time_interleaved({"limit": limit, "data.Batches": lambda: next(loader)}, reps,
                             n=per_call)
    if len(shards) == 1:  # the slow one in a group of its own: its garbage would land on others
        slow = contender(4, lambda starts: nanogpt_get_batch(source.files[0], starts, L))
        times |= time_interleaved({"nanoGPT get_batch": slow}, max(3, reps // 10), n=per_call)
    return times, check


def time_prepare(out: Path, tokenizer: str, workers: int):
    """(tokens, seconds by its own report: not Python's start, stats) of prepare.py on the demo."""
    cmd = [sys.executable, "prepare.py", "--tokenizer", tokenizer, "--workers", str(workers),
           "--val-fraction", "0.01", "--out-dir", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:  # its error's first clause: what went wrong, without the details
        raise RuntimeError(" ".join(done.stderr.split()).removeprefix("error: ").split(":")[0])
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(split["tokens"] for split in manifest["splits"].values())
    tokens_per_s = float(re.search(r"([\d,]+)\s+tokens/s", done.stdout)[1].replace(",", ""))
    return tokens, tokens / tokens_per_s, manifest["stats"]


def bench_prepare(out: Path):
    rows = []
    for tokenizer in ("byte", "gpt2"):
        try:
            for workers in (1, 2):  # best of two: the first run also warms the page cache
                runs = [time_prepare(out, tokenizer, workers) for _ in range(2)]
                n, best, stats = min(runs, key=lambda run: run[1])
                if tokenizer == "byte":  # a token a byte, and an EOS a document
                    files, size = stats["input_files"], n - stats["documents"]
                rows.append([tokenizer, workers, f"{n:,}", f"{best:.2f}", f"{n / best / 1e6:.2f}",
                             f"{size / best / 1e6:.1f}"])
        except RuntimeError as e:  # gpt2 without its BPE file (offline): said, then the rest
            if tokenizer == "byte":
                raise
            say(f"prepare {tokenizer}: skipped ({e}; set TIKTOKEN_CACHE_DIR)")
    print_table(f"prepare.py on the demo corpus ({files} files, {size / 1e6:.1f} MB of Python)",
                ["tokenizer", "workers", "tokens", "seconds", "M tokens/s", "MB/s"], rows)


@app.command()
def data(
    tokens: int = typer.Option(50_000_000, min=1, help="Tokens in the synthetic stream (uint16)."),
    shard_tokens: int = typer.Option(8192, min=1, help="Tokens per file of its sharded copy."),
    seq_len: int = typer.Option(2048, min=1, help="L"),
    batch_size: int = typer.Option(16, min=1, help="B"),
    reps: int = typer.Option(60, min=1, help="Interleaved repetitions per loader."),
    per_call: int = typer.Option(10, min=1, help="Batches per timed call."),
    prepare: bool = typer.Option(True, help="Also time prepare.py."),
    workdir: Optional[Path] = typer.Option(None, help="Where the token files go (default: a "
                                           "temporary directory, removed afterwards)."),
):
    """The loader's tokens/s on random windows, one core, vs a raw copy of them into a fresh int64
    (B, L+1) buffer (addresses found untimed); prepare.py on the demo corpus, byte and gpt2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loader feeds the GPU from one core (restored below, for `all`)
    B, L = batch_size, seq_len
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root, rows, checks = Path(workdir or tmp), [], []
        one, shards = root / "train.bin", root / "shards"
        shards.mkdir(parents=True, exist_ok=True)
        stream = np.random.default_rng(0).integers(0, 50257, tokens, dtype=np.uint16)
        stream.tofile(one)
        for k in range(0, tokens, shard_tokens):
            stream[k : k + shard_tokens].tofile(shards / f"shard_{k // shard_tokens:06d}.bin")
        streams = {f"one {tokens / 1e6:g}M-token file": one,
                   f"{-(-tokens // shard_tokens):,} files of {shard_tokens:,} tokens": shards}
        for label, path in streams.items():
            t, check = bench_loaders(path, L, B, reps, per_call)
            checks.append(f"{label}: {check * 1e3:.0f} ms")
            rows += [[label if name == "limit" else "", name, f"{B * L / t[name] / 1e6:,.0f}",
                      f"{t[name] * 1e6:,.0f}", f"{t['limit'] / t[name]:.2f}x"] for name in t]
        print_table(f"data loader  B{B} L{L} random windows, warm page cache, 1 core",
                    ["stream", "loader", "M tokens/s", "us/batch", "vs limit"], rows)
        console.print("the token-id check's one-time cost (every window read once, so every file "
                      "checked once): " + "; ".join(checks))
        if prepare:
            bench_prepare(root / "demo")
    console.print(f"machine: {machine()}")
    torch.set_num_threads(threads)

# -----------------------------------------------------------------------------
# bench.py ckpt


@app.command()
def ckpt(
    params: float = typer.Option(100e6, help="Parameters of a stack of 2048x2048 Linear layers."),
    model: Optional[Literal[tuple(PRESETS)]] = typer.Option(None, help="A preset's model instead."),
    reps: int = typer.Option(7, min=1, help="Interleaved repetitions."),
    workdir: Optional[Path] = typer.Option(None, help="A directory on the disk to measure."),
):
    """ckpt.save / ckpt.load vs bare safetensors + torch.save of the model and AdamW state, on CPU;
    bare + fsync is durability alone, ckpt.save adds the sha256s, renames and directory fsyncs."""
    torch.manual_seed(0)
    n = max(1, round(params / 2048**2))
    net = (Mamba3LM(PRESETS[model]) if model
           else torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(n)]))
    opt = torch.optim.AdamW(net.parameters())
    for p in net.parameters():  # one step so that AdamW holds its two moments per parameter
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory(dir=workdir) as d:
        files, written = (os.path.join(d, "bare.safetensors"), os.path.join(d, "bare.pt")), []

        def bare_save(durable=False):  # save_model: save_file, a tied tensor (a preset's) once
            save_model(net, files[0])
            torch.save({"optimizer": opt.state_dict()}, files[1])
            for path in files if durable else ():  # what any crash-safe save must add
                D.fsync(path)
        def bare_load():
            load_model(net, files[0])
            opt.load_state_dict(torch.load(files[1], weights_only=True)["optimizer"])
        save = lambda: written.append(C.save(d, 1, net, opt, {"bench": True}))  # noqa: E731
        saves = time_interleaved({"bare": bare_save, "fsync": lambda: bare_save(True),
                                  "ckpt": save}, reps)
        loads = time_interleaved({"bare": bare_load, "ckpt": lambda: C.load(d, 1, net, opt)}, reps)
        size = sum(os.path.getsize(p) for p in written[-1][:2])  # the weights, the optimizer state
    rows = [[what] + [f"{t[k]:.2f}" if k in t else "" for k in ("bare", "fsync", "ckpt")]
            + [f"{t['ckpt'] / t[k]:.2f}x" if k in t else "" for k in ("bare", "fsync")]
            + [f"{size / t[k] / 1e9:.2f}" for k in ("bare", "ckpt")]
            for what, t in (("save", saves), ("load", loads))]
    print_table(f"checkpoint of {sum(p.numel() for p in net.parameters()) / 1e6:.0f}M params "
                f"({f'{model} preset' if model else 'Linear stack'}) + AdamW state: "
                f"{size / 1e9:.2f} GB, medians of {reps}",
                ["", "bare s", "bare + fsync s", "ckpt s", "ckpt / bare", "ckpt / (bare + fsync)",
                 "bare GB/s", "ckpt GB/s"], rows)
    console.print("save target: ckpt / bare <= 1.30x (bare + fsync is the floor of any save that "
                  f"survives a crash, set by the disk)\nmachine: {machine()}, checkpoint dir on "
                  f"{workdir or tempfile.gettempdir()}")

# -----------------------------------------------------------------------------
# bench.py train


def training(name: str, dev: str, autocast, compile_: bool, accum: int = 1):
    """(model, step): preset `name`, and an AdamW step of `accum` micro batches of random tokens."""
    B, L = train.RECIPES[name]["batch_size"], train.RECIPES[name]["seq_len"]
    vocab = 257 if name in ("tiny", "small") else 50257  # the byte-level demo corpus, GPT-2 BPE
    torch.manual_seed(0)
    lm = Mamba3LM(dataclasses.replace(PRESETS[name], vocab_size=vocab)).to(dev)
    opt = torch.optim.AdamW(lm.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), fused=dev == "cuda")
    model = torch.compile(lm) if compile_ else lm
    tokens = torch.randint(0, vocab, (B, L + 1), device=dev)

    def step():
        for _ in range(accum):
            train.micro_step(model, tokens[:, :-1], tokens[:, 1:], autocast).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return lm, step


@app.command("train")
def train_step(
    model: Optional[List[Preset]] = typer.Option(None, help="A preset; repeat for several "
                                                 "(default: tiny and small on CPU, all on GPU)."),
    steps: int = typer.Option(5, min=1, help="Timed optimizer steps per preset."),
    warmup: int = typer.Option(2, min=0, help="Untimed steps first (allocation, torch.compile)."),
    device: Device = typer.Option("auto", help="auto picks cuda when torch sees a GPU."),
    dtype: Literal["auto", "bf16", "fp32"] = typer.Option(
        "auto", help="auto: as train.py, bf16 autocast where the device has bf16 arithmetic."),
    compile: Optional[bool] = typer.Option(
        None, "--compile/--no-compile", help="torch.compile the model (default: on for CUDA)."),
):
    """Tokens/s, ms/step and MFU of training steps per preset, one micro batch of its recipe a
    step; warm-up and compilation untimed; a preset that runs out of memory does not fit."""
    with D.cli_errors(ValueError):
        dev = pick_device(device)
    dtype = ("bf16" if bf16_native(dev) else "fp32") if dtype == "auto" else dtype
    compile_ = dev == "cuda" if compile is None else compile
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype == "bf16")
    peak = peak_flops(torch.cuda.get_device_name() if dev == "cuda" else "")
    rows = []
    for name in [m.value for m in model or []] or (PRESETS if dev == "cuda" else ["tiny", "small"]):
        B, L = train.RECIPES[name]["batch_size"], train.RECIPES[name]["seq_len"]
        try:
            lm, step = training(name, dev, autocast, compile_)
            for _ in range(warmup):
                step()
            dt = timed(step, steps)
            mfu = f"{lm.flops_per_token(L) * B * L / dt / peak:.1%}" if peak else "-"
            rows.append([name, f"{B}x{L}", f"{B * L / dt:,.0f}", f"{dt * 1e3:.0f}",
                         f"{lm.num_params() / 1e6:.1f}M", mfu])
        except torch.cuda.OutOfMemoryError:
            rows.append([name, f"{B}x{L}", "does not fit", "", "", ""])
        finally:
            lm = step = None
            torch.cuda.empty_cache()  # (a no-op without CUDA)
    print_table(f"training step on {dev} ({dtype}, compile {'on' if compile_ else 'off'})",
                ["preset", "batch x seq", "tokens/s", "ms/step", "params", "MFU"], rows)
    console.print(f"machine: {machine()}")

# -----------------------------------------------------------------------------
# bench.py gpu

# Max |a - ref| / max |ref| of y and every gradient against the float32 torch path: bf16 keeps 8
# bits of mantissa (4e-3 a rounding), a layer rounds often; fp32's products are tf32 (11 bits: the
# interpreter's tf32 shows 1.3e-3 for y, up to 5e-3 for gradients).
GPU_TOLERANCE = {"bf16": {"y": 3e-2, "gradients": 5e-2}, "fp32": {"y": 1e-2, "gradients": 2e-2}}
GPU_BUDGET_S = 300  # bench.py gpu, start-up included: the GPU check must fit what a lent GPU allows
# Peak HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name() (the first match wins,
# so the more specific names come first; "NVIDIA H100 80GB HBM3" is the SXM part).
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                   "H800": 3.35e12, "A100-SXM4-80GB": 2.04e12, "A100 80GB PCIe": 1.94e12,
                   "A100": 1.56e12, "L40S": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12,
                   "RTX 4090": 1.01e12, "RTX 3090": 0.936e12}


def region_bytes(cfg, batch_size: int, seq_len: int, act_bytes: int = 2) -> dict:
    """The compulsory HBM bytes of the layer's region (in_proj's output to out_proj's input): each
    pass reads its inputs and writes its outputs once, the fp32 parameters and gradients too."""
    T, H, N = batch_size * seq_len, cfg.n_heads, cfg.d_state
    row = 2 * cfg.d_inner + 2 * cfg.ngroups * N + 3 * H + cfg.n_angles  # z|x|B|C|dt|A|trap|angle
    inputs, output = T * row * act_bytes, T * cfg.d_inner * act_bytes
    params = 4 * (H + 2 * N + 2 * H * N + H)  # dt_bias, B/C norm weights, B/C biases, D
    return {"forward": inputs + output + params, "backward": 2 * inputs + output + 2 * params}


def forward_backward(module, u, dy, impl=None, dtype="bf16", reset=None):
    """One forward and backward of module on u (a leaf) on scan path impl, in autocast to dtype."""
    module.zero_grad(set_to_none=True)
    u.grad = None
    kw = {k: v for k, v in [("impl", impl), ("reset", reset)] if v is not None}  # (official: none)
    with torch.autocast(u.device.type, dtype=TORCH_DTYPE[dtype], enabled=dtype != "fp32"):
        y = module(u, **kw)
    y.backward(dy)
    return y


def check_layer(mixer, u, dy, dtype: str = "bf16", reset=None) -> list:
    """The Triton path in dtype and, for bf16, the torch path in bf16, against the float32 torch
    path, for y and the gradients of u and every parameter: rows of (tensor, shape, torch vs fp32,
    triton vs fp32, triton vs torch, tolerance, passed), the torch columns None for fp32."""
    def outputs(impl, dtype):
        x = u.detach().requires_grad_()
        y = forward_backward(mixer, x, dy, impl, dtype, reset)
        return {"y": y.detach(), "u": x.grad} | {n: p.grad for n, p in mixer.named_parameters()}
    def rel_err(a, ref) -> float:  # max |a - ref| / max |ref|
        err, scale = (a.double() - ref.double()).abs().max().item(), ref.double().abs().max().item()
        return err / scale if scale > 0 else err
    ref, ours = outputs("torch", "fp32"), outputs("triton", dtype)
    low = outputs("torch", dtype) if dtype != "fp32" else None  # the torch path in bf16
    rows = []
    for name, r in ref.items():
        tol, e = GPU_TOLERANCE[dtype]["y" if name == "y" else "gradients"], rel_err(ours[name], r)
        e0, e2 = (rel_err(low[name], r), rel_err(ours[name], low[name])) if low else (None, None)
        ok = bool(torch.isfinite(ours[name]).all()) and max(e, e2 or 0) <= tol
        rows.append((name, tuple(r.shape), e0, e, e2, tol, ok))
    return rows


def train_child(steps: int, accum: int):
    """bench.py gpu's 440m training run, in a process started first so that torch.compile's minutes
    overlap the layer checks. Says "BENCH {json}" lines: {"ready": s} after two untimed steps, then,
    once a line comes on stdin (the GPU is its own), the figures of `steps` more."""
    lm, step = training("440m", "cuda", torch.autocast("cuda", dtype=torch.bfloat16), True, accum)
    L, B = train.RECIPES["440m"]["seq_len"], train.RECIPES["440m"]["batch_size"]
    tell = lambda **figures: print("BENCH " + json.dumps(figures), flush=True)  # noqa: E731
    tell(ready=2 * timed(step, 2))  # compilation, allocation
    sys.stdin.readline()
    torch.cuda.reset_peak_memory_stats()
    dt, peak, tokens = timed(step, steps), peak_flops(torch.cuda.get_device_name()), accum * B * L
    tell(steps=steps, tokens_per_step=tokens, tok_per_s=tokens / dt, ms_per_step=dt * 1e3,
         peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9,
         mfu=lm.flops_per_token(L) * tokens / dt / peak if peak else None)


def start_train_child(steps: int, accum: int):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no wandb run
    code, log = f"import bench; bench.train_child({steps}, {accum})", tempfile.TemporaryFile("w+")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
    child.log = log  # its stderr, for the error report
    return child


def child_says(child, deadline: float, go: bool = False) -> dict:
    """train_child's next "BENCH" line (told to go on first, with go), or {"error": ...} when it
    exits or the deadline passes first (then it is stopped)."""
    if go:
        print("go", file=child.stdin, flush=True)
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), child.kill)
    timer.start()
    said = next((line for line in child.stdout if line.startswith("BENCH ")), None)
    timer.cancel()
    if said:
        return json.loads(said[6:])
    child.kill()  # its stdout ended: should it linger on, it goes now
    code = child.wait()
    child.log.seek(0)
    why = "ran past the time budget" if code == -9 else f"exited with {code}"
    return {"error": f"the training run {why}:\n{child.log.read()[-2000:]}"}


def layer_times(mixer, u, dy, reps: int, official=None, shape: str = "") -> dict:
    """Medians of a bf16 forward + backward of the layer on each scan path (and of `official`), and
    of its two projections alone: each path's layer and region (the difference) against the HBM
    roofline of the region's compulsory bytes, as a table and as figures."""
    u, (B, L, d) = u.detach().requires_grad_(), u.shape
    g = torch.randn(B, L, mixer.cfg.d_inner, device=u.device, requires_grad=True)  # into out_proj
    da, dout = (torch.ones(B, L, n, device=u.device, dtype=torch.bfloat16)
                for n in (mixer.in_proj.out_features, d))

    def projections():
        mixer.zero_grad(set_to_none=True)
        u.grad = g.grad = None
        with torch.autocast(u.device.type, dtype=torch.bfloat16):
            a, out = mixer.in_proj(u), mixer.out_proj(g)
        torch.autograd.backward([a, out], [da, dout])
    fns = {"torch": lambda: forward_backward(mixer, u, dy, "torch"), "projections": projections,
           "triton": lambda: forward_backward(mixer, u, dy, "triton")}
    if official is not None:
        fns["official"] = lambda: forward_backward(official, u, dy)
    t = time_interleaved(fns, reps, warmup=2)
    name = torch.cuda.get_device_name() if u.is_cuda else "this CPU"
    moved = sum(region_bytes(mixer.cfg, *u.shape[:2]).values())
    bw = next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)
    rows, figures = [], {"projections_ms": t["projections"] * 1e3, "region_bytes": moved,
                         "hbm_bytes_per_s": bw}
    for path in [path for path in t if path != "projections"]:
        region = t[path] - t["projections"]
        roofline = moved / bw / region if bw and region > 0 else None
        figures[path] = {"layer_ms": t[path] * 1e3, "region_ms": region * 1e3, "roofline": roofline,
                         "speedup_vs_torch": t["torch"] / t[path]}
        rows.append([path, f"{t[path] * 1e3:.2f}", f"{region * 1e3:.2f}",
                     f"{t['torch'] / t[path]:.2f}x", f"{roofline:.0%}" if roofline else "-"])
    print_table(f"one layer forward + backward, {shape}, bf16 autocast, medians of {reps}",
                ["scan path", "layer ms", "region ms (layer - projections)",
                 "layer speed-up vs torch", "region of HBM roofline"], rows)
    at = (f" at {bw / 1e12:.2f} TB/s = {moved / bw * 1e3:.3f} ms" if bw
          else f"; no HBM bandwidth known for {name}")
    console.print(f"projections alone: {t['projections'] * 1e3:.2f} ms; region's compulsory "
                  f"traffic {moved / 1e6:,.0f} MB (counted from the shapes, fwd + bwd){at}")
    return figures


def gpu_resets(B: int, L: int):
    # documents of ~200 tokens, starting anywhere in the chunks (as --reset-at-eos marks them)
    reset = torch.rand(B, L, generator=torch.Generator().manual_seed(0)) < 1 / 200
    reset[:, 0] = False
    return reset.cuda()


def gpu_layer(B: int, L: int):
    """(mixer, u, dy, shape): a seeded 440m mixer on the GPU, its input and output's gradient."""
    torch.manual_seed(0)
    cfg = PRESETS["440m"]
    mixer = Mamba3Mixer(cfg).cuda()
    u, dy = (torch.randn(B, L, cfg.d_model, device="cuda") for _ in range(2))
    return mixer, u, dy, f"B{B} L{L} H{cfg.n_heads} P{cfg.headdim} N{cfg.d_state} C{cfg.chunk_size}"


def gpu_checks(mixer, u, dy, shape: str, out: dict, done):
    """check_layer's tables in bf16 without and with resets and in fp32, into out["checks"]."""
    keys = ("tensor", "shape", "torch_vs_fp32", "triton_vs_fp32", "triton_vs_torch", "tolerance",
            "passed")
    e = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
    for dtype, reset in [("bf16", None), ("bf16", gpu_resets(*u.shape[:2])), ("fp32", None)]:
        what = dtype + (" with resets" if reset is not None else "")
        rows = check_layer(mixer, u, dy, dtype, reset)
        print_table(f"one 440m mixer layer, {shape}, {what}: max |a - ref| / max |ref| per "
                    "tensor, ref the float32 torch path", [k.replace("_", " ") for k in keys],
                    [[name, "x".join(map(str, s)), e(e0), e(e1), e(e2), f"{tol:.0e}",
                      "pass" if ok else "[red]FAIL[/red]"]
                     for name, s, e0, e1, e2, tol, ok in rows])
        out["checks"][what] = [dict(zip(keys, row)) for row in rows]
        out["failed"] += [] if all(row[-1] for row in rows) else [what]
        done(f"check {what}")


def gpu_train(child, deadline: float, out: dict):
    """The training run's figures once it has the GPU, into out["train"] (or its error)."""
    ready = out["train_ready"]
    run = out["train"] = ready if "error" in ready else child_says(child, deadline, go=True)
    if "error" in run:
        say(run["error"])
        out["failed"].append("training run")
        return
    print_table(f"the 440m preset, torch.compile on, random tokens, {run['tokens_per_step']:,} "
                f"tokens a step: {run['steps']} steps after 2 of warm-up",
                ["tokens/s", "ms/step", "MFU", "peak memory GB", "compile + warm-up s"],
                [[f"{run['tok_per_s']:,.0f}", f"{run['ms_per_step']:.0f}",
                  f"{run['mfu']:.1%}" if run["mfu"] else "-", f"{run['peak_memory_gb']:.1f}",
                  f"{ready['ready']:.0f}"]])


# bench.py gpu's prefill: (B, L) prompts of the 440m model, and the timed repetitions of each.
PREFILL_SHAPES = [(1, 8192), (8, 2048)]
PREFILL_REPS = 5
# The seconds bench.py gpu keeps for the prefill, its compiles included.
PREFILL_BUDGET_S = 30


def gpu_model():
    """A seeded 440m model on the GPU, for its prefill."""
    torch.manual_seed(0)
    return Mamba3LM(PRESETS["440m"]).cuda().eval()


def prefill_times(lm, shapes: list, reps: int) -> dict:
    """lm.prefill (a prompt through every layer from the cache's state, no gradient) on the
    fused Triton forward and on the PyTorch chunked scan, in bf16 autocast: tokens/s for each
    (B, L) in shapes, and how far apart the two paths' last logits are (max |a - b| / max |b|,
    each from a fresh cache), as a table and as figures."""
    device = lm.embed.weight.device
    paths = ("torch", "triton")
    rows = []
    figures = {}
    for B, L in shapes:
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, lm.config.vocab_size, (B, L), generator=g).to(device)

        def prefill(impl, cache):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return lm.prefill(idx, cache, impl)

        def contender(impl):
            # Each path moves its own cache on, call after call.
            cache = lm.init_cache(B)
            return lambda: prefill(impl, cache)

        # From fresh caches: the logits compared, and the kernels compiled and tuned.
        logits = {}
        for impl in paths:
            logits[impl] = prefill(impl, lm.init_cache(B)).double()
        apart = (logits["triton"] - logits["torch"]).abs().max()
        apart = (apart / logits["torch"].abs().max()).item()
        fns = {impl: contender(impl) for impl in paths}
        t = time_interleaved(fns, reps)
        speed = {impl: B * L / t[impl] for impl in paths}
        speedup = speed["triton"] / speed["torch"]
        figures[f"B{B} L{L}"] = {"torch_tok_per_s": speed["torch"],
                                 "triton_tok_per_s": speed["triton"], "speedup": speedup,
                                 "logits_apart": apart}
        rows.append([f"{B} x {L}", f"{speed['torch']:,.0f}", f"{speed['triton']:,.0f}",
                     f"{speedup:.2f}x", f"{apart:.1e}"])
    cfg = lm.config
    print_table(f"prefill (model.prefill from a cache, no gradient), {cfg.n_layer} layers of "
                f"d_model {cfg.d_model}, bf16 autocast, medians of {reps}",
                ["prompt B x L", "torch tokens/s", "triton tokens/s", "speed-up",
                 "last logits apart"], rows)
    return figures


@app.command()
def gpu(
    batch_size: int = typer.Option(8, min=1, help="B of the layer checked and timed."),
    seq_len: int = typer.Option(2048, min=1, help="L of the layer checked and timed."),
    reps: int = typer.Option(20, min=1, help="Interleaved repetitions of the layer timings."),
    train_steps: int = typer.Option(10, min=0, help="Timed steps of the 440m run; 0: none."),
    total_batch_size: int = typer.Option(
        16384, min=16384, help="Tokens per optimizer step of that run, a multiple of its micro "
        "batch 8 x 2048 (the default fits the time; the preset's 524,288 takes 32)."),
    json_path: Optional[Path] = typer.Option(None, "--json", dir_okay=False,
                                             help="Also write every figure there, as JSON."),
):
    """On a CUDA GPU, within five minutes of an H200: a 440m layer's output and gradients on the
    Triton path against the float32 torch path (bf16, bf16 with resets, fp32), its forward +
    backward time on both paths and against the HBM roofline, then steps of the 440m preset,
    compiled (started first, to overlap the checks), then the 440m model's prefill tokens/s on
    both paths."""
    t0 = time.monotonic()
    with D.cli_errors(ValueError):
        if not torch.cuda.is_available():
            raise ValueError("bench.py gpu needs a CUDA GPU and torch sees none here (without one, "
                             "python tools/gpu_evidence.py compile shows the GPU's binaries)")
        if total_batch_size % 16384:
            raise ValueError(f"--total-batch-size {total_batch_size} must be a multiple of 16384 "
                             "(8 x 2048, one micro batch of the 440m recipe)")
    # first: its compilation overlaps the checks
    child = start_train_child(train_steps, total_batch_size // 16384) if train_steps else None
    # for the training run, leaving the time for the prefill and to report
    deadline = t0 + GPU_BUDGET_S - 15 - PREFILL_BUDGET_S
    torch.set_float32_matmul_precision("highest")  # the fp32 reference in true fp32, no TF32
    mixer, u, dy, shape = gpu_layer(batch_size, seq_len)
    out = {"machine": machine(), "triton": K.triton.__version__, "shape": shape, "checks": {},
           "elapsed_s": {}, "failed": []}

    def done(part):
        out["elapsed_s"][part] = round(time.monotonic() - t0, 1)
        say(f"[{part}: done at {out['elapsed_s'][part]:.0f} s]")

    gpu_checks(mixer, u, dy, shape, out, done)
    if child:
        out["train_ready"] = child_says(child, deadline)  # compiled: the GPU is ours now
        done("training run compiled")
    out["layer_times"] = layer_times(mixer, u, dy, reps, shape=shape)
    done("layer timings")
    del mixer, u, dy
    torch.cuda.empty_cache()
    if child:
        gpu_train(child, deadline, out)
        done("training run")
    # The GPU is free again: prefill on both paths.
    out["prefill"] = prefill_times(gpu_model(), PREFILL_SHAPES, PREFILL_REPS)
    done("prefill")
    # the launch config each kernel's tuner chose in this process, by kernel and shape
    out["tuned"] = [dict(kernel=k[0], shape=dict(k[2]), options=v) for k, v in K.TUNED.items()]
    if json_path:
        json_path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    failed = f"; FAILED: {', '.join(out['failed'])}" if out["failed"] else ""
    console.print(f"machine: {machine()}, triton {out['triton']}{failed}")
    if out["failed"]:
        raise typer.Exit(1)


# -----------------------------------------------------------------------------
# bench.py eval

# Words of the stand-in task's made-up texts.
WORDS = ("the man then woman picks up a ball and throws it across field while dog runs "
         "after kitchen knife cuts onion slowly into small pieces before adding them to "
         "pan she he they camera shows").split()

# A multiple-choice task of hellaswag's shape over a local JSONL file, as eval.py --include
# reads it: a context, four endings, the index of the right one; acc and acc_norm.
CHOICE_YAML = """task: bench_hellaswag_shaped
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def made_up(rng, n_words):
    """A text of about n_words words (+-20%) drawn from WORDS."""
    low = max(1, int(n_words * 0.8))
    high = int(n_words * 1.2) + 1
    count = int(rng.integers(low, high))
    return " ".join(rng.choice(WORDS, count))


def choice_docs(n_docs, seed=0):
    """Documents of hellaswag's shape: a context of about 40 words (hellaswag's ctx), and
    four endings of about 20 words each, of similar lengths."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        query = made_up(rng, 40).capitalize() + "."
        choices = []
        for _ in range(4):
            choices.append(made_up(rng, 20) + ".")
        docs.append({"query": query, "choices": choices, "label": int(rng.integers(4))})
    return docs


def write_choice_task(directory, docs):
    """The stand-in task's YAML and JSONL in `directory`; returns the task's name."""
    directory = Path(directory)
    jsonl = directory / "bench_choice.jsonl"
    lines = [json.dumps(doc) for doc in docs]
    jsonl.write_text("\n".join(lines) + "\n")
    (directory / "bench_choice.yaml").write_text(CHOICE_YAML.format(data=jsonl))
    return "bench_hellaswag_shaped"


def loglikelihood_contenders(model, docs, batch_size):
    """{name: fn} for the harness's loglikelihood of every (context, ending) pair of docs and
    a plain forward over the same tokens, and the tokens each runs."""
    # Imported here: lm-eval takes seconds to import, and only this table needs it.
    import eval as E
    from lm_eval.api.instance import Instance

    harness = E.Mamba3Harness(model, D.ByteTokenizer(), batch_size)
    requests = []
    for doc in docs:
        for ending in doc["choices"]:
            # hellaswag's continuation is the ending after a space.
            args = (doc["query"], " " + ending)
            requests.append(Instance("loglikelihood", doc={}, arguments=args, idx=0))
    sequences = [harness.encode_pair(*r.args).tokens for r in requests]
    # The plain forward: the same tokens, packed into rows of the mean length, no padding,
    # the logits of every position.
    stream = list(itertools.chain.from_iterable(sequences))
    length = len(stream) // len(sequences)
    rows = len(stream) // length
    # (rows, length)
    packed = torch.tensor(stream[:rows * length]).view(rows, length)

    def forward():
        with torch.no_grad():
            for start in range(0, rows, batch_size):
                model(packed[start:start + batch_size])

    def loglikelihood():
        harness.loglikelihood(requests)

    fns = {"harness": loglikelihood, "forward": forward}
    tokens = {"harness": len(stream), "forward": rows * length}
    return fns, tokens


@app.command("eval")
def eval_(
    model: Preset = typer.Option("small", help="The preset (byte vocabulary), random weights."),
    docs: int = typer.Option(200, min=1, help="Documents of the stand-in task (4 endings each)."),
    throughput_docs: int = typer.Option(50, min=1, help="Documents whose requests the "
                                        "loglikelihood table times."),
    batch_size: int = typer.Option(16, min=1, help="Requests (rows) per forward."),
    reps: int = typer.Option(3, min=1, help="Interleaved repetitions."),
    wall: bool = typer.Option(True, "--wall/--no-wall", help="Also time `python eval.py` "
                              "on the stand-in task."),
):
    """eval.py on CPU: the harness's loglikelihood tokens/s against a plain forward over the same
    tokens (goal >= 0.8x), and the wall time of `python eval.py RUN --tasks ... --limit DOCS` on
    an offline task of hellaswag's shape (no network here: it stands in for hellaswag)."""
    name = model.value
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS[name], vocab_size=257)
    lm = Mamba3LM(cfg).eval()
    fns, tokens = loglikelihood_contenders(lm, choice_docs(throughput_docs), batch_size)
    times = time_interleaved(fns, reps)
    speed = {}
    for key in fns:
        speed[key] = tokens[key] / times[key]
    rows = []
    for key in fns:
        ratio = speed[key] / speed["forward"]
        rows.append([key, f"{tokens[key]:,}", f"{times[key]:.2f}", f"{speed[key]:,.0f}",
                     f"{ratio:.2f}x"])
    print_table(f"loglikelihood of {throughput_docs * 4} requests ({name} preset, float32, "
                f"batch {batch_size}), medians of {reps}",
                ["", "tokens", "s", "tokens/s", "vs forward"], rows)
    console.print("goal: harness >= 0.80x the plain forward")
    if wall:
        with tempfile.TemporaryDirectory() as d:
            # A run directory of the preset, as eval.py reads one.
            C.save(Path(d) / "run", 1, lm, None, {"tokenizer": {"name": "byte"}})
            task = write_choice_task(d, choice_docs(docs))
            command = [sys.executable, str(ROOT / "eval.py"), str(Path(d) / "run"), "--tasks",
                       task, "--include", d, "--limit", str(docs), "--device", "cpu",
                       "--batch-size", str(batch_size)]
            # The Hub is never needed: the task's data is local.
            env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
            t0 = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            seconds = time.perf_counter() - t0
        if done.returncode != 0:
            say(done.stdout + done.stderr)
            raise typer.Exit(1)
        say(done.stdout.strip())
        console.print(f"python eval.py RUN --tasks {task} --limit {docs} ({name} preset, an "
                      f"offline stand-in for hellaswag: {docs} documents of 4 endings): "
                      f"{seconds:.1f} s wall")
    console.print(f"machine: {machine()}")

# -----------------------------------------------------------------------------
# bench.py all


@app.command("all")
def all_():
    """kernels, data, ckpt and train with their defaults, one after the other (gpu: on its own)."""
    commands = typer.main.get_command(app).commands
    for name in ("kernels", "data", "ckpt", "train"):
        commands[name].callback(**{p.name: p.default for p in commands[name].params})


if __name__ == "__main__":
    app()
