"""Checkpoints: atomic save, discovery, verified load, retention, and the one writer's lock.

Step N of a run is three files; the meta records the other two's bytes and sha256:
    model_step_N.safetensors   the unwrapped model's weights (a tied tensor under each name)
    optim_step_N.pt            {"optimizer": state_dict or None, "rng": RNG states}, weights_only
    meta_step_N.json           the caller's meta + step, time, versions, model_config, files

Each file goes to a temporary name (".NAME.tmp") and is fsynced; the data files are renamed into
place, then the meta as the commit, fsyncing the directory after each rename. A kill at any instant
leaves the earlier steps and all of the new one or nothing that counts. One process writes a
directory, holding lock(dir); any number may read. A model sharded with FSDP is saved and loaded
as full tensors, so its files are any run's: every rank calls save (the gather is collective) and
rank 0 writes; every rank calls load. A step counts when its files have the sizes its
meta records; load checks their sha256 too, before it changes anything. A step that fails is
reported and skipped (load_latest falls back to an older one), never deleted.
"""
import dataclasses
import errno
import fcntl
import json
import math
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
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp
from torch.distributed.tensor import DTensor

from data import fsync, sha256


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit the model."""


class CorruptCheckpoint(CheckpointError):
    """A step's files cannot be trusted (hash mismatch, unreadable): load_latest tries older ones."""


class IncompleteCheckpoint(CheckpointError):
    """A file of the step is missing: a save cut short, or one deleted by retention as it is read."""


class ModelMismatch(CheckpointError):
    """Another model (config, keys, shapes) than the one it is loaded into: `what` says how."""

    def __init__(self, what):
        super().__init__(f"{what}. Build the model from its meta['model_config'], or where shapes "
                         "agree strict=False loads the keys both have")
        self.what = what


STEP_FILE = re.compile(r"(?:model|optim|meta)_step_(0|[1-9][0-9]*)\.(?:safetensors|pt|json)")
_written = set()  # (directory, step) saved by this process: known good, retention need not re-hash
_warned = set()  # what list_steps skipped, reported once per process
# a model sharded by FSDP2 and its optimizer <-> full tensors on the CPU (on rank 0 only, gathered)
FULL = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True, strict=False)
_UMASK = os.umask(0o022)  # Python reads the umask only by setting it: set back at once
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() gives a new file; safetensors writes 0600 whatever it is


def _names(step):
    return f"model_step_{step}.safetensors", f"optim_step_{step}.pt", f"meta_step_{step}.json"


def save(dir, step, model, optimizer, meta, keep_last=None):
    """Write (or rewrite) step `step` of `model` and `optimizer` (or None) into `dir`; return the
    three paths (None on the other ranks of a sharded model). keep_last=K then deletes all but the K
    highest steps, never the one just written nor one that fails to verify."""
    if type(step) is not int or step < 0:  # another type would make a name list_steps never finds
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise CheckpointError(f"keep_last must be a positive int or None, got {keep_last!r}")
    module = _unwrap(model)
    versions = {m.__name__: m.__version__ for m in (torch, np, safetensors)}
    versions["python"] = platform.python_version()
    meta = dict(meta or {}, step=step, time=time.time(), versions=versions)
    if dataclasses.is_dataclass(config := getattr(module, "config", None)):
        meta["model_config"] = dataclasses.asdict(config)
    _check_json(meta, "meta")
    tensors, optimizer_state = _full_state(module, optimizer)
    if tensors is None:  # a rank of a sharded model, which has sent its shards to rank 0
        return None
    tensors = _independent(tensors)
    # the current CUDA device's RNG only: asking for all makes a context on every GPU from rank 0
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    numpy = dict(zip(["name", "keys", "pos", "has_gauss", "cached_gaussian"], np.random.get_state()))
    numpy["keys"] = numpy["keys"].tolist()  # an ndarray would not load with weights_only=True
    rng = {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate(), "numpy": numpy}
    optim = {"optimizer": optimizer_state, "rng": rng}
    _check_plain(optim, "optimizer file")

    d, (model_name, optim_name, meta_name) = Path(dir), _names(step)
    tmp = {name: d / f".{name}.tmp" for name in _names(step)}  # never a step's name
    writers = {model_name: lambda p: safetensors.torch.save_file(tensors, p, {"format": "pt"}),
               optim_name: lambda p: torch.save(optim, p)}
    committed = False
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(d)
        with ThreadPoolExecutor(2) as pool:  # independent files; writing and hashing free the GIL
            meta["files"] = dict(zip(writers, pool.map(_write, map(tmp.get, writers), writers.values())))
        _write(tmp[meta_name], lambda p: p.write_text(json.dumps(meta, indent=2)))
        if (d / meta_name).exists():  # re-saving: un-commit, no crash pairs old meta, new data
            (d / meta_name).unlink()
            fsync(d)
        for name in _names(step):  # the meta last, as the commit, once the data files are durable
            os.replace(tmp[name], d / name)
            committed = name == meta_name
            fsync(d)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:  # a full disk, in 3 dialects
        if committed:  # only the last fsync failed: the step is there, but may not outlive a crash
            raise CheckpointError(f"checkpoint step {step} was written to {d}, but syncing the "
                                  f"directory failed ({e}), so a power loss may undo it; the disk "
                                  f"reports an error: check it before training on") from None
        for p in tmp.values():
            p.unlink(missing_ok=True)
        free = f"{shutil.disk_usage(d).free / 1e9:.1f} GB free there" if d.is_dir() else "no directory"
        fix = ("The disk reports an I/O error: check it" if getattr(e, "errno", None) == errno.EIO
               else "Free space or fix permissions")
        raise CheckpointError(f"could not write checkpoint step {step} in {d} ({free}): {e}. "
                              f"{fix}; the checkpoints there are untouched") from None
    _written.add((d.resolve(), step))
    if keep_last is not None:
        _retain(d, keep_last, step)
    return d / model_name, d / optim_name, d / meta_name


def _unwrap(model):
    # DDP keeps the model in `.module`, torch.compile in `._orig_mod`, and they nest; a wrapper has
    # just that one child, unlike a model that happens to have a submodule called `module`
    inner = getattr(model, "_orig_mod", getattr(model, "module", None))
    wrapper = isinstance(inner, torch.nn.Module) and list(model.children()) == [inner]
    return _unwrap(inner) if wrapper else model


def _full_state(module, optimizer):
    # A model sharded by FSDP2 (its parameters are DTensors) sends each tensor in turn to rank 0's
    # CPU, so no rank holds it all on its device. Its optimizer's state, keyed by parameter name,
    # is stored by number as an unsharded one's is, so that any run reads it. Rank 0 gets both,
    # the other ranks (None, None).
    if not _sharded(module):
        return module.state_dict(), optimizer and optimizer.state_dict()
    tensors = dcp.get_model_state_dict(module, options=FULL)
    state = optimizer and dcp.get_optimizer_state_dict(module, optimizer, options=FULL)
    if dist.get_rank() != 0:
        return None, None
    names = [name for group in state["param_groups"] for name in group["params"]] if state else []
    return tensors, state and _rekey(state, {name: i for i, name in enumerate(names)})


def _sharded(module):
    return any(isinstance(p, DTensor) for p in module.parameters())


def _rekey(state, key):  # an optimizer's state dict, its parameters renamed by `key`
    return {"state": {key[k]: v for k, v in state["state"].items()}, "param_groups": [
        dict(group, params=[key[k] for k in group["params"]]) for group in state["param_groups"]]}


def _independent(state):
    # safetensors refuses tensors that share memory (the tied embedding and head): write copies
    seen, out = set(), {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t.contiguous()  # state_dict() detaches them
        seen.add(ptr)
    return out


def _check_json(x, where):
    # json.dumps would quietly turn int keys into strings and write NaN (not JSON): refused now,
    # not at the resume that could not read it
    if isinstance(x, (list, tuple)) or isinstance(x, dict) and all(isinstance(k, str) for k in x):
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            _check_json(v, f"{where}[{k!r}]")
    elif not (x is None or isinstance(x, (str, int)) or isinstance(x, float) and math.isfinite(x)):
        raise CheckpointError(f"{where} is {str(x)[:60]} ({type(x).__name__}), which JSON cannot "
                              f"hold exactly; store plain values (finite floats, str keys)")


def _check_plain(x, where):
    # weights_only=True unpickles tensors and plain values only: anything else is refused now
    if type(x) in (list, tuple, dict):
        for k, v in x.items() if type(x) is dict else enumerate(x):
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
    elif not (x is None or isinstance(x, (str, int, float, torch.Tensor, torch.dtype, torch.device,
                                          torch.Size))):
        raise CheckpointError(f"{where}: {type(x).__name__} {str(x)[:60]} fails weights_only=True")


def _write(tmp, write):
    # write(tmp), then fsync it while hashing it (measured: a third faster than one after the other)
    write(tmp)
    os.chmod(tmp, FILE_MODE)
    with ThreadPoolExecutor(2) as pool:
        _, digest = pool.map(lambda f: f(tmp), [fsync, sha256])
    return {"bytes": tmp.stat().st_size, "sha256": digest}


def _remove_leftovers(d):
    # What killed saves and retentions leave: temporary files, and the data files of a step without
    # a meta. Only the one writer of d calls this, so none of it can be a save in progress.
    orphans = [p for ps in step_files(d).values() if all(p.suffix != ".json" for p in ps) for p in ps]
    for p in orphans + [p for p in d.glob(".*.tmp") if STEP_FILE.match(p.name[1:])]:
        p.unlink()


def _retain(d, keep_last, just_written):
    for step in [s for s in list_steps(d)[:-keep_last] if s != just_written]:
        if (d.resolve(), step) not in _written:  # not written by this process: goes if it verifies
            try:
                read_meta(d, step, verify=True)
            except CheckpointError as e:
                warnings.warn(f"retention keeps {e}", stacklevel=3)
                continue
        for name in reversed(_names(step)):  # meta first: the step stops counting, then its data goes
            (d / name).unlink(missing_ok=True)


def lock(dir):
    """Lock `dir` for its one writer (another is refused, naming this one's PID and host) until the
    returned file is closed or the process ends, however it ends (kill -9 too)."""
    d = Path(dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / ".lock", "a+", buffering=1)  # line-buffered: the PID line is there at once
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (d / ".lock").read_text().strip() or "unknown"
        raise CheckpointError(f"{d} is in use by another run ({holder}); wait for it to finish or "
                              f"stop it, or use another directory") from None
    except (FileExistsError, NotADirectoryError):  # (what mkdir and open say of a file there)
        raise CheckpointError(f"{d} is a file (or lies under one), not a directory; use another "
                              f"directory") from None
    except OSError as e:
        raise CheckpointError(f"cannot lock {d} ({e.strerror}); use another directory or fix its "
                              f"permissions") from None
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
    d, (model_name, optim_name, meta_name) = Path(dir), _names(step)
    if not any((d / name).exists() for name in _names(step)):
        steps = list_steps(d) or "none"
        raise IncompleteCheckpoint(f"no checkpoint for step {step} in {d}; steps there: {steps}")
    where = f"step {step} in {d}"
    try:
        meta = json.loads((d / meta_name).read_text())
        # (a KeyError: the meta of another step, or not a meta at all)
        hashes = {name: meta["files"][name]["sha256"] for name in (model_name, optim_name)}
        for name in hashes:
            if (size := (d / name).stat().st_size) != (want := meta["files"][name]["bytes"]):
                raise CheckpointError(f"{where} is damaged: {name} has {size} bytes, {meta_name} "
                                      f"says {want}")
        with ThreadPoolExecutor(2) as pool:  # hashlib releases the GIL: both files at once
            found = dict(zip(hashes, pool.map(sha256, [d / n for n in hashes] if verify else [])))
    except FileNotFoundError as e:  # also when retention removes one as we look: readers do not lock
        raise IncompleteCheckpoint(f"{where} is incomplete: {Path(e.filename).name} is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where} is unreadable: {d / meta_name} is not a valid meta file "
                              f"({e})") from None
    for name in found:
        if found[name] != hashes[name]:
            raise CorruptCheckpoint(f"checkpoint step {step}: {d / name} is corrupt (sha256 mismatch)")
    return meta


def load(dir, step, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load step `step` of `dir` into `model` (and `optimizer`), verified and parsed before anything
    changes; return its meta. strict=False loads the keys both have; restore_rng=True restores the
    torch, CUDA, Python and NumPy RNGs."""
    d, module, (model_name, optim_name, _) = Path(dir), _unwrap(model), _names(step)
    meta, where = read_meta(d, step, verify=True), f"checkpoint step {step} in {d}"
    path, sharded = d / model_name, _sharded(module)  # (path: the file being parsed, for errors)
    try:
        tensors = safetensors.torch.load_file(path)  # to the CPU: a 2nd copy on a GPU may not fit
        path = d / optim_name  # (sharded: kept on the CPU, each rank takes its shard from there)
        state = torch.load(path, map_location="cpu" if sharded else map_location, weights_only=True)
        _check_state(state)
    except FileNotFoundError:  # hashed a moment ago: deleted since
        raise IncompleteCheckpoint(f"{where} is incomplete: {path.name} is missing") from None
    except (safetensors.SafetensorError, pickle.UnpicklingError, RuntimeError, OSError, ValueError,
            EOFError, TypeError, KeyError, AttributeError) as e:  # bytes that are not the format
        raise CorruptCheckpoint(f"{where}: {path.name} matches its sha256 but is unreadable "
                                f"({str(e)[:200]})") from None
    own, diffs, saved, absent = module.state_dict(), [], meta.get("model_config"), "<absent>"
    if saved is not None and dataclasses.is_dataclass(live := getattr(module, "config", None)):
        # a field newer than the checkpoint counts as its default: older checkpoints keep loading
        new = {f.name: f.default for f in dataclasses.fields(live) if f.default is not dataclasses.MISSING}
        live = json.loads(json.dumps(dataclasses.asdict(live), default=repr))  # tuples -> lists
        saved = {**json.loads(json.dumps(new, default=repr)), **saved}
        diffs = [f"{k}: checkpoint {saved.get(k, absent)!r}, model {live.get(k, absent)!r}"
                 for k in sorted(saved.keys() | live.keys()) if saved.get(k, absent) != live.get(k, absent)]
    diffs += [f"{k}: not in the checkpoint" for k in sorted(own.keys() - tensors.keys())]
    diffs += [f"{k}: not in the model" for k in sorted(tensors.keys() - own.keys())]
    shapes = [f"shape of {k}: checkpoint {list(tensors[k].shape)}, model {list(own[k].shape)}"
              for k in sorted(own.keys() & tensors.keys()) if tensors[k].shape != own[k].shape]
    if shapes or (diffs and strict):  # a shape that differs is an error even with strict=False
        raise ModelMismatch(f"{where} does not fit the model: {'; '.join(diffs + shapes)}")
    if diffs:
        warnings.warn(f"{where} is from another model, loading the keys both have: "
                      f"{'; '.join(diffs)}", stacklevel=2)
    if optimizer is not None:
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
            raise CheckpointError(f"{where}: optimizer state does not fit the optimizer: {e}") from None
    if sharded:  # every rank keeps its shards of the full tensors
        dcp.set_model_state_dict(module, tensors, options=FULL)
    else:
        module.load_state_dict(tensors, strict=False)  # copies in place: tied parameters stay tied
    if restore_rng:  # the setters want CPU byte tensors, wherever map_location put them
        rng = state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"].cpu())
        random.setstate(rng["python"])
        np.random.set_state(tuple(rng["numpy"].values()))  # in np.random.get_state()'s order
    return meta


def _check_state(state):
    # a file whose hash matches may hold another structure than save()'s (written by hand, or by
    # another tool): each RNG state is tried on a scratch generator, before anything changes
    rng = state["rng"]
    if not isinstance(state["optimizer"], (dict, type(None))) or not isinstance(rng["cuda"], (
            torch.Tensor, type(None))):
        raise TypeError("expected {'optimizer': a state dict or None, 'rng': RNG states}")
    torch.Generator().set_state(rng["torch"].cpu())
    random.Random().setstate(rng["python"])
    np.random.RandomState().set_state(tuple(rng["numpy"].values()))


def newest(dir, load_step):
    """(step, load_step(step)) for the newest step of `dir` that loads, or (None, None). A corrupt
    step is reported and passed over; one whose files vanish as it is read was deleted by the
    retention of the run writing there (readers take no lock): the steps are listed again."""
    failed = set()
    while steps := [s for s in list_steps(dir) if s not in failed]:
        try:
            return steps[-1], load_step(steps[-1])
        except CorruptCheckpoint as e:
            warnings.warn(f"{e}; trying an earlier step", stacklevel=3)
        except IncompleteCheckpoint:
            warnings.warn(f"checkpoint step {steps[-1]} in {dir} was deleted as it was read (by "
                          "the retention of the run writing there, or moved aside as it resumed); "
                          "trying the newest step again", stacklevel=3)
        failed.add(steps[-1])
    return None, None


def load_latest(dir, model, optimizer=None, map_location="cpu", strict=True, restore_rng=False):
    """Load the newest step that verifies: (step, meta), or (None, None). A corrupt or vanished step
    falls back (see newest); a step that does not fit the model is an error (older ones would not
    either)."""
    return newest(dir, lambda step: load(dir, step, model, optimizer, map_location, strict,
                                          restore_rng))
