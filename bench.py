"""Throughput tables for mamba3-lite, measured against baselines run in the same process.

    python bench.py kernels   # the Mamba-3 scan: every ssd path vs a minimal-SSD baseline
    python bench.py data      # the data loader vs a raw memcpy of the same windows; prepare.py tokens/s
    python bench.py ckpt      # checkpoint save/load vs bare safetensors + torch.save
    python bench.py train     # tokens/s, ms/step and MFU of a few training steps per preset
    python bench.py all

Timings are medians of interleaved repetitions (A, B, C, A, B, C, ...) so that a noisy shared machine
slows every contender alike; the ratios are what to read, the absolute figures depend on the machine.
"""
import platform
import statistics
import time

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
console = Console()


# -----------------------------------------------------------------------------
# shared helpers


def machine() -> str:
    """One line naming the machine the figures come from."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    line = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        line += f", {torch.cuda.get_device_name()}"
    return line


def sync():
    import torch

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

# -----------------------------------------------------------------------------
# bench.py data

# -----------------------------------------------------------------------------
# bench.py ckpt

# -----------------------------------------------------------------------------
# bench.py train


if __name__ == "__main__":
    app()
