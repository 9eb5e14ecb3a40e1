"""Turn text into the token shards data.py reads.

    python prepare.py                          # demo corpus: Python's stdlib -> data/demo
    python prepare.py corpus/ extra.jsonl.gz --out-dir data/mine --tokenizer gpt2
    python prepare.py fineweb/*.parquet --out-dir data/web   # a row a document: "text"
    python prepare.py verify data/mine         # re-hash and range-check every shard
    python prepare.py info data/mine           # statistics and a decoded sample

Inputs: files or directories (searched recursively, sorted by path) of .txt, .md and .py
files (a file is a document) and .jsonl files (a line is a document: its "text" field),
each optionally gzipped, and .parquet files (a row is a document: its "text" column, a
null an empty one); --text-field names another field or column. Each document ends with
the tokenizer's EOS id; every 1/f-th goes to the validation split (_is_val says which),
the rest to train, each split cut at document ends into shards of about --shard-tokens
tokens. --workers processes tokenize in bounded memory and in input order: the output is
byte-identical for any worker count.

The output is built beside --out-dir and put in its place only when complete
(data.replace_dir): a failure or a kill never leaves a half-written directory that looks
valid or loses the previous output, and files you added to it move into the new one.
Ctrl-C and SIGTERM stop the command, workers included, within a second or so (exit 130 or
143).
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
from typer import Option

from data import (EOS_TOKENS, MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, DataError,
                  cli_errors, load_tokenizer, open_tokens, read_manifest, refuse_empty_path,
                  replace_dir, sha256, shard_problem, split_totals, write_atomic)

DEMO_OUT = Path("data/demo")
# Text per task sent to a worker: enough to amortise the copy between processes.
BATCH_BYTES = 1 << 20
# Rows per batch read from a Parquet file: a bounded slice of one row group.
PARQUET_ROWS = 1024


@dataclasses.dataclass
class Options:
    """How prepare() cuts and tokenizes: the fields are also the command's flags."""
    shard_tokens: Annotated[int, Option(
        min=1,
        help="Most tokens per shard; shards end at document ends (a longer one gets its "
        "own).")] = 50_000_000
    val_fraction: Annotated[Optional[float], Option(
        help="Fraction of documents held out for validation, at least one when > 0 "
        "(default: 0.01 for the demo, 0.0005 otherwise).")] = None
    workers: Annotated[Optional[int], Option(
        min=1,
        help="Processes (default: all cores).")] = None
    eos_token: Annotated[Optional[str], Option(
        help="A tokenizer file's end-of-document token, if not one of "
        f"{', '.join(EOS_TOKENS)}.")] = None
    overwrite: Annotated[bool, Option(
        help="Replace an --out-dir that holds something other than a previous "
        "output.")] = False
    text_field: Annotated[str, Option(
        help="The text column of .parquet files and the text field of .jsonl "
        "records.")] = "text"


def _plural(n):
    """The "s" of a noun counted n, none for one."""
    if n > 1:
        return "s"
    return ""


# -----------------------------------------------------------------------------
# inputs: which files, and the documents in them


def _kind(path: Path):
    """"parquet", "jsonl", "text", or None for a file that is no input.

    A Parquet file is compressed inside, never gzipped whole."""
    if path.name.endswith(".parquet"):
        return "parquet"
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith((".txt", ".md", ".py")):
        return "text"
    return None


def find_inputs(paths) -> list:
    """Input files in order: each path in turn, a directory's files (hidden directories
    skipped) sorted by their path inside it; a file named twice is read once."""
    files = []
    for p in [Path(x) for x in paths]:
        if not p.exists():
            raise DataError(f"{p}: no such file or directory")
        # A file named must be an input; in a directory, other files are passed over.
        if p.is_file() and _kind(p) is None:
            raise DataError(f"{p}: expected a .txt, .md, .py or .jsonl file (optionally .gz) "
                            f"or a .parquet file, found {p.suffix or 'no suffix'}")
        found = []
        if p.is_file():
            found.append(p)
        # os.walk yields nothing for a file.
        for root, dirs, names in os.walk(p):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in names:
                if _kind(Path(name)) is not None:
                    found.append(Path(root) / name)
        # Sorted by path: os.walk's order is the file system's, and the output must not
        # depend on it.
        files += sorted(found, key=lambda f: f.relative_to(p).parts)
    if not files:
        raise DataError(f"no documents found in {', '.join(map(str, paths))}: expected .txt, "
                        ".md, .py, .jsonl or .parquet files")
    # Each file once, in the order first named.
    return list(dict.fromkeys(files))


def demo_inputs(root=None) -> list:
    """Every .py file of the standard library (or `root`) but tests and packages.

    They are sorted by their path inside it."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    # Tests and installed packages are not the library's own code: they would swamp it.
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for f in root.rglob("*.py"):
        folders = f.relative_to(root).parts[:-1]
        if not skip & set(folders):
            files.append(f)
    return sorted(files, key=lambda f: f.relative_to(root).parts)


def check_parquet(files, text_field="text"):
    """Refuse a .parquet input without a text_field column.

    Only the footers are read, before any work."""
    for f in files:
        if _kind(f) != "parquet":
            continue
        # Imported only for Parquet inputs: it takes a while.
        import pyarrow as pa
        import pyarrow.parquet as pq
        # Only the footer is read: a wrong column is refused before any tokenizing.
        try:
            schema = pq.read_schema(f)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{f}: expected a Parquet file, found one pyarrow cannot read "
                            f"({e})") from None
        if text_field not in schema.names:
            columns = ", ".join(map(repr, schema.names))
            raise DataError(f"{f}: expected a column {text_field!r} (--text-field), found the "
                            f"columns {columns}")
        t = schema.field(text_field).type
        text = pa.types.is_string(t) or pa.types.is_large_string(t)
        if not text and not pa.types.is_string_view(t):
            raise DataError(f"{f}: expected column {text_field!r} to hold text (an Arrow "
                            f"string type), found {t}; name the text column with --text-field")


def _parquet_documents(i, f, text_field):
    """The documents of Parquet file f, the i-th input: one a row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        # pyarrow's default pre-buffering reads the column of the whole file ahead, so
        # memory would grow with the file: read one row group's column in 1 MiB pieces.
        with pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20) as pf:
            batches = pf.iter_batches(batch_size=PARQUET_ROWS, columns=[text_field])
            for batch in batches:
                texts = batch.column(0).cast(pa.large_binary()).to_pylist()
                # A null is an empty document, which is counted and skipped.
                for raw in texts:
                    yield "text", raw or b"", (i, f, 0)
    except (pa.ArrowException, OSError) as e:
        # A corrupt page or row group, or a file gone.
        raise DataError(f"{f}: could not read it as Parquet ({e})") from None


def read_documents(files, text_field="text"):
    """Yield (kind, raw bytes, (file index, file, line number)) per document,
    streaming: one file, line or slice of a Parquet row group at a time (a Parquet row
    is a "text" document)."""
    for i, f in enumerate(files):
        if _kind(f) == "parquet":
            yield from _parquet_documents(i, f, text_field)
            continue
        # A gzipped file is decompressed as it is read.
        opener = open
        if f.name.endswith(".gz"):
            opener = gzip.open
        try:
            with opener(f, "rb") as fh:
                if _kind(f) == "text":
                    yield "text", fh.read(), (i, f, 0)
                    continue
                # Blank lines (a trailing newline, say) are not documents.
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        yield "jsonl", line, (i, f, n)
        except (OSError, EOFError, zlib.error) as e:
            # An unreadable file, or a corrupt gzip stream.
            raise DataError(f"{f}: could not read it ({e})") from None


def _batched(documents):
    """Lists of about BATCH_BYTES of documents."""
    # A batch ends after a document, never inside one.
    batch = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc[1])
        if size >= BATCH_BYTES:
            yield batch
            batch = []
            size = 0
    if batch:
        yield batch


# -----------------------------------------------------------------------------
# tokenization, in worker processes

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
JSON_TYPES = {dict: "object", list: "list", str: "string", bool: "boolean",
              type(None): "null"}
WORKER_DIED = "a tokenizer process died; rerun with fewer --workers if memory ran short"


def _json_text(line, text_field, where):
    """The text field of a jsonl line, or a DataError.

    Returns (the text, lone surrogates replaced; their count)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: expected one JSON object per line, found invalid JSON "
                        f"({e})") from None
    # The field's name as JSON spells it, quotes and all, for the message.
    field = json.dumps(text_field)
    if not isinstance(obj, dict):
        what = JSON_TYPES.get(type(obj), "number")
        found = f"a JSON {what}"
    elif not isinstance(obj.get(text_field), str):
        what = JSON_TYPES.get(type(obj.get(text_field)), "number")
        if text_field in obj:
            found = f"a {what} in {field}, not a string"
        else:
            keys = ", ".join(map(json.dumps, sorted(obj)[:5]))
            found = f"the keys {keys}"
    else:
        # Lone surrogates (\ud800 escapes) have no UTF-8: they become U+FFFD.
        return re.subn("[\ud800-\udfff]", "\ufffd", obj[text_field])
    raise DataError(f"{where}: expected a JSON object with a string {field} field "
                    f"(--text-field), found {found}")


def _encode_batch(tok, docs, dtype, text_field):
    """(tokens (N,), each document then EOS; lengths (D,), 0 for an empty one; the
    count of undecodable byte sequences; text_bytes (D,), the UTF-8 bytes of each
    document's text as tokenized, its EOS counting none)."""
    eos = np.array([tok.eos_id], dtype=dtype)
    pieces = []
    lengths = []
    text_bytes = []
    bad = 0
    for kind, raw, (_, f, lineno) in docs:
        # Count the U+FFFD that replace bytes, not those the text holds.
        text = raw.decode("utf-8", "replace")
        bad += text.count("\ufffd") - raw.count("\ufffd".encode())
        # A jsonl line may hold lone surrogates: they are replaced and counted too.
        if kind == "jsonl":
            text, n = _json_text(text, text_field, f"{f}:{lineno}")
            bad += n
        ids = tok.encode_array(text).astype(dtype, copy=False)
        # The bytes of the text the tokens encode, replacement characters included: the
        # byte tokenizer makes exactly one token of each.
        text_bytes.append(len(text.encode("utf-8")))
        # An empty document is counted, not written.
        if text:
            pieces += [ids, eos]
            lengths.append(len(ids) + 1)
        else:
            lengths.append(0)
    if not pieces:
        pieces = [np.empty(0, dtype)]
    lengths = np.asarray(lengths, dtype=np.int64)
    text_bytes = np.asarray(text_bytes, dtype=np.int64)
    return np.concatenate(pieces), lengths, bad, text_bytes


def _worker(conn, parents_end, tok):
    """A tokenizer process: batches in, their _encode_batch results out.

    An exception is sent back as the result, and raised in the parent."""
    # Ctrl-C reaches every process of the terminal's group: the parent alone decides, and
    # ends the workers with SIGTERM, which must then just end them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # _workers blocked the stop signals while it forked.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    # Closed here, so that recv() ends (EOFError) when the parent is gone.
    parents_end.close()
    # When the parent is gone, so is the work.
    with contextlib.suppress(EOFError, BrokenPipeError):
        for task in iter(conn.recv, None):
            try:
                result = _encode_batch(tok, *task)
            except Exception as e:
                # Raised again in the parent.
                result = e
            conn.send(result)


@contextlib.contextmanager
def _workers(n, tok):
    """n tokenizer processes (their pipes), ended by SIGTERM however the block is left.

    Not a Pool: a pool worker killed while it holds the task queue's lock (SIGTERM to the
    group) hangs terminate()."""
    ctx = multiprocessing.get_context()
    procs = []
    conns = []
    # The stop signals stay blocked until every worker has set its own handlers (the mask
    # is inherited); one that came meanwhile is raised at the unblock, inside the try.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            conns.append(mine)
            proc = ctx.Process(target=_worker, args=(theirs, mine, tok), daemon=True)
            procs.append(proc)
            proc.start()
            # The worker's end lives in the worker alone: its death is an EOF here.
            theirs.close()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield conns
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for proc in procs:
            proc.terminate()
        for proc, conn in zip(procs, conns):
            proc.join()
            conn.close()


def _receive(files_done, conn):
    """A worker's result for a batch, as _encoded yields it, or its exception raised."""
    result = conn.recv()
    if isinstance(result, Exception):
        raise result
    return (files_done, *result)


def _encoded(files, tok, dtype, conns, text_field):
    """Yield (files done, tokens, lengths, undecodable, text bytes) per batch, in input
    order.

    Batch k goes to worker k % n, one at a time each, so memory stays bounded; with no
    conns, the batches are tokenized in this process."""
    batches = _batched(read_documents(files, text_field))
    # Without workers the batches are tokenized here, in order.
    if not conns:
        for docs in batches:
            files_done = docs[-1][2][0] + 1
            yield (files_done, *_encode_batch(tok, docs, dtype, text_field))
        return
    # (files done, pipe) of the batches in the workers, oldest first.
    pending = []
    try:
        for k, docs in enumerate(batches):
            done = None
            # With every worker busy, the oldest result is taken before a batch goes.
            if len(pending) == len(conns):
                done = _receive(*pending.pop(0))
            # Round robin: results come back in the order the batches went.
            conn = conns[k % len(conns)]
            conn.send((docs, dtype, text_field))
            pending.append((docs[-1][2][0] + 1, conn))
            if done:
                yield done
        while pending:
            yield _receive(*pending.pop(0))
    except (EOFError, OSError):
        # A pipe closed: a worker is gone (a crash, the OOM killer).
        raise DataError(WORKER_DIED) from None


# -----------------------------------------------------------------------------
# writing shards


class ShardWriter:
    """One split's shards of whole documents, each within shard_tokens unless one
    document is longer; `shards`: the manifest entries. The directory is a stage, so
    the shards need no temporary names."""

    def __init__(self, directory: Path, split: str, shard_tokens: int):
        self.directory = directory
        self.split = split
        self.shard_tokens = shard_tokens
        self.shards = []
        self.f = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: np.ndarray):
        """Append documents: `tokens` (N,) is their concatenation, `lengths` (D,) their
        sizes, each > 0, `text_bytes` (D,) the UTF-8 bytes of their text."""
        # (D,) where each document ends in `tokens`
        ends = np.cumsum(lengths)
        i = 0
        while i < len(lengths):
            # A document never straddles two shards: one that does not fit starts one.
            is_open = self.f is not None
            if is_open and self.entry["tokens"] + lengths[i] > self.shard_tokens:
                self.close()
            if self.f is None:
                self._open()
            e = self.entry
            begin = 0
            if i:
                begin = int(ends[i - 1])
            room = begin + self.shard_tokens - e["tokens"]
            # Documents i .. j-1 fill the room, or document i alone when it is longer.
            j = max(i + 1, int(np.searchsorted(ends, room, side="right")))
            chunk = tokens[begin : int(ends[j - 1])]
            self.f.write(chunk.data)
            self.hash.update(chunk.data)
            e["tokens"] += len(chunk)
            e["documents"] += j - i
            e["bytes"] += int(text_bytes[i:j].sum())
            e["max_token_id"] = max(e["max_token_id"], int(chunk.max()))
            i = j

    def _open(self):
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self.f = open(self.directory / name, "wb", buffering=1 << 23)
        self.entry = {"file": name, "tokens": 0, "documents": 0, "max_token_id": 0,
                      "bytes": 0}
        # Hashed as it is written: the shard is never read a second time.
        self.hash = hashlib.sha256()

    def close(self):
        # A shard is durable before the manifest that lists it is written.
        if self.f is not None:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.shards.append({**self.entry, "sha256": self.hash.hexdigest()})
            self.f = None


def _is_val(n, f: Fraction):
    """Document n (from 0) is validation's when round((n + 1) f) > round(n f), halves up.

    Every prefix then holds round(prefix * f), spread evenly from about 1 / (2f) on,
    favouring neither the start nor a large first file. When that is none (f > 0), _build
    holds out the last document."""
    p = f.numerator
    q = f.denominator
    # round(x), halves up, is floor(x + 1/2): for x = n p / q, (2 n p + q) // (2 q).
    return (2 * (n + 1) * p + q) // (2 * q) > (2 * n * p + q) // (2 * q)


def _build(stage, files, tok, tok_file, o, show) -> dict:
    """Write into `stage` the shards, the tokenizer file if any and, last, the
    manifest."""
    # Imported here, where it is used: --help and refusals need not wait for it.
    from rich.progress import Progress
    # uint16 holds every id of a vocabulary of up to 65,536 tokens.
    dtype = np.uint16
    if tok.vocab_size > 1 << 16:
        dtype = np.uint32
    writers = {}
    for split in ("train", "val"):
        writers[split] = ShardWriter(stage, split, o.shard_tokens)
    # As a fraction, 0.1 is 1/10 exactly, not the float nearest to it.
    f = Fraction(str(o.val_fraction)).limit_denominator(10**9)
    docs = 0
    empty = 0
    undecodable = 0
    tokens = 0

    def add(toks, lengths, is_val, text_bytes):
        # is_val (D,) says which documents are validation's, v (N,) which tokens are.
        v = np.repeat(is_val, lengths)
        writers["val"].add(toks[v], lengths[is_val], text_bytes[is_val])
        writers["train"].add(toks[~v], lengths[~is_val], text_bytes[~is_val])

    # An empty batch: none is held yet.
    held = (np.empty(0, dtype), np.empty(0, np.int64), np.empty(0, bool),
            np.empty(0, np.int64))
    workers = contextlib.nullcontext()
    if o.workers > 1:
        workers = _workers(o.workers, tok)
    hide = not (show and sys.stdout.isatty())
    # The workers start before the progress bar's thread: forking with threads is unsafe.
    with workers as conns, Progress(disable=hide) as bar:
        stream = _encoded(files, tok, dtype, conns, o.text_field)
        with contextlib.closing(stream):
            task = bar.add_task("tokenizing", total=len(files))
            t0 = time.perf_counter()
            for files_done, toks, lengths, bad, text_bytes in stream:
                undecodable += bad
                empty += int((lengths == 0).sum())
                # Empty documents are not written, so their (zero) bytes go with them.
                text_bytes = text_bytes[lengths > 0]
                lengths = lengths[lengths > 0]
                # Decided per document, in input order: the same for any worker count.
                is_val = _is_val(docs + np.arange(len(lengths), dtype=np.int64), f)
                docs += len(lengths)
                tokens += len(toks)
                speed = tokens / (time.perf_counter() - t0 + 1e-9)
                bar.update(task, completed=files_done, description=f"tokenizing: {docs:,} "
                           f"docs {tokens:,} tokens {speed:,.0f} tok/s")
                # A batch waits for the next: its last document may be validation's.
                if len(lengths):
                    add(*held)
                    held = (toks, lengths, is_val, text_bytes)
    if docs == 0:
        raise DataError(f"no documents found: the {len(files)} input files hold only empty "
                        "documents")
    # When round(docs * f), _is_val's count, is 0, the last document is validation's.
    if 0 < 2 * docs * f < 1:
        held[2][-1] = True
    add(*held)
    for w in writers.values():
        w.close()
    if not writers["train"].shards:
        raise DataError(f"all {docs} documents went to the validation split, none is left "
                        "for training: give more documents or a smaller --val-fraction (0 "
                        "for none)")
    # A tokenizer file travels with the shards: the directory is all a reader needs.
    if tok_file:
        write_atomic(stage / "tokenizer.json", tok_file.read_bytes())
    splits = {}
    for name, w in writers.items():
        splits[name] = {**split_totals(w.shards), "shards": w.shards}
    stats = {
        "input_files": len(files),
        "documents": docs,
        "empty_documents_skipped": empty,
        "undecodable_replaced": undecodable,
        "val_fraction": o.val_fraction,
        "shard_tokens": o.shard_tokens,
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "dtype": np.dtype(dtype).name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "tokenizer": tok.spec,
        "splits": splits,
        "stats": stats,
    }
    # The manifest goes last: the directory is valid only once it is there.
    write_atomic(stage / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def _ours(old: Path) -> set:
    """What of a replaced output is prepare.py's (the rest is a user's, and is kept)."""
    try:
        splits = read_manifest(old)["splits"].values()
    except DataError:
        # Not an earlier output: --overwrite asked to replace it.
        return {p.name for p in old.iterdir()}
    names = {MANIFEST, "tokenizer.json"}
    for split in splits:
        for shard in split["shards"]:
            names.add(shard["file"])
    return names


def _check_options(o, tokenizer, tok_file, out):
    """Refuse what Typer's ranges let through: a NaN --val-fraction passes them."""
    # NaN compares False with everything, so it fails this test.
    if not 0 <= o.val_fraction < 1:
        raise DataError(f"--val-fraction: expected a fraction in [0, 1), found "
                        f"{o.val_fraction}")
    if tok_file and not tok_file.is_file():
        raise DataError(f"--tokenizer: expected gpt2, byte or a tokenizer.json file, found "
                        f"{tokenizer!r} (no such file)")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out-dir {out}: expected a directory, found a file")


def _check_out_dir(out, files, overwrite):
    """Refuse an --out-dir whose replacement would lose something."""
    # The output replaces `out` whole, so an input inside it would be lost.
    inside = [f for f in files if out.resolve() in f.resolve().parents]
    if inside:
        raise DataError(f"--out-dir {out}: contains the input {inside[0]}, and would be "
                        "replaced; write somewhere else")
    # A previous output is replaced; other files only when asked (--overwrite).
    if overwrite or not out.is_dir() or not any(out.iterdir()):
        return
    try:
        read_manifest(out)
    except DataError:
        names = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise DataError(f"--out-dir {out}: expected an empty directory or a previous "
                        f"prepare.py output, found other files ({names}...); pick another "
                        "--out-dir, or pass --overwrite to replace it") from None


def _report(m, out, seconds, workers, log):
    """The lines that say what a run wrote."""
    stats = m["stats"]
    train = m["splits"]["train"]
    val = m["splits"]["val"]
    tokens = train["tokens"] + val["tokens"]
    # The speed covers the whole run: reading, tokenizing and writing.
    log(f"wrote {tokens:,} tokens ({stats['documents']:,} documents) to {out} in "
        f"{seconds:.1f}s ({tokens / seconds:,.0f} tokens/s, {workers} "
        f"worker{_plural(workers)}): train {train['tokens']:,} tokens in "
        f"{len(train['shards'])} shards, val {val['tokens']:,} tokens")
    bad = stats["undecodable_replaced"]
    empty = stats["empty_documents_skipped"]
    # The notes say only what happened: none for nothing replaced or skipped.
    notes = []
    if bad > 0:
        notes.append(f"replaced {bad:,} undecodable byte sequence{_plural(bad)} with U+FFFD")
    if empty > 0:
        notes.append(f"skipped {empty:,} empty document{_plural(empty)}")
    if notes:
        log(f"note: {'; '.join(notes)}")


def prepare(files, out, tokenizer="gpt2", log=print, progress=False, **options) -> dict:
    """Tokenize `files` (from find_inputs or demo_inputs) into the shard directory
    `out`; return the manifest. `options`: Options' fields, in Typer's ranges; the
    rest is checked before work."""
    o = Options(**options)
    # The defaults for real corpora: 0.05% held out, a worker per core.
    if o.val_fraction is None:
        o.val_fraction = 0.0005
    if o.workers is None:
        o.workers = os.cpu_count() or 1
    out = Path(out)
    # The swap renames directories: a link is replaced behind it, not itself.
    if out.is_symlink():
        out = out.resolve()
    # Any tokenizer but the two built in (their EOS too) is a tokenizer file.
    tok_file = None
    if tokenizer not in ("byte", "gpt2"):
        tok_file = Path(tokenizer)
    # Every input is checked before any work, and before anything is written.
    _check_options(o, tokenizer, tok_file, out)
    check_parquet(files, o.text_field)
    if tok_file is None:
        spec = {"name": tokenizer}
    else:
        spec = {"name": "file", "file": "tokenizer.json", "sha256": sha256(tok_file),
                "eos_token": o.eos_token}
    tok = load_tokenizer(spec, path=tok_file)
    _check_out_dir(out, files, o.overwrite)
    t0 = time.perf_counter()

    # The shards are built in a stage beside `out`, which then takes its place.
    def fill(stage):
        return _build(stage, files, tok, tok_file, o, progress)

    try:
        m = replace_dir(out, fill, _ours)
    except OSError as e:
        # A full disk, or permissions: say where, and that nothing was lost.
        raise DataError(f"could not write {e.filename or out} ({e.strerror or e}); free disk "
                        f"space or fix the permissions, then run again: {out} is "
                        "unchanged") from None
    _report(m, out, time.perf_counter() - t0, o.workers, log)
    return m


# -----------------------------------------------------------------------------
# verify and info


def _shard_problems(f, s, dtype, eos, vocab) -> list:
    """What is wrong with shard file f against its manifest entry s."""
    # np.memmap refuses an empty file.
    if s["tokens"]:
        t = np.memmap(f, dtype, mode="r")
    else:
        t = np.empty(0, dtype)
    hi = int(t.max(initial=0))
    n_eos = int((t == eos).sum())
    digest = sha256(f)
    last = None
    if len(t):
        last = int(t[-1])
    # Every problem of the shard is listed, not only the first.
    problems = []
    if digest != s["sha256"]:
        problems.append(f"sha256 {digest[:16]}... differs from the manifest's "
                        f"{s['sha256'][:16]}...: the file changed after prepare.py wrote it")
    if hi != s["max_token_id"]:
        problems.append(f"max token id {hi}, the manifest says {s['max_token_id']}")
    if hi >= vocab:
        problems.append(f"token id {hi} is outside the vocabulary of {vocab}")
    if n_eos != s["documents"]:
        problems.append(f"{n_eos} EOS tokens, the manifest says {s['documents']} documents")
    if last != eos:
        problems.append(f"ends with token {last}, not EOS {eos}: a document is cut at the "
                        "shard end")
    return [f"{f}: {problem}" for problem in problems]


def verify(directory) -> list:
    """The problems of a prepared directory: each shard's size, sha256, max token id, EOS
    count and final EOS against the manifest (which read_manifest checks), and the
    tokenizer file."""
    directory = Path(directory)
    try:
        m = read_manifest(directory)
    except DataError as e:
        return [str(e)]
    dtype = np.dtype(m["dtype"])
    # Each shard is checked on its own: one bad shard does not hide another.
    problems = []
    for split in m["splits"].values():
        for s in split["shards"]:
            f = directory / s["file"]
            # A shard of the wrong size is not read.
            problem = shard_problem(f, s, m["dtype"])
            if problem:
                problems.append(problem)
                continue
            problems += _shard_problems(f, s, dtype, m["eos_id"], m["vocab_size"])
    # A tokenizer file must be there, and be the file the spec names.
    if m["tokenizer"].get("name") == "file":
        try:
            load_tokenizer(m["tokenizer"], directory)
        except DataError as e:
            problems.append(str(e))
    return problems


def info(directory, sample_tokens=300):
    """(manifest, a decoded sample of the first training document).

    The sample is None when no tokenizer loads."""
    m = read_manifest(directory)
    source = open_tokens(directory, "train")
    ids = source.read(0, min(sample_tokens, source.num_tokens)).tolist()
    # The sample ends with the first document's EOS.
    if m["eos_id"] in ids:
        ids = ids[: ids.index(m["eos_id"]) + 1]
    try:
        return m, load_tokenizer(m["tokenizer"], directory).decode(ids)
    except DataError:
        return m, None


# -----------------------------------------------------------------------------
# command line: `prepare.py [INPUT ...]`, `prepare.py verify DIR`, `prepare.py info DIR`


def _read_or_none(path):
    """The bytes of file `path`, or None when there is no such file."""
    if path.is_file():
        return path.read_bytes()
    return None


@contextlib.contextmanager
def _stoppable(out: Path):
    """Ctrl-C and SIGTERM end the command with one line and exit 130 or 143.

    SIGTERM raises KeyboardInterrupt too: both unwind alike (replace_dir drops the stage,
    _workers the workers)."""
    # The manifest before the run tells, after a stop, whether the output changed.
    manifest = out / MANIFEST
    before = _read_or_none(manifest)

    def on_sigterm(signum, frame):
        # A second one must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt("SIGTERM")

    handler = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt as e:
        # The exit status is 128 + the signal's number, as a shell reports it.
        what = "Ctrl-C (SIGINT)"
        code = 130
        if e.args == ("SIGTERM",):
            what = "SIGTERM"
            code = 143
        kept = "is unchanged"
        if _read_or_none(manifest) != before:
            kept = "holds the new output, which was complete"
        print(f"stopped by {what}: {out} {kept}", file=sys.stderr, flush=True)
        raise typer.Exit(code) from None
    finally:
        signal.signal(signal.SIGTERM, handler)


# Typer passes the path arguments on as the strings typed (path_type=str), so that an
# empty one can be told from "." and refused; the commands make them Paths after that.
def main(
    inputs: Annotated[Optional[List[Path]], typer.Argument(
        path_type=str,
        help="Files or directories of .txt/.md/.py/.jsonl (optionally .gz) and .parquet. "
        "None: the demo corpus, Python's standard library sources.")] = None,
    out: Annotated[Optional[Path], Option(
        "--out-dir", "-o",
        path_type=str,
        help=f"Output directory (default: {DEMO_OUT} for the demo; required with "
        "INPUT).")] = None,
    tokenizer: Annotated[Optional[str], Option(
        help="gpt2, byte, or a path to a Hugging Face tokenizer.json (default: byte for "
        "the demo, gpt2 otherwise).")] = None,
    **options,
):
    """Tokenize text into shards + manifest.json for train.py.
    Also `prepare.py verify DIR`: re-hash and range-check every shard;
    `prepare.py info DIR`: statistics and a decoded sample."""
    with cli_errors(DataError, OSError):
        # Refused before anything is read or written.
        for path in inputs or []:
            refuse_empty_path("INPUT", path, "a file or directory")
        refuse_empty_path("--out-dir", out, "a directory")
        refuse_empty_path("--tokenizer", tokenizer, "gpt2, byte or a tokenizer.json file")
        # Only the demo has a default output directory.
        if out is None:
            out_dir = DEMO_OUT
        else:
            out_dir = Path(out)
        with _stoppable(out_dir):
            if inputs and out is None:
                raise DataError("--out-dir: expected an output directory for your INPUT "
                                "files (only the demo has one)")
            if inputs:
                files = find_inputs([Path(path) for path in inputs])
                if tokenizer is None:
                    tokenizer = "gpt2"
            else:
                # The demo: the library's sources, the byte tokenizer, 1% held out.
                files = demo_inputs()
                print(f"no INPUT: building the demo corpus, {len(files)} .py files of "
                      "Python's standard library")
                if options["val_fraction"] is None:
                    options["val_fraction"] = 0.01
                if tokenizer is None:
                    tokenizer = "byte"
            prepare(files, out_dir, tokenizer, progress=True, **options)


# The flags are main's own three and then Options' fields, written once.
_main_flags = list(inspect.signature(main).parameters.values())[:3]
_option_flags = list(inspect.signature(Options).parameters.values())
main.__signature__ = inspect.Signature(_main_flags + _option_flags)

# The argument of `verify` and `info`, as the strings typed (see main).
Directory = Annotated[Path, typer.Argument(path_type=str,
                                           help="A prepare.py output directory.")]


def _refuse_empty_directory(directory):
    """The DIRECTORY of `verify` or `info` as a Path, or exit 2 for an empty string."""
    with cli_errors(DataError):
        refuse_empty_path("DIRECTORY", directory, "a prepare.py output directory")
    return Path(directory)


def verify_main(directory: Directory):
    """Re-hash every shard, check sizes, token ranges and documents;
    exit 0 if all is well."""
    directory = _refuse_empty_directory(directory)
    # Problems are a failure, as a refusal is: exit 2.
    problems = verify(directory)
    if problems:
        lines = [f"  - {p}" for p in problems]
        print(f"{directory}: {len(problems)} problem{_plural(len(problems))}", *lines,
              sep="\n", file=sys.stderr)
        raise typer.Exit(2)
    print(f"{directory}: all shards match the manifest")


def info_main(directory: Directory):
    """Tokens, documents, shards, tokenizer,
    and a decoded sample of the first training document."""
    directory = _refuse_empty_directory(directory)
    with cli_errors(DataError):
        m, sample = info(directory)
    for name, s in m["splits"].items():
        line = (f"{name}: {s['tokens']:,} tokens, {s['documents']:,} documents in "
                f"{len(s['shards'])} shards, max token id {s['max_token_id']}")
        # Manifests from before the byte counts have none.
        if "bytes" in s:
            line += f", {s['bytes']:,} bytes of text"
        print(line)
    print(f"tokenizer {m['tokenizer']}, vocab_size {m['vocab_size']:,}, eos_id "
          f"{m['eos_id']}, dtype {m['dtype']}")
    print(f"stats {m.get('stats', {})}")
    if sample is None:
        print("sample: (the tokenizer could not be loaded here)")
    else:
        print(f"sample:\n{sample}")


if __name__ == "__main__":
    # Subcommands are dispatched by hand: a Typer group cannot take free INPUT paths.
    command = None
    if sys.argv[1:2] in (["verify"], ["info"]):
        command = sys.argv.pop(1)
    app = typer.Typer(add_completion=False, rich_markup_mode="rich")
    app.command()({"verify": verify_main, "info": info_main}.get(command, main))
    prog = "prepare.py"
    if command:
        prog = f"prepare.py {command}"
    app(prog_name=prog)
