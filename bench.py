"""Benchmarks for mamba3-lite: throughput against baselines run in the same process, and the GPU path's evidence.

    python bench.py kernels   # the Mamba-3 scan: every ssd path vs a minimal-SSD baseline
    python bench.py data      # the data loader vs a raw memcpy of the same windows; prepare.py tokens/s
    python bench.py ckpt      # checkpoint save/load vs bare safetensors + torch.save
    python bench.py train     # tokens/s, ms/step and MFU of a few training steps per preset
    python bench.py all       # the four above
    python bench.py compile   # every Triton kernel a layer launches, compiled for sm_80 / sm_90 (no GPU needed)
    python bench.py gpu       # on a GPU: Triton vs torch accuracy and speed of a layer, then 30 training steps

Timings are medians of interleaved repetitions (A, B, C, A, B, C, ...) so that a noisy shared machine
slows every contender alike; the ratios are what to read, the absolute figures depend on the machine.
"""
import contextlib
import dataclasses
import enum
import inspect
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import List, Literal, Optional

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.table import Table

from model import PRESETS, Mamba3LM, Mamba3Mixer, bf16_native, peak_flops

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="rich",
                  pretty_exceptions_enable=False, help=__doc__.split("\n")[0])
console = Console(width=None if os.isatty(1) else 140)
ROOT = Path(__file__).resolve().parent

# the choices, spelled as train.py spells them
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["bf16", "fp16", "fp32"]
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
Preset = enum.Enum("Preset", {name: name for name in PRESETS}, type=str)  # an Enum: --model repeats


def command(name: Optional[str] = None):
    """app.command, with each paragraph of the docstring joined into one line: Typer's rich help keeps the
    line breaks of the source, which would break its paragraphs at the source's width instead of the terminal's."""
    def register(fn):
        fn.__doc__ = "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(fn.__doc__).split("\n\n"))
        return app.command(name)(fn)
    return register


def fail(message: str):
    """Bad input or a machine that cannot run the command: one paragraph on stderr, exit code 2."""
    Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {message}", soft_wrap=True)
    raise typer.Exit(2)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda was asked for, but torch sees no CUDA device; use --device cpu (or auto)")
    return device


@app.callback()
def main():
    """Benchmarks for mamba3-lite: throughput against baselines run in the same process, and the GPU path's
    evidence (see each command's --help)."""


# -----------------------------------------------------------------------------
# shared helpers


def machine() -> str:
    """One line naming the machine the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    line = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        line += f", {torch.cuda.get_device_name()}"
    return line


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_interleaved(fns: dict, reps: int, warmup: int = 1) -> dict:
    """Median seconds per call of each fn, running them round-robin so load affects all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_table(title: str, columns: list, rows: list):
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        table.add_row(*[str(v) for v in r])
    console.print(table)


# -----------------------------------------------------------------------------
# bench.py kernels


def segsum_minimal(a):
    """(..., T) -> (..., T, T): sum of a over (j, i], -inf above the diagonal (the stable masked-cumsum form)."""
    T = a.shape[-1]
    a = a[..., None].repeat(*([1] * a.dim()), T)
    below = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    a = a.masked_fill(~below, 0).cumsum(dim=-2)
    return a.masked_fill(~(below | torch.eye(T, dtype=torch.bool, device=a.device)), float("-inf"))


def ssd_minimal(x, q, k, log_a, gamma, beta, chunk_size=64):
    """The baseline: a Mamba-2-paper-style minimal SSD (segsum masks and four einsums) extended with
    Mamba-3's trapezoid weights w_s = gamma_s + beta_{s+1} and the gamma diagonal. No initial state;
    L must be a multiple of chunk_size."""
    B, L, H, P = x.shape
    C = chunk_size
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


# Peak HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name() (the first match wins, so the
# more specific names come first; "NVIDIA H100 80GB HBM3" is the SXM part).
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "H800": 3.35e12,
                   "A100-SXM4-80GB": 2.04e12, "A100 80GB PCIe": 1.94e12, "A100": 1.56e12, "L40S": 0.864e12,
                   "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12, "RTX 4090": 1.01e12, "RTX 3090": 0.936e12}


def hbm_bandwidth():
    """Peak HBM bytes/s of this GPU by its name (None for a GPU not in HBM_BYTES_PER_S)."""
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


@command()
def kernels(
    batch_size: int = typer.Option(2, min=1, help="B"),
    seq_len: int = typer.Option(1024, min=1, help="L (a multiple of --chunk-size, for the baseline)"),
    heads: int = typer.Option(8, min=1, help="H"),
    headdim: int = typer.Option(64, min=1, help="P"),
    d_state: int = typer.Option(64, min=1, help="N"),
    chunk_size: int = typer.Option(64, min=1, help="C"),
    dtype: DType = typer.Option("fp32", help="Dtype of x, q, k (log_a, gamma, beta stay fp32)."),
    device: Device = typer.Option("auto", help="auto picks cuda when torch sees a GPU."),
    reps: int = typer.Option(25, min=1, help="Interleaved repetitions per path."),
    recurrent: bool = typer.Option(True, help="Also time the token-by-token recurrence (slow)."),
):
    """The scan: fwd and fwd+bwd time of every available ssd path vs a minimal-SSD baseline.

    The defaults are a CPU-sized problem; the 440m layer on a GPU is
    [bold]--batch-size 8 --seq-len 2048 --heads 32 --d-state 128 --dtype bf16[/bold]."""
    import kernels as K

    dev = resolve_device(device)
    dt = TORCH_DTYPE[dtype]
    B, L, H, P, N = batch_size, seq_len, heads, headdim, d_state
    if L % chunk_size:
        fail(f"--seq-len {L} must be a multiple of --chunk-size {chunk_size} for the baseline")
    g = torch.Generator(device="cpu").manual_seed(0)

    def make(*shape, scale=1.0, positive=False, dtype=dt):
        t = torch.randn(*shape, generator=g) * scale
        t = t.abs() if positive else t
        return t.to(device=dev, dtype=dtype).requires_grad_()

    x, q, k = make(B, L, H, P), make(B, L, H, N, scale=N ** -0.5), make(B, L, H, N, scale=N ** -0.5)
    log_a = (-make(B, L, H, scale=0.1, positive=True, dtype=torch.float32)).detach().requires_grad_()
    gamma, beta = (make(B, L, H, scale=0.05, positive=True, dtype=torch.float32) for _ in range(2))
    inputs = (x, q, k, log_a, gamma, beta)
    dy = torch.randn(B, L, H, P, generator=g).to(device=dev, dtype=dt)

    paths = {"minimal SSD (baseline)": lambda *t: ssd_minimal(*t, chunk_size=chunk_size)}
    paths["torch (chunked)"] = lambda *t: K.ssd(*t, chunk_size=chunk_size, impl="torch")
    if dev == "cuda" and K.triton_available():
        paths["triton"] = lambda *t: K.ssd(*t, chunk_size=chunk_size, impl="triton")
    if recurrent:
        paths["recurrent (oracle)"] = lambda *t: K.ssd(*t, impl="recurrent")

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(*inputs)
        return run

    def fwd_bwd(fn):
        def run():
            y, _ = fn(*inputs)
            torch.autograd.grad(y, inputs, dy)  # no .grad accumulation inside the timing
        return run

    fns = {}
    for name, fn in paths.items():
        fns[(name, "fwd")] = fwd(fn)
        fns[(name, "fwd+bwd")] = fwd_bwd(fn)
    slow = {key: f for key, f in fns.items() if key[0].startswith("recurrent")}
    fast = {key: f for key, f in fns.items() if key not in slow}
    times = time_interleaved(fast, reps)
    if slow:
        times.update(time_interleaved(slow, max(3, reps // 5), warmup=0))

    base = "minimal SSD (baseline)"
    rec = "recurrent (oracle)"
    bytes_moved = sum(t.numel() * t.element_size() for t in inputs) + x.numel() * x.element_size()
    bw = hbm_bandwidth() if dev == "cuda" else None
    rows = []
    for name in paths:
        f, fb = times[(name, "fwd")], times[(name, "fwd+bwd")]
        row = [name, f"{f * 1e3:.2f}", f"{fb * 1e3:.2f}", f"{f / times[(base, 'fwd')]:.2f}x",
               f"{fb / times[(base, 'fwd+bwd')]:.2f}x"]
        row.append(f"{times[(rec, 'fwd+bwd')] / fb:.0f}x" if rec in paths else "-")
        if bw:
            row.append(f"{bytes_moved / f / bw:.0%}")
        rows.append(row)
    cols = ["path", "fwd ms", "fwd+bwd ms", "fwd vs baseline", "fwd+bwd vs baseline", "faster than recurrence"]
    if bw:
        cols.append("fwd of HBM roofline (in+out bytes)")
    print_table(f"ssd  B{B} L{L} H{H} P{P} N{N} C{chunk_size} {dtype} on {dev}", cols, rows)
    console.print(f"machine: {machine()}")


# -----------------------------------------------------------------------------
# bench.py data


def _nanogpt_get_batch(path, starts, L):
    # nanoGPT's train.py get_batch: re-create the memmap every batch, one astype + stack per row
    import numpy as np

    data = np.memmap(path, dtype=np.uint16, mode="r")
    x = torch.stack([torch.from_numpy(data[i : i + L].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + L].astype(np.int64)) for i in starts])
    return x, y


def _python_lists_batch(shards, shard_starts, starts, L):
    # a loader that finds each window's shards and stitches them through Python lists
    import bisect

    rows = []
    for s in starts:
        k, toks = bisect.bisect_right(shard_starts, s) - 1, []
        while len(toks) < L + 1:
            lo = s + len(toks) - shard_starts[k]
            toks += shards[k][lo : lo + L + 1 - len(toks)].tolist()
            k += 1
        rows.append(toks)
    return torch.tensor([r[:-1] for r in rows]), torch.tensor([r[1:] for r in rows])


def _window_pieces(shards, shard_starts, s, n):
    """[(shard, lo, hi, column)] covering tokens [s, s + n): the addresses a copy needs, found in advance."""
    import bisect

    k, done, out = bisect.bisect_right(shard_starts, s) - 1, 0, []
    while done < n:
        lo = s + done - shard_starts[k]
        hi = min(len(shards[k]), lo + n - done)
        out.append((shards[k], lo, hi, done))
        done += hi - lo
        k += 1
    return out


def _copy_windows(pieces, g):
    # the plain copy of each window's pieces (addresses found in advance) into one (B, L+1) int64 buffer,
    # converting on the way
    for b, window in enumerate(pieces):
        for shard, lo, hi, col in window:
            g[b, col : col + hi - lo] = shard[lo:hi]
    return g


def _bench_loaders(path, files, tokens, L, B, reps, per_call):
    """Seconds per batch of each loader on the token stream at `path` (one file or a shard directory)."""
    import numpy as np
    from numpy.lib.stride_tricks import as_strided

    import data as D

    shards = [np.memmap(f, dtype=np.uint16, mode="r").view(np.ndarray) for f in files]
    shard_starts = [0] + np.cumsum([len(s) for s in shards]).tolist()
    source = D.open_tokens(path)
    # Touch every page through both sets of maps, so that all contenders run in the steady state
    # (first touches of a fresh map cost a page fault each, whoever makes them).
    assert max(int(s.max()) for s in shards) == source.max_token_id
    W = (tokens - 1) // L
    n = min(W // B, (reps + 2) * per_call)

    def contender(seed, batch_fn, addresses=False):
        # Each contender gets its own random windows (a permutation, as the loader draws them): windows
        # another contender has just copied would be cache-warm, and flatter it.
        order = np.random.default_rng(seed).permutation(W)[: n * B].reshape(n, B)  # (n, B) window ids
        batches = [(o * L).tolist() for o in order]  # window starts
        if addresses:  # found in advance, outside the timer
            batches = [[_window_pieces(shards, shard_starts, s, L + 1) for s in starts] for starts in batches]
        state = {"i": 0, "order": order, "batches": batches}

        def run():
            for _ in range(per_call):
                i = state["i"] = (state["i"] + 1) % n
                batch_fn(order[i], batches[i])

        return run

    # the limit: the same kind of windows copied into a fresh (B, L+1) int64 buffer (the caller keeps it)
    if len(files) == 1:  # one file: one strided gather of all the rows, then the conversion
        view = as_strided(shards[0], (W, L + 1), (2 * L, 2), writeable=False)
        limit = contender(1, lambda ids, _: view[ids].astype(np.int64))
    else:  # many files: one slice copy per piece of a window, converting as it copies
        limit = contender(1, lambda _, pieces: _copy_windows(pieces, np.empty((B, L + 1), np.int64)), addresses=True)
    # As train.py does, arm the check of each file's token ids at its first read; it runs once per file, so the
    # steady state (what the table shows) pays nothing for it: its one-time cost, one read of every file, is
    # timed here and printed below the table.
    D.check_vocab(source, 1 << 16)
    t0 = time.perf_counter()
    source.windows(np.arange(W), L)  # every window once: every file's first read, and its check
    check = time.perf_counter() - t0
    loader = D.Batches(source, L, B, B, seed=0)

    def batches():  # like a training loop, each batch is dropped before the next is taken
        for _ in range(per_call):
            next(loader)

    fns = {"limit": limit, "data.Batches": batches}
    # The slow baselines run in a group of their own: their garbage would otherwise land on whoever follows.
    slow = {"Python lists": contender(3, lambda _, starts: _python_lists_batch(shards, shard_starts, starts, L))}
    if len(files) == 1:
        slow["nanoGPT get_batch"] = contender(4, lambda _, starts: _nanogpt_get_batch(files[0], starts, L))
    times = {**time_interleaved(fns, reps), **time_interleaved(slow, max(3, reps // 10))}
    return {**{name: t / per_call for name, t in times.items()}, "check": check}


@command()
def data(
    tokens: int = typer.Option(50_000_000, min=1, help="Tokens in the synthetic stream (uint16, GPT-2 vocabulary)."),
    shard_tokens: int = typer.Option(8192, min=1, help="Tokens per file of the sharded copy of the same stream."),
    seq_len: int = typer.Option(2048, min=1, help="L"),
    batch_size: int = typer.Option(16, min=1, help="B"),
    reps: int = typer.Option(60, min=1, help="Interleaved repetitions per loader."),
    per_call: int = typer.Option(10, min=1, help="Batches per timed call."),
    prepare_corpus: bool = typer.Option(True, "--prepare/--no-prepare", help="Also time prepare.py on the demo corpus."),
    workdir: Optional[Path] = typer.Option(None, help="Where the token files go (default: a temporary directory, "
                                           "removed afterwards)."),
):
    """The data loader's tokens/s on random windows vs a raw copy of the same windows; prepare.py's tokens/s.

    One core, warm page cache. The limit is a raw copy of the same kind of windows into a fresh int64 (B, L+1)
    buffer (what the loader returns x and y as views of), with every window's address found in advance, outside
    the timer. Baselines: nanoGPT's get_batch and a loader stitching windows through Python lists. Then prepare.py
    on the demo corpus with 1 and 2 workers (byte, and gpt2 where tiktoken can load its BPE file)."""
    import shutil

    import numpy as np

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loader feeds the GPU from one core (restored below for `bench.py all`)
    B, L = batch_size, seq_len
    root = Path(workdir or tempfile.mkdtemp(prefix="bench-data-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        stream = np.random.default_rng(0).integers(0, 50257, tokens, dtype=np.uint16)
        single = root / "train.bin"
        stream.tofile(single)
        sharded = root / "shards"
        sharded.mkdir(exist_ok=True)
        files = []
        for k, i in enumerate(range(0, tokens, shard_tokens)):
            files.append(sharded / f"shard_{k:06d}.bin")
            stream[i : i + shard_tokens].tofile(files[-1])
        del stream
        for f in [single] + files:  # warm the page cache
            f.read_bytes()
        names = ["limit", "data.Batches", "nanoGPT get_batch", "Python lists"]
        rows, checks = [], []
        for label, path, fs in [(f"one {tokens / 1e6:g}M-token file", single, [single]),
                                (f"{len(files):,} files of {shard_tokens:,} tokens", sharded, files)]:
            t = _bench_loaders(path, fs, tokens, L, B, reps, per_call)
            checks.append(f"{label}: {t.pop('check') * 1e3:.0f} ms")
            for name in names:
                if name in t:
                    rows.append([label if name == "limit" else "", name, f"{B * L / t[name] / 1e6:,.0f}",
                                 f"{t[name] * 1e6:,.0f}", f"{t['limit'] / t[name]:.2f}x"])
        print_table(f"data loader  B{B} L{L} random windows, warm page cache, 1 core",
                    ["stream", "loader", "M tokens/s", "us/batch", "vs limit"], rows)
        console.print("the token-id check's one-time cost (every window read once, so every file checked once): "
                      + "; ".join(checks))
        if prepare_corpus:
            _bench_prepare(root)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    console.print(f"machine: {machine()}")
    torch.set_num_threads(threads)


def _bench_prepare(root):
    import prepare as P
    from data import DataError

    files = P.demo_inputs()
    size = sum(f.stat().st_size for f in files)
    rows = []
    for tokenizer in ("byte", "gpt2"):
        try:
            P.tokenizer_from_flag(tokenizer)
        except DataError as e:
            console.print(f"prepare {tokenizer}: skipped ({str(e).split(':')[0]}; set TIKTOKEN_CACHE_DIR)")
            continue
        for workers in (1, 2):
            best = float("inf")
            for _ in range(2):  # best of two: the first run also warms the page cache
                t0 = time.perf_counter()
                m = P.prepare(files, root / "demo", tokenizer, workers=workers, val_fraction=0.01, log=lambda s: None)
                best = min(best, time.perf_counter() - t0)
            n = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
            rows.append([tokenizer, workers, f"{n:,}", f"{best:.2f}", f"{n / best / 1e6:.2f}",
                         f"{size / best / 1e6:.1f}"])
    print_table(f"prepare.py on the demo corpus ({len(files)} files, {size / 1e6:.1f} MB of Python)",
                ["tokenizer", "workers", "tokens", "seconds", "M tokens/s", "MB/s"], rows)


# -----------------------------------------------------------------------------
# bench.py ckpt


@command()
def ckpt(
    params: float = typer.Option(100e6, help="Parameters of the benchmark model (a stack of 2048x2048 Linear layers)."),
    model: Optional[Literal[tuple(PRESETS)]] = typer.Option(None, help="Checkpoint this preset's model instead of "
                                                            "the Linear stack."),
    reps: int = typer.Option(7, min=1, help="Interleaved repetitions."),
    workdir: Optional[Path] = typer.Option(None, help="A directory on the disk to measure (default: the system "
                                           "temporary directory)."),
):
    """ckpt.save / ckpt.load vs bare safetensors save_file + torch.save of the same state, with AdamW, on CPU.

    ckpt.save includes the sha256 of both files, fsync of files and directory, and the atomic renames; bare + fsync
    (bare, then both files fsynced) is what durability alone costs on this disk."""
    import ckpt as C
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    if model:
        net = Mamba3LM(PRESETS[model])
    else:
        net = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(max(1, round(params / 2048**2)))])
    opt = torch.optim.AdamW(net.parameters())
    for p in net.parameters():  # one step so that AdamW holds its two moments per parameter
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    n_params = sum(p.numel() for p in net.parameters())

    with tempfile.TemporaryDirectory(dir=workdir) as d:
        bare_model, bare_optim = os.path.join(d, "bare.safetensors"), os.path.join(d, "bare.pt")

        def bare_save():
            save_file(net.state_dict(), bare_model)
            torch.save({"optimizer": opt.state_dict()}, bare_optim)

        def durable_save():  # bare, then what any crash-safe save must add: both files on the disk
            bare_save()
            for path in bare_model, bare_optim:
                with open(path, "rb") as f:
                    os.fsync(f.fileno())

        def bare_load():
            net.load_state_dict(load_file(bare_model))
            opt.load_state_dict(torch.load(bare_optim, weights_only=True)["optimizer"])

        saves = time_interleaved({"bare": bare_save, "fsync": durable_save,
                                  "ckpt": lambda: C.save(d, 1, net, opt, {"bench": True})}, reps)
        loads = time_interleaved({"bare": bare_load, "ckpt": lambda: C.load(d, 1, net, opt)}, reps)
        size = sum(os.path.getsize(os.path.join(d, n)) for n in C._names(1)[:2])

    rows = []
    for what, t in (("save", saves), ("load", loads)):
        fsync = [f"{t['fsync']:.2f}", f"{t['ckpt'] / t['fsync']:.2f}x"] if "fsync" in t else ["", ""]
        rows.append([what, f"{t['bare']:.2f}", fsync[0], f"{t['ckpt']:.2f}", f"{t['ckpt'] / t['bare']:.2f}x", fsync[1],
                     f"{size / t['bare'] / 1e9:.2f}", f"{size / t['ckpt'] / 1e9:.2f}"])
    cols = ["", "bare s", "bare + fsync s", "ckpt s", "ckpt / bare", "ckpt / (bare + fsync)", "bare GB/s", "ckpt GB/s"]
    what = f"{model} preset" if model else "Linear stack"
    print_table(f"checkpoint of {n_params / 1e6:.0f}M params ({what}) + AdamW state: {size / 1e9:.2f} GB, "
                f"medians of {reps}", cols, rows)
    console.print("save target: ckpt / bare <= 1.30x (ckpt.save includes sha256, fsync, renames; bare does neither; "
                  "bare + fsync is the floor of any save that survives a crash, set by the disk)")
    console.print(f"machine: {machine()}, checkpoint dir on {workdir or tempfile.gettempdir()}")


# -----------------------------------------------------------------------------
# bench.py train


@command("train")
def train_step(
    model: Optional[List[Preset]] = typer.Option(None, help="A preset to time; repeat for several (default: tiny "
                                                 "and small on a CPU, every preset on a GPU)."),
    steps: int = typer.Option(5, min=1, help="Timed optimizer steps per preset."),
    warmup: int = typer.Option(2, min=0, help="Untimed steps first (allocation, torch.compile)."),
    device: Device = typer.Option("auto", help="auto picks cuda when torch sees a GPU."),
    dtype: Literal["auto", "bf16", "fp32"] = typer.Option("auto", help="auto: as train.py, bf16 autocast where "
                                                          "the device has bf16 arithmetic."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the model (default: "
                                           "on for CUDA, off for CPU)."),
):
    """Tokens/s, ms/step and MFU of training steps per preset.

    One micro batch of the preset's recipe per step, AdamW, the autocast train.py would use; warm-up and
    compilation are not timed. A preset that runs out of memory is reported as not fitting."""
    import train as trainer

    dev = resolve_device(device)
    dtype = ("bf16" if bf16_native(dev) else "fp32") if dtype == "auto" else dtype
    compile_ = dev == "cuda" if compile is None else compile
    names = [m.value for m in model] if model else (list(PRESETS) if dev == "cuda" else ["tiny", "small"])
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype == "bf16")
    gpu_name = torch.cuda.get_device_name() if dev == "cuda" else ""
    peak = peak_flops(gpu_name)
    rows = []
    for name in names:
        recipe = trainer.RECIPES[name]
        B, L = recipe["batch_size"], recipe["seq_len"]
        vocab = 257 if name in ("tiny", "small") else 50257  # the byte-level demo corpus vs GPT-2 BPE
        torch.manual_seed(0)
        try:
            lm = Mamba3LM(dataclasses.replace(PRESETS[name], vocab_size=vocab)).to(dev)
            opt = torch.optim.AdamW(lm.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), fused=dev == "cuda")
            fwd = torch.compile(lm) if compile_ else lm
            tokens = torch.randint(0, vocab, (B, L + 1), device=dev)

            def step():
                loss = trainer.micro_step(fwd, tokens[:, :-1], tokens[:, 1:], autocast)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(warmup):
                step()
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            dt = (time.perf_counter() - t0) / steps
            n_params, flops = lm.num_params(), lm.flops_per_token(L)
        except torch.cuda.OutOfMemoryError:
            rows.append([name, f"{B}x{L}", "does not fit", "", "", ""])
            continue
        finally:
            lm = opt = fwd = None
            if dev == "cuda":
                torch.cuda.empty_cache()
        tok_s = B * L / dt
        mfu = f"{flops * tok_s / peak:.1%}" if peak else "-"
        rows.append([name, f"{B}x{L}", f"{tok_s:,.0f}", f"{dt * 1e3:.0f}", f"{n_params / 1e6:.1f}M", mfu])
    print_table(f"training step on {dev} ({dtype}, compile {'on' if compile_ else 'off'})",
                ["preset", "batch x seq", "tokens/s", "ms/step", "params", "MFU"], rows)
    console.print(f"machine: {machine()}")


# -----------------------------------------------------------------------------
# the official Mamba-3 layer (state-spaces/mamba), for comparison: compile and traffic --official

def _check_official(official: Optional[Path]):
    if official and not (official / "mamba_ssm" / "ops" / "triton" / "mamba3").is_dir():
        fail(f"--official {official} is not a checkout of state-spaces/mamba with Mamba-3 (it has no "
             "mamba_ssm/ops/triton/mamba3)")


def official_package(src):
    """The mamba_ssm package of a state-spaces/mamba checkout at src, as a module whose submodules import without
    running its __init__ (which imports transformers, for generation)."""
    import types

    package = types.ModuleType("mamba_ssm")
    package.__path__ = [str(Path(src) / "mamba_ssm")]
    return package


def official_layer(Mamba3, cfg, **kwargs):
    # the official layer with cfg's widths (its defaults, expand 2 and half the state dims turned, are ours)
    return Mamba3(d_model=cfg.d_model, d_state=cfg.d_state, headdim=cfg.headdim, ngroups=cfg.ngroups,
                  chunk_size=cfg.chunk_size, **kwargs)

@contextlib.contextmanager
def official_mamba3(src: Path):
    """state-spaces/mamba's Mamba3 layer class from a checkout at src, made to run on CPU tensors through Triton's
    interpreter so that its bytes count as ours do. Its package is imported without its __init__ (which imports
    transformers); what it asks of a CUDA device is answered for an H100 (compute capability 9.0, 132 SMs, by
    which its RMS norm's backward splits its rows); its cos, sin and tanh approximations (PTX inline assembly,
    which the interpreter cannot run) become Triton's functions, the same bytes; autotuning runs the first config
    (the configs differ in warps, stages, register caps and, in two elementwise kernels, tile length: the same
    bytes); its checks that tensors are on CUDA pass. All of it is undone on exit."""
    import types
    from unittest import mock

    import triton.language as tl
    from triton.runtime.autotuner import Autotuner

    import kernels as K

    # (plain functions: the interpreter runs a kernel as Python, with triton.language's functions on numpy)
    standins = {"cos_approx": lambda x: tl.cos(x), "sin_approx": lambda x: tl.sin(x), "tanh_approx": K._tanh,
                "sech2_approx": lambda x: 1.0 - K._tanh(x) * K._tanh(x),
                "_alloc_fn": lambda size, alignment, stream: torch.empty(size, dtype=torch.int8),  # TMA scratch
                "_triton_alloc_fn": lambda size, alignment, stream: torch.empty(size, dtype=torch.int8)}
    device, prune = torch.cuda.device, Autotuner.prune_configs
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, {"mamba_ssm": official_package(src)}))
        for target, name, value in (
                (torch.cuda, "device", lambda index: contextlib.nullcontext() if index is None else device(index)),
                (torch.cuda, "get_device_capability", lambda *args: (9, 0)),
                (torch.cuda, "get_device_properties", lambda *args: types.SimpleNamespace(multi_processor_count=132)),
                (torch.Tensor, "is_cuda", property(lambda self: True)),
                (Autotuner, "prune_configs", lambda self, kwargs: prune(self, kwargs)[:1])):
            stack.enter_context(mock.patch.object(target, name, value))
        try:
            from mamba_ssm.modules.mamba3 import Mamba3
        except ImportError as e:
            fail(f"--official: the Mamba-3 layer in {src} does not import here ({e}); install what it needs")
        for module in [m for name, m in sys.modules.items() if name.startswith("mamba_ssm.ops.triton.mamba3.")]:
            for name in standins.keys() & vars(module).keys():
                stack.enter_context(mock.patch.object(module, name, standins[name]))
        yield Mamba3


# -----------------------------------------------------------------------------
# bench.py compile
#
# What a GPU's compiler makes of the Triton kernels, without a GPU. First, one mixer layer runs forward and
# backward on CPU tensors through Triton's interpreter, and every kernel launch is recorded the way the JIT
# sees it: the kernel, its arguments (tensors by dtype and 16-byte alignment, numbers by value: the JIT
# specializes on both) and the launch keywords (constexprs, num_warps, num_stages). Nothing here names a
# kernel: whatever the layer launches is what gets compiled. Then, in a process where Triton is not
# interpreted, each launch goes to its kernel's own JITFunction.warmup for a GPU target that is not here, so
# Triton specializes and compiles it (through ptxas to a cubin) exactly as that launch on that GPU would.

ARCHS = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90, "sm_100": 100, "sm_120": 120}
Arch = enum.Enum("Arch", {name: name for name in ARCHS}, type=str)


def layer_config(heads: int):
    """The 440m preset's mixer with `heads` heads (d_model follows); P, N, C, the groups and angles unchanged.
    The in_proj row, every kernel's token stride, is a multiple of 16 elements exactly when heads is, as at 440m's
    32 heads: the JIT specializes on that divisibility, so 16 or 32 heads compile the same code."""
    cfg = PRESETS["440m"]
    return dataclasses.replace(cfg, d_model=heads * cfg.headdim // cfg.expand)


@contextlib.contextmanager
def scan_impl(impl: str):
    """Select the scan's path inside, through MAMBA3_IMPL (it overrides impl="auto", the model's default)."""
    previous = os.environ.get("MAMBA3_IMPL")
    os.environ["MAMBA3_IMPL"] = impl
    try:
        yield
    finally:
        if previous is None:
            del os.environ["MAMBA3_IMPL"]
        else:
            os.environ["MAMBA3_IMPL"] = previous


def _describe(value, where: str):
    """A launch argument as the JIT's specializer sees it, in JSON terms."""
    import triton.language as tl

    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, TensorDescriptor):  # a TMA descriptor: its base's dtype and its block matter to the JIT
        return {"descriptor": str(value.base.dtype).removeprefix("torch."), "shape": list(value.shape),
                "strides": list(value.strides), "block_shape": list(value.block_shape)}
    if isinstance(value, tl.dtype):
        return {"tl": str(value)}
    if isinstance(value, tl.constexpr):
        value = value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which bench.py compile cannot describe to the compiler")


@contextlib.contextmanager
def recording_launches():
    """Inside, every launch of every @triton.jit kernel run by Triton's interpreter is recorded (and still runs):
    yields the list of distinct launches, each the kernel's module and qualified name, its args and kwargs
    described by _describe. Needs a process whose Triton is interpreted (TRITON_INTERPRET=1 before triton is
    imported)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("recording Triton launches needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                           "triton is imported (bench.py compile runs its capture in a subprocess that does)")
    launches, seen = [], set()
    launch = InterpretedFunction.run

    def record(kernel, *args, grid, warmup, **kwargs):  # kernel[grid](...) and autotuners all end up here
        name = kernel.fn.__qualname__
        described = {"module": kernel.fn.__module__, "name": name,
                     "args": [_describe(a, f"{name} argument {i}") for i, a in enumerate(args)],
                     "kwargs": {k: _describe(v, f"{name} argument {k}") for k, v in kwargs.items()}}
        key = json.dumps(described, sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(described)
        return launch(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = record
    try:
        yield launches
    finally:
        InterpretedFunction.run = launch


def capture_launches(batch_size: int = 1, seq_len: int = 128, heads: int = 32, dtype: str = "bf16") -> list:
    """Every distinct Triton kernel launch of one mixer layer (layer_config(heads)), forward and backward, with
    the Triton path selected, under autocast to dtype (none for fp32) as train.py runs it; see
    recording_launches."""
    torch.manual_seed(0)
    cfg = layer_config(heads)
    mixer = Mamba3Mixer(cfg)
    u = torch.randn(batch_size, seq_len, cfg.d_model, requires_grad=True)
    with recording_launches() as launches, scan_impl("triton"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU autocast's notes on mixed-dtype rms_norm
        with torch.autocast("cpu", dtype=TORCH_DTYPE[dtype], enabled=dtype != "fp32"):
            y = mixer(u)
        y.backward(torch.randn_like(y))
    return launches


def capture_official_launches(src: str, batch_size: int = 1, seq_len: int = 128, heads: int = 32,
                              dtype: str = "bf16") -> list:
    """capture_launches for the official Mamba-3 SISO layer at src (official_mamba3) with layer_config(heads)'s
    widths, its region alone. An autotuned kernel is launched once per config of its autotuner that has
    num_stages 1 (warps and register caps; on a GPU the autotuner picks by speed): compile_launches compiles
    each, and the compile table shows the one that spills least."""
    import importlib

    cfg = layer_config(heads)
    with official_mamba3(Path(src)) as Mamba3, recording_launches() as launches:
        torch.manual_seed(0)
        theirs = official_layer(Mamba3, cfg)
        zx = torch.randn(batch_size, seq_len, theirs.in_proj.out_features, dtype=TORCH_DTYPE[dtype],
                         requires_grad=True)
        theirs.in_proj, theirs.out_proj = torch.nn.Identity(), torch.nn.Identity()
        y = theirs(zx)
        torch.autograd.grad(y, [zx, *theirs.parameters()], torch.randn_like(y))
        tuners = {(l["module"], l["name"]): getattr(importlib.import_module(l["module"]), l["name"]) for l in launches}
    expanded = []
    for launch in launches:
        configs = [c for c in getattr(tuners[launch["module"], launch["name"]], "configs", []) if c.num_stages == 1]
        for config in configs or [None]:
            kwargs = dict(launch["kwargs"])
            if config is not None:  # this config's warps, cap and tile in place of the first config's
                kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "maxnreg")}
                kwargs.update({k: v for k, v in config.all_kwargs().items() if v is not None})
            expanded.append(dict(launch, kwargs=kwargs))
    return expanded


class _OfflineGPU:
    """What JITFunction.warmup asks of Triton's active driver, answered for a GPU that is not here."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch  # the JIT keeps one kernel cache per device: one per target here

    def get_current_stream(self, device):
        return 0


def _stand_in(value):
    """A described argument back as something the JIT's specializer takes: a MockTensor at an address that is
    16-byte aligned or not, a tl dtype, or the number itself."""
    import triton.language as tl
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


def _jit_function(module: str, name: str):
    """The JITFunction behind a kernel's module and qualified name (through @triton.autotune / heuristics)."""
    import importlib

    from triton.runtime.jit import JITFunction

    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _ptxas_figures(log: str) -> dict:
    """Registers and spill bytes from ptxas -v's report on one kernel."""
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not (registers and spills):
        raise RuntimeError(f"no ptxas -v report to read registers and spills from (got {log[:200]!r})")
    return dict(registers=int(registers.group(1)), spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)))


def compile_launches(launches: list, archs: list, official: Optional[str] = None) -> list:
    """Compile each launch (capture_launches' output) for each compute capability in archs (80 is sm_80) and
    report per distinct binary: registers and spill bytes as ptxas -v reported them while Triton built the
    cubin, shared memory from the kernel's metadata, whether its Triton IR has a tl.dot and whether its SASS
    has wgmma instructions (HGMMA). Needs a process whose Triton is not interpreted, and leaves Triton's active
    driver answering for the last target: run it in a process of its own (run_isolated). No GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget

    import kernels as K

    if triton.knobs.runtime.interpret:
        raise RuntimeError("compile_launches needs Triton not interpreted: run it with TRITON_INTERPRET=0")
    if official:  # the official kernels' modules, importable here
        sys.modules.setdefault("mamba_ssm", official_package(official))
    rows, seen = [], set()
    with triton.knobs.compilation.scope(), triton.knobs.nvidia.scope():
        triton.knobs.compilation.always_compile = True  # no cache: ptxas runs, and logs, for every binary
        triton.knobs.nvidia.dump_ptxas_log = True
        for arch in archs:
            triton.runtime.driver.set_active(_OfflineGPU(GPUTarget("cuda", arch, 32)))
            for i, launch in enumerate(launches):
                row = {"launch": i, "arch": arch, "kernel": launch["name"],
                       "constexprs": {k: v for k, v in launch["kwargs"].items() if k not in ("num_warps", "num_stages")}}
                try:
                    fn = _jit_function(launch["module"], launch["name"])
                    args = [_stand_in(a) for a in launch["args"]]
                    kwargs = {k: _stand_in(v) for k, v in launch["kwargs"].items()}
                    if launch["name"] == "_mixer_bwd":  # what kernels.py adds on a GPU of this arch, shown in its row
                        options = K._bwd_options(arch // 10)
                        kwargs, row["constexprs"] = kwargs | options, row["constexprs"] | options
                    with contextlib.redirect_stdout(io.StringIO()) as log:
                        kernel = fn.warmup(*args, grid=(1,), **kwargs)
                    if (arch, kernel.hash) in seen:  # the same specialization launched again: the same binary
                        continue
                    seen.add((arch, kernel.hash))
                    rows.append(dict(row, hash=kernel.hash, **_ptxas_figures(log.getvalue()),
                                     shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                                     num_stages=kernel.metadata.num_stages, dot="tt.dot" in kernel.asm["ttir"],
                                     wgmma=kernel.asm["sass"].count("HGMMA")))
                except Exception as e:  # a kernel that does not compile is a finding, reported in its row
                    rows.append(dict(row, error=f"{type(e).__name__}: {e}".strip()))
    return rows


def run_isolated(function: str, interpret: bool, timeout: Optional[float] = None, **kwargs):
    """bench.<function>(**kwargs) in a fresh Python whose Triton is interpreted or not (the choice is made when
    triton is first imported, so it takes a process of its own); arguments and result travel as JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    code = ("import contextlib, json, sys, bench\n"
            "request = json.load(sys.stdin)\n"
            "with contextlib.redirect_stdout(sys.stderr):  # only the result goes to stdout\n"
            "    result = getattr(bench, request['function'])(**request['kwargs'])\n"
            "json.dump(result, sys.stdout)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          input=json.dumps({"function": function, "kwargs": kwargs}), timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"bench.{function} failed in its subprocess:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def compile_table(rows: list) -> list:
    """compile_launches' rows as table rows, sorted by launch order then architecture. Each row also gets a
    "label" for the summary: the kernel's name, plus the constexprs that tell its launches apart if it has several."""
    show = lambda v: v["tl"] if isinstance(v, dict) else v  # noqa: E731  (a tl dtype by its name)
    rows.sort(key=lambda r: (r["launch"], r["arch"]))
    table = []
    for r in rows:
        others = [o["constexprs"] for o in rows if o["kernel"] == r["kernel"]]
        r["label"] = " ".join([r["kernel"]] + [f"{k}={show(v)}" for k, v in r["constexprs"].items()
                                               if any(o.get(k) != v for o in others)])
        constexprs = " ".join(f"{k}={show(v)}" for k, v in r["constexprs"].items())
        if "error" in r:
            table.append([r["kernel"], constexprs, f"sm_{r['arch']}", "[red]failed[/red]", r["error"].splitlines()[0],
                          "", "", ""])
            continue
        spills = f"{r['spill_stores']} / {r['spill_loads']}"
        wgmma = "-" if r["arch"] != 90 or not r["dot"] else f"yes ({r['wgmma']} HGMMA)" if r["wgmma"] else "[red]no[/red]"
        table.append([r["kernel"], constexprs, f"sm_{r['arch']}", f"{r['num_warps']} / {r['num_stages']}",
                      r["registers"], spills if spills == "0 / 0" else f"[red]{spills}[/red]",
                      f"{r['shared'] / 1024:.1f}", wgmma])
    return table


@command("compile")
def compile_(
    arch: List[Arch] = typer.Option(["sm_80", "sm_90"], help="GPU architecture to compile for; repeat for several."),
    batch_size: int = typer.Option(1, min=1, help="B of the layer run that captures the launches."),
    seq_len: int = typer.Option(128, min=1, help="L of that run (any multiple of 1024 gives exactly the binaries of "
                                "L 2048, at eight times the capture time or more)."),
    heads: int = typer.Option(32, min=1, help="H of that run (the 440m layer has 32; P, N and C are always 440m's)."),
    dtype: DType = typer.Option("bf16", help="Autocast dtype of that run, as train.py --dtype (fp32: none)."),
    official: Optional[Path] = typer.Option(None, exists=True, file_okay=False, help="A checkout of "
                                            "state-spaces/mamba: its Mamba-3 SISO layer's kernels are compiled too."),
):
    """Every Triton kernel a Mamba-3 layer launches, compiled for sm_80 / sm_90 on this machine: no GPU needed.

    One mixer layer with the 440m layer's widths (P 64, N 128, chunk 64) runs forward and backward through
    Triton's interpreter on CPU tensors, which records every kernel launch; each is then compiled with Triton's
    own compiler for each --arch exactly as launched. Reports registers, spill bytes, shared memory and, on
    sm_90, whether the code uses wgmma. Targets: [bold]no spills on any architecture, wgmma on sm_90[/bold].
    With --official, the official layer's kernels at the same widths, each in every config its autotuner has
    with num_stages 1, the one that spills least shown."""
    import triton

    if "nvidia" not in triton.backends.backends:
        fail(f"this Triton build ({triton.__version__}) has no NVIDIA backend to compile with")
    _check_official(official)
    t0 = time.perf_counter()
    launches = run_isolated("capture_launches", True, batch_size=batch_size, seq_len=seq_len, heads=heads,
                            dtype=dtype)
    t1 = time.perf_counter()
    rows = run_isolated("compile_launches", False, launches=launches, archs=[ARCHS[a.value] for a in arch])
    t2 = time.perf_counter()
    cfg = layer_config(heads)
    print_table(f"Triton kernels of one mixer layer (P{cfg.headdim} N{cfg.d_state} C{cfg.chunk_size}, {dtype}; "
                f"launches captured at B{batch_size} L{seq_len} H{heads}), compiled offline",
                ["kernel", "constexprs", "arch", "warps / stages", "registers", "spill st / ld bytes", "shared KiB",
                 "wgmma"], compile_table(rows))
    failed = [r for r in rows if "error" in r]
    spilled = [f"{r['label']} on sm_{r['arch']}" for r in rows if r.get("spill_stores") or r.get("spill_loads")]
    dots90 = [r for r in rows if r["arch"] == 90 and r.get("dot")]
    no_wgmma = [r["label"] for r in dots90 if not r["wgmma"]]
    console.print(f"{len(launches)} distinct launches captured in {t1 - t0:.0f} s, compiled in {t2 - t1:.0f} s")
    console.print("target, no spills on any architecture: " + (f"NOT met ({', '.join(spilled)})" if spilled else "met"))
    if dots90:
        used = len(dots90) - len(no_wgmma)
        console.print("target, wgmma on sm_90: " + (f"NOT met, no HGMMA in {', '.join(no_wgmma)} ({used} of "
                                                     f"{len(dots90)} kernels with a tl.dot use it)" if no_wgmma else "met"))
    console.print("registers and spill bytes: ptxas -v as Triton ran it for each cubin; shared memory: the compiled "
                  "kernel's metadata; wgmma: HGMMA instructions in the cubin's SASS (cuobjdump)")
    if official:
        launches = run_isolated("capture_official_launches", True, src=str(official), batch_size=batch_size,
                                seq_len=seq_len, heads=heads, dtype=dtype)
        theirs = run_isolated("compile_launches", False, launches=launches, archs=[ARCHS[a.value] for a in arch],
                              official=str(official))
        failed += [r for r in theirs if "error" in r]
        best = {}
        for r in (r for r in theirs if "error" not in r):  # per kernel and arch, the config that spills least
            key = r["kernel"], r["arch"]
            if key not in best or r["spill_stores"] < best[key]["spill_stores"]:
                best[key] = dict(r, configs=best.get(key, {}).get("configs", 0))
            best[key]["configs"] += 1
        print_table("the official Mamba-3 SISO layer's kernels at the same widths: per kernel, the config with the "
                    "fewest spill bytes", ["kernel", "arch", "configs", "warps", "maxnreg", "registers",
                                           "spill st / ld bytes", "wgmma"],
                    [[k, f"sm_{a}", r["configs"], r["num_warps"], r["constexprs"].get("maxnreg", "-"), r["registers"],
                      f"{r['spill_stores']} / {r['spill_loads']}", f"yes ({r['wgmma']} HGMMA)" if r["wgmma"] else "-"]
                     for (k, a), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0]))])
    console.print(f"machine: {machine()}, triton {triton.__version__}, no GPU used")
    if failed:
        raise typer.Exit(1)


# -----------------------------------------------------------------------------
# bench.py gpu

# Max relative error (max |a - ref| / max |ref| over a tensor) a bf16 run may show, for the layer's output and
# for every gradient; bf16 keeps 8 bits of mantissa (a relative 4e-3 per rounding) and a layer rounds many times.
GPU_TOLERANCE = {"y": 3e-2, "gradients": 5e-2}


def rel_err(a, ref) -> float:
    err, scale = (a.double() - ref.double()).abs().max().item(), ref.double().abs().max().item()
    return err / scale if scale > 0 else err


def region_bytes(cfg, batch_size: int, seq_len: int, act_bytes: int = 2) -> dict:
    """The compulsory HBM traffic of the layer's region from the in_proj output to the gated output that goes
    into out_proj (the scan and everything around it), counted from the shapes: forward reads each input once
    (z, x, B, C, dd_dt, dd_A, trap, angle: the in_proj row) and writes the output once; backward reads the
    saved input and the output's gradient once and writes the input's gradient once. Activations are act_bytes
    per element; the region's parameters (dt_bias, the B/C norm weights and biases, D) are fp32, read once per
    pass, their gradients written once. in_proj and out_proj are not in it: their traffic is the matmuls'."""
    T = batch_size * seq_len
    H, N, G = cfg.n_heads, cfg.d_state, cfg.ngroups
    row = 2 * cfg.d_inner + 2 * G * N + 3 * H + cfg.n_angles  # z | x | B | C | dd_dt | dd_A | trap | angle
    inputs, output = T * row * act_bytes, T * cfg.d_inner * act_bytes
    params = 4 * (H + 2 * N + 2 * H * N + H)  # dt_bias, B/C norm weights, B/C biases, D
    return {"forward": inputs + output + params, "backward": 2 * inputs + output + 2 * params}


def layer_outputs(mixer, u, dy, impl: str, dtype: str) -> dict:
    """The layer's output y and the gradients of its input u and of every parameter after one forward and
    backward on the given scan path, under autocast to dtype (fp32: none), all as fp32 tensors by name."""
    mixer.zero_grad(set_to_none=True)
    u = u.detach().requires_grad_()
    with scan_impl(impl):
        with torch.autocast(u.device.type, dtype=TORCH_DTYPE[dtype], enabled=dtype != "fp32"):
            y = mixer(u)
        y.backward(dy)
    return {"y": y.detach().float(), "u": u.grad.float()} | {n: p.grad.float() for n, p in mixer.named_parameters()}


def check_layer(mixer, u, dy) -> list:
    """Triton vs torch path in bf16, each against a fp32 torch reference: rows of (tensor, shape, torch bf16 vs
    fp32, triton vs fp32, triton vs torch bf16, tolerance, passed)."""
    ref = layer_outputs(mixer, u, dy, "torch", "fp32")
    torch_bf16 = layer_outputs(mixer, u, dy, "torch", "bf16")
    triton_bf16 = layer_outputs(mixer, u, dy, "triton", "bf16")
    rows = []
    for name, r in ref.items():
        a, b = torch_bf16[name], triton_bf16[name]
        tol = GPU_TOLERANCE["y" if name == "y" else "gradients"]
        errors = rel_err(a, r), rel_err(b, r), rel_err(b, a)
        passed = bool(torch.isfinite(b).all()) and errors[1] <= tol and errors[2] <= tol
        rows.append((name, tuple(r.shape), *errors, tol, passed))
    return rows


def time_layer(mixer, u, dy, reps: int, official=None) -> dict:
    """Median seconds of one forward + backward of the layer under bf16 autocast on each scan path (and of the
    official layer of the same widths, if given), and of its two projections alone (in_proj and out_proj on inputs
    of the same shapes) to subtract."""
    autocast = torch.autocast(u.device.type, dtype=torch.bfloat16)
    u = u.detach().requires_grad_()
    g = torch.randn(*u.shape[:2], mixer.cfg.d_inner, device=u.device, requires_grad=True)  # an out_proj input
    da = torch.ones(*u.shape[:2], mixer.in_proj.out_features, device=u.device, dtype=torch.bfloat16)
    dout = torch.ones(*u.shape, device=u.device, dtype=torch.bfloat16)

    def layer(impl):
        def run():
            mixer.zero_grad(set_to_none=True)
            u.grad = None
            with scan_impl(impl):
                with autocast:
                    y = mixer(u)
                y.backward(dy)
        return run

    def projections():
        mixer.zero_grad(set_to_none=True)
        u.grad = g.grad = None
        with autocast:
            a, out = mixer.in_proj(u), mixer.out_proj(g)
        torch.autograd.backward([a, out], [da, dout])

    def theirs():
        official.zero_grad(set_to_none=True)
        u.grad = None
        with autocast:
            y = official(u)
        y.backward(dy)

    contenders = {"torch": layer("torch"), "triton": layer("triton"), "projections": projections}
    return time_interleaved(contenders | ({"official": theirs} if official is not None else {}), reps, warmup=2)


def train_throughput(compile_: bool, steps: int, total_batch_size: int, timeout: float) -> dict:
    """`python train.py --data synthetic --model 440m` for a few steps in a subprocess, exactly as a user runs
    it; returns its last metrics.jsonl training record (tok_per_s, mfu, ms_per_step over the last log window,
    so after compilation and warm-up)."""
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as out:
        cmd = [sys.executable, "train.py", "--data", "synthetic", "--model", "440m", "--max-steps", str(steps),
               "--total-batch-size", str(total_batch_size), "--log-every", str(max(1, steps // 3)), "--out-dir", out,
               "--resume", "never", "--keep-last", "1", "--compile" if compile_ else "--no-compile"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no wandb run for a benchmark
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd[1:])} exited with {done.returncode}:\n{done.stderr[-2000:]}")
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "train"][-1]


@command()
def gpu(
    batch_size: int = typer.Option(8, min=1, help="B of the layer checked and timed (the 440m recipe's micro batch)."),
    seq_len: int = typer.Option(2048, min=1, help="L of the layer checked and timed."),
    reps: int = typer.Option(20, min=1, help="Interleaved repetitions of the layer timings."),
    train_steps: int = typer.Option(30, min=0, help="Training steps per run of train.py; 0 skips the training runs."),
    total_batch_size: int = typer.Option(16384, min=1, help="Tokens per optimizer step of those runs (default: one "
                                         "micro batch, 8 x 2048, so that 30 steps fit the time; the preset's 524,288 "
                                         "would take 32 micro-steps a step)."),
    official: Optional[Path] = typer.Option(None, exists=True, file_okay=False, help="A checkout of "
                                            "state-spaces/mamba: its Mamba-3 SISO layer is timed too."),
):
    """On a CUDA GPU: the Triton path's accuracy and speed on a 440m layer, then train.py's tokens/s and MFU.

    Sized to finish within ten minutes. (1) One mixer layer of the 440m model (H 32, P 64, N 128, chunk 64) in bf16
    autocast on the Triton and on the torch path: the output and every gradient (input and parameters) against a
    fp32 torch reference and against each other, with tolerances. (2) Forward + backward time of that layer on
    both paths, and of the scan region alone (the layer minus its two projections) as a fraction of the HBM
    roofline of its compulsory bytes, counted from the shapes. (3) train.py on synthetic data with the 440m
    preset, torch.compile on and off: tokens/s and MFU. With --official, (2) also times the official Mamba-3 layer
    of the same widths on its own kernels."""
    if not torch.cuda.is_available():
        fail("bench.py gpu needs a CUDA GPU and torch sees none here; without one, bench.py compile shows what a "
             "GPU's compiler makes of the kernels")
    _check_official(official)
    import triton

    torch.set_float32_matmul_precision("highest")  # the fp32 reference in true fp32, no TF32
    torch.manual_seed(0)
    cfg = layer_config(32)
    B, L = batch_size, seq_len
    mixer = Mamba3Mixer(cfg).cuda()
    u = torch.randn(B, L, cfg.d_model, device="cuda")
    dy = torch.randn(B, L, cfg.d_model, device="cuda")
    shape = f"B{B} L{L} H{cfg.n_heads} P{cfg.headdim} N{cfg.d_state} C{cfg.chunk_size}"

    rows = check_layer(mixer, u, dy)
    print_table(f"one 440m mixer layer, {shape}, bf16 autocast: max |a - ref| / max |ref| per tensor",
                ["tensor", "shape", "torch bf16 vs fp32", "triton bf16 vs fp32", "triton vs torch bf16", "tolerance",
                 ""], [[name, "x".join(map(str, s)), f"{e0:.1e}", f"{e1:.1e}", f"{e2:.1e}", f"{tol:.0e}",
                        "pass" if ok else "[red]FAIL[/red]"] for name, s, e0, e1, e2, tol, ok in rows])

    theirs = None
    if official:  # the official layer of the same widths, as its users run it (its own kernels, on this GPU)
        sys.modules.setdefault("mamba_ssm", official_package(official))
        try:
            from mamba_ssm.modules.mamba3 import Mamba3

            theirs = official_layer(Mamba3, cfg, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):  # once, to see that it runs
                y = theirs(u)
            y.backward(dy)
        except Exception as e:  # a contender that does not run is a finding: shown, then the rest
            console.print(f"the official layer in {official} did not run here: {type(e).__name__}: {e}",
                          markup=False, highlight=False)
            theirs = None
    t = time_layer(mixer, u, dy, reps, theirs)
    moved = sum(region_bytes(cfg, B, L).values())
    bw = hbm_bandwidth()
    table = []
    for path in ("torch", "triton") + (("official",) if theirs is not None else ()):
        region = t[path] - t["projections"]
        roofline = f"{moved / bw / region:.0%}" if bw and region > 0 else "-"
        table.append([path, f"{t[path] * 1e3:.2f}", f"{region * 1e3:.2f}", f"{t['torch'] / t[path]:.2f}x", roofline])
    print_table(f"one layer forward + backward, {shape}, bf16 autocast, medians of {reps}",
                ["scan path", "layer ms", "region ms (layer - projections)", "layer speed-up vs torch",
                 "region of HBM roofline"], table)
    if theirs is not None:
        console.print(f"the Triton path's layer takes {t['triton'] / t['official']:.2f}x the official layer's time")
    console.print(f"projections alone: {t['projections'] * 1e3:.2f} ms; region's compulsory traffic {moved / 1e6:,.0f} MB "
                  f"(counted from the shapes, forward + backward)" + (f" at {bw / 1e12:.2f} TB/s = "
                  f"{moved / bw * 1e3:.3f} ms" if bw else f"; no HBM bandwidth known for {torch.cuda.get_device_name()}"))
    del mixer, u, dy
    torch.cuda.empty_cache()

    if train_steps:
        table, errors = [], []
        for compile_ in (True, False):
            try:
                r = train_throughput(compile_, train_steps, total_batch_size, timeout=240)
                mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
                table.append(["on" if compile_ else "off", f"{r['tok_per_s']:,.0f}", f"{r['ms_per_step']:.0f}", mfu])
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # a failed run is a finding: shown, then the rest
                table.append(["on" if compile_ else "off", "[red]failed[/red]", "", ""])
                errors.append(str(e))
        print_table(f"python train.py --data synthetic --model 440m --max-steps {train_steps} --total-batch-size "
                    f"{total_batch_size}: the last log window", ["torch.compile", "tokens/s", "ms/step", "MFU"], table)
        for e in errors:
            console.print(e, markup=False, highlight=False)
    console.print(f"machine: {machine()}, triton {triton.__version__}")
    if not all(ok for *_, ok in rows):
        raise typer.Exit(1)


# -----------------------------------------------------------------------------
# bench.py traffic


class _Traffic:
    """Bytes moved, by who moved them. Triton kernels count through the interpreter: every element a load or
    store actually touches (masked-off lanes are not counted; a descriptor copies its whole in-bounds block).
    Eager aten ops count the bytes of their tensor inputs and outputs (a view moves nothing, nor does a .to
    that returns its input; an allocation writes nothing; copy_/fill_/zero_ only write their destination)."""

    def __init__(self):
        import collections

        self.bytes, self.calls = collections.Counter(), collections.Counter()
        self.kernel = None

    def triton_bytes(self, n_elements, dtype):
        if self.kernel is not None:
            self.bytes["triton " + self.kernel] += int(n_elements) * dtype.primitive_bitwidth // 8


def _hook_interpreter(counter):
    """Patch Triton's interpreter so that kernel launches report to counter; returns a function that undoes it."""
    import numpy as np
    import triton.runtime.interpreter as I
    from torch.utils._python_dispatch import _disable_current_modes

    # (a descriptor's block load or store is a masked load or store of its in-bounds elements in the interpreter)
    saved = {name: getattr(cls, name) for cls, name in ((I.InterpreterBuilder, "create_masked_load"),
                                                         (I.InterpreterBuilder, "create_masked_store"),
                                                         (I.InterpretedFunction, "run"))}

    def touched(ptrs, mask):
        return np.broadcast_to(mask.data, ptrs.data.shape).sum()

    def load(self, ptrs, mask, *args, **kwargs):
        counter.triton_bytes(touched(ptrs, mask), ptrs.get_element_ty())
        return saved["create_masked_load"](self, ptrs, mask, *args, **kwargs)

    def store(self, ptrs, value, mask, *args, **kwargs):
        counter.triton_bytes(touched(ptrs, mask), ptrs.get_element_ty())
        return saved["create_masked_store"](self, ptrs, value, mask, *args, **kwargs)

    def run(self, *args, **kwargs):
        counter.kernel = self.fn.__name__
        counter.calls["triton " + self.fn.__name__] += 1
        try:
            with _disable_current_modes():  # the interpreter's copies to and from the host are not traffic
                return saved["run"](self, *args, **kwargs)
        finally:
            counter.kernel = None

    I.InterpreterBuilder.create_masked_load, I.InterpreterBuilder.create_masked_store = load, store
    I.InterpretedFunction.run = run

    def undo():
        for name, fn in saved.items():
            setattr(I.InterpretedFunction if name == "run" else I.InterpreterBuilder, name, fn)

    return undo


def _eager_bytes_mode(counter):
    """A TorchDispatchMode that adds every aten op's bytes to counter. The fused region's custom ops run their
    Python implementation inside the mode, so the few eager ops around the launches count too."""
    import kernels as K
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    writes_only = {"copy_", "fill_", "zero_"}
    moves_nothing = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
                     "lift_fresh"}
    custom = {"mixer_fwd": K._mixer_forward, "mixer_bwd": K._mixer_backward}

    def shares_storage(out, args):  # a view, or an op that may alias its input (.to) and did
        storages = {t.untyped_storage().data_ptr() for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
        return all(t.untyped_storage().data_ptr() in storages for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    def nbytes(t):  # a broadcast (stride 0) dimension is one element in memory
        n = t.element_size()
        for size, stride in zip(t.shape, t.stride()):
            n *= size if stride else 1
        return n

    class EagerBytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0]
            if func.namespace == "mamba3":
                with EagerBytes():
                    return custom[name](*args, **kwargs)
            out = func(*args, **kwargs)
            if func.namespace != "aten" or name in moves_nothing or (func.is_view and shares_storage(out, args)):
                return out
            inputs = tree_leaves((args[1:], kwargs) if name in writes_only else (args, kwargs))
            tensors = [t for t in tree_leaves(out) + inputs if isinstance(t, torch.Tensor)]
            counter.bytes["eager " + name] += sum(nbytes(t) for t in tensors)
            counter.calls["eager " + name] += 1
            return out

    return EagerBytes()


def _count(fn):
    """(bytes by kernel or op, calls by kernel or op) that fn() moves."""
    counter = _Traffic()
    undo = _hook_interpreter(counter)
    try:
        with _eager_bytes_mode(counter):
            fn()
    finally:
        undo()
    return counter.bytes, counter.calls


@command()
def traffic(
    batch_size: int = typer.Option(1, min=1, help="B"),
    seq_len: int = typer.Option(256, min=1, help="L"),
    heads: int = typer.Option(4, min=1, help="H"),
    headdim: int = typer.Option(64, min=1, help="P"),
    d_state: int = typer.Option(128, min=2, help="N"),
    ngroups: int = typer.Option(1, min=1, help="G"),
    chunk_size: int = typer.Option(64, min=16, help="C"),
    dtype: DType = typer.Option("bf16", help="in_proj's output dtype."),
    official: Optional[Path] = typer.Option(None, exists=True, file_okay=False, help="A checkout of "
                                            "state-spaces/mamba: its Mamba-3 SISO layer's region is counted too."),
):
    """Bytes one layer's mixer region (in_proj's output -> out_proj's input) moves, forward and backward, counted
    without a GPU: Triton's interpreter counts the kernels' loads and stores, a dispatch mode every eager op's
    inputs and outputs; in_proj and out_proj are left out. Next to the compulsory minimum: each input read once
    (the backward reads them again: they are what it saves), each output written once, what the fused path saves
    besides its inputs (the per-chunk states and phases) written and read once, the incoming gradient read once
    and each gradient written once. Contrast: the eager glue around ssd(impl="triton"), and with --official the
    official Mamba-3 SISO layer (its Triton kernels and eager glue) on the same input, counted the same way."""
    import subprocess
    import sys

    _check_official(official)
    if os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter is chosen when triton is imported: count in a fresh process that has it on
        args = [sys.executable, os.path.abspath(__file__), "traffic", "--batch-size", str(batch_size), "--seq-len", str(seq_len),
                "--heads", str(heads), "--headdim", str(headdim), "--d-state", str(d_state), "--ngroups", str(ngroups),
                "--chunk-size", str(chunk_size), "--dtype", dtype] + (["--official", str(official)] if official else [])
        raise typer.Exit(subprocess.run(args, env={**os.environ, "TRITON_INTERPRET": "1"}).returncode)

    import kernels as K
    from model import Mamba3Mixer, ModelConfig

    if not K.triton_available():
        raise typer.BadParameter("bench.py traffic counts through Triton's interpreter, and Triton does not "
                                 "import here")
    cfg = ModelConfig(d_model=heads * headdim // 2, headdim=headdim, d_state=d_state, ngroups=ngroups,
                      chunk_size=chunk_size, n_layer=1, vocab_size=256)
    torch.manual_seed(0)
    mixer = Mamba3Mixer(cfg)
    mixer.in_proj, mixer.out_proj = torch.nn.Identity(), torch.nn.Identity()  # the region alone
    params = list(mixer.parameters())
    zx = (torch.randn(batch_size, seq_len, sum(mixer.split)) * 0.5).to(TORCH_DTYPE[dtype]).requires_grad_()
    dout = torch.randn(batch_size, seq_len, cfg.d_inner).to(zx.dtype)
    sizes = dict(headdim=headdim, ngroups=ngroups, n_angles=cfg.n_angles, chunk_size=chunk_size, A_floor=cfg.A_floor,
                 eps=cfg.norm_eps)
    paths = {"fused (kernels.mixer_triton)": lambda: K.mixer_triton(zx, *params, **sizes),
             'eager glue + ssd(impl="triton")': lambda: K.mixer_torch(zx, *params, **sizes, impl="triton")[0]}
    counts = {}
    for name, region in paths.items():
        box = {}
        fwd = _count(lambda: box.update(out=region()))
        bwd = _count(lambda: torch.autograd.grad(box["out"], [zx] + params, dout))
        counts[name] = fwd, bwd
    if official:
        with official_mamba3(official) as Mamba3:
            theirs = official_layer(Mamba3, cfg)
            if theirs.num_rope_angles != cfg.n_angles:
                fail(f"the official layer turns {theirs.num_rope_angles} pairs at d_state {d_state}, ours "
                     f"{cfg.n_angles}: not the same computation")
            theirs.in_proj, theirs.out_proj = torch.nn.Identity(), torch.nn.Identity()
            version = re.search(r'__version__ = "(.*)"', (official / "mamba_ssm" / "__init__.py").read_text())
            box = {}
            fwd = _count(lambda: box.update(out=theirs(zx)))
            bwd = _count(lambda: torch.autograd.grad(box["out"], [zx] + list(theirs.parameters()), dout))
            counts[f"official Mamba-3 SISO (mamba_ssm {version.group(1) if version else '?'})"] = fwd, bwd

    # the compulsory minimum, from the tensors themselves
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    _, states, phase = K._mixer_forward(zx.detach(), *(p.detach() for p in params), None, headdim, ngroups,
                                        cfg.n_angles, chunk_size, cfg.A_floor, cfg.norm_eps)
    inputs, saved, out = nbytes(zx, *params), nbytes(states, phase), nbytes(dout)
    minimum = (inputs + out + saved, inputs + saved + nbytes(dout) + inputs)  # the gradients are the inputs' size
    rows = [["compulsory minimum", f"{minimum[0] / 1e6:.3f}", f"{minimum[1] / 1e6:.3f}", f"{sum(minimum) / 1e6:.3f}",
             "1.00x", "", ""]]
    totals = {name: sum(fwd[0].values()) + sum(bwd[0].values()) for name, (fwd, bwd) in counts.items()}
    for name, (fwd, bwd) in counts.items():
        total = totals[name]
        launches = "/".join(str(sum(v for k, v in c[1].items() if k.startswith("triton"))) for c in (fwd, bwd))
        ops = "/".join(str(sum(v for k, v in c[1].items() if k.startswith("eager"))) for c in (fwd, bwd))
        rows.append([name, f"{sum(fwd[0].values()) / 1e6:.3f}", f"{sum(bwd[0].values()) / 1e6:.3f}",
                     f"{total / 1e6:.3f}", f"{total / sum(minimum):.2f}x", launches, ops])
    shape = f"B{batch_size} L{seq_len} H{heads} P{headdim} N{d_state} G{ngroups} S{cfg.n_angles} C{chunk_size} {dtype}"
    print_table(f"mixer region traffic, MB ({shape}; in_proj and out_proj excluded)",
                ["path", "fwd MB", "bwd MB", "total MB", "vs minimum", "launches fwd/bwd", "eager ops fwd/bwd"], rows)
    fwd, bwd = counts["fused (kernels.mixer_triton)"]
    who = sorted(set(fwd[0]) | set(bwd[0]), key=lambda k: -(fwd[0][k] + bwd[0][k]))
    print_table("the fused path, by kernel or op (MB)", ["kernel / op", "fwd", "bwd"],
                [[k, f"{fwd[0][k] / 1e6:.3f}", f"{bwd[0][k] / 1e6:.3f}"] for k in who])
    for name in [name for name in totals if name.startswith("official")]:
        console.print(f"the fused path moves {totals[name] / totals['fused (kernels.mixer_triton)']:.2f}x fewer "
                      f"bytes than the {name}")
    console.print(f"saved for the backward besides the inputs: states {nbytes(states) / 1e6:.3f} MB, "
                  f"phases {nbytes(phase) / 1e6:.3f} MB. machine: {machine()}")


@command("all")
def all_():
    """kernels, data, ckpt and train with their defaults, one after the other (compile and gpu run on their own)."""
    commands = typer.main.get_command(app).commands
    for name in ("kernels", "data", "ckpt", "train"):
        commands[name].callback(**{p.name: p.default for p in commands[name].params})


if __name__ == "__main__":
    app()
