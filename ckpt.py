"""Checkpoints: atomic save, discovery, verified load, retention, and the one writer's lock.

Step N of a run is three files, each written to ".NAME.tmp", fsynced and renamed, the meta last as
the commit (a kill at any instant leaves the new step whole or not counting):
    model_step_N.safetensors   the unwrapped model's weights (a tied tensor under each name)
    optim_step_N.pt            {"optimizer": state_dict or None, "rng": RNG states}, weights_only
    meta_step_N.json           the caller's meta + step, time, versions, model_config, and the
                               other two's bytes and sha256
A step that fails verification is reported and skipped, never deleted. A model sharded by FSDP is
saved and loaded as full tensors (all ranks call save and load, rank 0 writes): any run reads it.
"""
import dataclasses
import errno
import fcntl
import json
import math
import os
import platform
import random
import re
import shutil
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp
from torch.distributed.tensor import DTensor

from data import fsync, sha256


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model."""


class CorruptCheckpoint(CheckpointError):
    """A step's files cannot be trusted (hash mismatch, unreadable): newest() tries older ones."""


class IncompleteCheckpoint(CheckpointError):
    """A file of the step is missing: a save cut short, or one retention deleted as it was read."""


class ModelMismatch(CheckpointError):
    """Another model (config, keys, shapes) than the one it is loaded into: `what` says how."""
    def __init__(self, what):
        super().__init__(f"{what}. Build the model from its meta['model_config'], or where shapes "
                         "agree strict=False loads the keys both have")
        self.what = what


STEP_FILE = re.compile(r"(?:model|optim|meta)_step_(0|[1-9][0-9]*)\.(?:safetensors|pt|json)")
_written = set()  # (directory, step) saved by this process: known good, retention need not re-hash
_warned = set()  # what list_steps skipped, reported once per process
FULL = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True, strict=False)  # FSDP2 <-> full
_UMASK = os.umask(0o022)  # Python reads the umask only by setting it: set back at once
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file; safetensors writes 0600 whatever it is


def _names(step):
    return f"model_step_{step}.safetensors", f"optim_step_{step}.pt", f"meta_step_{step}.json"


def save(dir, step, model, optimizer, meta, keep_last=None):
    """Write (or rewrite) step `step` of `model` and `optimizer` (or None) into `dir`; return the
    three paths (None on a sharded model's other ranks). keep_last=K then deletes all but the K
    highest steps, never the one just written nor one that fails to verify."""
    module, libs = _unwrap(model), (torch, np, safetensors)
    meta = dict(meta or {}, step=step, time=time.time(), versions=dict(
        {m.__name__: m.__version__ for m in libs}, python=platform.python_version()))
    if dataclasses.is_dataclass(config := getattr(module, "config", None)):
        meta["model_config"] = dataclasses.asdict(config)
    _check(meta, "meta", json=True)
    tensors, optim = _state(module, optimizer)
    if tensors is None:  # a rank of a sharded model, which has sent its shards to rank 0
        return None
    _check(optim, "optimizer file")
    d, names = Path(dir), _names(step)
    tmp = {name: d / f".{name}.tmp" for name in names}  # never a step's name
    writers = [lambda p: safetensors.torch.save_file(tensors, p, {"format": "pt"}),
               lambda p: torch.save(optim, p)]
    committed = False
    try:
        d.mkdir(parents=True, exist_ok=True)
        # what killed saves and retentions leave (d has one writer: none of it is a save under way)
        orphans = [ps for ps in step_files(d).values() if all(p.suffix != ".json" for p in ps)]
        for p in sum(orphans, []) + [p for p in d.glob(".*.tmp") if STEP_FILE.match(p.name[1:])]:
            p.unlink()
        with ThreadPoolExecutor(2) as pool:  # independent files; writing and hashing free the GIL
            meta["files"] = dict(zip(names, pool.map(_write, map(tmp.get, names), writers)))
        _write(tmp[names[2]], lambda p: p.write_text(json.dumps(meta, indent=2)))
        if (d / names[2]).exists():  # re-saving: un-commit, or a crash pairs old meta, new data
            (d / names[2]).unlink()
            fsync(d)
        for name in names:  # the meta last, as the commit, once the data files are durable
            os.replace(tmp[name], d / name)
            committed = name == names[2]
            fsync(d)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:  # a full disk, in 3 dialects
        if committed:  # only the last fsync failed: the step is there, but may not outlive a crash
            raise CheckpointError(f"checkpoint step {step} was written to {d}, but a power loss "
                                  f"may undo it: syncing failed ({e}); check the disk") from None
        for p in tmp.values():
            p.unlink(missing_ok=True)
        free = f"{shutil.disk_usage(d).free / 1e9:.1f} GB free" if d.is_dir() else "no directory"
        fix = "The disk reports an I/O error: check it" if getattr(e, "errno", 0) == errno.EIO \
            else "Free space or fix permissions"
        raise CheckpointError(f"could not write checkpoint step {step} in {d} ({free} there): "
                              f"{e}. {fix}; the checkpoints there are untouched") from None
    _written.add((d.resolve(), step))
    for s in [s for s in list_steps(d)[:-keep_last] if s != step] if keep_last else []:
        if (d.resolve(), s) not in _written:  # not written by this process: goes if it verifies
            try:
                read_meta(d, s, verify=True)
            except CheckpointError as e:
                warnings.warn(f"retention keeps {e}", stacklevel=2)
                continue
        for name in reversed(_names(s)):  # meta first: the step stops counting, then the data go
            (d / name).unlink(missing_ok=True)
    return tuple(d / name for name in names)


def _unwrap(model):
    # DDP keeps the model in `.module`, torch.compile in `._orig_mod`, and they nest; a wrapper has
    # just that one child, unlike a model that happens to have a submodule called `module`
    inner = getattr(model, "_orig_mod", getattr(model, "module", None))
    wrapper = isinstance(inner, torch.nn.Module) and list(model.children()) == [inner]
    return _unwrap(inner) if wrapper else model


def _state(module, optimizer):
    # What save writes, or (None, None) on the other ranks of an FSDP2 model: it sends each tensor
    # in turn to rank 0's CPU (none holds it all), its optimizer's state keyed by number, as DDP's.
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        tensors, state = module.state_dict(), optimizer and optimizer.state_dict()
    else:
        tensors = dcp.get_model_state_dict(module, options=FULL)
        state = optimizer and dcp.get_optimizer_state_dict(module, optimizer, options=FULL)
        if dist.get_rank() != 0:
            return None, None
        order = state and [name for group in state["param_groups"] for name in group["params"]]
        state = state and _rekey(state, {name: i for i, name in enumerate(order)})
    first = {}  # safetensors refuses tensors sharing memory (the tied embedding and head): copies
    tensors = {k: t.contiguous() if first.setdefault(t.untyped_storage().data_ptr(), k) == k
               else t.clone() for k, t in tensors.items()}
    numpy = dict(zip("name keys pos has_gauss cached_gaussian".split(), np.random.get_state()))
    numpy["keys"] = numpy["keys"].tolist()  # an ndarray would not load with weights_only=True
    # the current CUDA device's RNG only: asking for all makes a context on every GPU from rank 0
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return tensors, {"optimizer": state, "rng": {"torch": torch.get_rng_state(), "cuda": cuda,
                                                 "python": random.getstate(), "numpy": numpy}}


def _rekey(state, key):  # an optimizer's state dict, its parameters renamed by `key`
    return {"state": {key[k]: v for k, v in state["state"].items()}, "param_groups": [
        dict(group, params=[key[k] for k in group["params"]]) for group in state["param_groups"]]}


def _set_rng(rng, scratch=False):
    # scratch=True: into new generators, to try the states a file holds before anything changes
    cpu, python, numpy = (torch.Generator(), random.Random(), np.random.RandomState()) if scratch \
        else (torch.default_generator, random, np.random)
    cpu.set_state(rng["torch"].cpu())  # (the setters want CPU byte tensors)
    python.setstate(rng["python"])
    numpy.set_state(tuple(rng["numpy"].values()))  # in np.random.get_state()'s order
    cuda = None if rng["cuda"] is None else rng["cuda"].cpu()  # (weights_only: a tensor, or fails)
    if not scratch and cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _check(x, where, json=False):
    # refused at the save, not at the resume that cannot read it: what weights_only=True does not
    # unpickle, or (json) what JSON does not hold exactly (json.dumps writes NaN, int keys as str)
    plain = (str, int, float, type(None)) + (() if json else (torch.Tensor, torch.dtype,
                                                             torch.device))
    if isinstance(x, (list, tuple)) or isinstance(x, dict) and all(
            isinstance(k, str if json else (str, int)) for k in x):
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            _check(v, f"{where}[{k!r}]", json)
    elif not isinstance(x, plain) or json and isinstance(x, float) and not math.isfinite(x):
        raise CheckpointError(f"{where} is {str(x)[:60]} ({type(x).__name__}), which " + (
            "JSON cannot hold exactly; store plain values (finite floats, str keys)" if json else
            "torch.load(weights_only=True) refuses; store tensors and plain values"))


def _write(tmp, write):
    # write(tmp), then fsync it while hashing it (measured: a third faster than one after the other)
    write(tmp)
    os.chmod(tmp, FILE_MODE)
    with ThreadPoolExecutor(2) as pool:
        _, digest = pool.map(lambda f: f(tmp), [fsync, sha256])
    return {"bytes": tmp.stat().st_size, "sha256": digest}


def lock(dir):
    """Lock `dir` for its one writer until the returned file is closed or the process ends (kill -9
    too); another is refused, naming this one's PID and host."""
    d = Path(dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / ".lock", "a+", buffering=1)  # line-buffered: the PID line is there at once
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (d / ".lock").read_text().strip() or "unknown"
        raise CheckpointError(f"{d} is in use by another run ({holder}); wait for it to finish or "
                              "stop it, or use another directory") from None
    except (FileExistsError, NotADirectoryError):  # (what mkdir and open say of a file there)
        raise CheckpointError(f"{d} is a file (or lies under one), not a directory") from None
    except OSError as e:  # (a file system without locks, say)
        raise CheckpointError(f"cannot lock {d} ({e.strerror}); use another directory or fix its "
                              "permissions") from None
    f.truncate(0)
    f.write(f"PID {os.getpid()} on {platform.node()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    return f


def step_files(dir):
    """{step: [paths]} of every checkpoint file in `dir`, whether its step counts or not."""
    d, found = Path(dir), {}
    for p in sorted(d.iterdir()) if d.is_dir() else []:
        if m := STEP_FILE.fullmatch(p.name):
            found.setdefault(int(m.group(1)), []).append(p)
    return found


def list_steps(dir):
    """The steps of `dir` that count (see read_meta), ascending; others are reported and skipped."""
    steps = []
    for step in sorted(step_files(dir)):
        try:
            read_meta(dir, step)
            steps.append(step)
        except CheckpointError as e:  # (a step whose files all went since they were listed: none)
            if str(e) not in _warned and any((Path(dir) / n).exists() for n in _names(step)):
                _warned.add(str(e))
                warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return steps


def latest_step(dir):
    """The highest step of `dir` that counts, or None."""
    return max(list_steps(dir), default=None)


def read_meta(dir, step, verify=False):
    """The meta of `step` once its files have the sizes it records (verify=True: and the sha256)."""
    d, names = Path(dir), _names(step)
    if not any((d / name).exists() for name in names):
        raise IncompleteCheckpoint(f"no checkpoint for step {step} in {d}; steps there: "
                                   f"{list_steps(d) or 'none'}")
    try:
        meta = json.loads((d / names[2]).read_text())
        files = {name: meta["files"][name] for name in names[:2]}  # (KeyError: not this step's)
        for name, want in files.items():
            if (size := (d / name).stat().st_size) != want["bytes"]:
                raise CheckpointError(f"step {step} in {d} is damaged: {name} has {size} bytes, "
                                      f"its meta says {want['bytes']}")
        with ThreadPoolExecutor(2) as pool:  # hashlib releases the GIL: both files at once
            found = dict(zip(files, pool.map(sha256, [d / n for n in files] if verify else [])))
        if bad := [name for name in found if found[name] != files[name]["sha256"]]:
            raise CorruptCheckpoint(f"checkpoint step {step}: {d / bad[0]} is corrupt (sha256 "
                                    "differs)")
    except FileNotFoundError as e:  # also as retention removes one: readers take no lock
        raise IncompleteCheckpoint(f"step {step} in {d} is incomplete: {Path(e.filename).name} "
                                   "is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"step {step} in {d} is unreadable: {names[2]} is not a valid meta "
                              f"file ({e})") from None
    return meta


def load(dir, step, model, optimizer=None, strict=True, restore_rng=False):
    """Load step `step` of `dir` into `model` (and `optimizer`), verified and parsed before anything
    changes; return its meta. strict=False loads the keys both have; restore_rng=True the RNGs."""
    d, module = Path(dir), _unwrap(model)
    meta, where = read_meta(d, step, verify=True), f"checkpoint step {step} in {d}"
    path = d / _names(step)[0]  # (the file being parsed, for errors)
    try:  # a file whose hash matches may still not be save()'s (written by hand, by another tool)
        tensors = safetensors.torch.load_file(path)  # to the CPU: a 2nd copy on a GPU may not fit
        state = torch.load(path := d / _names(step)[1], map_location="cpu", weights_only=True)
        _set_rng(state["rng"], scratch=True)
    except FileNotFoundError:  # hashed a moment ago: deleted since
        raise IncompleteCheckpoint(f"{where} is incomplete: {path.name} is missing") from None
    except Exception as e:  # noqa: BLE001 (bytes that are not the format: each library's error)
        raise CorruptCheckpoint(f"{where}: {path.name} matches its sha256 but is unreadable "
                                f"({str(e)[:200]})") from None
    # config, keys and shapes must agree, or with strict=False the shapes (the keys both have load).
    # A config field newer than the checkpoint counts as its default: older checkpoints still load.
    own, diffs, absent, saved = module.state_dict(), [], "<absent>", meta.get("model_config")
    if saved is not None and dataclasses.is_dataclass(live := getattr(module, "config", None)):
        new = {f.name: f.default for f in dataclasses.fields(live)
               if f.default is not dataclasses.MISSING}
        live, saved = (json.loads(json.dumps(c, default=repr))  # (a tuple compares as JSON's list)
                       for c in (dataclasses.asdict(live), {**new, **saved}))
        diffs = [f"{k}: checkpoint {saved.get(k, absent)!r}, model {live.get(k, absent)!r}"
                 for k in sorted(saved | live) if saved.get(k, absent) != live.get(k, absent)]
    diffs += [f"{k}: not in the {'model' if k in tensors else 'checkpoint'}"
              for k in sorted(own.keys() ^ tensors.keys())]
    shapes = [f"shape of {k}: checkpoint {list(tensors[k].shape)}, model {list(own[k].shape)}"
              for k in sorted(own.keys() & tensors.keys()) if tensors[k].shape != own[k].shape]
    if shapes or diffs and strict:
        raise ModelMismatch(f"{where} does not fit the model: {'; '.join(diffs + shapes)}")
    if diffs:
        warnings.warn(f"{where} is from another model, loading the keys both have: "
                      f"{'; '.join(diffs)}", stacklevel=2)
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    if optimizer is not None:  # before the model, which then changes only if both fit
        if state["optimizer"] is None:
            raise CheckpointError(f"{where} was saved without optimizer state")
        try:
            if sharded:  # the numbers name the live optimizer's parameters, in its order
                names = {p: name for name, p in module.named_parameters()}
                order = [names[p] for group in optimizer.param_groups for p in group["params"]]
                named = _rekey(state["optimizer"], dict(enumerate(order)))
                dcp.set_optimizer_state_dict(module, optimizer, named, options=FULL)
            else:
                optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: its optimizer state does not fit: {e}") from None
    if sharded:  # every rank keeps its shards of the full tensors
        dcp.set_model_state_dict(module, tensors, options=FULL)
    else:  # (copied to the model's device, in place: tied parameters stay tied)
        module.load_state_dict(tensors, strict=False)
    if restore_rng:
        _set_rng(state["rng"])
    return meta


def newest(dir, load_step):
    """(step, load_step(step)) for the newest step of `dir` that loads, or (None, None). A corrupt
    step is passed over; a vanished one (retention deletes under readers) has the steps relisted."""
    failed = set()
    while steps := [s for s in list_steps(dir) if s not in failed]:
        try:
            return steps[-1], load_step(steps[-1])
        except CorruptCheckpoint as e:
            warnings.warn(f"{e}; trying an earlier step", stacklevel=3)
        except IncompleteCheckpoint:
            warnings.warn(f"checkpoint step {steps[-1]} in {dir} was deleted as it was read (by "
                          "the retention of the run writing there, or moved aside)", stacklevel=3)
        failed.add(steps[-1])
    return None, None


def load_latest(dir, model, optimizer=None, strict=True, restore_rng=False):
    """Load the newest step that verifies: (step, meta), or (None, None). A corrupt or vanished step
    falls back (see newest); one that does not fit the model is an error (older ones would not)."""
    return newest(dir, lambda step: load(dir, step, model, optimizer, strict, restore_rng))
