"""Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

    python prepare.py && python train.py --data data/demo                  # CPU quickstart (small preset)
    python train.py --data data/fineweb --model 180m                        # one GPU
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
    python train.py --data synthetic --model 440m --max-steps 50            # random tokens, for speed tests

The loop, top to bottom: evaluate and save when due, then one optimizer step (micro-steps with gradient
accumulation, clip, skip non-finite updates), then log. A checkpoint carries everything a resumed run needs
to continue bit for bit: weights, optimizer, data-loader position, step, tokens seen, RNG states.
"""
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
import typer
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

import ckpt
import data
from model import PRESETS, Mamba3LM

# Per-preset defaults (MAMBA3.md §4 recipe: peak LR about 5x GPT-3's for the size, context 2048, ~0.5M-token
# batches). The CPU presets use short contexts and small batches so that a laptop sees the loss fall in minutes.
# max_steps None means Chinchilla-style: 20 tokens per parameter.
RECIPES = {
    "tiny": dict(lr=3e-3, seq_len=128, batch_size=8, total_batch_size=1024, max_steps=200, eval_every=50, save_every=100),
    "small": dict(lr=3e-3, seq_len=256, batch_size=8, total_batch_size=2048, max_steps=300, eval_every=50, save_every=100),
    "180m": dict(lr=3e-3, seq_len=2048, batch_size=16, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
    "440m": dict(lr=1.5e-3, seq_len=2048, batch_size=8, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
    "880m": dict(lr=1.25e-3, seq_len=2048, batch_size=4, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
    "1.5b": dict(lr=1e-3, seq_len=2048, batch_size=2, total_batch_size=524288, max_steps=None, eval_every=250, save_every=1000),
}

# Dense bf16 peak FLOP/s by device name, for MFU (omitted on devices not listed).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "L4": 121e12, "A10G": 125e12, "A10": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12}


class TrainError(Exception):
    """An expected problem with the run's settings or directories; the CLI prints it as one paragraph."""


@dataclass
class TrainConfig:
    data: List[str]
    model: str = "small"
    seq_len: int = 256
    batch_size: int = 16  # micro batch, sequences per device per micro-step
    total_batch_size: int = 4096  # tokens per optimizer step, over all devices and micro-steps
    max_steps: int = 300
    lr: float = 3e-3
    min_lr: float = 1e-5
    warmup_steps: int = 30
    schedule: str = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "fp32"
    device: str = "cpu"
    compile: bool = False
    grad_checkpointing: bool = False
    vocab_size: Optional[int] = None
    data_dtype: Optional[str] = None
    out_dir: str = "out"
    resume: str = "auto"
    overwrite: bool = False
    save_every: int = 100
    keep_last: Optional[int] = 3
    eval_every: int = 50
    eval_batches: int = 20
    log_every: int = 10
    nan_guard: int = 5
    seed: int = 0
    dry_run: bool = False


# -----------------------------------------------------------------------------
# setup: devices, data, model


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(device: str) -> Dist:
    """torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; plain `python train.py` is world size 1."""
    if "RANK" not in os.environ:
        return Dist()
    d = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if device == "cuda":
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return d


def resolve_device(device, dtype, compile_):
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu (or auto)")
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if dtype == "bf16" and device == "cpu":
        raise TrainError("--dtype bf16 is for CUDA (bf16 autocast with float32 weights); on a CPU use --dtype fp32")
    if compile_ is None:
        compile_ = device == "cuda"
    return device, dtype, compile_


def parse_data(specs):
    """--data DIR or DIR:WEIGHT (repeatable) -> [(path, weight)], or "synthetic"."""
    if specs == ["synthetic"]:
        return "synthetic"
    if "synthetic" in specs:
        raise TrainError("--data synthetic trains on random tokens and cannot be blended with real data")
    out = []
    for spec in specs:
        path, weight = spec, 1.0
        head, sep, tail = spec.rpartition(":")
        if sep and not Path(spec).exists():
            try:
                path, weight = head, float(tail)
            except ValueError:
                raise TrainError(f"--data {spec!r}: expected DIR or DIR:WEIGHT with a number after the colon") from None
            if not weight > 0:
                raise TrainError(f"--data {spec!r}: a blend weight must be positive, found {weight}")
        out.append((path, weight))
    return out


def synthetic_source(vocab_size, seed, directory, num_tokens=1 << 22):
    """Random tokens in a raw token file: the only way this trainer touches random data (--data synthetic)."""
    tokens = np.random.default_rng(seed).integers(0, vocab_size, num_tokens, dtype=np.int64)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    path = Path(directory) / "synthetic.bin"
    tokens.astype(dtype).tofile(path)
    return data.open_tokens(path, dtype=dtype)


def open_data(cfg: TrainConfig, tmpdir):
    """(train sources, weights, val source or None, vocab_size, tokenizer spec or None, tokenizer directory)."""
    specs = parse_data(cfg.data)
    if specs == "synthetic":
        vocab = cfg.vocab_size or 50257
        return [synthetic_source(vocab, cfg.seed, tmpdir)], None, None, vocab, None, None
    dtype = np.dtype(cfg.data_dtype) if cfg.data_dtype else None
    sources = [data.open_tokens(path, "train", dtype) for path, _ in specs]
    first = sources[0]
    vocab = cfg.vocab_size or first.vocab_size or 50257
    for s in sources:
        data.check_vocab(s, vocab)
    val = None
    if "val" in data.splits(specs[0][0]):
        val = data.open_tokens(specs[0][0], "val", dtype)
        data.check_vocab(val, vocab)
    weights = [w for _, w in specs] if len(specs) > 1 else None
    return sources, weights, val, vocab, first.tokenizer, first.path


def build_model(cfg: TrainConfig, vocab_size, device):
    if cfg.model not in PRESETS:
        raise TrainError(f"--model {cfg.model!r} is not a preset; choose one of {', '.join(PRESETS)}")
    model = Mamba3LM(dataclasses.replace(PRESETS[cfg.model], vocab_size=vocab_size)).to(device)
    model.grad_checkpointing = cfg.grad_checkpointing
    return model


def lr_at(step, cfg: TrainConfig):
    """Linear warmup, then cosine to min_lr, or WSD: warmup, stable at lr, linear decay over the last 20%."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay_start = int(cfg.max_steps * 0.8)
        if step < decay_start:
            return cfg.lr
        frac = (step - decay_start) / max(1, cfg.max_steps - decay_start)
        return cfg.lr + frac * (cfg.min_lr - cfg.lr)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def peak_flops(device):
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((f for key, f in PEAK_FLOPS.items() if key in name), None)


# -----------------------------------------------------------------------------
# the step


def micro_step(model, x, y, autocast):
    """Forward one micro-batch; returns the mean loss. A separate function so that tests can inject faults."""
    with autocast:
        _, loss = model(x, y)
    return loss


def all_mean(t: torch.Tensor, d: Dist):
    if d.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.AVG if t.is_cuda else dist.ReduceOp.SUM)
        if not t.is_cuda:  # gloo has no AVG
            t /= d.world_size
    return t


@torch.no_grad()
def evaluate(model, val, cfg: TrainConfig, d: Dist, device, autocast):
    """Mean loss over the fixed validation windows (the same ones at every eval), summed across ranks."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of token losses, tokens
    for x, y in data.val_batches(val, cfg.seq_len, cfg.batch_size, cfg.eval_batches, d.rank, d.world_size, device):
        loss = micro_step(model, x, y, autocast)
        total += torch.stack([loss.double() * y.numel(), torch.tensor(y.numel(), dtype=torch.float64, device=device)])
    if d.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


# -----------------------------------------------------------------------------
# logging


class Log:
    """Rank 0's console lines, progress bar (terminals only) and metrics.jsonl (appended and flushed, opened at
    the first record so that a run refused at start-up leaves nothing behind)."""

    def __init__(self, cfg: TrainConfig, d: Dist):
        self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
        self.enabled = d.master
        self.path = Path(cfg.out_dir) / "metrics.jsonl" if d.master and not cfg.dry_run else None
        self.metrics = self.progress = None

    def line(self, text):
        if self.enabled:
            self.console.print(text)
            self.console.file.flush()  # lines reach a log file or pipe as they happen

    def record(self, **rec):
        if self.path is None:
            return
        if self.metrics is None:
            self.metrics = open(self.path, "a")
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()

    def start_progress(self, done, total):
        if self.enabled and sys.stdout.isatty():
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self.task = self.progress.add_task("train", total=total, completed=done)
            self.progress.start()

    def advance(self, step):
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def close(self):
        if self.progress is not None:
            self.progress.stop()
        if self.metrics is not None:
            self.metrics.close()


def header(log, cfg, model, d, accum, sources, weights, val):
    n_params = model.num_params()
    data_tokens = sum(s.num_tokens for s in sources)
    planned = cfg.total_batch_size * cfg.max_steps
    lines = [
        f"model      {cfg.model}: {n_params:,} parameters ({model.config.n_layer} layers, d_model {model.config.d_model}, "
        f"vocab {model.config.vocab_size})",
        f"device     {cfg.device}" + (f" ({torch.cuda.get_device_name()})" if cfg.device == "cuda" else "") +
        f", dtype {cfg.dtype}, compile {'on' if cfg.compile else 'off'}, world size {d.world_size}",
        f"batch      {cfg.total_batch_size:,} tokens per step = {cfg.batch_size} seqs x {cfg.seq_len} tokens x "
        f"{accum} accumulation x {d.world_size} ranks",
        f"schedule   {cfg.max_steps} steps, lr {cfg.lr:g} -> {cfg.min_lr:g} ({cfg.schedule}, {cfg.warmup_steps} warmup)",
    ]
    if cfg.data == ["synthetic"]:
        lines.append("data       SYNTHETIC random tokens (--data synthetic): the loss will not fall below ln(vocab)")
    else:
        names = ", ".join(str(s.path) for s in sources)
        if weights:
            names = ", ".join(f"{s.path} (weight {w:g})" for s, w in zip(sources, weights))
        lines.append(f"data       {names}: {data_tokens:,} tokens; {planned:,} planned = {planned / data_tokens:.2f} epochs")
        lines.append("eval       " + (f"every {cfg.eval_every} steps on {val.path} (val)" if val else "none: no val split"))
    lines.append(f"out        {cfg.out_dir}" + (" (dry run: nothing written)" if cfg.dry_run else "")
                 + f", resume {cfg.resume}, save every {cfg.save_every} (keep {cfg.keep_last or 'all'})")
    lines.append(f"optimizer  AdamW, weight decay {cfg.weight_decay:g}, grad clip {cfg.grad_clip:g}, nan guard "
                 f"{cfg.nan_guard}, seed {cfg.seed}" + (", grad checkpointing" if cfg.grad_checkpointing else ""))
    if log.enabled:
        log.console.print(Panel("\n".join(lines), title="mamba3-lite train", expand=False))


# -----------------------------------------------------------------------------
# checkpoints and resume


def prepare_out_dir(cfg: TrainConfig, d: Dist):
    """--resume never refuses a directory that already holds checkpoints, unless --overwrite, which moves
    the old run (checkpoints, config.json, metrics.jsonl) into OUT_DIR/previous-TIME/ rather than deleting it."""
    out = Path(cfg.out_dir)
    steps = ckpt.list_steps(out) if cfg.resume == "never" else []
    if not steps:
        return
    if not cfg.overwrite:
        raise TrainError(f"{out} already holds checkpoints (steps {steps}) and --resume never was "
                         f"given; use --resume auto to continue that run, another --out-dir, or --overwrite to "
                         f"move the old run aside into {out}/previous-*/")
    if d.master:
        backup = out / time.strftime("previous-%Y%m%d-%H%M%S")
        backup.mkdir()
        for p in list(out.iterdir()):
            if p.is_file() and (p.name.startswith(("model_step_", "optim_step_", "meta_step_"))
                                or p.name in ("config.json", "metrics.jsonl")):
                shutil.move(str(p), backup / p.name)


def resume(cfg: TrainConfig, model, optimizer, log, device):
    """Load what --resume asks for; returns the meta of the loaded step, or None for a fresh start."""
    out = Path(cfg.out_dir)
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        step, meta = ckpt.load_latest(out, model, optimizer, map_location=device, restore_rng=True)
        if step is not None:
            log.line(f"resumed from {out} step {step}")
        return meta
    step = int(cfg.resume)
    meta = ckpt.load(out, step, model, optimizer, map_location=device, restore_rng=True)
    log.line(f"resumed from {out} step {step} (--resume {step})")
    return meta


def save_checkpoint(cfg, step, model, optimizer, state, log):
    meta = dict(state, tag="final" if step == cfg.max_steps else "periodic", config=asdict(cfg))
    t0 = time.time()
    ckpt.save(cfg.out_dir, step, model, optimizer, meta, keep_last=cfg.keep_last)
    log.line(f"step {step}: saved checkpoint to {cfg.out_dir} ({time.time() - t0:.1f}s)")
    log.record(kind="event", event="checkpoint", step=step)


def start_wandb(cfg, run_id, log):
    """WandB only when WANDB_PROJECT is set; any failure is a warning, never a crash. Returns (run, id)."""
    if not os.environ.get("WANDB_PROJECT") or not log.enabled or cfg.dry_run:
        return None, run_id
    try:
        import wandb

        run = wandb.init(project=os.environ["WANDB_PROJECT"], name=os.environ.get("WANDB_RUN_NAME"), id=run_id,
                         resume="allow", config=asdict(cfg))
        return run, run.id
    except Exception as e:  # noqa: BLE001 - a logging service must never stop training
        log.line(f"[yellow]warning: wandb disabled ({type(e).__name__}: {e})[/yellow]")
        return None, run_id


def wandb_log(run, rec, log):
    if run is None:
        return
    try:
        run.log({k: v for k, v in rec.items() if isinstance(v, (int, float))}, step=rec["step"])
    except Exception as e:  # noqa: BLE001
        log.line(f"[yellow]warning: wandb log failed ({type(e).__name__}: {e})[/yellow]")


# -----------------------------------------------------------------------------
# the run


def train(cfg: TrainConfig):
    d = setup_distributed(cfg.device)
    try:
        _train(cfg, d)
    finally:
        if d.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, d: Dist):
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = f"cuda:{d.local_rank}" if cfg.device == "cuda" else "cpu"
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cfg.dtype == "bf16" else contextlib.nullcontext())
    if cfg.total_batch_size % cfg.seq_len:
        raise TrainError(f"--total-batch-size {cfg.total_batch_size} tokens is not a multiple of --seq-len "
                         f"{cfg.seq_len}; use a multiple, e.g. {max(1, cfg.total_batch_size // cfg.seq_len) * cfg.seq_len}")
    if cfg.resume not in ("auto", "never") and not cfg.resume.isdigit():
        raise TrainError(f"--resume {cfg.resume!r}: expected auto, never or a step number")
    if cfg.schedule not in ("cosine", "wsd"):
        raise TrainError(f"--schedule {cfg.schedule!r}: expected cosine or wsd")
    tmp = tempfile.TemporaryDirectory()

    # data: refused before anything is built or written if missing, malformed, or beyond the vocabulary
    sources, weights, val, vocab, tokenizer, tokenizer_dir = open_data(cfg, tmp.name)
    batches = data.Batches(sources, cfg.seq_len, cfg.batch_size, cfg.total_batch_size // cfg.seq_len,
                           d.rank, d.world_size, cfg.seed, weights, device, prefetch=cfg.device == "cuda")
    accum = batches.accum_steps
    tokens_per_step = cfg.total_batch_size

    model = build_model(cfg, vocab, device)
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=cfg.device == "cuda")
    prepare_out_dir(cfg, d)
    log = Log(cfg, d)
    meta = resume(cfg, model, optimizer, log, device)
    step, tokens_seen, skipped, run_id, wall = 0, 0, 0, None, 0.0
    if meta is not None:
        step, tokens_seen, skipped = meta["step"], meta["tokens_seen"], meta["skipped_steps"]
        run_id, wall = meta.get("wandb_run_id"), meta.get("wall_time", 0.0)
        batches.load_state_dict(meta["data"])
    if cfg.max_steps < step:
        raise TrainError(f"--max-steps {cfg.max_steps} is below the resumed step {step}; raise it to train further")
    start_step = step
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, max_steps=step + 2, log_every=1)

    if d.master and not cfg.dry_run:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        if tokenizer and tokenizer.get("name") == "file":  # sample.py finds the tokenizer beside the checkpoints
            shutil.copy(Path(tokenizer_dir) / tokenizer["file"], Path(cfg.out_dir) / tokenizer["file"])
    header(log, cfg, model, d, accum, sources, weights, val)
    log.start_progress(step, cfg.max_steps)
    wandb_run, run_id = start_wandb(cfg, run_id, log)

    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if d.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if cfg.device == "cuda" else None)
    flops = raw_model.flops_per_token(cfg.seq_len)
    peak = peak_flops(cfg.device)

    # SIGTERM / SIGINT: finish the current step, save, exit cleanly
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signal.Signals(signum).name

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def state():
        return dict(tokens_seen=tokens_seen, skipped_steps=skipped, data=batches.state_dict(), wandb_run_id=run_id,
                    scheduler=dict(step=step, schedule=cfg.schedule, lr=cfg.lr, min_lr=cfg.min_lr,
                                   warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps),
                    optimizer_steps=step - skipped, tokenizer=tokenizer, wall_time=wall + time.time() - t_start)

    try:
        t_start = time.time()
        window = dict(loss=0.0, norm=0.0, good=0, steps=0, t=time.time())  # sums over the steps since the last log
        bad_streak = 0
        while True:
            last = step == cfg.max_steps
            # --- eval and save when due (and at the end, inside the loop so the last step gets both); their time
            # is kept out of the throughput figures
            t_pause = time.time()
            if val is not None and (last or (step % cfg.eval_every == 0 and step > start_step)):
                val_loss = evaluate(model, val, cfg, d, device, autocast)
                log.line(f"step {step}: val loss {val_loss:.4f}, ppl {math.exp(min(val_loss, 50)):.2f}")
                rec = dict(kind="eval", step=step, val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                log.record(**rec)
                wandb_log(wandb_run, rec, log)
            if d.master and not cfg.dry_run and step > start_step and (last or step % cfg.save_every == 0 or stop["signal"]):
                save_checkpoint(cfg, step, raw_model, optimizer, state(), log)
            window["t"] += time.time() - t_pause
            if stop["signal"]:
                log.line(f"stopped by {stop['signal']} at step {step}; resume with --resume auto")
                break
            if last:
                break

            # --- one optimizer step: accumulate over micro-steps, then clip and update unless non-finite
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for m in range(accum):
                x, y = next(batches)
                sync = contextlib.nullcontext() if d.world_size == 1 or m == accum - 1 else model.no_sync()
                with sync:
                    loss = micro_step(model, x, y, autocast)
                    (loss / accum).backward()
                loss_sum += loss.detach()
            loss = all_mean(loss_sum / accum, d)
            norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            finite = bool(torch.isfinite(loss)) and bool(torch.isfinite(norm))
            if finite:
                optimizer.step()
                bad_streak = 0
            else:
                skipped += 1
                bad_streak += 1
                log.line(f"[yellow]step {step}: non-finite loss or gradient norm, update skipped "
                         f"({bad_streak} in a row, {skipped} in all)[/yellow]")
                log.record(kind="event", event="nonfinite", step=step)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            window["steps"] += 1
            if finite:
                window["loss"] += loss.item()
                window["norm"] += norm.item()
                window["good"] += 1
            if not finite and cfg.nan_guard and bad_streak >= cfg.nan_guard:
                bad_streak = rollback(cfg, raw_model, optimizer, device, step, log)
            # agree across ranks on a signal, so all of them save and stop at the same step
            if d.world_size > 1:
                flag = torch.tensor([1.0 if stop["signal"] else 0.0], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item() and not stop["signal"]:
                    stop["signal"] = "a signal on another rank"

            # --- log
            log.advance(step)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                log_window(log, wandb_run, window, step, lr, tokens_per_step, flops, peak, d)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.close()
        batches.close()
        tmp.cleanup()


def rollback(cfg, model, optimizer, device, step, log):
    """--nan-guard: after N non-finite steps in a row, restore the newest good checkpoint's weights and optimizer
    state, but keep the step count and the data position, so the poisoned batches are not replayed."""
    saved, _ = ckpt.load_latest(cfg.out_dir, model, optimizer, map_location=device)
    if saved is None:
        raise TrainError(f"{cfg.nan_guard} non-finite steps in a row at step {step} and no checkpoint in "
                         f"{cfg.out_dir} to roll back to; lower --lr, check the data, or raise --nan-guard")
    log.line(f"[yellow]step {step}: {cfg.nan_guard} non-finite steps in a row, restored the weights of step "
             f"{saved}; the data continues from step {step}[/yellow]")
    log.record(kind="event", event="rollback", step=step, restored=saved)
    return 0


def log_window(log, wandb_run, window, step, lr, tokens_per_step, flops, peak, d):
    """One line and one metrics record for the steps since the last one: the mean loss over them (skipped
    steps excluded), the perplexity of that mean, lr, mean grad norm, throughput and MFU."""
    dt = time.time() - window["t"]
    good = window["good"]
    loss = window["loss"] / good if good else float("nan")
    tok_per_s = window["steps"] * tokens_per_step / dt
    rec = dict(kind="train", step=step, loss=loss, ppl=math.exp(min(loss, 50)) if good else None, lr=lr,
               grad_norm=window["norm"] / good if good else None, tok_per_s=tok_per_s,
               ms_per_step=1000 * dt / max(1, window["steps"]))
    if peak:
        rec["mfu"] = flops * tok_per_s / (peak * d.world_size)
    if not good:
        rec["loss"] = None  # JSON has no NaN
    log.line(f"step {step}: loss {loss:.4f}, ppl {math.exp(min(loss, 50)):.2f}, lr {lr:.2e}, "
             f"grad norm {window['norm'] / max(1, good):.3f}, {tok_per_s:,.0f} tok/s, {rec['ms_per_step']:.0f} ms/step"
             + (f", MFU {rec['mfu']:.1%}" if peak else ""))
    log.record(**rec)
    wandb_log(wandb_run, rec, log)
    window.update(loss=0.0, norm=0.0, good=0, steps=0, t=time.time())


# -----------------------------------------------------------------------------
# command line

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


HELP = """Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

\b
  python train.py --data data/demo                       # CPU quickstart (small preset)
  python train.py --data data/fineweb --model 180m       # one GPU
  torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
  python train.py --data synthetic --model 440m --max-steps 50

Resumes from the newest checkpoint in --out-dir by default (--resume auto)."""


@app.command(help=HELP)
def main(
    data_: List[str] = typer.Option(..., "--data", help="Token data: a prepare.py directory, a nanoGPT .bin file or "
                                    "directory, a shard_*.bin directory or a Megatron prefix; repeat as DIR:WEIGHT to "
                                    "blend sources; 'synthetic' for random tokens (speed tests only)."),
    model: str = typer.Option("small", help=f"Preset: {', '.join(PRESETS)}. Also sets the defaults marked (preset)."),
    seq_len: Optional[int] = typer.Option(None, help="Context length in tokens (preset)."),
    batch_size: Optional[int] = typer.Option(None, help="Micro batch: sequences per device per micro-step (preset)."),
    total_batch_size: Optional[int] = typer.Option(None, help="Tokens per optimizer step over all devices and "
                                                   "micro-steps; gradient accumulation is derived from it (preset)."),
    max_steps: Optional[int] = typer.Option(None, help="Optimizer steps (preset; GPU presets: 20 tokens per parameter)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate (preset, from the paper's recipe)."),
    min_lr: float = typer.Option(1e-5, help="Final learning rate of the decay."),
    warmup_steps: Optional[int] = typer.Option(None, help="Linear warmup steps (default: 10% of max steps, at most 2000)."),
    schedule: str = typer.Option("cosine", help="cosine (warmup, cosine decay) or wsd (warmup, stable, linear decay "
                                 "over the last 20%)."),
    weight_decay: float = typer.Option(0.1, help="AdamW weight decay (matrices only; none on dt_bias, D, norms, biases)."),
    grad_clip: float = typer.Option(1.0, help="Clip the global gradient norm to this; 0 disables clipping."),
    dtype: str = typer.Option("auto", help="auto (bf16 autocast on CUDA, fp32 on CPU), bf16 or fp32."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the model "
                                           "(default: on for CUDA, off for CPU)."),
    grad_checkpointing: bool = typer.Option(False, help="Recompute each block in backward: less memory, more compute."),
    vocab_size: Optional[int] = typer.Option(None, help="Model vocabulary (default: the data's tokenizer, else 50257)."),
    data_dtype: Optional[str] = typer.Option(None, help="Token dtype of raw sources without a manifest (default uint16)."),
    out_dir: str = typer.Option("out", help="Run directory: checkpoints, config.json, metrics.jsonl."),
    resume: str = typer.Option("auto", help="auto: continue from the newest checkpoint that verifies; never: start "
                               "fresh; STEP: load exactly that step."),
    overwrite: bool = typer.Option(False, help="With --resume never: move an existing run in --out-dir aside into "
                                   "OUT_DIR/previous-TIME/ instead of refusing."),
    save_every: Optional[int] = typer.Option(None, help="Checkpoint every N steps, and at the end (preset)."),
    keep_last: int = typer.Option(3, help="Keep the newest K checkpoints; 0 keeps all."),
    eval_every: Optional[int] = typer.Option(None, help="Evaluate on the validation windows every N steps (preset)."),
    eval_batches: int = typer.Option(20, help="Micro-batches of validation windows per eval."),
    log_every: int = typer.Option(10, help="Log a line and a metrics.jsonl record every N steps."),
    nan_guard: int = typer.Option(5, help="After N non-finite steps in a row, roll back to the newest checkpoint; 0 never."),
    seed: int = typer.Option(0, help="Seeds the data order and the initialisation."),
    dry_run: bool = typer.Option(False, help="Run 2 steps and an eval; write nothing."),
):
    try:
        cfg = resolve_config(locals())
        train(cfg)
    except (TrainError, data.DataError, ckpt.CheckpointError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {e}", soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:  # before training started (after, Ctrl-C saves and exits cleanly)
        raise typer.Exit(130)


def resolve_config(args) -> TrainConfig:
    """Flags -> TrainConfig: the preset's recipe fills what was not given."""
    if args["model"] not in PRESETS:
        raise TrainError(f"--model {args['model']!r} is not a preset; choose one of {', '.join(PRESETS)}")
    recipe = RECIPES[args["model"]]
    device, dtype, compile_ = resolve_device(args["device"], args["dtype"], args["compile"])
    given = {k: v for k, v in args.items() if v is not None}
    seq_len = given.get("seq_len", recipe["seq_len"])
    total = given.get("total_batch_size", recipe["total_batch_size"])
    max_steps = given.get("max_steps", recipe["max_steps"])
    if max_steps is None:  # Chinchilla-style horizon: 20 tokens per parameter
        with torch.device("meta"):
            n = Mamba3LM(PRESETS[args["model"]]).num_params()
        max_steps = max(1, 20 * n // total)
    lr = given.get("lr", recipe["lr"])
    for name, v in (("--seq-len", seq_len), ("--total-batch-size", total), ("--max-steps", max_steps),
                    ("--batch-size", given.get("batch_size", 1)), ("--log-every", args["log_every"])):
        if v < 1:
            raise TrainError(f"{name} must be at least 1, found {v}")
    return TrainConfig(
        data=list(args["data_"]), model=args["model"], seq_len=seq_len,
        batch_size=given.get("batch_size", recipe["batch_size"]), total_batch_size=total, max_steps=max_steps,
        lr=lr, min_lr=min(args["min_lr"], lr), warmup_steps=given.get("warmup_steps", min(2000, max(1, max_steps // 10))),
        schedule=args["schedule"], weight_decay=args["weight_decay"], grad_clip=args["grad_clip"], dtype=dtype,
        device=device, compile=compile_, grad_checkpointing=args["grad_checkpointing"],
        vocab_size=args["vocab_size"], data_dtype=args["data_dtype"], out_dir=args["out_dir"], resume=args["resume"],
        overwrite=args["overwrite"], save_every=given.get("save_every", recipe["save_every"]),
        keep_last=args["keep_last"] or None, eval_every=given.get("eval_every", recipe["eval_every"]),
        eval_batches=args["eval_batches"], log_every=args["log_every"], nan_guard=args["nan_guard"],
        seed=args["seed"], dry_run=args["dry_run"],
    )


if __name__ == "__main__":
    app()
