"""The fault matrix of the data side (prepare.py, data.py): each case a user can run into, with the
exit code, the message, and the promise that every shard that verified before the fault still
verifies after it."""
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import data
import prepare
from test_train import BASE, corpus, run  # noqa: F401 (corpus is a fixture)

ROOT = Path(__file__).resolve().parent.parent
PREPARE = [sys.executable, str(ROOT / "prepare.py")]


def fingerprint(directory):
    """sha256 of every file in a prepared directory: what must survive a fault unchanged."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).iterdir())}


def prepared(tmp_path, name="out", docs=30):
    """A small verified output, and its fingerprint."""
    src = tmp_path / f"{name}-src"
    src.mkdir()
    for i in range(docs):
        (src / f"{i:03d}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 5)
    out = tmp_path / name
    prepare.prepare(prepare.find_inputs([src]), out, "byte", val_fraction=0.1, workers=1,
                    shard_tokens=500, log=lambda *a: None)
    assert prepare.verify(out) == []
    return out, fingerprint(out)


def hidden(directory):
    """What prepare.py leaves beside an output: only the lock file, never a stage or old output."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -----------------------------------------------------------------------------
# interrupts: real processes, real signals


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory):
    """~20 MB of short jsonl documents: seconds of work for two workers, so that a signal lands
    mid-run."""
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    path.write_bytes(b'{"text": "a short document, one of very many"}\n' * 400_000)
    return path


def default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def session_processes(sid):
    """The processes still alive in session `sid` (the command and its workers)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig, to_group, code, what", [
    (signal.SIGINT, True, 130, "Ctrl-C (SIGINT)"),  # Ctrl-C: the terminal signals the whole group
    (signal.SIGTERM, False, 143, "SIGTERM"),  # kill PID
    (signal.SIGTERM, True, 143, "SIGTERM"),  # a job scheduler, timeout(1): the workers too
])
def test_ctrl_c_and_sigterm_stop_prepare_and_its_workers(tmp_path, big_jsonl, sig, to_group, code,
                                                         what):
    out, before = prepared(tmp_path)
    cmd = PREPARE + [str(big_jsonl), "--out-dir", str(out), "--tokenizer", "byte", "--workers",
                     "2", "--shard-tokens", "20000"]
    # Its own group, as a shell's job, with Ctrl-C's default action: a test run as a
    # background job (`pytest &` in a script) has SIGINT ignored, which Python then keeps.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / ".out.stage" / "train_00002.bin").exists():  # mid-run
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        t0 = time.monotonic()
        stdout, stderr = proc.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == code and took < 5, (proc.returncode, took, stderr)
    assert stderr == f"stopped by {what}: {out} is unchanged\n" and stdout == ""
    deadline = time.monotonic() + 5  # the workers are gone too (reaped by now, or about to be)
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_processes(proc.pid) == []
    assert fingerprint(out) == before and prepare.verify(out) == []
    assert hidden(tmp_path) == [".out.lock"]  # no stage left behind


def test_an_interrupt_in_process_unwinds_and_the_next_run_works(tmp_path, monkeypatch):
    # the same unwinding without subprocesses: KeyboardInterrupt in the middle of writing shards
    out, before = prepared(tmp_path)
    src = tmp_path / "out-src"
    real, calls = prepare.ShardWriter.add, []

    def interrupted(self, tokens, lengths, text_bytes):
        calls.append(1)
        if len(calls) == 2:  # the first documents are written, the next are not
            raise KeyboardInterrupt
        real(self, tokens, lengths, text_bytes)

    monkeypatch.setattr(prepare.ShardWriter, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(prepare.find_inputs([src]), out, "byte", shard_tokens=10_000, workers=2,
                        log=lambda *a: None)
    assert fingerprint(out) == before and hidden(tmp_path) == [".out.lock"]
    monkeypatch.setattr(prepare.ShardWriter, "add", real)
    prepare.prepare(prepare.find_inputs([src]), out, "byte", shard_tokens=10_000, workers=2,
                    log=lambda *a: None)
    assert prepare.verify(out) == []
    assert len(data.read_manifest(out)["splits"]["train"]["shards"]) == 1


# -----------------------------------------------------------------------------
# bad input accepted before: refused, one sentence naming the file or flag, exit 2


def write_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a document"]}), path)


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["notes.txt", "README.md", "train.py", "docs.jsonl",
                                  "docs.jsonl.gz", "meta.json", "web.parquet", "corpus.bin"])
def test_a_text_file_as_data_is_refused(corpus, tmp_path, name):
    path, before = tmp_path / name, fingerprint(corpus)
    text = "def f(x):\n    return x + 1  # ünïcode is text too\n" * 50
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
        write_parquet(path)
    else:
        path.write_text(text)  # corpus.bin: text under a token file's name, found by its content
    out = run("--data", path, *BASE, "--max-steps", 1, "--out-dir", tmp_path / "run", expect=2)
    found = "UTF-8 text" if name == "corpus.bin" else f"a {path.suffix} file"
    assert f"{path}: expected a file of token ids, found {found}, which holds text" in out
    assert f"python prepare.py {path} --out-dir DIR" in " ".join(out.split())
    assert "Traceback" not in out and not (tmp_path / "run").exists()
    assert fingerprint(corpus) == before and prepare.verify(corpus) == []


def test_token_files_are_not_mistaken_for_text(tmp_path):
    # byte-level ids hold zero bytes; GPT-2 ids, bytes that are not UTF-8; both still open
    rng = np.random.default_rng(0)
    for name, ids in [("bytes.bin", rng.integers(32, 127, 5000)),
                      ("gpt2.bin", rng.integers(0, 50257, 5000))]:
        ids.astype(np.uint16).tofile(tmp_path / name)
        assert data.open_tokens(tmp_path / name).num_tokens == 5000


@pytest.mark.smoke
@pytest.mark.parametrize("specs, message", [
    (["{a}:0"], "--data '{a}:0': expected PATH:WEIGHT with a positive WEIGHT, found 0: a source "
                "weighted 0 would never be read; leave it out"),
    (["{a}:1", "{b}:0.0"], "--data '{b}:0.0': expected PATH:WEIGHT with a positive WEIGHT"),
    (["{a}:0", "{b}:0"], "--data '{a}:0': expected PATH:WEIGHT with a positive WEIGHT"),
    (["{a}:-1"], "--data '{a}:-1': expected a path, or PATH:WEIGHT with WEIGHT a positive number, "
                 "found the weight '-1' (and no such path)"),
])
def test_a_zero_or_bad_blend_weight_is_refused(corpus, tmp_path, specs, message):
    b = tmp_path / "b"
    shutil.copytree(corpus, b)
    before = fingerprint(corpus)
    specs = [s.format(a=corpus, b=b) for s in specs]
    out = run(*[x for s in specs for x in ("--data", s)], *BASE, "--max-steps", 1, "--out-dir",
              tmp_path / "run", expect=2)
    assert message.format(a=corpus, b=b) in " ".join(out.split()) and "synthetic" not in out
    assert "Traceback" not in out and not (tmp_path / "run").exists()
    assert fingerprint(corpus) == before and prepare.verify(corpus) == []


# -----------------------------------------------------------------------------
# misleading words: each message names the flag that fixes it


@pytest.mark.smoke
def test_an_odd_sized_token_file_names_data_dtype(corpus, tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1001, dtype=np.uint16).tofile(path)  # 2002 bytes: not whole uint32 tokens
    out = run("--data", path, "--data-dtype", "uint32", *BASE, "--max-steps", 1, "--out-dir",
              tmp_path / "run", expect=2)
    out = " ".join(out.split())
    assert f"{path}: expected a whole number of uint32 tokens (4 bytes each), found 2002 " \
           "bytes" in out
    assert "wrong --data-dtype, or a truncated file?" in out and "Traceback" not in out


def test_blend_weight_errors_of_batches_name_the_flag(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "a.bin")
    source = data.open_tokens(tmp_path / "a.bin")
    with pytest.raises(data.DataError) as e:
        data.Batches([source, source], data.BatchConfig(7, 1, 1), weights=[1, 0])
    assert str(e.value) == ("blend weights: expected 2 positive weights, one per source (train.py: "
                            "--data PATH:WEIGHT), found [1, 0]")


def test_an_indivisible_batch_names_the_flags(corpus, tmp_path):
    before = fingerprint(corpus)
    out = run("--data", corpus, *BASE, "--total-batch-size", 96, "--max-steps", 1, "--out-dir",
              tmp_path / "run", expect=2)
    assert ("global batch 3 sequences (--total-batch-size 96 / --seq-len 32) is not a multiple of "
            "micro_batch 4 (--batch-size) x world_size 1 = 4; pick sizes where it is, for example "
            "--total-batch-size 128 (4 sequences)") in " ".join(out.split())
    assert "Traceback" not in out and fingerprint(corpus) == before


@pytest.mark.parametrize("value, kind", [(12, "number"), (None, "null"), (["a"], "list"),
                                         ({"t": "a"}, "object")])
def test_a_jsonl_text_field_that_is_not_a_string_says_what_it_is(tmp_path, value, kind):
    out, before = prepared(tmp_path)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ({"text": "fine"}, {"text": value})))
    r = subprocess.run(PREPARE + [str(src), "--out-dir", str(out), "--tokenizer", "byte"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == (f'error: {src}:2: expected a JSON object with a string "text" field '
                        f'(--text-field), found a {kind} in "text", not a string\n')
    assert fingerprint(out) == before and hidden(tmp_path) == [".out.lock"]


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["splits"]["train"]["shards"][0].update(tokens="12"),
     'expected splits.train.shards[0].tokens to be a whole number >= 0, found "12"'),
    (lambda m: m.update(vocab_size=None),
     "expected vocab_size to be a whole number >= 1, found null"),
    (lambda m: m["splits"]["val"].update(max_token_id=3.5),
     "expected splits.val.max_token_id to be a whole number >= 0, found 3.5"),
    (lambda m: m.pop("eos_id"), "expected eos_id to be a whole number >= 0, found no such field"),
    (lambda m: m.update(tokenizer={"name": "file"}),
     'expected tokenizer to be an object, naming its "file" if its "name" is "file", '
     'found {"name": "file"}'),
])
def test_a_hand_edited_manifest_field_of_the_wrong_type(corpus, tmp_path, edit, message):
    d = tmp_path / "data"
    shutil.copytree(corpus, d)
    good = (d / "manifest.json").read_text()
    m = json.loads(good)
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))
    want = f"{d / 'manifest.json'}: {message}; prepare.py writes manifests whole: was this one " \
           "edited by hand?"
    out = run("--data", d, *BASE, "--max-steps", 1, "--out-dir", tmp_path / "run", expect=2)
    assert want in " ".join(out.split()) and "Traceback" not in out
    r = subprocess.run(PREPARE + ["verify", str(d)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == f"{d}: 1 problem\n  - {want}\n"
    (d / "manifest.json").write_text(good)  # put back: every shard verifies, as before the edit
    assert prepare.verify(d) == [] and fingerprint(d) == fingerprint(corpus)


# -----------------------------------------------------------------------------
# rough edges


def test_output_to_a_pipe_is_whole_lines_and_notes_say_only_what_happened(tmp_path):
    src = tmp_path / "a-source-directory-with-a-long-name-so-the-lines-are-long"
    src.mkdir()
    (src / "a.txt").write_text("one document\n" * 20)
    (src / "b.txt").write_text("")
    (src / "c.txt").write_text("another document\n" * 20)
    out = tmp_path / ("an-output-directory-with-a-long-name-" * 2)
    cmd = PREPARE + [str(src), "--out-dir", str(out), "--tokenizer", "byte", "--workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"wrote 602 tokens (2 documents) to {out} in ")
    assert lines[0].endswith("train 261 tokens in 1 shards, val 341 tokens")
    assert lines[1] == "note: skipped 1 empty document"  # nothing about undecodable bytes
    (src / "b.txt").write_text("a third document\n")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "note" not in r.stdout


@pytest.mark.parametrize("umask, mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_outputs_are_written_with_the_users_umask(tmp_path, umask, mode, dir_mode):
    tokenizers = pytest.importorskip("tokenizers")
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "<|endoftext|>": 1}, "a"))
    t.save(str(tmp_path / "tok.json"))
    (tmp_path / "src").mkdir()
    for i in range(20):
        (tmp_path / "src" / f"{i}.txt").write_text("a a a")
    old = os.umask(umask)
    try:
        prepare.prepare(prepare.find_inputs([tmp_path / "src"]), tmp_path / "out",
                        str(tmp_path / "tok.json"), val_fraction=0.1, workers=1,
                        log=lambda *a: None)
    finally:
        os.umask(old)
    files = [*(tmp_path / "out").iterdir(), tmp_path / ".out.lock"]
    assert {"manifest.json", "tokenizer.json", "train_00000.bin", "val_00000.bin"} <= {
        p.name for p in files}
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: mode for p in files}
    assert (tmp_path / "out").stat().st_mode & 0o777 == dir_mode


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork", reason="patches forked workers")
def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path, monkeypatch):
    # the kernel's out-of-memory killer, say: the parent sees the pipe close, and stops cleanly
    out, before = prepared(tmp_path)
    monkeypatch.setattr(prepare, "_encode_batch", lambda *args: os._exit(9))  # in the workers
    with pytest.raises(data.DataError, match="a tokenizer process died; rerun with fewer"):
        prepare.prepare(prepare.find_inputs([tmp_path / "out-src"]), out, "byte", workers=2,
                        log=lambda *a: None)
    assert fingerprint(out) == before and hidden(tmp_path) == [".out.lock"]
