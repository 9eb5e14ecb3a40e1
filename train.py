"""Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

    python prepare.py && python train.py --data data/demo         # CPU quickstart (small preset)
    python train.py --data data/fineweb --model 180m               # one GPU
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 1.5b --fsdp
    python train.py --data synthetic --model 440m --max-steps 50   # random tokens, for speed tests
"""
import contextlib
import dataclasses
import inspect
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Annotated, List, Literal, Optional

import torch
import torch.distributed as dist
import typer
from rich.console import Console
from rich.panel import Panel
from rich.progress import Progress
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from typer import Option

import ckpt
import data
import official
from model import (PARAM_BYTES, PRESETS, Mamba3LM, ModelConfig, activation_bytes, bf16_native,
                   peak_flops, pick_device)

# -----------------------------------------------------------------------------
# the recipes and the config: every preset's defaults in one table, and the flags

# The GPU presets follow the paper's recipe (Mamba-2's): peak LR about 5x GPT-3's for the size,
# context 2048, ~0.5M-token batches, and max_steps None = Chinchilla's 20 tokens per parameter. The
# CPU presets use short contexts and small batches, so that a laptop sees the loss fall in a minute.
RECIPES = {name: dict(zip(("lr", "seq_len", "batch_size", "total_batch_size", "max_steps",
                           "eval_every", "save_every"), values)) for name, values in [
    #           lr       seq_len  batch  tokens/step  max_steps  eval_every  save_every
    ("tiny",   (3e-3,    128,     8,     1024,        200,       50,         100)),
    ("small",  (3e-3,    256,     8,     2048,        300,       50,         100)),
    ("180m",   (3e-3,    2048,    16,    524288,      None,      250,        1000)),
    ("440m",   (1.5e-3,  2048,    8,     524288,      None,      250,        1000)),
    ("880m",   (1.25e-3, 2048,    4,     524288,      None,      250,        1000)),
    ("1.5b",   (1e-3,    2048,    2,     524288,      None,      250,        1000))]}
EXPLODED = 1e3  # weights this many times larger (max |w|) than at the start are poison: never saved
MAX_ROLLBACKS = 3  # rolled back to the same checkpoint this often in a row: it cannot recover alone
Int = Optional[int]  # None: the preset's value


def preset(key, what, low=1):  # the option of a flag whose default is the preset's
    values = ", ".join(f"{p} {r[key]:g}" if r[key] else f"{p} 20 tok/param"
                       for p, r in RECIPES.items())
    return Option(min=low, help=f"{what} [dim](preset: {values})[/dim]")


@dataclasses.dataclass
class TrainConfig:
    """The flags (main's signature); resolve() fills the (preset) ones. Saved in config.json."""
    data: Annotated[List[str], Option(help="A prepare.py directory, nanoGPT .bin (or directory), "
                    "shard_*.bin directory or Megatron prefix; DIR:WEIGHT (repeated) blends; "
                    "'synthetic': random tokens (speed tests only).")]
    model: Annotated[Optional[Literal[tuple(PRESETS)]], Option(help="Model preset; sets the "
                     "(preset) defaults too (default: small, or --init-from's).")] = None
    init_from: Annotated[Optional[str], Option(help="Start from the weights of a run directory "
                         "or an official mamba_ssm one (fresh optimizer, schedule, data).")] = None
    reset_at_eos: Annotated[bool, Option(help="Reset the state after each EOS.")] = False
    mimo_rank: Annotated[Int, Option(min=1, help="MIMO rank R; 1: SISO (default: 1, or "
                         "--init-from's).")] = None
    # the batch and the schedule
    seq_len: Annotated[Int, preset("seq_len", "Context length.")] = None
    batch_size: Annotated[Int, preset("batch_size", "Sequences per device and micro-step.")] = None
    total_batch_size: Annotated[Int, preset("total_batch_size", "Tokens per optimizer step over "
                                            "all devices; sets the accumulation.")] = None
    max_steps: Annotated[Int, preset("max_steps", "Optimizer steps.")] = None
    lr: Annotated[Optional[float], preset("lr", "Peak learning rate (> 0).", None)] = None
    min_lr: Annotated[float, Option(min=0, help="Final learning rate (at most --lr).")] = 1e-5
    warmup_steps: Annotated[Int, Option(min=0, help="Default: 10% of --max-steps, <= 2000.")] = None
    schedule: Annotated[Literal["cosine", "wsd"], Option(help="After warmup: cosine decay, or wsd: "
                        "stable, then linear decay over the last 20%.")] = "cosine"
    weight_decay: Annotated[float, Option(min=0, help="AdamW weight decay (matrices only).")] = 0.1
    grad_clip: Annotated[float, Option(min=0, help="Clip the gradient norm; 0: never.")] = 1.0
    # the hardware
    dtype: Annotated[Literal["auto", "bf16", "fp32"], Option(help="auto: bf16 autocast (float32 "
                     "weights) where the device has bf16 arithmetic, else fp32.")] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Option(help="auto: CUDA if any.")] = "auto"
    compile: Annotated[Optional[bool], Option("--compile/--no-compile",
                       help="torch.compile (default: on CUDA).")] = None
    grad_checkpointing: Annotated[bool, Option(help="Recompute in backward: less memory.")] = False
    fsdp: Annotated[bool, Option(help="Shard weights, gradients and optimizer over the ranks "
                    "(FSDP2), for training state that does not fit one GPU.")] = False
    # the vocabulary
    vocab_size: Annotated[Int, Option(min=1, help="Default: the data's, else 50257.")] = None
    data_dtype: Annotated[Optional[Literal["uint16", "uint32", "int32"]], Option(help="Token dtype "
                          "of raw sources without a manifest (default: uint16).")] = None
    # the run directory, and what goes into it when
    out_dir: Annotated[str, Option(help="Checkpoints, config.json, metrics.jsonl.")] = "out"
    resume: Annotated[str, Option(help="auto: the newest checkpoint that verifies; never: start "
                      "fresh; STEP: that step (newer steps are moved aside).")] = "auto"
    new_data: Annotated[bool, Option(help="Resume on other --data (from its start).")] = False
    overwrite: Annotated[bool, Option(help="With --resume never: move an old run aside into "
                         "OUT_DIR/previous-TIME/ instead of refusing.")] = False
    save_every: Annotated[Int, preset("save_every", "And at the end.")] = None
    keep_last: Annotated[int, Option(min=0, help="Keep the newest K checkpoints; 0: all.")] = 3
    eval_every: Annotated[Int, preset("eval_every", "And at the end.")] = None
    eval_batches: Annotated[int, Option(min=1, help="Micro-batches of val windows per eval.")] = 20
    log_every: Annotated[int, Option(min=1, help="A log line and metrics record every N.")] = 10
    nan_guard: Annotated[int, Option(min=0, help="After N non-finite steps in a row, roll back to "
                         "the newest checkpoint; 0: never.")] = 5
    seed: Annotated[int, Option(min=0, max=2**63 - 1, help="Seeds data order and init.")] = 0
    dry_run: Annotated[bool, Option(help="Run 2 steps and an eval; write nothing.")] = False


class TrainError(Exception):
    """An expected problem with the run's settings, data or directory: printed as one paragraph."""


def resolve(cfg, init=None):
    """The (preset) flags filled (init: --init-from's ModelConfig fields), auto settled, the
    impossible refused before anything runs."""
    model = cfg.model or "small"
    if init is not None:
        keys = ("n_layer", "d_model", "expand", "headdim", "d_state", "ngroups", "mlp_hidden")
        same = [p for p, c in PRESETS.items() if all(getattr(c, k) == init[k] for k in keys)]
        if (cfg.model and cfg.model not in same or cfg.vocab_size not in (None, init["vocab_size"])
                or cfg.mimo_rank not in (None, init["mimo_rank"])):
            raise TrainError(f"--init-from {cfg.init_from} is a model of its own shape ({init}): "
                             "--model, --vocab-size and --mimo-rank may not change it")
        model = cfg.model or (same + ["small"])[0]
    recipe = {k: v if (f := getattr(cfg, k)) is None else f for k, v in RECIPES[model].items()}
    if recipe["max_steps"] is None:  # Chinchilla-style horizon: 20 tokens per parameter
        recipe["max_steps"] = max(1, 20 * num_params(PRESETS[model]) // recipe["total_batch_size"])
    if bad := [f"--{k.replace('_', '-')} {v}" for k, v in {**vars(cfg), **recipe}.items()
               if isinstance(v, float) and not math.isfinite(v)]:  # (Typer takes inf and nan)
        raise TrainError(f"{', '.join(bad)}: expected a finite number")
    if not recipe["lr"] > 0:
        raise TrainError(f"--lr must be positive, found {recipe['lr']}")
    if not cfg.out_dir.strip():
        raise TrainError("--out-dir is empty; name the run's directory (the default is out)")
    if cfg.init_from and Path(cfg.init_from).resolve() == Path(cfg.out_dir).resolve():
        raise TrainError(f"--init-from and --out-dir are both {cfg.out_dir}: to continue that run "
                         "leave out --init-from; to start from its weights use another --out-dir")
    if (tokens := recipe["total_batch_size"]) % (seq_len := recipe["seq_len"]):
        raise TrainError(f"--total-batch-size {tokens} tokens is not a multiple of --seq-len "
                         f"{seq_len}; use a multiple, e.g. {max(1, tokens // seq_len) * seq_len}")
    if cfg.resume not in ("auto", "never") and not cfg.resume.isdigit():
        raise TrainError(f"--resume {cfg.resume!r}: expected auto, never or a step number")
    device, warmup = pick_device(cfg.device), min(2000, max(1, recipe["max_steps"] // 10))
    return dataclasses.replace(
        cfg, **recipe, model=model, device=device, min_lr=min(cfg.min_lr, recipe["lr"]),
        vocab_size=init["vocab_size"] if init else cfg.vocab_size,  # the data must fit the weights
        dtype=("bf16" if bf16_native(device) else "fp32") if cfg.dtype == "auto" else cfg.dtype,
        warmup_steps=warmup if cfg.warmup_steps is None else cfg.warmup_steps,
        compile=device == "cuda" if cfg.compile is None else cfg.compile)


# -----------------------------------------------------------------------------
# what the loop uses: the model and its memory, the schedule, a step, eval, the NaN guard, the log
def num_params(config):  # counted on the meta device: nothing allocated
    with torch.device("meta"):
        return Mamba3LM(config).num_params()


def free_memory(device):
    """Bytes free: on the GPU, or the RAM Linux calls available (or a lower cgroup limit's rest)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    with contextlib.suppress(OSError, ValueError, KeyError):  # (not Linux: no check)
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(info["MemAvailable"].split()[0]) * 1024
        with contextlib.suppress(OSError, ValueError):  # no cgroup v2 limit ("max", or none)
            cg = [int(Path(f"/sys/fs/cgroup/memory.{k}").read_text()) for k in ("max", "current")]
            free = min(free, cg[0] - cg[1])
        return free


def check_memory(cfg, config):
    """Refuse a step that cannot fit in the memory free, naming the numbers and the ways out. On a
    GPU only the parameters' share is sure, the rest a warning (CUDA's OOM stops a run cleanly)."""
    params, free, b, L = num_params(config), free_memory(cfg.device), cfg.batch_size, cfg.seq_len
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if cfg.device == "cpu" else 1  # share RAM
    world, sequences = int(os.environ.get("WORLD_SIZE", 1)), cfg.total_batch_size // L
    fixed = ranks * PARAM_BYTES * params // (world if cfg.fsdp else 1)  # FSDP: 1/world per rank
    act = ranks * activation_bytes(config, b * L, cfg.grad_checkpointing)
    if free is None or fixed + act <= free:
        return
    n, r = (max([n for n in range(1, b + 1) if sequences % (n * world) == 0  # (n must divide)
                 and fixed + ranks * activation_bytes(config, n * L, recompute) <= free], default=0)
            for recompute in (cfg.grad_checkpointing, True))
    ways = [f"--batch-size {n} (the accumulation keeps --total-batch-size)"] * (0 < n < b)
    ways += [f"--grad-checkpointing" + f" with --batch-size {r}" * (r < b)] * (
        r > 0 and not cfg.grad_checkpointing)
    what = (f"a step needs about {(fixed + act) / 1e9:.1f} GB and the {cfg.device} has "
            f"{free / 1e9:.1f} GB free: {fixed / 1e9:.1f} GB for {params / 1e6:.1f}M parameters "
            f"with their gradients and AdamW state, {act / 1e9:.1f} GB for the activations of {b} "
            f"sequences of {L} tokens" + f" (times {ranks} ranks on this machine)" * (ranks > 1)
            + ". Use " + " or ".join(ways + ["a smaller --model"]))
    if cfg.device == "cpu" or fixed > free:
        raise TrainError(f"{what} (an estimate from measurements of float32 steps on a CPU)")
    warnings.warn(f"{what} if it runs out (the activations are estimated from a CPU's)")


def lr_at(step, cfg):
    """Linear warmup, then cosine to min_lr; or WSD: warmup, stable, linear decay over the last 20%
    (the stable phase makes a checkpoint from which a shorter or longer decay can branch)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = int(cfg.max_steps * 0.8)
        frac = max(0.0, (step - start) / max(1, cfg.max_steps - start))
        return cfg.lr + frac * (cfg.min_lr - cfg.lr)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def micro_step(model, x, y, autocast):  # one micro-batch's mean loss (tests inject faults here)
    with autocast:
        return model(x, y)[1]


def train_step(model, batches, autocast, world, signals):
    """One optimizer step's gradient -> (mean loss, whether any rank was signalled to stop)."""
    stats = torch.zeros(2, device=next(model.parameters()).device)  # summed loss; signals seen
    for m in range(batches.accum_steps):
        x, y = next(batches)
        # DDP averages gradients across ranks once per optimizer step, not at every micro-step;
        # FSDP reduce-scatters each micro-step's, so every rank holds only its shard of the sum
        sync = not isinstance(model, DDP) or m == batches.accum_steps - 1
        with contextlib.nullcontext() if sync else model.no_sync():
            loss = micro_step(model, x, y, autocast)
            (loss / batches.accum_steps).backward()
        stats[0] += loss.detach()
    stats[1] = len(signals)
    if world > 1:  # a sum (gloo has no average): a signal on any rank stops all at the same step
        dist.all_reduce(stats)
    return stats[0].item() / (batches.accum_steps * world), stats[1].item() > 0


@torch.no_grad()
def evaluate(model, val, layout, num_batches, autocast):
    """Mean loss over the fixed validation windows (the same at every eval), over all ranks:
    `layout` is the training's BatchConfig (its seq_len, micro-batch, rank, world size, device)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in data.val_batches(val, layout, num_batches):  # (sums: token losses, tokens)
        total[0] += micro_step(model, x, y, autocast).double() * y.numel()
        total[1] += y.numel()
    if layout.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def max_abs_weight(model):
    """What "the weights blew up" measures: over all ranks' shards, so that all agree to save."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    top = torch.stack([t.detach().abs().max() for t in local if t.numel()]  # (a shard may be
                      + [local[0].new_zeros(())]).max()  # empty: a tensor of fewer rows than ranks)
    if dist.is_initialized():
        dist.all_reduce(top, dist.ReduceOp.MAX)
    return top.item()


@dataclasses.dataclass
class NanGuard:
    """A step with a non-finite loss or gradient norm skips its update; `limit` in a row (0: never)
    restore the newest checkpoint while the data moves on (the poison is not replayed). Nothing is
    saved in a streak, nor weights beyond `explode` (max |w|): those roll back at once. Rolled back
    MAX_ROLLBACKS times with no save between (each time to the newest step: the same), it stops."""
    limit: int
    explode: float
    out: Path  # where the checkpoints are
    streak: int = 0  # non-finite steps in a row
    skipped: int = 0  # non-finite steps in all (in the checkpoints' meta)
    rollbacks: int = 0  # since the last save

    def finite(self, loss, norm, step, log):  # counts a step; whether it may update
        if math.isfinite(loss) and math.isfinite(norm):
            self.streak = 0
            return True
        self.streak, self.skipped = self.streak + 1, self.skipped + 1
        log(f"[yellow]step {step}: non-finite loss or gradient norm, update skipped ({self.streak}"
            f" in a row, {self.skipped} in all)[/yellow]", kind="event", event="nonfinite",
            step=step)
        return False

    def due(self):  # whether to roll back instead of stepping
        return self.limit > 0 and self.streak >= self.limit

    def poison(self, model):  # why `model` must not be saved now, or None
        if self.streak:
            return f"{self.streak} non-finite steps in a row"
        if (top := max_abs_weight(model)) > self.explode:
            self.streak = max(1, self.limit)  # a rollback now (--nan-guard 0: the run ends unsaved)
            return f"the weights have exploded (max |w| {top:.3g})"
        self.rollbacks = 0  # a clean save point: rollbacks count afresh

    def roll_back(self, model, optimizer, step, log):
        if (restored := ckpt.load_latest(self.out, model, optimizer)[0]) is None:
            raise TrainError(f"{self.streak} bad steps in a row at step {step} and no checkpoint "
                             f"in {self.out}; lower --lr, check the data or raise --nan-guard")
        log(f"[yellow]step {step}: {self.streak} bad steps in a row, restored the weights of step "
            f"{restored}; the data continues from step {step}[/yellow]", kind="event",
            event="rollback", step=step, restored=restored)
        self.streak, self.rollbacks = 0, self.rollbacks + 1
        if self.rollbacks == MAX_ROLLBACKS:
            raise TrainError(f"rolled back to step {restored} {MAX_ROLLBACKS} times in a row, bad "
                             f"again each time (last at step {step}); lower --lr or check the data")


# How a record's values read on the console, in this order (the rest is in the record only)
SHOW = dict(loss="loss {:.4f}", ppl="ppl {:.2f}", lr="lr {:.2e}", grad_norm="grad norm {:.3f}",
            tok_per_s="{:,.0f} tok/s", ms_per_step="{:.0f} ms/step", mfu="MFU {:.1%}",
            val_loss="val loss {:.4f}", val_ppl="ppl {:.2f}")


class Log:
    """log(line, **record): rank 0 prints the line, appends the record to metrics.jsonl (made at
    the first: a refused run leaves none; a dry run writes none) and sends it to wandb if set up."""

    def __init__(self, cfg, rank):
        self.wandb, self.tokens_per_step, tty = None, cfg.total_batch_size, sys.stdout.isatty()
        self.console = Console(highlight=False, width=None if tty else 200, quiet=rank != 0)
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if rank == 0 and not cfg.dry_run else None
        # a progress bar on terminals only: not in log files
        self.progress = Progress(console=self.console, transient=True, disable=rank != 0 or not tty)

    def __call__(self, line, **record):
        self.console.print(line)  # rich flushes: lines reach a log file or pipe as they happen
        if record and self.path is not None:
            write(self.path, json.dumps(record) + "\n", append=True)
        if record and self.wandb is not None:
            with contextlib.suppress(Exception):  # a logging service must never stop training
                numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
                self.wandb.log(numbers, record["step"])

    def metrics(self, kind, step, **values):  # a record with the tokens seen (plot.py's x axis)
        shown = [f.format(values[k]) for k, f in SHOW.items() if values.get(k) is not None]
        values = {k: None if v != v else v for k, v in values.items()}  # NaN is not JSON: null
        self(f"step {step}: {', '.join(shown)}", kind=kind, step=step,
             tokens=step * self.tokens_per_step, **values)

    def start_wandb(self, cfg, run_id):  # (wandb reads its own WANDB_* variables) -> the run id
        if self.path and os.environ.get("WANDB_PROJECT"):
            try:
                import wandb
                self.wandb = wandb.init(id=run_id, resume="allow", config=dataclasses.asdict(cfg))
                return self.wandb.id
            except Exception as e:  # noqa: BLE001
                self(f"[yellow]warning: wandb disabled ({type(e).__name__}: {e})[/yellow]")
        return run_id


def header(log, cfg, model, batches, val):
    """The resolved run in one panel: what a reader of the log needs to know it is the run meant."""
    c, world, planned = model.config, batches.cfg.world_size, cfg.total_batch_size * cfg.max_steps
    tokens = sum(s.num_tokens for s in batches.sources)
    gpu = f" ({torch.cuda.get_device_name()})" if cfg.device == "cuda" else ""
    sources = ", ".join(f"{s.path}" + f" ({float(w):.0%} of the samples)" * (len(cfg.data) > 1)
                        for s, w in zip(batches.sources, batches.weights))
    lines = [
        f"model      {cfg.model}: {model.num_params():,} parameters ({c.n_layer} layers, d_model "
        f"{c.d_model}, vocab {c.vocab_size}" + f", mimo rank {c.mimo_rank}" * (c.mimo_rank > 1)
        + f", reset after token {c.reset_token}" * (c.reset_token is not None) + ")",
        f"device     {cfg.device}{gpu}, dtype {cfg.dtype}, compile {'on' if cfg.compile else 'off'}"
        f", world size {world}"
        + (", FSDP" + " (without torchrun: nothing to shard)" * (world == 1)) * cfg.fsdp,
        f"batch      {cfg.total_batch_size:,} tokens per step = {cfg.batch_size} seqs x "
        f"{cfg.seq_len} tokens x {batches.accum_steps} accumulation x {world} ranks",
        "data       SYNTHETIC random tokens (--data synthetic): the loss stays at ln(vocab)"
        if cfg.data == ["synthetic"] else f"data       {sources}: {tokens:,} tokens; "
        f"{planned:,} planned = {planned / tokens:.2f} epochs",
        f"eval       every {cfg.eval_every} steps on {val.path} (val)" if val else
        "eval       [bold yellow]off: no val split of seq_len + 1 tokens[/bold yellow]",
        f"out        {cfg.out_dir}" + " (dry run: nothing written)" * cfg.dry_run + f", resume "
        f"{cfg.resume}, save every {cfg.save_every} (keep {cfg.keep_last or 'all'})",
        f"optimizer  AdamW for {cfg.max_steps} steps, lr {cfg.lr:g} -> {cfg.min_lr:g} "
        f"({cfg.schedule}, {cfg.warmup_steps} warmup), weight decay {cfg.weight_decay:g}, grad "
        f"clip {cfg.grad_clip:g}, nan guard {cfg.nan_guard}, seed {cfg.seed}",
    ] + [f"init from  {cfg.init_from}"] * bool(cfg.init_from)
    log.console.print(Panel("\n".join(lines), title="mamba3-lite train", expand=False))


# -----------------------------------------------------------------------------
# the run directory: files that survive a full disk, branches moved aside, resume
def write(path, text, append=False):
    """Write `path` whole (atomically) or append to it; a full disk is a TrainError naming it."""
    try:
        if not append:
            return data.write_atomic(path, text.encode())
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:  # (the OSError of a failed write() names no file)
        raise TrainError(f"could not write {path} ({e.strerror or e}); free disk space or fix "
                         "the permissions: a new run resumes from the newest checkpoint") from None


def move_aside(out, step, files, prefix):
    """Move the checkpoint `files` of steps after `step` (step -1: and config.json) and their
    records into a new OUT/PREFIX-TIME/, returned (None if none): a branch left is never deleted.
    The hidden stage is made first, its name the journal (`step` in it), then finish_moves moves."""
    if any(s > step for s in files):
        base = time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
        name = next(n for i in range(99) if not (out / (n := base + f"-{i}" * (i > 0))).exists())
        (out / f".{name}.after{step}.moving").mkdir()
    return finish_moves(out, step)


def finish_moves(out, step=None):
    """Do the moves journalled as OUT/.NAME.afterSTEP.moving/ (then named NAME, returned) and drop
    records after `step`. The next run finishes one a killed run left before it reads or writes a
    step (so the steps after the journal's are still the ones to move): no step is split in two."""
    metrics, aside, records = out / "metrics.jsonl", None, []
    text = metrics.read_text() if metrics.exists() else ""
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):  # (a line a full disk cut short)
            records.append((line + "\n", json.loads(line)["step"]))
    for stage in sorted(out.glob(".*.after*.moving")):
        final, after = stage.name[1:-len(".moving")].rsplit(".after", 1)
        after = int(after)
        names = [p.name for s, ps in ckpt.step_files(out).items() if s > after for p in ps]
        for name in names + ["config.json"] * (after < 0 and (out / "config.json").exists()):
            os.replace(out / name, stage / name)
        write(stage / metrics.name, "".join(line for line, s in records if s > after))
        os.replace(stage, aside := out / final)  # the move, whole
        data.fsync(out)
        step = min(after, math.inf if step is None else step)
    keep = "".join(line for line, s in records if step is None or s <= step)
    if keep != text:  # records dropped, or a last line without its newline (the next would join it)
        write(metrics, keep)
    return aside


def data_identity(batches):  # per source: what resume compares (its path, weight, files' digest)
    return [dict(path=str(s.path), weight=str(w), files=s.digest())
            for s, w in zip(batches.sources, batches.weights)]


def resume(cfg, model, optimizer, batches, log, cleanup):
    """Lock the directory (rank 0), load what --resume asks for (weights, optimizer, data position,
    RNGs: bit for bit) -> its meta, or None. Once all that cannot continue is refused, newer steps
    (a branch left, unverifiable steps; --overwrite: the old run) and their records move aside."""
    out, writes, step, meta = Path(cfg.out_dir), log.path is not None, None, None  # (rank 0 writes)
    if cfg.resume.isdigit():
        ckpt.read_meta(out, int(cfg.resume))  # a step that does not exist: refused before the lock
    if writes:
        if (out / official.MARKER).is_file():
            raise TrainError(f"{out} is an export (it holds {official.MARKER}): a run would "
                             f"overwrite its config.json; use another --out-dir")
        cleanup.enter_context(ckpt.lock(out))  # one run per directory
        finish_moves(out)  # what a run killed while moving steps aside left: done first
    if (files := ckpt.step_files(out)) and cfg.resume == "never" and not cfg.overwrite:
        raise TrainError(f"{out} already holds checkpoints (steps {sorted(files)}): use --resume "
                         "auto, another --out-dir, or --overwrite to move them to previous-TIME/")
    try:
        if cfg.resume == "auto":
            step, meta = ckpt.load_latest(out, model, optimizer, restore_rng=True)
        elif cfg.resume != "never":
            meta = ckpt.load(out, (step := int(cfg.resume)), model, optimizer, restore_rng=True)
    except ckpt.ModelMismatch as e:
        raise TrainError(f"{e.what}: resume with its --model, --vocab-size and --reset-at-eos "
                         f"({out}/config.json), or start anew: --resume never or another --out-dir")
    if step is None and files and cfg.resume == "auto":
        names = ", ".join(p.name for ps in files.values() for p in ps)[:400]
        raise TrainError(f"{out} holds checkpoint files but no step verifies ({names}); nothing "
                         "changed: use --resume STEP, or --resume never --overwrite to move them")
    if step is not None:
        ids = [[(d["weight"], d["files"]) for d in ds]  # (old checkpoints have none: not compared)
               for ds in (meta.get("data_identity") or [], data_identity(batches))]
        if not ((same := ids[0] in ([], ids[1])) or cfg.new_data):
            was, now = (" ".join(d) for d in (meta["config"]["data"], cfg.data))
            raise TrainError(f"{out} step {step} was trained on --data {was}, not {now}: add "
                             "--new-data to continue on it, or --resume never or another --out-dir")
        if same:  # (new data starts at its beginning)
            batches.load_state_dict(meta["data"])
        if cfg.max_steps < step:
            raise TrainError(f"--max-steps {cfg.max_steps} is below the resumed step {step}")
    # (also without a step: the records of a run killed before its first save are dropped)
    prefix = "previous" if cfg.resume == "never" else "abandoned"
    if writes and (aside := move_aside(out, -1 if step is None else step, files, prefix)):
        log(f"moved the previous run aside into {aside}" if step is None else f"[yellow]moved the"
            f" newer steps {[s for s in files if s > step]} and their records aside into {aside}"
            "[/yellow]")
    if step is not None:
        log(f"resumed from {out} step {step}", kind="event", event="resume", step=step)
    if step == cfg.max_steps and not cfg.dry_run:  # (said before the header, which then follows)
        log(f"{out} is at step {step} of --max-steps {step} already: nothing to do")
    if writes:  # the directory is this run's now: its config, and its tokenizer for sample.py
        write(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        if (spec := batches.sources[0].tokenizer) and spec.get("name") == "file":
            shutil.copy(batches.sources[0].path / spec["file"], out / spec["file"])
    return meta


def save_checkpoint(cfg, step, model, optimizer, log, state):  # (tests inject faults here)
    t0, tag = time.time(), "final" if step == cfg.max_steps else "periodic"
    meta = dict(state, tokens_seen=step * cfg.total_batch_size, config=dataclasses.asdict(cfg),
                optimizer_steps=step - state["skipped_steps"], tag=tag)
    ckpt.save(cfg.out_dir, step, model, optimizer, meta, keep_last=cfg.keep_last or None)
    log(f"step {step}: saved checkpoint to {cfg.out_dir} ({time.time() - t0:.1f}s)",
        kind="event", event="checkpoint", step=step)


# -----------------------------------------------------------------------------
# the run, and its command line
def setup(cfg, init, tmp, cleanup):
    """(rank, world, local rank, batches, val or None, model, optimizer); bad input refused."""
    rank, world, local = (int(os.environ.get(k, 0)) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if "RANK" in os.environ or cfg.fsdp:  # set by torchrun; plain python is a world of one
        if cfg.device == "cuda":
            torch.cuda.set_device(local)
        alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(backend="nccl" if cfg.device == "cuda" else "gloo", **alone)
        cleanup.callback(dist.destroy_process_group)
    torch.manual_seed(cfg.seed)
    # the data: missing, malformed or out-of-vocabulary data is refused here, before anything else
    sources, weights, val, vocab = data.open_blend(cfg.data, cfg.data_dtype, cfg.vocab_size,
                                                   cfg.seed, tmp)
    world, sequences = max(world, 1), cfg.total_batch_size // cfg.seq_len  # per optimizer step
    layout = data.BatchConfig(cfg.seq_len, cfg.batch_size, sequences, cfg.seed, rank, world,
                              cfg.device, prefetch=cfg.device == "cuda")
    batches, source = data.Batches(sources, layout, weights), sources[0]
    cleanup.callback(batches.close)
    if val is not None and val.num_tokens < cfg.seq_len + 1:  # a short first document, say: the
        val = None  # header says that evaluation is off; the training is still worth running
    # the model: the preset's, or --init-from's (init: its ModelConfig fields, state, tokenizer)
    if cfg.reset_at_eos and source.eos_id is None:
        raise TrainError(f"--reset-at-eos needs data that records its EOS id (a prepare.py "
                         f"directory); {source.path} does not")
    if init and init[2] and source.tokenizer and init[2]["name"] != source.tokenizer["name"]:
        raise TrainError(f"--init-from {cfg.init_from} has the {init[2]['name']} tokenizer, "
                         f"the data {source.tokenizer['name']}: token ids would mean other things")
    config = ModelConfig(**init[0]) if init else dataclasses.replace(
        PRESETS[cfg.model], vocab_size=vocab, mimo_rank=cfg.mimo_rank or 1)
    if cfg.reset_at_eos:
        config = dataclasses.replace(config, reset_token=source.eos_id)
    check_memory(cfg, config)  # before the weights take any
    model = Mamba3LM(config).to(f"cuda:{local}" if cfg.device == "cuda" else "cpu")
    if init:
        model.load_state_dict(init[1])  # weights only: the optimizer, schedule, data start afresh
    model.grad_checkpointing = cfg.grad_checkpointing
    official.check_impl(model)
    if cfg.fsdp:  # before the optimizer, which must hold the shards
        # FSDP2: each block (compiled first: torchtitan's order), then the root; a rank holds
        # 1/world of the weights, gradients and AdamW moments, gathering a block's weights only
        # while it computes (in bf16 on CUDA; master weights and gradient reduction stay float32)
        mp = (torch.bfloat16, torch.float32) if cfg.device == "cuda" and cfg.dtype == "bf16" else ()
        # FSDP2 warns of the logits' view (the padded vocabulary sliced off): nothing edits it
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
        for block in model.blocks:
            if cfg.compile:
                block.compile()
            fully_shard(block, mp_policy=MixedPrecisionPolicy(*mp))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(*mp))
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr,
                                  betas=(0.9, 0.95), eps=1e-8, fused=cfg.device == "cuda")
    return rank, world, local, batches, val, model, optimizer


def run(cfg, init, tmp, cleanup):
    """Set up, then train; cleanup (an ExitStack) releases what the setup takes, however it ends."""
    rank, world, local, batches, val, raw_model, optimizer = setup(cfg, init, tmp, cleanup)
    log = Log(cfg, rank)
    meta = resume(cfg, raw_model, optimizer, batches, log, cleanup) or dict(step=0, skipped_steps=0)
    step = meta["step"]
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, max_steps=step + 2, log_every=1)
    header(log, cfg, raw_model, batches, val)
    run_id = log.start_wandb(cfg, meta.get("wandb_run_id"))
    bar = cleanup.enter_context(log.progress).add_task("train", total=cfg.max_steps, completed=step)
    # `raw_model` is what is saved and restored; `model` may be wrapped for speed and for DDP
    model = torch.compile(raw_model) if cfg.compile and not cfg.fsdp else raw_model
    if world > 1 and not cfg.fsdp:
        model = DDP(model, [local] if cfg.device == "cuda" else None)
    autocast = torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    peak = world * (peak_flops(torch.cuda.get_device_name()) or 0) if cfg.device == "cuda" else 0
    explode = EXPLODED * max(1.0, max_abs_weight(raw_model))
    guard = NanGuard(cfg.nan_guard, explode, Path(cfg.out_dir), skipped=meta["skipped_steps"])
    stop, stopping = [], False  # SIGTERM and Ctrl-C: finish the step, save, exit (all ranks alike)
    for s in (signal.SIGTERM, signal.SIGINT):
        old = signal.signal(s, lambda sig, frame: stop.append(signal.Signals(sig).name))
        cleanup.callback(signal.signal, s, old)
    good, seconds = [], []  # since the last log line: good steps' (loss, norm), every step's time
    t_start = time.time() - meta.get("wall_time", 0.0)  # as if the run had never stopped
    while step < cfg.max_steps and not stopping:
        if not guard.due():  # one optimizer step: accumulate, clip, update unless non-finite
            t0 = time.time()  # (the tok/s figures time the steps alone: not eval, save, rollback)
            for group in optimizer.param_groups:  # the schedule is a function of the step alone,
                group["lr"] = lr_at(step, cfg)  # so a resumed run follows it without its own state
            loss, stopping = train_step(model, batches, autocast, world, stop)
            clip = cfg.grad_clip or math.inf  # (--grad-clip 0: the norm is measured, not clipped)
            norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip).item()
            if guard.finite(loss, norm, step, log):
                optimizer.step()
                good.append((loss, norm))
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.time() - t0)
            step += 1
        if guard.due():  # back to the newest checkpoint; the data cursor keeps moving
            guard.roll_back(raw_model, optimizer, step, log)
        last_step = step == cfg.max_steps  # the final log, eval and save happen in the loop
        log.progress.update(bar, completed=step)
        if seconds and (step % cfg.log_every == 0 or last_step):
            # the good steps' mean loss and gradient norm (NaN after skipped steps only), the speed
            loss, norm = (sum(v) / len(good) for v in zip(*good)) if good else (math.nan, math.nan)
            tok_per_s = len(seconds) * cfg.total_batch_size / sum(seconds)
            mfu = raw_model.flops_per_token(cfg.seq_len) * tok_per_s / peak if peak else None
            log.metrics("train", step, loss=loss, ppl=math.exp(min(loss, 50)), grad_norm=norm,
                        lr=lr_at(step - 1, cfg), tok_per_s=tok_per_s, mfu=mfu,
                        ms_per_step=1000 * sum(seconds) / len(seconds))
            good, seconds = [], []
        if val is not None and (last_step or step % cfg.eval_every == 0):
            val_loss = evaluate(model, val, batches.cfg, cfg.eval_batches, autocast)
            log.metrics("eval", step, val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
        if last_step or stopping or step % cfg.save_every == 0:
            if why := guard.poison(raw_model):  # poison is never saved
                log(f"[yellow]step {step}: not saved: {why}[/yellow]", kind="event",
                    event="not_saved", step=step)
            elif (rank == 0 or cfg.fsdp) and not cfg.dry_run:  # (FSDP: all gather, rank 0 writes)
                save_checkpoint(cfg, step, raw_model, optimizer, log, dict(
                    skipped_steps=guard.skipped, data=batches.state_dict(), wandb_run_id=run_id,
                    data_identity=data_identity(batches), tokenizer=batches.sources[0].tokenizer,
                    wall_time=time.time() - t_start))
    if guard.streak:
        raise TrainError(f"the run ended at step {step} in a streak of bad steps, not saved; "
                         f"resume from the newest checkpoint in {cfg.out_dir} with a lower --lr")
    if stopping:
        log(f"stopped by {stop[0] if stop else 'a signal on another rank'} at step {step}; resume "
            f"with --resume auto")


def lost_peer(e, cfg):
    """The TrainError for a rank lost under torchrun (its peers see a closed connection, not why;
    DDP's hooks raise a plain RuntimeError), or `e` itself."""
    if not ((isinstance(e, dist.DistError) or "gloo" in str(e) or "NCCL" in str(e))
            and dist.is_initialized() and dist.get_world_size() > 1):
        return e
    return TrainError(f"rank {dist.get_rank()} of {dist.get_world_size()} lost another rank, which "
                      f"stopped (killed, or failed: its output says why): "
                      f"{str(e).split('] ', 1)[-1].split('. ')[0][:200]}. When it is fixed, run "
                      f"again: it resumes from the newest checkpoint in {cfg.out_dir}")


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


@app.command(help=__doc__.split("\n\n")[0] + "\n\nResumes from the newest checkpoint in --out-dir "
             "by default (--resume auto). Flags marked (preset) default to the preset's recipe.")
def main(**flags):
    # one paragraph each: OSError the disk's; ValueError data's, pick_device's and ModelConfig's
    with data.cli_errors(TrainError, ckpt.CheckpointError, OSError, ValueError):
        cfg = TrainConfig(**flags)
        init = official.read_pretrained(cfg.init_from) if cfg.init_from else None
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
            try:
                run(resolve(cfg, init and init[0]), init, tmp, cleanup)
            except RuntimeError as e:  # (before the ExitStack ends the process group)
                raise lost_peer(e, cfg) from None


main.__signature__ = inspect.signature(TrainConfig)  # the flags are TrainConfig's fields, once

if __name__ == "__main__":
    app()
