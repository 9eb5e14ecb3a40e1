"""Three-file checkpoints: atomic save, discovery, verified load, retention, and the one writer's lock.

Step N of a run is three files in its checkpoint directory:

    model_step_N.safetensors   the unwrapped model's weights (a tied tensor is written under each name, as a copy)
    optim_step_N.pt            {"optimizer": its state_dict or None, "rng": RNG states}, tensors and plain values
                               only, so that torch.load(weights_only=True) reads it
    meta_step_N.json           the caller's meta + step, time, versions, model config, and under "files" the
                               byte size and sha256 of the two files above

A save writes each file under a temporary name (".NAME.tmp", which never looks like a step), fsyncs it and
renames it into place; the meta goes last and is the commit marker; then the directory is fsynced. A kill at
any instant leaves the earlier steps and either all of the new one or nothing that counts, and the next save
clears what it left. One process writes a directory at a time, holding lock(dir); any number may read.
A step that fails verification is reported and skipped, and never deleted here.
"""
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import pickle
import platform
import random
import re
import shutil
import socket
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model it is loaded into."""


class CorruptCheckpoint(CheckpointError):
    """The files of a step cannot be trusted (hash mismatch, unreadable): load_latest tries an older step."""


STEP_FILE = re.compile(r"(?:model|optim|meta)_step_(0|[1-9][0-9]*)\.(?:safetensors|pt|json)")
_written = set()  # (directory, step) saved by this process: known good, so retention need not re-hash them


def _names(step):
    return f"model_step_{step}.safetensors", f"optim_step_{step}.pt", f"meta_step_{step}.json"


# -----------------------------------------------------------------------------
# save


def save(dir, step, model, optimizer, meta, keep_last=None):
    """Write checkpoint `step` of `model` (and `optimizer`, or None) into `dir` atomically; return the three paths.

    `meta` holds plain JSON values (tuples come back as lists); ckpt adds "step", "time", "versions", "files"
    and "model_config" (the model's dataclass `config`, if any). DDP / torch.compile wrappers are unwrapped, so
    the keys are the plain model's. What can be refused is refused before the first byte is written; a failed
    write (disk full, permissions) is a CheckpointError naming the directory, and what was there is untouched.
    Re-saving a step replaces it. keep_last=K then deletes all but the K highest complete steps: never the one
    just written, never one that fails verification (a step this process did not write is re-hashed first).
    """
    if type(step) is not int or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
    module = _unwrap(model)
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

    d, (model_name, optim_name, meta_name) = Path(dir), _names(step)
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(d)
        with ThreadPoolExecutor(2) as pool:  # two independent files; writing and sha256 release the GIL
            model_info = pool.submit(_write, d / model_name,
                                     lambda p: safetensors.torch.save_file(tensors, p, {"format": "pt"}))
            optim_info = pool.submit(_write, d / optim_name, lambda p: torch.save(optim, p))
        meta["files"] = {model_name: model_info.result(), optim_name: optim_info.result()}
        if (d / meta_name).exists():  # re-saving: un-commit first, so that no crash pairs the old meta with new data
            (d / meta_name).unlink()
            _fsync_dir(d)
        for name in model_name, optim_name:
            os.replace(_tmp(d / name), d / name)
        _fsync_dir(d)  # the data files' names are durable before the meta that vouches for them
        _write(d / meta_name, lambda p: p.write_text(json.dumps(meta, indent=2)))
        os.replace(_tmp(d / meta_name), d / meta_name)  # the commit
        _fsync_dir(d)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        for name in _names(step):
            _tmp(d / name).unlink(missing_ok=True)
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
        inner = getattr(model, "_orig_mod", getattr(model, "module", None))
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
    # json.dumps would quietly turn int keys into strings and write NaN, which is not JSON: a meta that does
    # not come back exactly is an error at the first save, not a surprise at resume time
    if x is None or isinstance(x, (str, bool, int)) or (isinstance(x, float) and math.isfinite(x)):
        return
    if isinstance(x, (list, tuple)) or (isinstance(x, dict) and all(isinstance(k, str) for k in x)):
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            _check_json(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where} is {str(x)[:60]} ({type(x).__name__}), which JSON cannot hold exactly; store "
                          f"plain values (finite floats, str keys) before saving")


def _check_plain(x, where):
    # weights_only=True unpickles tensors and plain containers only: an exotic optimizer value would save
    # fine and then refuse to load at resume time
    if x is None or isinstance(x, (str, bool, int, float, torch.Tensor, torch.dtype, torch.device, torch.Size)):
        return
    if type(x) in (list, tuple, dict):
        for k, v in x.items() if type(x) is dict else enumerate(x):
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


def _tmp(path):
    return path.with_name(f".{path.name}.tmp")


def _write(path, write):
    """write(p) to the temporary name of `path`, then hash and fsync it; return its {"bytes", "sha256"}."""
    write(_tmp(path))
    with open(_tmp(path), "rb") as f, ThreadPoolExecutor(1) as pool:
        # the disk writes while the CPU hashes: measured, a save takes a third less than hashing, then syncing
        synced = pool.submit(os.fsync, f.fileno())
        info = {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
        synced.result()
    return info


def _fsync_dir(d):
    # a rename is durable only once the directory itself is fsynced
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock(dir):
    """An exclusive lock on DIR/.lock for the one writer of `dir`: a second one is refused with the PID and host of
    the first. The OS drops it when the process ends, however it ends (kill -9 too). Returns the open lock file;
    closing it releases the lock."""
    d = Path(dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / ".lock", "a+")
    except OSError as e:
        raise CheckpointError(f"{d} is not writable ({e.strerror}); choose another directory or fix its "
                              f"permissions") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise CheckpointError(f"{d} is in use by another run ({f.read().strip() or 'unknown'}); wait for it to "
                              f"finish or stop it, or use another directory") from None
    f.truncate(0)
    f.write(f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def _remove_leftovers(d):
    # What killed saves and retentions leave: temporary files, and the data files of a step without a meta (a
    # save killed before its commit, a retention killed after deleting the meta). Only the one writer of d
    # calls this, so none of it can be a save in progress.
    for paths in step_files(d).values():
        if not any(p.suffix == ".json" for p in paths):
            for p in paths:
                p.unlink()
    for p in d.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp") and STEP_FILE.match(p.name[1:]):
            p.unlink()


def _retain(d, keep_last, just_written):
    for step in list_steps(d)[:-keep_last]:
        if step == just_written:
            continue
        if (d.resolve(), step) not in _written:
            try:
                read_meta(d, step, verify=True)
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
    if d.exists() and not d.is_dir():
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


def read_meta(dir, step, verify=False):
    """The meta of checkpoint `step` in `dir` after checking that its three files exist with the sizes it
    records, and with verify=True the sha256 of both data files (a mismatch is a CorruptCheckpoint); nothing
    else is read. A step with no files at all is an error listing the steps there."""
    d, (model_name, optim_name, meta_name) = Path(dir), _names(step)
    if not any((d / name).exists() for name in _names(step)):
        raise CheckpointError(f"no checkpoint for step {step} in {d}; steps there: {list_steps(d) or 'none'}")
    where = f"step {step} in {d}"
    try:
        meta = json.loads((d / meta_name).read_text())
        sizes = {name: int(meta["files"][name]["bytes"]) for name in (model_name, optim_name)}
        if not all(isinstance(meta["files"][name]["sha256"], str) for name in sizes) or meta["step"] != step:
            raise ValueError("its step or a sha256 is wrong")
    except FileNotFoundError:  # also when retention removes it while we look (readers do not lock)
        raise CheckpointError(f"{where} is incomplete: {meta_name} is missing (an interrupted save?)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where} is unreadable: {d / meta_name} is not a valid meta file ({e})") from None
    for name, size in sizes.items():
        if not (d / name).exists():
            raise CheckpointError(f"{where} is incomplete: {name} is missing")
        if (found := (d / name).stat().st_size) != size:
            raise CheckpointError(f"{where} is damaged: {name} has {found} bytes, {meta_name} says {size}")
    if not verify:
        return meta

    def sha256(name):
        with open(d / name, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    with ThreadPoolExecutor(2) as pool:  # hashlib releases the GIL: both files at once
        for name, found in zip(sizes, pool.map(sha256, sizes)):
            if found != (want := meta["files"][name]["sha256"]):
                raise CorruptCheckpoint(f"checkpoint step {step}: {d / name} is corrupt (sha256 {found[:16]}..., "
                                        f"{meta_name} says {want[:16]}...)")
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
    d, module = Path(dir), _unwrap(model)
    meta, tensors, state = _read(d, step, map_location)
    where = f"checkpoint step {step} in {d}"
    diff = _config_diff(meta.get("model_config"), module)
    if diff and strict:
        raise CheckpointError(f"{where} is from a model with a different config: " + "; ".join(diff) + ". Build the "
                              "model with the checkpoint's config (meta['model_config']) or pass strict=False")
    if diff:
        warnings.warn(f"checkpoint step {step}: model config differs: " + "; ".join(diff), stacklevel=2)
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
    return meta


def load_latest(dir, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load the newest step of `dir` that verifies; return (step, meta), or (None, None) if there is none.
    A corrupt step gets a warning and the next older one is tried (load finds that out before it modifies
    anything). A step that verifies but does not fit the model is an error: older steps of the same run would
    not fit either."""
    for step in reversed(list_steps(dir)):
        try:
            return step, load(dir, step, model, optimizer, map_location, strict, restore_rng)
        except CorruptCheckpoint as e:
            warnings.warn(f"{e}; trying an earlier step", stacklevel=2)
    return None, None


def _read(d, step, map_location):
    """(meta, tensors, optimizer file) of a step whose hashes match and whose files parse, or CorruptCheckpoint."""
    meta, (model_name, optim_name, _) = read_meta(d, step, verify=True), _names(step)
    try:
        tensors = safetensors.torch.load_file(d / model_name)  # on the CPU: a second copy on a GPU may not fit
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


if __name__ == "__main__":  # python ckpt.py export RUN_DIR OUT_DIR: the official mamba_ssm format is official.py's
    from official import app

    app()
