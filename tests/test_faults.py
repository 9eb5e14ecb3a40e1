"""The fault matrix: each case a user can run into around the edges of a run, with the exit code,
the message, and the promise that every checkpoint that verified before the fault still verifies
after it."""
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

import ckpt
import data
import official
import plot
import prepare
import sample
import train
from model import PRESETS
# corpus is a fixture (hence the noqa: F401)
from test_train import BASE, ROOT, corpus, records, run, start_train, weights  # noqa: F401

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
    run("--data", corpus, *BASE, "--max-steps", steps, "--save-every", 5, "--keep-last", 0,
        "--out-dir", out, *extra)
    return fingerprint(out)


def test_nan_guard_never_saves_poison_and_stops_when_the_streak_returns(corpus, tmp_path):
    out = tmp_path / "run"
    before = trained(corpus, out)
    # lr 1e30: the first update leaves the weights finite but ~1e29, then every step is non-finite
    text = run("--data", corpus, *BASE, "--max-steps", 40, "--save-every", 5, "--keep-last", 3,
               "--lr", "1e30", "--out-dir", out, expect=2)
    assert ("rolled back to step 20 3 times" in text and "lower --lr" in text
            and "Traceback" not in text)
    assert fingerprint(out) == before  # nothing new was saved, and retention deleted nothing
    assert verified_steps(out) == [5, 10, 15, 20]
    rollbacks = [r["event"] for r in records(out, "event") if r["event"] == "rollback"]
    assert rollbacks == ["rollback"] * 3


def test_exploded_weights_are_not_saved(corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = train.micro_step

    # weights blown up while finite: not a non-finite step
    def explode_at_step_7(model, x, y, autocast):
        if model.training and len(calls) == 2 * 7:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1e9)
        calls.append(1)
        return real(model, x, y, autocast)

    calls = []
    monkeypatch.setattr(train, "micro_step", explode_at_step_7)
    text = run("--data", corpus, *BASE, "--max-steps", 12, "--save-every", 5, "--keep-last", 0,
               "--out-dir", out)
    assert "restored the weights of step 5" in text
    assert verified_steps(out) == [5, 12]  # step 10 held exploded weights: never written


def test_all_checkpoints_corrupt_is_refused_and_nothing_is_touched(corpus, tmp_path):
    out = tmp_path / "run"
    trained(corpus, out, 10)
    # one byte each, same size: only the hash can tell
    for p in out.glob("model_step_*.safetensors"):
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 1
        p.write_bytes(bytes(b))
    damaged = fingerprint(out)
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--out-dir", out, expect=2)
    assert ("no step verifies" in text and "--resume never --overwrite" in text
            and "model_step_10" in text)
    assert fingerprint(out) == damaged
    # the way out the message names: --overwrite moves them aside, untouched
    run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, "--resume", "never",
        "--overwrite")
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
    # released: the next run goes ahead
    run("--data", corpus, *BASE, "--max-steps", 6, "--out-dir", out)


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
    run("--data", corpus, *BASE, "--max-steps", 4, "--out-dir", out, "--resume", "never",
        "--overwrite")


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
    text = run("--data", corpus, *BASE, "--max-steps", 20, "--save-every", 5, "--out-dir", out,
               "--resume", 10, expect=130)
    monkeypatch.setattr(train, "save_checkpoint", real)
    aside = next(out.glob("abandoned-*"))
    assert sorted(int(p.stem.split("_")[-1]) for p in aside.glob("meta_step_*")) == [15, 20]
    text = run("--data", corpus, *BASE, "--max-steps", 20, "--save-every", 5, "--out-dir", out)
    assert "resumed from" in text and "step 15" in text
    # the new branch, trained from 10 with the same data, is the same run
    for k, v in weights(out, 20).items():
        assert torch.equal(v, original[k]), k
    steps = [r["step"] for r in records(out)]
    # one record per step: the abandoned and the redone ones are not mixed in
    assert steps == list(range(1, 21))


def test_a_short_validation_split_turns_eval_off_before_step_1(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    # the last document is held out (31 x 0.01 rounds to none): 7 tokens, shorter than seq_len + 1
    (src / "z.txt").write_text("x = 1\n")
    for i in range(30):
        (src / f"b{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    data = tmp_path / "data"
    prepare.prepare(prepare.find_inputs([src]), data, tokenizer="byte", val_fraction=0.01,
                    workers=1, log=lambda *a: None)
    text = run("--data", data, *BASE, "--max-steps", 3, "--out-dir", tmp_path / "run")
    assert "off: no val split of seq_len + 1 tokens" in text and "val loss" not in text


@pytest.mark.smoke
def test_a_token_beyond_the_vocabulary_names_the_file_and_offset(corpus, tmp_path):
    data = tmp_path / "data"
    prepare.prepare(prepare.find_inputs([Path(json.__file__).parent]), data, tokenizer="byte",
                    val_fraction=0.2, workers=1, log=lambda *a: None)
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
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--save-every", 5, "--out-dir", out,
               expect=2)
    assert ("could not write checkpoint step 10" in text and "No space left" in text
            and "untouched" in text)
    assert fingerprint(out) == before and not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("extra, message", [
    (["--max-steps", 4], "--max-steps 4 is below the resumed step 5"),
    (["--seed", 1], "saved with seed = 0, but this run has seed = 1")])
def test_a_refused_resume_moves_no_newer_step_aside(corpus, tmp_path, extra, message):
    out = tmp_path / "run"
    before, metrics = trained(corpus, out, 10), (out / "metrics.jsonl").read_text()
    text = run("--data", corpus, *BASE, "--max-steps", 10, "--out-dir", out, "--resume", 5, *extra,
               expect=2)
    assert message in text and "moved" not in text
    assert fingerprint(out) == before and (out / "metrics.jsonl").read_text() == metrics
    assert not list(out.glob("abandoned-*"))


def test_a_metrics_record_cut_short_by_a_full_disk_does_not_stop_the_resume(corpus, tmp_path):
    out = tmp_path / "run"
    trained(corpus, out, 10)
    with open(out / "metrics.jsonl", "a") as f:
        # what a disk full during an append left
        f.write('{"kind": "event", "event": "resume", "st')
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
    assert ("could not write /dev/full (No space left on device)" in text
            and fingerprint(out) == before)


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_the_records_of_a_run_killed_before_its_first_save_are_not_repeated(
        corpus, tmp_path, resume):
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
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--init-from", tmp_path / "run",
               "--out-dir", export, expect=2)
    assert "is an export" in text and {p.name: p.read_bytes() for p in export.iterdir()} == before


def test_a_hash_matching_but_malformed_newest_step_falls_back(corpus, tmp_path):
    out = tmp_path / "run"
    trained(corpus, out, 10)
    for name in ("model_step_10.safetensors", "optim_step_10.pt"):
        path = out / name
        # garbage whose hash the meta is then made to record
        path.write_bytes(b"\x00" * path.stat().st_size)
        meta = json.loads((out / "meta_step_10.json").read_text())
        meta["files"][name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (out / "meta_step_10.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning,
                      match="model_step_10.safetensors matches its sha256 but is unreadable"):
        result = runner.invoke(sample.app, ["--out-dir", str(out), "--max-new-tokens", "3",
                                            "--num-samples", "2"])
    assert result.exit_code == 0 and "(step 5)" in result.output
    text = run("--data", corpus, *BASE, "--max-steps", 12, "--save-every", 5, "--out-dir", out)
    assert "resumed from" in text and "step 5" in text


@pytest.mark.smoke
@pytest.mark.parametrize("flags", [["--top-k", "0"], ["--temperature", "-1"],
                                   ["--max-new-tokens", "-5"], ["--device", "tpu"]])
def test_sample_flags_out_of_range_are_usage_errors(tmp_path, flags):
    result = runner.invoke(sample.app, ["--out-dir", str(tmp_path), *flags])
    assert result.exit_code == 2 and f"Invalid value for '{flags[0]}'" in result.output


# -----------------------------------------------------------------------------
# round three: moving steps aside, readers during retention, other data, memory,
# the last rough edges


@pytest.fixture(scope="module")
def run3(corpus, tmp_path_factory):
    """A finished run with checkpoints at steps 1, 2 and 3: copy it (runs) before changing it."""
    out = tmp_path_factory.mktemp("run3") / "run"
    run("--data", corpus, *BASE, "--max-steps", 3, "--save-every", 1, "--keep-last", 0,
        "--out-dir", out)
    return out


def copied(run3, tmp_path):
    shutil.copytree(run3, tmp_path / "run")
    return tmp_path / "run"


def where_each_step_verifies(out):
    """{step: [directories in which it verifies]} over out and every directory in it, hidden
    ones too."""
    found = {}
    for d in [out] + sorted(p for p in Path(out).iterdir() if p.is_dir()):
        for step in ckpt.step_files(d):
            with contextlib.suppress(ckpt.CheckpointError):
                ckpt.read_meta(d, step, verify=True)
                found.setdefault(step, []).append(d.name)
    return found


class Killed(BaseException):
    """What a kill -9 between two renames amounts to: nothing after it runs."""


def killed_after(monkeypatch, renames):
    """os.replace (every rename of the move and of its records) dies after `renames` calls."""
    real, calls = os.replace, []

    def replace(*args):
        if len(calls) == renames:
            raise Killed
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_moving_steps_aside_survives_a_kill_at_every_rename(tmp_path, monkeypatch):
    src = tmp_path / "src"
    for step in (10, 20, 30):
        ckpt.save(src, step, torch.nn.Linear(2, 2), None, {})
    lines = "".join(json.dumps(dict(kind="train", step=s)) + "\n" for s in range(1, 31))
    (src / "metrics.jsonl").write_text(lines)
    for k in itertools.count():
        out = tmp_path / f"kill{k}"
        shutil.copytree(src, out)
        killed_after(monkeypatch, k)
        try:
            # no kill came
            finished = bool(train.move_aside(out, 10, ckpt.step_files(out), "abandoned"))
        except Killed:
            finished = False
        monkeypatch.undo()
        # the next run (--resume auto), first thing; then it resumes the newest step
        train.finish_moves(out)
        train.move_aside(out, ckpt.latest_step(out), ckpt.step_files(out), "abandoned")
        # and its first save, which removes leftovers
        ckpt.save(out, 11, torch.nn.Linear(2, 2), None, {})
        where = where_each_step_verifies(out)
        assert (sorted(where) == [10, 11, 20, 30]
                and all(len(ds) == 1 for ds in where.values())), (k, where)
        assert not list(out.glob(".*.moving")), k
        aside = where[20][0]
        assert (aside.startswith("abandoned-") and where[30] == [aside]
                and where[10] == [f"kill{k}"]), (k, where)
        steps = lambda d: [json.loads(line)["step"]
                           for line in (d / "metrics.jsonl").read_text().splitlines()]
        assert steps(out) == list(range(1, 11)) and steps(out / aside) == list(range(11, 31)), k
        if finished:
            break
    assert k > 6  # six step files, the records, the directory


def test_a_run_killed_while_moving_steps_aside_is_continued_on_its_branch(
        run3, corpus, tmp_path, monkeypatch):
    out = copied(run3, tmp_path)
    killed_after(monkeypatch, 2)  # two of step 2's three files
    with pytest.raises(Killed):
        args = ["--data", corpus, *BASE, "--max-steps", 3, "--out-dir", out, "--resume", 1]
        runner.invoke(train.app, [str(a) for a in args], catch_exceptions=False)
    monkeypatch.undo()
    assert list(out.glob(".abandoned-*.moving"))
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out)  # --resume auto
    assert "resumed from" in text and "step 1" in text
    where = where_each_step_verifies(out)
    assert where[1] == where[2][:1] == ["run"] and where[3][0].startswith("abandoned-")
    # the new step 2 here, the old one aside
    assert len(where[2]) == 2 and where[2][1] == where[3][0]
    assert [r["step"] for r in records(out)] == [1, 2]


def deleted_between_listing_and_reading(monkeypatch, point, delete):
    """Run delete() once, at `point` of a load: after list_steps, inside the hashing, or before
    the tensors are read."""
    target = {"list": (ckpt, "list_steps"), "hash": (ckpt, "sha256"),
              "read": (safetensors.torch, "load_file")}[point]
    real, done = getattr(*target), []

    def at_point(*args, **kwargs):
        result = None if point != "list" else real(*args, **kwargs)
        if not done:
            done.append(1)
            delete()
        return result if point == "list" else real(*args, **kwargs)

    monkeypatch.setattr(*target, at_point)


@pytest.mark.parametrize("point", ["list", "hash", "read"])
def test_a_step_deleted_by_retention_as_it_is_read_falls_back_to_the_newest(
        tmp_path, monkeypatch, point):
    model = torch.nn.Linear(3, 3)
    ckpt.save(tmp_path, 1, model, None, {}, keep_last=1)
    # the writer saves step 2 and its retention deletes step 1 while a reader is loading step 1
    deleted_between_listing_and_reading(
        monkeypatch, point, lambda: ckpt.save(tmp_path, 2, model, None, {}, keep_last=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, meta = ckpt.load_latest(tmp_path, torch.nn.Linear(3, 3))
    assert step == 2 and meta["step"] == 2
    messages = [str(w.message) for w in caught]
    assert any("step 1" in m and "deleted as it was read (by the retention" in m
               for m in messages), messages
    assert not any("corrupt" in m for m in messages), messages


@pytest.mark.parametrize("point", ["list", "hash", "read"])
def test_sample_and_load_model_fall_back_when_the_newest_step_vanishes(
        run3, tmp_path, monkeypatch, point):
    out = copied(run3, tmp_path)
    deleted_between_listing_and_reading(
        monkeypatch, point, lambda: [p.unlink() for p in ckpt.step_files(out)[3]])
    with pytest.warns(UserWarning, match="step 3 .* deleted as it was read"):
        result = runner.invoke(sample.app, ["--out-dir", str(out), "--max-new-tokens", "3",
                                            "--num-samples", "2"])
    assert (result.exit_code == 0 and "(step 2)" in result.output
            and "corrupt" not in result.output), result.output
    monkeypatch.undo()
    flip = out / "model_step_2.safetensors"
    flip.write_bytes(flip.read_bytes()[:-1] + bytes([flip.read_bytes()[-1] ^ 1]))
    # corrupt is still called corrupt
    with pytest.warns(UserWarning, match="model_step_2.safetensors is corrupt"):
        assert official.load_model(out)[2] == 1


def test_resuming_on_other_data_is_refused_unless_meant(run3, corpus, tmp_path):
    out = copied(run3, tmp_path)
    before = fingerprint(out)
    other = tmp_path / "other"
    prepare.prepare(prepare.find_inputs([Path(json.__file__).parent / "tool.py", Path(__file__)]),
                    other, tokenizer="byte", val_fraction=0.2, workers=1, log=lambda *a: None)
    for data in [["--data", other], ["--data", f"{corpus}:1", "--data", f"{other}:1"]]:
        text = run(*data, *BASE, "--max-steps", 4, "--out-dir", out, expect=2)
        assert (f"trained on --data {corpus}" in text and str(other) in text
                and "--new-data" in text), text
        assert ("--resume never" in text and fingerprint(out) == before
                and not list(out.glob("abandoned-*")))
    text = run("--data", other, *BASE, "--max-steps", 4, "--out-dir", out, "--new-data")
    assert "resumed from" in text and "step 3" in text and "step 4:" in text
    assert ckpt.read_meta(out, 4)["data_identity"][0]["path"] == str(other)


def test_the_data_identity_sees_other_shards_not_other_paths(corpus, tmp_path):
    def identity(path):
        sources, weights, _, _ = data.open_blend([str(path)])
        batches = data.Batches(sources, data.BatchConfig(8, 1, 1))
        return [(d["weight"], d["files"]) for d in train.data_identity(batches)]

    shutil.copytree(corpus, tmp_path / "copy")
    # the same shards moved elsewhere: the same data
    assert identity(tmp_path / "copy") == identity(corpus)
    inputs = prepare.find_inputs([Path(json.__file__).parent / "tool.py", Path(json.__file__)])
    prepare.prepare(inputs, tmp_path / "copy", tokenizer="byte", val_fraction=0.2, workers=1,
                    log=lambda *a: None)
    # the same directory prepared again from other text
    assert identity(tmp_path / "copy") != identity(corpus)
    raw = tmp_path / "raw.bin"
    np.arange(1000, dtype=np.uint16).tofile(raw)
    before = identity(raw)
    np.arange(1001, dtype=np.uint16).tofile(raw)
    assert identity(raw) != before  # a raw token file: by its size


@pytest.mark.parametrize("free, settings, ways", [
    (24e9, dict(model="180m"), 2),  # the README's own-data example on a 24 GB CPU
    (8e9, dict(model="180m", grad_checkpointing=True), 1),
    (2e9, dict(model="180m"), 0),  # neither way fits: only another preset
    (1e8, dict(model="tiny", batch_size=256, seq_len=256, total_batch_size=65536), 2)])
def test_a_step_that_cannot_fit_in_memory_is_refused_before_step_1(
        corpus, tmp_path, monkeypatch, free, settings, ways):
    monkeypatch.setattr(train, "free_memory", lambda device: free)

    def not_refused(*args):
        raise AssertionError("a 180m step is not for this CPU")

    monkeypatch.setattr(train, "header", not_refused)
    flags = [f for k, v in settings.items()
             for f in [f"--{k.replace('_', '-')}", v][: 1 if v is True else 2]]
    text = run("--data", corpus, *flags, "--dtype", "fp32", "--out-dir", tmp_path / "run",
               "--dry-run", expect=2)
    assert (f"{free / 1e9:.1f} GB free" in text
            and "parameters with their gradients and AdamW state" in text)
    assert ("a smaller --model" in text and "Traceback" not in text
            and not (tmp_path / "run").exists()), text
    # each way out the message names fits, by the same estimate
    found = re.findall(r"--grad-checkpointing(?: with --batch-size (\d+))?|--batch-size (\d+)",
                       text)
    assert len(found) == ways, text
    cfg = train.resolve(train.TrainConfig(data=[str(corpus)], **settings))
    config = dataclasses.replace(PRESETS[cfg.model], vocab_size=257)
    for with_recompute, batch in found:
        train.check_memory(dataclasses.replace(
            cfg, grad_checkpointing=not batch or cfg.grad_checkpointing,
            batch_size=int(with_recompute or batch or cfg.batch_size)), config)


def test_memory_on_a_gpu_refuses_only_what_is_sure(monkeypatch):
    cfg = train.resolve(train.TrainConfig(data=["x"], model="180m", device="cpu"))
    cfg = dataclasses.replace(cfg, device="cuda")
    config = dataclasses.replace(PRESETS["180m"], vocab_size=50257)
    # the weights' state fits, the activations may not
    monkeypatch.setattr(train, "free_memory", lambda device: 20e9)
    with pytest.warns(UserWarning, match="if it runs out"):
        train.check_memory(cfg, config)
    # not even the weights, gradients, AdamW state
    monkeypatch.setattr(train, "free_memory", lambda device: 1e9)
    with pytest.raises(train.TrainError, match="2.0 GB for 127.0M parameters"):
        train.check_memory(cfg, config)
    monkeypatch.setattr(train, "free_memory", lambda device: None)  # unknown: no check
    train.check_memory(dataclasses.replace(cfg, device="cpu"), config)


@pytest.mark.parametrize("impl", ["foo", "Triton"])
def test_an_unknown_scan_impl_is_refused_before_anything_is_written(
        corpus, run3, tmp_path, monkeypatch, impl):
    monkeypatch.setenv("MAMBA3_IMPL", impl)
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", tmp_path / "run", expect=2)
    assert (f"MAMBA3_IMPL={impl}" in text and impl in text.split("got")[-1]
            and not (tmp_path / "run").exists())
    result = runner.invoke(sample.app, ["--out-dir", str(run3), "--prompt", "PROMPT",
                                        "--max-new-tokens", "3"])
    assert (result.exit_code == 2 and f"MAMBA3_IMPL={impl}" in result.output
            and "PROMPT" not in result.output)


def test_triton_on_a_cpu_without_its_interpreter_is_one_sentence(corpus, tmp_path):
    env = {**os.environ, "MAMBA3_IMPL": "triton", "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", str(corpus), *map(str, BASE),
           "--max-steps", "2", "--out-dir", str(tmp_path / "run"), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert (proc.returncode == 2 and "MAMBA3_IMPL=triton" in proc.stderr
            and "TRITON_INTERPRET=1" in proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("app, flags", [(train.app, ["--data", "x"]), (sample.app, [])])
@pytest.mark.parametrize("seed", [2**63, 2**64, 10**30])
def test_a_seed_beyond_int64_is_a_usage_error(app, flags, seed):
    result = runner.invoke(app, [*flags, "--seed", str(seed)])
    assert result.exit_code == 2 and "Invalid value for '--seed'" in result.output


@pytest.mark.smoke
@pytest.mark.parametrize("flags, message", [
    (["--out-dir", ""], "--out-dir is empty"), (["--out-dir", "  "], "--out-dir is empty"),
    (["--init-from", ""], "--init-from is empty"), (["--init-from", " "], "--init-from is empty"),
    (["--data", ""], "--data is empty"),
    (["--lr", "inf"], "--lr inf: expected a finite number"),
    (["--lr", "nan"], "--lr nan: expected a finite number"),
    (["--min-lr", "nan"], "'--min-lr'"),
    (["--grad-clip", "inf"], "--grad-clip inf: expected a finite number"),
    (["--weight-decay", "inf"], "--weight-decay inf: expected a finite number")])
def test_bad_numbers_and_names_are_refused(corpus, tmp_path, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    text = run("--data", corpus, *BASE, "--max-steps", 2, *flags, expect=2)
    assert message in text and "Traceback" not in text and not list(tmp_path.iterdir())


@pytest.mark.parametrize("same", [lambda out: out, lambda out: f"{out}/",
                                  lambda out: out.parent / "." / out.name])
def test_init_from_its_own_out_dir_is_refused(run3, corpus, tmp_path, same):
    out = copied(run3, tmp_path)
    before, metrics = fingerprint(out), (out / "metrics.jsonl").read_text()
    text = run("--data", corpus, *BASE, "--max-steps", 5, "--init-from", same(out),
               "--out-dir", out, expect=2)
    assert "--init-from and --out-dir are both" in text and "another --out-dir" in text
    assert fingerprint(out) == before and (out / "metrics.jsonl").read_text() == metrics


def test_resets_without_an_eos_id_and_another_tokenizer_than_init_froms_are_refused(
        run3, corpus, tmp_path):
    raw = tmp_path / "raw.bin"  # a raw token file records no EOS id
    (np.arange(20000) % 257).astype(np.uint16).tofile(raw)
    text = run("--data", raw, *BASE, "--max-steps", 2, "--reset-at-eos",
               "--out-dir", tmp_path / "a", expect=2)
    assert ("--reset-at-eos needs data that records its EOS id (a prepare.py directory); "
            f"{raw} does not" in text)
    other = tmp_path / "gpt2-corpus"  # the same ids, said to be GPT-2's: they would mean other text
    shutil.copytree(corpus, other)
    m = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**m, "tokenizer": {"name": "gpt2"}}))
    text = run("--data", other, *BASE, "--max-steps", 2, "--init-from", run3,
               "--out-dir", tmp_path / "b", expect=2)
    assert f"--init-from {run3} has the byte tokenizer, the data gpt2" in " ".join(text.split())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.smoke
@pytest.mark.parametrize("under", [False, True])
def test_an_out_dir_that_is_a_file_is_called_a_file(corpus, tmp_path, under):
    (tmp_path / "notes").write_text("mine")
    out = tmp_path / "notes" / "run" if under else tmp_path / "notes"
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, expect=2)
    assert "is a file (or lies under one), not a directory" in text and "File exists" not in text
    assert (tmp_path / "notes").read_text() == "mine"


@pytest.mark.parametrize("flags", [["--vocab-size", 300], ["--model", "small"], ["--reset-at-eos"]])
def test_resuming_another_model_advises_flags_not_strict_false(run3, corpus, tmp_path, flags):
    out = copied(run3, tmp_path)
    before = fingerprint(out)
    text = run("--data", corpus, *BASE[2:], "--model", "tiny", "--max-steps", 4, "--out-dir", out,
               *flags, expect=2)
    assert ("does not fit the model" in text and "--vocab-size" in text
            and "--resume never" in text), text
    assert "strict=False" not in text and fingerprint(out) == before


@pytest.mark.parametrize("k", [0, 1, 2])
def test_an_io_error_on_the_last_fsync_of_a_save_says_the_step_was_written(
        tmp_path, monkeypatch, k):
    model = torch.nn.Linear(2, 2)
    ckpt.save(tmp_path, 1, model, None, {})
    real, calls = ckpt.fsync, []

    # the directory's fsyncs: after each of the three renames; k counts from the last
    def fsync(path):
        if Path(path) == tmp_path:
            calls.append(path)
            if len(calls) == 3 - k:
                raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(ckpt, "fsync", fsync)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.save(tmp_path, 2, model, None, {})
    if k == 0:  # the meta was renamed: the step is there
        assert "checkpoint step 2 was written" in str(e.value) and "Free space" not in str(e.value)
        assert where_each_step_verifies(tmp_path) == {1: [tmp_path.name], 2: [tmp_path.name]}
    else:
        assert ("could not write checkpoint step 2" in str(e.value)
                and "I/O error: check it" in str(e.value))
        assert "Free space" not in str(e.value) and ckpt.list_steps(tmp_path) == [1]


@pytest.mark.parametrize("state", [
    {"something": 1}, [1, 2], {"optimizer": None, "rng": {"torch": "x"}},
    {"optimizer": None, "rng": {"torch": torch.zeros(3, dtype=torch.uint8), "cuda": None,
                                "python": (3, (1,), None), "numpy": {"name": "MT19937"}}},
    {"optimizer": [1], "rng": {}}])
def test_a_hash_matching_optimizer_file_of_another_structure_is_corrupt(tmp_path, state):
    good = torch.nn.Linear(2, 2)
    ckpt.save(tmp_path, 1, good, None, {})
    ckpt.save(tmp_path, 2, torch.nn.Linear(2, 2), None, {})
    torch.save(state, tmp_path / "optim_step_2.pt")
    meta = json.loads((tmp_path / "meta_step_2.json").read_text())
    digest = hashlib.sha256((tmp_path / "optim_step_2.pt").read_bytes()).hexdigest()
    meta["files"]["optim_step_2.pt"] = {"bytes": (tmp_path / "optim_step_2.pt").stat().st_size,
                                        "sha256": digest}
    (tmp_path / "meta_step_2.json").write_text(json.dumps(meta))
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CorruptCheckpoint,
                       match="optim_step_2.pt matches its sha256 but is unreadable"):
        ckpt.load(tmp_path, 2, model, restore_rng=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing changed
    with pytest.warns(UserWarning, match="trying an earlier step"):
        assert ckpt.load_latest(tmp_path, model, restore_rng=True)[0] == 1


def test_a_lost_peer_under_torchrun_is_one_paragraph(monkeypatch):
    cfg = train.TrainConfig(data=["x"], out_dir="runs/a")
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                        "Connection closed by peer [127.0.0.1]:41368. "
                        "This is typically caused by a remote worker crashing.")
    assert train.lost_peer(gloo, cfg) is gloo  # a world of one: not a lost peer
    for name, value in [("is_initialized", True), ("get_world_size", 4), ("get_rank", 0)]:
        monkeypatch.setattr(train.dist, name, lambda value=value: value)
    e = train.lost_peer(gloo, cfg)
    assert isinstance(e, train.TrainError) and "rank 0 of 4 lost another rank" in str(e)
    assert ("Connection closed by peer [127.0.0.1]:41368" in str(e)
            and "resumes from the newest checkpoint in runs/a" in str(e))
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert train.lost_peer(bug, cfg) is bug  # a bug keeps its traceback


@pytest.mark.parametrize("fault", ["directory", "read-only"])
def test_plot_into_a_place_it_cannot_write_is_one_paragraph(run3, tmp_path, monkeypatch, fault):
    target = tmp_path / "plot.png"
    if fault == "directory":
        target.mkdir()
    else:  # (root writes anywhere: the refusal a read-only place gives, injected)
        def read_only(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(target))

        from matplotlib.figure import Figure  # plot.py imports it where it draws
        monkeypatch.setattr(Figure, "savefig", read_only)
    result = runner.invoke(plot.app, [str(run3), "--out", str(target)])
    assert result.exit_code == 2 and f"--out {target}: could not write it" in result.output
    assert ("Is a directory" if fault == "directory" else "Permission denied") in result.output


def test_a_full_disk_while_trimming_the_records_leaves_no_temporary_file(
        run3, corpus, tmp_path, monkeypatch):
    out = copied(run3, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"kind": "event", "st')  # a record cut short: the resume rewrites the file

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data.os, "fsync", disk_full)
    text = run("--data", corpus, *BASE, "--max-steps", 3, "--out-dir", out, expect=2)
    assert "could not write" in text and "metrics.jsonl (No space left on device)" in text
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_rerunning_a_finished_run_says_there_is_nothing_to_do(run3, corpus, tmp_path):
    out = copied(run3, tmp_path)
    before = fingerprint(out)
    text = run("--data", corpus, *BASE, "--max-steps", 3, "--out-dir", out)
    assert (text.index("is at step 3 of --max-steps 3 already: nothing to do")
            < text.index("mamba3-lite train"))
    assert fingerprint(out) == before and "step 4" not in text


def test_a_finished_run_rerun_changes_nothing_on_disk(run3, corpus, tmp_path):
    out = copied(run3, tmp_path)

    def contents():
        # The lock file names the process that holds the directory, the rerun while it reads
        return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*"))
                if p.is_file() and p.name != ".lock"}

    before = contents()
    # other flags than the run's: a config.json written now would differ
    text = run("--data", corpus, *BASE, "--max-steps", 3, "--log-every", 1, "--out-dir", out)
    assert "nothing to do" in text
    assert contents() == before and (out / ".lock").is_file()


def test_files_are_written_with_the_users_umask(run3, tmp_path):
    mode = 0o666 & ~ckpt._UMASK
    export = official.export(run3, tmp_path / "export")
    for d in (run3, export):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in d.iterdir() if p.is_file()}
        assert set(modes.values()) == {oct(mode)}, modes


def test_the_readmes_directories_are_ignored_by_git():
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {"/export/", "/runs/", "/out/", "/data/"} <= set(ignored)
