"""Train a Mamba-3 language model on one CPU, one GPU, or many GPUs.

    # The CPU quickstart (the small preset):
    python prepare.py && python train.py --data data/demo
    # One GPU:
    python train.py --data data/fineweb --model 180m
    # Eight GPUs, and FSDP for a model whose training state does not fit one:
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 440m
    torchrun --standalone --nproc_per_node=8 train.py --data data/fineweb --model 1.5b \
        --fsdp
    # Random tokens, for speed tests:
    python train.py --data synthetic --model 440m --max-steps 50
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
# DDP comes with `import torch`; FSDP and DTensor cost a second to import, so they are
# imported where --fsdp uses them.
from torch.nn.parallel import DistributedDataParallel as DDP
from typer import Option

import ckpt
import data
import official
from model import PRESETS, Mamba3LM, ModelConfig
from model import activation_bytes, bf16_native, peak_flops, pick_device

# -----------------------------------------------------------------------------
# The recipes: every preset's defaults in one table.

# The GPU presets follow the paper's recipe (Mamba-2's): a peak LR about 5x GPT-3's for the
# size, context 2048, ~0.5M-token batches, and max_steps None, which means Chinchilla's
# 20 tokens per parameter. The CPU presets use short contexts and small batches, so that a
# laptop sees the loss fall in a minute.
#
# muon_lr is Muon's peak LR for the blocks' weight matrices (--optimizer muon). Muon's update
# is scaled to the RMS of an AdamW update (0.2 * sqrt(max(rows, cols))), so its LR lives on
# AdamW's scale. The CPU presets' values were tuned on this repo's CPU benchmarks; the GPU
# presets take AdamW's LR, which that scaling is designed to allow, until measured there.
RECIPE_COLUMNS = ("lr", "muon_lr", "seq_len", "batch_size", "total_batch_size", "max_steps",
                  "eval_every", "save_every")
RECIPE_ROWS = [
    #           lr       muon_lr  seq_len  batch  tokens/step  max_steps  eval  save
    ("tiny",   (3e-3,    3e-3,    128,     8,     1024,        200,       50,   100)),
    ("small",  (3e-3,    3e-3,    256,     8,     2048,        300,       50,   100)),
    ("180m",   (3e-3,    3e-3,    2048,    16,    524288,      None,      250,  1000)),
    ("440m",   (1.5e-3,  1.5e-3,  2048,    8,     524288,      None,      250,  1000)),
    ("880m",   (1.25e-3, 1.25e-3, 2048,    4,     524288,      None,      250,  1000)),
    ("1.5b",   (1e-3,    1e-3,    2048,    2,     524288,      None,      250,  1000)),
]
RECIPES = {name: dict(zip(RECIPE_COLUMNS, values)) for name, values in RECIPE_ROWS}

# Weights this many times larger (max |w|) than at the start are poison: never saved.
EXPLODED = 1e3
# Rolled back to the same checkpoint this often in a row, a run cannot recover alone.
MAX_ROLLBACKS = 3

# -----------------------------------------------------------------------------
# The optimizer and its schedule.

# The bytes of training state per parameter, by the optimizer that updates it: the float32
# weight and its gradient, then AdamW's two moments or Muon's one momentum buffer.
PARAM_BYTES = {"adamw": 16, "muon": 12}
# The optimizers' names, for the log.
OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon"}


def muon_matrices(model):
    """The parameters Muon updates: the weight matrices of the Linear layers inside the
    blocks (in_proj, out_proj, the MLP's). Not the embedding and its tied LM head, whose
    rows are looked up one token at a time, and no vector (norms, biases, dt_bias, D, the
    MIMO vectors, B_bias: some of these are 3-D, so the role decides, not ndim)."""
    matrices = []
    for block in model.blocks:
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                matrices.append(module.weight)
    return matrices


# Muon's momentum rises from 0.85 to 0.95 over the first 100 steps (nanochat warms up
# over 300): on this repo's CPU benchmark, 200-step runs ended 0.026 lower on both seeds.
# It depends on the step alone, not on --max-steps, so a run stopped early and continued
# with a longer horizon sees the same momentum.
MUON_MOMENTUM = (0.85, 0.95)
MUON_MOMENTUM_WARMUP = 100


def muon_momentum(step):
    """Muon's momentum at `step`: a pure function of the step, like the LR, so a resumed
    run needs no state for it."""
    frac = min(step / MUON_MOMENTUM_WARMUP, 1.0)
    start, end = MUON_MOMENTUM
    return (1 - frac) * start + frac * end


def build_optimizers(model, cfg):
    """The run's optimizers, as a list: [AdamW], or [Muon, AdamW] with --optimizer muon.

    AdamW takes the model's parameters by role (model.param_groups): weight decay on the
    weight matrices of the Linear and Embedding layers, none on the per-channel scales
    and biases. With Muon, the blocks' weight matrices move to Muon (orthogonalized
    Nesterov momentum, 5 Newton-Schulz steps; the momentum warms up, muon_momentum), and
    AdamW keeps the embedding and every vector. The schedule scales each group's LR by
    its peak over --lr (lr_scales: --muon-lr / --lr for Muon's)."""
    fused = cfg.device == "cuda"
    groups = model.param_groups(cfg.weight_decay)
    if cfg.optimizer == "adamw":
        adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                  fused=fused)
        return [adamw]

    matrices = muon_matrices(model)
    in_muon = set(id(p) for p in matrices)
    # AdamW's groups less what Muon takes: the embedding (decayed) and the vectors.
    for group in groups:
        group["params"] = [p for p in group["params"] if id(p) not in in_muon]
    # The loop sets the momentum of every step (muon_momentum).
    muon = torch.optim.Muon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                            momentum=MUON_MOMENTUM[1], nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
    return [muon, adamw]


def lr_scales(optimizers, cfg):
    """Each param group's peak LR over --lr, in the order of the optimizers' groups.

    Kept beside the optimizers, not in their groups: a group's keys go into its state
    dict, and checkpoints from before Muon have none."""
    scales = []
    for optimizer in optimizers:
        scale = 1.0
        if isinstance(optimizer, torch.optim.Muon):
            scale = cfg.muon_lr / cfg.lr
        for _ in optimizer.param_groups:
            scales.append(scale)
    return scales


def training_state_bytes(config, optimizer):
    """The bytes of weights, gradients and optimizer state of a model of `config`,
    counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = Mamba3LM(config)
    params = model.num_params()
    if optimizer == "adamw":
        return PARAM_BYTES["adamw"] * params
    in_muon = sum(p.numel() for p in muon_matrices(model))
    return PARAM_BYTES["muon"] * in_muon + PARAM_BYTES["adamw"] * (params - in_muon)


# WSD holds the peak LR, then decays linearly over this last share of the steps. The stable
# phase makes a checkpoint from which a shorter or longer decay can branch.
WSD_DECAY = 0.2


def lr_at(step, cfg):
    """Linear warmup, then cosine to min_lr; or WSD: warmup, stable, then a linear decay
    to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "wsd":
        start = int(cfg.max_steps * (1 - WSD_DECAY))
        frac = max(0.0, (step - start) / max(1, cfg.max_steps - start))
        return cfg.lr + frac * (cfg.min_lr - cfg.lr)
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


# -----------------------------------------------------------------------------
# The flags.

# None: the preset's value.
Int = Optional[int]


def preset(key, what, low=1):
    """The Option of a flag whose default is the preset's. Its help lists each preset's
    value."""
    values = []
    for name, recipe in RECIPES.items():
        if recipe[key]:
            values.append(f"{name} {recipe[key]:g}")
        else:
            values.append(f"{name} 20 tok/param")
    return Option(min=low, help=f"{what} [dim](preset: {', '.join(values)})[/dim]")


@dataclasses.dataclass
class TrainConfig:
    """The flags (main's signature); resolve() fills the (preset) ones. Saved in
    config.json."""
    data: Annotated[List[str], Option(
        help=f"Token data: {data.FORMATS}; DIR:WEIGHT (repeated) blends; 'synthetic': "
             "random tokens (speed tests only).")]
    model: Annotated[Optional[Literal[tuple(PRESETS)]], Option(
        help="Model preset; sets the (preset) defaults too (default: small, or "
             "--init-from's).")] = None
    init_from: Annotated[Optional[str], Option(
        help="Start from the weights of a run directory or an official mamba_ssm one "
             "(fresh optimizer, schedule, data).")] = None
    reset_at_eos: Annotated[bool, Option(
        help="Reset the state after each EOS.")] = False
    mimo_rank: Annotated[Int, Option(
        min=1, help="MIMO rank R; 1: SISO (default: 1, or --init-from's).")] = None

    # A hybrid: attention layers among the Mamba-3 ones, and their shape.
    attn_layers: Annotated[Optional[str], Option(
        help="The layers whose mixer is attention, by index from 0, e.g. 3,7 (default: "
             "none, or --init-from's).")] = None
    attn_heads: Annotated[Int, Option(
        min=1, help="Attention heads (default: d_model / --attn-head-dim).")] = None
    attn_kv_heads: Annotated[Int, Option(
        min=1, help="Key/value heads, grouped-query attention (default: the heads).")] = None
    attn_head_dim: Annotated[Int, Option(
        min=1, help="Channels per attention head (default: the Mamba headdim, or d_model / "
                    "--attn-heads).")] = None
    attn_rotary_dim: Annotated[Int, Option(
        min=0, help="Channels per head turned by rotary embedding, even; 0: none "
                    "(default: the whole head).")] = None
    attn_rotary_base: Annotated[Optional[float], Option(
        min=0, help="Rotary embedding's base (default: 10000).")] = None

    # The batch and the schedule.
    seq_len: Annotated[Int, preset(
        "seq_len", "Context length.")] = None
    batch_size: Annotated[Int, preset(
        "batch_size", "Sequences per device and micro-step.")] = None
    total_batch_size: Annotated[Int, preset(
        "total_batch_size",
        "Tokens per optimizer step over all devices; sets the accumulation.")] = None
    max_steps: Annotated[Int, preset(
        "max_steps", "Optimizer steps.")] = None
    optimizer: Annotated[Literal["adamw", "muon"], Option(
        help="adamw, or muon: Muon for the blocks' weight matrices, AdamW (at --lr) for "
             "the embedding and the vectors.")] = "adamw"
    lr: Annotated[Optional[float], preset(
        "lr", "Peak learning rate (> 0); AdamW's.", None)] = None
    muon_lr: Annotated[Optional[float], preset(
        "muon_lr", "Muon's peak learning rate (> 0), with --optimizer muon.", None)] = None
    min_lr: Annotated[float, Option(
        min=0, help="Final learning rate (at most --lr).")] = 1e-5
    warmup_steps: Annotated[Int, Option(
        min=0, help="Default: 10% of --max-steps, <= 2000.")] = None
    schedule: Annotated[Literal["cosine", "wsd"], Option(
        help="After warmup: cosine decay, or wsd: stable, then linear decay over the last "
             f"{WSD_DECAY:.0%}.")] = "cosine"
    weight_decay: Annotated[float, Option(
        min=0, help="Weight decay (matrices only).")] = 0.1
    grad_clip: Annotated[float, Option(
        min=0, help="Clip the gradient norm; 0: never.")] = 1.0

    # The hardware.
    dtype: Annotated[Literal["auto", "bf16", "fp32"], Option(
        help="auto: bf16 autocast (float32 weights) where the device has bf16 arithmetic, "
             "else fp32.")] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Option(
        help="auto: CUDA if any.")] = "auto"
    compile: Annotated[Optional[bool], Option(
        "--compile/--no-compile", help="torch.compile (default: on CUDA).")] = None
    grad_checkpointing: Annotated[bool, Option(
        help="Recompute in backward: less memory.")] = False
    fsdp: Annotated[bool, Option(
        help="Shard weights, gradients and optimizer over the ranks (FSDP2), for training "
             "state that does not fit one GPU.")] = False

    # The vocabulary.
    vocab_size: Annotated[Int, Option(
        min=1, help="Default: the data's, else 50257.")] = None
    data_dtype: Annotated[Optional[Literal["uint16", "uint32", "int32"]], Option(
        help="Token dtype of raw sources without a manifest (default: uint16).")] = None

    # The run directory, and what goes into it when.
    out_dir: Annotated[str, Option(
        help="Checkpoints, config.json, metrics.jsonl.")] = "out"
    resume: Annotated[str, Option(
        help="auto: the newest checkpoint that verifies; never: start fresh; STEP: that "
             "step (newer steps are moved aside).")] = "auto"
    new_data: Annotated[bool, Option(
        help="Resume on other --data (from its start).")] = False
    overwrite: Annotated[bool, Option(
        help="With --resume never: move an old run aside into OUT_DIR/previous-TIME/ "
             "instead of refusing.")] = False
    save_every: Annotated[Int, preset(
        "save_every", "And at the end.")] = None
    keep_last: Annotated[int, Option(
        min=0, help="Keep the newest K checkpoints; 0: all.")] = 3
    eval_every: Annotated[Int, preset(
        "eval_every", "And at the end.")] = None
    eval_batches: Annotated[int, Option(
        min=1, help="Micro-batches of val windows per eval.")] = 20
    log_every: Annotated[int, Option(
        min=1, help="A log line and metrics record every N.")] = 10
    nan_guard: Annotated[int, Option(
        min=0, help="After N non-finite steps in a row, roll back to the newest "
                    "checkpoint; 0: never.")] = 5
    seed: Annotated[int, Option(
        min=0, max=2**63 - 1, help="Seeds data order and init.")] = 0
    dry_run: Annotated[bool, Option(
        help="Run 2 steps and an eval; write nothing.")] = False


class TrainError(Exception):
    """An expected problem with the run's settings, data or directory: printed as one
    paragraph."""


def refuse_empty_paths(cfg):
    """Refuse an empty --data, --init-from or --out-dir before anything reads or writes.

    An empty path would otherwise mean the working directory, or for --init-from no
    initialization at all: never what was meant."""
    if any(not path.strip() for path in cfg.data):
        raise TrainError("--data is empty; name a prepare.py directory or token file, or "
                         "'synthetic'")
    if cfg.init_from is not None and not cfg.init_from.strip():
        raise TrainError("--init-from is empty; name a run directory or an official "
                         "mamba_ssm one, or leave the option out")
    if not cfg.out_dir.strip():
        raise TrainError("--out-dir is empty; name the run's directory (the default is "
                         "out)")


# The attention flags, which are ModelConfig's fields of the same names.
ATTN_FLAGS = ("attn_layers", "attn_heads", "attn_kv_heads", "attn_head_dim",
              "attn_rotary_dim", "attn_rotary_base")


def attention_fields(cfg):
    """The ModelConfig fields that the attention flags given set, --attn-layers "3,7" as
    (3, 7)."""
    fields = {}
    for name in ATTN_FLAGS:
        value = getattr(cfg, name)
        if value is not None:
            fields[name] = value
    text = cfg.attn_layers
    if text is None:
        return fields
    layers = []
    for part in text.split(","):
        part = part.strip()
        # An empty --attn-layers "" means no attention layers.
        if not part:
            continue
        if not part.isdigit():
            raise TrainError(f"--attn-layers {text!r}: expected layer indices from 0, "
                             "separated by commas, e.g. 3,7")
        layers.append(int(part))
    fields["attn_layers"] = tuple(layers)
    return fields


def num_params(config):
    """The parameters of a model of `config`, counted on the meta device: nothing is
    allocated."""
    with torch.device("meta"):
        return Mamba3LM(config).num_params()


def resolve(cfg, init=None):
    """The (preset) flags filled (init: --init-from's ModelConfig fields), auto settled,
    the impossible refused before anything runs."""
    model = cfg.model or "small"
    if init is not None:
        # The presets of init's shape: --model may name one of them, and the first is the
        # default.
        keys = ("n_layer", "d_model", "expand", "headdim", "d_state", "ngroups",
                "mlp_hidden")
        same = []
        for name, config in PRESETS.items():
            if all(getattr(config, k) == init[k] for k in keys):
                same.append(name)
        other_model = cfg.model and cfg.model not in same
        other_vocab = cfg.vocab_size not in (None, init["vocab_size"])
        other_rank = cfg.mimo_rank not in (None, init["mimo_rank"])
        if other_model or other_vocab or other_rank:
            raise TrainError(f"--init-from {cfg.init_from} is a model of its own shape "
                             f"({init}): --model, --vocab-size and --mimo-rank may not "
                             "change it")
        # The attention layers and their shape are the source's too.
        other_attention = []
        for name, value in attention_fields(cfg).items():
            if init.get(name) != value:
                other_attention.append("--" + name.replace("_", "-"))
        if other_attention:
            layers = list(init.get("attn_layers", ()))
            raise TrainError(f"--init-from {cfg.init_from} has attention in layers "
                             f"{layers} with its own shape: {', '.join(other_attention)} "
                             "may not change it; leave them out")
        if cfg.model is None:
            model = same[0] if same else "small"

    # A flag given wins over the preset's recipe.
    recipe = {}
    for key, value in RECIPES[model].items():
        flag = getattr(cfg, key)
        recipe[key] = value if flag is None else flag
    if recipe["max_steps"] is None:
        # Chinchilla's horizon: 20 tokens per parameter.
        tokens = 20 * num_params(PRESETS[model])
        recipe["max_steps"] = max(1, tokens // recipe["total_batch_size"])

    # Typer takes inf and nan for a float option.
    bad = []
    for key, value in {**vars(cfg), **recipe}.items():
        if isinstance(value, float) and not math.isfinite(value):
            bad.append(f"--{key.replace('_', '-')} {value}")
    if bad:
        raise TrainError(f"{', '.join(bad)}: expected a finite number")
    if not recipe["lr"] > 0:
        raise TrainError(f"--lr must be positive, found {recipe['lr']}")
    if not recipe["muon_lr"] > 0:
        raise TrainError(f"--muon-lr must be positive, found {recipe['muon_lr']}")
    if cfg.optimizer == "muon" and cfg.fsdp:
        raise TrainError("--optimizer muon cannot run with --fsdp: Muon orthogonalizes each "
                         "weight matrix whole, and FSDP2 shards the matrices across the "
                         "ranks. Leave out --fsdp (DDP), or use --optimizer adamw")
    if cfg.init_from and Path(cfg.init_from).resolve() == Path(cfg.out_dir).resolve():
        raise TrainError(f"--init-from and --out-dir are both {cfg.out_dir}: to continue "
                         "that run leave out --init-from; to start from its weights use "
                         "another --out-dir")
    tokens = recipe["total_batch_size"]
    seq_len = recipe["seq_len"]
    if tokens % seq_len:
        example = max(1, tokens // seq_len) * seq_len
        raise TrainError(f"--total-batch-size {tokens} tokens is not a multiple of "
                         f"--seq-len {seq_len}; use a multiple, e.g. {example}")
    if cfg.resume not in ("auto", "never") and not cfg.resume.isdigit():
        raise TrainError(f"--resume {cfg.resume!r}: expected auto, never or a step number")
    # An impossible hybrid is refused here, before anything is read or written:
    # ModelConfig raises a ValueError naming the flag.
    if init is None:
        dataclasses.replace(PRESETS[model], **attention_fields(cfg))

    device = pick_device(cfg.device)
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bf16" if bf16_native(device) else "fp32"
    warmup_steps = cfg.warmup_steps
    if warmup_steps is None:
        warmup_steps = min(2000, max(1, recipe["max_steps"] // 10))
    use_compile = cfg.compile
    if use_compile is None:
        use_compile = device == "cuda"
    # The data must fit the weights: --init-from's vocabulary.
    vocab_size = cfg.vocab_size
    if init:
        vocab_size = init["vocab_size"]
    return dataclasses.replace(
        cfg, **recipe, model=model, device=device, min_lr=min(cfg.min_lr, recipe["lr"]),
        vocab_size=vocab_size, dtype=dtype, warmup_steps=warmup_steps, compile=use_compile)


# -----------------------------------------------------------------------------
# Memory: refuse a step that cannot fit before the weights take any.

def free_memory(device):
    """Bytes free: on the GPU, or the RAM Linux calls available (or a lower cgroup
    limit's rest). None where it cannot tell (not Linux): then there is no check."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    with contextlib.suppress(OSError, ValueError, KeyError):
        lines = Path("/proc/meminfo").read_text().splitlines()
        info = dict(line.split(":", 1) for line in lines)
        free = int(info["MemAvailable"].split()[0]) * 1024
        # A cgroup v2 limit lowers it. Its file reads "max", or is missing, where there is
        # none.
        with contextlib.suppress(OSError, ValueError):
            limit = int(Path("/sys/fs/cgroup/memory.max").read_text())
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free, limit - used)
        return free


def check_memory(cfg, config):
    """Refuse a step that cannot fit in the memory free, naming the numbers and the ways
    out. On a GPU only the parameters' share is sure, the rest a warning (CUDA's OOM stops
    a run cleanly)."""
    params = num_params(config)
    free = free_memory(cfg.device)
    b = cfg.batch_size
    L = cfg.seq_len
    # The ranks on one machine share its RAM; each GPU has its own memory.
    ranks = 1
    if cfg.device == "cpu":
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    world = int(os.environ.get("WORLD_SIZE", 1))
    sequences = cfg.total_batch_size // L
    optimizer = OPTIMIZER_NAMES[cfg.optimizer]
    # FSDP gives each rank 1/world of the training state.
    shards = world if cfg.fsdp else 1
    fixed = ranks * training_state_bytes(config, cfg.optimizer) // shards
    act = ranks * activation_bytes(config, b * L, cfg.grad_checkpointing, L)
    if free is None or fixed + act <= free:
        return

    def largest_batch(recompute):
        # The largest --batch-size up to today's that fits, 0 if none does. It must divide
        # a step's sequences over the ranks, so that the accumulation comes out whole.
        best = 0
        for n in range(1, b + 1):
            if sequences % (n * world) != 0:
                continue
            act_n = activation_bytes(config, n * L, recompute, L)
            if fixed + ranks * act_n <= free:
                best = n
        return best

    n = largest_batch(cfg.grad_checkpointing)
    r = largest_batch(True)
    ways = []
    if 0 < n < b:
        ways.append(f"--batch-size {n} (the accumulation keeps --total-batch-size)")
    if r > 0 and not cfg.grad_checkpointing:
        way = "--grad-checkpointing"
        if r < b:
            way += f" with --batch-size {r}"
        ways.append(way)
    ways.append("a smaller --model")
    what = (f"a step needs about {(fixed + act) / 1e9:.1f} GB and the {cfg.device} has "
            f"{free / 1e9:.1f} GB free: {fixed / 1e9:.1f} GB for {params / 1e6:.1f}M "
            f"parameters with their gradients and {optimizer} state, {act / 1e9:.1f} GB "
            f"for the activations of {b} sequences of {L} tokens")
    if ranks > 1:
        what += f" (times {ranks} ranks on this machine)"
    what += ". Use " + " or ".join(ways)
    if cfg.device == "cpu" or fixed > free:
        raise TrainError(f"{what} (an estimate from measurements of float32 steps on a "
                         "CPU)")
    warnings.warn(f"{what} if it runs out (the activations are estimated from a CPU's)")


# -----------------------------------------------------------------------------
# A step, an eval, and the NaN guard.

def micro_step(model, x, y, autocast):
    """One micro-batch's mean loss. (The tests inject faults here.)"""
    with autocast:
        return model(x, y)[1]


def train_step(model, batches, autocast, world, signals):
    """One optimizer step's gradient -> (mean loss, whether any rank was signalled to
    stop)."""
    # The summed loss and the signals seen, in one tensor for one all-reduce.
    stats = torch.zeros(2, device=next(model.parameters()).device)
    for m in range(batches.accum_steps):
        x, y = next(batches)
        # DDP averages gradients across ranks once per optimizer step, not at every
        # micro-step. FSDP reduce-scatters each micro-step's, so every rank holds only its
        # shard of the sum.
        last = m == batches.accum_steps - 1
        sync = not isinstance(model, DDP) or last
        context = contextlib.nullcontext() if sync else model.no_sync()
        with context:
            loss = micro_step(model, x, y, autocast)
            (loss / batches.accum_steps).backward()
        stats[0] += loss.detach()
    stats[1] = len(signals)
    # A sum (gloo has no average): a signal on any rank stops all of them at the same step.
    if world > 1:
        dist.all_reduce(stats)
    loss = stats[0].item() / (batches.accum_steps * world)
    return loss, stats[1].item() > 0


@torch.no_grad()
def evaluate(model, val, layout, num_batches, autocast):
    """Mean loss over the fixed validation windows (the same at every eval), over all
    ranks. `layout` is the training's BatchConfig: its seq_len, micro-batch, rank, world
    size and device."""
    model.eval()
    # The sums of the token losses and of the tokens.
    total = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in data.val_batches(val, layout, num_batches):
        total[0] += micro_step(model, x, y, autocast).double() * y.numel()
        total[1] += y.numel()
    if layout.world_size > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def bits_per_byte(loss, source):
    """Bits per byte of a mean loss in nats per token on `source`, or None when its
    manifest does not count the bytes of its text.

    The eval scores only the first --eval-batches windows of the split, whose bytes no one
    counted, so the split's own bytes per token stand in for theirs:
    bpb = loss / ln 2 * tokens / bytes. An EOS is a token of no bytes; eval.py --data
    computes the exact figure over every token of the split."""
    if not source.text_bytes:
        return None
    return loss / math.log(2) * source.num_tokens / source.text_bytes


def max_abs_weight(model):
    """What "the weights blew up" measures: over all ranks' shards, so that all agree to
    save."""
    from torch.distributed.tensor import DTensor

    tensors = []
    for p in model.parameters():
        if isinstance(p, DTensor):
            p = p.to_local()
        tensors.append(p.detach())
    # A shard may be empty (a tensor of fewer rows than ranks): the zero stands in for it.
    tops = [t.abs().max() for t in tensors if t.numel()]
    tops.append(tensors[0].new_zeros(()))
    top = torch.stack(tops).max()
    if dist.is_initialized():
        dist.all_reduce(top, dist.ReduceOp.MAX)
    return top.item()


@dataclasses.dataclass
class NanGuard:
    """A step with a non-finite loss or gradient norm skips its update; `limit` in a row
    (0: never) restore the newest checkpoint while the data moves on (the poison is not
    replayed). Nothing is saved in a streak, nor weights beyond `explode` (max |w|): those
    roll back at once. Rolled back MAX_ROLLBACKS times with no save between (each time to
    the newest step: the same), it stops."""
    limit: int
    explode: float
    # Where the checkpoints are.
    out: Path
    # Non-finite steps in a row.
    streak: int = 0
    # Non-finite steps in all, kept in the checkpoints' meta.
    skipped: int = 0
    # Rollbacks since the last save.
    rollbacks: int = 0

    def finite(self, loss, norm, step, log):
        """Count a step; whether it may update the weights."""
        if math.isfinite(loss) and math.isfinite(norm):
            self.streak = 0
            return True
        self.streak += 1
        self.skipped += 1
        line = (f"[yellow]step {step}: non-finite loss or gradient norm, update skipped "
                f"({self.streak} in a row, {self.skipped} in all)[/yellow]")
        log(line, kind="event", event="nonfinite", step=step)
        return False

    def due(self):
        """Whether to roll back instead of stepping."""
        return self.limit > 0 and self.streak >= self.limit

    def poison(self, model):
        """Why `model` must not be saved now, or None."""
        if self.streak:
            return f"{self.streak} non-finite steps in a row"
        top = max_abs_weight(model)
        if top > self.explode:
            # A rollback now; with --nan-guard 0 the run ends unsaved.
            self.streak = max(1, self.limit)
            return f"the weights have exploded (max |w| {top:.3g})"
        # A clean save point: the rollbacks count afresh.
        self.rollbacks = 0
        return None

    def roll_back(self, model, optimizers, step, log):
        restored = ckpt.load_latest(self.out, model, optimizers)[0]
        if restored is None:
            raise TrainError(f"{self.streak} bad steps in a row at step {step} and no "
                             f"checkpoint in {self.out}; lower --lr, check the data or raise "
                             "--nan-guard")
        line = (f"[yellow]step {step}: {self.streak} bad steps in a row, restored the "
                f"weights of step {restored}; the data continues from step {step}[/yellow]")
        log(line, kind="event", event="rollback", step=step, restored=restored)
        self.streak = 0
        self.rollbacks += 1
        if self.rollbacks == MAX_ROLLBACKS:
            raise TrainError(f"rolled back to step {restored} {MAX_ROLLBACKS} times in a "
                             f"row, bad again each time (last at step {step}); lower --lr or "
                             "check the data")


# -----------------------------------------------------------------------------
# The log: the window of steps since the last line, the console, metrics.jsonl, wandb.

@dataclasses.dataclass
class Window:
    """The steps since the last log line: every step's time, and the loss and gradient
    norm of the good steps (a skipped step's are not finite, and would make the means
    NaN)."""
    tokens_per_step: int
    seconds: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    norms: list = dataclasses.field(default_factory=list)

    def add(self, seconds, loss, norm, good):
        self.seconds.append(seconds)
        if good:
            self.losses.append(loss)
            self.norms.append(norm)

    def summary(self):
        """The means over the window. The loss and norm are NaN when every step was
        skipped."""
        loss = math.nan
        norm = math.nan
        if self.losses:
            loss = sum(self.losses) / len(self.losses)
            norm = sum(self.norms) / len(self.norms)
        steps = len(self.seconds)
        total = sum(self.seconds)
        tok_per_s = steps * self.tokens_per_step / total
        ms_per_step = 1000 * total / steps
        return dict(loss=loss, grad_norm=norm, tok_per_s=tok_per_s, ms_per_step=ms_per_step)

    def clear(self):
        self.seconds.clear()
        self.losses.clear()
        self.norms.clear()


# How a record's values read on the console, in this order. The rest is in the record
# only.
SHOW = dict(
    loss="loss {:.4f}",
    ppl="ppl {:.2f}",
    lr="lr {:.2e}",
    grad_norm="grad norm {:.3f}",
    tok_per_s="{:,.0f} tok/s",
    ms_per_step="{:.0f} ms/step",
    mfu="MFU {:.1%}",
    val_loss="val loss {:.4f}",
    val_bpb="bpb {:.4f}",
    val_ppl="ppl {:.2f}",
)


def write(path, text, append=False):
    """Write `path` whole (atomically) or append to it. A full disk is a TrainError naming
    the file."""
    try:
        if not append:
            return data.write_atomic(path, text.encode())
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        # The OSError of a failed write() names no file: the message does.
        reason = e.strerror or e
        raise TrainError(f"could not write {path} ({reason}); free disk space or fix the "
                         "permissions: a new run resumes from the newest checkpoint") from None


class Log:
    """log(line, **record): rank 0 prints the line, appends the record to metrics.jsonl
    (made at the first: a refused run leaves none; a dry run writes none) and sends it to
    wandb if set up."""

    def __init__(self, cfg, rank):
        self.wandb = None
        self.tokens_per_step = cfg.total_batch_size
        tty = sys.stdout.isatty()
        # A log file or pipe gets long lines, not a terminal's wrapping.
        width = None if tty else 200
        self.console = Console(highlight=False, width=width, quiet=rank != 0)
        # Only rank 0 writes records, and a dry run none.
        self.path = None
        if rank == 0 and not cfg.dry_run:
            self.path = Path(cfg.out_dir) / "metrics.jsonl"
        # A progress bar on terminals only: not in log files.
        no_bar = rank != 0 or not tty
        self.progress = Progress(console=self.console, transient=True, disable=no_bar)

    def __call__(self, line, **record):
        # Rich flushes: lines reach a log file or pipe as they happen.
        self.console.print(line)
        if record and self.path is not None:
            write(self.path, json.dumps(record) + "\n", append=True)
        if record and self.wandb is not None:
            # A logging service must never stop training.
            with contextlib.suppress(Exception):
                numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
                self.wandb.log(numbers, record["step"])

    def metrics(self, kind, step, **values):
        """A line and a record of `values`, with the tokens seen (plot.py's x axis)."""
        shown = []
        for key, fmt in SHOW.items():
            if values.get(key) is not None:
                shown.append(fmt.format(values[key]))
        # NaN is not JSON: it is written as null. (Only NaN differs from itself.)
        values = {k: None if v != v else v for k, v in values.items()}
        self(f"step {step}: {', '.join(shown)}", kind=kind, step=step,
             tokens=step * self.tokens_per_step, **values)

    def start_wandb(self, cfg, run_id):
        """Start or continue the wandb run `run_id` if WANDB_PROJECT is set -> its id.
        wandb reads its other WANDB_* variables itself."""
        if self.path and os.environ.get("WANDB_PROJECT"):
            try:
                import wandb
                config = dataclasses.asdict(cfg)
                self.wandb = wandb.init(id=run_id, resume="allow", config=config)
                return self.wandb.id
            except Exception as e:  # noqa: BLE001
                self(f"[yellow]warning: wandb disabled ({type(e).__name__}: {e})[/yellow]")
        return run_id


def header(log, cfg, model, batches, val):
    """The resolved run in one panel: what a reader of the log needs to know it is the run
    meant."""
    c = model.config
    world = batches.cfg.world_size

    shape = f"{c.n_layer} layers, d_model {c.d_model}, vocab {c.vocab_size}"
    if c.mimo_rank > 1:
        shape += f", mimo rank {c.mimo_rank}"
    if c.reset_token is not None:
        shape += f", reset after token {c.reset_token}"
    if c.attn_layers:
        a = c.attn_shape
        shape += (f", attention in layers {list(c.attn_layers)} ({a.heads} heads, "
                  f"{a.kv_heads} KV heads of {a.head_dim})")

    gpu = ""
    if cfg.device == "cuda":
        gpu = f" ({torch.cuda.get_device_name()})"
    compiled = "on" if cfg.compile else "off"
    devices = (f"{cfg.device}{gpu}, dtype {cfg.dtype}, compile {compiled}, world size "
               f"{world}")
    if cfg.fsdp:
        devices += ", FSDP"
        if world == 1:
            devices += " (without torchrun: nothing to shard)"

    batch = (f"{cfg.total_batch_size:,} tokens per step = {cfg.batch_size} seqs x "
             f"{cfg.seq_len} tokens x {batches.accum_steps} accumulation x {world} ranks")

    if cfg.data == ["synthetic"]:
        about_data = ("SYNTHETIC random tokens (--data synthetic): the loss stays at "
                      "ln(vocab)")
    else:
        sources = []
        for source, weight in zip(batches.sources, batches.weights):
            text = f"{source.path}"
            if len(cfg.data) > 1:
                text += f" ({float(weight):.0%} of the samples)"
            sources.append(text)
        tokens = sum(s.num_tokens for s in batches.sources)
        planned = cfg.total_batch_size * cfg.max_steps
        about_data = (f"{', '.join(sources)}: {tokens:,} tokens; "
                      f"{planned:,} planned = {planned / tokens:.2f} epochs")

    if val:
        about_eval = f"every {cfg.eval_every} steps on {val.path} (val)"
    else:
        about_eval = "[bold yellow]off: no val split of seq_len + 1 tokens[/bold yellow]"

    out = f"{cfg.out_dir}"
    if cfg.dry_run:
        out += " (dry run: nothing written)"
    keep = cfg.keep_last or "all"
    out += f", resume {cfg.resume}, save every {cfg.save_every} (keep {keep})"

    optimizer = f"AdamW for {cfg.max_steps} steps, lr {cfg.lr:g} -> {cfg.min_lr:g} "
    if cfg.optimizer == "muon":
        # Muon's LR follows the same schedule, in proportion.
        optimizer = (f"Muon (the blocks' matrices, lr {cfg.muon_lr:g}) and AdamW (lr "
                     f"{cfg.lr:g} -> {cfg.min_lr:g}) for {cfg.max_steps} steps ")
    optimizer += (f"({cfg.schedule}, {cfg.warmup_steps} warmup), weight decay "
                  f"{cfg.weight_decay:g}, grad clip {cfg.grad_clip:g}, nan guard "
                  f"{cfg.nan_guard}, seed {cfg.seed}")

    lines = [
        f"model      {cfg.model}: {model.num_params():,} parameters ({shape})",
        f"device     {devices}",
        f"batch      {batch}",
        f"data       {about_data}",
        f"eval       {about_eval}",
        f"out        {out}",
        f"optimizer  {optimizer}",
    ]
    if cfg.init_from:
        lines.append(f"init from  {cfg.init_from}")
    log.console.print(Panel("\n".join(lines), title="mamba3-lite train", expand=False))


# -----------------------------------------------------------------------------
# The run directory: branches moved aside, resume, checkpoints.

def finish_moves(out, step=None):
    """Do the moves journalled as OUT/.NAME.afterSTEP.moving/ (then named NAME, returned)
    and drop records after `step`. The next run finishes one a killed run left before it
    reads or writes a step (so the steps after the journal's are still the ones to move):
    no step is split in two."""
    metrics = out / "metrics.jsonl"
    aside = None
    text = ""
    if metrics.exists():
        text = metrics.read_text()
    # Each record's line and step. A line a full disk cut short has none, and is dropped.
    records = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            records.append((line + "\n", json.loads(line)["step"]))

    for stage in sorted(out.glob(".*.after*.moving")):
        final, after = stage.name[1:-len(".moving")].rsplit(".after", 1)
        after = int(after)
        names = []
        for s, paths in ckpt.step_files(out).items():
            if s > after:
                names.extend(p.name for p in paths)
        # A move after step -1 is the whole old run's: its config goes too.
        if after < 0 and (out / "config.json").exists():
            names.append("config.json")
        for name in names:
            os.replace(out / name, stage / name)
        moved = [line for line, s in records if s > after]
        write(stage / metrics.name, "".join(moved))
        # The move, whole.
        aside = out / final
        os.replace(stage, aside)
        data.fsync(out)
        if step is None:
            step = after
        else:
            step = min(after, step)

    kept = [line for line, s in records if step is None or s <= step]
    keep = "".join(kept)
    # Rewritten if records were dropped, or if a last line lacks its newline: the next
    # record would join it.
    if keep != text:
        write(metrics, keep)
    return aside


def move_aside(out, step, files, prefix):
    """Move the checkpoint `files` of steps after `step` (step -1: and config.json) and
    their records into a new OUT/PREFIX-TIME/, returned (None if none): a branch left is
    never deleted. The hidden stage is made first, its name the journal (`step` in it),
    then finish_moves moves."""
    if any(s > step for s in files):
        base = time.strftime(f"{prefix}-%Y%m%d-%H%M%S")
        # Two moves within a second get -1, -2, ... after the time.
        for i in range(99):
            name = base if i == 0 else f"{base}-{i}"
            if not (out / name).exists():
                break
        (out / f".{name}.after{step}.moving").mkdir()
    return finish_moves(out, step)


def data_identity(batches):
    """Per source, what resume compares: its path, weight and its files' digest."""
    return [dict(path=str(s.path), weight=str(w), files=s.digest())
            for s, w in zip(batches.sources, batches.weights)]


def refuse_another_optimizer(cfg, out):
    """Refuse to continue a run with another --optimizer than the one it was trained with:
    its checkpoints hold that optimizer's state, which the other cannot take."""
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        # No config to tell: the checkpoint's own check then refuses a mismatch.
        return
    # Runs from before --optimizer existed were trained with AdamW.
    trained_with = config.get("optimizer", "adamw")
    if trained_with != cfg.optimizer:
        raise TrainError(f"{out} was trained with --optimizer {trained_with}, whose state "
                         f"its checkpoints hold: resume it with --optimizer {trained_with}, "
                         f"or start anew with --optimizer {cfg.optimizer} (--resume never "
                         "or another --out-dir)")


def resume(cfg, model, optimizers, batches, log, cleanup):
    """Lock the directory (rank 0), load what --resume asks for (weights, optimizer, data
    position, RNGs: bit for bit) -> its meta, or None. Once all that cannot continue is
    refused, newer steps (a branch left, unverifiable steps; --overwrite: the old run) and
    their records move aside. A finished run (at --max-steps already) has nothing to do,
    and its directory stays as it is."""
    out = Path(cfg.out_dir)
    # Only rank 0 writes.
    writes = log.path is not None
    step = None
    meta = None
    if cfg.resume.isdigit():
        # A step that does not exist is refused before the lock.
        ckpt.read_meta(out, int(cfg.resume))
    if writes:
        if (out / official.MARKER).is_file():
            raise TrainError(f"{out} is an export (it holds {official.MARKER}): a run "
                             "would overwrite its config.json; use another --out-dir")
        # One run per directory.
        cleanup.enter_context(ckpt.lock(out))
        # What a run killed while moving steps aside left is done first.
        finish_moves(out)
    files = ckpt.step_files(out)
    if files and cfg.resume != "never":
        refuse_another_optimizer(cfg, out)
    if files and cfg.resume == "never" and not cfg.overwrite:
        raise TrainError(f"{out} already holds checkpoints (steps {sorted(files)}): use "
                         "--resume auto, another --out-dir, or --overwrite to move them to "
                         "previous-TIME/")
    try:
        if cfg.resume == "auto":
            step, meta = ckpt.load_latest(out, model, optimizers, restore_rng=True)
        elif cfg.resume != "never":
            step = int(cfg.resume)
            meta = ckpt.load(out, step, model, optimizers, restore_rng=True)
    except ckpt.ModelMismatch as e:
        raise TrainError(f"{e.what}: resume with its --model, --vocab-size and "
                         f"--reset-at-eos ({out}/config.json), or start anew: --resume never "
                         "or another --out-dir")
    if step is None and files and cfg.resume == "auto":
        names = []
        for paths in files.values():
            names.extend(p.name for p in paths)
        listed = ", ".join(names)[:400]
        raise TrainError(f"{out} holds checkpoint files but no step verifies ({listed}); "
                         "nothing changed: use --resume STEP, or --resume never --overwrite "
                         "to move them")

    if step is not None:
        # A source is known by its weight and files' digest; its path may change.
        # Checkpoints from before this record have none, and are not compared.
        was = [(d["weight"], d["files"]) for d in meta.get("data_identity") or []]
        now = [(d["weight"], d["files"]) for d in data_identity(batches)]
        same = was == [] or was == now
        if not same and not cfg.new_data:
            was_data = " ".join(meta["config"]["data"])
            now_data = " ".join(cfg.data)
            raise TrainError(f"{out} step {step} was trained on --data {was_data}, not "
                             f"{now_data}: add --new-data to continue on it, or --resume never "
                             "or another --out-dir")
        # New data starts at its beginning.
        if same:
            batches.load_state_dict(meta["data"])
        if cfg.max_steps < step:
            raise TrainError(f"--max-steps {cfg.max_steps} is below the resumed step "
                             f"{step}")

    # Also without a step: the records of a run killed before its first save are dropped.
    prefix = "previous" if cfg.resume == "never" else "abandoned"
    if writes:
        after = -1 if step is None else step
        aside = move_aside(out, after, files, prefix)
        if aside and step is None:
            log(f"moved the previous run aside into {aside}")
        elif aside:
            newer = [s for s in files if s > step]
            log(f"[yellow]moved the newer steps {newer} and their records aside into "
                f"{aside}[/yellow]")

    # Said before the header, which then follows. A run with nothing to do writes nothing:
    # no resume record, no config.
    nothing_to_do = step == cfg.max_steps and not cfg.dry_run
    if step is not None and nothing_to_do:
        log(f"resumed from {out} step {step}")
    elif step is not None:
        log(f"resumed from {out} step {step}", kind="event", event="resume", step=step)
    if nothing_to_do:
        log(f"{out} is at step {step} of --max-steps {step} already: nothing to do")

    # The directory is this run's now: its config, and its tokenizer for sample.py.
    if writes and not nothing_to_do:
        write(out / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        source = batches.sources[0]
        spec = source.tokenizer
        if spec and spec.get("name") == "file":
            shutil.copy(source.path / spec["file"], out / spec["file"])
    return meta


def save_checkpoint(cfg, step, model, optimizers, log, state):
    """Save step `step` with `state` in its meta. (The tests inject faults here.)"""
    t0 = time.time()
    tag = "final" if step == cfg.max_steps else "periodic"
    tokens = step * cfg.total_batch_size
    config = dataclasses.asdict(cfg)
    # The skipped steps made no update.
    updates = step - state["skipped_steps"]
    meta = dict(state, tokens_seen=tokens, config=config, optimizer_steps=updates, tag=tag)
    # --keep-last 0 keeps them all.
    keep_last = cfg.keep_last or None
    ckpt.save(cfg.out_dir, step, model, optimizers, meta, keep_last=keep_last)
    seconds = time.time() - t0
    log(f"step {step}: saved checkpoint to {cfg.out_dir} ({seconds:.1f}s)",
        kind="event", event="checkpoint", step=step)


# -----------------------------------------------------------------------------
# The run, and its command line.

@dataclasses.dataclass
class Run:
    """What setup builds for the training loop."""
    rank: int
    world: int
    local_rank: int
    batches: data.Batches
    # The validation split, or None: evaluation is off.
    val: Optional[data.TokenSource]
    # The model that is saved and restored; the loop may wrap it for speed and for DDP.
    model: Mamba3LM
    # [AdamW], or [Muon, AdamW]; and each of their param groups' peak LR over --lr.
    optimizers: list
    lr_scales: list


def shard(model, cfg):
    """FSDP2: each block (compiled first: torchtitan's order), then the root. A rank holds
    1/world of the weights, gradients and optimizer state, and gathers a block's weights
    only while it computes: in bf16 on CUDA, while master weights and gradient reduction
    stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = ()
    if cfg.device == "cuda" and cfg.dtype == "bf16":
        dtypes = (torch.bfloat16, torch.float32)
    # FSDP2 warns of the logits' view (the padded vocabulary sliced off): nothing edits it.
    warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
    for block in model.blocks:
        if cfg.compile:
            block.compile()
        fully_shard(block, mp_policy=MixedPrecisionPolicy(*dtypes))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(*dtypes))


def setup(cfg, init, tmp, cleanup):
    """The process group, the data, the model and its optimizer -> Run; bad input refused.
    init: --init-from's (ModelConfig fields, state dict, tokenizer spec), or None."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # torchrun sets RANK. Plain python is a world of one, with a process group for --fsdp.
    if "RANK" in os.environ or cfg.fsdp:
        if cfg.device == "cuda":
            torch.cuda.set_device(local_rank)
        alone = {}
        if "RANK" not in os.environ:
            alone = dict(store=dist.HashStore(), rank=0, world_size=1)
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend=backend, **alone)
        cleanup.callback(dist.destroy_process_group)
    torch.manual_seed(cfg.seed)

    # The data: missing, malformed or out-of-vocabulary data is refused here, before
    # anything else.
    opened = data.open_blend(cfg.data, cfg.data_dtype, cfg.vocab_size, cfg.seed, tmp)
    sources, weights, val, vocab = opened
    world = max(world, 1)
    # The sequences of one optimizer step.
    sequences = cfg.total_batch_size // cfg.seq_len
    # On a GPU the next batches are read while the step computes.
    prefetch = cfg.device == "cuda"
    layout = data.BatchConfig(cfg.seq_len, cfg.batch_size, sequences, cfg.seed, rank,
                              world, cfg.device, prefetch=prefetch)
    batches = data.Batches(sources, layout, weights)
    cleanup.callback(batches.close)
    source = sources[0]
    # A val split shorter than one window (a short first document, say): the header says
    # that evaluation is off; the training is still worth running.
    if val is not None and val.num_tokens < cfg.seq_len + 1:
        val = None

    # The model: the preset's, or --init-from's.
    if cfg.reset_at_eos and source.eos_id is None:
        raise TrainError(f"--reset-at-eos needs data that records its EOS id (a "
                         f"prepare.py directory); {source.path} does not")
    if init:
        init_fields, init_state, init_tokenizer = init
        if init_tokenizer and source.tokenizer:
            if init_tokenizer["name"] != source.tokenizer["name"]:
                theirs = init_tokenizer["name"]
                ours = source.tokenizer["name"]
                raise TrainError(f"--init-from {cfg.init_from} has the {theirs} tokenizer, "
                                 f"the data {ours}: token ids would mean other things")
        config = ModelConfig(**init_fields)
    else:
        config = dataclasses.replace(PRESETS[cfg.model], vocab_size=vocab,
                                     mimo_rank=cfg.mimo_rank or 1,
                                     **attention_fields(cfg))
    if cfg.reset_at_eos:
        config = dataclasses.replace(config, reset_token=source.eos_id)
    # Before the weights take any memory.
    check_memory(cfg, config)
    device = f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu"
    model = Mamba3LM(config).to(device)
    if init:
        # The weights only: the optimizer, schedule and data start afresh.
        model.load_state_dict(init_state)
    model.grad_checkpointing = cfg.grad_checkpointing
    official.check_impl(model)
    # Sharded before the optimizer is built, which must hold the shards.
    if cfg.fsdp:
        shard(model, cfg)
    optimizers = build_optimizers(model, cfg)
    scales = lr_scales(optimizers, cfg)
    return Run(rank=rank, world=world, local_rank=local_rank, batches=batches, val=val,
               model=model, optimizers=optimizers, lr_scales=scales)


def train(cfg, init, tmp, cleanup):
    """Set up, then train. cleanup (an ExitStack) releases what the setup takes, however it
    ends."""
    run = setup(cfg, init, tmp, cleanup)
    batches = run.batches
    optimizers = run.optimizers
    log = Log(cfg, run.rank)
    meta = resume(cfg, run.model, optimizers, batches, log, cleanup)
    if meta is None:
        meta = dict(step=0, skipped_steps=0)
    step = meta["step"]
    if cfg.dry_run:
        cfg = dataclasses.replace(cfg, max_steps=step + 2, log_every=1)
    header(log, cfg, run.model, batches, run.val)
    run_id = log.start_wandb(cfg, meta.get("wandb_run_id"))
    progress = cleanup.enter_context(log.progress)
    bar = progress.add_task("train", total=cfg.max_steps, completed=step)

    # run.model is what is saved and restored; `model` may be wrapped for speed and for
    # DDP.
    model = run.model
    if cfg.compile and not cfg.fsdp:
        model = torch.compile(model)
    if run.world > 1 and not cfg.fsdp:
        device_ids = [run.local_rank] if cfg.device == "cuda" else None
        model = DDP(model, device_ids)
    bf16 = cfg.dtype == "bf16"
    autocast = torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=bf16)
    # MFU needs the GPU's peak FLOP/s: none on a CPU or a GPU missing from the table.
    peak = 0
    if cfg.device == "cuda":
        peak = run.world * (peak_flops(torch.cuda.get_device_name()) or 0)
    explode = EXPLODED * max(1.0, max_abs_weight(run.model))
    skipped = meta["skipped_steps"]
    guard = NanGuard(cfg.nan_guard, explode, Path(cfg.out_dir), skipped=skipped)

    # SIGTERM and Ctrl-C finish the step, save and exit, all ranks at the same step.
    stop = []
    stopping = False

    def on_signal(sig, frame):
        stop.append(signal.Signals(sig).name)

    for s in (signal.SIGTERM, signal.SIGINT):
        old = signal.signal(s, on_signal)
        cleanup.callback(signal.signal, s, old)

    window = Window(cfg.total_batch_size)
    # The wall time counts on as if the run had never stopped.
    t_start = time.time() - meta.get("wall_time", 0.0)
    while step < cfg.max_steps and not stopping:
        # One optimizer step: accumulate, clip, update unless non-finite.
        if not guard.due():
            # The tok/s figures time the steps alone: not eval, save or rollback.
            t0 = time.time()
            # The LR is a pure function of the step, so a resumed run needs no scheduler
            # state.
            lr = lr_at(step, cfg)
            groups = []
            for optimizer in optimizers:
                groups.extend(optimizer.param_groups)
            for group, scale in zip(groups, run.lr_scales):
                group["lr"] = lr * scale
            for optimizer in optimizers:
                if isinstance(optimizer, torch.optim.Muon):
                    for group in optimizer.param_groups:
                        group["momentum"] = muon_momentum(step)
            loss, stopping = train_step(model, batches, autocast, run.world, stop)
            # With --grad-clip 0 the norm is measured, not clipped.
            clip = cfg.grad_clip or math.inf
            norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip).item()
            good = guard.finite(loss, norm, step, log)
            for optimizer in optimizers:
                if good:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            window.add(time.time() - t0, loss, norm, good)
            step += 1
        # Back to the newest checkpoint; the data cursor keeps moving.
        if guard.due():
            guard.roll_back(run.model, optimizers, step, log)
        # The final log, eval and save happen in the loop.
        last_step = step == cfg.max_steps
        progress.update(bar, completed=step)

        if window.seconds and (step % cfg.log_every == 0 or last_step):
            mean = window.summary()
            mfu = None
            if peak:
                mfu = run.model.flops_per_token(cfg.seq_len) * mean["tok_per_s"] / peak
            loss = mean["loss"]
            # The perplexity is capped where exp would overflow.
            ppl = math.exp(min(loss, 50))
            # The LR of the window's last step.
            lr = lr_at(step - 1, cfg)
            log.metrics("train", step, loss=loss, ppl=ppl, grad_norm=mean["grad_norm"],
                        lr=lr, tok_per_s=mean["tok_per_s"], mfu=mfu,
                        ms_per_step=mean["ms_per_step"])
            window.clear()

        if run.val is not None and (last_step or step % cfg.eval_every == 0):
            val_loss = evaluate(model, run.val, batches.cfg, cfg.eval_batches, autocast)
            val_ppl = math.exp(min(val_loss, 50))
            # Bits per byte only when the manifest counts bytes: older data logs as before.
            extra = {}
            val_bpb = bits_per_byte(val_loss, run.val)
            if val_bpb is not None:
                extra["val_bpb"] = val_bpb
            log.metrics("eval", step, val_loss=val_loss, **extra, val_ppl=val_ppl)

        if last_step or stopping or step % cfg.save_every == 0:
            # Poison is never saved.
            why = guard.poison(run.model)
            # Under FSDP every rank takes part in gathering the state; rank 0 writes.
            saves = (run.rank == 0 or cfg.fsdp) and not cfg.dry_run
            if why:
                log(f"[yellow]step {step}: not saved: {why}[/yellow]", kind="event",
                    event="not_saved", step=step)
            elif saves:
                state = dict(skipped_steps=guard.skipped, data=batches.state_dict(),
                             wandb_run_id=run_id, data_identity=data_identity(batches),
                             tokenizer=batches.sources[0].tokenizer,
                             wall_time=time.time() - t_start)
                save_checkpoint(cfg, step, run.model, optimizers, log, state)

    if guard.streak:
        raise TrainError(f"the run ended at step {step} in a streak of bad steps, not "
                         f"saved; resume from the newest checkpoint in {cfg.out_dir} with a "
                         "lower --lr")
    if stopping:
        who = stop[0] if stop else "a signal on another rank"
        log(f"stopped by {who} at step {step}; resume with --resume auto")


def lost_peer(e, cfg):
    """The TrainError for a rank lost under torchrun, or `e` itself. Its peers see a closed
    connection, not why; DDP's hooks raise a plain RuntimeError."""
    text = str(e)
    collective = isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text
    if not collective:
        return e
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return e
    # The first sentence of what the peer saw, without the source location.
    seen = text.split("] ", 1)[-1].split(". ")[0][:200]
    rank = dist.get_rank()
    world = dist.get_world_size()
    return TrainError(f"rank {rank} of {world} lost another rank, which stopped (killed, or "
                      f"failed: its output says why): {seen}. When it is fixed, run again: "
                      f"it resumes from the newest checkpoint in {cfg.out_dir}")


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="rich")
# The first line of the docstring, and how a run starts.
HELP = (__doc__.split("\n\n")[0] + "\n\nResumes from the newest checkpoint in --out-dir "
        "by default (--resume auto). Flags marked (preset) default to the preset's recipe.")


@app.command(help=HELP)
def main(**flags):
    # Each of these is one paragraph: an OSError is the disk's; a ValueError the data's,
    # pick_device's or ModelConfig's.
    with data.cli_errors(TrainError, ckpt.CheckpointError, OSError, ValueError):
        cfg = TrainConfig(**flags)
        refuse_empty_paths(cfg)
        init = None
        init_fields = None
        if cfg.init_from:
            init = official.read_pretrained(cfg.init_from)
            init_fields = init[0]
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as cleanup:
            try:
                train(resolve(cfg, init_fields), init, tmp, cleanup)
            except RuntimeError as e:
                # Raised here, before the ExitStack ends the process group.
                raise lost_peer(e, cfg) from None


# The flags are TrainConfig's fields, written once.
main.__signature__ = inspect.signature(TrainConfig)

if __name__ == "__main__":
    app()
