"""Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

    python prepare.py && python train.py --data data/demo         # CPU quickstart (small preset)
    python train.py --data data/fineweb --model 180m               # one GPU
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
    python train.py --data synthetic --model 440m --max-steps 50   # random tokens, for speed tests

Read it top to bottom: the recipes (every preset's defaults), the config (which is the command line), the
helpers the loop uses, then `run`: the setup, and the loop -- one optimizer step, the NaN guard, log,
evaluate and save when due. A checkpoint holds all a resumed run needs to continue bit for bit: weights,
optimizer, data position, step and RNG states.
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

import numpy as np
import torch
import torch.distributed as dist
import typer
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import Progress
from typer import Option

import ckpt
import data
import official
from model import PRESETS, Mamba3LM, ModelConfig, bf16_native, peak_flops

# -----------------------------------------------------------------------------
# the recipes and the config: every preset's defaults in one table, and the flags

# The GPU presets follow the paper's recipe (Mamba-2's): peak LR about 5x GPT-3's for the size, context
# 2048, ~0.5M-token batches, and max_steps None = Chinchilla's 20 tokens per parameter. The CPU presets use
# short contexts and small batches, so that a laptop sees the loss fall in about a minute.
RECIPES = {name: dict(zip(("lr", "seq_len", "batch_size", "total_batch_size", "max_steps", "eval_every",
                           "save_every"), values)) for name, values in [
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


def preset(key, what):
    """Help text for a flag whose default is the preset's: the values behind "(preset)"."""
    values = ", ".join(f"{p} {r[key]:g}" if r[key] else f"{p} 20 tok/param" for p, r in RECIPES.items())
    return f"{what} [dim](preset: {values})[/dim]"


@dataclasses.dataclass
class TrainConfig:
    """A run's settings. The fields are train.py's flags (main takes this signature); resolve() fills the
    (preset) ones and settles auto. Saved as config.json and in every checkpoint's meta."""
    data: Annotated[List[str], Option("--data", help="Token data: a prepare.py directory, a nanoGPT .bin file or "
                    "directory, a shard_*.bin directory or a Megatron prefix; DIR:WEIGHT (repeated) blends; "
                    "'synthetic' is random tokens (speed tests only).")]
    model: Annotated[Optional[Literal[tuple(PRESETS)]], Option(help="Model preset; sets the (preset) defaults "
                     "too (default: small, or --init-from's).")] = None
    init_from: Annotated[Optional[str], Option(help="Start from these weights (fresh optimizer, schedule, data): "
                         "a run directory or an official mamba_ssm directory.")] = None
    reset_at_eos: Annotated[bool, Option(help="Reset the state after each EOS (document), also in decoding.")] = False
    seq_len: Annotated[Int, Option(min=1, help=preset("seq_len", "Context length."))] = None
    batch_size: Annotated[Int, Option(min=1, help=preset("batch_size", "Sequences per device and micro-step."))] = None
    total_batch_size: Annotated[Int, Option(min=1, help=preset("total_batch_size", "Tokens per optimizer step "
                                "over all devices; sets the accumulation."))] = None
    max_steps: Annotated[Int, Option(min=1, help=preset("max_steps", "Optimizer steps."))] = None
    lr: Annotated[Optional[float], Option(help=preset("lr", "Peak learning rate (> 0)."))] = None
    min_lr: Annotated[float, Option(min=0, help="Final learning rate (at most --lr).")] = 1e-5
    warmup_steps: Annotated[Int, Option(min=0, help="Warmup steps (default: 10% of --max-steps, <= 2000).")] = None
    schedule: Annotated[Literal["cosine", "wsd"], Option(help="After warmup: cosine decay, or wsd: stable, "
                        "then linear decay over the last 20%.")] = "cosine"
    weight_decay: Annotated[float, Option(min=0, help="AdamW weight decay (matrices only).")] = 0.1
    grad_clip: Annotated[float, Option(min=0, help="Clip the gradient norm to this; 0: never.")] = 1.0
    dtype: Annotated[Literal["auto", "bf16", "fp32"], Option(help="auto: bf16 autocast (float32 weights) where "
                     "the device has bf16 arithmetic, else fp32.")] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Option(help="auto: CUDA if there is one.")] = "auto"
    compile: Annotated[Optional[bool], Option("--compile/--no-compile", help="torch.compile; default: on CUDA.")] = None
    grad_checkpointing: Annotated[bool, Option(help="Recompute blocks in backward: less memory.")] = False
    vocab_size: Annotated[Int, Option(min=1, help="Model vocabulary (default: the data's, else 50257).")] = None
    data_dtype: Annotated[Optional[Literal["uint16", "uint32", "int32"]], Option(help="Token dtype of raw "
                          "sources without a manifest (default: uint16).")] = None
    out_dir: Annotated[str, Option(help="Run directory: checkpoints, config.json, metrics.jsonl.")] = "out"
    resume: Annotated[str, Option(help="auto: the newest checkpoint that verifies; never: start fresh; STEP: "
                      "that step (newer steps are moved aside).")] = "auto"
    overwrite: Annotated[bool, Option(help="With --resume never: move an old run aside into "
                         "OUT_DIR/previous-TIME/ instead of refusing.")] = False
    save_every: Annotated[Int, Option(min=1, help=preset("save_every", "Save every N steps and at the end."))] = None
    keep_last: Annotated[int, Option(min=0, help="Keep the newest K checkpoints; 0 keeps all.")] = 3
    eval_every: Annotated[Int, Option(min=1, help=preset("eval_every", "Evaluate every N steps."))] = None
    eval_batches: Annotated[int, Option(min=1, help="Micro-batches of val windows per eval.")] = 20
    log_every: Annotated[int, Option(min=1, help="A log line and metrics record every N steps.")] = 10
    nan_guard: Annotated[int, Option(min=0, help="After N non-finite steps in a row, roll back to the newest "
                         "checkpoint; 0: never.")] = 5
    seed: Annotated[int, Option(min=0, help="Seeds the data order and the initialisation.")] = 0
    dry_run: Annotated[bool, Option(help="Run 2 steps and an eval; write nothing.")] = False


class TrainError(Exception):
    """An expected problem with the run's settings, data or directory: printed as one paragraph."""


def resolve(cfg, init=None):
    """The (preset) flags from the recipe, auto settled, and what cannot work refused before anything runs.
    With --init-from (init: its ModelConfig fields), the recipe is that of its shape's preset."""
    model = cfg.model or "small"
    if init is not None:
        keys = ("n_layer", "d_model", "expand", "headdim", "d_state", "ngroups", "mlp_hidden")
        same = [p for p, c in PRESETS.items() if all(getattr(c, k) == init[k] for k in keys)]
        if cfg.model and cfg.model not in same or cfg.vocab_size not in (None, init["vocab_size"]):
            raise TrainError(f"--init-from {cfg.init_from} is a model of its own shape ({init}); --model and "
                             f"--vocab-size may not change it: leave them out")
        model = cfg.model or (same + ["small"])[0]
    recipe = {k: v if getattr(cfg, k) is None else getattr(cfg, k) for k, v in RECIPES[model].items()}
    if recipe["max_steps"] is None:  # Chinchilla-style horizon: 20 tokens per parameter
        with torch.device("meta"):
            recipe["max_steps"] = max(1, 20 * Mamba3LM(PRESETS[model]).num_params() // recipe["total_batch_size"])
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu")
    if not recipe["lr"] > 0:
        raise TrainError(f"--lr must be positive, found {recipe['lr']}")
    if (tokens := recipe["total_batch_size"]) % (seq_len := recipe["seq_len"]):
        raise TrainError(f"--total-batch-size {tokens} tokens is not a multiple of --seq-len {seq_len}; use a "
                         f"multiple, e.g. {max(1, tokens // seq_len) * seq_len}")
    if cfg.resume not in ("auto", "never") and not cfg.resume.isdigit():
        raise TrainError(f"--resume {cfg.resume!r}: expected auto, never or a step number")
    return dataclasses.replace(
        cfg, **recipe, model=model, device=device, min_lr=min(cfg.min_lr, recipe["lr"]),
        vocab_size=init["vocab_size"] if init else cfg.vocab_size,  # the data must fit the weights' vocabulary
        dtype=("bf16" if bf16_native(device) else "fp32") if cfg.dtype == "auto" else cfg.dtype,
        warmup_steps=min(2000, max(1, recipe["max_steps"] // 10)) if cfg.warmup_steps is None else cfg.warmup_steps,
        compile=device == "cuda" if cfg.compile is None else cfg.compile)


# -----------------------------------------------------------------------------
# the helpers the loop uses: the model, the learning rate, evaluation, the log, the run directory


def build_model(cfg, init, source):
    """The model of the preset (or of --init-from, with its weights), resetting at the data's EOS when asked;
    init is read_pretrained's (config, state, tokenizer) or None."""
    config = ModelConfig(**init[0]) if init else dataclasses.replace(PRESETS[cfg.model], vocab_size=cfg.vocab_size)
    if cfg.reset_at_eos and source.eos_id is None:
        raise TrainError(f"--reset-at-eos needs data that records its EOS id (a prepare.py directory); "
                         f"{source.path} does not")
    if init and init[2] and source.tokenizer and init[2]["name"] != source.tokenizer["name"]:
        raise TrainError(f"--init-from {cfg.init_from} was trained with the {init[2]['name']} tokenizer, the "
                         f"data with {source.tokenizer['name']}: token ids would mean other things")
    model = Mamba3LM(dataclasses.replace(config, reset_token=source.eos_id) if cfg.reset_at_eos else config)
    if init:
        model.load_state_dict(init[1])  # weights only: the optimizer, schedule and data start afresh
    model.grad_checkpointing = cfg.grad_checkpointing
    return model


def lr_at(step, cfg):
    """Linear warmup, then cosine to min_lr; or WSD: warmup, stable, linear decay over the last 20%."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = int(cfg.max_steps * 0.8)
        return cfg.lr + max(0.0, (step - start) / max(1, cfg.max_steps - start)) * (cfg.min_lr - cfg.lr)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def micro_step(model, x, y, autocast):
    """Forward one micro-batch; returns the mean loss. Its own function so that tests can inject faults."""
    with autocast:
        return model(x, y)[1]


@torch.no_grad()
def evaluate(model, val, cfg, autocast, rank, world):
    """Mean loss over the fixed validation windows (the same at every eval), summed across ranks."""
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of token losses, tokens
    for x, y in data.val_batches(val, cfg.seq_len, cfg.batch_size, cfg.eval_batches, rank, world, device):
        total[0] += micro_step(model, x, y, autocast).double() * y.numel()
        total[1] += y.numel()
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def max_abs_weight(model):
    return torch.stack([p.detach().abs().max() for p in model.parameters()]).max().item()


class Log:
    """The one sink: log(line, **record) prints the line, appends the record to metrics.jsonl (created at the first
    record: a run refused at start-up leaves nothing) and sends it to wandb when WANDB_PROJECT is set (wandb reads
    its own WANDB_* variables; the checkpoints keep the run id). Rank 0 alone speaks, and a dry run writes nothing."""

    def __init__(self, cfg, rank):
        self.wandb, tty = None, sys.stdout.isatty()
        self.console = Console(highlight=False, width=None if tty else 200, quiet=rank != 0)
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if rank == 0 and not cfg.dry_run else None
        self.progress = Progress(console=self.console, transient=True, disable=rank != 0 or not tty)  # not in logs

    def __call__(self, line=None, **record):
        if line is not None:
            self.console.print(line)  # rich flushes: lines reach a log file or a pipe as they happen
        if record and self.path is not None:
            write(self.path, json.dumps(record) + "\n", "a")
        with contextlib.suppress(Exception):  # a logging service must never stop training
            if record and self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, record["step"])

    def start_wandb(self, cfg, run_id):
        """Start wandb (when this rank writes and WANDB_PROJECT is set); returns the run id the checkpoints keep."""
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
    c, tokens, planned = model.config, sum(s.num_tokens for s in batches.sources), cfg.total_batch_size * cfg.max_steps
    shares = [f" ({float(w):.0%} of the samples)" if len(cfg.data) > 1 else "" for w in batches.weights]
    lines = [f"model      {cfg.model}: {model.num_params():,} parameters ({c.n_layer} layers, d_model {c.d_model}, "
             f"vocab {c.vocab_size}{'' if c.reset_token is None else f', reset after token {c.reset_token}'})",
             f"device     {cfg.device}" + (f" ({torch.cuda.get_device_name()})" if cfg.device == "cuda" else "")
             + f", dtype {cfg.dtype}, compile {'on' if cfg.compile else 'off'}, world size {batches.world_size}",
             f"batch      {cfg.total_batch_size:,} tokens per step = {cfg.batch_size} seqs x {cfg.seq_len} tokens x "
             f"{batches.accum_steps} accumulation x {batches.world_size} ranks",
             "data       SYNTHETIC random tokens (--data synthetic): the loss stays at ln(vocab)"
             if cfg.data == ["synthetic"] else
             f"data       {', '.join(f'{s.path}{share}' for s, share in zip(batches.sources, shares))}: "
             f"{tokens:,} tokens; {planned:,} planned = {planned / tokens:.2f} epochs",
             f"eval       every {cfg.eval_every} steps on {val.path} (val)" if val else
             "eval       [bold yellow]off: no val split of seq_len + 1 tokens[/bold yellow]",
             f"out        {cfg.out_dir}" + (" (dry run: nothing written)" if cfg.dry_run else "") +
             f", resume {cfg.resume}, save every {cfg.save_every} (keep {cfg.keep_last or 'all'})",
             f"optimizer  AdamW for {cfg.max_steps} steps, lr {cfg.lr:g} -> {cfg.min_lr:g} ({cfg.schedule}, "
             f"{cfg.warmup_steps} warmup), weight decay {cfg.weight_decay:g}, grad clip {cfg.grad_clip:g}, nan "
             f"guard {cfg.nan_guard}, seed {cfg.seed}"] + [f"init from  {cfg.init_from}"] * bool(cfg.init_from)
    log.console.print(Panel("\n".join(lines), title="mamba3-lite train", expand=False))


def record_step(line):
    """The step of a metrics.jsonl line, or None for a record cut short (the disk filled during its append)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def write(path, text, mode="w"):
    """Write (or append) text; a full disk or a missing permission is a TrainError naming the file."""
    try:
        with open(path, mode) as f:
            f.write(text)
    except OSError as e:  # a failed write's error names no file
        raise TrainError(f"could not write {path} ({e.strerror or e}); free disk space or fix the permissions, then "
                         f"run again: it resumes from the newest checkpoint") from None


def move_aside(out, step, files, prefix):
    """Move the checkpoint `files` of steps after `step`, with their metrics records, into a new OUT/PREFIX-TIME/
    and return it (None if there are none): a branch left behind is never deleted. Records past `step` with no
    checkpoint (steps that will run again) are dropped, so that each (kind, step) is recorded once."""
    metrics = out / "metrics.jsonl"
    text = metrics.read_text() if metrics.exists() else ""
    records = [(line + "\n", s) for line in text.splitlines() if (s := record_step(line)) is not None]  # whole ones
    keep = [line for line, s in records if s <= step]
    paths = [p for s in sorted(files) if s > step for p in files[s]]
    aside = out / time.strftime(f"{prefix}-%Y%m%d-%H%M%S") if paths else None
    if aside:
        aside.mkdir()
        for p in paths + [out / "config.json"] * (step < 0 and (out / "config.json").exists()):
            shutil.move(p, aside / p.name)
        write(aside / metrics.name, "".join(line for line, s in records if s > step))
    if "".join(keep) != text:  # records dropped, or a last line without its newline, which the next would join
        write(metrics.with_name(".metrics.jsonl.tmp"), "".join(keep))
        os.replace(metrics.with_name(".metrics.jsonl.tmp"), metrics)
    return aside


def resume(cfg, model, optimizer, batches, log):
    """Load what --resume asks for (the data position into `batches`) and return its meta, or None for a fresh
    start. Steps newer than the one resumed (an abandoned branch, or ones that fail verification) and their records
    are moved aside."""
    out, device, writes = Path(cfg.out_dir), next(model.parameters()).device, log.path is not None
    files = ckpt.step_files(out)
    if cfg.resume == "never":
        if files and not cfg.overwrite:
            raise TrainError(f"{out} already holds checkpoints (steps {sorted(files)}) and --resume never was "
                             f"given; use --resume auto to continue that run, another --out-dir, or --overwrite "
                             f"to move the old run aside into {out}/previous-TIME/")
        if writes and (aside := move_aside(out, -1, files, "previous")):  # (records of a run that never saved: dropped)
            log(f"moved the previous run aside into {aside}")
        return None
    if cfg.resume == "auto":
        step, meta = ckpt.load_latest(out, model, optimizer, map_location=device, restore_rng=True)
        if step is None and files:
            names = ", ".join(p.name for ps in files.values() for p in ps)[:400]
            raise TrainError(f"{out} holds checkpoint files but no step verifies ({names}); nothing was changed. "
                             f"Use --resume STEP to pick a step, or --resume never --overwrite to move them aside "
                             f"into {out}/previous-TIME/ and start afresh")
    else:
        step = int(cfg.resume)
        meta = ckpt.load(out, step, model, optimizer, map_location=device, restore_rng=True)
    if step is not None:  # what cannot continue is refused before newer steps are moved aside
        if meta["data"] is not None:
            batches.load_state_dict(meta["data"])
        if cfg.max_steps < step:
            raise TrainError(f"--max-steps {cfg.max_steps} is below the resumed step {step}; raise it")
    if writes and (aside := move_aside(out, -1 if step is None else step, files, "abandoned")):
        log(f"[yellow]moved the newer steps {[s for s in files if s > step]} and their records aside into "
            f"{aside}[/yellow]")
    if step is not None:
        log(f"resumed from {out} step {step}", kind="event", event="resume", step=step)
    return meta


def save_checkpoint(cfg, step, model, optimizer, state):
    """Write step `step` (with retention). Its own function so that tests can inject faults around it."""
    meta = dict(state, tag="final" if step == cfg.max_steps else "periodic", config=dataclasses.asdict(cfg))
    ckpt.save(cfg.out_dir, step, model, optimizer, meta, keep_last=cfg.keep_last or None)


# -----------------------------------------------------------------------------
# the run, and its command line


def run(cfg, init, tmp, cleanup):
    """Train: set up, then loop. init is --init-from's (ModelConfig fields, state dict, tokenizer spec) or
    None; cleanup (an ExitStack) releases what the setup takes, however the run ends."""
    # --- setup: everything that can be refused is refused before the run directory is touched
    rank, world, local = (int(os.environ.get(k, 0)) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    world, device = max(world, 1), f"cuda:{local}" if cfg.device == "cuda" else "cpu"  # plain python: a world of 1
    if "RANK" in os.environ:  # set by torchrun
        if cfg.device == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if cfg.device == "cuda" else "gloo")
        cleanup.callback(dist.destroy_process_group)
    torch.manual_seed(cfg.seed)
    # the data: missing, malformed or out-of-vocabulary data is refused here, before anything is built or written
    sources, weights, val, vocab = data.open_blend(cfg.data, cfg.data_dtype, cfg.vocab_size, cfg.seed, tmp)
    batches = data.Batches(sources, cfg.seq_len, cfg.batch_size, cfg.total_batch_size // cfg.seq_len, rank, world,
                           cfg.seed, weights, cfg.device, prefetch=cfg.device == "cuda")
    cleanup.callback(batches.close)
    if val is not None and val.num_tokens < cfg.seq_len + 1:  # a short first document, say: the header says
        val = None  # that evaluation is off; the training itself is still worth running
    source = batches.sources[0]
    model = build_model(dataclasses.replace(cfg, vocab_size=vocab), init, source).to(device)
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=cfg.device == "cuda")
    out, writes = Path(cfg.out_dir), rank == 0 and not cfg.dry_run  # rank 0 alone writes
    if cfg.resume.isdigit():
        ckpt.read_meta(out, int(cfg.resume))  # a step that does not exist: refused before the lock
    if writes and (out / official.MARKER).is_file():
        raise TrainError(f"{out} is an export (it holds {official.MARKER}): a run would overwrite its config.json; "
                         f"use another --out-dir")
    if writes:
        cleanup.enter_context(ckpt.lock(out))  # one run per directory
    log = Log(cfg, rank)
    meta = resume(cfg, model, optimizer, batches, log) or dict(step=0, skipped_steps=0, data=None)
    step, skipped = meta["step"], meta["skipped_steps"]
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, max_steps=step + 2, log_every=1)
    if writes:
        write(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        if source.tokenizer and source.tokenizer.get("name") == "file":  # sample.py finds it beside the checkpoints
            shutil.copy(source.path / source.tokenizer["file"], out / source.tokenizer["file"])
    header(log, cfg, model, batches, val)
    run_id = log.start_wandb(cfg, meta.get("wandb_run_id"))
    bar = cleanup.enter_context(log.progress).add_task("train", total=cfg.max_steps, completed=step)

    raw_model = model  # what is saved and restored; `model` may be wrapped for speed or for DDP
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, [local] if cfg.device == "cuda" else None)
    autocast = torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    peak = peak_flops(torch.cuda.get_device_name()) if cfg.device == "cuda" else None  # for MFU; None: unknown
    limit = EXPLODED * max(1.0, max_abs_weight(raw_model))  # weights beyond it have exploded
    stop, stopping = [], False  # SIGTERM / SIGINT: finish the step, save, exit; stopping: all ranks agree
    for s in (signal.SIGTERM, signal.SIGINT):
        cleanup.callback(signal.signal, s, signal.signal(s, lambda sig, frame: stop.append(signal.Signals(sig).name)))
    bad_streak, rollbacks = 0, []  # non-finite steps in a row; steps restored since the last save
    good, logged, t_log = [], step, time.time()  # the good steps' (loss, norm) since the line logged at `logged`
    t_start = time.time() - meta.get("wall_time", 0.0)  # as if the run had never stopped
    while step < cfg.max_steps and not stopping:
        if not (cfg.nan_guard and bad_streak >= cfg.nan_guard):
            # --- one optimizer step: accumulate over micro-steps, clip, update unless non-finite
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            stats = torch.zeros(2, device=device)  # the micro-steps' summed loss; signals received
            for m in range(batches.accum_steps):
                x, y = next(batches)
                # DDP averages gradients across ranks once per optimizer step, not per micro-step
                with contextlib.nullcontext() if world == 1 or m == batches.accum_steps - 1 else model.no_sync():
                    loss = micro_step(model, x, y, autocast)
                    (loss / batches.accum_steps).backward()
                stats[0] += loss.detach()
            stats[1] = len(stop)
            if world > 1:  # a sum (gloo has no average); a signal on any rank stops every rank at the same step
                dist.all_reduce(stats)
            loss, stopping = stats[0].item() / (batches.accum_steps * world), stats[1].item() > 0
            norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf).item()
            if math.isfinite(loss) and math.isfinite(norm):
                optimizer.step()
                bad_streak = 0
                good.append((loss, norm))
            else:
                skipped, bad_streak = skipped + 1, bad_streak + 1
                log(f"[yellow]step {step}: non-finite loss or gradient norm, update skipped ({bad_streak} in a "
                    f"row, {skipped} in all)[/yellow]", kind="event", event="nonfinite", step=step)
            optimizer.zero_grad(set_to_none=True)
            step += 1

        # --- the NaN guard: restore the newest checkpoint that verifies; the data cursor keeps moving, so
        # the batches that poisoned the run are not replayed
        if cfg.nan_guard and bad_streak >= cfg.nan_guard:
            restored, _ = ckpt.load_latest(out, raw_model, optimizer, map_location=device)
            if restored is None:
                raise TrainError(f"{bad_streak} bad steps in a row at step {step} and no checkpoint in {out} to "
                                 f"roll back to; lower --lr, check the data or raise --nan-guard")
            log(f"[yellow]step {step}: {bad_streak} bad steps in a row, restored the weights of step {restored}; "
                f"the data continues from step {step}[/yellow]", kind="event", event="rollback", step=step,
                restored=restored)
            rollbacks, bad_streak = rollbacks + [restored], 0
            if rollbacks[-MAX_ROLLBACKS:] == [restored] * MAX_ROLLBACKS:
                raise TrainError(f"rolled back to step {restored} {MAX_ROLLBACKS} times in a row and the run went "
                                 f"bad again each time (last at step {step}); lower --lr (now {cfg.lr:g}) or "
                                 f"check the data around these steps")

        # --- log: the mean loss of the steps since the last line (skipped steps excluded)
        last = step == cfg.max_steps
        log.progress.update(bar, completed=step)
        if step > logged and (step % cfg.log_every == 0 or last):
            dt, loss, norm = time.time() - t_log, *(np.mean(good, axis=0) if good else (math.nan, math.nan))
            rec = dict(kind="train", step=step, loss=loss, ppl=math.exp(min(loss, 50)), lr=lr_at(step - 1, cfg),
                       grad_norm=norm, tok_per_s=(step - logged) * cfg.total_batch_size / dt,
                       ms_per_step=1000 * dt / (step - logged))
            rec["mfu"] = raw_model.flops_per_token(cfg.seq_len) * rec["tok_per_s"] / (peak * world) if peak else None
            # a window of skipped steps only: nan on the console, null (not NaN, which is not JSON) in the record
            log(f"step {step}: loss {loss:.4f}, ppl {rec['ppl']:.2f}, lr {rec['lr']:.2e}, grad norm {norm:.3f}, "
                f"{rec['tok_per_s']:,.0f} tok/s, {rec['ms_per_step']:.0f} ms/step"
                + (f", MFU {rec['mfu']:.1%}" if peak else ""), **{k: None if v != v else v for k, v in rec.items()})
            good, logged, t_log = [], step, time.time()

        # --- evaluate and save when due and at the end (save when stopped too), outside the throughput figures
        t_pause = time.time()
        if val is not None and (last or step % cfg.eval_every == 0):
            val_loss = evaluate(model, val, cfg, autocast, rank, world)
            ppl = math.exp(min(val_loss, 50))
            log(f"step {step}: val loss {val_loss:.4f}, ppl {ppl:.2f}", kind="eval", step=step, val_loss=val_loss,
                val_ppl=ppl)
        if last or stopping or step % cfg.save_every == 0:
            # poison is never saved: not in a non-finite streak, nor weights blown up while finite
            top = max_abs_weight(raw_model)
            why = f"{bad_streak} non-finite steps in a row" if bad_streak else (
                None if top <= limit else f"the weights have exploded (max |w| {top:.3g})")
            if why:
                log(f"[yellow]step {step}: not saved: {why}[/yellow]", kind="event", event="not_saved", step=step)
                bad_streak = bad_streak or max(1, cfg.nan_guard)  # blown up while finite: roll back at once
            elif writes:
                t0 = time.time()
                save_checkpoint(cfg, step, raw_model, optimizer, dict(
                    tokens_seen=step * cfg.total_batch_size, skipped_steps=skipped, optimizer_steps=step - skipped,
                    data=batches.state_dict(), wandb_run_id=run_id, tokenizer=source.tokenizer,
                    wall_time=time.time() - t_start))
                log(f"step {step}: saved checkpoint to {out} ({time.time() - t0:.1f}s)", kind="event",
                    event="checkpoint", step=step)
            rollbacks = rollbacks if why else []
        t_log += time.time() - t_pause
    if bad_streak:
        raise TrainError(f"the run ended at step {step} in a streak of bad steps, which was not saved; "
                         f"resume from the newest checkpoint in {out} with a lower --lr")
    if stopping:
        log(f"stopped by {stop[0] if stop else 'a signal on another rank'} at step {step}; resume with --resume auto")


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


@app.command(help=__doc__.split("\n\n")[0] + "\n\nResumes from the newest checkpoint in --out-dir by default "
             "(--resume auto). Flags marked (preset) default to the preset's recipe.")
def main(**flags):
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        cfg = TrainConfig(**flags)
        init = official.read_pretrained(cfg.init_from) if cfg.init_from else None
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
            run(resolve(cfg, init and init[0]), init, tmp, cleanup)
    except (TrainError, data.DataError, ckpt.CheckpointError, OSError) as e:  # OSError: the disk's, named by the OS
        err = Console(stderr=True, highlight=False, quiet=os.environ.get("RANK", "0") != "0")  # rank 0 speaks
        err.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:  # before training started (after it, Ctrl-C saves and exits cleanly)
        raise typer.Exit(130)


main.__signature__ = inspect.signature(TrainConfig)  # the flags are TrainConfig's fields, written once

if __name__ == "__main__":
    app()
