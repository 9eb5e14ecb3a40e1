"""Turn text into the token shards data.py reads.

    python prepare.py                                    # demo corpus: Python's stdlib -> data/demo
    python prepare.py corpus/ extra.jsonl.gz --out-dir data/mine --tokenizer gpt2
    python prepare.py fineweb/*.parquet --out-dir data/web   # one row a document: the "text" column
    python prepare.py verify data/mine                   # re-hash and range-check every shard
    python prepare.py info data/mine                     # statistics and a decoded sample

Inputs: files or directories (searched recursively, sorted by path) of .txt, .md and .py files (a
file is a document) and .jsonl files (a line is a document: its "text" field), each optionally
gzipped, and .parquet files (a row is a document: its "text" column, a null an empty one);
--text-field names another field or column. Each document ends with the tokenizer's EOS id; every
1/f-th goes to the validation split (_is_val says which), the rest to train, each split cut at
document ends into shards of about --shard-tokens tokens. --workers processes tokenize in bounded
memory and in input order: the output is byte-identical for any worker count.

The output is built beside --out-dir and put in its place only when complete (data.replace_dir): a
failure or a kill never leaves a half-written directory that looks valid or loses the previous
output, and files you added to it move into the new one. Ctrl-C and SIGTERM stop the command,
workers included, within a second or so (exit 130 or 143).
"""
import contextlib
import dataclasses
import gzip
import hashlib
import inspect
import json
import multiprocessing
import os
import re
import signal
import sys
import sysconfig
import time
import zlib
from fractions import Fraction
from pathlib import Path
from typing import Annotated, List, Optional

import numpy as np
import typer
from rich.progress import Progress
from typer import Option

from data import (EOS_TOKENS, MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, DataError, cli_errors,
                  load_tokenizer, open_tokens, read_manifest, replace_dir, sha256, shard_problem,
                  split_totals, write_atomic)

DEMO_OUT = Path("data/demo")
BATCH_BYTES = 1 << 20  # text per task sent to a worker: enough to amortise the inter-process copy
PARQUET_ROWS = 1024  # rows per batch read from a Parquet file: a bounded slice of one row group


@dataclasses.dataclass
class Options:
    """How prepare() cuts and tokenizes; the fields are also the command's flags (see main)."""
    shard_tokens: Annotated[int, Option(min=1, help="Most tokens per shard; shards end at "
                                        "document ends (a longer one gets its own).")] = 50_000_000
    val_fraction: Annotated[Optional[float], Option(
        help="Fraction of documents held out for validation, at least one when > 0 (default: 0.01 "
        "for the demo, 0.0005 otherwise).")] = None
    workers: Annotated[Optional[int], Option(min=1, help="Processes (default: all cores).")] = None
    eos_token: Annotated[Optional[str], Option(help="A tokenizer file's end-of-document token, "
                                               f"if not one of {', '.join(EOS_TOKENS)}.")] = None
    overwrite: Annotated[bool, Option(help="Replace an --out-dir that holds something other than a "
                                      "previous output.")] = False
    text_field: Annotated[str, Option(help="The text column of .parquet files and the text field "
                                      "of .jsonl records.")] = "text"


# -----------------------------------------------------------------------------
# inputs: which files, and the documents in them


def _kind(path: Path):  # "parquet" (compressed inside, never gzipped whole), "jsonl", "text", None
    name = path.name.removesuffix(".gz")
    return ("parquet" if path.name.endswith(".parquet") else "jsonl" if name.endswith(".jsonl")
            else "text" if name.endswith((".txt", ".md", ".py")) else None)


def find_inputs(paths) -> list:
    """Input files in order: each path in turn, a directory's files (hidden directories skipped)
    sorted by their path inside it; a file named twice is read once."""
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise DataError(f"{p}: no such file or directory")
        if p.is_file() and _kind(p) is None:
            raise DataError(f"{p}: expected a .txt, .md, .py or .jsonl file (optionally .gz) or a "
                            f".parquet file, found {p.suffix or 'no suffix'}")
        found = [p] if p.is_file() else []
        for root, dirs, names in os.walk(p):  # (nothing for a file)
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [Path(root) / n for n in names if _kind(Path(n)) is not None]
        files += sorted(found, key=lambda f: f.relative_to(p).parts)
    if not files:
        raise DataError(f"no documents found in {', '.join(map(str, paths))}: expected .txt, .md, "
                        ".py, .jsonl or .parquet files")
    return list(dict.fromkeys(files))


def demo_inputs(root=None) -> list:
    """Every .py file of the standard library (or `root`) but tests and packages, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [f for f in root.rglob("*.py") if not skip & set(f.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda f: f.relative_to(root).parts)


def check_parquet(files, text_field="text"):
    """Refuse, from the footers, before any work, a .parquet input without a text_field column."""
    for f in (f for f in files if _kind(f) == "parquet"):
        import pyarrow as pa  # only when needed: it takes a while
        import pyarrow.parquet as pq
        try:
            schema = pq.read_schema(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f}: expected a Parquet file, found one pyarrow cannot read "
                            f"({e})") from None
        if text_field not in schema.names:
            raise DataError(f"{f}: expected a column {text_field!r} (--text-field), found the "
                            f"columns {', '.join(map(repr, schema.names))}")
        t = schema.field(text_field).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
            raise DataError(f"{f}: expected column {text_field!r} to hold text (an Arrow string "
                            f"type), found {t}; name the text column with --text-field")


def read_documents(files, text_field="text"):
    """Yield (kind, raw bytes, (file index, file, line number)) per document, streaming: one file,
    line or slice of a Parquet row group at a time (a Parquet row is a "text" document)."""
    for i, f in enumerate(files):
        if _kind(f) == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq
            try:
                # pyarrow's default pre-buffering reads the column of the whole file ahead, so
                # memory would grow with the file: read one row group's column in 1 MiB pieces.
                with pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20) as pf:
                    for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[text_field]):
                        texts = batch.column(0).cast(pa.large_binary()).to_pylist()
                        yield from (("text", raw or b"", (i, f, 0)) for raw in texts)  # null: b""
            except (pa.ArrowException, OSError) as e:  # a corrupt page or row group, a file gone
                raise DataError(f"{f}: could not read it as Parquet ({e})") from None
            continue
        try:
            with (gzip.open if f.name.endswith(".gz") else open)(f, "rb") as fh:
                if _kind(f) == "text":
                    yield "text", fh.read(), (i, f, 0)
                else:  # blank lines (a trailing newline, say) are not documents
                    yield from (("jsonl", line, (i, f, n)) for n, line in enumerate(fh, 1)
                                if line.strip())
        except (OSError, EOFError, zlib.error) as e:  # unreadable file, corrupt gzip stream
            raise DataError(f"{f}: could not read it ({e})") from None


def _batched(documents):  # lists of about BATCH_BYTES of documents
    batch, size = [], 0
    for doc in documents:
        batch.append(doc)
        size += len(doc[1])
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# -----------------------------------------------------------------------------
# tokenization, in worker processes

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
JSON_TYPES = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
WORKER_DIED = "a tokenizer process died; rerun with fewer --workers if memory ran short"


def _encode_batch(tok, docs, dtype, text_field):
    """(tokens (N,), each document then EOS; lengths (D,), 0 for empty; undecodable count)."""
    eos, pieces, lengths, bad = np.array([tok.eos_id], dtype=dtype), [], [], 0
    for kind, raw, (_, f, lineno) in docs:
        text = raw.decode("utf-8", "replace")  # count the U+FFFD that replace bytes, not the text's
        bad += text.count("\ufffd") - raw.count("\ufffd".encode())
        if kind == "jsonl":
            text, n = _json_text(text, text_field, f"{f}:{lineno}")
            bad += n
        ids = tok.encode_array(text).astype(dtype, copy=False)
        pieces += [ids, eos] if text else []
        lengths.append(len(ids) + 1 if text else 0)
    return np.concatenate(pieces or [np.empty(0, dtype)]), np.asarray(lengths, dtype=np.int64), bad


def _json_text(line, text_field, where):
    """(the text field of a jsonl line, lone surrogates replaced, their count), or a DataError."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: expected one JSON object per line, found invalid JSON "
                        f"({e})") from None
    value, field = obj.get(text_field) if isinstance(obj, dict) else None, json.dumps(text_field)
    if not isinstance(value, str):
        what = JSON_TYPES.get(type(value if isinstance(obj, dict) else obj), "number")
        found = (f"a JSON {what}" if not isinstance(obj, dict) else
                 f"a {what} in {field}, not a string" if text_field in obj else
                 f"the keys {', '.join(map(json.dumps, sorted(obj)[:5]))}")
        raise DataError(f"{where}: expected a JSON object with a string {field} field "
                        f"(--text-field), found {found}")
    return re.subn("[\ud800-\udfff]", "\ufffd", value)  # lone surrogates (\ud800 escapes): no UTF-8


def _worker(conn, parents_end, tok):
    """A tokenizer process: batches in, their _encode_batch results (or exceptions) out."""
    # Ctrl-C reaches every process of the terminal's group: the parent alone decides, and ends the
    # workers with SIGTERM, which must then just end them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by _workers while it forked
    parents_end.close()  # so that recv() ends (EOFError) when the parent is gone
    with contextlib.suppress(EOFError, BrokenPipeError):  # the parent is gone: so is the work
        for task in iter(conn.recv, None):
            try:
                result = _encode_batch(tok, *task)
            except Exception as e:  # raised again in the parent
                result = e
            conn.send(result)


@contextlib.contextmanager
def _workers(n, tok):
    """n tokenizer processes (their pipes), ended by SIGTERM however the block is left. Not a Pool:
    a pool worker killed holding the task queue's lock (SIGTERM to the group) hangs terminate()."""
    ctx, procs, conns = multiprocessing.get_context(), [], []
    # The stop signals stay blocked until every worker has set its own handlers (the mask is
    # inherited); one that came meanwhile is raised at the unblock, inside the try.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            conns.append(mine)
            procs.append(ctx.Process(target=_worker, args=(theirs, mine, tok), daemon=True))
            procs[-1].start()
            theirs.close()  # the worker's end lives in the worker alone: its death is an EOF here
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield conns
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for proc in procs:
            proc.terminate()
        for proc, conn in zip(procs, conns):
            proc.join()
            conn.close()


def _encoded(files, tok, dtype, conns, text_field):
    """Yield (files done, tokens, lengths, undecodable) per batch, in input order. Batch k goes to
    worker k % n, one at a time each, so memory stays bounded; no conns: in this process."""
    batches = _batched(read_documents(files, text_field))
    if not conns:
        yield from ((b[-1][2][0] + 1, *_encode_batch(tok, b, dtype, text_field)) for b in batches)
        return
    pending = []  # (files done, pipe) of the batches in the workers, oldest first
    def take(files_done, conn):
        if isinstance(result := conn.recv(), Exception):
            raise result
        return files_done, *result
    try:
        for k, docs in enumerate(batches):
            done = take(*pending.pop(0)) if len(pending) == len(conns) else None
            conns[k % len(conns)].send((docs, dtype, text_field))
            pending.append((docs[-1][2][0] + 1, conns[k % len(conns)]))
            if done:
                yield done
        while pending:
            yield take(*pending.pop(0))
    except (EOFError, OSError):  # a pipe closed: a worker is gone (a crash, the OOM killer)
        raise DataError(WORKER_DIED) from None


# -----------------------------------------------------------------------------
# writing shards


class ShardWriter:
    """One split's shards of whole documents, each within shard_tokens unless one document is
    longer; `shards`: the manifest entries. (No temporary names: the directory is a stage.)"""

    def __init__(self, directory: Path, split: str, shard_tokens: int):
        self.directory, self.split, self.shard_tokens, self.shards, self.f = (
            directory, split, shard_tokens, [], None)

    def add(self, tokens: np.ndarray, lengths: np.ndarray):
        """Append documents: `tokens` (N,) their concatenation, `lengths` (D,) their sizes (> 0)."""
        ends, i = np.cumsum(lengths), 0  # (D,) where each document ends in `tokens`
        while i < len(lengths):
            if self.f is not None and self.entry["tokens"] + lengths[i] > self.shard_tokens:
                self.close()
            if self.f is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self.f = open(self.directory / name, "wb", buffering=1 << 23)
                self.entry = {"file": name, "tokens": 0, "documents": 0, "max_token_id": 0}
                self.hash = hashlib.sha256()  # as it is written: no second read of the shard
            begin, e = int(ends[i - 1]) if i else 0, self.entry
            room = begin + self.shard_tokens - e["tokens"]
            j = max(i + 1, int(np.searchsorted(ends, room, side="right")))  # documents i .. j-1
            chunk = tokens[begin : int(ends[j - 1])]
            self.f.write(chunk.data)
            self.hash.update(chunk.data)
            e["tokens"], e["documents"], i = e["tokens"] + len(chunk), e["documents"] + j - i, j
            e["max_token_id"] = max(e["max_token_id"], int(chunk.max()))

    def close(self):
        if self.f is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.shards.append({**self.entry, "sha256": self.hash.hexdigest()})
            self.f = None


def _ours(old: Path) -> set:
    """What of a replaced output is prepare.py's (the rest is a user's, and is kept)."""
    try:
        splits = read_manifest(old)["splits"].values()
    except DataError:  # not an earlier output: --overwrite asked to replace it
        return {p.name for p in old.iterdir()}
    return {MANIFEST, "tokenizer.json", *(s["file"] for split in splits for s in split["shards"])}


def prepare(files, out, tokenizer="gpt2", log=print, progress=False, **options) -> dict:
    """Tokenize `files` (from find_inputs or demo_inputs) into the shard directory `out`; return the
    manifest. `options`: Options' fields, in Typer's ranges; the rest is checked before work."""
    o = Options(**options)
    o.val_fraction = 0.0005 if o.val_fraction is None else o.val_fraction
    o.workers = (os.cpu_count() or 1) if o.workers is None else o.workers
    out = Path(out).resolve() if Path(out).is_symlink() else Path(out)  # the swap renames dirs
    tok_file = None if tokenizer in ("byte", "gpt2") else Path(tokenizer)  # (their EOS is built in)
    # Typer checks the flags' other ranges; a NaN would pass its --val-fraction range
    for ok, flag, want, value in [
            (0 <= o.val_fraction < 1, "--val-fraction", "a fraction in [0, 1)", o.val_fraction),
            (not tok_file or tok_file.is_file(), "--tokenizer",
             "gpt2, byte or a tokenizer.json file", f"{tokenizer!r} (no such file)"),
            (not out.exists() or out.is_dir(), f"--out-dir {out}", "a directory", "a file")]:
        if not ok:
            raise DataError(f"{flag}: expected {want}, found {value}")
    check_parquet(files, o.text_field)
    tok = load_tokenizer({"name": tokenizer} if tok_file is None else {
        "name": "file", "file": "tokenizer.json", "sha256": sha256(tok_file),
        "eos_token": o.eos_token}, path=tok_file)
    # refuse an --out-dir whose replacement would lose something
    if inside := [f for f in files if out.resolve() in f.resolve().parents]:
        raise DataError(f"--out-dir {out}: contains the input {inside[0]}, and would be replaced; "
                        "write somewhere else")
    if not o.overwrite and out.is_dir() and any(out.iterdir()):
        try:
            read_manifest(out)
        except DataError:
            names = ", ".join(sorted(p.name for p in out.iterdir())[:5])
            raise DataError(f"--out-dir {out}: expected an empty directory or a previous "
                            f"prepare.py output, found other files ({names}...); pick another "
                            "--out-dir, or pass --overwrite to replace it") from None
    t0 = time.perf_counter()
    try:
        m = replace_dir(out, lambda stage: _build(stage, files, tok, tok_file, o, progress), _ours)
    except OSError as e:  # disk full, permissions: say where, and that nothing was lost
        raise DataError(f"could not write {e.filename or out} ({e.strerror or e}); free disk space "
                        f"or fix the permissions, then run again: {out} is unchanged") from None
    seconds, stats, (train, val) = time.perf_counter() - t0, m["stats"], m["splits"].values()
    tokens = train["tokens"] + val["tokens"]
    log(f"wrote {tokens:,} tokens ({stats['documents']:,} documents) to {out} in {seconds:.1f}s "
        f"({tokens / seconds:,.0f} tokens/s, {o.workers} worker{'s' * (o.workers > 1)}): train "
        f"{train['tokens']:,} tokens in {len(train['shards'])} shards, val {val['tokens']:,} "
        "tokens")
    bad, empty = stats["undecodable_replaced"], stats["empty_documents_skipped"]
    notes = [f"replaced {bad:,} undecodable byte sequence{'s' * (bad > 1)} with U+FFFD"] * (bad > 0)
    notes += [f"skipped {empty:,} empty document{'s' * (empty > 1)}"] * (empty > 0)
    if notes:
        log(f"note: {'; '.join(notes)}")
    return m


def _build(stage, files, tok, tok_file, o, show) -> dict:
    """Write the shards, the tokenizer file if any and, last, the manifest into `stage`."""
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    writers = {s: ShardWriter(stage, s, o.shard_tokens) for s in ("train", "val")}
    f = Fraction(str(o.val_fraction)).limit_denominator(10**9)
    docs = empty = undecodable = tokens = 0
    held = [np.empty(0, t) for t in (dtype, np.int64, bool)]  # none yet: an empty batch
    def add(toks, lengths, is_val):  # is_val (D,) says which documents are validation's
        v = np.repeat(is_val, lengths)  # (N,) which tokens are
        writers["val"].add(toks[v], lengths[is_val])
        writers["train"].add(toks[~v], lengths[~is_val])
    # the workers start before the progress bar's thread: forking with threads is unsafe
    with (_workers(o.workers, tok) if o.workers > 1 else contextlib.nullcontext() as conns,
          Progress(disable=not (show and sys.stdout.isatty())) as bar,
          contextlib.closing(_encoded(files, tok, dtype, conns, o.text_field)) as stream):
        task, t0 = bar.add_task("tokenizing", total=len(files)), time.perf_counter()
        for files_done, toks, lengths, bad in stream:
            undecodable, empty = undecodable + bad, empty + int((lengths == 0).sum())
            lengths = lengths[lengths > 0]
            is_val = _is_val(docs + np.arange(len(lengths), dtype=np.int64), f)
            docs, tokens = docs + len(lengths), tokens + len(toks)
            bar.update(task, completed=files_done, description=f"tokenizing: {docs:,} docs "
                       f"{tokens:,} tokens {tokens / (time.perf_counter() - t0 + 1e-9):,.0f} tok/s")
            if len(lengths):  # a batch waits for the next: its last document may be val's
                add(*held)
                held = toks, lengths, is_val
    if docs == 0:
        raise DataError(f"no documents found: the {len(files)} input files hold only empty "
                        "documents")
    if 0 < 2 * docs * f < 1:  # round(docs * f), _is_val's count, is 0: the last is validation's
        held[2][-1] = True
    add(*held)
    for w in writers.values():
        w.close()
    if not writers["train"].shards:
        raise DataError(f"all {docs} documents went to the validation split, none is left for "
                        "training: give more documents or a smaller --val-fraction (0 for none)")
    if tok_file:
        write_atomic(stage / "tokenizer.json", tok_file.read_bytes())
    splits = {name: {**split_totals(w.shards), "shards": w.shards} for name, w in writers.items()}
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
                "dtype": np.dtype(dtype).name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                "tokenizer": tok.spec, "splits": splits, "stats": {
                    "input_files": len(files), "documents": docs, "empty_documents_skipped": empty,
                    "undecodable_replaced": undecodable, "val_fraction": o.val_fraction,
                    "shard_tokens": o.shard_tokens}}
    write_atomic(stage / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def _is_val(n, f: Fraction):
    """Document n (from 0) is validation's when round((n + 1) f) > round(n f), halves up: every
    prefix then holds round(prefix * f), spread evenly from about 1 / (2f) on, favouring neither the
    start nor a large first file. When that is none (f > 0), _build holds out the last document."""
    p, q = f.numerator, f.denominator
    return (2 * (n + 1) * p + q) // (2 * q) > (2 * n * p + q) // (2 * q)


# -----------------------------------------------------------------------------
# verify and info


def verify(directory) -> list:
    """The problems of a prepared directory: each shard's size, sha256, max token id, EOS count and
    final EOS against the manifest (which read_manifest checks), and the tokenizer file."""
    directory = Path(directory)
    try:
        m = read_manifest(directory)
    except DataError as e:
        return [str(e)]
    problems, dtype, eos, vocab = [], np.dtype(m["dtype"]), m["eos_id"], m["vocab_size"]
    for s in (x for split in m["splits"].values() for x in split["shards"]):
        if problem := shard_problem(f := directory / s["file"], s, m["dtype"]):
            problems.append(problem)
            continue
        t = np.memmap(f, dtype, mode="r") if s["tokens"] else np.empty(0, dtype)  # (no empty maps)
        hi, n_eos, digest = int(t.max(initial=0)), int((t == eos).sum()), sha256(f)
        last = int(t[-1]) if len(t) else None
        problems += [f"{f}: {problem}" for bad, problem in [
            (digest != s["sha256"], f"sha256 {digest[:16]}... differs from the "
             f"manifest's {s['sha256'][:16]}...: the file changed after prepare.py wrote it"),
            (hi != s["max_token_id"], f"max token id {hi}, the manifest says {s['max_token_id']}"),
            (hi >= vocab, f"token id {hi} is outside the vocabulary of {vocab}"),
            (n_eos != s["documents"], f"{n_eos} EOS tokens, the manifest says {s['documents']} "
             "documents"),
            (last != eos, f"ends with token {last}, not EOS {eos}: a document is cut at the shard "
             "end")] if bad]
    if m["tokenizer"].get("name") == "file":  # there, and the file the spec names
        try:
            load_tokenizer(m["tokenizer"], directory)
        except DataError as e:
            problems.append(str(e))
    return problems


def info(directory, sample_tokens=300):
    """(manifest, a decoded sample of the first training document, None if no tokenizer loads)."""
    m, source = read_manifest(directory), open_tokens(directory, "train")
    ids = source.read(0, min(sample_tokens, source.num_tokens)).tolist()
    ids = ids[: ids.index(m["eos_id"]) + 1] if m["eos_id"] in ids else ids
    try:
        return m, load_tokenizer(m["tokenizer"], directory).decode(ids)
    except DataError:
        return m, None


# -----------------------------------------------------------------------------
# command line: `prepare.py [INPUT ...]`, `prepare.py verify DIR`, `prepare.py info DIR`


@contextlib.contextmanager
def _stoppable(out: Path):
    """Ctrl-C and SIGTERM end the command with one line and exit 130 or 143. SIGTERM raises
    KeyboardInterrupt too: both unwind alike (replace_dir drops the stage, _workers the workers)."""
    manifest = out / MANIFEST
    before = manifest.is_file() and manifest.read_bytes()
    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
        raise KeyboardInterrupt("SIGTERM")
    handler = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt as e:
        what, code = ("SIGTERM", 143) if e.args == ("SIGTERM",) else ("Ctrl-C (SIGINT)", 130)
        same = (manifest.is_file() and manifest.read_bytes()) == before
        kept = "is unchanged" if same else "holds the new output, which was complete"
        print(f"stopped by {what}: {out} {kept}", file=sys.stderr, flush=True)
        raise typer.Exit(code) from None
    finally:
        signal.signal(signal.SIGTERM, handler)


def main(
    inputs: Annotated[Optional[List[Path]], typer.Argument(
        help="Files or directories of .txt/.md/.py/.jsonl (optionally .gz) and .parquet. None: the "
        "demo corpus, Python's standard library sources.")] = None,
    out: Annotated[Optional[Path], Option("--out-dir", "-o", help=(
        f"Output directory (default: {DEMO_OUT} for the demo; required with INPUT)."))] = None,
    tokenizer: Annotated[Optional[str], Option(help="gpt2, byte, or a path to a Hugging Face "
        "tokenizer.json (default: byte for the demo, gpt2 otherwise).")] = None,
    **options,
):
    """Tokenize text into shards + manifest.json for train.py. Also `prepare.py verify DIR`:
    re-hash and range-check every shard; `prepare.py info DIR`: statistics and a decoded sample."""
    with cli_errors(DataError, OSError), _stoppable(out or DEMO_OUT):
        if inputs and out is None:
            raise DataError("--out-dir: expected an output directory for your INPUT files (only "
                            "the demo has one)")
        files = find_inputs(inputs) if inputs else demo_inputs()
        if not inputs:
            print(f"no INPUT: building the demo corpus, {len(files)} .py files of Python's "
                  "standard library")
            if options["val_fraction"] is None:
                options["val_fraction"] = 0.01
        prepare(files, out or DEMO_OUT, tokenizer or ("gpt2" if inputs else "byte"), progress=True,
                **options)


# the flags are main's own three and then Options' fields, written once
main.__signature__ = inspect.Signature([*list(inspect.signature(main).parameters.values())[:3],
                                        *inspect.signature(Options).parameters.values()])


def verify_main(directory: Path = typer.Argument(..., help="A prepare.py output directory.")):
    """Re-hash every shard, check sizes, token ranges and documents; exit 0 if all is well."""
    if problems := verify(directory):
        print(f"{directory}: {len(problems)} problem{'s' * (len(problems) > 1)}",
              *(f"  - {p}" for p in problems), sep="\n", file=sys.stderr)
        raise typer.Exit(2)
    print(f"{directory}: all shards match the manifest")


def info_main(directory: Path = typer.Argument(..., help="A prepare.py output directory.")):
    """Tokens, documents, shards, tokenizer, and a decoded sample of the first training document."""
    with cli_errors(DataError):
        m, sample = info(directory)
    for name, s in m["splits"].items():
        print(f"{name}: {s['tokens']:,} tokens, {s['documents']:,} documents in "
              f"{len(s['shards'])} shards, max token id {s['max_token_id']}")
    print(f"tokenizer {m['tokenizer']}, vocab_size {m['vocab_size']:,}, eos_id {m['eos_id']}, "
          f"dtype {m['dtype']}")
    print(f"stats {m.get('stats', {})}")
    print(f"sample:\n{sample}" if sample is not None else
          "sample: (the tokenizer could not be loaded here)")


if __name__ == "__main__":
    # Subcommands are dispatched by hand: a Typer group cannot also take free INPUT paths first.
    command = sys.argv.pop(1) if sys.argv[1:2] in (["verify"], ["info"]) else None
    app = typer.Typer(add_completion=False, rich_markup_mode="rich")
    app.command()({"verify": verify_main, "info": info_main}.get(command, main))
    app(prog_name=f"prepare.py {command}" if command else "prepare.py")
