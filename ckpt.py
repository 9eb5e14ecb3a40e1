"""Three-file checkpoints: atomic save, discovery, verified load, retention.

For every saved step N the checkpoint directory holds

    model_step_N.safetensors   the unwrapped model's weights (tied tensors written as independent copies)
    optim_step_N.pt            optimizer state + RNG states; tensors and plain values only, so it loads
                               with torch.load(..., weights_only=True)
    meta_step_N.json           the caller's meta + step, time, library versions, model config, and the
                               byte size and sha256 of the two files above

Each file is written to a temporary name in the same directory (".NAME.PID.tmp", which never looks like
a step), fsynced and renamed; the meta file goes last and is the commit marker; then the directory is
fsynced. So a kill at any instant leaves either the previous steps or the new step, never half of one.

    save(dir, step, model, optimizer, meta, keep_last=None)
    list_steps(dir) -> [steps]            complete steps only (all three files, sizes match the meta)
    latest_step(dir) -> step | None
    read_meta(dir, step) -> meta          sizes checked, nothing loaded
    load(dir, step, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False) -> meta
    load_latest(dir, model, ...) -> (step, meta) | (None, None)   newest step that verifies

One process writes to a checkpoint directory at a time (rank 0 under DDP); any number may read it.
"""
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import re
import struct
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors
import torch
from safetensors import safe_open


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model it is loaded into."""


def _names(step):
    return f"model_step_{step}.safetensors", f"optim_step_{step}.pt", f"meta_step_{step}.json"


_META_RE = re.compile(r"meta_step_(0|[1-9][0-9]*)\.json")
_DATA_RE = re.compile(r"(?:model_step_(0|[1-9][0-9]*)\.safetensors|optim_step_(0|[1-9][0-9]*)\.pt)")
_TMP_RE = re.compile(r"\.(?:model|optim|meta)_step_[0-9]+\.[a-z]+\.([0-9]+)\.tmp")

# -----------------------------------------------------------------------------
# save


def save(dir, step, model, optimizer, meta, keep_last=None):
    """Write checkpoint `step` of `model` (and `optimizer`, which may be None) into `dir`, atomically.

    `meta` is a dict of plain JSON values (str, int, finite float, bool, None, lists, str-keyed dicts;
    tuples come back as lists). Anything else (a set, a NumPy scalar, NaN, an int key) is a
    CheckpointError before any file is written. ckpt adds, overriding the caller's keys of the same
    names: "step", "files" ({file name: {"bytes", "sha256"}} of the weights and optimizer files),
    "time" (Unix seconds), "versions" (torch, python, numpy, safetensors) and, when the unwrapped model
    has a dataclass attribute `config`, "model_config" = dataclasses.asdict(config).

    Wrappers are unwrapped first (`.module` of DDP, `._orig_mod` of torch.compile, nested any way), so
    the file's keys are the plain model's. The optimizer file holds {"optimizer": state_dict or None,
    "rng": {"torch", "cuda", "python", "numpy"}}. Saving a step that already exists replaces it.

    keep_last=K: after the commit, delete all complete steps but the K highest step numbers, never the
    step just written. Steps that are incomplete or fail verification are never deleted.

    Returns the paths of the three files (model, optimizer, meta).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
    module = _unwrap(model)

    # Everything that can be rejected is rejected before the first byte hits the disk.
    meta = dict(meta or {})
    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        meta["model_config"] = dataclasses.asdict(config)
    meta["step"] = step
    meta["time"] = time.time()
    meta["versions"] = _versions()
    _check_json(meta, "meta")
    tensors = module.state_dict()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"model state {name!r} is a {type(t).__name__}, not a tensor; "
                                  f"safetensors holds tensors only")
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(f"model state {name!r} has dtype {t.dtype}, which safetensors cannot hold")
    optim = {"optimizer": None if optimizer is None else optimizer.state_dict(), "rng": _rng_state()}
    _check_plain(optim, "optimizer file")

    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(d)
    model_name, optim_name, meta_name = _names(step)
    (tmp_model, model_info), (tmp_optim, optim_info) = _write_tmps(d, {
        model_name: lambda f: _write_safetensors(f, tensors),
        optim_name: lambda f: torch.save(optim, f)})
    meta["files"] = {model_name: model_info, optim_name: optim_info}

    # Re-saving an existing step: un-commit the old one first, so a crash between the renames below
    # can never pair the old meta with a new weights file.
    if (d / meta_name).exists():
        (d / meta_name).unlink()
        _fsync_dir(d)
    os.replace(tmp_model, d / model_name)
    os.replace(tmp_optim, d / optim_name)
    _fsync_dir(d)  # the data files' names are durable before the meta that vouches for them
    tmp_meta, _ = _write_tmp(d, meta_name, lambda f: f.write(json.dumps(meta, indent=2).encode()))
    os.replace(tmp_meta, d / meta_name)  # the commit
    _fsync_dir(d)

    if keep_last is not None:
        _retain(d, keep_last, step)
    return d / model_name, d / optim_name, d / meta_name


def _unwrap(model):
    # DDP and DataParallel keep the model in `.module`, torch.compile in `._orig_mod`, and they nest.
    # Only a module whose single child is that attribute counts as a wrapper, so a model that merely
    # has a submodule called `module` is left alone.
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module) or list(model.children()) != [inner]:
            return model
        model = inner


def _versions():
    return {"torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__,
            "safetensors": safetensors.__version__}


def _check_json(x, where):
    # json.dumps would quietly turn int keys into strings and write NaN, which is not JSON; a checkpoint
    # whose meta does not round-trip exactly is worse than an error at the first save.
    if x is None or isinstance(x, (str, bool, int)):
        return
    if isinstance(x, float):
        if not math.isfinite(x):
            raise CheckpointError(f"{where} is {x}, which is not JSON; store None or a string instead")
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where} has the key {k!r} ({type(k).__name__}); JSON keys are strings, "
                                      f"use str keys")
            _check_json(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where} is a {type(x).__name__} ({str(x)[:60]}), which JSON cannot hold; "
                          f"convert it to a plain value (int(), float(), list(), str()) before saving")


def _check_plain(x, where):
    # weights_only=True unpickles tensors and plain containers/scalars only; an optimizer with an exotic
    # value in its state would save fine and then refuse to load at resume time. Catch it now.
    if x is None or isinstance(x, (str, bool, int, float, torch.Tensor, torch.dtype, torch.device, torch.Size)):
        return
    if type(x) in (list, tuple):
        for i, v in enumerate(x):
            _check_plain(v, f"{where}[{i}]")
        return
    if isinstance(x, dict):
        for k, v in x.items():
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
        return
    raise CheckpointError(f"{where}: {type(x).__name__} value ({str(x)[:60]}) would not load with "
                          f"torch.load(weights_only=True); only tensors and plain Python values may go there")


def _rng_state():
    # The CUDA state is the current device's only: asking for all devices would create a CUDA context
    # on every GPU of the machine from rank 0.
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate(),
            "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}}


def _set_rng_state(rng):
    # Both setters want CPU byte tensors, whatever map_location moved them to.
    torch.set_rng_state(rng["torch"].cpu())
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    random.setstate(rng["python"])
    n = rng["numpy"]
    keys = np.array(n["keys"], dtype=np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))


class _HashingFile:
    """A binary file being written that is hashed and sent to disk on the way, and fsynced on close.

    Hashing while writing is one pass over the bytes instead of writing everything and reading it back:
    big buffers are hashed by a helper thread while this one writes them (both release the GIL).
    Every _WRITE_OUT bytes, another helper asks the kernel to write out what we have so far and then
    drops it from the page cache: the disk works while we serialize, the final fsync has little left
    to do, and a checkpoint of many GB does not push the training data out of the cache.
    """

    def __init__(self, path, pool):
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.pool = pool  # two threads: one hashes, one writes out
        self.bytes = 0
        self.written_out = 0
        self.writing_out = None

    def write(self, data):
        data = memoryview(data).cast("B")  # callers' buffers may not be bytes; count bytes, not items
        if data.nbytes >= (1 << 20):
            hashed = self.pool.submit(self.sha.update, data)
            try:
                self.f.write(data)
            finally:
                hashed.result()  # the buffer is only ours during this call (torch.save reuses it)
        else:
            self.sha.update(data)
            self.f.write(data)
        self.bytes += data.nbytes
        if self.bytes - self.written_out >= _WRITE_OUT and (self.writing_out is None or self.writing_out.done()):
            self.f.flush()
            self.written_out = self.bytes
            self.writing_out = self.pool.submit(self._write_out, self.bytes)
        return data.nbytes

    def _write_out(self, upto):
        _fdatasync(self.f.fileno())
        _drop_cache(self.f.fileno(), upto)

    def flush(self):
        self.f.flush()

    def close(self):
        try:
            if self.writing_out is not None:
                self.writing_out.result()
            self.f.flush()
            os.fsync(self.f.fileno())
            _drop_cache(self.f.fileno(), 0)
        finally:
            self.f.close()


_WRITE_OUT = 128 << 20
_fdatasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def _drop_cache(fd, upto):
    # Only written-out (clean) pages are dropped, so this never loses data; upto=0 means the whole file.
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, upto, os.POSIX_FADV_DONTNEED)


def _write_tmp(d, name, write):
    """Write a file under a temporary name in `d` with `write(f)`; return (tmp path, {bytes, sha256})."""
    tmp = d / f".{name}.{os.getpid()}.tmp"
    try:
        with ThreadPoolExecutor(2) as pool:  # per call: a pool made before a fork would be dead in the child
            f = _HashingFile(tmp, pool)
            try:
                write(f)
            finally:
                f.close()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, {"bytes": f.bytes, "sha256": f.sha.hexdigest()}


def _write_tmps(d, writers):
    """_write_tmp for each {name: write}, all at once (the files are independent); all or nothing."""
    with ThreadPoolExecutor(len(writers)) as pool:
        jobs = [pool.submit(_write_tmp, d, name, write) for name, write in writers.items()]
    done = [job.result() for job in jobs if job.exception() is None]
    for job in jobs:
        if job.exception() is not None:
            for tmp, _ in done:
                tmp.unlink(missing_ok=True)
            raise job.exception()
    return done


# safetensors' names for torch dtypes
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _write_safetensors(f, tensors):
    # We write the safetensors layout ourselves: u64 little-endian header length, a JSON header giving
    # each tensor's dtype, shape and byte range, then the raw bytes. That lets every tensor's memory go
    # straight to the file and through sha256 without an intermediate copy, and writes tensors that
    # share storage (a tied embedding/head) as independent copies. The safetensors library reads it.
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this machine is not")
    # Widest elements first: with the header padded to 8 bytes, every tensor starts aligned.
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, offset = {}, 0
    for k in names:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for k in names:
        t = tensors[k].detach().cpu().contiguous().reshape(-1)
        if t.numel():
            f.write(t.view(torch.uint8).numpy())


def _fsync_dir(d):
    # A rename is durable only once the directory itself is fsynced. (Windows cannot open directories.)
    if os.name == "nt":
        return
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_tmp(d):
    # Temporary files of saves that were killed midway: the writing process is gone, so nobody will
    # ever rename them. Those of live processes (another save in progress) are left alone.
    for p in d.iterdir():
        m = _TMP_RE.fullmatch(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _retain(d, keep_last, just_written):
    steps = list_steps(d)  # complete steps only: what fails verification is never deleted
    keep = set(steps[-keep_last:]) | {just_written}
    for s in steps:
        if s not in keep:
            for name in reversed(_names(s)):  # meta first: an interrupted deletion leaves no half step
                (d / name).unlink(missing_ok=True)


# -----------------------------------------------------------------------------
# discover

_warned = set()


def _warn_once(msg):
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


def _read_meta(d, step):
    """The meta of `step` after checking that all three files exist with the sizes it records."""
    model_name, optim_name, meta_name = _names(step)
    path = d / meta_name
    try:
        text = path.read_text()
    except FileNotFoundError:  # also when retention removes it while we look (readers do not lock)
        raise CheckpointError(f"step {step} in {d} is incomplete: {meta_name} is missing "
                              f"(an interrupted save?)") from None
    try:
        meta = json.loads(text)
        files = meta["files"]
        sizes = {name: int(files[name]["bytes"]) for name in (model_name, optim_name)}
        if not all(isinstance(files[name]["sha256"], str) for name in sizes):
            raise ValueError("a sha256 is not a string")
        if meta["step"] != step:
            raise ValueError(f"it says step {meta['step']}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"step {step} in {d} is unreadable: {path} is not a valid meta file ({e})") from None
    for name, size in sizes.items():
        try:
            found = (d / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"step {step} in {d} is incomplete: {name} is missing") from None
        if found != size:
            raise CheckpointError(f"step {step} in {d} is damaged: {name} has {found} bytes, {meta_name} says {size}")
    return meta


def list_steps(dir):
    """The complete steps in `dir`, ascending: all three files present, sizes as the meta records.

    A step that does not count (missing file, size mismatch, unreadable meta) is reported once per
    process with warnings.warn, naming the file and why, and skipped. A missing or empty dir gives [].
    Sizes catch truncation cheaply; the sha256 is checked by load().
    """
    d = Path(dir)
    if not d.exists():
        return []
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory")
    found, orphans = [], set()
    for p in d.iterdir():
        if m := _META_RE.fullmatch(p.name):
            found.append(int(m.group(1)))
        elif m := _DATA_RE.fullmatch(p.name):
            orphans.add(int(m.group(1) or m.group(2)))
    steps = []
    for step in sorted(set(found) | orphans):
        try:
            _read_meta(d, step)
            steps.append(step)
        except CheckpointError as e:
            _warn_once(f"skipping checkpoint: {e}")
    return steps


def read_meta(dir, step):
    """The meta dict of checkpoint `step` in `dir`, without loading anything (to build the model from
    meta["model_config"] first, say). The three files must exist with the recorded sizes; the sha256
    is left to load(). A step that does not exist is a CheckpointError listing the steps that do.
    """
    d = Path(dir)
    if not (d / _names(step)[2]).exists() and step not in _data_steps(d):
        steps = list_steps(d)
        raise CheckpointError(f"no checkpoint for step {step} in {d}; steps there: {steps if steps else 'none'}")
    return _read_meta(d, step)


def latest_step(dir):
    """The highest complete step in `dir` (see list_steps), or None when there is none."""
    steps = list_steps(dir)
    return steps[-1] if steps else None


# -----------------------------------------------------------------------------
# load


def load(dir, step, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load checkpoint `step` from `dir` into `model` (and `optimizer`); return its meta dict.

    The sha256 of both files is verified before either is used: a mismatch is a CheckpointError
    naming the file and step (load_latest falls back past such steps). Weights are copied into the
    model's existing tensors, so tied parameters stay tied; wrappers are unwrapped as in save().
    strict=True: the file's keys must equal the model's (the error lists missing and unexpected keys)
    and meta["model_config"] must equal the live model's dataclass `config` (the error lists the
    fields that differ). strict=False loads the keys both have and only warns about the config.
    Shapes must always match. `map_location` is the device tensors are read to before being copied.
    restore_rng=True restores the torch, CUDA (current device), Python and NumPy RNG states.
    A step that does not exist is a CheckpointError that lists the steps that do.
    Nothing is modified unless all checks pass.
    """
    d = Path(dir)
    meta = _verify(d, step)
    _load_verified(d, step, meta, model, optimizer, map_location, strict, restore_rng)
    return meta


def load_latest(dir, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load the newest step of `dir` that verifies; return (step, meta), or (None, None) if there is none.

    A step that fails verification gets a warning and the next older one is tried; nothing is deleted.
    A step that verifies but does not fit the model (keys, config, shapes) is an error, not skipped:
    older steps of the same run would not fit either.
    """
    d = Path(dir)
    for step in reversed(list_steps(d)):
        try:
            meta = _verify(d, step)
        except CheckpointError as e:
            warnings.warn(f"{e}; trying an earlier step", stacklevel=2)
            continue
        _load_verified(d, step, meta, model, optimizer, map_location, strict, restore_rng)
        return step, meta
    return None, None


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _verify(d, step):
    """Meta of `step` after checking sizes and the sha256 of both data files."""
    meta = read_meta(d, step)
    names = _names(step)[:2]
    with ThreadPoolExecutor(2) as pool:  # hashlib releases the GIL: both files at once
        digests = list(pool.map(_sha256, [d / name for name in names]))
    for name, digest in zip(names, digests):
        if digest != meta["files"][name]["sha256"]:
            raise CheckpointError(f"checkpoint step {step}: {d / name} is corrupt (sha256 {digest[:16]}..., "
                                  f"{_names(step)[2]} says {meta['files'][name]['sha256'][:16]}...); "
                                  f"load an earlier step")
    return meta


def _data_steps(d):
    if not d.is_dir():
        return set()
    return {int(m.group(1) or m.group(2)) for p in d.iterdir() if (m := _DATA_RE.fullmatch(p.name))}


def _config_diff(saved, module):
    live = getattr(module, "config", None)
    if saved is None or not dataclasses.is_dataclass(live) or isinstance(live, type):
        return []
    live = json.loads(json.dumps(dataclasses.asdict(live), default=repr))  # tuples -> lists, as saved
    missing = "<absent>"
    return [f"{k}: checkpoint {saved.get(k, missing)!r}, model {live.get(k, missing)!r}"
            for k in sorted(saved.keys() | live.keys()) if saved.get(k, missing) != live.get(k, missing)]


def _load_verified(d, step, meta, model, optimizer, map_location, strict, restore_rng):
    module = _unwrap(model)
    model_name, optim_name, _ = _names(step)
    diff = _config_diff(meta.get("model_config"), module)
    if diff and strict:
        raise CheckpointError(f"checkpoint step {step} in {d} is from a model with a different config: "
                              + "; ".join(diff) + ". Build the model with the checkpoint's config "
                              "(meta['model_config']) or pass strict=False to load the matching tensors")
    if diff:
        warnings.warn(f"checkpoint step {step}: model config differs: " + "; ".join(diff), stacklevel=3)

    own = module.state_dict()  # detached views of the live parameters and buffers
    with safe_open(str(d / model_name), framework="pt", device=str(map_location)) as f:
        keys = set(f.keys())
        missing, unexpected = sorted(own.keys() - keys), sorted(keys - own.keys())
        if strict and (missing or unexpected):
            raise CheckpointError(f"checkpoint step {step} in {d} does not fit the model: missing keys "
                                  f"{missing or 'none'}; unexpected keys {unexpected or 'none'} "
                                  f"(strict=False loads the keys both have)")
        common = sorted(own.keys() & keys)
        shapes = [f"{k}: checkpoint {list(f.get_slice(k).get_shape())}, model {list(own[k].shape)}"
                  for k in common if list(f.get_slice(k).get_shape()) != list(own[k].shape)]
        if shapes:
            raise CheckpointError(f"checkpoint step {step} in {d}: shapes differ: " + "; ".join(shapes))

        state = torch.load(d / optim_name, map_location=map_location, weights_only=True)
        if optimizer is not None:
            if state["optimizer"] is None:
                raise CheckpointError(f"checkpoint step {step} in {d} was saved without optimizer state")
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"checkpoint step {step} in {d}: optimizer state does not fit "
                                      f"the optimizer: {e}") from None
        with torch.no_grad():
            for k in common:
                own[k].copy_(f.get_tensor(k))  # in place: parameters tied to each other stay tied
    if restore_rng:
        _set_rng_state(state["rng"])
