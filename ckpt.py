"""Checkpoints: atomic save, discovery, verified load, retention, and the one writer's lock.

Step N of a run is three files:
    model_step_N.safetensors   the unwrapped model's weights, a tied tensor under each of its names
    optim_step_N.pt            {"optimizer": state, "rng": RNG states}, loadable with weights_only
    meta_step_N.json           the caller's meta, plus step, time, versions, model_config, and
                               the byte size and sha256 of the other two files
The optimizer's state is its state_dict(), a list of them when save is given a list of
optimizers (say Muon for the matrices beside AdamW for the rest), or None without one.

Each file is written to ".NAME.tmp", fsynced and renamed, the meta last: it is the commit, so a
kill at any instant leaves the new step either whole or not counting. A step that fails
verification is reported and skipped, never deleted. A model sharded by FSDP is saved and loaded
as full tensors (all ranks call save and load, rank 0 writes), so any run reads it.
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
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist

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
        super().__init__(f"{what}. Build the model from its meta['model_config'], or where "
                         "shapes agree strict=False loads the keys both have")
        self.what = what


STEP_FILE = re.compile(
    r"(?:model|optim|meta)_step_(0|[1-9][0-9]*)\.(?:safetensors|pt|json)")

# The (directory, step) pairs this process saved. They are known to be good, so retention need
# not hash them again.
_written = set()

# The skipped steps that list_steps has reported, so that each is reported once per process.
_warned = set()

# Python reads the umask only by setting it, so it is set back at once.
_UMASK = os.umask(0o022)
os.umask(_UMASK)

# The mode open() gives a new file. safetensors writes 0600 whatever the umask, so save sets
# this mode on every file it writes.
FILE_MODE = 0o666 & ~_UMASK


def _names(step):
    model_name = f"model_step_{step}.safetensors"
    optim_name = f"optim_step_{step}.pt"
    meta_name = f"meta_step_{step}.json"
    return model_name, optim_name, meta_name


# -----------------------------------------------------------------------------
# what a save writes: weights, optimizer state, RNG states


def _unwrap(model):
    """The model inside DDP's and torch.compile's wrappers, which may nest."""
    # DDP keeps the model in `.module` and torch.compile in `._orig_mod`. A wrapper has just
    # that one child, unlike a model that happens to have a submodule called `module`.
    inner = getattr(model, "_orig_mod", getattr(model, "module", None))
    if not isinstance(inner, torch.nn.Module):
        return model
    if list(model.children()) != [inner]:
        return model
    return _unwrap(inner)


def _is_sharded(module):
    """Whether FSDP2 has sharded the module's parameters into DTensors."""
    # No DTensor can exist before its module is imported. Checking that first spares every run
    # without FSDP the half second that the import takes.
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in module.parameters())


def _as_list(optimizer):
    """The optimizers save and load were given: None, one optimizer, or a list of them."""
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    return [optimizer]


def _rekey(state, key):
    """An optimizer's state dict with its parameters renamed by the mapping `key`."""
    renamed = {}
    for k, value in state["state"].items():
        renamed[key[k]] = value
    groups = []
    for group in state["param_groups"]:
        params = [key[k] for k in group["params"]]
        groups.append(dict(group, params=params))
    return {"state": renamed, "param_groups": groups}


def _full_options():
    """The options that turn FSDP2's shards into full tensors on the CPU, and back."""
    # torch.distributed.checkpoint takes over a second to import and only FSDP runs need it.
    import torch.distributed.checkpoint.state_dict as dcp
    return dcp.StateDictOptions(full_state_dict=True, cpu_offload=True, strict=False)


def _gather_full(module, optimizers):
    """The full weights and optimizer states of an FSDP2 model on rank 0, None on the others.

    Each tensor is sent in turn to rank 0's CPU, as no rank holds them all. The optimizers'
    states come keyed by parameter name; they are keyed here by number, in each optimizer's
    order, as a plain optimizer's state_dict() keys them, so that any run reads the file.
    """
    import torch.distributed.checkpoint.state_dict as dcp
    options = _full_options()
    tensors = dcp.get_model_state_dict(module, options=options)
    states = []
    for optimizer in optimizers:
        state = dcp.get_optimizer_state_dict(module, optimizer, options=options)
        states.append(state)
    if dist.get_rank() != 0:
        return None, None
    numbered = []
    for state in states:
        order = [name for group in state["param_groups"] for name in group["params"]]
        number = {name: i for i, name in enumerate(order)}
        numbered.append(_rekey(state, number))
    return tensors, numbered


def _untied(tensors):
    """The tensors, each on its own memory."""
    # safetensors refuses tensors that share memory, such as the tied embedding and LM head.
    # The first name on a storage keeps the tensor; every later one gets a copy.
    seen = set()
    untied = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            untied[name] = tensor.clone()
        else:
            seen.add(storage)
            untied[name] = tensor.contiguous()
    return untied


def _rng_state():
    """The states of every RNG a run draws from, as tensors and plain values."""
    fields = ["name", "keys", "pos", "has_gauss", "cached_gaussian"]
    numpy = dict(zip(fields, np.random.get_state()))
    # An ndarray would not load with weights_only=True, so the keys go as a list.
    numpy["keys"] = numpy["keys"].tolist()
    # Only the current CUDA device's RNG: asking for all of them would make a context on every
    # GPU from rank 0.
    cuda = None
    if torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state()
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate(),
            "numpy": numpy}


def _state(module, optimizer):
    """(weights, optimizer file) that save writes, or (None, None) on the ranks of an FSDP2
    model other than rank 0."""
    optimizers = _as_list(optimizer)
    if _is_sharded(module):
        tensors, states = _gather_full(module, optimizers)
        if tensors is None:
            return None, None
    else:
        tensors = module.state_dict()
        states = [o.state_dict() for o in optimizers]
    # One optimizer, alone or in a list, keeps the file format it has always had: its state
    # dict, not a list.
    if optimizer is None:
        optimizer_state = None
    elif len(states) == 1:
        optimizer_state = states[0]
    else:
        optimizer_state = states
    optim_file = {"optimizer": optimizer_state, "rng": _rng_state()}
    return _untied(tensors), optim_file


def _check(value, where, for_json=False):
    """Refuse what torch.load(weights_only=True) would not unpickle, or with for_json=True
    what JSON does not hold exactly (json.dumps writes NaN, and int keys as strings)."""
    # This runs at the save, so that the error comes there and not at the resume that cannot
    # read the file.
    if for_json:
        plain = (str, int, float, type(None))
        key_types = str
    else:
        plain = (str, int, float, type(None), torch.Tensor, torch.dtype, torch.device)
        key_types = (str, int)
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i!r}]", for_json)
        return
    if isinstance(value, dict) and all(isinstance(k, key_types) for k in value):
        for k, item in value.items():
            _check(item, f"{where}[{k!r}]", for_json)
        return
    infinite = for_json and isinstance(value, float) and not math.isfinite(value)
    if isinstance(value, plain) and not infinite:
        return
    if for_json:
        fix = "JSON cannot hold exactly; store plain values (finite floats, str keys)"
    else:
        fix = "torch.load(weights_only=True) refuses; store tensors and plain values"
    found = f"{str(value)[:60]} ({type(value).__name__})"
    raise CheckpointError(f"{where} is {found}, which {fix}")


# -----------------------------------------------------------------------------
# finding steps on disk


def step_files(dir):
    """{step: [paths]} of every checkpoint file in `dir`, whether its step counts or not."""
    d = Path(dir)
    found = {}
    if not d.is_dir():
        return found
    for p in sorted(d.iterdir()):
        match = STEP_FILE.fullmatch(p.name)
        if match:
            step = int(match.group(1))
            found.setdefault(step, []).append(p)
    return found


def list_steps(dir):
    """The steps of `dir` that count (see read_meta), ascending; others are reported and
    skipped."""
    # read_meta checks sizes, not hashes, so listing stays cheap however large the steps.
    steps = []
    for step in sorted(step_files(dir)):
        try:
            read_meta(dir, step)
        except CheckpointError as e:
            # A step whose files all went since they were listed is not reported.
            still_there = any((Path(dir) / name).exists() for name in _names(step))
            if str(e) not in _warned and still_there:
                _warned.add(str(e))
                warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
            continue
        steps.append(step)
    return steps


def latest_step(dir):
    """The highest step of `dir` that counts, or None."""
    return max(list_steps(dir), default=None)


def read_meta(dir, step, verify=False):
    """The meta of `step` once its files have the sizes it records (verify=True: and the
    sha256 it records)."""
    d = Path(dir)
    model_name, optim_name, meta_name = _names(step)
    if not any((d / name).exists() for name in _names(step)):
        raise IncompleteCheckpoint(f"no checkpoint for step {step} in {d}; steps there: "
                                   f"{list_steps(d) or 'none'}")
    try:
        meta = json.loads((d / meta_name).read_text())
        # A KeyError here means the meta is not that of a step.
        files = {model_name: meta["files"][model_name], optim_name: meta["files"][optim_name]}
        for name, want in files.items():
            size = (d / name).stat().st_size
            if size != want["bytes"]:
                raise CheckpointError(f"step {step} in {d} is damaged: {name} has {size} "
                                      f"bytes, its meta says {want['bytes']}")
        if verify:
            # hashlib releases the GIL, so both files are hashed at once.
            with ThreadPoolExecutor(2) as pool:
                digests = list(pool.map(sha256, [d / name for name in files]))
            for name, digest in zip(files, digests):
                if digest != files[name]["sha256"]:
                    raise CorruptCheckpoint(f"checkpoint step {step}: {d / name} is corrupt "
                                            "(sha256 differs)")
    except FileNotFoundError as e:
        # Readers take no lock, so this also happens as retention removes a step.
        missing = Path(e.filename).name
        raise IncompleteCheckpoint(f"step {step} in {d} is incomplete: {missing} is "
                                   "missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"step {step} in {d} is unreadable: {meta_name} is not a valid "
                              f"meta file ({e})") from None
    return meta


# -----------------------------------------------------------------------------
# saving


def _write(tmp, write):
    """write(tmp), then fsync the file while hashing it; its size and sha256."""
    write(tmp)
    os.chmod(tmp, FILE_MODE)
    # Both at once measured a third faster than one after the other.
    with ThreadPoolExecutor(2) as pool:
        synced = pool.submit(fsync, tmp)
        digest = pool.submit(sha256, tmp)
        synced.result()
        return {"bytes": tmp.stat().st_size, "sha256": digest.result()}


def _remove_leftovers(d):
    """Delete what killed saves and retentions left in `d`."""
    # The directory has one writer, so none of this is a save under way: step files whose meta
    # is gone, and temporary files of step files.
    for paths in step_files(d).values():
        if all(p.suffix != ".json" for p in paths):
            for p in paths:
                p.unlink()
    for p in d.glob(".*.tmp"):
        if STEP_FILE.match(p.name[1:]):
            p.unlink()


def _commit(d, step, tensors, optim_file, meta):
    """Write the three files of `step` into `d`, the meta last, or raise a CheckpointError that
    leaves the directory as it was."""
    model_name, optim_name, meta_name = _names(step)
    # Temporary names are never the name of a step's file.
    tmp = {name: d / f".{name}.tmp" for name in _names(step)}

    def write_model(path):
        safetensors.torch.save_file(tensors, path, {"format": "pt"})

    def write_optim(path):
        torch.save(optim_file, path)

    def write_meta(path):
        path.write_text(json.dumps(meta, indent=2))

    committed = False
    try:
        d.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(d)
        # The two data files are independent, and writing and hashing release the GIL.
        with ThreadPoolExecutor(2) as pool:
            model_file = pool.submit(_write, tmp[model_name], write_model)
            optim_info = pool.submit(_write, tmp[optim_name], write_optim)
            meta["files"] = {model_name: model_file.result(), optim_name: optim_info.result()}
        _write(tmp[meta_name], write_meta)
        # Re-saving a step un-commits the old one first: a crash could otherwise pair the old
        # meta with the new data.
        if (d / meta_name).exists():
            (d / meta_name).unlink()
            fsync(d)
        # The meta goes last, as the commit, once the data files are durable.
        for name in _names(step):
            os.replace(tmp[name], d / name)
            committed = name == meta_name
            fsync(d)
    # A full disk, in the dialects of the three writers.
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        if committed:
            # Only the last fsync failed: the step is there, but may not outlive a crash.
            raise CheckpointError(f"checkpoint step {step} was written to {d}, but a power "
                                  f"loss may undo it: syncing failed ({e}); check the "
                                  "disk") from None
        for p in tmp.values():
            p.unlink(missing_ok=True)
        if d.is_dir():
            free = f"{shutil.disk_usage(d).free / 1e9:.1f} GB free"
        else:
            free = "no directory"
        if getattr(e, "errno", 0) == errno.EIO:
            fix = "The disk reports an I/O error: check it"
        else:
            fix = "Free space or fix permissions"
        raise CheckpointError(f"could not write checkpoint step {step} in {d} ({free} there): "
                              f"{e}. {fix}; the checkpoints there are untouched") from None


def _retain(d, step, keep_last):
    """Delete all but the `keep_last` highest steps of `d`, never `step` (just written) nor a
    step that fails to verify."""
    for old in list_steps(d)[:-keep_last]:
        if old == step:
            continue
        # A step this process did not write goes only if it verifies.
        if (d.resolve(), old) not in _written:
            try:
                read_meta(d, old, verify=True)
            except CheckpointError as e:
                warnings.warn(f"retention keeps {e}", stacklevel=3)
                continue
        # The meta first, so the step stops counting; then its data files go.
        for name in reversed(_names(old)):
            (d / name).unlink(missing_ok=True)


def save(dir, step, model, optimizer, meta, keep_last=None):
    """Write (or rewrite) step `step` of `model` and `optimizer` into `dir`.

    `optimizer` is one optimizer, a list of them, or None. Returns the three paths, or None on
    the ranks of a sharded model other than rank 0. keep_last=K then deletes all but the K
    highest steps, never the one just written nor one that fails to verify.
    """
    module = _unwrap(model)
    versions = {lib.__name__: lib.__version__ for lib in (torch, np, safetensors)}
    versions["python"] = platform.python_version()
    meta = dict(meta or {}, step=step, time=time.time(), versions=versions)
    # The config in the meta lets load refuse another model by name, not by a shape error.
    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config):
        meta["model_config"] = dataclasses.asdict(config)
    # The meta and the optimizer file are checked before anything is written, so a refusal
    # leaves the directory as it was.
    _check(meta, "meta", for_json=True)
    tensors, optim_file = _state(module, optimizer)
    # The other ranks of a sharded model have sent their shards to rank 0, which writes.
    if tensors is None:
        return None
    _check(optim_file, "optimizer file")
    d = Path(dir)
    _commit(d, step, tensors, optim_file, meta)
    _written.add((d.resolve(), step))
    if keep_last:
        _retain(d, step, keep_last)
    return tuple(d / name for name in _names(step))


def lock(dir):
    """Lock `dir` for its one writer until the returned file is closed or the process ends
    (kill -9 too); another is refused, naming this one's PID and host."""
    d = Path(dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        # Line-buffered, so that the PID line is there at once.
        f = open(d / ".lock", "a+", buffering=1)
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (d / ".lock").read_text().strip() or "unknown"
        raise CheckpointError(f"{d} is in use by another run ({holder}); wait for it to "
                              "finish or stop it, or use another directory") from None
    # What mkdir and open say of a file where the directory should be.
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"{d} is a file (or lies under one), not a "
                              "directory") from None
    # A file system without locks, say.
    except OSError as e:
        raise CheckpointError(f"cannot lock {d} ({e.strerror}); use another directory or fix "
                              "its permissions") from None
    # The kernel releases a flock however its holder ends, so a stale lock never blocks a new
    # run; the line below only tells a refused run who holds it.
    f.truncate(0)
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    f.write(f"PID {os.getpid()} on {platform.node()}, since {since}\n")
    return f


# -----------------------------------------------------------------------------
# loading


def _set_rng(rng, scratch=False):
    """Set every RNG to the states in `rng`; scratch=True sets new generators instead, to try
    the states a file holds before anything changes."""
    if scratch:
        cpu = torch.Generator()
        python = random.Random()
        numpy = np.random.RandomState()
    else:
        cpu = torch.default_generator
        python = random
        numpy = np.random
    # The setters want CPU byte tensors.
    cpu.set_state(rng["torch"].cpu())
    python.setstate(rng["python"])
    # The values are in np.random.get_state()'s order.
    numpy.set_state(tuple(rng["numpy"].values()))
    # With weights_only the CUDA state is a tensor or fails here, on a scratch try too.
    cuda = rng["cuda"]
    if cuda is not None:
        cuda = cuda.cpu()
    if not scratch and cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _read_step(d, step, where):
    """(weights, optimizer file) of a step whose hashes were checked; a file that does not
    parse is a CorruptCheckpoint."""
    model_name, optim_name, _ = _names(step)
    # The file being parsed, for the errors.
    path = d / model_name
    # A file whose hash matches may still not be save()'s: written by hand, or by another tool.
    try:
        # To the CPU: a second copy on a GPU may not fit.
        tensors = safetensors.torch.load_file(path)
        path = d / optim_name
        optim_file = torch.load(path, map_location="cpu", weights_only=True)
        _set_rng(optim_file["rng"], scratch=True)
    # Hashed a moment ago, and deleted since.
    except FileNotFoundError:
        raise IncompleteCheckpoint(f"{where} is incomplete: {path.name} is missing") from None
    # Bytes that are not the format raise each library's own error.
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpoint(f"{where}: {path.name} matches its sha256 but is unreadable "
                                f"({str(e)[:200]})") from None
    return tensors, optim_file


def _config_diffs(module, saved):
    """How the model_config a checkpoint recorded differs from the model's own config."""
    live = getattr(module, "config", None)
    if saved is None or not dataclasses.is_dataclass(live):
        return []
    # A config field newer than the checkpoint counts as its default, so older checkpoints
    # still load.
    defaults = {}
    for field in dataclasses.fields(live):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
    # Both go through JSON, so that a tuple compares equal to JSON's list.
    live = json.loads(json.dumps(dataclasses.asdict(live), default=repr))
    saved = json.loads(json.dumps({**defaults, **saved}, default=repr))
    absent = "<absent>"
    diffs = []
    for k in sorted(saved | live):
        theirs = saved.get(k, absent)
        ours = live.get(k, absent)
        if theirs != ours:
            diffs.append(f"{k}: checkpoint {theirs!r}, model {ours!r}")
    return diffs


def _mismatches(module, meta, tensors):
    """(differences of config and keys, differences of shape) between checkpoint and model."""
    own = module.state_dict()
    diffs = _config_diffs(module, meta.get("model_config"))
    for k in sorted(own.keys() ^ tensors.keys()):
        if k in tensors:
            diffs.append(f"{k}: not in the model")
        else:
            diffs.append(f"{k}: not in the checkpoint")
    shapes = []
    for k in sorted(own.keys() & tensors.keys()):
        if tensors[k].shape != own[k].shape:
            shapes.append(f"shape of {k}: checkpoint {list(tensors[k].shape)}, model "
                          f"{list(own[k].shape)}")
    return diffs, shapes


def _set_full_optimizer_state(module, optimizer, state):
    """Load a numbered optimizer state into the optimizer of an FSDP2 model."""
    import torch.distributed.checkpoint.state_dict as dcp
    # The numbers name the live optimizer's parameters, in its order.
    names = {p: name for name, p in module.named_parameters()}
    order = [names[p] for group in optimizer.param_groups for p in group["params"]]
    named = _rekey(state, dict(enumerate(order)))
    dcp.set_optimizer_state_dict(module, optimizer, named, options=_full_options())


def _set_full_model_state(module, tensors):
    """Load full tensors into an FSDP2 model: every rank keeps its shards of them."""
    import torch.distributed.checkpoint.state_dict as dcp
    dcp.set_model_state_dict(module, tensors, options=_full_options())


def _load_optimizers(module, optimizer, saved, sharded, where):
    """Load the saved state of one optimizer or of a list of them."""
    if saved is None:
        raise CheckpointError(f"{where} was saved without optimizer state")
    optimizers = _as_list(optimizer)
    # A list of states was saved from a list of optimizers. One optimizer and a list of one
    # are the same here.
    if isinstance(saved, list):
        states = saved
    else:
        states = [saved]
    if len(states) != len(optimizers):
        raise CheckpointError(f"{where}: its optimizer state does not fit: it holds the state "
                              f"of {len(states)} optimizers, the run has {len(optimizers)}")
    try:
        for one, state in zip(optimizers, states):
            if sharded:
                _set_full_optimizer_state(module, one, state)
            else:
                one.load_state_dict(state)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: its optimizer state does not fit: {e}") from None


def load(dir, step, model, optimizer=None, strict=True, restore_rng=False):
    """Load step `step` of `dir` into `model` (and `optimizer`: one, a list, or None), verified
    and parsed before anything changes; return its meta. strict=False loads the keys both
    have; restore_rng=True also sets the RNGs."""
    d = Path(dir)
    module = _unwrap(model)
    meta = read_meta(d, step, verify=True)
    where = f"checkpoint step {step} in {d}"
    # Everything is read and checked before the model or the optimizer changes, so a bad
    # checkpoint leaves them as they were.
    tensors, optim_file = _read_step(d, step, where)
    # Config, keys and shapes must agree; with strict=False only the shapes, and the keys both
    # have are loaded.
    diffs, shapes = _mismatches(module, meta, tensors)
    if shapes or (diffs and strict):
        problems = "; ".join(diffs + shapes)
        raise ModelMismatch(f"{where} does not fit the model: {problems}")
    if diffs:
        warnings.warn(f"{where} is from another model, loading the keys both have: "
                      f"{'; '.join(diffs)}", stacklevel=2)
    sharded = _is_sharded(module)
    # The optimizer goes before the model, which then changes only if both fit.
    if optimizer is not None:
        _load_optimizers(module, optimizer, optim_file["optimizer"], sharded, where)
    if sharded:
        _set_full_model_state(module, tensors)
    else:
        # Copied in place to the model's device, so tied parameters stay tied.
        module.load_state_dict(tensors, strict=False)
    if restore_rng:
        _set_rng(optim_file["rng"])
    return meta


def newest(dir, load_step):
    """(step, load_step(step)) for the newest step of `dir` that loads, or (None, None). A
    corrupt step is passed over; a vanished one (retention deletes under readers) has the
    steps listed again."""
    failed = set()
    while True:
        steps = [s for s in list_steps(dir) if s not in failed]
        if not steps:
            return None, None
        step = steps[-1]
        try:
            return step, load_step(step)
        except CorruptCheckpoint as e:
            warnings.warn(f"{e}; trying an earlier step", stacklevel=3)
        except IncompleteCheckpoint:
            warnings.warn(f"checkpoint step {step} in {dir} was deleted as it was read (by "
                          "the retention of the run writing there, or moved aside)",
                          stacklevel=3)
        failed.add(step)


def load_latest(dir, model, optimizer=None, strict=True, restore_rng=False):
    """Load the newest step that verifies: (step, meta), or (None, None). A corrupt or vanished
    step falls back (see newest); one that does not fit the model is an error, as older ones
    would not fit either."""

    def load_step(step):
        return load(dir, step, model, optimizer, strict, restore_rng)

    return newest(dir, load_step)
