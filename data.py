"""Token sources and the batches a training step sees.

Sources: `open_tokens(path, split)` opens any of FORMAT_OPENERS (prepare.py's shards, raw token
files, nanoGPT's, Megatron-LM's) as one token stream, its files in order, through memory maps.

Windows and order: sample i of a stream is tokens [i*L, i*L + L + 1), inputs the first L, targets
the last L; a stream of T tokens has (T - 1) // L windows. Each epoch is a fresh permutation of all
windows, a pure function of (seed, source, epoch). Global sample g is the g-th entry of that endless
sequence; optimizer step s consumes global samples [s*G, (s+1)*G), and micro-step m on rank r takes
the slice from s*G + (m*world_size + r)*micro_batch. The whole loader state is therefore the count
of consumed samples (plus, when blending, how many of them came from each source).

The file helpers and the tokenizers live here too, so that every tool writes files and reports
errors alike; torch is imported only where tensors are made: prepare.py starts in a blink.
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

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "mamba3-lite-tokens"
MANIFEST_VERSION = 1
# manifest.json: {"format", "version", MANIFEST_FIELDS, "stats"}, "splits" {name: SPLIT_FIELDS},
# each split's "shards" [SHARD_FIELDS]. A field: (what it must hold in words, its test), so that a
# hand-edited manifest is one message naming the field, never a TypeError deep in a reader.
_COUNT = ("a whole number >= 0", lambda v: type(v) is int and v >= 0)
_OBJECT = ("an object", lambda v: isinstance(v, dict))
# a file name inside the manifest's directory: no path, not "." or ".."
_NAME = lambda v: isinstance(v, str) and "/" not in v and v.strip(".") != ""  # noqa: E731
_TOKENIZER = ('an object, naming its "file" if its "name" is "file"',
              lambda v: isinstance(v, dict) and (v.get("name") != "file" or _NAME(v.get("file"))))
MANIFEST_FIELDS = {"dtype": ('"uint16" or "uint32"', lambda v: v in ("uint16", "uint32")),
                   "vocab_size": ("a whole number >= 1", lambda v: type(v) is int and v >= 1),
                   "eos_id": _COUNT, "tokenizer": _TOKENIZER, "splits": _OBJECT}
_TOTALS = {"tokens": sum, "documents": sum, "max_token_id": max}  # a split's, of its shards'
SPLIT_FIELDS = {**dict.fromkeys(_TOTALS, _COUNT), "shards": ("a list", lambda v: type(v) is list)}
SHARD_FIELDS = {"file": ("a file name", _NAME), **dict.fromkeys(_TOTALS, _COUNT),
                "sha256": ("a string", lambda v: type(v) is str)}


def split_totals(shards) -> dict:
    """A split's tokens, documents and max_token_id from its shards' entries (readers trust it)."""
    return {key: total([0] + [s[key] for s in shards]) for key, total in _TOTALS.items()}


def shard_problem(f, shard, dtype):
    """What is wrong with shard file `f` before it is read (manifest entry `shard`), or None."""
    if not f.is_file():
        return f"{f}: listed in {MANIFEST} but missing"
    if (size := f.stat().st_size) != (want := shard["tokens"] * np.dtype(dtype).itemsize):
        return f"{f}: expected {want} bytes ({shard['tokens']} {dtype} tokens), found {size}"


class DataError(ValueError):
    """Bad input data. The message names the file, what was expected and what was found."""


class NoSplit(DataError):
    """The path holds no such split (open_blend then runs without validation data)."""


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
    """Write `path` whole or not at all: a temporary beside it, fsync, rename, fsync the dir."""
    tmp = (path := Path(path)).with_name(f".{path.name}.tmp")
    try:
        tmp.write_bytes(data)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no empty temporary behind
        raise
    fsync(path.parent)


def replace_dir(out, fill, ours):
    """Put the directory fill(stage) builds in place of `out`, so that a kill at any instant loses
    neither: `out` moves to `.NAME.old`, `.NAME.stage` takes its place, what ours(old) does not
    claim (a user's files) moves into the new one, the old one goes. The holder of `.NAME.lock` (a
    flock, released however its holder ends) knows that a stage or old directory is a dead run's."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage, old = out.parent / f".{out.name}.stage", out.parent / f".{out.name}.old"

    def settle():  # a stage goes, an old directory goes back (no `out`) or is retired
        shutil.rmtree(stage, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        elif old.exists():  # what it holds that is not the tool's own moves over first
            mine = ours(old)
            for p in sorted(old.iterdir()):
                if p.name not in mine and not (out / p.name).exists():
                    os.rename(p, out / p.name)
                    warnings.warn(f"kept {p.name}, which is not the tool's own, in {out}",
                                  stacklevel=3)
            shutil.rmtree(old)
            fsync(out.parent)

    with open(out.parent / f".{out.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"{out} is being written by another process; wait for it") from None
        settle()  # after a run that died
        try:
            stage.mkdir()
            result = fill(stage)
            fsync(stage)
            if out.exists():
                os.rename(out, old)
            os.rename(stage, out)
            fsync(out.parent)
        finally:  # after a failure too: `out` is the old directory or the new one, never neither
            settle()
    return result


@contextlib.contextmanager
def cli_errors(*expected):
    """The body of a command-line tool: an `expected` exception becomes one red paragraph on stderr
    (rank 0's only) and exit status 2, Ctrl-C exit 130; warnings print as one line."""
    import typer
    from rich.console import Console
    from rich.markup import escape
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        yield
    except expected as e:
        err = Console(stderr=True, highlight=False, quiet=os.environ.get("RANK", "0") != "0")
        err.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# -----------------------------------------------------------------------------
# tokenizers: each has encode(str) -> list[int], encode_array(str) -> np.ndarray, decode(ids),
# eos_id, vocab_size and spec (JSON-serialisable: load_tokenizer(spec) rebuilds the same tokenizer)

EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")  # looked for in files


class ByteTokenizer:
    """The 256 byte values of UTF-8 text, plus EOS = 256: needs nothing, trains fastest on a CPU."""
    spec, vocab_size, eos_id = {"name": "byte"}, 257, 256

    def encode(self, text):
        return list(text.encode("utf-8", "replace"))

    def encode_array(self, text):
        return np.frombuffer(text.encode("utf-8", "replace"), dtype=np.uint8)

    def decode(self, ids):  # (an id past 256 is a ValueError of bytes())
        raw = b"".join(b"<|endoftext|>" if i == 256 else bytes((i,)) for i in ids)
        return raw.decode("utf-8", "replace")


class BPETokenizer:
    """GPT-2's BPE (a tiktoken Encoding) or a tokenizer.json (a tokenizers.Tokenizer), as
    load_tokenizer builds them; "<|endoftext|>" in a text is text. Picklable, as workers need."""

    def __init__(self, spec, bpe, eos_id, vocab_size):
        self.spec, self._bpe, self.eos_id, self.vocab_size = spec, bpe, eos_id, vocab_size
        self._file = spec["name"] == "file"
        if self._file:  # a special token spelled in a text is text
            bpe.encode_special_tokens = True

    def __reduce__(self):  # (a pickled tokenizers.Tokenizer forgets encode_special_tokens)
        return BPETokenizer, (self.spec, self._bpe, self.eos_id, self.vocab_size)

    def encode(self, text):
        return (self._bpe.encode(text, add_special_tokens=False).ids if self._file else
                self._bpe.encode_ordinary(text))

    def encode_array(self, text):
        return np.asarray(self.encode(text), dtype=np.uint32)

    def decode(self, ids):
        return (self._bpe.decode(list(ids), skip_special_tokens=False) if self._file else
                self._bpe.decode(list(ids)))


def load_tokenizer(spec: dict, directory=None, path=None):
    """Rebuild a tokenizer from its spec: {"name": "byte"}, {"name": "gpt2"}, or {"name": "file",
    "file": "tokenizer.json", "sha256": ..., "eos_token": ...} with the file in `directory` (or at
    `path`); its EOS: spec["eos_token"], else the first of EOS_TOKENS the file has."""
    name = spec.get("name")  # (a manifest's tokenizer is an object: read_manifest checks it)
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        import tiktoken
        try:
            enc = tiktoken.get_encoding("r50k_base")
        except Exception as e:  # a download failure surfaces as one of many network error types
            raise DataError(
                f"could not load the GPT-2 BPE file (tiktoken r50k_base): {e!r}; tiktoken fetches "
                "it on first use: offline, set TIKTOKEN_CACHE_DIR to a directory holding it as "
                "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4, or use --tokenizer byte") from None
        return BPETokenizer({"name": "gpt2"}, enc, enc.eot_token, enc.n_vocab)
    if name != "file":
        raise DataError(f"expected a tokenizer spec named byte, gpt2 or file, found {spec!r}")
    path = Path(path or Path(directory or ".") / spec["file"])
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file missing (the tokenizer spec {spec} names it)")
    if spec.get("sha256") and sha256(path) != spec["sha256"]:
        raise DataError(f"{path}: expected sha256 {spec['sha256']} (per the tokenizer spec), "
                        "found another file")
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"{path}: expected a Hugging Face tokenizer.json file, found one it "
                        f"cannot load ({e})") from None
    names = [spec["eos_token"]] if spec.get("eos_token") else EOS_TOKENS
    if not (found := [n for n in names if tok.token_to_id(n) is not None]):
        raise DataError(f"{path}: expected an end-of-document token ({', '.join(names)}), "
                        "found none; name the one it has with --eos-token")
    return BPETokenizer({**spec, "eos_token": found[0]}, tok, tok.token_to_id(found[0]),
                        tok.get_vocab_size(with_added_tokens=True))


# -----------------------------------------------------------------------------
# token sources, and the formats they are read from


class TokenSource:
    """A token stream of memory-mapped files: files (non-empty), tokens[k] (files[k]'s, read-only)
    from stream position starts[k]; vocab_size, eos_id and tokenizer from `manifest`, else None."""

    def __init__(self, path, files, dtype, max_token_id=None, manifest=None):
        self.path, self.dtype, m = Path(path), np.dtype(dtype), manifest or {}
        self.vocab_size, self.eos_id, self.tokenizer = (m.get(k) for k in ("vocab_size", "eos_id",
                                                                           "tokenizer"))
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # each memory map holds a file
        if 0 <= hard < (need := len(files) + 256):  # descriptor: thousands > 1024 (-1: no limit)
            raise DataError(f"{len(files)} token files need {need} open files, but the limit is "
                            f"{hard}; raise `ulimit -n`")
        if 0 <= soft < need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        for f in map(Path, files):
            if (size := f.stat().st_size) % self.dtype.itemsize:
                raise DataError(f"{f}: expected a whole number of {self.dtype.name} tokens "
                                f"({self.dtype.itemsize} bytes each), found {size} bytes; wrong "
                                "--data-dtype, or a truncated file?")
        self.files = [f for f in map(Path, files) if f.stat().st_size]  # (memmap refuses empty)
        # plain ndarray views: slicing one is several times cheaper than slicing a memmap
        self.tokens = [np.memmap(f, self.dtype, "r").view(np.ndarray) for f in self.files]
        self.starts = np.cumsum([0, *map(len, self.tokens)], dtype=np.int64)
        self.num_tokens = int(self.starts[-1])  # (0: Batches refuses it, train.py evaluates none)
        self.recorded = max_token_id is not None  # trusted, so that a run starts at once
        self._range = (0, max_token_id) if self.recorded else None
        self.unchecked, self._vocab, self._rows = set(), None, {}
        self._sha256 = {x["file"]: x["sha256"] for split in m.get("splits", {}).values()
                        for x in split["shards"]}  # (a manifest's shards: by file name)

    def id_range(self) -> tuple:  # (smallest, largest) token id
        self._range = self._range or (int(min((t.min() for t in self.tokens), default=0)),
                                      int(max((t.max() for t in self.tokens), default=0)))
        return self._range

    def digest(self) -> str:  # of the files: names and sha256 (a manifest's), else names and sizes
        files = [(f.name, self._sha256.get(f.name) or f.stat().st_size) for f in self.files]
        return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]

    def check_vocab(self, vocab_size: int):
        """Refuse token ids outside [0, vocab_size): a raw source scanned now, a recorded range
        now and each file again at its first read (a shard edited after prepare.py keeps its size:
        a bad id is then never an index error deep in a step)."""
        lo, hi = self.id_range()
        if lo < 0 or hi >= vocab_size:
            theirs = f" (its tokenizer has {self.vocab_size} ids)" if self.vocab_size else ""
            raise DataError(f"{self.path}: expected token ids in [0, {vocab_size}) for a model "
                            f"with vocab_size {vocab_size}, found {hi if hi >= vocab_size else lo}"
                            f"{theirs}; use a larger vocabulary or data made with its tokenizer")
        self._vocab, self.unchecked = vocab_size, set(range(len(self.files) * self.recorded))

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n): a view of the file when they lie in one, else a copy."""
        if start < 0 or n < 0 or start + n > self.num_tokens:
            raise IndexError(f"read({start}, {n}) outside {self.path} ({self.num_tokens} tokens)")
        a, b = self.starts.searchsorted(start, "right") - 1, self.starts.searchsorted(start + n)
        pieces = [t[max(start - s, 0) : start + n - s]  # of files a .. b - 1
                  for t, s in zip(self.tokens[a:b], self.starts[a:b].tolist())]
        return pieces[0] if len(pieces) == 1 else np.concatenate([np.empty(0, self.dtype), *pieces])

    def windows(self, ids, seq_len: int, out=None) -> np.ndarray:
        """Windows `ids` (see the module doc), (len(ids), seq_len + 1), in the source dtype or
        written into `out` (C-contiguous, any dtype: Batches's int64 is converted as it copies)."""
        ids, n = np.asarray(ids), seq_len + 1
        if self.unchecked:
            self._check(ids, seq_len)
        out = np.empty((len(ids), n), self.dtype) if out is None else out
        if len(self.tokens) == 1:  # the windows as overlapping rows of the file: one gather
            if seq_len not in self._rows:  # (a view, but 30 us to make: once)
                self._rows[seq_len] = sliding_window_view(self.tokens[0], n)[::seq_len]
            out[...] = self._rows[seq_len][ids]
            return out
        begin = ids.astype(np.int64) * seq_len  # (int64: uint32 ids would wrap past 2**32 tokens)
        first = self.starts.searchsorted(begin, "right") - 1  # the file each window starts in
        pieces = []  # one concatenate of all the windows' pieces, not a Python setitem each
        for lo, k in zip((begin - self.starts[first]).tolist(), first.tolist()):
            h = 0
            while h < n:  # at a file's end the window runs on into the next file(s)
                pieces.append(piece := self.tokens[k][lo : lo + n - h])
                h, k, lo = h + len(piece), k + 1, 0
        np.concatenate(pieces, out=out.reshape(-1))
        return out

    def _check(self, ids, seq_len):  # check_vocab's first-read check of the files ids touch
        begin = ids.astype(np.int64) * seq_len
        first, last = self.starts.searchsorted([begin, begin + seq_len], "right")
        for k in sorted(self.unchecked & {k for a, b in zip(first - 1, last) for k in range(a, b)}):
            tokens, V = self.tokens[k], self._vocab
            if tokens.max() >= V:  # (no id below 0: only a manifest's uint16/uint32 files wait)
                i = int(np.flatnonzero(tokens >= V)[0])
                raise DataError(f"{self.files[k]}: token id {tokens[i]} at token offset {i} is "
                                f"outside [0, {V}), though the manifest says otherwise: changed "
                                "since prepare.py wrote it? `python prepare.py verify "
                                f"{self.path}` checks every shard")
            self.unchecked.discard(k)


check_vocab = TokenSource.check_vocab  # check_vocab(source, vocab_size)


def read_manifest(directory) -> dict:
    """Read `directory/manifest.json`, every field checked (see MANIFEST_FIELDS)."""
    path = Path(directory) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: expected a JSON manifest (prepare.py writes it last), found "
                        f"{'none' if isinstance(e, FileNotFoundError) else e}") from None
    for key, want in (("format", MANIFEST_FORMAT), ("version", MANIFEST_VERSION)):
        if (found := m.get(key) if isinstance(m, dict) else type(m).__name__) != want:
            raise DataError(f"{path}: expected {key} {want!r}, found {found!r}"
                            + "; a newer prepare.py?" * (key == "version"))
    _check_fields(path, m, MANIFEST_FIELDS, "")
    for name, split in m["splits"].items():
        _check_fields(path, split, SPLIT_FIELDS, f"splits.{name}.")
        for i, shard in enumerate(split["shards"]):
            _check_fields(path, shard, SHARD_FIELDS, f"splits.{name}.shards[{i}].")
        for key, found in split_totals(split["shards"]).items():  # (max_token_id: check_vocab's)
            if split[key] != found:
                raise DataError(f"{path}: split {name!r} has {key} {split[key]}, shards {found}")
    return m


def _check_fields(path, obj, fields, where):
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected {where.rstrip('.')} to be an object, found "
                        f"{json.dumps(obj)[:60]}")
    for key, (what, ok) in fields.items():
        if key not in obj or not ok(obj[key]):
            found = json.dumps(obj[key])[:60] if key in obj else "no such field"
            raise DataError(f"{path}: expected {where}{key} to be {what}, found {found}; "
                            "prepare.py writes manifests whole: was this one edited by hand?")


def _prepared(p, split, dtype):
    if not (p / MANIFEST).is_file():
        return None
    m = read_manifest(p)
    if (s := m["splits"].get(split)) is None or s["tokens"] == 0:
        have = [k for k, v in m["splits"].items() if v["tokens"] > 0]
        raise NoSplit(f"{p}: expected a {split!r} split, found only {have} (prepared with "
                      "--val-fraction 0?)")
    files = [p / shard["file"] for shard in s["shards"]]
    for f, shard in zip(files, s["shards"]):  # the sizes the manifest promises, before mapping
        if problem := shard_problem(f, shard, m["dtype"]):
            raise DataError(f"{problem}; run `python prepare.py verify {p}`")
    return TokenSource(p, files, m["dtype"], s["max_token_id"], m)


def _shard_dir(p, split, dtype):
    number = lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f.name)]  # noqa
    shards = sorted(p.glob("shard_*.bin"), key=number) if p.is_dir() else []  # shard_2 < shard_10
    return TokenSource(p, shards, dtype) if shards else None


def _nanogpt_dir(p, split, dtype):
    if not p.is_dir() or not ((p / "train.bin").exists() or (p / "val.bin").exists()):
        return None
    if not (f := p / f"{split}.bin").exists():
        raise NoSplit(f"{p}: expected {split}.bin in this nanoGPT data directory, found "
                      f"{_listing(p)}")
    return TokenSource(f, [f], dtype)


MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
MEGATRON_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences S, D = docs + 1


def _megatron(p, split, dtype):
    # PREFIX.idx: the header, int32 lengths[S], int64 byte pointers[S], int64 document starts[D],
    # 34 + 12 S + 8 D bytes in all; PREFIX.bin: the sequences' tokens back to back
    prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
    idx, binf = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    if not idx.exists():
        return None
    size, o = idx.stat().st_size, MEGATRON_HEADER.size
    if size < o:
        raise DataError(f"{idx}: expected a {o}-byte header at least, found {size} bytes")
    raw = np.memmap(idx, dtype=np.uint8, mode="r")  # the index can be large: map it, do not copy
    magic, version, code, S, D = MEGATRON_HEADER.unpack_from(raw)
    for ok, want, found in [
            (magic == MEGATRON_MAGIC, f"the magic {MEGATRON_MAGIC!r} of a Megatron index", magic),
            (version == 1, "version 1", version),
            (code in MEGATRON_DTYPES, f"a dtype code in {sorted(MEGATRON_DTYPES)}", code),
            (size == o + 12 * S + 8 * D,
             f"{o + 12 * S + 8 * D} bytes for {S} sequences and {D} document boundaries", size)]:
        if not ok:
            raise DataError(f"{idx}: expected {want}, found {found}")
    token = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
    lengths = np.frombuffer(raw, "<i4", S, o).astype(np.int64)  # (S,) tokens per sequence
    pointers = np.frombuffer(raw, "<i8", S, o + 4 * S)  # (S,) byte offset of each sequence
    docs = np.frombuffer(raw, "<i8", D, o + 12 * S)  # (D,) first sequence of each document, then S
    expect = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * token.itemsize  # back to back
    if (bad := (pointers != expect) | (lengths < 0)).any():
        i = int(np.argmax(bad))
        raise DataError(f"{idx}: expected increasing pointers, each sequence right after the one "
                        f"before: sequence {i} at byte {expect[i]}, found {pointers[i]}")
    if D < 1 or docs[0] != 0 or docs[-1] != S or (np.diff(docs) < 0).any():
        raise DataError(f"{idx}: expected document boundaries rising from 0 to {S} (the sequence "
                        f"count), found {docs[:3].tolist()}...{docs[-3:].tolist()}")
    if (have := binf.stat().st_size) != (want := int(lengths.sum()) * token.itemsize):
        raise DataError(f"{binf}: expected {want} bytes ({lengths.sum()} {token.name} tokens per "
                        f"{idx.name}), found {have}: {'truncated' if have < want else 'too long'}")
    return TokenSource(prefix, [binf], token)


def _raw_file(p, split, dtype):
    if not p.is_file():
        return None
    # Trained on as token ids, text would be garbage without a word of warning. Token ids are
    # almost never printable UTF-8: small ids hold zero bytes, large ones bytes that are not UTF-8.
    head = np.fromfile(p, np.uint8, 1 << 16).tobytes()
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head)  # a character cut at the end
    except UnicodeDecodeError:
        text = ""
    named = p.suffix.lower() in (".txt", ".md", ".py", ".json", ".jsonl", ".gz", ".parquet", ".csv",
                                 ".tsv", ".html") and f"a {p.suffix} file"
    if named or text and all(c.isprintable() or c in "\t\n\r\f" for c in text):
        raise DataError(f"{p}: expected a file of token ids, found {named or 'UTF-8 text'}, which "
                        f"holds text: `python prepare.py {p} --out-dir DIR` makes it --data DIR")
    return TokenSource(p, [p], dtype)


# An opener takes (path, split, dtype: the one given, else uint16) and returns a TokenSource, or
# None when the path is not of its format: a new format is one opener and one line here (what it
# is, its opener, whether it has splits; if not, it is one stream: the train split), tried in order.
FORMAT_OPENERS = [
    ("a prepare.py directory (manifest.json)", _prepared, True),
    ("a directory of shard_*.bin files", _shard_dir, False),
    ("a nanoGPT data directory (train.bin, val.bin)", _nanogpt_dir, True),
    ("a Megatron prefix (PREFIX.bin + PREFIX.idx)", _megatron, False),
    ("a raw token file such as nanoGPT's train.bin", _raw_file, False),
]
FORMATS = ", ".join(what for what, *_ in FORMAT_OPENERS[:-1]) + ", or " + FORMAT_OPENERS[-1][0]


def open_tokens(path, split: str = "train", dtype=None) -> TokenSource:
    """Split `split` (train or val) of a stream of the FORMATS; `dtype` where none is recorded."""
    p = Path(path)
    want = None if dtype is None else np.dtype(dtype).newbyteorder("<")
    for what, opener, splits in FORMAT_OPENERS:
        if (source := opener(p, split, want or np.uint16)) is None:
            continue
        if not splits and split != "train":
            raise NoSplit(f"{p}: asked for the {split!r} split, but {what} holds one token stream "
                          "(the train split); give the validation data as a separate path")
        if want is not None and source.dtype != want:  # a format that records its dtype
            raise DataError(f"{p}: records dtype {source.dtype.name}, not the {want.name} given")
        return source
    if p.is_dir() and any(p.glob("train_*.bin")):
        raise DataError(f"{p}: has train_*.bin shards but no {MANIFEST}, the file prepare.py "
                        "writes last: an interrupted prepare.py run? Run prepare.py again")
    raise DataError(f"{p}: expected {FORMATS}; found {_listing(p)}" if p.is_dir() else
                    f"{p}: no such file or directory; expected {FORMATS}")


def _listing(p):
    names = sorted(x.name for x in p.iterdir())
    return ", ".join(names[:8]) + f" and {len(names) - 8} more" * (len(names) > 8) or "no files"


def open_blend(specs, dtype=None, vocab_size=None, seed=0, tmpdir=None):
    """train.py's --data: paths, or PATH:WEIGHT to blend several, or ["synthetic"] (random tokens
    in a file under tmpdir). Returns (train sources, weights or None, the first path's val source or
    None, vocab_size: by default the first source's, else GPT-2's), each source checked on it."""
    if list(specs) == ["synthetic"]:
        vocab, path = vocab_size or 50257, Path(tmpdir) / "synthetic.bin"
        np.random.default_rng(seed).integers(0, vocab, 1 << 22).astype(np.uint32).tofile(path)
        return [open_tokens(path, dtype=np.uint32)], None, None, vocab
    paths, weights = [], []
    for spec in specs:
        head, sep, tail = spec.rpartition(":")
        if not sep or Path(spec).exists():  # a path may hold a colon of its own
            head, tail = spec, "1"
        elif not tail.replace(".", "", 1).isdigit():
            raise DataError(f"--data {spec!r}: expected a path, or PATH:WEIGHT with WEIGHT a "
                            f"positive number, found the weight {tail!r} (and no such path)")
        elif float(tail) == 0:
            raise DataError(f"--data {spec!r}: expected PATH:WEIGHT with a positive WEIGHT, found "
                            "0: a source weighted 0 would never be read; leave it out")
        paths.append(head)
        weights.append(float(tail))
    sources = [open_tokens(path, "train", dtype) for path in paths]
    first = sources[0].tokenizer  # raw token files record none: only manifests can be compared
    for path, source in zip(paths[1:], sources[1:]):
        if first and source.tokenizer and source.tokenizer != first:
            raise DataError(f"--data {path}: made with the tokenizer {source.tokenizer}, "
                            f"{paths[0]} with {first}: blend data made with one tokenizer")
    val = None
    with contextlib.suppress(NoSplit):
        val = open_tokens(paths[0], "val", dtype)
    vocab = vocab_size or sources[0].vocab_size or 50257
    for source in sources + [val] * (val is not None):
        check_vocab(source, vocab)
    return sources, weights if len(paths) > 1 else None, val, vocab


# -----------------------------------------------------------------------------
# batches: epochs, global samples, ranks, blending, state; validation


@dataclasses.dataclass
class BatchConfig:
    """seq_len, global_batch (sequences a step on all ranks, a multiple of micro_batch * world_size;
    default one micro-batch per rank) and seed define the sample sequence; micro_batch, rank and
    world_size only which part this process takes (a resume may change them)."""
    seq_len: int
    micro_batch: int
    global_batch: int | None = None
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    prefetch: bool = False  # build the next micro-batch in a thread while the caller trains


class Batches:
    """This rank's endless micro-batches (see the module doc): (x, y) int64 (micro_batch, seq_len)
    views of one buffer, of `sources` blended by `weights`. A resume (load_state_dict) may change
    world_size and micro_batch (elastic), never global_batch, seq_len, seed or the blend."""

    def __init__(self, sources, cfg: BatchConfig, weights=None):
        self.sources = [sources] if isinstance(sources, TokenSource) else list(sources)
        B, L, world = cfg.micro_batch, cfg.seq_len, cfg.world_size
        G = cfg.global_batch or B * world
        self.cfg = cfg = dataclasses.replace(cfg, global_batch=G)
        if G % (B * world):
            good = max(1, round(G / (B * world))) * B * world
            raise DataError(f"global batch {G} sequences (--total-batch-size {G * L} / --seq-len "
                            f"{L}) is not a multiple of micro_batch {B} (--batch-size) x "
                            f"world_size {world} = {B * world}; pick sizes where it is, for "
                            f"example --total-batch-size {good * L} ({good} sequences)")
        self.accum_steps = G // (B * world)
        if short := [s for s in self.sources if s.num_tokens <= L]:
            raise DataError(f"{short[0].path}: expected at least seq_len + 1 = {L + 1} tokens, "
                            f"found {short[0].num_tokens}")
        ws = [Fraction(str(w)) for w in weights or [1] * len(self.sources)]  # "0.7": 7/10 exactly
        if len(ws) != len(self.sources) or min(ws) <= 0:
            raise DataError(f"blend weights: expected {len(self.sources)} positive weights, one "
                            f"per source (train.py: --data PATH:WEIGHT), found {weights}")
        self.weights = [w / sum(ws) for w in ws]
        D = math.lcm(*(w.denominator for w in self.weights))
        self._shares = [int(w * D) for w in self.weights], D  # weight k == a[k] / D exactly
        self._consumed, self._counts = 0, (0,) * len(self.sources)  # the state: all ranks' samples
        self._orders = [(None, None)] * len(self.sources)  # per source: (epoch, its window order)
        self._pool, self._ahead = ThreadPoolExecutor(1) if cfg.prefetch else None, None

    def __iter__(self):
        return self

    def __next__(self):
        ahead, self._ahead = self._ahead, None  # (after an error, the next call starts afresh)
        x, y, *state = ahead.result() if ahead else self._build(self._consumed, self._counts)
        self._consumed, self._counts = state  # a build returns the state after it: what was taken
        if self._pool is not None:
            self._ahead = self._pool.submit(self._build, *state)
        return x, y

    def state_dict(self) -> dict:  # the position, then what defines the sample sequence
        c = self.cfg
        return {"consumed": self._consumed, "source_consumed": list(self._counts),
                "global_batch": int(c.global_batch), "seq_len": int(c.seq_len),
                "seed": int(c.seed), "weights": [str(w) for w in self.weights]}

    def load_state_dict(self, state: dict):
        for key, mine in list(self.state_dict().items())[2:]:  # a resume must keep all of those
            if state.get(key) != mine:
                raise DataError(f"loader state: saved with {key} = {state.get(key)}, but this run "
                                f"has {key} = {mine}: a resume must keep it, or start a fresh run")
        self.close()
        self._consumed = int(state["consumed"])  # (train.py saves between steps: whole batches)
        self._counts = tuple(int(c) for c in state["source_consumed"])

    def close(self):  # stops the prefetch thread, if one runs (the next batch starts it again)
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)  # waits for a build under way
            self._pool, self._ahead = ThreadPoolExecutor(1), None

    def _build(self, consumed, counts):
        """(x, y, the state after this micro-step of all ranks): a pure function of the state."""
        import torch
        B, L, n = self.cfg.micro_batch, self.cfg.seq_len, self.cfg.micro_batch * self.cfg.world_size
        cuda = str(self.cfg.device).startswith("cuda")  # pinned: the copy can be asynchronous
        g = np.empty((B, L + 1), np.int64) if not cuda else torch.empty(
            (B, L + 1), dtype=torch.int64, pin_memory=True).numpy()
        lo = self.cfg.rank * B  # this rank's slice of the micro-step
        if len(self.sources) == 1:  # converted to int64 on the way in
            self.sources[0].windows(self._window_ids(0, counts[0] + lo, B), L, out=g)
            counts = (counts[0] + n,)
        else:
            src, first, counts = _blend(consumed, counts, self._shares, lo, B, n)
            for k in np.unique(src).tolist():
                rows = np.flatnonzero(src == k)  # consecutive samples in source k's own order
                g[rows] = self.sources[k].windows(self._window_ids(k, first[rows[0]], len(rows)), L)
        # x and y are views of the one buffer, offset by a token: one copy, one transfer
        if cuda:
            g = torch.from_numpy(g).to(self.cfg.device, non_blocking=True)
            return g[:, :-1], g[:, 1:], consumed + n, counts
        # (slicing in NumPy, then wrapping, costs a third of slicing a tensor: 15 us a batch)
        return torch.from_numpy(g[:, :-1]), torch.from_numpy(g[:, 1:]), consumed + n, counts

    def _window_ids(self, k, first, n):  # of source k's samples first .. first + n - 1
        e, p = divmod(first, (self.sources[k].num_tokens - 1) // self.cfg.seq_len)
        ids = self._order(k, e)[p : p + n]  # mostly a slice of one epoch's order, else it runs on
        while len(ids) < n:
            e, ids = e + 1, np.concatenate([ids, self._order(k, e + 1)[: n - len(ids)]])
        return ids

    def _order(self, k, epoch):  # a permutation of source k's windows from (seed, k, epoch) alone
        if self._orders[k][0] != epoch:  # (epochs only grow: the last one is all a cache needs)
            W = (self.sources[k].num_tokens - 1) // self.cfg.seq_len
            order = np.arange(W, dtype=np.uint32 if W < 2**32 else np.int64)  # 4 bytes a window
            np.random.default_rng([self.cfg.seed, k, epoch]).shuffle(order)
            self._orders[k] = epoch, order
        return self._orders[k][1]


def _blend(consumed, counts, shares, lo, B, n):
    """Source and per-source index of samples [lo, lo + B) of the n-sample micro-step at global
    sample `consumed`, and the counts after. Earliest deadline first among the sources not ahead of
    their share (weight a[k] / D: eligible for sample g when c[k] < (g + 1) a[k] / D, deadline
    (c[k] + 1) / a[k]) keeps every prefix within a sample of its shares; "largest deficit first"
    does not (tests/test_data.py)."""
    (a, D), c, picks = shares, list(counts), []  # picks: (source, its index) of each sample
    for g in range(consumed, consumed + n):
        best = -1
        for k in range(len(c)):  # (in integers, cross-multiplied: Fractions cost 8x)
            eligible = c[k] * D < (g + 1) * a[k]
            if eligible and (best < 0 or (c[k] + 1) * a[best] < (c[best] + 1) * a[k]):
                best = k
        picks.append((best, c[best]))
        c[best] += 1
    src, idx = np.array(picks[lo : lo + B]).T
    return src, idx, tuple(c)


def val_batches(source, cfg: BatchConfig, num_batches):
    """The fixed validation micro-batches (x, y): windows [0, B), [B, 2 B), ... up to `num_batches`
    full ones (or one smaller one when there are fewer windows than B). Batch j goes to rank j %
    world_size: a rank may get one fewer, so sum losses and counts across ranks, not means."""
    import torch
    B, L = cfg.micro_batch, cfg.seq_len  # (train.py turns evaluation off below L + 1 tokens)
    n = min(num_batches * B, (source.num_tokens - 1) // L)
    bounds = [(j * B, (j + 1) * B) for j in range(n // B)] or [(0, n)]
    pin = str(cfg.device).startswith("cuda")
    for j in range(cfg.rank, len(bounds), cfg.world_size):
        g = torch.from_numpy(source.windows(np.arange(*bounds[j]), L).astype(np.int64))
        g = (g.pin_memory() if pin else g).to(cfg.device, non_blocking=pin)
        yield g[:, :-1], g[:, 1:]  # views of one buffer offset by a token, as Batches gives
