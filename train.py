"""Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

    python prepare.py && python train.py --data data/demo                  # CPU quickstart (small preset)
    python train.py --data data/fineweb --model 180m                        # one GPU
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
    python train.py --data synthetic --model 440m --max-steps 50            # random tokens, for speed tests

Read it top to bottom: the recipes (every preset's defaults), the config (which is the command line), the
helpers the loop uses, then `run`: setup, and the loop -- evaluate and save when due, one optimizer step,
log. A checkpoint holds all a resumed run needs to continue bit for bit: weights, optimizer, data position,
step, RNG states.
"""
import contextlib
import dataclasses
import fcntl
import inspect
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, List, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from typer import Option

import ckpt
import data
import official
from model import PRESETS, Mamba3LM, ModelConfig

# -----------------------------------------------------------------------------
# recipes: every preset's defaults, in one place

# The GPU presets follow the paper's recipe (Mamba-2's): peak LR about 5x GPT-3's for the size, context 2048,
# ~0.5M-token batches, and max_steps None = Chinchilla's 20 tokens per parameter. The CPU presets use short
# contexts and small batches, so that a laptop sees the loss fall within a couple of minutes.
RECIPES = {
    "tiny": dict(lr=3e-3, seq_len=128, batch_size=8, total_batch_size=1024, max_steps=200, eval_every=50, save_every=100),
    "small": dict(lr=3e-3, seq_len=256, batch_size=8, total_batch_size=2048, max_steps=300, eval_every=50, save_every=100),
    "180m": dict(lr=3e-3, seq_len=2048, batch_size=16, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
    "440m": dict(lr=1.5e-3, seq_len=2048, batch_size=8, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
    "880m": dict(lr=1.25e-3, seq_len=2048, batch_size=4, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
    "1.5b": dict(lr=1e-3, seq_len=2048, batch_size=2, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
}
# Dense bf16 peak FLOP/s by device name, for MFU (not shown on devices missing here).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "L4": 121e12, "A10G": 125e12, "A10": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}
EXPLODED = 1e3  # weights this many times larger (max |w|) than at the start are poison: never saved
MAX_ROLLBACKS = 3  # rolled back to the same checkpoint this many times in a row: the run cannot recover alone


def preset(key, what):
    """Help text for a flag whose default is the preset's: the values behind "(preset)"."""
    values = ", ".join(f"{name} {r[key]:g}" if r[key] else f"{name} 20 tok/param" for name, r in RECIPES.items())
    return f"{what} [dim](preset: {values})[/dim]"


# -----------------------------------------------------------------------------
# the config: the command line's flags, resolved


@dataclass
class TrainConfig:
    """A run's settings. Its fields are train.py's flags (main takes its signature); resolve() then fills the
    (preset) ones from the recipe and settles auto. Saved as config.json and in every checkpoint's meta."""
    data: Annotated[List[str], Option("--data", help="Token data: a prepare.py directory, a nanoGPT .bin file or "
                                      "directory, a shard_*.bin directory or a Megatron prefix; repeat as DIR:WEIGHT "
                                      "to blend; 'synthetic' for random tokens (speed tests only).")]
    model: Annotated[Optional[Literal[tuple(PRESETS)]], Option(help="Model preset, which sets the (preset) defaults "
                                                                   "too [default: small, or --init-from's]")] = None
    init_from: Annotated[Optional[str], Option(help="Start from these weights (fresh optimizer, schedule and data): a "
                                               "run directory or an official mamba_ssm directory.")] = None
    seq_len: Annotated[Optional[int], Option(min=1, help=preset("seq_len", "Context length in tokens."))] = None
    batch_size: Annotated[Optional[int], Option(min=1, help=preset("batch_size", "Micro batch: sequences per device "
                                                                    "per micro-step."))] = None
    total_batch_size: Annotated[Optional[int], Option(min=1, help=preset("total_batch_size", "Tokens per optimizer "
                                                      "step over all devices; sets the accumulation."))] = None
    max_steps: Annotated[Optional[int], Option(min=1, help=preset("max_steps", "Optimizer steps."))] = None
    lr: Annotated[Optional[float], Option(help=preset("lr", "Peak learning rate (> 0)."))] = None
    min_lr: Annotated[float, Option(min=0, help="Final learning rate of the decay (at most --lr).")] = 1e-5
    warmup_steps: Annotated[Optional[int], Option(min=0, help="Linear warmup steps (default: 10% of --max-steps, at "
                                                  "most 2000).")] = None
    schedule: Annotated[Literal["cosine", "wsd"], Option(help="cosine: warmup, cosine decay; wsd: warmup, stable, "
                                                         "linear decay over the last 20%.")] = "cosine"
    weight_decay: Annotated[float, Option(min=0, help="AdamW weight decay (matrices only).")] = 0.1
    grad_clip: Annotated[float, Option(min=0, help="Clip the global gradient norm to this; 0: no clipping.")] = 1.0
    dtype: Annotated[Literal["auto", "bf16", "fp32"], Option(help="auto: bf16 autocast (float32 weights) where the "
                                                             "device has bf16 arithmetic, else fp32.")] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Option(help="auto: CUDA when available.")] = "auto"
    compile: Annotated[Optional[bool], Option("--compile/--no-compile", help="torch.compile the model (default: on "
                                              "CUDA only).")] = None
    grad_checkpointing: Annotated[bool, Option(help="Recompute each block in backward: less memory.")] = False
    vocab_size: Annotated[Optional[int], Option(min=1, help="Model vocabulary (default: the data's, else 50257).")] = None
    data_dtype: Annotated[Optional[Literal["uint16", "uint32", "int32"]], Option(help="Token dtype of raw sources "
                                                                                 "without a manifest (uint16).")] = None
    out_dir: Annotated[str, Option(help="Run directory: checkpoints, config.json, metrics.jsonl.")] = "out"
    resume: Annotated[str, Option(help="auto: the newest checkpoint that verifies; never: start fresh; STEP: exactly "
                                  "that step (newer steps are moved aside).")] = "auto"
    overwrite: Annotated[bool, Option(help="With --resume never: move an existing run aside into "
                                      "OUT_DIR/previous-TIME/ instead of refusing.")] = False
    save_every: Annotated[Optional[int], Option(min=1, help=preset("save_every", "Checkpoint every N steps and at "
                                                                   "the end."))] = None
    keep_last: Annotated[int, Option(min=0, help="Keep the newest K checkpoints; 0 keeps all.")] = 3
    eval_every: Annotated[Optional[int], Option(min=1, help=preset("eval_every", "Evaluate every N steps."))] = None
    eval_batches: Annotated[int, Option(min=1, help="Micro-batches of validation windows per eval.")] = 20
    log_every: Annotated[int, Option(min=1, help="Log a line and a metrics.jsonl record every N steps.")] = 10
    nan_guard: Annotated[int, Option(min=0, help="After N non-finite steps in a row, roll back to the newest "
                                     "checkpoint; 0 never.")] = 5
    seed: Annotated[int, Option(min=0, help="Seeds the data order and the initialisation.")] = 0
    dry_run: Annotated[bool, Option(help="Run 2 steps and an eval; write nothing.")] = False


class TrainError(Exception):
    """An expected problem with the run's settings, data or directory; the CLI prints it as one paragraph."""


def bf16_native(device):
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN has bf16 kernels for this CPU
    except (AttributeError, RuntimeError):
        return False


def resolve(cfg: TrainConfig, init=None) -> TrainConfig:
    """The (preset) flags from the recipe, auto settled, and what cannot work refused before anything runs.
    With --init-from (init: its ModelConfig fields), the model is init's and the recipe its preset's."""
    model = cfg.model or "small"
    if init is not None:
        shape = lambda c: [getattr(c, k) for k in ("n_layer", "d_model", "expand", "headdim", "d_state", "ngroups",
                                                   "mlp_hidden", "rope_fraction")]  # noqa: E731
        same = [name for name, c in PRESETS.items() if shape(c) == shape(ModelConfig(**init))]
        if cfg.model and cfg.model not in same or cfg.vocab_size not in (None, init["vocab_size"]):
            raise TrainError(f"--init-from {cfg.init_from} is a model of its own shape ({init}); --model and "
                             f"--vocab-size may not change it: leave them out")
        model = cfg.model or (same + ["small"])[0]
    recipe = {k: getattr(cfg, k) if getattr(cfg, k) is not None else v for k, v in RECIPES[model].items()}
    if recipe["max_steps"] is None:  # Chinchilla-style horizon: 20 tokens per parameter
        with torch.device("meta"):
            recipe["max_steps"] = max(1, 20 * Mamba3LM(PRESETS[model]).num_params() // recipe["total_batch_size"])
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu (or auto)")
    # bf16 matmuls run at several times the float32 rate on GPUs and on CPUs with bf16 instructions (AVX512-BF16,
    # AMX): there bf16 autocast nearly halves a CPU step of the small preset, at the same loss
    dtype = ("bf16" if bf16_native(device) else "fp32") if cfg.dtype == "auto" else cfg.dtype
    if not recipe["lr"] > 0:
        raise TrainError(f"--lr must be positive, found {recipe['lr']}")
    tokens, seq_len = recipe["total_batch_size"], recipe["seq_len"]
    if tokens % seq_len:
        raise TrainError(f"--total-batch-size {tokens} tokens is not a multiple of --seq-len {seq_len}; use a "
                         f"multiple, e.g. {max(1, tokens // seq_len) * seq_len}")
    if cfg.resume not in ("auto", "never") and not cfg.resume.isdigit():
        raise TrainError(f"--resume {cfg.resume!r}: expected auto, never or a step number")
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else min(2000, max(1, recipe["max_steps"] // 10))
    return dataclasses.replace(cfg, **recipe, model=model, device=device, dtype=dtype, warmup_steps=warmup,
                               compile=device == "cuda" if cfg.compile is None else cfg.compile,
                               min_lr=min(cfg.min_lr, recipe["lr"]))


# -----------------------------------------------------------------------------
# setup: ranks, data, the learning rate


def setup_distributed(device):
    """(rank, world size, local rank): torchrun sets them in the environment; plain python is a world of one."""
    rank, world, local = (int(os.environ.get(k, 0)) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if "RANK" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return rank, max(world, 1), local


def open_data(cfg, rank, world, tmpdir):
    """--data -> (train Batches, val source or None, vocab size, tokenizer spec, data path). Missing, malformed
    or out-of-vocabulary data is refused here, before anything is built or written."""
    if cfg.data == ["synthetic"]:  # the only way this trainer ever touches random tokens
        vocab, path = cfg.vocab_size or 50257, Path(tmpdir) / "synthetic.bin"
        np.random.default_rng(cfg.seed).integers(0, vocab, 1 << 22).astype(np.uint32).tofile(path)
        sources, weights, val, tokenizer = [data.open_tokens(path, dtype=np.uint32)], None, None, None
    else:
        specs = []
        for spec in cfg.data:  # DIR or DIR:WEIGHT
            head, sep, tail = spec.rpartition(":")
            if spec == "synthetic":
                raise TrainError("--data synthetic trains on random tokens and cannot be blended with real data")
            if sep and not Path(spec).exists() and not (tail.replace(".", "", 1).isdigit() and float(tail) > 0):
                raise TrainError(f"--data {spec!r}: expected DIR or DIR:WEIGHT with a positive number after the colon")
            specs.append((head, float(tail)) if sep and not Path(spec).exists() else (spec, 1.0))
        sources = [data.open_tokens(path, "train", cfg.data_dtype) for path, _ in specs]
        weights = [w for _, w in specs] if len(specs) > 1 else None
        val = data.open_tokens(specs[0][0], "val", cfg.data_dtype) if "val" in data.splits(specs[0][0]) else None
        vocab, tokenizer = cfg.vocab_size or sources[0].vocab_size or 50257, sources[0].tokenizer
        for s in sources + [val] * (val is not None):
            data.check_vocab(s, vocab)
        if val is not None and val.num_tokens < cfg.seq_len + 1:  # a short first document, say: the header says
            val = None  # that evaluation is off; the training itself is still worth running
    batches = data.Batches(sources, cfg.seq_len, cfg.batch_size, cfg.total_batch_size // cfg.seq_len, rank, world,
                           cfg.seed, weights, "cuda" if cfg.device == "cuda" else "cpu", prefetch=cfg.device == "cuda")
    return batches, val, vocab, tokenizer, sources[0].path


def lr_at(step, cfg):
    """Linear warmup, then cosine to min_lr, or WSD: warmup, stable at lr, linear decay over the last 20%."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay_start = int(cfg.max_steps * 0.8)
        return cfg.lr + max(0.0, (step - decay_start) / max(1, cfg.max_steps - decay_start)) * (cfg.min_lr - cfg.lr)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


# -----------------------------------------------------------------------------
# the step's pieces


def micro_step(model, x, y, autocast):
    """Forward one micro-batch; returns the mean loss. Its own function so that tests can inject faults."""
    with autocast:
        return model(x, y)[1]


@torch.no_grad()
def evaluate(model, val, cfg, rank, world):
    """Mean loss over the fixed validation windows (the same ones at every eval), summed across ranks."""
    model.eval()
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of token losses, tokens
    for x, y in data.val_batches(val, cfg.seq_len, cfg.batch_size, cfg.eval_batches, rank, world, device):
        total += torch.stack([micro_step(model, x, y, autocast).double() * y.numel(), total.new_tensor(y.numel())])
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def max_abs_weight(model):
    return torch.stack([p.detach().abs().max() for p in model.parameters()]).max().item()


# -----------------------------------------------------------------------------
# logging: one sink


class Log:
    """Rank 0's one sink: log(line, **record) prints the line and appends the record to metrics.jsonl and to
    wandb. metrics.jsonl opens at the first record (a run refused at start-up leaves nothing); wandb runs when
    WANDB_PROJECT is set and reads its own WANDB_* variables; a progress bar shows on terminals only."""

    def __init__(self, cfg, rank):
        self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
        self.on = rank == 0
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if self.on and not cfg.dry_run else None
        self.file = self.progress = self.wandb = None

    def __call__(self, line=None, **record):
        if not self.on:
            return
        if line is not None:
            self.console.print(line)
            self.console.file.flush()  # lines reach a log file or a pipe as they happen
        if record and self.path is not None:
            self.file = self.file or open(self.path, "a")
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        with contextlib.suppress(Exception):  # a logging service must never stop training
            if record and self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

    def start(self, cfg, step, run_id):
        """The progress bar and wandb (the run id kept in the checkpoints continues the same wandb run)."""
        if self.on and sys.stdout.isatty():
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self.task = self.progress.add_task("train", total=cfg.max_steps, completed=step)
            self.progress.start()
        if self.on and os.environ.get("WANDB_PROJECT") and not cfg.dry_run:
            try:
                import wandb

                self.wandb = wandb.init(id=run_id, resume="allow", config=asdict(cfg))
                return self.wandb.id
            except Exception as e:  # noqa: BLE001
                self(f"[yellow]warning: wandb disabled ({type(e).__name__}: {e})[/yellow]")
        return run_id

    def close(self):
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()


def header(log, cfg, model, batches, val):
    """The resolved run in one panel: what a reader of the log needs to know it is the run they meant."""
    c, world = model.config, batches.world_size
    gpu = f" ({torch.cuda.get_device_name()})" if cfg.device == "cuda" else ""
    lines = [f"model      {cfg.model}: {model.num_params():,} parameters ({c.n_layer} layers, d_model {c.d_model}, "
             f"vocab {c.vocab_size})",
             f"device     {cfg.device}{gpu}, dtype {cfg.dtype}, compile {'on' if cfg.compile else 'off'}, world size {world}",
             f"batch      {cfg.total_batch_size:,} tokens per step = {cfg.batch_size} seqs x {cfg.seq_len} tokens x "
             f"{batches.accum_steps} accumulation x {world} ranks",
             f"schedule   {cfg.max_steps} steps, lr {cfg.lr:g} -> {cfg.min_lr:g} ({cfg.schedule}, {cfg.warmup_steps} warmup)"]
    if cfg.data == ["synthetic"]:
        lines.append("data       SYNTHETIC random tokens (--data synthetic): the loss will not fall below ln(vocab)")
    else:
        tokens, planned = sum(s.num_tokens for s in batches.sources), cfg.total_batch_size * cfg.max_steps
        names = ", ".join(f"{s.path}" + (f" ({float(w):.0%} of the samples)" if len(cfg.data) > 1 else "")
                          for s, w in zip(batches.sources, batches.weights))
        lines.append(f"data       {names}: {tokens:,} tokens; {planned:,} planned = {planned / tokens:.2f} epochs")
        lines.append("eval       " + (f"every {cfg.eval_every} steps on {val.path} (val)" if val else
                                      "[bold yellow]off: no val split (or one shorter than seq_len + 1)[/bold yellow]"))
    if cfg.init_from:
        lines.append(f"init       weights from {cfg.init_from} (a resumed checkpoint takes precedence)")
    lines.append(f"out        {cfg.out_dir}" + (" (dry run: nothing written)" if cfg.dry_run else "") +
                 f", resume {cfg.resume}, save every {cfg.save_every} (keep {cfg.keep_last or 'all'})")
    lines.append(f"optimizer  AdamW, weight decay {cfg.weight_decay:g}, grad clip {cfg.grad_clip:g}, nan guard "
                 f"{cfg.nan_guard}, seed {cfg.seed}" + (", grad checkpointing" if cfg.grad_checkpointing else ""))
    if log.on:
        log.console.print(Panel("\n".join(lines), title="mamba3-lite train", expand=False))


# -----------------------------------------------------------------------------
# the run directory: lock, resume, branches, checkpoints


def lock(out):
    """An exclusive lock on OUT/.lock for the whole run, so a second run on the same directory is refused; the
    OS drops it when the process ends, however it ends (kill -9 too). Returns the open lock file."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        f = open(out / ".lock", "a+")
    except OSError as e:
        raise TrainError(f"--out-dir {out} is not writable ({e.strerror}); choose another or fix its permissions") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise TrainError(f"{out} is in use by another run ({f.read().strip() or 'unknown process'}); wait for it to "
                         f"finish or stop it, or train into another --out-dir") from None
    f.truncate(0)
    f.write(f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def move_aside(out, prefix, steps, after=None):
    """Move the files of `steps` into OUT/PREFIX-TIME/ (nothing a user had is deleted) with metrics.jsonl's
    records past step `after`, or with metrics.jsonl and config.json whole when after is None."""
    aside = out / time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
    aside.mkdir()
    for p in (p for s in steps for p in ckpt.step_files(out)[s]):
        shutil.move(p, aside / p.name)
    for p in (out / "metrics.jsonl", out / "config.json") if after is None else ():
        if p.exists():
            shutil.move(p, aside / p.name)
    if after is not None:
        split_metrics(out / "metrics.jsonl", after, aside / "metrics.jsonl")
    return aside


def split_metrics(path, step, aside=None):
    """Keep metrics.jsonl's records of steps <= step (rewritten atomically) and move those past it to `aside`,
    or drop them: after a resume each (kind, step) is recorded once, even when a crash made steps run twice."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    if len(keep) < len(lines):
        if aside is not None:
            aside.write_text("".join(line for line in lines if json.loads(line)["step"] > step))
        path.with_name(".metrics.jsonl.tmp").write_text("".join(keep))
        os.replace(path.with_name(".metrics.jsonl.tmp"), path)


def resume(cfg, model, optimizer, log):
    """Load what --resume asks for and return its meta, or None for a fresh start. Steps newer than the one
    resumed (an abandoned branch, or steps that fail verification) are moved aside before anything is saved."""
    out, device, writes = Path(cfg.out_dir), next(model.parameters()).device, log.on and not cfg.dry_run
    files = ckpt.step_files(out)
    if cfg.resume == "never":
        if files and not cfg.overwrite:
            raise TrainError(f"{out} already holds checkpoints (steps {sorted(files)}) and --resume never was given; "
                             f"use --resume auto to continue that run, another --out-dir, or --overwrite to move "
                             f"the old run aside into {out}/previous-TIME/")
        if files and writes:
            log(f"moved the previous run aside into {move_aside(out, 'previous', files)}")
        return None
    if cfg.resume == "auto":
        step, meta = ckpt.load_latest(out, model, optimizer, map_location=device, restore_rng=True)
        if step is None and files:
            names = ", ".join(p.name for ps in files.values() for p in ps)
            raise TrainError(f"{out} holds checkpoint files but no step verifies ({names[:400]}); nothing was "
                             f"changed. Use --resume STEP to pick a step, or --resume never --overwrite to move "
                             f"them aside into {out}/previous-TIME/ and start afresh")
    else:
        step = int(cfg.resume)
        meta = ckpt.load(out, step, model, optimizer, map_location=device, restore_rng=True)
    newer = [s for s in files if step is not None and s > step]
    if newer and writes:
        log(f"[yellow]moved the newer steps {newer} and their records aside into "
            f"{move_aside(out, 'abandoned', newer, after=step)}[/yellow]")
    elif step is not None and writes:
        split_metrics(out / "metrics.jsonl", step)  # the records of steps a crash made us run twice
    if step is not None:
        log(f"resumed from {out} step {step}", kind="event", event="resume", step=step)
    return meta


def save_checkpoint(cfg, step, model, optimizer, state):
    """Write step `step` (with retention). Its own function so that tests can inject faults around it."""
    meta = dict(state, tag="final" if step == cfg.max_steps else "periodic", config=asdict(cfg))
    ckpt.save(cfg.out_dir, step, model, optimizer, meta, keep_last=cfg.keep_last or None)


# -----------------------------------------------------------------------------
# the run


def train(cfg: TrainConfig, init=None):
    """Run cfg; init is --init-from's (ModelConfig fields, state dict, tokenizer spec), or None."""
    rank, world, local = setup_distributed(cfg.device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(cfg, init, (rank, world, local), tmp)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(cfg, init, ranks, tmp):
    # --- setup: everything that can be refused is refused before the run directory is touched
    (rank, world, local), (init_config, init_state, init_tokenizer) = ranks, init or (None, None, None)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = f"cuda:{local}" if cfg.device == "cuda" else "cpu"
    if init_config:  # the data must fit the weights' vocabulary, and the same tokenizer is the only sensible one
        cfg = dataclasses.replace(cfg, vocab_size=init_config["vocab_size"])
    batches, val, vocab, tokenizer, data_path = open_data(cfg, rank, world, tmp)
    if init_tokenizer and tokenizer and init_tokenizer.get("name") != tokenizer.get("name"):
        raise TrainError(f"--init-from {cfg.init_from} was trained with the {init_tokenizer['name']} tokenizer, the "
                         f"data with {tokenizer['name']}: the token ids would mean other things")
    model_config = ModelConfig(**init_config) if init_config else dataclasses.replace(PRESETS[cfg.model], vocab_size=vocab)
    model = Mamba3LM(model_config)
    if init_state is not None:
        model.load_state_dict(init_state)  # weights only: the optimizer, schedule and data start afresh
    model = model.to(device)
    model.grad_checkpointing = cfg.grad_checkpointing
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=cfg.device == "cuda")
    out, writes = Path(cfg.out_dir), rank == 0 and not cfg.dry_run  # rank 0 alone writes checkpoints and logs
    if cfg.resume.isdigit():
        ckpt.read_meta(out, int(cfg.resume))  # a step that does not exist is refused before anything is locked
    lock_file = lock(out) if writes else None
    log = Log(cfg, rank)
    meta = resume(cfg, model, optimizer, log) or dict(step=0, tokens_seen=0, skipped_steps=0, data=None)
    step, tokens_seen, skipped, run_id = meta["step"], meta["tokens_seen"], meta["skipped_steps"], meta.get("wandb_run_id")
    if meta["data"] is not None:
        batches.load_state_dict(meta["data"])
    if cfg.max_steps < step:
        raise TrainError(f"--max-steps {cfg.max_steps} is below the resumed step {step}; raise it to train further")
    start_step, wall = step, meta.get("wall_time", 0.0)
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, max_steps=step + 2, log_every=1)
    if writes:
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        if tokenizer and tokenizer.get("name") == "file":  # sample.py finds the tokenizer beside the checkpoints
            shutil.copy(Path(data_path) / tokenizer["file"], out / tokenizer["file"])
    header(log, cfg, model, batches, val)
    run_id = log.start(cfg, step, run_id)

    raw_model = model  # what is saved and restored; `model` may be wrapped for speed or for DDP
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cfg.device == "cuda" else None)
    autocast = torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    flops = raw_model.flops_per_token(cfg.seq_len)
    peak = next((f for k, f in PEAK_FLOPS.items() if k in torch.cuda.get_device_name()), None) if cfg.device == "cuda" else None
    limit = EXPLODED * max(1.0, max_abs_weight(raw_model))  # weights beyond it have exploded

    stop = []  # SIGTERM / SIGINT: finish the current step, save, exit cleanly
    previous = {s: signal.signal(s, lambda signum, frame: stop.append(signal.Signals(signum).name))
                for s in (signal.SIGTERM, signal.SIGINT)}
    bad_streak, rollbacks = 0, []  # non-finite steps in a row; the steps restored since the last healthy save
    window = dict(loss=0.0, norm=0.0, good=0, steps=0, t=time.time())  # sums over the steps since the last log
    t_start = time.time()
    try:
        while True:
            last = step == cfg.max_steps

            # --- evaluate and save when due (and at the end, inside the loop so the last step gets both); their
            # time is kept out of the throughput figures
            t_pause = time.time()
            if val is not None and (last or (step % cfg.eval_every == 0 and step > start_step)):
                val_loss = evaluate(model, val, cfg, rank, world)
                ppl = math.exp(min(val_loss, 50))
                log(f"step {step}: val loss {val_loss:.4f}, ppl {ppl:.2f}", kind="eval", step=step, val_loss=val_loss,
                    val_ppl=ppl)
            if step > start_step and (last or step % cfg.save_every == 0 or stop):
                # poison is never saved: not in a non-finite streak, nor weights that blew up while finite
                top = max_abs_weight(raw_model)
                if bad_streak:
                    log(f"[yellow]step {step}: not saved: {bad_streak} non-finite steps in a row[/yellow]",
                        kind="event", event="not_saved", step=step)
                elif not top <= limit:  # (nan fails it too)
                    log(f"[yellow]step {step}: not saved: the weights have exploded (max |w| {top:.3g})[/yellow]",
                        kind="event", event="not_saved", step=step)
                    bad_streak = max(1, cfg.nan_guard)  # as bad as a full streak: roll back below
                else:
                    rollbacks = []
                    if writes:
                        t0 = time.time()
                        save_checkpoint(cfg, step, raw_model, optimizer, dict(
                            tokens_seen=tokens_seen, skipped_steps=skipped, optimizer_steps=step - skipped,
                            data=batches.state_dict(), wandb_run_id=run_id, tokenizer=tokenizer,
                            wall_time=wall + time.time() - t_start))
                        log(f"step {step}: saved checkpoint to {out} ({time.time() - t0:.1f}s)", kind="event",
                            event="checkpoint", step=step)
            window["t"] += time.time() - t_pause
            if (stop or last) and bad_streak:
                raise TrainError(f"the run ended at step {step} inside a streak of {bad_streak} bad steps, which "
                                 f"was not saved; resume from the newest checkpoint in {out} with a lower --lr")
            if stop:
                log(f"stopped by {stop[0]} at step {step}; resume with --resume auto")
            if stop or last:
                break

            if not (cfg.nan_guard and bad_streak >= cfg.nan_guard):
                # --- one optimizer step: accumulate over micro-steps, then clip and update unless non-finite
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                for m in range(batches.accum_steps):
                    x, y = next(batches)
                    # DDP averages the gradients across ranks once per optimizer step, not per micro-step
                    with model.no_sync() if world > 1 and m < batches.accum_steps - 1 else contextlib.nullcontext():
                        loss = micro_step(model, x, y, autocast)
                        (loss / batches.accum_steps).backward()
                    loss_sum += loss.detach()
                if world > 1:
                    dist.all_reduce(loss_sum)  # a sum: gloo has no average
                loss = loss_sum.item() / (batches.accum_steps * world)
                norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf).item()
                if math.isfinite(loss) and math.isfinite(norm):
                    optimizer.step()
                    bad_streak = 0
                    window.update(loss=window["loss"] + loss, norm=window["norm"] + norm, good=window["good"] + 1)
                else:
                    skipped, bad_streak = skipped + 1, bad_streak + 1
                    log(f"[yellow]step {step}: non-finite loss or gradient norm, update skipped ({bad_streak} in a "
                        f"row, {skipped} in all)[/yellow]", kind="event", event="nonfinite", step=step)
                optimizer.zero_grad(set_to_none=True)
                step, tokens_seen, window["steps"] = step + 1, tokens_seen + cfg.total_batch_size, window["steps"] + 1

            # --- the NaN guard: restore the newest checkpoint that verifies; the data cursor keeps moving, so the
            # batches that poisoned the run are not replayed
            if cfg.nan_guard and bad_streak >= cfg.nan_guard:
                restored, _ = ckpt.load_latest(out, raw_model, optimizer, map_location=device)
                if restored is None:
                    raise TrainError(f"{bad_streak} bad steps in a row at step {step} and no checkpoint in {out} to "
                                     f"roll back to; lower --lr, check the data, or raise --nan-guard")
                log(f"[yellow]step {step}: {bad_streak} bad steps in a row, restored the weights of step {restored}; "
                    f"the data continues from step {step}[/yellow]", kind="event", event="rollback", step=step,
                    restored=restored)
                rollbacks, bad_streak = rollbacks + [restored], 0
                if rollbacks[-MAX_ROLLBACKS:] == [restored] * MAX_ROLLBACKS:
                    raise TrainError(f"rolled back to step {restored} {MAX_ROLLBACKS} times in a row and the run went "
                                     f"bad again each time (last at step {step}); lower --lr (now {cfg.lr:g}) or "
                                     f"check the data around these steps")
            if world > 1:  # agree on a signal, so that every rank saves and stops at the same step
                flag = torch.tensor([float(bool(stop))], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() and not stop:
                    stop.append("a signal on another rank")

            # --- log: the mean loss of the steps since the last line (skipped steps excluded)
            if log.progress is not None:
                log.progress.update(log.task, completed=step)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                dt, good = time.time() - window["t"], window["good"]
                loss = window["loss"] / good if good else float("nan")
                rec = dict(kind="train", step=step, loss=loss if good else None, ppl=math.exp(min(loss, 50)) if good
                           else None, lr=lr_at(step - 1, cfg), grad_norm=window["norm"] / good if good else None,
                           tok_per_s=window["steps"] * cfg.total_batch_size / dt, ms_per_step=1000 * dt / window["steps"])
                if peak:
                    rec["mfu"] = flops * rec["tok_per_s"] / (peak * world)
                log(f"step {step}: loss {loss:.4f}, ppl {math.exp(min(loss, 50)):.2f}, lr {rec['lr']:.2e}, grad norm "
                    f"{window['norm'] / max(1, good):.3f}, {rec['tok_per_s']:,.0f} tok/s, {rec['ms_per_step']:.0f} "
                    f"ms/step" + (f", MFU {rec['mfu']:.1%}" if peak else ""), **rec)
                window.update(loss=0.0, norm=0.0, good=0, steps=0, t=time.time())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.close()
        batches.close()
        if lock_file is not None:
            lock_file.close()


# -----------------------------------------------------------------------------
# command line

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


@app.command(help=__doc__.split("\n\n")[0] + "\n\nResumes from the newest checkpoint in --out-dir by default "
             "(--resume auto). Flags marked (preset) default to the preset's recipe.")
def main(**flags):
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        cfg = TrainConfig(**flags)
        init = official.read_pretrained(cfg.init_from) if cfg.init_from else None
        train(resolve(cfg, init and init[0]), init)
    except (TrainError, data.DataError, ckpt.CheckpointError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:  # before training started (after it, Ctrl-C saves and exits cleanly)
        raise typer.Exit(130)


main.__signature__ = inspect.signature(TrainConfig)  # the flags are TrainConfig's fields, defined once above

if __name__ == "__main__":
    app()
