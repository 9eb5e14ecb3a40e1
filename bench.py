"""Throughput tables for mamba3-lite, measured against baselines run in the same process.

    python bench.py kernels   # the Mamba-3 scan: every ssd path vs a minimal-SSD baseline
    python bench.py data      # the data loader vs a raw memcpy of the same windows; prepare.py tokens/s
    python bench.py ckpt      # checkpoint save/load vs bare safetensors + torch.save
    python bench.py train     # tokens/s, ms/step and MFU of a few training steps per preset
    python bench.py all

Timings are medians of interleaved repetitions (A, B, C, A, B, C, ...) so that a noisy shared machine
slows every contender alike; the ratios are what to read, the absolute figures depend on the machine.
"""
import os
import platform
import statistics
import time

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
    reps: int = typer.Option(15, help="interleaved repetitions per path"),
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

# -----------------------------------------------------------------------------
# bench.py ckpt

# -----------------------------------------------------------------------------
# bench.py train


if __name__ == "__main__":
    app()
