"""Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

    python prepare.py && python train.py --data data/demo                  # CPU quickstart (small preset)
    python train.py --data data/fineweb --model 180m                        # one GPU
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
    python train.py --data synthetic --model 440m --max-steps 50            # random tokens, for speed tests

Read it top to bottom: the recipes (every preset's defaults), the config, the helpers the loop uses, then
`train`: setup, and the loop -- evaluate and save when due, one optimizer step, log. A checkpoint holds all
that a resumed run needs to continue bit for bit: weights, optimizer, data position, step, RNG states.
"""
import contextlib
import dataclasses
import fcntl
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
from typing import List, Literal, Optional

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


class TrainError(Exception):
    """An expected problem with the run's settings, data or directory; the CLI prints it as one paragraph."""


@dataclass
class TrainConfig:
    """A run's resolved settings: the flags, with the preset's recipe for those not given. Saved as the run
    directory's config.json and in every checkpoint's meta."""
    data: List[str]
    model: str
    seq_len: int
    batch_size: int  # micro batch: sequences per device per micro-step
    total_batch_size: int  # tokens per optimizer step, over all devices and micro-steps
    max_steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    schedule: str
    weight_decay: float
    grad_clip: float
    dtype: str
    device: str
    compile: bool
    grad_checkpointing: bool
    vocab_size: Optional[int]
    data_dtype: Optional[str]
    out_dir: str
    resume: str
    overwrite: bool
    save_every: int
    keep_last: int  # 0 keeps all
    eval_every: int
    eval_batches: int
    log_every: int
    nan_guard: int
    seed: int
    dry_run: bool


# -----------------------------------------------------------------------------
# setup: ranks, data


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def setup_distributed(device):
    """torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; plain `python train.py` is a world of one."""
    if "RANK" not in os.environ:
        return Dist()
    d = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if device == "cuda":
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return d


def open_data(cfg, d, device, tmpdir):
    """--data -> (train Batches, val source or None, vocab size, tokenizer spec, tokenizer directory). Missing,
    malformed or out-of-vocabulary data is refused here, before anything is built or written."""
    if cfg.data == ["synthetic"]:  # the only way this trainer ever touches random tokens
        vocab = cfg.vocab_size or 50257
        path = Path(tmpdir) / "synthetic.bin"
        np.random.default_rng(cfg.seed).integers(0, vocab, 1 << 22).astype(np.uint32).tofile(path)
        sources, weights, val, tokenizer = [data.open_tokens(path, dtype=np.uint32)], None, None, None
    else:
        specs = []
        for spec in cfg.data:  # DIR or DIR:WEIGHT
            head, sep, tail = spec.rpartition(":")
            if spec == "synthetic":
                raise TrainError("--data synthetic trains on random tokens and cannot be blended with real data")
            if not sep or Path(spec).exists():
                specs.append((spec, 1.0))
            elif not tail.replace(".", "", 1).isdigit() or not float(tail) > 0:
                raise TrainError(f"--data {spec!r}: expected DIR or DIR:WEIGHT with a positive number after the colon")
            else:
                specs.append((head, float(tail)))
        sources = [data.open_tokens(path, "train", cfg.data_dtype) for path, _ in specs]
        weights = [w for _, w in specs] if len(specs) > 1 else None
        val = data.open_tokens(specs[0][0], "val", cfg.data_dtype) if "val" in data.splits(specs[0][0]) else None
        vocab = cfg.vocab_size or sources[0].vocab_size or 50257
        for s in sources + [val] * (val is not None):
            data.check_vocab(s, vocab)
        tokenizer = sources[0].tokenizer
    batches = data.Batches(sources, cfg.seq_len, cfg.batch_size, cfg.total_batch_size // cfg.seq_len, d.rank,
                           d.world_size, cfg.seed, weights, device, prefetch=cfg.device == "cuda")
    return batches, val, vocab, tokenizer, sources[0].path


def lr_at(step, cfg):
    """Linear warmup, then cosine to min_lr, or WSD: warmup, stable at lr, linear decay over the last 20%."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        decay_start = int(cfg.max_steps * 0.8)
        frac = max(0.0, (step - decay_start) / max(1, cfg.max_steps - decay_start))
        return cfg.lr + frac * (cfg.min_lr - cfg.lr)
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


# -----------------------------------------------------------------------------
# the step's pieces


def micro_step(model, x, y, autocast):
    """Forward one micro-batch; returns the mean loss. Its own function so that tests can inject faults."""
    with autocast:
        _, loss = model(x, y)
    return loss


def all_mean(t, d):
    if d.world_size > 1:
        dist.all_reduce(t)  # a sum: gloo has no average
        t /= d.world_size
    return t


@torch.no_grad()
def evaluate(model, val, cfg, d, autocast):
    """Mean loss over the fixed validation windows (the same ones at every eval), summed across ranks."""
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of token losses, tokens
    for x, y in data.val_batches(val, cfg.seq_len, cfg.batch_size, cfg.eval_batches, d.rank, d.world_size, device):
        total[0] += micro_step(model, x, y, autocast).double() * y.numel()
        total[1] += y.numel()
    if d.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def weights_problem(model, limit):
    """None when every weight is finite and max |w| <= limit; else what is wrong (such weights are never saved)."""
    top = torch.stack([p.detach().abs().max() for p in model.parameters()]).max().item()
    if not math.isfinite(top):
        return "the weights are not finite"
    return f"the weights have exploded (max |w| = {top:.3g})" if top > limit else None


# -----------------------------------------------------------------------------
# logging: one sink


class Log:
    """Rank 0's one sink: log(line, **record) prints the line and appends the record to metrics.jsonl and to
    wandb. metrics.jsonl opens at the first record, so a run refused at start-up leaves nothing behind; a
    progress bar shows on terminals only."""

    def __init__(self, cfg, d):
        self.console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
        self.on = d.rank == 0
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
        if record and self.wandb is not None:
            try:
                self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
            except Exception as e:  # noqa: BLE001 - a logging service must never stop training
                self.console.print(f"[yellow]warning: wandb log failed ({type(e).__name__}: {e})[/yellow]")

    def start(self, cfg, step, run_id):
        """The progress bar, and wandb when WANDB_PROJECT is set (wandb reads its own WANDB_* variables; the
        run id kept in the checkpoints makes a resumed run continue the same wandb run). Returns the run id."""
        if not self.on:
            return run_id
        if sys.stdout.isatty():
            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TimeRemainingColumn(), console=self.console, transient=True)
            self.task = self.progress.add_task("train", total=cfg.max_steps, completed=step)
            self.progress.start()
        if os.environ.get("WANDB_PROJECT") and not cfg.dry_run:
            try:
                import wandb

                self.wandb = wandb.init(id=run_id, resume="allow", config=asdict(cfg))
                return self.wandb.id
            except Exception as e:  # noqa: BLE001
                self(f"[yellow]warning: wandb disabled ({type(e).__name__}: {e})[/yellow]")
        return run_id

    def close(self):
        for thing in (self.progress, self.file):
            if thing is not None:
                thing.stop() if thing is self.progress else thing.close()


def header(log, cfg, model, batches, val):
    """The resolved run in one panel: what a reader of the log needs to know it is the run they meant."""
    c = model.config
    lines = [f"model      {cfg.model}: {model.num_params():,} parameters ({c.n_layer} layers, d_model {c.d_model}, "
             f"vocab {c.vocab_size})",
             f"device     {cfg.device}" + (f" ({torch.cuda.get_device_name()})" if cfg.device == "cuda" else "") +
             f", dtype {cfg.dtype}, compile {'on' if cfg.compile else 'off'}, world size {batches.world_size}",
             f"batch      {cfg.total_batch_size:,} tokens per step = {cfg.batch_size} seqs x {cfg.seq_len} tokens x "
             f"{batches.accum_steps} accumulation x {batches.world_size} ranks",
             f"schedule   {cfg.max_steps} steps, lr {cfg.lr:g} -> {cfg.min_lr:g} ({cfg.schedule}, "
             f"{cfg.warmup_steps} warmup)"]
    if cfg.data == ["synthetic"]:
        lines.append("data       SYNTHETIC random tokens (--data synthetic): the loss will not fall below ln(vocab)")
    else:
        tokens = sum(s.num_tokens for s in batches.sources)
        planned = cfg.total_batch_size * cfg.max_steps
        shares = [f" ({float(w):.0%} of the samples)" if len(cfg.data) > 1 else "" for w in batches.weights]
        names = ", ".join(f"{s.path}{share}" for s, share in zip(batches.sources, shares))
        lines.append(f"data       {names}: {tokens:,} tokens; {planned:,} planned = {planned / tokens:.2f} epochs")
        lines.append("eval       " + (f"every {cfg.eval_every} steps on {val.path} (val)" if val else
                                      "[bold yellow]off: no val split (or one shorter than seq_len + 1)[/bold yellow]"))
    lines.append(f"out        {cfg.out_dir}" + (" (dry run: nothing written)" if cfg.dry_run else "") +
                 f", resume {cfg.resume}, save every {cfg.save_every} (keep {cfg.keep_last or 'all'})")
    lines.append(f"optimizer  AdamW, weight decay {cfg.weight_decay:g}, grad clip {cfg.grad_clip:g}, nan guard "
                 f"{cfg.nan_guard}, seed {cfg.seed}" + (", grad checkpointing" if cfg.grad_checkpointing else ""))
    if log.on:
        log.console.print(Panel("\n".join(lines), title="mamba3-lite train", expand=False))


# -----------------------------------------------------------------------------
# the run directory: lock, resume, branches, checkpoints


def lock(out):
    """An exclusive lock on OUT/.lock for the whole run: a second run on the same directory is refused. The
    OS drops it when the process ends, however it ends (kill -9 included). Returns the open lock file."""
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


def step_files(out):
    """{step: [paths]} of every checkpoint file in out, complete or not."""
    found = {}
    for p in sorted(out.iterdir()) if out.is_dir() else []:
        if m := ckpt.STEP_FILE.fullmatch(p.name):
            found.setdefault(int(m.group(1)), []).append(p)
    return found


def move_aside(out, prefix, steps, after=None):
    """Move the files of `steps` (and config.json, and metrics.jsonl's records past step `after`, or all of it
    when after is None) into OUT/PREFIX-TIME/, so that nothing a user had is deleted. Returns that directory."""
    aside = out / time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
    aside.mkdir()
    files = step_files(out)
    for s in steps:
        for p in files.get(s, []):
            shutil.move(p, aside / p.name)
    metrics = out / "metrics.jsonl"
    if after is None:
        for p in (metrics, out / "config.json"):
            if p.exists():
                shutil.move(p, aside / p.name)
    elif metrics.exists():
        split_metrics(metrics, after, aside / "metrics.jsonl")
    return aside


def split_metrics(path, step, aside=None):
    """Keep the records of steps <= step in metrics.jsonl (rewritten atomically); those past it go to `aside`
    or are dropped. After a resume every (kind, step) is recorded once, even if a crash made steps run twice."""
    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(keep) < len(lines):
        if aside is not None:
            aside.write_text("".join(line for line in lines if line not in keep))
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)


def resume(cfg, model, optimizer, device, log):
    """Load what --resume asks for and return its meta, or None for a fresh start. Newer steps than the one
    resumed (an abandoned branch, or steps that fail verification) are moved aside before anything is saved."""
    out = Path(cfg.out_dir)
    files = step_files(out)
    if cfg.resume == "never":
        if files and not cfg.overwrite:
            raise TrainError(f"{out} already holds checkpoints (steps {sorted(files)}) and --resume never was given; "
                             f"use --resume auto to continue that run, another --out-dir, or --overwrite to move "
                             f"the old run aside into {out}/previous-TIME/")
        if files and log.on and not cfg.dry_run:
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
    if step is None:
        return None
    newer = [s for s in files if s > step]
    if newer and log.on and not cfg.dry_run:
        aside = move_aside(out, "abandoned", newer, after=step)
        log(f"[yellow]moved the newer steps {newer} (and their metrics records) aside into {aside}[/yellow]")
    elif log.on and not cfg.dry_run and (out / "metrics.jsonl").exists():
        split_metrics(out / "metrics.jsonl", step)  # the records of steps a crash made us redo
    log(f"resumed from {out} step {step}", kind="event", event="resume", step=step)
    return meta


def save_checkpoint(cfg, step, model, optimizer, state):
    """Write step `step` (with retention). Its own function so that tests can inject faults around it."""
    meta = dict(state, tag="final" if step == cfg.max_steps else "periodic", config=asdict(cfg))
    ckpt.save(cfg.out_dir, step, model, optimizer, meta, keep_last=cfg.keep_last or None)


def rollback(cfg, model, optimizer, device, step):
    """Restore the newest checkpoint that verifies (weights and optimizer), keeping the step count and the
    data position, so the batches that poisoned the run are not replayed. Returns the restored step."""
    saved, _ = ckpt.load_latest(cfg.out_dir, model, optimizer, map_location=device)
    if saved is None:
        raise TrainError(f"{cfg.nan_guard} non-finite steps in a row at step {step} and no checkpoint in "
                         f"{cfg.out_dir} to roll back to; lower --lr, check the data, or raise --nan-guard")
    return saved


# -----------------------------------------------------------------------------
# the run


def train(cfg: TrainConfig):
    d = setup_distributed(cfg.device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run(cfg, d, tmp)
    finally:
        if d.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(cfg, d, tmp):
    # --- setup: everything that can be refused is refused before the run directory is touched
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = f"cuda:{d.local_rank}" if cfg.device == "cuda" else "cpu"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cfg.dtype == "bf16" else contextlib.nullcontext()
    batches, val, vocab, tokenizer, data_dir = open_data(cfg, d, device, tmp)
    if val is not None and val.num_tokens < cfg.seq_len + 1:  # a short first document, say
        val = None  # evaluation off, and the header says so: the training itself is still worth running
    model = Mamba3LM(dataclasses.replace(PRESETS[cfg.model], vocab_size=vocab)).to(device)
    model.grad_checkpointing = cfg.grad_checkpointing
    optimizer = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=cfg.device == "cuda")
    out = Path(cfg.out_dir)
    if cfg.resume not in ("auto", "never"):
        ckpt.read_meta(out, int(cfg.resume))  # a step that does not exist: refused before the directory is locked
    writes = d.rank == 0 and not cfg.dry_run  # rank 0 alone writes checkpoints and logs
    lock_file = lock(out) if writes else None
    log = Log(cfg, d)
    meta = resume(cfg, model, optimizer, device, log)
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
    if writes:
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        if tokenizer and tokenizer.get("name") == "file":  # sample.py finds the tokenizer beside the checkpoints
            shutil.copy(Path(data_dir) / tokenizer["file"], out / tokenizer["file"])
    header(log, cfg, model, batches, val)
    run_id = log.start(cfg, step, run_id)

    raw_model = model  # what is saved and restored; `model` may be wrapped for speed or for DDP
    if cfg.compile:
        model = torch.compile(model)
    if d.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if cfg.device == "cuda" else None)
    flops = raw_model.flops_per_token(cfg.seq_len)
    name = torch.cuda.get_device_name() if cfg.device == "cuda" else ""
    peak = next((f for key, f in PEAK_FLOPS.items() if key in name), None)
    limit = EXPLODED * max(1.0, torch.stack([p.detach().abs().max() for p in raw_model.parameters()]).max().item())

    stop = []  # SIGTERM / SIGINT: finish the current step, save, exit cleanly
    previous = {s: signal.signal(s, lambda signum, frame: stop.append(signal.Signals(signum).name))
                for s in (signal.SIGTERM, signal.SIGINT)}
    bad_streak, rollbacks = 0, []  # non-finite steps in a row; the steps restored since the last healthy save
    window = dict(loss=0.0, norm=0.0, good=0, steps=0, t=time.time())  # sums over the steps since the last log
    t_start = time.time()
    try:
        while True:
            last = step == cfg.max_steps

            # --- evaluate and save when due (and at the end, inside the loop so the last step gets both);
            # their time is kept out of the throughput figures
            t_pause = time.time()
            if val is not None and (last or (step % cfg.eval_every == 0 and step > start_step)):
                val_loss = evaluate(model, val, cfg, d, autocast)
                ppl = math.exp(min(val_loss, 50))
                log(f"step {step}: val loss {val_loss:.4f}, ppl {ppl:.2f}", kind="eval", step=step,
                    val_loss=val_loss, val_ppl=ppl)
            if step > start_step and (last or step % cfg.save_every == 0 or stop):
                # poison is never saved: not in a non-finite streak, nor weights that blew up while finite
                problem = f"{bad_streak} non-finite steps in a row" if bad_streak else weights_problem(raw_model, limit)
                if problem is None and writes:
                    t0 = time.time()
                    save_checkpoint(cfg, step, raw_model, optimizer, dict(
                        tokens_seen=tokens_seen, skipped_steps=skipped, optimizer_steps=step - skipped,
                        data=batches.state_dict(), wandb_run_id=run_id, tokenizer=tokenizer,
                        wall_time=wall + time.time() - t_start))
                    log(f"step {step}: saved checkpoint to {out} ({time.time() - t0:.1f}s)", kind="event",
                        event="checkpoint", step=step)
                if problem is None:
                    rollbacks = []
                elif bad_streak:
                    log(f"[yellow]step {step}: not saved: {problem}[/yellow]", kind="event", event="not_saved", step=step)
                else:
                    bad_streak = max(1, cfg.nan_guard)  # as bad as a full streak: roll back below
            window["t"] += time.time() - t_pause
            if stop or last:
                if bad_streak:
                    raise TrainError(f"the run ended at step {step} inside a streak of {bad_streak} non-finite steps; "
                                     f"that state was not saved. Resume from the newest checkpoint in {out} with a "
                                     f"lower --lr, or check the data")
                if stop:
                    log(f"stopped by {stop[0]} at step {step}; resume with --resume auto")
                break

            if not (cfg.nan_guard and bad_streak >= cfg.nan_guard):
                # --- one optimizer step: accumulate over micro-steps, then clip and update unless non-finite
                lr = lr_at(step, cfg)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss_sum = torch.zeros((), device=device)
                for m in range(batches.accum_steps):
                    x, y = next(batches)
                    # DDP averages gradients across ranks once per optimizer step, not per micro-step
                    sync = model.no_sync() if d.world_size > 1 and m < batches.accum_steps - 1 else contextlib.nullcontext()
                    with sync:
                        loss = micro_step(model, x, y, autocast)
                        (loss / batches.accum_steps).backward()
                    loss_sum += loss.detach()
                loss = all_mean(loss_sum / batches.accum_steps, d)
                norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
                finite = math.isfinite(loss.item()) and math.isfinite(norm.item())
                if finite:
                    optimizer.step()
                    bad_streak = 0
                    window["loss"] += loss.item()
                    window["norm"] += norm.item()
                    window["good"] += 1
                else:
                    skipped += 1
                    bad_streak += 1
                    log(f"[yellow]step {step}: non-finite loss or gradient norm, update skipped ({bad_streak} in a "
                        f"row, {skipped} in all)[/yellow]", kind="event", event="nonfinite", step=step)
                optimizer.zero_grad(set_to_none=True)
                step += 1
                tokens_seen += cfg.total_batch_size
                window["steps"] += 1

            # --- the NaN guard: restore the newest healthy checkpoint; the data cursor keeps moving
            if cfg.nan_guard and bad_streak >= cfg.nan_guard:
                restored = rollback(cfg, raw_model, optimizer, device, step)
                log(f"[yellow]step {step}: {cfg.nan_guard} bad steps in a row, restored the weights of step "
                    f"{restored}; the data continues from step {step}[/yellow]", kind="event", event="rollback",
                    step=step, restored=restored)
                rollbacks.append(restored)
                if len(rollbacks) >= MAX_ROLLBACKS and set(rollbacks) == {restored}:
                    raise TrainError(f"rolled back to step {restored} {len(rollbacks)} times in a row and the run "
                                     f"went bad again each time (last at step {step}); lower --lr (now {cfg.lr:g}) "
                                     f"or check the data around these steps")
                bad_streak = 0
            if d.world_size > 1:  # agree on a signal, so that every rank saves and stops at the same step
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
                           tok_per_s=window["steps"] * cfg.total_batch_size / dt,
                           ms_per_step=1000 * dt / max(1, window["steps"]))
                if peak:
                    rec["mfu"] = flops * rec["tok_per_s"] / (peak * d.world_size)
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


def preset(key, what):
    """Help text for a flag whose default comes from the preset's recipe: the values behind "(preset)"."""
    values = ", ".join(f"{name} {r[key]:g}" if r[key] is not None else f"{name} 20 tokens/param"
                       for name, r in RECIPES.items())
    return f"{what} [dim](preset: {values})[/dim]"


@app.command(help=__doc__.split("\n\n")[0] + "\n\nResumes from the newest checkpoint in --out-dir by default "
             "(--resume auto). Flags marked (preset) default to the preset's recipe.")
def main(
    data_: List[str] = typer.Option(..., "--data", help="Token data: a prepare.py directory, a nanoGPT .bin file or "
                                    "directory, a shard_*.bin directory or a Megatron prefix; repeat as DIR:WEIGHT to "
                                    "blend sources; 'synthetic' for random tokens (speed tests only)."),
    model: Literal["tiny", "small", "180m", "440m", "880m", "1.5b"] = typer.Option("small", help="Model preset; "
                                                                                   "also sets the (preset) defaults."),
    seq_len: Optional[int] = typer.Option(None, min=1, help=preset("seq_len", "Context length in tokens.")),
    batch_size: Optional[int] = typer.Option(None, min=1, help=preset("batch_size", "Micro batch: sequences per "
                                                                       "device per micro-step.")),
    total_batch_size: Optional[int] = typer.Option(None, min=1, help=preset("total_batch_size", "Tokens per optimizer "
                                                   "step over all devices and micro-steps; sets the accumulation.")),
    max_steps: Optional[int] = typer.Option(None, min=1, help=preset("max_steps", "Optimizer steps.")),
    lr: Optional[float] = typer.Option(None, help=preset("lr", "Peak learning rate (> 0).")),
    min_lr: float = typer.Option(1e-5, min=0, help="Final learning rate of the decay (at most --lr)."),
    warmup_steps: Optional[int] = typer.Option(None, min=0, help="Linear warmup steps (default: 10% of --max-steps, "
                                               "at most 2000)."),
    schedule: Literal["cosine", "wsd"] = typer.Option("cosine", help="cosine: warmup, cosine decay; wsd: warmup, "
                                                      "stable, linear decay over the last 20%."),
    weight_decay: float = typer.Option(0.1, min=0, help="AdamW weight decay (matrices only; none on dt_bias, D, norms, "
                                       "biases)."),
    grad_clip: float = typer.Option(1.0, min=0, help="Clip the global gradient norm to this; 0 disables clipping."),
    dtype: Literal["auto", "bf16", "fp32"] = typer.Option("auto", help="auto: bf16 autocast on CUDA, fp32 on CPU."),
    device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", help="auto: CUDA when available."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the model (default: on "
                                           "for CUDA, off for CPU)."),
    grad_checkpointing: bool = typer.Option(False, help="Recompute each block in backward: less memory, more compute."),
    vocab_size: Optional[int] = typer.Option(None, min=1, help="Model vocabulary (default: the data's tokenizer, else "
                                             "50257)."),
    data_dtype: Optional[Literal["uint16", "uint32", "int32"]] = typer.Option(None, help="Token dtype of raw sources "
                                                                               "without a manifest (default uint16)."),
    out_dir: str = typer.Option("out", help="Run directory: checkpoints, config.json, metrics.jsonl."),
    resume: str = typer.Option("auto", help="auto: continue from the newest checkpoint that verifies; never: start "
                               "fresh; STEP: load exactly that step (newer steps are moved aside)."),
    overwrite: bool = typer.Option(False, help="With --resume never: move an existing run aside into "
                                   "OUT_DIR/previous-TIME/ instead of refusing."),
    save_every: Optional[int] = typer.Option(None, min=1, help=preset("save_every", "Checkpoint every N steps, and "
                                                                       "at the end.")),
    keep_last: int = typer.Option(3, min=0, help="Keep the newest K checkpoints; 0 keeps all."),
    eval_every: Optional[int] = typer.Option(None, min=1, help=preset("eval_every", "Evaluate every N steps.")),
    eval_batches: int = typer.Option(20, min=1, help="Micro-batches of validation windows per eval."),
    log_every: int = typer.Option(10, min=1, help="Log a line and a metrics.jsonl record every N steps."),
    nan_guard: int = typer.Option(5, min=0, help="After N non-finite steps in a row, roll back to the newest "
                                  "checkpoint; 0 never."),
    seed: int = typer.Option(0, min=0, help="Seeds the data order and the initialisation."),
    dry_run: bool = typer.Option(False, help="Run 2 steps and an eval; write nothing."),
):
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        train(resolve_config(locals()))
    except (TrainError, data.DataError, ckpt.CheckpointError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {e}", soft_wrap=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:  # before training started (after, Ctrl-C saves and exits cleanly)
        raise typer.Exit(130)


def resolve_config(args) -> TrainConfig:
    """Flags -> TrainConfig: the preset's recipe fills what was not given; what cannot work is refused here."""
    recipe = {k: args[k] if args.get(k) is not None else v for k, v in RECIPES[args["model"]].items()}
    if recipe["max_steps"] is None:  # Chinchilla-style horizon: 20 tokens per parameter
        with torch.device("meta"):
            recipe["max_steps"] = max(1, 20 * Mamba3LM(PRESETS[args["model"]]).num_params() // recipe["total_batch_size"])
    device, dtype, compile_ = args["device"], args["dtype"], args["compile"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu (or auto)")
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if dtype == "bf16" and device == "cpu":
        raise TrainError("--dtype bf16 is for CUDA (bf16 autocast with float32 weights); on a CPU use --dtype fp32")
    if not recipe["lr"] > 0:
        raise TrainError(f"--lr must be positive, found {recipe['lr']}")
    if recipe["total_batch_size"] % recipe["seq_len"]:
        raise TrainError(f"--total-batch-size {recipe['total_batch_size']} tokens is not a multiple of --seq-len "
                         f"{recipe['seq_len']}; use a multiple, e.g. "
                         f"{max(1, recipe['total_batch_size'] // recipe['seq_len']) * recipe['seq_len']}")
    if args["resume"] not in ("auto", "never") and not args["resume"].isdigit():
        raise TrainError(f"--resume {args['resume']!r}: expected auto, never or a step number")
    warmup = args["warmup_steps"] if args["warmup_steps"] is not None else min(2000, max(1, recipe["max_steps"] // 10))
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {k: v for k, v in args.items() if k in keys}
    return TrainConfig(**{**flags, **recipe, "data": list(args["data_"]), "device": device, "dtype": dtype,
                          "compile": device == "cuda" if compile_ is None else compile_,
                          "min_lr": min(args["min_lr"], recipe["lr"]), "warmup_steps": warmup})


if __name__ == "__main__":
    app()
