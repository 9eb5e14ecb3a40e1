"""Three-file checkpoints: atomic save, discovery, verified load, retention.

For every saved step N the checkpoint directory holds

    model_step_N.safetensors   the unwrapped model's weights (tied tensors written as independent copies)
    optim_step_N.pt            optimizer state + RNG states, tensors and plain values only (weights_only=True)
    meta_step_N.json           the caller's meta + step, time, versions, model config, and the byte size and
                               sha256 of the two files above

Each file is written under a temporary name in the same directory (".NAME.PID.tmp", which never looks like
a step), fsynced and renamed; the meta goes last and is the commit marker; then the directory is fsynced.
So a kill at any instant leaves the previous steps and either all of the new one or nothing that counts.
One process writes to a directory at a time (train.py holds a lock); any number may read. A checkpoint that
fails verification is reported and skipped, and never deleted by this module.
"""
import dataclasses
import hashlib
import json
import os
import pickle
import platform
import random
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors
import torch
import safetensors.torch


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model it is loaded into."""


class CorruptCheckpoint(CheckpointError):
    """The files of a step cannot be trusted (hash mismatch, unreadable): load_latest tries an older step."""


def _names(step):
    return f"model_step_{step}.safetensors", f"optim_step_{step}.pt", f"meta_step_{step}.json"


STEP_FILE = re.compile(r"(?:model|optim|meta)_step_(0|[1-9][0-9]*)\.(?:safetensors|pt|json)")
_TMP = re.compile(r"\.(?:model|optim|meta)_step_[0-9]+\.[a-z]+\.([0-9]+)\.tmp")
_written = set()  # (directory, step) saved by this process: known good, so retention need not re-hash them

# -----------------------------------------------------------------------------
# save


def save(dir, step, model, optimizer, meta, keep_last=None):
    """Write checkpoint `step` of `model` (and `optimizer`, or None) into `dir` atomically; return the three paths.

    `meta` holds plain JSON values (tuples come back as lists), else CheckpointError before anything is
    written. ckpt adds "step", "time", "versions", "files" ({name: {"bytes", "sha256"}}) and "model_config"
    (the unwrapped model's dataclass `config`, if any). DDP / torch.compile wrappers are unwrapped, so the
    keys are the plain model's. Re-saving a step replaces it. A failed write (disk full, permissions) is a
    CheckpointError naming the directory; what was there is untouched. keep_last=K then deletes all but the
    K highest complete steps: never the one just written, never one that fails verification (a step this
    process did not write is re-hashed first).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
    module = _unwrap(model)
    # everything that can be refused is refused before the first byte reaches the disk
    versions = {"torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__,
                "safetensors": safetensors.__version__}
    meta = dict(meta or {}, step=step, time=time.time(), versions=versions)
    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        meta["model_config"] = dataclasses.asdict(config)
    _check_json(meta, "meta")
    tensors = _independent(module.state_dict())
    optim = {"optimizer": None if optimizer is None else optimizer.state_dict(), "rng": _rng_state()}
    _check_plain(optim, "optimizer file")

    d = Path(dir)
    model_name, optim_name, meta_name = _names(step)
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(d)
        with ThreadPoolExecutor(2) as pool:  # two independent files; the writers and sha256 release the GIL
            jobs = [pool.submit(_write_tmp, d, model_name, lambda p: safetensors.torch.save_file(tensors, p, {"format": "pt"})),
                    pool.submit(_write_tmp, d, optim_name, lambda p: torch.save(optim, p))]
        (tmp_model, model_info), (tmp_optim, optim_info) = [job.result() for job in jobs]
        meta["files"] = {model_name: model_info, optim_name: optim_info}
        # Re-saving an existing step: un-commit it first, so a crash between the renames below can never
        # pair the old meta with a new weights file.
        if (d / meta_name).exists():
            (d / meta_name).unlink()
            _fsync_dir(d)
        os.replace(tmp_model, d / model_name)
        os.replace(tmp_optim, d / optim_name)
        _fsync_dir(d)  # the data files' names are durable before the meta that vouches for them
        tmp_meta, _ = _write_tmp(d, meta_name, lambda p: p.write_text(json.dumps(meta, indent=2)))
        os.replace(tmp_meta, d / meta_name)  # the commit
        _fsync_dir(d)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        for name in _names(step):
            (d / f".{name}.{os.getpid()}.tmp").unlink(missing_ok=True)
        free = f"{shutil.disk_usage(d).free / 1e9:.1f} GB free there" if d.is_dir() else "it cannot be created"
        raise CheckpointError(f"could not write checkpoint step {step} in {d} ({free}): {e}. Free disk space or "
                              f"fix the permissions; the checkpoints already there are untouched") from None
    _written.add((d.resolve(), step))
    if keep_last is not None:
        _retain(d, keep_last, step)
    return d / model_name, d / optim_name, d / meta_name


def _unwrap(model):
    # DDP keeps the model in `.module`, torch.compile in `._orig_mod`, and they nest. Only a module whose
    # single child is that attribute counts as a wrapper (a model may have a submodule called `module`).
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module) or list(model.children()) != [inner]:
            return model
        model = inner


def _independent(state):
    # safetensors refuses tensors that share memory (a tied embedding and head): write later ones as copies
    seen, out = set(), {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"model state {name!r} is a {type(t).__name__}, not a tensor; safetensors holds "
                                  f"tensors only")
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.detach().clone() if ptr in seen else t.detach().contiguous()
        seen.add(ptr)
    return out


def _check_json(x, where):
    # json.dumps would quietly turn int keys into strings and write NaN, which is not JSON; a meta that does
    # not round-trip exactly is worse than an error at the first save
    if x is None or isinstance(x, (str, bool, int)) or (isinstance(x, float) and x == x and abs(x) != float("inf")):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_json(v, f"{where}[{i}]")
    elif isinstance(x, dict) and all(isinstance(k, str) for k in x):
        for k, v in x.items():
            _check_json(v, f"{where}[{k!r}]")
    else:
        raise CheckpointError(f"{where} is {str(x)[:60]} ({type(x).__name__}), which JSON cannot hold exactly; store "
                              f"plain values (finite floats, str keys) before saving")


def _check_plain(x, where):
    # weights_only=True unpickles tensors and plain containers only: an exotic optimizer value would save
    # fine and then refuse to load at resume time
    if x is None or isinstance(x, (str, bool, int, float, torch.Tensor, torch.dtype, torch.device, torch.Size)):
        return
    if type(x) in (list, tuple, dict):
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where}: {type(x).__name__} value ({str(x)[:60]}) would not load with "
                          f"torch.load(weights_only=True); only tensors and plain Python values may go there")


def _rng_state():
    # the current CUDA device's state only: asking for all would create a context on every GPU from rank 0
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate(),
            "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}}


def _set_rng_state(rng):
    torch.set_rng_state(rng["torch"].cpu())  # both setters want CPU byte tensors, wherever map_location put them
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    random.setstate(rng["python"])
    n = rng["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))


def _write_tmp(d, name, write):
    """write(path) to a temporary name in d, then hash and fsync it; return (tmp path, {bytes, sha256})."""
    tmp = d / f".{name}.{os.getpid()}.tmp"
    write(tmp)
    with open(tmp, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()  # from the page cache while the disk writes
        os.fsync(f.fileno())
    return tmp, {"bytes": tmp.stat().st_size, "sha256": digest}


def _fsync_dir(d):
    # a rename is durable only once the directory itself is fsynced (Windows cannot open directories)
    if os.name != "nt":
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_leftovers(d):
    # Temporary files of saves that were killed midway (their process is gone), and the data files of steps
    # without a meta: a save killed before its commit, or a retention killed after deleting the meta. Only
    # the writer of d calls this, so a data file without a meta can never be a save in progress.
    for paths in step_files(d).values():
        for p in paths if not any(p.suffix == ".json" for p in paths) else []:
            p.unlink(missing_ok=True)
    for p in d.iterdir():
        if (m := _TMP.fullmatch(p.name)) and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, but belongs to someone else
        pass
    return True


def _retain(d, keep_last, just_written):
    for step in list_steps(d)[:-keep_last]:
        if step == just_written:
            continue
        if (d.resolve(), step) not in _written:
            try:
                _verify(d, step)
            except CheckpointError as e:
                warnings.warn(f"retention keeps {e}", stacklevel=3)
                continue
        for name in reversed(_names(step)):  # meta first: the step stops counting before its data goes
            (d / name).unlink(missing_ok=True)


# -----------------------------------------------------------------------------
# discover

_warned = set()


def list_steps(dir):
    """The complete steps in `dir`, ascending: all three files present, sizes as the meta records (cheap;
    load() checks the hashes). One that does not count is reported once per process and skipped."""
    d = Path(dir)
    if not d.exists():
        return []
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory")
    steps = []
    for step in sorted(step_files(d)):
        try:
            read_meta(d, step)
            steps.append(step)
        except CheckpointError as e:
            if str(e) not in _warned:
                _warned.add(str(e))
                warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return steps


def read_meta(dir, step):
    """The meta of checkpoint `step` in `dir` after checking that its three files exist with the sizes it
    records; nothing is loaded or hashed. A step with no files at all is an error listing the steps there."""
    d = Path(dir)
    model_name, optim_name, meta_name = _names(step)
    if not any((d / name).exists() for name in _names(step)):
        steps = list_steps(d)
        raise CheckpointError(f"no checkpoint for step {step} in {d}; steps there: {steps if steps else 'none'}")
    try:
        meta = json.loads((d / meta_name).read_text())
        sizes = {name: int(meta["files"][name]["bytes"]) for name in (model_name, optim_name)}
        if not all(isinstance(meta["files"][name]["sha256"], str) for name in sizes) or meta["step"] != step:
            raise ValueError("its step or a sha256 is wrong")
    except FileNotFoundError:  # also when retention removes it while we look (readers do not lock)
        raise CheckpointError(f"step {step} in {d} is incomplete: {meta_name} is missing (an interrupted save?)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"step {step} in {d} is unreadable: {d / meta_name} is not a valid meta file ({e})") from None
    for name, size in sizes.items():
        found = (d / name).stat().st_size if (d / name).exists() else None
        if found is None:
            raise CheckpointError(f"step {step} in {d} is incomplete: {name} is missing")
        if found != size:
            raise CheckpointError(f"step {step} in {d} is damaged: {name} has {found} bytes, {meta_name} says {size}")
    return meta


def step_files(dir):
    """{step: [paths]} of every checkpoint file in `dir`, whether its step counts or not."""
    d, found = Path(dir), {}
    for p in sorted(d.iterdir()) if d.is_dir() else []:
        if m := STEP_FILE.fullmatch(p.name):
            found.setdefault(int(m.group(1)), []).append(p)
    return found


def latest_step(dir):
    """The highest complete step in `dir` (see list_steps), or None when there is none."""
    steps = list_steps(dir)
    return steps[-1] if steps else None


# -----------------------------------------------------------------------------
# load


def load(dir, step, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load checkpoint `step` of `dir` into `model` (and `optimizer`); return its meta.

    Both files are checked against their sha256 and parsed before anything is modified (a mismatch or an
    unreadable file is a CorruptCheckpoint naming the file). Weights are copied into the model's tensors,
    so tied parameters stay tied. strict=True: keys and meta["model_config"] must equal the model's (the
    error lists what differs); strict=False loads the keys both have. Shapes must always match.
    restore_rng=True restores the torch, CUDA, Python and NumPy RNG states.
    """
    d = Path(dir)
    meta, tensors, state = _read(d, step, map_location)
    _apply(d, step, meta, tensors, state, model, optimizer, strict, restore_rng)
    return meta


def load_latest(dir, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load the newest step of `dir` that verifies; return (step, meta), or (None, None) if there is none.
    A corrupt step gets a warning and the next older one is tried. A step that verifies but does not fit
    the model is an error: older steps of the same run would not fit either."""
    d = Path(dir)
    for step in reversed(list_steps(d)):
        try:
            meta, tensors, state = _read(d, step, map_location)
        except CorruptCheckpoint as e:
            warnings.warn(f"{e}; trying an earlier step", stacklevel=2)
            continue
        _apply(d, step, meta, tensors, state, model, optimizer, strict, restore_rng)
        return step, meta
    return None, None


def _verify(d, step):
    """Meta of `step` after checking sizes and the sha256 of both data files."""
    meta = read_meta(d, step)
    names = _names(step)[:2]

    def digest(name):
        with open(d / name, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(2) as pool:  # hashlib releases the GIL: both files at once
        for name, found in zip(names, pool.map(digest, names)):
            want = meta["files"][name]["sha256"]
            if found != want:
                raise CorruptCheckpoint(f"checkpoint step {step}: {d / name} is corrupt (sha256 {found[:16]}..., "
                                        f"{_names(step)[2]} says {want[:16]}...)")
    return meta


def _read(d, step, map_location):
    """(meta, tensors, optimizer file) of a step whose hashes match, or CorruptCheckpoint."""
    meta = _verify(d, step)
    model_name, optim_name, _ = _names(step)
    try:
        tensors = safetensors.torch.load_file(d / model_name, device=str(map_location))
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise CorruptCheckpoint(f"checkpoint step {step}: {d / model_name} matches its sha256 but is not a "
                                f"readable safetensors file ({e})") from None
    try:
        state = torch.load(d / optim_name, map_location=map_location, weights_only=True)
        if not isinstance(state, dict) or not {"optimizer", "rng"} <= state.keys():
            raise ValueError(f"expected a dict with 'optimizer' and 'rng', found {type(state).__name__}")
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpoint(f"checkpoint step {step}: {d / optim_name} matches its sha256 but cannot be "
                                f"read ({str(e)[:200]})") from None
    return meta, tensors, state


def _config_diff(saved, module):
    live = getattr(module, "config", None)
    if saved is None or not dataclasses.is_dataclass(live) or isinstance(live, type):
        return []
    live = json.loads(json.dumps(dataclasses.asdict(live), default=repr))  # tuples -> lists, as saved
    return [f"{k}: checkpoint {saved.get(k, '<absent>')!r}, model {live.get(k, '<absent>')!r}"
            for k in sorted(saved.keys() | live.keys()) if saved.get(k, "<absent>") != live.get(k, "<absent>")]


def _apply(d, step, meta, tensors, state, model, optimizer, strict, restore_rng):
    module = _unwrap(model)
    where = f"checkpoint step {step} in {d}"
    diff = _config_diff(meta.get("model_config"), module)
    if diff and strict:
        raise CheckpointError(f"{where} is from a model with a different config: " + "; ".join(diff) + ". Build the "
                              "model with the checkpoint's config (meta['model_config']) or pass strict=False")
    if diff:
        warnings.warn(f"checkpoint step {step}: model config differs: " + "; ".join(diff), stacklevel=3)
    own = module.state_dict()  # detached views of the live parameters and buffers
    missing, unexpected = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
    if strict and (missing or unexpected):
        raise CheckpointError(f"{where} does not fit the model: missing keys {missing or 'none'}; unexpected keys "
                              f"{unexpected or 'none'} (strict=False loads the keys both have)")
    common = sorted(own.keys() & tensors.keys())
    shapes = [f"{k}: checkpoint {list(tensors[k].shape)}, model {list(own[k].shape)}"
              for k in common if tensors[k].shape != own[k].shape]
    if shapes:
        raise CheckpointError(f"{where}: shapes differ: " + "; ".join(shapes))
    if optimizer is not None:
        if state["optimizer"] is None:
            raise CheckpointError(f"{where} was saved without optimizer state")
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{where}: optimizer state does not fit the optimizer: {e}") from None
    with torch.no_grad():
        for k in common:
            own[k].copy_(tensors[k])  # in place: parameters tied to each other stay tied
    if restore_rng:
        _set_rng_state(state["rng"])


# -----------------------------------------------------------------------------
# the official mamba_ssm format
#
# state-spaces/mamba's MambaLMHeadModel (mamba_ssm.models.mixer_seq_simple) builds a language model from a
# MambaConfig (config.json) and loads its state dict (pytorch_model.bin) with from_pretrained; the
# evaluation harness runs such a directory (lm_eval --model mamba_ssm). Its Mamba3 layer with MIMO and the
# output norm off is our mixer: the same in_proj layout (z | x | B | C | dd_dt | dd_A | trap | angle), the
# same dt / A / trapezoid / rotary math, B and C RMS-normalised per group then biased per head. Its blocks
# are ours too (pre-norm RMSNorm, mixer, RMSNorm, gated MLP), with a tied LM head. What differs is the
# naming and the packing of a few tensors:
#
#   ours                               official                                       change
#   embed.weight (V64, D)              backbone.embedding.weight, lm_head.weight      the first vocab_size rows;
#                                      (vocab_size, D)                                tied: one tensor, two keys
#   blocks.i.norm1.weight              backbone.layers.i.norm.weight
#   blocks.i.mixer.in_proj.weight      backbone.layers.i.mixer.in_proj.weight
#   blocks.i.mixer.dt_bias, D          backbone.layers.i.mixer.dt_bias, D
#   blocks.i.mixer.B_bias (H, N)       backbone.layers.i.mixer.B_bias (H, 1, N)       a MIMO rank axis, 1 here
#   blocks.i.mixer.C_bias (H, N)       backbone.layers.i.mixer.C_bias (H, 1, N)
#   blocks.i.mixer.B_norm_weight       backbone.layers.i.mixer.B_norm.weight
#   blocks.i.mixer.C_norm_weight       backbone.layers.i.mixer.C_norm.weight
#   blocks.i.mixer.out_proj.weight     backbone.layers.i.mixer.out_proj.weight
#   blocks.i.norm2.weight              backbone.layers.i.norm2.weight
#   blocks.i.mlp.up, .gate (F, D)      backbone.layers.i.mlp.fc1.weight (2F, D)       [up; gate]: its forward
#                                                                                     splits fc1's output in
#                                                                                     two and gates the 1st
#   blocks.i.mlp.down.weight           backbone.layers.i.mlp.fc2.weight
#   norm_f.weight                      backbone.norm_f.weight
#
# Some of our options have no official equivalent, and an export refuses them: the official MLP rounds
# its hidden size up to a multiple of 128, its layer accepts rope_fraction 0.5 or 1.0 and its kernel an even,
# non-zero number of rotary angles, and every norm's epsilon is fixed at 1e-5. The official model also has
# no state reset at a token (ModelConfig.reset_token): such a model is exported, with a warning.
#
# The vocabulary is exported unpadded (pad_vocab_size_multiple 1). Our padding rows are never trained, since
# our logits stop at vocab_size, but the official model returns a logit for every row, and anything that
# takes a softmax over them (the harness's log-likelihoods, generate's sampling) would give those rows
# probability: on the tiny and small presets trained briefly with the byte tokenizer they took 14% and 4.5%
# of the probability mass (0.16 and 0.05 nats per token of validation loss). Without the rows the official
# logits are ours, column for column.
#
# An export directory holds config.json, pytorch_model.bin, model.safetensors (the same tensors), the
# tokenizer files, README.md (how to load and evaluate it) and mamba3_lite.json, which marks the directory
# as an export (so that it may be replaced by the next one) and keeps what config.json cannot: our full
# model config and the tokenizer spec.

from typing import Optional  # noqa: E402  (this section's imports are kept with it)

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402

EXPORT_MARKER = "mamba3_lite.json"
EXPORT_FORMAT = "mamba3-lite official-format export"
EXPORT_FILES = {"config.json", "pytorch_model.bin", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "README.md", EXPORT_MARKER}
OFFICIAL_MLP_MULTIPLE = 128  # GatedMLP rounds its hidden size up to this
OFFICIAL_NORM_EPS = 1e-5  # MambaConfig has no field for it: every RMSNorm uses this
EOS_TEXT = "<|endoftext|>"  # the byte tokenizer's end of document, as prepare.py writes it

# MambaConfig's fields and Mamba3's keyword arguments, with the official defaults where a config.json may
# leave one out. Fields without a default here must be present.
OFFICIAL_CONFIG_DEFAULTS = dict(d_intermediate=0, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                                residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
                                tie_embeddings=True)
OFFICIAL_MAMBA3_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=1e-3,
                                dt_max=1e-1, dt_init_floor=1e-4, A_floor=1e-4, chunk_size=64,
                                is_outproj_norm=False, is_mimo=False)
# Mamba3 arguments that do not change a SISO layer without the output norm (or are ignored by it)
OFFICIAL_MAMBA3_INERT = {"layer", "mimo_rank", "fuse_pregate_headwise_norm", "dropout"}
_MIXER_NAMES = [("in_proj.weight", "in_proj.weight"), ("dt_bias", "dt_bias"), ("B_bias", "B_bias"),
                ("C_bias", "C_bias"), ("B_norm_weight", "B_norm.weight"), ("C_norm_weight", "C_norm.weight"),
                ("D", "D"), ("out_proj.weight", "out_proj.weight")]


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def official_config(cfg) -> dict:
    """Our ModelConfig -> the MambaConfig fields (config.json) that make the official modules rebuild exactly
    our model. A CheckpointError lists every option the official format cannot express."""
    problems = []
    if cfg.rope_fraction not in (0.5, 1.0):
        problems.append(f"rope_fraction {cfg.rope_fraction}: the official Mamba3 layer accepts only 0.5 and 1.0")
    elif cfg.n_angles == 0 or cfg.n_angles % 2:
        problems.append(f"d_state {cfg.d_state} with rope_fraction {cfg.rope_fraction} gives {cfg.n_angles} rotary "
                        f"angles: the official layer needs at least one and its kernel an even number")
    if cfg.mlp_hidden % OFFICIAL_MLP_MULTIPLE:
        problems.append(f"mlp_hidden {cfg.mlp_hidden}: the official GatedMLP rounds its hidden size up to a "
                        f"multiple of {OFFICIAL_MLP_MULTIPLE} ({_round_up(cfg.mlp_hidden, OFFICIAL_MLP_MULTIPLE)}), "
                        f"which would be another model; train with a multiple of {OFFICIAL_MLP_MULTIPLE} (or 0)")
    if cfg.norm_eps != OFFICIAL_NORM_EPS:
        problems.append(f"norm_eps {cfg.norm_eps}: the official model fixes every RMSNorm epsilon at "
                        f"{OFFICIAL_NORM_EPS} (MambaConfig has no field for it)")
    if problems:
        raise CheckpointError("; ".join(problems))
    ssm_cfg = dict(layer="Mamba3", d_state=cfg.d_state, expand=cfg.expand, headdim=cfg.headdim, ngroups=cfg.ngroups,
                   rope_fraction=cfg.rope_fraction, dt_min=cfg.dt_min, dt_max=cfg.dt_max,
                   dt_init_floor=cfg.dt_init_floor, A_floor=cfg.A_floor, chunk_size=cfg.chunk_size,
                   is_outproj_norm=False, is_mimo=False)
    # residual_in_fp32 is what our bf16 training does (the stream stays float32); fused_add_norm is the same
    # math, done by the official fused kernel
    return dict(d_model=cfg.d_model, d_intermediate=cfg.mlp_hidden, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                ssm_cfg=ssm_cfg, attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True,
                fused_add_norm=True, pad_vocab_size_multiple=1, tie_embeddings=True)


def config_from_official(config: dict, where) -> dict:
    """MambaConfig fields (a config.json) -> our ModelConfig fields; a CheckpointError naming `where` for
    anything our model cannot represent exactly (other layers, MIMO, the output norm, attention, LayerNorm,
    an untied head) or a field that is missing or unknown."""
    def refuse(why):
        raise CheckpointError(f"{where}: {why}; mamba3-lite models are Mamba-3 SISO layers with RMSNorm, "
                              f"gated MLPs and a tied LM head")

    missing = [k for k in ("d_model", "n_layer", "vocab_size", "ssm_cfg") if k not in config]
    unknown = sorted(config.keys() - OFFICIAL_CONFIG_DEFAULTS.keys() - {"d_model", "n_layer", "vocab_size", "ssm_cfg"})
    if missing or unknown:
        found = [f"missing {', '.join(missing)}"] if missing else []
        found += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise CheckpointError(f"{where}: not a mamba_ssm MambaConfig: " + "; ".join(found))
    c = {**OFFICIAL_CONFIG_DEFAULTS, **config}
    ssm = {**OFFICIAL_MAMBA3_DEFAULTS, **(c["ssm_cfg"] or {})}
    if ssm.get("layer", "Mamba1") != "Mamba3":
        refuse(f"ssm_cfg layer is {ssm.get('layer', 'Mamba1 (the default)')}, not Mamba3")
    if unknown := sorted(ssm.keys() - OFFICIAL_MAMBA3_DEFAULTS.keys() - OFFICIAL_MAMBA3_INERT):
        refuse(f"ssm_cfg has options this converter does not know: {', '.join(unknown)}")
    for flag, what in (("is_mimo", "MIMO layers"), ("is_outproj_norm", "the norm before out_proj")):
        if ssm[flag]:
            refuse(f"ssm_cfg {flag} is true ({what})")
    if c["attn_layer_idx"]:
        refuse(f"layers {c['attn_layer_idx']} are attention layers (attn_layer_idx)")
    if not c["rms_norm"]:
        refuse("rms_norm is false (LayerNorm blocks)")
    if not c["tie_embeddings"]:
        refuse("tie_embeddings is false (a separate LM head)")
    if ssm["expand"] != int(ssm["expand"]):
        refuse(f"ssm_cfg expand is {ssm['expand']}, not a whole number")
    if ssm["rope_fraction"] not in (0.5, 1.0):
        refuse(f"ssm_cfg rope_fraction is {ssm['rope_fraction']}, which the official layer itself refuses")
    return dict(vocab_size=c["vocab_size"], n_layer=c["n_layer"], d_model=c["d_model"], expand=int(ssm["expand"]),
                headdim=ssm["headdim"], d_state=ssm["d_state"], ngroups=ssm["ngroups"],
                rope_fraction=ssm["rope_fraction"], mlp_hidden=_round_up(c["d_intermediate"], OFFICIAL_MLP_MULTIPLE),
                chunk_size=ssm["chunk_size"], A_floor=ssm["A_floor"], dt_min=ssm["dt_min"], dt_max=ssm["dt_max"],
                dt_init_floor=ssm["dt_init_floor"], norm_eps=OFFICIAL_NORM_EPS)


def _name_pairs(n_layer, has_mlp):
    """(our key, official key) for every tensor that keeps its values; lm_head.weight and fc1 are special."""
    pairs = [("embed.weight", "backbone.embedding.weight"), ("norm_f.weight", "backbone.norm_f.weight")]
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"backbone.layers.{i}."
        pairs.append((ours + "norm1.weight", theirs + "norm.weight"))
        pairs += [(ours + "mixer." + a, theirs + "mixer." + b) for a, b in _MIXER_NAMES]
        if has_mlp:
            pairs += [(ours + "norm2.weight", theirs + "norm2.weight"),
                      (ours + "mlp.down.weight", theirs + "mlp.fc2.weight")]
    return pairs


def official_state_dict(state, cfg) -> dict:
    """Our state dict -> the official one (fresh tensors; the embedding without its padding rows, and
    lm_head.weight the same tensor: tied)."""
    out = {}
    for ours, theirs in _name_pairs(cfg.n_layer, cfg.mlp_hidden > 0):
        t = state[ours].detach().clone()
        out[theirs] = t[:, None] if ours.endswith(("B_bias", "C_bias")) else t  # (H, N) -> (H, 1, N)
    out["backbone.embedding.weight"] = out["backbone.embedding.weight"][: cfg.vocab_size].clone()
    for i in range(cfg.n_layer if cfg.mlp_hidden else 0):
        out[f"backbone.layers.{i}.mlp.fc1.weight"] = torch.cat([state[f"blocks.{i}.mlp.up.weight"],
                                                                state[f"blocks.{i}.mlp.gate.weight"]])
    out["lm_head.weight"] = out["backbone.embedding.weight"]
    return out


def state_dict_from_official(state, config: dict, vocab_rows, where) -> dict:
    """An official state dict with `vocab_rows` embedding rows (its padded vocabulary) -> ours for the
    ModelConfig fields `config` (from config_from_official). The padding rows are copied as far as both
    models have them; rows only ours has are zeros (no token uses them). A CheckpointError names `where` and
    lists missing or unexpected keys and wrong shapes."""
    from model import Mamba3LM, ModelConfig  # ckpt.py is generic over models; only this format knows ours

    try:
        cfg = ModelConfig(**config)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Mamba3LM(cfg).state_dict().items()}
    emb = "backbone.embedding.weight"
    official = {theirs: (expected[ours][0], 1, expected[ours][1]) if ours.endswith(("B_bias", "C_bias"))
                else expected[ours] for ours, theirs in _name_pairs(cfg.n_layer, cfg.mlp_hidden > 0)}
    for i in range(cfg.n_layer if cfg.mlp_hidden else 0):
        official[f"backbone.layers.{i}.mlp.fc1.weight"] = (2 * cfg.mlp_hidden, cfg.d_model)
    official["lm_head.weight"] = official[emb] = (vocab_rows, cfg.d_model)
    missing = sorted(official.keys() - state.keys() - {"lm_head.weight"})
    unexpected = sorted(state.keys() - official.keys())
    shapes = [f"{k} {list(state[k].shape)}, expected {list(v)}" for k, v in official.items()
              if k in state and tuple(state[k].shape) != v]
    if missing or unexpected or shapes:
        raise CheckpointError(f"{where} does not fit its config.json: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) +
            ([f"unexpected {', '.join(unexpected)}"] if unexpected else []) + shapes))
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state[emb]):
        raise CheckpointError(f"{where}: lm_head.weight differs from backbone.embedding.weight, but tie_embeddings "
                              f"says they are one tensor")

    out = {}
    for ours, theirs in _name_pairs(cfg.n_layer, cfg.mlp_hidden > 0):
        t = state[theirs]
        out[ours] = t[:, 0] if ours.endswith(("B_bias", "C_bias")) else t
    for i in range(cfg.n_layer if cfg.mlp_hidden else 0):
        out[f"blocks.{i}.mlp.up.weight"], out[f"blocks.{i}.mlp.gate.weight"] = \
            state[f"backbone.layers.{i}.mlp.fc1.weight"].chunk(2)
    embed = state[emb]
    rows = expected["embed.weight"][0]
    if embed.shape[0] != rows:  # another padding multiple: rows past vocab_size are padding in both models
        padded = embed.new_zeros(rows, cfg.d_model)
        n = min(rows, embed.shape[0])
        padded[:n] = embed[:n]
        embed = padded
    out["embed.weight"] = out["lm_head.weight"] = embed
    return out


def _load_run(run_dir, step=None):
    """(model, meta, step): checkpoint `step` of a train.py run directory, or without one its newest step that
    verifies (a corrupt step is warned about and passed over, as load_latest does)."""
    from model import Mamba3LM, ModelConfig

    d = Path(run_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: no such directory; expected a train.py --out-dir holding checkpoints")
    steps = list_steps(d) if step is None else [step]
    if not steps:
        raise CheckpointError(f"{d}: no complete checkpoint (model_step_N.safetensors, optim_step_N.pt and "
                              f"meta_step_N.json with the sizes the meta records)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for s in reversed(steps):
        meta = read_meta(d, s)
        if not isinstance(meta.get("model_config"), dict):
            raise CheckpointError(f"checkpoint step {s} in {d} records no model_config, so it is not a "
                                  f"mamba3-lite model")
        model = Mamba3LM(ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in fields}))
        try:
            load(d, s, model)  # verifies both files' sha256
            return model, meta, s
        except CorruptCheckpoint as e:
            if step is not None or s == steps[0]:
                raise
            warnings.warn(f"{e}; trying an earlier step", stacklevel=3)


def _byte_level_chars():
    # GPT-2's table from bytes to the printable characters that stand for them, which the `tokenizers`
    # ByteLevel pre-tokenizer uses: printable Latin-1 bytes are themselves, the other 68 move to U+0100 on
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    moved = iter(range(256, 256 + 68))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


def byte_tokenizer_json() -> str:
    """A Hugging Face tokenizer.json equal to prepare.py's byte tokenizer: ids 0..255 are the bytes of the UTF-8
    text, 256 is <|endoftext|> (a byte-level BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_level_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TEXT])
    return tok.to_str()


def _tokenizer_files(spec, run_dir):
    """{file name: bytes} to write beside an export so that Hugging Face's AutoTokenizer loads the export
    directory as the run's tokenizer; empty for GPT-2 (the Hub's "gpt2" has the same ids) and no tokenizer."""
    name = spec.get("name") if isinstance(spec, dict) else None
    if name == "byte":
        data, eos = byte_tokenizer_json().encode(), EOS_TEXT
    elif name == "file":
        path = Path(run_dir) / spec["file"]
        if not path.is_file():
            raise CheckpointError(f"{path}: the run's tokenizer file is missing (its tokenizer spec names it); "
                                  f"copy it from the data directory")
        data, eos = path.read_bytes(), spec.get("eos_token")
        if spec.get("sha256") and hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise CheckpointError(f"{path}: not the tokenizer the run was trained with (sha256 differs from its "
                                  f"tokenizer spec)")
    else:
        return {}
    # split_special_tokens: a text that spells the EOS token is plain text, as prepare.py encodes it
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "split_special_tokens": True,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": data, "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def _usage(out, marker):
    """(load line, harness command, tokenizer sentence, warnings) for an export, from its marker."""
    spec, cfg = marker["tokenizer"], marker["model_config"]
    name = spec.get("name") if isinstance(spec, dict) else None
    tokenizer = {"gpt2": "gpt2", "byte": str(out), "file": str(out)}.get(name, "TOKENIZER")
    about = {"gpt2": "`tokenizer=gpt2` is GPT-2's BPE from the Hugging Face Hub: the ids of the tiktoken encoding "
                     "the model was trained with.",
             "byte": "tokenizer.json here is mamba3-lite's byte tokenizer (ids 0-255 are the bytes of the UTF-8 "
                     "text, 256 is <|endoftext|>), so the directory is its own tokenizer.",
             "file": "tokenizer.json here is the tokenizer the model was trained with, so the directory is its own "
                     "tokenizer."}.get(name, "The run recorded no tokenizer (raw token data): replace TOKENIZER by "
                                             "the Hugging Face tokenizer that made its token ids.")
    notes = []
    if cfg.get("reset_token") is not None:
        notes.append(f"this model resets its state after token {cfg['reset_token']} (reset_token), but the official "
                     f"model does not reset at EOS: give it one document per sequence, or its outputs after an EOS "
                     f"will differ from mamba3-lite's")
    load_line = f'MambaLMHeadModel.from_pretrained("{out}", device="cuda")'
    command = (f"lm_eval --model mamba_ssm --model_args pretrained={out},tokenizer={tokenizer},dtype=float32 "
               f"--tasks lambada_openai,hellaswag,piqa,arc_easy --device cuda --batch_size 16")
    return load_line, command, about, notes


def _note(out, marker):
    load_line, command, about, notes = _usage(out, marker)
    cfg = marker["model_config"]
    return "\n".join([
        f"# {Path(out).name}: a Mamba-3 language model in the official mamba_ssm format", "",
        f"Exported by mamba3-lite (`python ckpt.py export`) from `{marker['source']}`, step {marker['step']}: "
        f"{cfg['n_layer']} layers, d_model {cfg['d_model']}, vocabulary {cfg['vocab_size']}.",
        "", "- `config.json`, `pytorch_model.bin`: mamba_ssm's MambaConfig and state dict (Mamba3 layers, SISO)",
        "- `model.safetensors`: the same tensors (the tied embedding and LM head stored twice)",
        "- `tokenizer.json`, `tokenizer_config.json` (when present): the tokenizer, for Hugging Face's AutoTokenizer",
        "- `mamba3_lite.json`: mamba3-lite's model config and tokenizer spec (`train.py --init-from` reads them)", "",
        "## Load it", "", "    import torch", "    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel", "",
        f"    model = {load_line}",
        f"    input_ids = torch.randint(0, {cfg['vocab_size']}, (1, 16), device=\"cuda\")  # (batch, length) token ids",
        "    logits = model(input_ids).logits  # (batch, length, vocabulary)", "",
        "The official Mamba-3 layer runs on CUDA GPUs (Triton kernels). The embedding has exactly one row per "
        "token (mamba3-lite's padding rows, which it never trains, are left out), so the logits are mamba3-lite's.",
        "", "## Evaluate it with lm-evaluation-harness", "", "    pip install lm-eval mamba-ssm", f"    {command}", "",
        about, *[f"\n**Note:** {n}." for n in notes], ""])


def _export_marker(d):
    """The marker dict of an earlier export in `d`, or None."""
    try:
        marker = json.loads((Path(d) / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == EXPORT_FORMAT else None


def _check_export_target(out):
    """OUT_DIR may be missing, empty, or an earlier export; anything else is refused."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory; choose another OUT_DIR")
    if any(out.iterdir()) and _export_marker(out) is None:
        raise CheckpointError(f"{out} exists and is not an earlier export (it has no {EXPORT_MARKER}); choose another "
                              f"OUT_DIR, or empty it yourself")


def export(run_dir, out_dir, step=None) -> Path:
    """Write checkpoint `step` of the train.py run directory `run_dir` (default: its newest step that verifies)
    into `out_dir` in the official mamba_ssm format; returns out_dir. See the section comment for the layout.

    A CheckpointError naming the path, before anything is written: no complete checkpoint, a step that does
    not verify, an option the official format cannot express, a missing tokenizer file, or an out_dir that
    exists and is neither empty nor an earlier export. An earlier export is replaced whole (the new one is
    built in a hidden sibling directory, then swapped into place); files a user added to it are kept.
    """
    from safetensors.torch import save_file

    run_dir, out = Path(run_dir), Path(out_dir)
    _check_export_target(out)
    model, meta, step = _load_run(run_dir, step)
    cfg = model.config
    try:
        mamba_config = official_config(cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{run_dir} step {step} cannot be exported to the official mamba_ssm format: "
                              f"{e}") from None
    spec = meta.get("tokenizer")
    files = _tokenizer_files(spec, run_dir)
    if isinstance(spec, dict) and spec.get("name") == "file":
        spec = {**spec, "file": "tokenizer.json"}
    marker = {"format": EXPORT_FORMAT, "version": 1, "source": str(run_dir), "step": step,
              "model_config": dataclasses.asdict(cfg), "tokenizer": spec}
    state = official_state_dict(model.state_dict(), cfg)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        (staging / "config.json").write_text(json.dumps(mamba_config, indent=2) + "\n")
        torch.save(state, staging / "pytorch_model.bin")
        save_file({k: v.clone() if k == "lm_head.weight" else v for k, v in state.items()},
                  staging / "model.safetensors", metadata={"format": "pt"})
        for name, data in files.items():
            (staging / name).write_bytes(data)
        (staging / "README.md").write_text(_note(out, marker))
        (staging / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for p in [*staging.iterdir(), staging]:
            _fsync_dir(p)  # files and the directory alike
        if out.exists():  # swap: the earlier export goes only once the new one is in place
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            users = [p.name for p in old.iterdir() if p.name not in EXPORT_FILES]  # evaluation results, say: kept
            try:
                for name in users:
                    os.rename(old / name, staging / name)
                os.rename(staging, out)
            except BaseException:
                for name in users:
                    if (staging / name).exists():
                        os.rename(staging / name, old / name)
                os.rename(old, out)
                raise
            _fsync_dir(out.parent)
            shutil.rmtree(old)
        else:
            os.rename(staging, out)
            _fsync_dir(out.parent)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError):  # disk full, permissions: say where, and that nothing was lost
            raise CheckpointError(f"could not write {e.filename or staging} ({e.strerror or e}); free disk space or "
                                  f"fix the permissions, then run again: {out} is unchanged") from None
        raise
    return out


def read_pretrained(path):
    """Weights to start training from: (ModelConfig fields, state dict, tokenizer spec or None).

    `path` is a train.py run directory (its newest step that verifies; weights only) or a directory in the
    official mamba_ssm format (config.json + model.safetensors or pytorch_model.bin: an export of ours, or
    anyone's Mamba-3 SISO checkpoint). The state dict has our key names and shapes, ready for
    Mamba3LM(ModelConfig(**config)).load_state_dict(state). The tokenizer spec is the run's, or an export's
    (its tokenizer file, if any, is in `path`); None when unknown. A CheckpointError names the path and says
    what does not fit.
    """
    p = Path(path)
    if p.is_dir() and list_steps(p):
        model, meta, _ = _load_run(p)
        return dataclasses.asdict(model.config), model.state_dict(), meta.get("tokenizer")
    weights = [p / name for name in ("model.safetensors", "pytorch_model.bin") if (p / name).is_file()]
    if not weights or not (p / "config.json").is_file():
        raise CheckpointError(f"{p}: expected a train.py run directory (checkpoints) or a directory in the official "
                              f"mamba_ssm format (config.json with pytorch_model.bin or model.safetensors); found "
                              f"{'neither' if p.is_dir() else 'no such directory'}")
    try:
        mamba_config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p / 'config.json'}: not a JSON file ({e})") from None
    if not isinstance(mamba_config, dict):
        raise CheckpointError(f"{p / 'config.json'}: expected a JSON object of MambaConfig fields")
    config = config_from_official(mamba_config, p / "config.json")
    state = _read_official_weights(weights[0])
    rows = _round_up(config["vocab_size"], mamba_config.get("pad_vocab_size_multiple",
                                                            OFFICIAL_CONFIG_DEFAULTS["pad_vocab_size_multiple"]))
    state = state_dict_from_official(state, config, rows, weights[0])
    marker = _export_marker(p)
    if marker is None:
        return config, state, None
    if marker["model_config"].get("reset_token") is not None:
        config["reset_token"] = marker["model_config"]["reset_token"]
    return config, state, marker["tokenizer"]


def _read_official_weights(path):
    from safetensors.torch import load_file

    try:
        if path.suffix == ".safetensors":
            state = load_file(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # each library has its own error types for a damaged file
        raise CheckpointError(f"{path}: cannot be read as a state dict ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a state dict (tensor names -> tensors)")
    return state


# -----------------------------------------------------------------------------
# command line: python ckpt.py export RUN_DIR OUT_DIR [--step N]

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


@app.callback()
def _commands():
    """Checkpoint tools. The library (save, load, list_steps, ...) is described in ckpt.py's docstring."""


@app.command("export")
def export_main(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A train.py --out-dir (checkpoint directory)."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR",
                                   help="Where to write the export; an earlier export there is replaced."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step (default: the newest that verifies)."),
):
    """Export a checkpoint to the official mamba_ssm format (config.json + pytorch_model.bin), which
    MambaLMHeadModel.from_pretrained and lm-evaluation-harness (--model mamba_ssm) load."""
    console, errors = Console(highlight=False), Console(stderr=True, highlight=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = export(run_dir, out_dir, step)
        except (CheckpointError, OSError) as e:
            errors.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(2)
        finally:
            for w in caught:
                errors.print(f"[yellow]warning:[/yellow] {escape(str(w.message))}", soft_wrap=True)
    marker = _export_marker(out)
    load_line, command, about, notes = _usage(out, marker)
    written = ", ".join(sorted(p.name for p in out.iterdir()))
    console.print(f"exported {escape(str(run_dir))} step {marker['step']} to {escape(str(out))}: {written}",
                  soft_wrap=True)
    console.print(f"  load      {escape(load_line)}   (mamba_ssm.models.mixer_seq_simple, on a CUDA GPU)",
                  soft_wrap=True)
    console.print(f"  evaluate  {escape(command)}", soft_wrap=True)
    console.print(f"  {escape(about)}", soft_wrap=True)
    for n in notes:
        console.print(f"[bold yellow]warning:[/bold yellow] {escape(n)}", soft_wrap=True)


if __name__ == "__main__":
    app()
