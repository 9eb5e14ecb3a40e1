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
    """write(path) to a temporary name in d, hash it and fsync it; return (tmp path, {bytes, sha256}).
    The writer runs in a helper thread while this one follows the file as it grows and hashes it: the
    sha256 then costs no time beyond the write when a core is free (torch.save writes front to back into
    the file it is given). A writer that puts a new file in its place instead (safetensors does) is hashed
    once it is done."""
    tmp = d / f".{name}.{os.getpid()}.tmp"
    tmp.write_bytes(b"")  # there before the writer opens it, so that it can be followed
    sha, hashed = hashlib.sha256(), 0
    with open(tmp, "rb") as f, ThreadPoolExecutor(1) as pool:
        job = pool.submit(write, tmp)
        while True:
            finished = job.done()  # before the read: once the writer has finished, a short read is the end
            chunk = f.read(1 << 22)
            sha.update(chunk)
            hashed += len(chunk)
            if hashed % (64 << 20) < len(chunk) and hasattr(os, "posix_fadvise"):
                # start writing out what is hashed (Linux starts writeback for DONTNEED), so that the fsync
                # below finds little left to do: measured, it is a third of the save without this
                os.posix_fadvise(f.fileno(), 0, hashed, os.POSIX_FADV_DONTNEED)
            if not chunk and finished:
                break
            if not chunk:
                time.sleep(0.001)
        job.result()  # the writer's own error, if any
        if os.fstat(f.fileno()).st_ino != tmp.stat().st_ino:  # replaced, not written into
            with open(tmp, "rb") as g:
                sha = hashlib.file_digest(g, "sha256")
        with open(tmp, "rb") as g:
            os.fsync(g.fileno())
    return tmp, {"bytes": tmp.stat().st_size, "sha256": sha.hexdigest()}


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


if __name__ == "__main__":  # python ckpt.py export RUN_DIR OUT_DIR: the official mamba_ssm format is official.py's
    from official import app

    app()
