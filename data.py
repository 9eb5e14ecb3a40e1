"""Token sources and the batches a training step sees.

Sources: `open_tokens(path, split)` opens a path of any format of FORMAT_OPENERS, the one
list of them (FORMATS says it in words, for messages and help), as one token stream: its
files in order, through memory maps.

Windows and order: sample i of a stream is tokens [i*L, i*L + L + 1), inputs the first L,
targets the last L; a stream of T tokens has (T - 1) // L windows. Each epoch is a fresh
permutation of all windows, a pure function of (seed, source, epoch). Global sample g is
the g-th entry of that endless sequence. Optimizer step s consumes global samples
[s*G, (s+1)*G), and micro-step m on rank r takes the slice from
s*G + (m*world_size + r)*micro_batch. The whole loader state is therefore the count of
consumed samples (plus, when blending, how many of them came from each source).

The file helpers and the tokenizers live here too, so that every tool writes files and
reports errors alike. torch is imported only where tensors are made, so prepare.py
starts in a blink.
"""
import codecs
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import resource
import shutil
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class DataError(ValueError):
    """Bad input data: the message names the file, what was expected and what was found."""


class NoSplit(DataError):
    """The path holds no such split (open_blend then runs without validation data)."""


# -----------------------------------------------------------------------------
# manifest.json, the index prepare.py writes last

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "mamba3-lite-tokens"
MANIFEST_VERSION = 1


def _is_count(v):
    return type(v) is int and v >= 0


def _is_file_name(v):
    """A file name inside the manifest's directory: no path, not "." or ".."."""
    return isinstance(v, str) and "/" not in v and v.strip(".") != ""


def _is_tokenizer(v):
    """A tokenizer spec: an object, which names its file when it is a tokenizer file."""
    if not isinstance(v, dict):
        return False
    return v.get("name") != "file" or _is_file_name(v.get("file"))


# The manifest holds {"format", "version", MANIFEST_FIELDS, "stats"}, its "splits" are
# {name: SPLIT_FIELDS}, and each split's "shards" a list of SHARD_FIELDS. Each field is
# (what it must hold, in words; its test), so that a hand-edited manifest is one message
# naming the field, never a TypeError deep in a reader.
COUNT = ("a whole number >= 0", _is_count)
MANIFEST_FIELDS = {
    "dtype": ('"uint16" or "uint32"', lambda v: v in ("uint16", "uint32")),
    "vocab_size": ("a whole number >= 1", lambda v: type(v) is int and v >= 1),
    "eos_id": COUNT,
    "tokenizer": ('an object, naming its "file" if its "name" is "file"', _is_tokenizer),
    "splits": ("an object", lambda v: isinstance(v, dict)),
}
SPLIT_FIELDS = {
    "tokens": COUNT,
    "documents": COUNT,
    "max_token_id": COUNT,
    "shards": ("a list", lambda v: type(v) is list),
}
SHARD_FIELDS = {
    "file": ("a file name", _is_file_name),
    "tokens": COUNT,
    "documents": COUNT,
    "max_token_id": COUNT,
    "sha256": ("a string", lambda v: type(v) is str),
}
# Fields a manifest may lack, checked when present: "bytes" counts the UTF-8 bytes of the
# documents' text (an EOS adds none), for bits per byte. Manifests written before it have
# none, and stay valid.
OPTIONAL_FIELDS = {"bytes": COUNT}

# A split's totals, and how each is made of its shards' values.
_TOTALS = {"tokens": sum, "documents": sum, "max_token_id": max}


def split_totals(shards) -> dict:
    """A split's tokens, documents and max_token_id from its shards' entries, and its bytes
    when every shard counts them.

    Readers trust them: prepare.py writes them, and read_manifest checks them."""
    totals = {}
    for key, total in _TOTALS.items():
        totals[key] = total([0] + [shard[key] for shard in shards])
    if all("bytes" in shard for shard in shards):
        totals["bytes"] = sum(shard["bytes"] for shard in shards)
    return totals


def shard_problem(f, shard, dtype):
    """What is wrong with shard file `f` (manifest entry `shard`) before it is read.

    None when nothing is."""
    if not f.is_file():
        return f"{f}: listed in {MANIFEST} but missing"
    size = f.stat().st_size
    want = shard["tokens"] * np.dtype(dtype).itemsize
    if size != want:
        return f"{f}: expected {want} bytes ({shard['tokens']} {dtype} tokens), found {size}"
    return None


# -----------------------------------------------------------------------------
# files that survive a kill, and the one error paragraph of every command-line tool


def fsync(path):
    """Make a file's data, or a directory's renames, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_atomic(path, data: bytes):
    """Write `path` whole or not at all.

    A temporary beside it is written and fsynced, renamed over it, and the directory
    fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        # A full disk must leave no empty temporary behind.
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)


def replace_dir(out, fill, ours):
    """Put the directory fill(stage) builds in place of `out`, so that a kill at any
    instant loses neither.

    `out` moves to `.NAME.old`, `.NAME.stage` takes its place, what ours(old) does not
    claim (a user's files) moves into the new one, and the old one goes. The holder of
    `.NAME.lock` (a flock, released however its holder ends) knows that a stage or old
    directory it finds is a dead run's."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.stage"
    old = out.parent / f".{out.name}.old"

    def settle():
        # A stage goes. An old directory goes back when `out` is gone, else it retires.
        shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        elif old.exists():
            # What it holds that is not the tool's own moves over first.
            mine = ours(old)
            for p in sorted(old.iterdir()):
                if p.name not in mine and not (out / p.name).exists():
                    os.rename(p, out / p.name)
                    warnings.warn(f"kept {p.name}, which is not the tool's own, in {out}",
                                  stacklevel=3)
            shutil.rmtree(old)
            fsync(out.parent)

    with open(out.parent / f".{out.name}.lock", "a") as lock:
        # The lock is taken without waiting: a second writer is told at once, not queued.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            message = f"{out} is being written by another process; wait for it"
            raise DataError(message) from None
        # Clean up after a run that died.
        settle()
        try:
            stage.mkdir()
            result = fill(stage)
            # The new directory is durable before it takes the old one's place.
            fsync(stage)
            # Each rename is atomic; a kill between the two leaves `old` for settle().
            if out.exists():
                os.rename(out, old)
            os.rename(stage, out)
            fsync(out.parent)
        finally:
            # After a failure too: `out` is the old directory or the new one.
            settle()
    return result


def _one_line_warning(message, *args, **kwargs):
    return f"warning: {message}\n"


def refuse_empty_path(option, value, what="a path"):
    """Refuse an empty string given for a path option or argument, naming the option.

    Path("") is ".", the working directory: an unset variable in a shell ("$OUT") names
    it by accident, and an output written there would replace it. The command lines take
    their paths as the strings typed (Typer's path_type=str) so that this check sees them.
    """
    if value == "":
        raise DataError(f"{option}: expected {what}, found an empty string")


@contextlib.contextmanager
def cli_errors(*expected):
    """The body of a command-line tool.

    An `expected` exception becomes one red paragraph on stderr (rank 0's only) and exit
    status 2, Ctrl-C exit 130. Warnings print as one line."""
    import typer
    from rich.console import Console
    from rich.markup import escape
    warnings.formatwarning = _one_line_warning
    try:
        yield
    except expected as e:
        # Under torchrun every rank fails alike: rank 0 alone prints the paragraph.
        quiet = os.environ.get("RANK", "0") != "0"
        err = Console(stderr=True, highlight=False, quiet=quiet)
        err.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# -----------------------------------------------------------------------------
# tokenizers: each has encode(str) -> list[int], encode_array(str) -> np.ndarray,
# decode(ids), eos_id, vocab_size and spec (JSON-serialisable: load_tokenizer(spec)
# rebuilds the same one)

# The end-of-document tokens looked for in a tokenizer file, in order.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class ByteTokenizer:
    """The 256 byte values of UTF-8 text, plus EOS = 256.

    It needs nothing, and trains fastest on a CPU."""
    spec = {"name": "byte"}
    vocab_size = 257
    eos_id = 256

    def encode(self, text):
        return list(text.encode("utf-8", "replace"))

    def encode_array(self, text):
        return np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8)

    def decode(self, ids):
        # An id past 256 is a ValueError of bytes().
        raw = b"".join(b"<|endoftext|>" if i == 256 else bytes((i,)) for i in ids)
        return raw.decode("utf-8", "replace")


class BPETokenizer:
    """GPT-2's BPE (a tiktoken Encoding) or a tokenizer.json (a tokenizers.Tokenizer), as
    load_tokenizer builds them; "<|endoftext|>" in a text is text. Workers need it
    picklable, and it is."""

    def __init__(self, spec, bpe, eos_id, vocab_size):
        self.spec = spec
        self._bpe = bpe
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self._file = spec["name"] == "file"
        # A special token spelled in a text is text.
        if self._file:
            bpe.encode_special_tokens = True

    def __reduce__(self):
        # A pickled tokenizers.Tokenizer forgets encode_special_tokens: __init__ sets it.
        return BPETokenizer, (self.spec, self._bpe, self.eos_id, self.vocab_size)

    def encode(self, text):
        # Text only: tiktoken's encode_ordinary reads no special token; a tokenizer file
        # adds none (add_special_tokens=False) and reads none (encode_special_tokens).
        if self._file:
            return self._bpe.encode(text, add_special_tokens=False).ids
        return self._bpe.encode_ordinary(text)

    def encode_array(self, text):
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids):
        if self._file:
            return self._bpe.decode(list(ids), skip_special_tokens=False)
        return self._bpe.decode(list(ids))


def _load_gpt2():
    # Imported here, where it is used: --help and refusals need not wait for it.
    import tiktoken
    try:
        enc = tiktoken.get_encoding("r50k_base")
    except Exception as e:
        # A download failure surfaces as one of many network error types.
        raise DataError(
            f"could not load the GPT-2 BPE file (tiktoken r50k_base): {e!r}; tiktoken fetches "
            "it on first use: offline, set TIKTOKEN_CACHE_DIR to a directory holding it as "
            "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4, or use --tokenizer byte") from None
    return BPETokenizer({"name": "gpt2"}, enc, enc.eot_token, enc.n_vocab)


def _load_tokenizer_file(spec, path):
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file missing (the tokenizer spec {spec} names it)")
    if spec.get("sha256") and sha256(path) != spec["sha256"]:
        raise DataError(f"{path}: expected sha256 {spec['sha256']} (per the tokenizer spec), "
                        "found another file")
    # Imported here, where it is used: --help and refusals need not wait for it.
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"{path}: expected a Hugging Face tokenizer.json file, found one it "
                        f"cannot load ({e})") from None
    if spec.get("eos_token"):
        names = [spec["eos_token"]]
    else:
        names = EOS_TOKENS
    found = [name for name in names if tok.token_to_id(name) is not None]
    if not found:
        raise DataError(f"{path}: expected an end-of-document token ({', '.join(names)}), "
                        "found none; name the one it has with --eos-token")
    eos = found[0]
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    return BPETokenizer({**spec, "eos_token": eos}, tok, tok.token_to_id(eos), vocab_size)


def load_tokenizer(spec: dict, directory=None, path=None):
    """Rebuild a tokenizer from its spec: {"name": "byte"}, {"name": "gpt2"}, or
    {"name": "file", "file": "tokenizer.json", "sha256": ..., "eos_token": ...} with
    the file in `directory` (or at `path`); its EOS: spec["eos_token"], else the first
    of EOS_TOKENS the file has."""
    # A manifest's tokenizer is an object: read_manifest checks it.
    name = spec.get("name")
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return _load_gpt2()
    if name != "file":
        raise DataError(f"expected a tokenizer spec named byte, gpt2 or file, found {spec!r}")
    if not path:
        path = Path(directory or ".") / spec["file"]
    return _load_tokenizer_file(spec, Path(path))


# -----------------------------------------------------------------------------
# token sources


def _allow_open_files(n):
    """Raise the soft limit on open files to hold n memory maps, or refuse.

    Each memory map holds a file descriptor: thousands of shards pass the usual 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = n + 256
    # A limit of -1 is no limit.
    if 0 <= hard < need:
        raise DataError(f"{n} token files need {need} open files, but the limit is {hard}; "
                        "raise `ulimit -n`")
    if 0 <= soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _check_token_bytes(f, dtype, offset):
    """Refuse a file that is not an `offset`-byte header and then whole tokens."""
    size = f.stat().st_size
    if size < offset:
        raise DataError(f"{f}: expected a {offset}-byte header at least, found {size} bytes")
    body = size - offset
    if body % dtype.itemsize == 0:
        return
    found = f"{body} bytes"
    if offset:
        found += f" after its {offset}-byte header"
    raise DataError(f"{f}: expected a whole number of {dtype.name} tokens "
                    f"({dtype.itemsize} bytes each), found {found}; wrong --data-dtype, or a "
                    "truncated file?")


class TokenSource:
    """A token stream of memory-mapped files.

    files: the files that hold tokens, in order; tokens[k]: files[k]'s tokens,
    read-only, which start at stream position starts[k]. Each file's tokens begin
    `offset` bytes in, after a header of its format. vocab_size, eos_id and tokenizer
    come from `manifest`, else None."""

    def __init__(self, path, files, dtype, max_token_id=None, manifest=None, offset=0):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.offset = offset
        manifest = manifest or {}
        self.vocab_size = manifest.get("vocab_size")
        self.eos_id = manifest.get("eos_id")
        self.tokenizer = manifest.get("tokenizer")
        # The UTF-8 bytes of the text these tokens hold, when a manifest counts them (its
        # opener sets it): bits per byte need it.
        self.text_bytes = None
        files = [Path(f) for f in files]
        _allow_open_files(len(files))
        for f in files:
            _check_token_bytes(f, self.dtype, offset)
        # A file with no tokens adds nothing to the stream, and np.memmap refuses one.
        self.files = [f for f in files if f.stat().st_size > offset]
        # Plain ndarray views: slicing one is several times cheaper than slicing a memmap.
        self.tokens = []
        for f in self.files:
            tokens = np.memmap(f, self.dtype, "r", offset=offset)
            self.tokens.append(tokens.view(np.ndarray))
        lengths = [len(t) for t in self.tokens]
        self.starts = np.cumsum([0] + lengths, dtype=np.int64)
        # With 0 tokens, Batches refuses the source and train.py evaluates on none.
        self.num_tokens = int(self.starts[-1])
        # A recorded max_token_id is trusted, so that a run starts at once.
        self.recorded = max_token_id is not None
        self._range = None
        if self.recorded:
            self._range = (0, max_token_id)
        # check_vocab sets the vocabulary, and the files to check at their first read.
        self.unchecked = set()
        self._vocab = None
        # windows() keeps its sliding-window view of a single file here, one per seq_len.
        self._rows = {}
        # A manifest's shard hashes, by file name.
        self._sha256 = {}
        for split in manifest.get("splits", {}).values():
            for shard in split["shards"]:
                self._sha256[shard["file"]] = shard["sha256"]

    def id_range(self) -> tuple:
        """(smallest, largest) token id: the recorded range, else a scan of the files."""
        if self._range is None:
            lo = min((t.min() for t in self.tokens), default=0)
            hi = max((t.max() for t in self.tokens), default=0)
            self._range = (int(lo), int(hi))
        return self._range

    def digest(self) -> str:
        """Of the files: their names and sha256 (a manifest's), else names and sizes."""
        files = []
        for f in self.files:
            files.append((f.name, self._sha256.get(f.name) or f.stat().st_size))
        return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]

    def check_vocab(self, vocab_size: int):
        """Refuse token ids outside [0, vocab_size).

        A raw source is scanned now. A recorded range is checked now, and each file
        again at its first read: a shard edited after prepare.py keeps its size, and a
        bad id must never be an index error deep in a step."""
        lo, hi = self.id_range()
        if lo < 0 or hi >= vocab_size:
            theirs = ""
            if self.vocab_size:
                theirs = f" (its tokenizer has {self.vocab_size} ids)"
            bad = hi if hi >= vocab_size else lo
            raise DataError(f"{self.path}: expected token ids in [0, {vocab_size}) for a model "
                            f"with vocab_size {vocab_size}, found {bad}{theirs}; use a larger "
                            "vocabulary or data made with its tokenizer")
        self._vocab = vocab_size
        self.unchecked = set()
        if self.recorded:
            self.unchecked = set(range(len(self.files)))

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n): a view when they lie in one file, else a copy."""
        if start < 0 or n < 0 or start + n > self.num_tokens:
            raise IndexError(f"read({start}, {n}) outside {self.path} "
                             f"({self.num_tokens} tokens)")
        # The files a .. b - 1 hold the tokens.
        a = self.starts.searchsorted(start, "right") - 1
        b = self.starts.searchsorted(start + n)
        pieces = []
        for tokens, s in zip(self.tokens[a:b], self.starts[a:b].tolist()):
            pieces.append(tokens[max(start - s, 0) : start + n - s])
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate([np.empty(0, self.dtype)] + pieces)

    def windows(self, ids, seq_len: int, out=None) -> np.ndarray:
        """Windows `ids` (see the module doc), (len(ids), seq_len + 1), in the source
        dtype or written into `out` (C-contiguous, any dtype: Batches's int64 is
        converted as it copies)."""
        ids = np.asarray(ids)
        n = seq_len + 1
        if self.unchecked:
            self._check(ids, seq_len)
        if out is None:
            out = np.empty((len(ids), n), self.dtype)
        if len(self.tokens) == 1:
            # The windows are overlapping rows of the one file: one gather. The view takes
            # 30 us to make, so it is made once per seq_len.
            if seq_len not in self._rows:
                self._rows[seq_len] = sliding_window_view(self.tokens[0], n)[::seq_len]
            out[...] = self._rows[seq_len][ids]
            return out
        # int64, since uint32 ids would wrap past 2**32 tokens.
        begin = ids.astype(np.int64) * seq_len
        # The file each window starts in.
        first = self.starts.searchsorted(begin, "right") - 1
        # One concatenate of all the windows' pieces, not a Python setitem each.
        pieces = []
        for lo, k in zip((begin - self.starts[first]).tolist(), first.tolist()):
            have = 0
            # At a file's end the window runs on into the next file(s).
            while have < n:
                piece = self.tokens[k][lo : lo + n - have]
                pieces.append(piece)
                have += len(piece)
                k += 1
                lo = 0
        np.concatenate(pieces, out=out.reshape(-1))
        return out

    def _check(self, ids, seq_len):
        """check_vocab's first-read check of the files that windows `ids` touch."""
        begin = ids.astype(np.int64) * seq_len
        first, last = self.starts.searchsorted([begin, begin + seq_len], "right")
        touched = set()
        for a, b in zip((first - 1).tolist(), last.tolist()):
            touched.update(range(a, b))
        V = self._vocab
        for k in sorted(self.unchecked & touched):
            tokens = self.tokens[k]
            # No id is below 0: only a manifest's uint16 and uint32 files wait here.
            if tokens.max() >= V:
                i = int(np.flatnonzero(tokens >= V)[0])
                raise DataError(f"{self.files[k]}: token id {tokens[i]} at token offset {i} is "
                                f"outside [0, {V}), though the manifest says otherwise: changed "
                                "since prepare.py wrote it? `python prepare.py verify "
                                f"{self.path}` checks every shard")
            self.unchecked.discard(k)


# check_vocab(source, vocab_size), as train.py calls it.
check_vocab = TokenSource.check_vocab


# -----------------------------------------------------------------------------
# the formats: each opener takes (path, split, dtype: the one given, else uint16) and
# returns a TokenSource, or None when the path is not of its format


def _check_fields(path, obj, fields, where):
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected {where.rstrip('.')} to be an object, found "
                        f"{json.dumps(obj)[:60]}")
    # An optional field is checked only where it is.
    present = {}
    for key, rule in OPTIONAL_FIELDS.items():
        if key in obj:
            present[key] = rule
    # The first field that fails its test is the one the message names.
    for key, (what, ok) in {**fields, **present}.items():
        if key in obj and ok(obj[key]):
            continue
        found = "no such field"
        if key in obj:
            found = json.dumps(obj[key])[:60]
        raise DataError(f"{path}: expected {where}{key} to be {what}, found {found}; "
                        "prepare.py writes manifests whole: was this one edited by hand?")


def read_manifest(directory) -> dict:
    """Read `directory/manifest.json`, every field checked (see MANIFEST_FIELDS)."""
    path = Path(directory) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        found = e
        if isinstance(e, FileNotFoundError):
            found = "none"
        raise DataError(f"{path}: expected a JSON manifest (prepare.py writes it last), found "
                        f"{found}") from None
    # Another tool's manifest, or a newer prepare.py's, is refused before its fields.
    for key, want in (("format", MANIFEST_FORMAT), ("version", MANIFEST_VERSION)):
        if isinstance(m, dict):
            found = m.get(key)
        else:
            found = type(m).__name__
        if found != want:
            message = f"{path}: expected {key} {want!r}, found {found!r}"
            if key == "version":
                message += "; a newer prepare.py?"
            raise DataError(message)
    _check_fields(path, m, MANIFEST_FIELDS, "")
    for name, split in m["splits"].items():
        _check_fields(path, split, SPLIT_FIELDS, f"splits.{name}.")
        for i, shard in enumerate(split["shards"]):
            _check_fields(path, shard, SHARD_FIELDS, f"splits.{name}.shards[{i}].")
        totals = split_totals(split["shards"])
        # A split that counts its bytes needs them of every shard, to check the sum.
        if "bytes" in split and "bytes" not in totals:
            raise DataError(f"{path}: split {name!r} has bytes {split['bytes']}, but not "
                            "every shard of it counts its bytes; prepare.py writes both or "
                            "neither: was this manifest edited by hand?")
        # max_token_id is checked against the files by check_vocab. A split without bytes
        # (an older manifest) is not checked for them.
        for key, found in totals.items():
            if split.get(key, found) != found:
                raise DataError(f"{path}: split {name!r} has {key} {split[key]}, "
                                f"shards {found}")
    return m


def _prepared(p, split, dtype):
    if not (p / MANIFEST).is_file():
        return None
    m = read_manifest(p)
    s = m["splits"].get(split)
    # A split without tokens (--val-fraction 0) is no split: no validation then.
    if s is None or s["tokens"] == 0:
        have = [k for k, v in m["splits"].items() if v["tokens"] > 0]
        raise NoSplit(f"{p}: expected a {split!r} split, found only {have} (prepared with "
                      "--val-fraction 0?)")
    files = [p / shard["file"] for shard in s["shards"]]
    # The sizes the manifest promises are checked before mapping.
    for f, shard in zip(files, s["shards"]):
        problem = shard_problem(f, shard, m["dtype"])
        if problem:
            raise DataError(f"{problem}; run `python prepare.py verify {p}`")
    # One stream of the split's shards in the manifest's order, its max id trusted.
    source = TokenSource(p, files, m["dtype"], s["max_token_id"], m)
    source.text_bytes = s.get("bytes")
    return source


def _natural_key(f):
    """Sorts shard_2 before shard_10: the digits in a name compare as numbers."""
    parts = re.split(r"(\d+)", f.name)
    return [int(part) if part.isdigit() else part for part in parts]


def _shard_dir(p, split, dtype):
    if not p.is_dir():
        return None
    shards = sorted(p.glob("shard_*.bin"), key=_natural_key)
    if not shards:
        return None
    return TokenSource(p, shards, dtype)


def _listing(p):
    """The names in directory p, the first 8 of them, for a message."""
    names = sorted(x.name for x in p.iterdir())
    if not names:
        return "no files"
    listing = ", ".join(names[:8])
    if len(names) > 8:
        listing += f" and {len(names) - 8} more"
    return listing


def _nanogpt_dir(p, split, dtype):
    if not p.is_dir():
        return None
    if not (p / "train.bin").exists() and not (p / "val.bin").exists():
        return None
    f = p / f"{split}.bin"
    if not f.exists():
        raise NoSplit(f"{p}: expected {split}.bin in this nanoGPT data directory, found "
                      f"{_listing(p)}")
    return TokenSource(f, [f], dtype)


MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# The token type of each dtype code of the header.
MEGATRON_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    8: np.uint16,
}
# magic, version, dtype code, sequences S, D = documents + 1
MEGATRON_HEADER = struct.Struct("<9sQBQQ")


def _megatron(p, split, dtype):
    """A Megatron-LM indexed dataset, PREFIX.idx and PREFIX.bin.

    PREFIX.idx holds the header, int32 lengths[S], int64 byte pointers[S] and int64
    document starts[D]: 34 + 12 S + 8 D bytes in all. PREFIX.bin holds the sequences'
    tokens, back to back."""
    prefix = p
    if p.suffix in (".bin", ".idx"):
        prefix = p.with_suffix("")
    idx = Path(f"{prefix}.idx")
    binf = Path(f"{prefix}.bin")
    if not idx.exists():
        return None
    size = idx.stat().st_size
    o = MEGATRON_HEADER.size
    if size < o:
        raise DataError(f"{idx}: expected a {o}-byte header at least, found {size} bytes")
    # The index can be large: map it, do not copy it.
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    magic, version, code, S, D = MEGATRON_HEADER.unpack_from(raw)
    # The header is checked whole before any array is read past it.
    want_size = o + 12 * S + 8 * D
    checks = [
        (magic == MEGATRON_MAGIC, f"the magic {MEGATRON_MAGIC!r} of a Megatron index", magic),
        (version == 1, "version 1", version),
        (code in MEGATRON_DTYPES, f"a dtype code in {sorted(MEGATRON_DTYPES)}", code),
        (size == want_size,
         f"{want_size} bytes for {S} sequences and {D} document boundaries", size),
    ]
    for ok, want, found in checks:
        if not ok:
            raise DataError(f"{idx}: expected {want}, found {found}")
    # The tokens are little-endian, whatever this machine's byte order.
    token = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
    # (S,) tokens per sequence
    lengths = np.frombuffer(raw, "<i4", S, o).astype(np.int64)
    # (S,) byte offset of each sequence
    pointers = np.frombuffer(raw, "<i8", S, o + 4 * S)
    # (D,) first sequence of each document, then S
    docs = np.frombuffer(raw, "<i8", D, o + 12 * S)
    # The sequences lie back to back.
    expect = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * token.itemsize
    bad = (pointers != expect) | (lengths < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{idx}: expected increasing pointers, each sequence right after the "
                        f"one before: sequence {i} at byte {expect[i]}, found {pointers[i]}")
    if D < 1 or docs[0] != 0 or docs[-1] != S or (np.diff(docs) < 0).any():
        raise DataError(f"{idx}: expected document boundaries rising from 0 to {S} (the "
                        f"sequence count), found {docs[:3].tolist()}...{docs[-3:].tolist()}")
    have = binf.stat().st_size
    want = int(lengths.sum()) * token.itemsize
    if have != want:
        cut = "truncated" if have < want else "too long"
        raise DataError(f"{binf}: expected {want} bytes ({lengths.sum()} {token.name} tokens "
                        f"per {idx.name}), found {have}: {cut}")
    return TokenSource(prefix, [binf], token)


# A file with one of these suffixes holds text, whatever its bytes look like.
TEXT_SUFFIXES = (
    ".txt", ".md", ".py", ".json", ".jsonl", ".gz", ".parquet", ".csv", ".tsv", ".html",
)


def _reads_as_text(p) -> bool:
    """Whether the first 64 KiB of file p are printable UTF-8 text.

    Token ids almost never are: small ids hold zero bytes, large ones bytes that are
    not UTF-8."""
    head = np.fromfile(p, np.uint8, 1 << 16).tobytes()
    # The incremental decoder allows a character cut at the end of the head.
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return False
    if not text:
        return False
    return all(c.isprintable() or c in "\t\n\r\f" for c in text)


def _raw_file(p, split, dtype):
    if not p.is_file():
        return None
    # Trained on as token ids, text would be garbage without a word of warning.
    found = None
    if p.suffix.lower() in TEXT_SUFFIXES:
        found = f"a {p.suffix} file"
    elif _reads_as_text(p):
        found = "UTF-8 text"
    if found:
        raise DataError(f"{p}: expected a file of token ids, found {found}, which holds text: "
                        f"`python prepare.py {p} --out-dir DIR` makes it --data DIR")
    return TokenSource(p, [p], dtype)


class Format(NamedTuple):
    """A format open_tokens reads: what it is, in words; its opener; whether it has
    splits (if not, it is one token stream: the train split)."""
    what: str
    opener: Callable
    splits: bool


# The formats, tried in this order. A new format is its opener and one line here; messages
# and help list the formats through FORMATS. A format whose files begin with a header maps
# them from an offset: TokenSource(path, files, dtype, offset=HEADER_BYTES).
FORMAT_OPENERS = [
    Format("a prepare.py directory (manifest.json)", _prepared, True),
    Format("a directory of shard_*.bin files", _shard_dir, False),
    Format("a nanoGPT data directory (train.bin, val.bin)", _nanogpt_dir, True),
    Format("a Megatron prefix (PREFIX.bin + PREFIX.idx)", _megatron, False),
    Format("a raw token file such as nanoGPT's train.bin", _raw_file, False),
]


def _one_of(alternatives):
    """"a, b, or c": alternatives as a sentence lists them."""
    return ", ".join(alternatives[:-1]) + ", or " + alternatives[-1]


# The formats in words: "a prepare.py directory (manifest.json), ..., or a raw ...".
FORMATS = _one_of([fmt.what for fmt in FORMAT_OPENERS])


def open_tokens(path, split: str = "train", dtype=None) -> TokenSource:
    """Split `split` (train or val) of a path of any of the FORMATS.

    `dtype` is the token type of formats that record none."""
    p = Path(path)
    # A dtype given is read little-endian, as every format writes its tokens.
    want = None
    if dtype is not None:
        want = np.dtype(dtype).newbyteorder("<")
    read_as = want
    if read_as is None:
        read_as = np.uint16
    # The first format whose opener takes the path wins, so the order matters: a raw
    # token file is the last resort.
    for fmt in FORMAT_OPENERS:
        source = fmt.opener(p, split, read_as)
        if source is None:
            continue
        if not fmt.splits and split != "train":
            raise NoSplit(f"{p}: asked for the {split!r} split, but {fmt.what} holds one token "
                          "stream (the train split); give the validation data as a separate "
                          "path")
        # A format that records its dtype must agree with the one given.
        if want is not None and source.dtype != want:
            raise DataError(f"{p}: records dtype {source.dtype.name}, not the {want.name} "
                            "given")
        return source
    # No format took the path: say what it holds, and what would have been read.
    if p.is_dir() and any(p.glob("train_*.bin")):
        raise DataError(f"{p}: has train_*.bin shards but no {MANIFEST}, the file prepare.py "
                        "writes last: an interrupted prepare.py run? Run prepare.py again")
    if p.is_dir():
        raise DataError(f"{p}: expected {FORMATS}; found {_listing(p)}")
    raise DataError(f"{p}: no such file or directory; expected {FORMATS}")


def _path_and_weight(spec):
    """(path, weight) of one --data value: a path, or PATH:WEIGHT."""
    head, sep, tail = spec.rpartition(":")
    # A path may hold a colon of its own.
    if not sep or Path(spec).exists():
        return spec, 1.0
    if not tail.replace(".", "", 1).isdigit():
        raise DataError(f"--data {spec!r}: expected a path, or PATH:WEIGHT with WEIGHT a "
                        f"positive number, found the weight {tail!r} (and no such path)")
    if float(tail) == 0:
        raise DataError(f"--data {spec!r}: expected PATH:WEIGHT with a positive WEIGHT, found "
                        "0: a source weighted 0 would never be read; leave it out")
    return head, float(tail)


def _synthetic(vocab, seed, tmpdir):
    """A file of 4M random token ids below vocab, opened as a source."""
    path = Path(tmpdir) / "synthetic.bin"
    rng = np.random.default_rng(seed)
    rng.integers(0, vocab, 1 << 22).astype(np.uint32).tofile(path)
    return open_tokens(path, dtype=np.uint32)


def open_blend(specs, dtype=None, vocab_size=None, seed=0, tmpdir=None):
    """train.py's --data: paths, or PATH:WEIGHT to blend several, or ["synthetic"] (random
    tokens in a file under tmpdir).

    Returns (train sources, weights or None, the first path's val source or None,
    vocab_size): vocab_size is by default the first source's, else GPT-2's, and each
    source is checked against it."""
    if list(specs) == ["synthetic"]:
        vocab = vocab_size or 50257
        return [_synthetic(vocab, seed, tmpdir)], None, None, vocab
    paths = []
    weights = []
    for spec in specs:
        path, weight = _path_and_weight(spec)
        paths.append(path)
        weights.append(weight)
    sources = [open_tokens(path, "train", dtype) for path in paths]
    # Raw token files record no tokenizer: only manifests can be compared.
    first = sources[0].tokenizer
    for path, source in zip(paths[1:], sources[1:]):
        if first and source.tokenizer and source.tokenizer != first:
            raise DataError(f"--data {path}: made with the tokenizer {source.tokenizer}, "
                            f"{paths[0]} with {first}: blend data made with one tokenizer")
    # The validation data is the first path's val split, when it has one.
    val = None
    with contextlib.suppress(NoSplit):
        val = open_tokens(paths[0], "val", dtype)
    # Every source is checked against the model's vocabulary now, not at a bad batch.
    vocab = vocab_size or sources[0].vocab_size or 50257
    for source in sources:
        check_vocab(source, vocab)
    if val is not None:
        check_vocab(val, vocab)
    if len(paths) == 1:
        weights = None
    return sources, weights, val, vocab


# -----------------------------------------------------------------------------
# batches: epochs, global samples, ranks, blending, state; validation


@dataclasses.dataclass
class BatchConfig:
    """seq_len, global_batch and seed define the sample sequence; micro_batch, rank and
    world_size only which part this process takes (a resume may change them).

    global_batch is the sequences of a step on all ranks, a multiple of
    micro_batch * world_size; by default one micro-batch per rank."""
    seq_len: int
    micro_batch: int
    global_batch: int | None = None
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    # Build the next micro-batch in a thread while the caller trains.
    prefetch: bool = False


def _blend(consumed, counts, shares, lo, B, n):
    """Source and per-source index of samples [lo, lo + B) of the n-sample micro-step at
    global sample `consumed`, and the counts after.

    Earliest deadline first among the sources not ahead of their share keeps every
    prefix within a sample of its shares; "largest deficit first" does not
    (tests/test_data.py). With weight a[k] / D, source k is eligible for sample g when
    c[k] < (g + 1) a[k] / D, and its deadline is (c[k] + 1) / a[k]. The comparisons are cross-multiplied integers: Fractions cost
    8 times as much."""
    a, D = shares
    c = list(counts)
    # (source, its index) of each sample
    picks = []
    # The samples of all ranks are assigned, so that the counts after are every rank's.
    for g in range(consumed, consumed + n):
        best = -1
        for k in range(len(c)):
            eligible = c[k] * D < (g + 1) * a[k]
            if eligible and (best < 0 or (c[k] + 1) * a[best] < (c[best] + 1) * a[k]):
                best = k
        picks.append((best, c[best]))
        c[best] += 1
    src, idx = np.array(picks[lo : lo + B]).T
    return src, idx, tuple(c)


# What defines the sample sequence: a resume must keep it.
SEQUENCE_KEYS = ("global_batch", "seq_len", "seed", "weights")


class Batches:
    """This rank's endless micro-batches (see the module doc): (x, y) int64
    (micro_batch, seq_len) views of one buffer, of `sources` blended by `weights`. A
    resume (load_state_dict) may change world_size and micro_batch (elastic), never
    global_batch, seq_len, seed or the blend."""

    def __init__(self, sources, cfg: BatchConfig, weights=None):
        if isinstance(sources, TokenSource):
            self.sources = [sources]
        else:
            self.sources = list(sources)
        B = cfg.micro_batch
        L = cfg.seq_len
        world = cfg.world_size
        G = cfg.global_batch or B * world
        cfg = dataclasses.replace(cfg, global_batch=G)
        self.cfg = cfg
        # A step's sequences are split evenly over the ranks and their micro-steps.
        if G % (B * world):
            good = max(1, round(G / (B * world))) * B * world
            raise DataError(f"global batch {G} sequences (--total-batch-size {G * L} / --seq-len "
                            f"{L}) is not a multiple of micro_batch {B} (--batch-size) x "
                            f"world_size {world} = {B * world}; pick sizes where it is, for "
                            f"example --total-batch-size {good * L} ({good} sequences)")
        self.accum_steps = G // (B * world)
        # Every source must hold one window at least.
        short = [s for s in self.sources if s.num_tokens <= L]
        if short:
            raise DataError(f"{short[0].path}: expected at least seq_len + 1 = {L + 1} tokens, "
                            f"found {short[0].num_tokens}")
        # Weights as exact fractions: "0.7" is 7/10.
        if weights:
            ws = [Fraction(str(w)) for w in weights]
        else:
            ws = [Fraction(1)] * len(self.sources)
        if len(ws) != len(self.sources) or min(ws) <= 0:
            raise DataError(f"blend weights: expected {len(self.sources)} positive weights, one "
                            f"per source (train.py: --data PATH:WEIGHT), found {weights}")
        self.weights = [w / sum(ws) for w in ws]
        # Weight k is exactly a[k] / D.
        D = math.lcm(*[w.denominator for w in self.weights])
        a = [int(w * D) for w in self.weights]
        self._shares = (a, D)
        # The state: all ranks' samples taken, in all and from each source.
        self._consumed = 0
        self._counts = (0,) * len(self.sources)
        # Per source: (epoch, its window order), the last one made.
        self._orders = [(None, None)] * len(self.sources)
        self._pool = None
        if cfg.prefetch:
            self._pool = ThreadPoolExecutor(1)
        self._ahead = None

    def __iter__(self):
        return self

    def __next__(self):
        # A prefetched build is taken once: after an error, the next call starts afresh.
        ahead = self._ahead
        self._ahead = None
        if ahead is not None:
            x, y, consumed, counts = ahead.result()
        else:
            x, y, consumed, counts = self._build(self._consumed, self._counts)
        # A build returns the state after it: what the caller has now taken.
        self._consumed = consumed
        self._counts = counts
        # The next build runs while the caller trains on this one.
        if self._pool is not None:
            self._ahead = self._pool.submit(self._build, consumed, counts)
        return x, y

    def state_dict(self) -> dict:
        """The position, then what defines the sample sequence (SEQUENCE_KEYS)."""
        c = self.cfg
        return {
            "consumed": self._consumed,
            "source_consumed": list(self._counts),
            "global_batch": int(c.global_batch),
            "seq_len": int(c.seq_len),
            "seed": int(c.seed),
            "weights": [str(w) for w in self.weights],
        }

    def load_state_dict(self, state: dict):
        mine = self.state_dict()
        for key in SEQUENCE_KEYS:
            if state.get(key) != mine[key]:
                raise DataError(f"loader state: saved with {key} = {state.get(key)}, but this "
                                f"run has {key} = {mine[key]}: a resume must keep it, or start "
                                "a fresh run")
        # A build under way was made from the old state: it is dropped.
        self.close()
        # train.py saves between steps, so the count is of whole batches.
        self._consumed = int(state["consumed"])
        self._counts = tuple(int(c) for c in state["source_consumed"])

    def close(self):
        """Stop the prefetch thread, if one runs; the next batch starts it again."""
        if self._pool is not None:
            # This waits for a build under way.
            self._pool.shutdown(cancel_futures=True)
            self._pool = ThreadPoolExecutor(1)
            self._ahead = None

    def _build(self, consumed, counts):
        """(x, y, the state after this micro-step of all ranks), from the state alone."""
        import torch
        B = self.cfg.micro_batch
        L = self.cfg.seq_len
        n = B * self.cfg.world_size
        # On CUDA the buffer is pinned, so that the copy can be asynchronous.
        cuda = str(self.cfg.device).startswith("cuda")
        if cuda:
            g = torch.empty((B, L + 1), dtype=torch.int64, pin_memory=True).numpy()
        else:
            g = np.empty((B, L + 1), np.int64)
        # This rank's slice of the micro-step.
        lo = self.cfg.rank * B
        if len(self.sources) == 1:
            # The windows are converted to int64 on the way in.
            ids = self._window_ids(0, counts[0] + lo, B)
            self.sources[0].windows(ids, L, out=g)
            counts = (counts[0] + n,)
        else:
            # The source of each sample of this rank's slice, and its index there.
            src, first, counts = _blend(consumed, counts, self._shares, lo, B, n)
            for k in np.unique(src).tolist():
                # Consecutive samples in source k's own order.
                rows = np.flatnonzero(src == k)
                ids = self._window_ids(k, first[rows[0]], len(rows))
                g[rows] = self.sources[k].windows(ids, L)
        # x and y are views of the one buffer, offset by a token: one copy, one transfer.
        if cuda:
            g = torch.from_numpy(g).to(self.cfg.device, non_blocking=True)
            return g[:, :-1], g[:, 1:], consumed + n, counts
        # Slicing in NumPy, then wrapping, costs a third of slicing a tensor (15 us).
        x = torch.from_numpy(g[:, :-1])
        y = torch.from_numpy(g[:, 1:])
        return x, y, consumed + n, counts

    def _window_ids(self, k, first, n):
        """The windows of source k's samples first .. first + n - 1."""
        windows = (self.sources[k].num_tokens - 1) // self.cfg.seq_len
        epoch, p = divmod(first, windows)
        # Mostly a slice of one epoch's order; else it runs on into the next epochs.
        ids = self._order(k, epoch)[p : p + n]
        while len(ids) < n:
            epoch += 1
            more = self._order(k, epoch)[: n - len(ids)]
            ids = np.concatenate([ids, more])
        return ids

    def _order(self, k, epoch):
        """A permutation of source k's windows, from (seed, k, epoch) alone.

        Epochs only grow, so the last one made is all the cache needs."""
        if self._orders[k][0] != epoch:
            W = (self.sources[k].num_tokens - 1) // self.cfg.seq_len
            # 4 bytes a window while they fit.
            kind = np.uint32 if W < 2**32 else np.int64
            order = np.arange(W, dtype=kind)
            np.random.default_rng([self.cfg.seed, k, epoch]).shuffle(order)
            self._orders[k] = (epoch, order)
        return self._orders[k][1]


def val_batches(source, cfg: BatchConfig, num_batches):
    """The fixed validation micro-batches (x, y): windows [0, B), [B, 2 B), ... up to
    `num_batches` full ones (or one smaller one when there are fewer windows than B).

    Batch j goes to rank j % world_size: a rank may get one fewer, so sum losses and
    counts across ranks, not means."""
    import torch
    B = cfg.micro_batch
    # train.py turns evaluation off below L + 1 tokens.
    L = cfg.seq_len
    # The first n windows in batches of B; fewer than B windows make one batch.
    n = min(num_batches * B, (source.num_tokens - 1) // L)
    bounds = [(j * B, (j + 1) * B) for j in range(n // B)]
    if not bounds:
        bounds = [(0, n)]
    pin = str(cfg.device).startswith("cuda")
    # Pinned memory lets the copy to the GPU overlap the work.
    for j in range(cfg.rank, len(bounds), cfg.world_size):
        windows = source.windows(np.arange(*bounds[j]), L)
        g = torch.from_numpy(windows.astype(np.int64))
        if pin:
            g = g.pin_memory()
        g = g.to(cfg.device, non_blocking=pin)
        # Views of one buffer offset by a token, as Batches gives.
        yield g[:, :-1], g[:, 1:]
