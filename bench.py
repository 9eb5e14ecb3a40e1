"""Throughput tables for mamba3-lite, measured against baselines run in the same process.

    python bench.py kernels   # the Mamba-3 scan: every ssd path vs a minimal-SSD baseline
    python bench.py data      # the data loader vs a raw memcpy of the same windows; prepare.py tokens/s
    python bench.py ckpt      # checkpoint save/load vs bare safetensors + torch.save
    python bench.py train     # tokens/s, ms/step and MFU of a few training steps per preset
    python bench.py all

Timings are medians of interleaved repetitions (A, B, C, A, B, C, ...) so that a noisy shared machine
slows every contender alike; the ratios are what to read, the absolute figures depend on the machine.
"""
import contextlib
import os
import platform
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
console = Console(width=None if os.isatty(1) else 140)


@app.callback()
def main():
    """Throughput tables against baselines run in the same process (see each command's --help)."""


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


HBM_BYTES_PER_S = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
                   "A100": 1.55e12, "L40S": 0.864e12, "A10": 0.6e12, "RTX 4090": 1.0e12, "RTX 3090": 0.936e12}


def hbm_bandwidth():
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), None)


@app.command()
def kernels(
    batch: int = typer.Option(2, help="B"),
    seq_len: int = typer.Option(1024, help="L (a multiple of --chunk-size, for the baseline)"),
    heads: int = typer.Option(8, help="H"),
    headdim: int = typer.Option(64, help="P"),
    d_state: int = typer.Option(64, help="N"),
    chunk_size: int = typer.Option(64, help="C"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16 (x, q, k; log_a, gamma, beta stay float32)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    reps: int = typer.Option(25, help="interleaved repetitions per path"),
    recurrent: bool = typer.Option(True, help="also time the token-by-token recurrence (slow)"),
):
    """fwd and fwd+bwd time of every available ssd path vs the minimal-SSD baseline.
    The issue's CPU setting is the default; the GPU one is --batch 8 --seq-len 2048 --heads 32 --d-state 128 --dtype bfloat16."""
    import kernels as K

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dt = getattr(torch, dtype)
    B, L, H, P, N = batch, seq_len, heads, headdim, d_state
    if L % chunk_size:
        raise typer.BadParameter(f"--seq-len {L} must be a multiple of --chunk-size {chunk_size} for the baseline")
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
    return {name: t / per_call for name, t in times.items()}


@app.command()
def data(
    tokens: int = typer.Option(50_000_000, help="tokens in the synthetic stream (uint16, GPT-2 vocabulary)"),
    shard_tokens: int = typer.Option(8192, help="tokens per file of the sharded copy of the same stream"),
    seq_len: int = typer.Option(2048, help="L"),
    batch: int = typer.Option(16, help="B"),
    reps: int = typer.Option(60, help="interleaved repetitions per loader"),
    per_call: int = typer.Option(10, help="batches per timed call"),
    prepare_corpus: bool = typer.Option(True, "--prepare/--no-prepare", help="also time prepare.py on the demo corpus"),
    workdir: str = typer.Option(None, help="where the token files go (default: a temporary directory)"),
):
    """Loader tokens/s on random windows, warm page cache, one core, against the limit: a raw copy of the same
    kind of windows into a fresh int64 (B, L+1) buffer (what the loader returns x and y as views of), with every
    window's address found in advance, outside the timer. Baselines: nanoGPT's get_batch and a loader stitching
    windows through Python lists. Then prepare.py tokens/s on the demo corpus with 1 and 2 workers (byte, and
    gpt2 where tiktoken can load its BPE file)."""
    import shutil
    import tempfile
    from pathlib import Path

    import numpy as np

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as the issue asks (restored below for `bench.py all`)
    B, L = batch, seq_len
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
        rows = []
        for label, path, fs in [(f"one {tokens / 1e6:g}M-token file", single, [single]),
                                (f"{len(files):,} files of {shard_tokens:,} tokens", sharded, files)]:
            t = _bench_loaders(path, fs, tokens, L, B, reps, per_call)
            for name in names:
                if name in t:
                    rows.append([label if name == "limit" else "", name, f"{B * L / t[name] / 1e6:,.0f}",
                                 f"{t[name] * 1e6:,.0f}", f"{t['limit'] / t[name]:.2f}x"])
        print_table(f"data loader  B{B} L{L} random windows, warm page cache, 1 core",
                    ["stream", "loader", "M tokens/s", "us/batch", "vs limit"], rows)
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


@app.command()
def ckpt(
    params: float = typer.Option(100e6, help="parameters of the benchmark model (a stack of 2048x2048 Linear layers)"),
    preset: str = typer.Option("", help="use this model.py preset instead of the Linear stack (e.g. 180m)"),
    reps: int = typer.Option(7, help="interleaved repetitions"),
    dir: str = typer.Option("", help="directory on the disk to measure (default: the system temp dir)"),
):
    """ckpt.save / ckpt.load vs bare safetensors save_file + torch.save of the same state, with AdamW, on CPU.
    ckpt.save includes the sha256 of both files, fsync of files and directory, and the atomic renames."""
    import tempfile

    import ckpt as C
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    if preset:
        from model import PRESETS, Mamba3LM

        model = Mamba3LM(PRESETS[preset])
    else:
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(max(1, round(params / 2048**2)))])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # one step so that AdamW holds its two moments per parameter
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    n_params = sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory(dir=dir or None) as d:
        bare_model, bare_optim = os.path.join(d, "bare.safetensors"), os.path.join(d, "bare.pt")

        def bare_save():
            save_file(model.state_dict(), bare_model)
            torch.save({"optimizer": opt.state_dict()}, bare_optim)

        def bare_load():
            model.load_state_dict(load_file(bare_model))
            opt.load_state_dict(torch.load(bare_optim, weights_only=True)["optimizer"])

        saves = time_interleaved({"bare": bare_save, "ckpt": lambda: C.save(d, 1, model, opt, {"bench": True})}, reps)
        loads = time_interleaved({"bare": bare_load, "ckpt": lambda: C.load(d, 1, model, opt)}, reps)
        size = sum(os.path.getsize(os.path.join(d, n)) for n in C._names(1)[:2])

    rows = []
    for what, t in (("save", saves), ("load", loads)):
        rows.append([what, f"{t['bare']:.2f}", f"{t['ckpt']:.2f}", f"{t['ckpt'] / t['bare']:.2f}x",
                     f"{size / t['bare'] / 1e9:.2f}", f"{size / t['ckpt'] / 1e9:.2f}"])
    cols = ["", "bare s", "ckpt s", "ckpt / bare", "bare GB/s", "ckpt GB/s"]
    what = f"{preset} preset" if preset else "Linear stack"
    print_table(f"checkpoint of {n_params / 1e6:.0f}M params ({what}) + AdamW state: {size / 1e9:.2f} GB, "
                f"medians of {reps}", cols, rows)
    console.print("save target: ckpt / bare <= 1.30x (ckpt.save includes sha256, fsync, renames; bare does neither)")
    console.print(f"machine: {machine()}, checkpoint dir on {dir or tempfile.gettempdir()}")


# -----------------------------------------------------------------------------
# bench.py train


@app.command("train")
def train_step(
    models: str = typer.Option("", help="Comma-separated presets (default: tiny,small on a CPU, every preset on a GPU)."),
    steps: int = typer.Option(5, help="Timed optimizer steps per preset."),
    warmup: int = typer.Option(2, help="Untimed steps first (allocation, torch.compile)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="Default: on for CUDA, off for CPU."),
):
    """Tokens/s, ms/step and MFU of training steps per preset (one micro batch of the preset's recipe per step,
    AdamW, bf16 autocast on CUDA), excluding warm-up and compilation. A preset that runs out of memory is
    reported as not fitting."""
    import dataclasses

    import train as trainer
    from model import PRESETS, Mamba3LM

    dev, dtype, compile_ = trainer.resolve_device(device, "auto", compile)
    names = models.split(",") if models else (list(PRESETS) if dev == "cuda" else ["tiny", "small"])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    peak = trainer.peak_flops(dev)
    rows = []
    for name in names:
        recipe = trainer.RECIPES[name]
        B, L = recipe["batch_size"], recipe["seq_len"]
        vocab = 257 if name in ("tiny", "small") else 50257  # the byte-level demo corpus vs GPT-2 BPE
        torch.manual_seed(0)
        try:
            model = Mamba3LM(dataclasses.replace(PRESETS[name], vocab_size=vocab)).to(dev)
            opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95), fused=dev == "cuda")
            fwd = torch.compile(model) if compile_ else model
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
            n_params, flops = model.num_params(), model.flops_per_token(L)
        except torch.cuda.OutOfMemoryError:
            rows.append([name, f"{B}x{L}", "does not fit", "", "", ""])
            continue
        finally:
            model = opt = fwd = None
            if dev == "cuda":
                torch.cuda.empty_cache()
        tok_s = B * L / dt
        mfu = f"{flops * tok_s / peak:.1%}" if peak else "-"
        rows.append([name, f"{B}x{L}", f"{tok_s:,.0f}", f"{dt * 1e3:.0f}", f"{n_params / 1e6:.1f}M", mfu])
    print_table(f"training step on {dev} ({dtype}, compile {'on' if compile_ else 'off'})",
                ["preset", "batch x seq", "tokens/s", "ms/step", "params", "MFU"], rows)
    console.print(f"machine: {machine()}")


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


@app.command()
def traffic(
    batch: int = typer.Option(1, help="B"),
    seq_len: int = typer.Option(256, help="L"),
    heads: int = typer.Option(4, help="H"),
    headdim: int = typer.Option(64, help="P"),
    d_state: int = typer.Option(128, help="N"),
    ngroups: int = typer.Option(1, help="G"),
    chunk_size: int = typer.Option(64, help="C"),
    dtype: str = typer.Option("bfloat16", help="in_proj's output dtype: bfloat16 | float16 | float32"),
):
    """Bytes one layer's mixer region (in_proj's output -> out_proj's input) moves, forward and backward, counted
    without a GPU: Triton's interpreter counts the kernels' loads and stores, a dispatch mode every eager op's
    inputs and outputs; in_proj and out_proj are left out. Next to the compulsory minimum: each input read once
    (the backward reads them again: they are what it saves), each output written once, what the fused path saves
    besides its inputs (the per-chunk states and phases) written and read once, the incoming gradient read once
    and each gradient written once. Contrast: the eager glue around ssd(impl="triton")."""
    import subprocess
    import sys

    if os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter is chosen when triton is imported: count in a fresh process that has it on
        args = [sys.executable, os.path.abspath(__file__), "traffic", "--batch", str(batch), "--seq-len", str(seq_len),
                "--heads", str(heads), "--headdim", str(headdim), "--d-state", str(d_state), "--ngroups", str(ngroups),
                "--chunk-size", str(chunk_size), "--dtype", dtype]
        raise typer.Exit(subprocess.run(args, env={**os.environ, "TRITON_INTERPRET": "1"}).returncode)
    import dataclasses

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
    zx = (torch.randn(batch, seq_len, sum(mixer.split)) * 0.5).to(getattr(torch, dtype)).requires_grad_()
    dout = torch.randn(batch, seq_len, cfg.d_inner).to(zx.dtype)
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

    # the compulsory minimum, from the tensors themselves
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    _, states, phase = K._mixer_forward(zx.detach(), *(p.detach() for p in params), None, headdim, ngroups,
                                        cfg.n_angles, chunk_size, cfg.A_floor, cfg.norm_eps)
    inputs, saved, out = nbytes(zx, *params), nbytes(states, phase), nbytes(dout)
    minimum = (inputs + out + saved, inputs + saved + nbytes(dout) + inputs)  # the gradients are the inputs' size
    rows = [["compulsory minimum", f"{minimum[0] / 1e6:.3f}", f"{minimum[1] / 1e6:.3f}", f"{sum(minimum) / 1e6:.3f}",
             "1.00x", "", ""]]
    for name, (fwd, bwd) in counts.items():
        total = sum(fwd[0].values()) + sum(bwd[0].values())
        launches = "/".join(str(sum(v for k, v in c[1].items() if k.startswith("triton"))) for c in (fwd, bwd))
        ops = "/".join(str(sum(v for k, v in c[1].items() if k.startswith("eager"))) for c in (fwd, bwd))
        rows.append([name, f"{sum(fwd[0].values()) / 1e6:.3f}", f"{sum(bwd[0].values()) / 1e6:.3f}",
                     f"{total / 1e6:.3f}", f"{total / sum(minimum):.2f}x", launches, ops])
    shape = f"B{batch} L{seq_len} H{heads} P{headdim} N{d_state} G{ngroups} S{cfg.n_angles} C{chunk_size} {dtype}"
    print_table(f"mixer region traffic, MB ({shape}; in_proj and out_proj excluded)",
                ["path", "fwd MB", "bwd MB", "total MB", "vs minimum", "launches fwd/bwd", "eager ops fwd/bwd"], rows)
    fwd, bwd = counts["fused (kernels.mixer_triton)"]
    who = sorted(set(fwd[0]) | set(bwd[0]), key=lambda k: -(fwd[0][k] + bwd[0][k]))
    print_table("the fused path, by kernel or op (MB)", ["kernel / op", "fwd", "bwd"],
                [[k, f"{fwd[0][k] / 1e6:.3f}", f"{bwd[0][k] / 1e6:.3f}"] for k in who])
    console.print(f"saved for the backward besides the inputs: states {nbytes(states) / 1e6:.3f} MB, "
                  f"phases {nbytes(phase) / 1e6:.3f} MB. machine: {machine()}")


@app.command("all")
def all_():
    """Every table above with its defaults, one after the other."""
    commands = typer.main.get_command(app).commands
    for name in ("kernels", "data", "ckpt", "train"):
        commands[name].callback(**{p.name: p.default for p in commands[name].params})


if __name__ == "__main__":
    app()
