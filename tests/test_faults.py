"""The fault matrix: each case a user can run into around the edges of a run, with the exit code, the message,
and the promise that every checkpoint that verified before the fault still verifies after it."""
import fcntl
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

import ckpt
import official
import prepare
import sample
import train
from test_train import BASE, corpus, records, run, start_train, weights  # noqa: F401 (corpus is a fixture)

runner = CliRunner()


def fingerprint(out):
    """sha256 of every checkpoint file in out: what must survive a fault unchanged."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(out).iterdir())
            if ckpt.STEP_FILE.fullmatch(p.name)}


def verified_steps(out):
    good = []
    for step in ckpt.list_steps(out):
        try:
            ckpt.read_meta(out, step, verify=True)
            good.append(step)
        except ckpt.CheckpointError:
            pass
    return good


def trained(corpus, out, steps=20, *extra):
    run("--data", corpus, *BASE, "--max-steps", steps, "--save-every", 5, "--keep-last", 0, "--out-dir", out, *extra)
    return fingerprint(out)


def test_nan_guard_never_saves_poison_and_stops_when_the_streak_returns(corpus, tmp_path):
    out = tmp_path / "run"
    before = trained(corpus, out)
    # lr 1e30: the first update leaves the weights finite but ~1e29, then every step is non-finite
    text = run("--data", corpus, *BASE, "--max-steps", 40, "--save-every", 5, "--keep-last", 3, "--lr", "1e30",
               "--out-dir", out, expect=2)
    assert "rolled back to step 20 3 times" in text and "lower --lr" in text and "Traceback" not in text
    assert fingerprint(out) == before  # nothing new was saved, and retention deleted nothing
    assert verified_steps(out) == [5, 10, 15, 20]
    assert [r["event"] for r in records(out, "event") if r["event"] == "rollback"] == ["rollback"] * 3


def test_exploded_weights_are_not_saved(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = train.micro_step

    def explode_at_step_7(model, x, y, autocast):  # weights blown up while finite: not a non-finite step
        if model.training and len(calls) == 2 * 7:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1e9)
        calls.append(1)
        return real(model, x, y, autocast)

    calls = []
    monkeypatch.setattr(train, "micro_step", explode_at_step_7)
    text = run("--data", corpus, *BASE, "--max-steps", 12, "--save-every", 5, "--keep-last", 0, "--out-dir", out)
    assert "restored the weights of step 5" in text
    assert verified_steps(out) == [5, 12]  # step 10 held exploded weights: never written


def test_all_checkpoints_corrupt_is_refused_and_nothing_is_touched(corpus, tmp_path):
    out = tmp_path / "run"
    trained(corpus, out, 10)
    for p in out.glob("model_step_*.safetensors"):  # one byte each, same size: only the hash can tell
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 1
        p.write_bytes(bytes(b))
    damaged = fingerprint(out)
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--out-dir", out, expect=2)
    assert "no step verifies" in text and "--resume never --overwrite" in text and "model_step_10" in text
    assert fingerprint(out) == damaged
    # the way out the message names: --overwrite moves them aside, untouched
    run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, "--resume", "never", "--overwrite")
    aside = next(out.glob("previous-*"))
    assert fingerprint(aside) == damaged


def test_a_second_run_on_the_same_directory_is_refused(corpus, tmp_path):
    out = tmp_path / "run"
    before = trained(corpus, out, 5)
    with open(out / ".lock", "a+") as held:  # as a running train.py holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.truncate(0)
        held.write("PID 4242 on gpu-node-7, since 2026-12-01 06:00:00\n")
        held.flush()
        text = run("--data", corpus, *BASE, "--max-steps", 10, "--out-dir", out, expect=2)
    assert "in use by another run (PID 4242 on gpu-node-7" in text
    assert fingerprint(out) == before
    run("--data", corpus, *BASE, "--max-steps", 6, "--out-dir", out)  # released: the next run goes ahead


def test_the_lock_is_released_by_kill_9(corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_train(corpus, out)
    for line in proc.stdout:
        if line.startswith("step 2:"):
            break
    text = run("--data", corpus, *BASE, "--max-steps", 4, "--out-dir", out, expect=2)
    assert f"PID {proc.pid}" in text
    proc.kill()
    proc.wait()
    run("--data", corpus, *BASE, "--max-steps", 4, "--out-dir", out, "--resume", "never", "--overwrite")


def test_a_killed_branch_is_continued_not_the_abandoned_one(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trained(corpus, out, 20)
    original = weights(out, 20)
    real = train.save_checkpoint

    def killed_after_15(cfg, step, *args):
        real(cfg, step, *args)
        if step == 15:
            raise KeyboardInterrupt  # as a kill would: the new step 15 is saved, nothing after it

    monkeypatch.setattr(train, "save_checkpoint", killed_after_15)
    text = run("--data", corpus, *BASE, "--max-steps", 20, "--save-every", 5, "--out-dir", out, "--resume", 10,
               expect=130)
    monkeypatch.setattr(train, "save_checkpoint", real)
    aside = next(out.glob("abandoned-*"))
    assert sorted(int(p.stem.split("_")[-1]) for p in aside.glob("meta_step_*")) == [15, 20]
    text = run("--data", corpus, *BASE, "--max-steps", 20, "--save-every", 5, "--out-dir", out)
    assert "resumed from" in text and "step 15" in text
    for k, v in weights(out, 20).items():  # the new branch, trained from 10 with the same data, is the same run
        assert torch.equal(v, original[k]), k
    steps = [r["step"] for r in records(out)]
    assert steps == list(range(1, 21))  # one record per step: the abandoned and the redone ones are not mixed in


def test_a_short_validation_split_turns_eval_off_before_step_1(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    # the last document is held out (31 x 0.01 rounds to none): 7 tokens, shorter than seq_len + 1
    (src / "z.txt").write_text("x = 1\n")
    for i in range(30):
        (src / f"b{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    data = tmp_path / "data"
    prepare.prepare(prepare.find_inputs([src]), data, tokenizer="byte", val_fraction=0.01, workers=1,
                    log=lambda *a: None)
    text = run("--data", data, *BASE, "--max-steps", 3, "--out-dir", tmp_path / "run")
    assert "off: no val split of seq_len + 1 tokens" in text and "val loss" not in text


def test_a_token_beyond_the_vocabulary_names_the_file_and_offset(corpus, tmp_path):
    data = tmp_path / "data"
    prepare.prepare(prepare.find_inputs([Path(json.__file__).parent]), data, tokenizer="byte", val_fraction=0.2,
                    workers=1, log=lambda *a: None)
    shard = data / "train_00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[1234] = 300  # edited after prepare.py: same size, so only a full read can tell
    tokens.tofile(shard)
    out = tmp_path / "run"
    text = run("--data", data, *BASE, "--max-steps", 3, "--out-dir", out, expect=2)
    assert f"{shard}: token id 300 at token offset 1234" in text and "prepare.py verify" in text
    assert "Traceback" not in text


def test_a_failed_save_keeps_the_earlier_checkpoints(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    before = trained(corpus, out, 5)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--save-every", 5, "--out-dir", out, expect=2)
    assert "could not write checkpoint step 10" in text and "No space left" in text and "untouched" in text
    assert fingerprint(out) == before and not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("extra, message", [(["--max-steps", 4], "--max-steps 4 is below the resumed step 5"),
                                            (["--seed", 1], "saved with seed = 0, but this run has seed = 1")])
def test_a_refused_resume_moves_no_newer_step_aside(corpus, tmp_path, extra, message):
    out = tmp_path / "run"
    before, metrics = trained(corpus, out, 10), (out / "metrics.jsonl").read_text()
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--out-dir", out, "--resume", 5, *extra, expect=2)
    assert message in text and "moved" not in text
    assert fingerprint(out) == before and (out / "metrics.jsonl").read_text() == metrics
    assert not list(out.glob("abandoned-*"))


def test_a_metrics_record_cut_short_by_a_full_disk_does_not_stop_the_resume(corpus, tmp_path):
    out = tmp_path / "run"
    trained(corpus, out, 10)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "event", "event": "resume", "st')  # what a disk full during an append left
    assert "resumed from" in run("--data", corpus, *BASE, "--max-steps", 12, "--out-dir", out)
    assert [r["step"] for r in records(out)] == list(range(1, 13))  # every line is whole JSON again


@pytest.mark.skipif(not Path("/dev/full").is_char_device(), reason="needs /dev/full")
def test_a_full_disk_while_logging_is_a_clear_error(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    before = trained(corpus, out, 5)
    init = train.Log.__init__

    def log_to_a_full_disk(self, cfg, rank):
        init(self, cfg, rank)
        self.path = Path("/dev/full")  # every write fails with ENOSPC

    monkeypatch.setattr(train.Log, "__init__", log_to_a_full_disk)
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--out-dir", out, expect=2)
    assert "could not write /dev/full (No space left on device)" in text and fingerprint(out) == before


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_the_records_of_a_run_killed_before_its_first_save_are_not_repeated(corpus, tmp_path, resume):
    out = tmp_path / "run"
    run("--data", corpus, *BASE, "--max-steps", 3, "--out-dir", out)
    for p in [p for ps in ckpt.step_files(out).values() for p in ps]:
        p.unlink()  # as if killed at step 3, before its save
    run("--data", corpus, *BASE, "--max-steps", 4, "--out-dir", out, "--resume", resume)
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]


def test_an_export_is_refused_as_out_dir(corpus, tmp_path):
    trained(corpus, tmp_path / "run", 5)
    export = official.export(tmp_path / "run", tmp_path / "export")
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--init-from", export, "--out-dir", export, expect=2)
    assert "is an export" in text and {p.name: p.read_bytes() for p in export.iterdir()} == before


def test_a_hash_matching_but_malformed_newest_step_falls_back(corpus, tmp_path):
    out = tmp_path / "run"
    trained(corpus, out, 10)
    for name in ("model_step_10.safetensors", "optim_step_10.pt"):
        path = out / name
        path.write_bytes(b"\x00" * path.stat().st_size)  # garbage whose hash the meta is then made to record
        meta = json.loads((out / "meta_step_10.json").read_text())
        meta["files"][name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (out / "meta_step_10.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="model_step_10.safetensors matches its sha256 but is unreadable"):
        result = runner.invoke(sample.app, ["--out-dir", str(out), "--max-new-tokens", "3", "--num-samples", "2"])
    assert result.exit_code == 0 and "(step 5)" in result.output
    text = run("--data", corpus, *BASE, "--max-steps", 12, "--save-every", 5, "--out-dir", out)
    assert "resumed from" in text and "step 5" in text


@pytest.mark.parametrize("flags", [["--top-k", "0"], ["--temperature", "-1"], ["--max-new-tokens", "-5"],
                                   ["--device", "tpu"]])
def test_sample_flags_out_of_range_are_usage_errors(tmp_path, flags):
    result = runner.invoke(sample.app, ["--out-dir", str(tmp_path), *flags])
    assert result.exit_code == 2 and f"Invalid value for '{flags[0]}'" in result.output
