"""prepare.py end to end: byte, gpt2 and tokenizer-file corpora, shards, splits, hashes, verify, bad
input, kills."""
import fcntl
import gzip
import hashlib
import json
import math
import multiprocessing
import os
import pickle
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import prepare
from data import BatchConfig, Batches, DataError, open_tokens, read_manifest
from data import load_tokenizer
from prepare import demo_inputs, find_inputs, verify

ROOT = Path(__file__).resolve().parent.parent
GPT2_CACHE_NAME = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"  # tiktoken's cache name for r50k_base


def quiet(_):
    pass


def names(d):
    """What a directory holds. Beside an output prepare.py leaves only `.NAME.lock`, the file its
    runs lock (a flock needs a file that stays): no stage, no old output."""
    return sorted(p.name for p in d.iterdir())


def run(inputs, out, tokenizer="byte", **kw):
    kw = {"shard_tokens": 200, "val_fraction": 0.1, "workers": 1, "log": quiet, **kw}
    return prepare.prepare(find_inputs(inputs), out, tokenizer, **kw)


@pytest.fixture
def gpt2(tmp_path_factory, monkeypatch):
    """tiktoken pointed at the local GPT-2 BPE file: no network needed."""
    env = os.environ.get("MAMBA3_GPT2_TIKTOKEN")
    src = Path(env) if env else ROOT.parent / "shared" / "tokenizers" / "gpt2.tiktoken"
    if not src.is_file():
        pytest.skip(f"no local GPT-2 BPE file at {src} (set MAMBA3_GPT2_TIKTOKEN to one)")
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    shutil.copy(src, cache / GPT2_CACHE_NAME)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    import tiktoken

    return tiktoken.get_encoding("r50k_base")


def make_corpus(root: Path):
    """Write a small corpus of every input kind; return its documents in the documented order
    (files sorted by path inside the directory; jsonl lines in order; empty documents skipped)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "é", "漢字", "🙂", "def", "return", "\n", "  ",
             "<|endoftext|>"]
    sentence = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    files = {
        "a.txt": "Hello world.\n" + sentence(40),
        "sub/b.md": "# Title\n\n" + sentence(25),
        "sub/deeper/c.py": "def f(x):\n    return x + 1\n" * 4,
        "empty.txt": "",
    }
    docs_by_file = {name: [text] if text else [] for name, text in files.items()}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    lines = [sentence(int(rng.integers(1, 60))) for _ in range(40)]
    records = (json.dumps({"text": t, "id": i}) for i, t in enumerate(lines))
    (root / "d.jsonl").write_text("\n".join(records) + "\n\n")
    docs_by_file["d.jsonl"] = lines
    gz = [sentence(int(rng.integers(1, 30))) for _ in range(25)]
    with gzip.open(root / "e.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in gz))
    docs_by_file["e.jsonl.gz"] = gz
    # 3 undecodable bytes
    (root / "latin1.txt").write_bytes("café crème, naïve\n".encode("latin-1"))
    docs_by_file["latin1.txt"] = ["caf\ufffd cr\ufffdme, na\ufffdve\n"]
    (root / "ignored.csv").write_text("not,a,document\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("hidden directories are skipped")
    order = sorted(docs_by_file, key=lambda name: Path(name).parts)
    return [doc for name in order for doc in docs_by_file[name]]


def val_docs(n_docs, fraction):
    """The documented rule, computed the slow way: document n (from 1) when round(n * f) grows
    there, halves rounded up; when that is none, the last document."""
    f, half = Fraction(str(fraction)), Fraction(1, 2)
    chosen = {n - 1 for n in range(1, n_docs + 1)
              if math.floor(n * f + half) > math.floor((n - 1) * f + half)}
    return chosen or ({n_docs - 1} if f else set())


def read_split(out, manifest, split):
    dtype = np.dtype(manifest["dtype"])
    return [np.fromfile(out / s["file"], dtype=dtype) for s in manifest["splits"][split]["shards"]]


def check_output(out, manifest, expected_docs, fraction, shard_tokens):
    """Every promise of prepare.py about `out`, against the expected per-document token lists (EOS
    included)."""
    eos, val = manifest["eos_id"], val_docs(len(expected_docs), fraction)
    for split in ("train", "val"):
        want = [d for n, d in enumerate(expected_docs) if (n in val) == (split == "val")]
        shards = read_split(out, manifest, split)
        stream = np.concatenate(shards) if shards else np.empty(0, np.int64)
        np.testing.assert_array_equal(stream, np.concatenate(want) if want else [])
        summary = manifest["splits"][split]
        assert summary["tokens"] == len(stream) and summary["documents"] == len(want)
        for shard, tokens in zip(summary["shards"], shards):
            assert tokens[-1] == eos  # a shard ends at a document end
            assert shard["documents"] == int((tokens == eos).sum())  # EOS only ends documents
            assert shard["tokens"] == len(tokens) and shard["max_token_id"] == int(tokens.max())
            assert shard["tokens"] <= shard_tokens or shard["documents"] == 1
            assert shard["sha256"] == hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest()
    assert len(manifest["splits"]["val"]["shards"]) >= 1
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".tmp") == []


# -----------------------------------------------------------------------------
# end to end


@pytest.mark.smoke
def test_byte_corpus_end_to_end(tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    manifest = run([tmp_path / "corpus"], tmp_path / "out", "byte", shard_tokens=200,
                   val_fraction=0.1)
    assert (manifest["dtype"], manifest["vocab_size"], manifest["eos_id"]) == ("uint16", 257, 256)
    assert manifest["tokenizer"] == {"name": "byte"}
    expected = [np.array(list(d.encode("utf-8")) + [256]) for d in docs]
    check_output(tmp_path / "out", manifest, expected, 0.1, 200)
    assert len(manifest["splits"]["train"]["shards"]) > 3
    stats = manifest["stats"]
    assert stats["undecodable_replaced"] == 3 and stats["empty_documents_skipped"] == 1
    run([tmp_path / "corpus"], tmp_path / "out2", "byte", shard_tokens=200, val_fraction=0.1,
        workers=2)
    for f in (tmp_path / "out").iterdir():  # byte-identical with 2 workers
        assert f.read_bytes() == (tmp_path / "out2" / f.name).read_bytes(), f.name
    # what data.py reads is the same stream
    source = open_tokens(tmp_path / "out", "val")
    val = val_docs(len(expected), 0.1)
    want_val = np.concatenate([e for n, e in enumerate(expected) if n in val])
    np.testing.assert_array_equal(source.read(0, source.num_tokens), want_val)
    assert source.tokenizer == {"name": "byte"} and source.eos_id == 256


@pytest.mark.smoke
def test_gpt2_corpus_equals_direct_tiktoken_and_any_worker_count(gpt2, tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        manifest = run([tmp_path / "corpus"], out, "gpt2", shard_tokens=150, val_fraction=0.05,
                       workers=workers)
        outs[workers] = out
    assert (manifest["vocab_size"], manifest["eos_id"]) == (50257, 50256)
    assert manifest["tokenizer"] == {"name": "gpt2"}
    expected = [np.array(gpt2.encode_ordinary(d) + [50256]) for d in docs]
    assert all(50256 not in e[:-1] for e in expected)  # "<|endoftext|>" in a text is plain text
    check_output(outs[2], manifest, expected, 0.05, 150)
    files = sorted(p.name for p in outs[1].iterdir())
    assert files == sorted(p.name for p in outs[2].iterdir())
    for name in files:  # byte-identical output, manifest included
        assert (outs[1] / name).read_bytes() == (outs[2] / name).read_bytes(), name
    tok = load_tokenizer(manifest["tokenizer"])
    assert tok.decode(tok.encode(docs[0])) == docs[0]
    again = pickle.loads(pickle.dumps(tok))  # spawned workers (macOS) get the tokenizer pickled
    assert again.encode(docs[0]) == tok.encode(docs[0]) and again.decode([again.eos_id])


def test_tokenizer_file_is_copied_and_rebuilt_from_its_spec(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    docs = make_corpus(tmp_path / "corpus")
    t = tokenizers.Tokenizer(tokenizers.models.BPE())
    t.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=alphabet)
    t.train_from_iterator(docs, trainer)
    path = tmp_path / "my-bpe.json"
    t.save(str(path))
    manifest = run([tmp_path / "corpus"], tmp_path / "out", str(path), val_fraction=0.1)
    spec = manifest["tokenizer"]
    assert spec == {"name": "file", "file": "tokenizer.json", "eos_token": "<|endoftext|>",
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == path.read_bytes()
    tok = load_tokenizer(spec, tmp_path / "out")  # what sample.py does with a checkpoint's spec
    again = pickle.loads(pickle.dumps(tok))  # spawned workers (macOS) get the tokenizer pickled
    assert again.encode(docs[0]) == tok.encode(docs[0]) and again.spec == spec
    eos = t.token_to_id("<|endoftext|>")
    assert tok.eos_id == manifest["eos_id"] == eos
    t.encode_special_tokens = True
    expected = [np.array(t.encode(d, add_special_tokens=False).ids + [eos]) for d in docs]
    check_output(tmp_path / "out", manifest, expected, 0.1, 200)
    assert verify(tmp_path / "out") == []
    spawn = multiprocessing.get_context("spawn")
    with pytest.MonkeyPatch.context() as mp:  # workers started by spawn (macOS) tokenize alike
        mp.setattr(prepare.multiprocessing, "get_context", lambda s=spawn: s)
        run([tmp_path / "corpus"], tmp_path / "spawned", str(path), val_fraction=0.1, workers=2)
    for f in (tmp_path / "out").iterdir():
        assert (tmp_path / "spawned" / f.name).read_bytes() == f.read_bytes(), f.name
    (tmp_path / "out" / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="tokenizer.json: expected sha256"):
        load_tokenizer(spec, tmp_path / "out")
    assert any("tokenizer.json" in p for p in verify(tmp_path / "out"))


@pytest.mark.smoke
def test_tokenizer_specs_round_trip():
    byte = load_tokenizer({"name": "byte"})
    text = "naïve <|endoftext|> 🙂"
    assert byte.encode(text) == list(text.encode())
    assert byte.decode(byte.encode(text) + [256]) == text + "<|endoftext|>"
    with pytest.raises(DataError, match="byte, gpt2 or file"):
        load_tokenizer({"name": "sentencepiece"})
    with pytest.raises(DataError, match="tokenizer file missing"):
        load_tokenizer({"name": "file", "file": "tokenizer.json", "sha256": "0"}, "/nonexistent")


def test_demo_corpus_builds(tmp_path):
    # The builder's root is an argument: here a small real part of the standard library.
    root = Path(json.__file__).parent
    files = demo_inputs(root)
    assert [f.name for f in files] == sorted(f.name for f in root.glob("*.py"))
    manifest = prepare.prepare(files, tmp_path / "demo", "byte", val_fraction=0.01, workers=2,
                               log=quiet)
    expected = [np.array(list(f.read_bytes()) + [256]) for f in files]
    check_output(tmp_path / "demo", manifest, expected, 0.01, 50_000_000)
    x, y = next(Batches(open_tokens(tmp_path / "demo"), BatchConfig(64, 4, 4)))
    assert x.shape == (4, 64)


@pytest.mark.slow
def test_demo_cli_builds_the_full_stdlib_corpus(tmp_path):
    # The quickstart's first command, as a user runs it: no INPUT, output in ./data/demo.
    r = subprocess.run([sys.executable, str(ROOT / "prepare.py")], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "demo"
    m = json.loads((out / "manifest.json").read_text())
    assert m["tokenizer"] == {"name": "byte"} and m["splits"]["train"]["tokens"] > 1_000_000
    assert m["stats"]["input_files"] == len(demo_inputs())
    assert m["splits"]["val"]["documents"] == len(val_docs(m["stats"]["documents"], 0.01))
    r = subprocess.run([sys.executable, str(ROOT / "prepare.py"), "info", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "train" in r.stdout and "sample:" in r.stdout, r.stderr


def test_validation_documents_do_not_favour_the_start(tmp_path, monkeypatch):
    # A large first file (a book among short pages) is not the validation split: the documents are
    # every 1/f-th from about 1/(2f) on. With fewer than 1/(2f) documents the last one is held out,
    # also when it comes batches after the others and empty documents follow it.
    monkeypatch.setattr(prepare, "BATCH_BYTES", 300)  # many batches: the choice spans them
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a-book.txt").write_text("a long first document\n" * 500)
    for i in range(40):
        (tmp_path / "in" / f"page{i:02d}.txt").write_text(f"page {i}\n" * 10)
    (tmp_path / "few").mkdir()
    for name, text in [("a.txt", "x" * 400), ("b.txt", "y" * 400), ("c.txt", "z" * 400),
                       ("d.txt", ""), ("e.jsonl", '{"text": ""}\n' * 3)]:
        (tmp_path / "few" / name).write_text(text)
    for src, val_docs_want in [("in", [10, 30]), ("few", [3])]:  # 1-based document numbers
        docs = [f.read_bytes() for f in find_inputs([tmp_path / src])]
        docs = [d for d in docs if d and d != b'{"text": ""}\n' * 3]
        expected = [np.array(list(d) + [256]) for d in docs]
        outs = [tmp_path / f"{src}-{w}" for w in (1, 2)]
        for out, workers in zip(outs, (1, 2)):
            m = run([tmp_path / src], out, val_fraction=0.05, shard_tokens=1000, workers=workers)
        assert sorted(n + 1 for n in val_docs(len(docs), 0.05)) == val_docs_want
        check_output(outs[0], m, expected, 0.05, 1000)
        assert m["splits"]["val"]["documents"] == len(val_docs_want)
        for f in outs[0].iterdir():  # byte-identical with 2 workers
            assert f.read_bytes() == (outs[1] / f.name).read_bytes(), f.name


# -----------------------------------------------------------------------------
# Parquet input


def write_parquet(path, columns, row_group_size, **kw):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=row_group_size, **kw)
    return pq.ParquetFile(path).metadata.num_row_groups


def parquet_texts():
    """Documents with a null and an empty text among them; the jsonl equivalent has "" for the
    null."""
    rng = np.random.default_rng(1)
    words = ["alpha", "beta", "é", "漢字", "🙂", "\n", "<|endoftext|>"]
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 40)))) for _ in range(30)]
    texts[3], texts[17] = None, ""
    return texts


@pytest.mark.smoke
def test_parquet_equals_jsonl_and_any_worker_count(tmp_path, monkeypatch):
    # Small batches and row slices, so that a run spans many worker tasks and several slices per row
    # group.
    monkeypatch.setattr(prepare, "BATCH_BYTES", 150)
    monkeypatch.setattr(prepare, "PARQUET_ROWS", 4)
    texts = parquet_texts()
    (tmp_path / "pq").mkdir()
    columns = {"id": list(range(30)), "text": texts}
    assert write_parquet(tmp_path / "pq" / "a.parquet", columns, 7) == 5
    write_parquet(tmp_path / "pq" / "b.parquet", {"text": ["the second file"]}, 7)
    (tmp_path / "js").mkdir()
    lines = "".join(json.dumps({"text": t or ""}) + "\n" for t in texts)
    (tmp_path / "js" / "a.jsonl").write_text(lines)
    (tmp_path / "js" / "b.jsonl").write_text(json.dumps({"text": "the second file"}) + "\n")
    outs = {}
    for name, src, workers in (("pq1", "pq", 1), ("pq2", "pq", 2), ("js-out", "js", 1)):
        outs[name] = tmp_path / name
        manifest = run([tmp_path / src], outs[name], shard_tokens=100, val_fraction=0.1,
                       workers=workers)
        assert manifest["stats"]["empty_documents_skipped"] == 2  # the null and the empty text
    docs = [t for t in texts if t] + ["the second file"]
    expected = [np.array(list(d.encode()) + [256]) for d in docs]
    check_output(outs["pq1"], manifest, expected, 0.1, 100)
    names = sorted(p.name for p in outs["pq1"].iterdir())
    assert len([n for n in names if n.startswith("train_")]) > 3
    # byte-identical for 2 workers, and to the same documents given as .jsonl
    for other in ("pq2", "js-out"):
        assert sorted(p.name for p in outs[other].iterdir()) == names
        for n in names:
            assert (outs["pq1"] / n).read_bytes() == (outs[other] / n).read_bytes(), (other, n)


def test_parquet_is_read_in_bounded_memory(tmp_path):
    # Arrow's own allocation count (deterministic, unlike the process's RSS) while streaming a 16 MB
    # file of 32 row groups stays at a few row groups' worth, however many the file holds.
    import pyarrow as pa

    path = tmp_path / "big.parquet"
    texts = [f"document {i} " + "x" * 1000 for i in range(32 * 500)]
    assert write_parquet(path, {"text": texts}, 500, compression="none") == 32
    base, peak, n = pa.total_allocated_bytes(), 0, 0
    for raw in prepare.read_documents([path]):
        peak, n = max(peak, pa.total_allocated_bytes() - base), n + 1
    assert n == len(texts) and peak < path.stat().st_size / 4, peak


def test_text_field_picks_the_parquet_column_and_the_jsonl_field(tmp_path):
    texts = [t or "" for t in parquet_texts()]
    (tmp_path / "in").mkdir()
    write_parquet(tmp_path / "in" / "a.parquet", {"text": list(range(30)), "content": texts}, 8)
    lines = "".join(json.dumps({"text": 1, "content": t}) + "\n" for t in texts)
    (tmp_path / "in" / "b.jsonl").write_text(lines)
    (tmp_path / "ref").mkdir()
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts + texts)
    (tmp_path / "ref" / "a.jsonl").write_text(lines)
    ref = run([tmp_path / "ref"], tmp_path / "ref-out")
    cli = [sys.executable, str(ROOT / "prepare.py"), str(tmp_path / "in"), "--tokenizer", "byte",
           "--shard-tokens", "200", "--val-fraction", "0.1", "--workers", "1", "--out-dir"]
    r = subprocess.run(cli + [str(tmp_path / "out"), "--text-field", "content"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["splits"] == ref["splits"]
    # The default field is "text": here an integer column, refused before any work, with the way out
    # named.
    r = subprocess.run(cli + [str(tmp_path / "out2")], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "out2").exists()
    parquet = tmp_path / "in" / "a.parquet"
    assert r.stderr.startswith(f"error: {parquet}: expected column 'text' to hold text")
    assert "found int64" in r.stderr and "--text-field" in r.stderr


def test_bad_parquet_is_a_clear_error_naming_the_file(tmp_path):
    make_corpus(tmp_path / "corpus")
    bad = tmp_path / "corpus" / "bad.parquet"
    bad.write_text('{"text": "a jsonl file under the wrong name"}\n')
    with pytest.raises(DataError, match=r"bad.parquet: expected a Parquet file, found one pyarrow "
                                        r"cannot read"):
        run([tmp_path / "corpus"], tmp_path / "o")
    write_parquet(bad, {"url": ["u"], "body": ["b"]}, 1)
    with pytest.raises(DataError, match=r"bad.parquet: expected a column 'text' \(--text-field\), "
                                        r"found the columns 'url', 'body'"):
        run([tmp_path / "corpus"], tmp_path / "o")
    with pytest.raises(DataError, match=r"bad.parquet: expected a column 'content'"):
        run([tmp_path / "corpus"], tmp_path / "o", text_field="content")
    write_parquet(bad, {"text": [b"raw bytes"]}, 1)
    with pytest.raises(DataError, match=r"bad.parquet: expected column 'text' to hold text .* "
                                        r"found binary"):
        run([tmp_path / "corpus"], tmp_path / "o")
    # A damaged page (the footer intact) is found while reading: the run fails and leaves nothing
    # behind but the lock file.
    write_parquet(bad, {"text": [f"document {i}" for i in range(100)]}, 30)
    damaged = bytearray(bad.read_bytes())
    damaged[4:20] = b"\xff" * 16  # the first page header, just after the leading magic bytes
    bad.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"bad.parquet: could not read it as Parquet"):
        run([tmp_path / "corpus"], tmp_path / "o", workers=2)
    assert names(tmp_path) == [".o.lock", "corpus"]
    # .jsonl records without the --text-field name the line and the field
    with pytest.raises(DataError, match=r'd.jsonl:1: expected a JSON object with a string "body" '
                                        r'field'):
        run([tmp_path / "corpus" / "d.jsonl"], tmp_path / "o", text_field="body")


# -----------------------------------------------------------------------------
# verify and info


def test_verify_catches_a_flipped_byte_and_a_truncated_shard(tmp_path):
    make_corpus(tmp_path / "corpus")
    run([tmp_path / "corpus"], tmp_path / "out")
    assert verify(tmp_path / "out") == []
    shard = tmp_path / "out" / "train_00001.bin"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[5] ^= 0x01
    shard.write_bytes(bytes(flipped))
    problems = verify(tmp_path / "out")
    assert any("train_00001.bin: sha256" in p for p in problems), problems
    cli = [sys.executable, str(ROOT / "prepare.py"), "verify", str(tmp_path / "out")]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 2 and "train_00001.bin: sha256" in r.stderr
    assert "Traceback" not in r.stderr
    shard.write_bytes(good[:-4])
    problems = verify(tmp_path / "out")
    assert problems == [f"{shard}: expected {len(good)} bytes ({len(good) // 2} uint16 tokens), "
                        f"found {len(good) - 4}"]
    shard.write_bytes(good)
    assert subprocess.run(cli, capture_output=True).returncode == 0


@pytest.mark.smoke
def test_info_decodes_the_first_training_document(tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    run([tmp_path / "corpus"], tmp_path / "out", val_fraction=0.0)
    manifest, sample = prepare.info(tmp_path / "out", sample_tokens=10_000)
    assert manifest["splits"]["val"]["tokens"] == 0
    assert sample == docs[0] + "<|endoftext|>"
    # The command line says each split's bytes of text, the count bits per byte divide by.
    r = subprocess.run([sys.executable, str(ROOT / "prepare.py"), "info", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    train_bytes = manifest["splits"]["train"]["bytes"]
    assert train_bytes == sum(len(d.encode()) for d in docs)
    assert f"{train_bytes:,} bytes of text" in r.stdout


# -----------------------------------------------------------------------------
# bad input: refused before any work, nothing the user has is lost


@pytest.mark.smoke
def test_bad_inputs_are_clear_errors(tmp_path):
    make_corpus(tmp_path / "corpus")
    with pytest.raises(DataError, match="missing: no such file"):
        find_inputs([tmp_path / "missing"])
    with pytest.raises(DataError, match=r"ignored.csv: expected a .txt, .md, .py or .jsonl"):
        find_inputs([tmp_path / "corpus" / "ignored.csv"])
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.csv").write_text("1")
    with pytest.raises(DataError, match="no documents found"):
        find_inputs([tmp_path / "nothing"])
    with pytest.raises(DataError, match="--val-fraction"):  # (the flags' other ranges: Typer's)
        run([tmp_path / "corpus"], tmp_path / "o", val_fraction=1.5)
    with pytest.raises(DataError, match="expected gpt2, byte or a tokenizer.json file"):
        run([tmp_path / "corpus"], tmp_path / "o", "gtp2")
    (tmp_path / "gz").mkdir()
    broken = gzip.compress(b'{"text": "a"}\n' * 100)[:-30] + b"garbage!"
    (tmp_path / "gz" / "broken.jsonl.gz").write_bytes(broken)
    with pytest.raises(DataError, match="broken.jsonl.gz: could not read it"):
        run([tmp_path / "gz"], tmp_path / "o")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("a single document")
    with pytest.raises(DataError, match="none is left for training"):
        run([tmp_path / "one"], tmp_path / "o", val_fraction=0.5)
    with pytest.raises(DataError, match="contains the input"):
        run([tmp_path / "corpus"], tmp_path / "corpus", overwrite=True)
    assert not (tmp_path / "o").exists() and list(tmp_path.glob(".o.*")) == [tmp_path / ".o.lock"]


def test_failures_never_touch_existing_output(tmp_path):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    first = run([tmp_path / "corpus"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # A previous complete output is replaced only by a complete new one; a failing run leaves it as
    # it was.
    z = tmp_path / "corpus" / "z.jsonl"
    z.write_text('{"text": "fine"}\n{"text": "fine"}\n{"txt": "oops"}\n')
    with pytest.raises(DataError, match=r'z.jsonl:3: expected a JSON object with a string "text" '
                                        r'field'):
        run([tmp_path / "corpus"], out, workers=2)
    (tmp_path / "corpus" / "z.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"z.jsonl:2: expected one JSON object per line"):
        run([tmp_path / "corpus"], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert names(tmp_path) == [".out.lock", "corpus", "out"]  # no stage left behind
    z.write_text('{"text": "fine"}\n{"text": "\\ud800 lone surrogate"}\n')
    second = run([tmp_path / "corpus"], out, shard_tokens=10_000)
    assert second["splits"]["train"]["tokens"] > first["splits"]["train"]["tokens"]
    assert second["stats"]["undecodable_replaced"] == 3 + 1 and verify(out) == []
    # A directory that is not a previous output is refused, untouched, unless --overwrite.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="pass --overwrite"):
        run([tmp_path / "corpus"], other)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    run([tmp_path / "corpus"], other, overwrite=True)
    assert "notes.txt" not in {p.name for p in other.iterdir()} and verify(other) == []


def test_cli_errors_are_one_clean_paragraph(tmp_path):
    cli = [sys.executable, str(ROOT / "prepare.py"), str(tmp_path / "missing"), "--out-dir",
           str(tmp_path / "o")]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "missing" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()
    r = subprocess.run([sys.executable, str(ROOT / "prepare.py"), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--out-dir" in r.stderr


@pytest.mark.parametrize("args, refusal", [
    (["--out-dir", ""], "--out-dir: expected a directory"),
    (["-o", "", "--tokenizer", "byte"], "--out-dir: expected a directory"),
    (["{corpus}", "--out-dir", ""], "--out-dir: expected a directory"),
    (["{corpus}", "", "--out-dir", "{out}"], "INPUT: expected a file or directory"),
    (["{corpus}", "--out-dir", "{out}", "--tokenizer", ""],
     "--tokenizer: expected gpt2, byte or a tokenizer.json file"),
    (["verify", ""], "DIRECTORY: expected a prepare.py output directory"),
    (["info", ""], "DIRECTORY: expected a prepare.py output directory"),
])
def test_an_empty_path_is_refused_naming_it_before_anything_is_written(tmp_path, args,
                                                                          refusal):
    # Path("") is ".": an unset variable ("$OUT") would otherwise name the working directory
    # (--out-dir "" tried to replace it, and left a ..lock there).
    make_corpus(tmp_path / "corpus")
    work = tmp_path / "work"
    work.mkdir()
    args = [a.format(corpus=tmp_path / "corpus", out=tmp_path / "out") for a in args]
    r = subprocess.run([sys.executable, str(ROOT / "prepare.py"), *args], cwd=work,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"error: {refusal}, found an empty string\n"
    assert list(work.iterdir()) == [] and not (tmp_path / "out").exists()
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("flag, value", [("--shard-tokens", "0"), ("--workers", "0"),
                                         ("--val-fraction", "nan")])
def test_flags_out_of_range_are_refused_before_any_work(tmp_path, flag, value):
    # Typer's ranges, but for NaN, which passes them and is prepare()'s to refuse
    make_corpus(tmp_path / "corpus")
    cli = [sys.executable, str(ROOT / "prepare.py"), str(tmp_path / "corpus"), "--out-dir",
           str(tmp_path / "o"), flag, value]
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["out", "web[1]"])  # a glob pattern too: it matches only itself
def test_a_kill_mid_swap_is_recovered_by_the_next_run_and_user_files_are_kept(tmp_path, name):
    make_corpus(tmp_path / "corpus")
    out, old, stage = tmp_path / name, tmp_path / f".{name}.old", tmp_path / f".{name}.stage"
    run([tmp_path / "corpus"], out)
    (out / "NOTES.md").write_text("my notes about this data")
    # killed between the swap's two renames: the previous output sits in .NAME.old, --out-dir is
    # gone, and the stage of the killed run is still there
    os.rename(out, old)
    stage.mkdir()
    (stage / "train_00000.bin").write_bytes(b"half a shard")
    kept = rf"kept NOTES.md, which is not the tool's own, in .*{re.escape(name)}"
    with pytest.warns(UserWarning, match=kept):
        run([tmp_path / "corpus"], out, shard_tokens=10_000)
    assert (out / "NOTES.md").read_text() == "my notes about this data" and verify(out) == []
    assert len(read_manifest(out)["splits"]["train"]["shards"]) == 1  # the new output replaced it
    assert names(tmp_path) == [f".{name}.lock", "corpus", name]
    # killed after the second rename: the new output is in place, the old one (with the notes)
    # beside it
    shutil.copytree(out, old)
    (out / "NOTES.md").unlink()
    with pytest.warns(UserWarning, match="kept NOTES.md"):
        run([tmp_path / "corpus"], out)
    assert (out / "NOTES.md").read_text() == "my notes about this data" and verify(out) == []
    assert len(read_manifest(out)["splits"]["train"]["shards"]) > 1
    assert names(tmp_path) == [f".{name}.lock", "corpus", name]


def test_a_stage_left_by_a_killed_run_is_removed(tmp_path):
    make_corpus(tmp_path / "corpus")
    stale = tmp_path / ".out.stage"
    stale.mkdir()
    (stale / "train_00000.bin").write_bytes(b"half a shard")
    (stale / "manifest.json").write_text("{}")
    run([tmp_path / "corpus"], tmp_path / "out")
    assert verify(tmp_path / "out") == [] and names(tmp_path) == [".out.lock", "corpus", "out"]


def test_a_swap_interrupted_and_then_a_failed_run_still_leave_the_old_output(tmp_path):
    # the next run after a kill mid-swap puts the old output back first, so its own failure loses
    # nothing
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    run([tmp_path / "corpus"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    os.rename(out, tmp_path / ".out.old")
    (tmp_path / "corpus" / "z.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"z.jsonl:2: expected one JSON object per line"):
        run([tmp_path / "corpus"], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert names(tmp_path) == [".out.lock", "corpus", "out"]


def test_a_second_run_on_the_same_out_dir_is_refused_while_the_first_holds_the_lock(tmp_path):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    run([tmp_path / "corpus"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with open(tmp_path / ".out.lock", "a") as held:  # as a running prepare.py holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DataError, match="out is being written by another process"):
            run([tmp_path / "corpus"], out, shard_tokens=10_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    run([tmp_path / "corpus"], out, shard_tokens=10_000)  # released: the next run goes ahead
    assert len(read_manifest(out)["splits"]["train"]["shards"]) == 1


def test_an_out_dir_that_is_a_symlink_is_replaced_behind_the_link(tmp_path):
    make_corpus(tmp_path / "corpus")
    run([tmp_path / "corpus"], tmp_path / "real")
    (tmp_path / "link").symlink_to("real")
    run([tmp_path / "corpus"], tmp_path / "link", shard_tokens=10_000)
    assert (tmp_path / "link").is_symlink() and verify(tmp_path / "link") == []
    # the new output, in real/
    assert len(read_manifest(tmp_path / "real")["splits"]["train"]["shards"]) == 1
    assert names(tmp_path) == [".real.lock", "corpus", "link", "real"]


def test_a_failed_write_names_the_path_and_changes_nothing(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    run([tmp_path / "corpus"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(path, data):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(prepare, "write_atomic", disk_full)
    with pytest.raises(DataError, match=r"could not write .*manifest.json \(No space left on "
                                        r"device\).* is unchanged"):
        run([tmp_path / "corpus"], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert names(tmp_path) == [".out.lock", "corpus", "out"]


# -----------------------------------------------------------------------------
# the UTF-8 bytes of the text, for bits per byte


def test_the_manifest_counts_the_bytes_of_the_text(tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    manifest = run([tmp_path / "corpus"], tmp_path / "out", "byte", shard_tokens=200,
                   val_fraction=0.1)
    val = val_docs(len(docs), 0.1)
    for name, split in manifest["splits"].items():
        texts = [d for n, d in enumerate(docs) if (n in val) == (name == "val")]
        # The bytes of the text as tokenized (U+FFFD for an undecodable byte), no EOS.
        assert split["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
        # The byte tokenizer makes a token of each byte and one EOS a document.
        for shard in split["shards"]:
            assert shard["bytes"] == shard["tokens"] - shard["documents"]
        assert split["bytes"] == sum(shard["bytes"] for shard in split["shards"])
    assert open_tokens(tmp_path / "out", "val").text_bytes == manifest["splits"]["val"]["bytes"]
    # The count is of the text, whatever the tokenizer.
    tokenizer = tmp_path / "tokenizer.json"
    import official
    tokenizer.write_text(official.byte_tokenizer_json())
    other = run([tmp_path / "corpus"], tmp_path / "out2", str(tokenizer), shard_tokens=200,
                val_fraction=0.1)
    for name in ("train", "val"):
        assert other["splits"][name]["bytes"] == manifest["splits"][name]["bytes"]


def drop_byte_counts(directory):
    """Make `directory`'s manifest one from before the byte counts; return it."""
    path = Path(directory) / "manifest.json"
    m = json.loads(path.read_text())
    for split in m["splits"].values():
        del split["bytes"]
        for shard in split["shards"]:
            del shard["bytes"]
    path.write_text(json.dumps(m))
    return m


@pytest.mark.smoke
def test_a_manifest_without_byte_counts_still_loads(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("an older manifest " * 20)
    (tmp_path / "corpus" / "b.txt").write_text("has no byte counts " * 20)
    run([tmp_path / "corpus"], tmp_path / "out", "byte", val_fraction=0.5)
    m = drop_byte_counts(tmp_path / "out")
    assert read_manifest(tmp_path / "out") == m
    assert open_tokens(tmp_path / "out", "val").text_bytes is None
    assert verify(tmp_path / "out") == []


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(bytes=s["bytes"] + 1), r"split 'val' has bytes \d+, shards \d+"),
    (lambda s: s.update(bytes=-1), r"expected splits.val.bytes to be a whole number"),
    (lambda s: s["shards"][0].pop("bytes"), "not every shard of it counts its bytes"),
    (lambda s: s["shards"][0].update(bytes="9"), r"splits.val.shards\[0\].bytes"),
])
def test_a_bad_byte_count_is_refused(tmp_path, edit, message):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text " * 20)
    (tmp_path / "corpus" / "b.txt").write_text("more text " * 20)
    run([tmp_path / "corpus"], tmp_path / "out", "byte", val_fraction=0.5)
    path = tmp_path / "out" / "manifest.json"
    m = json.loads(path.read_text())
    edit(m["splits"]["val"])
    path.write_text(json.dumps(m))
    with pytest.raises(DataError, match=message):
        read_manifest(tmp_path / "out")
