"""train.py and sample.py end to end on the tiny preset and a small byte-level corpus prepared
here."""
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from test_prepare import drop_byte_counts

import ckpt
import data
import official
import prepare
import sample
import train
from model import Mamba3LM

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()

# a tiny model, short context, 2 micro-steps of 4 sequences per optimizer step
# (float32, so that the numerics do not depend on whether this CPU has bf16 arithmetic, where
# auto picks bf16)
BASE = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--total-batch-size", "256",
        "--log-every", "1", "--eval-every", "1000", "--eval-batches", "2", "--lr", "3e-3",
        "--warmup-steps", "2", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~60k byte tokens of Python source, 10% held out."""
    src = tmp_path_factory.mktemp("src")
    lib = Path(json.__file__).parent
    for f in sorted(lib.glob("*.py")):
        (src / f.name).write_text(f.read_text())
    out = tmp_path_factory.mktemp("data") / "corpus"
    prepare.prepare(prepare.find_inputs([src]), out, tokenizer="byte", val_fraction=0.2, workers=1,
                    log=lambda *a: None)
    return out


def run(*args, expect=0):
    """train.py in-process through its real command line."""
    result = runner.invoke(train.app, [str(a) for a in args])
    if result.exit_code != expect:
        raise AssertionError(f"exit {result.exit_code}, expected {expect}:\n"
                             f"{result.output}\n{result.exception!r}")
    return result.output


def records(out_dir, kind="train"):
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(out_dir):
    return {r["step"]: r["loss"] for r in records(out_dir)}


def weights(out_dir, step):
    return load_file(str(Path(out_dir) / f"model_step_{step}.safetensors"))


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_loss_falls_and_metrics_are_written(corpus, tmp_path):
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--max-steps", 40, "--out-dir", out, "--eval-every", 20,
               "--save-every", 20)
    assert "tiny" in text and "val loss" in text
    train_recs = records(out)
    assert [r["step"] for r in train_recs] == list(range(1, 41))
    first, last = train_recs[0]["loss"], sum(r["loss"] for r in train_recs[-5:]) / 5
    assert first > math.log(257) - 0.3 and last < first - 1.5
    for r in train_recs:
        assert {"loss", "ppl", "lr", "grad_norm", "tok_per_s", "ms_per_step"} <= r.keys()
        assert abs(r["ppl"] - math.exp(r["loss"])) < 1e-6 * r["ppl"]
    evals = records(out, "eval")
    assert [r["step"] for r in evals] == [20, 40] and evals[1]["val_loss"] < evals[0]["val_loss"]
    # each record carries what plot.py draws it against: the tokens seen
    assert all(r["tokens"] == r["step"] * 256 for r in train_recs + evals)
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == "tiny" and config["total_batch_size"] == 256
    meta = json.loads((out / "meta_step_40.json").read_text())
    assert meta["config"] == config and meta["tokens_seen"] == 40 * 256 and meta["tag"] == "final"
    assert meta["tokenizer"] == {"name": "byte"} and meta["data"]["consumed"] == 40 * 8


def test_resumed_run_continues_bit_for_bit(corpus, tmp_path, sigterm_in_step):
    args = ["--data", corpus, *BASE, "--max-steps", 12, "--save-every", 6]
    run(*args, "--out-dir", tmp_path / "straight")

    # the second run is stopped by SIGTERM during step 6 (steps count from 0): it finishes the
    # step, saves step 7 and exits; then it is resumed
    sigterm_in_step.stop(6)
    text = run(*args, "--out-dir", tmp_path / "resumed")
    assert "stopped by SIGTERM at step 7" in text
    assert (tmp_path / "resumed" / "meta_step_7.json").exists()
    sigterm_in_step.resume()
    text = run(*args, "--out-dir", tmp_path / "resumed")
    assert "resumed from" in text and "step 7" in text

    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")
    assert_same_weights(weights(tmp_path / "straight", 12), weights(tmp_path / "resumed", 12))


def test_sigkill_between_checkpoints_then_resume(corpus, tmp_path):
    args = ["--data", corpus, *BASE, "--max-steps", 10, "--save-every", 4]
    run(*args, "--out-dir", tmp_path / "straight")
    # a child that kills itself with SIGKILL two steps after committing step 4, once it has logged
    # steps 5 and 6
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import train
        forward, calls = train.micro_step, []
        def die_in_step_7(model, x, y, autocast):
            calls.append(1)
            if len(calls) == 2 * 6 + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return forward(model, x, y, autocast)
        train.micro_step = die_in_step_7
        sys.argv = ["train.py"] + {[str(a) for a in args + ["--out-dir", tmp_path / "killed"]]!r}
        train.app()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [r["step"] for r in records(tmp_path / "killed")] == list(range(1, 7))
    run(*args, "--out-dir", tmp_path / "killed")
    straight, killed = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert killed == straight
    # the records the killed run wrote past its last checkpoint were dropped: one record per step
    assert [r["step"] for r in records(tmp_path / "killed")] == list(range(1, 11))
    assert_same_weights(weights(tmp_path / "straight", 10), weights(tmp_path / "killed", 10))


def test_resume_step_is_honoured(corpus, tmp_path):
    out = tmp_path / "run"
    args = ["--data", corpus, *BASE, "--max-steps", 12, "--save-every", 4, "--out-dir", out,
            "--keep-last", 0]
    run(*args)
    original = weights(out, 12)
    # step 12 is the newest checkpoint, but --resume 4 must load step 4 and train steps 5-12 again
    text = run(*args, "--resume", 4)
    assert "resumed from" in text and "step 4" in text
    # the abandoned branch (steps 8 and 12 and their records) was moved aside, not deleted or
    # mixed in
    aside = next(out.glob("abandoned-*"))
    assert sorted(p.name for p in aside.glob("meta_step_*")) == ["meta_step_12.json",
                                                                 "meta_step_8.json"]
    assert [r["step"] for r in records(aside)] == list(range(5, 13))
    assert [r["step"] for r in records(out)] == list(range(1, 13))
    assert_same_weights(original, weights(out, 12))
    # a run that has reached --max-steps resumed with fewer steps is a clean error, not a silent
    # choice
    text = run(*args[:-4], "--max-steps", 8, "--out-dir", out, expect=2)
    assert "below the resumed step 12" in text


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_nonfinite_steps_are_skipped_and_a_run_of_them_rolls_back(corpus, tmp_path, monkeypatch,
                                                                  optimizer):
    out = tmp_path / "run"
    real = train.micro_step
    seen, params_at = [], {}
    poisoned = {6, 7, 8}  # optimizer steps whose loss is NaN (steps count from 0)

    def faulty(model, x, y, autocast):
        if not model.training:  # the final eval
            return real(model, x, y, autocast)
        step = len(seen) // 2
        seen.append(x[:, :8].clone())
        params_at.setdefault(step, [p.detach().clone() for p in model.parameters()])
        loss = real(model, x, y, autocast)
        return loss * float("nan") if step in poisoned or step == 3 else loss

    monkeypatch.setattr(train, "micro_step", faulty)
    text = run("--data", corpus, *BASE, "--max-steps", 12, "--save-every", 5, "--nan-guard", 3,
               "--optimizer", optimizer, "--out-dir", out)
    assert text.count("update skipped") == 4
    # a lone non-finite step (3) skips the update: the weights going into step 4 are those of step 3
    assert all(torch.equal(a, b) for a, b in zip(params_at[3], params_at[4]))
    # three in a row (6, 7, 8) restore checkpoint 5; step 9 starts from its weights
    saved = weights(out, 5)
    names = [n for n, _ in Mamba3LM(train.PRESETS["tiny"]).named_parameters()]
    assert all(torch.equal(p, saved[n]) for n, p in zip(names, params_at[9]))
    events = [r for r in records(out, "event") if r["event"] == "rollback"]
    assert events == [{"kind": "event", "event": "rollback", "step": 9, "restored": 5}]
    # the data cursor kept moving: no batch was seen twice
    assert len({tuple(t.flatten().tolist()) for t in seen}) == len(seen) == 24
    meta = json.loads((out / "meta_step_12.json").read_text())
    assert meta["skipped_steps"] == 4 and meta["optimizer_steps"] == 8


def test_the_nan_guard_rules(tmp_path):
    model, events = torch.nn.Linear(2, 2), []
    log = lambda line, **record: events.append(record)  # noqa: E731
    with torch.no_grad():
        model.weight.fill_(1.0)
    guard = train.NanGuard(limit=2, explode=10.0, out=tmp_path)
    assert guard.finite(1.0, 1.0, 1, log) and not guard.due() and guard.poison(model) is None
    # one bad step: skipped, no rollback
    assert not guard.finite(math.nan, 1.0, 2, log) and not guard.due()
    assert guard.poison(model) == "1 non-finite steps in a row"  # and not saved
    assert guard.finite(1.0, 1.0, 3, log) and guard.streak == 0  # a good step ends the streak
    assert (not guard.finite(1.0, math.inf, 4, log) and not guard.finite(math.nan, 1.0, 5, log)
            and guard.due())
    assert guard.skipped == 3 and events == [{"kind": "event", "event": "nonfinite", "step": s}
                                             for s in (2, 4, 5)]
    with pytest.raises(train.TrainError, match="2 bad steps in a row at step 7 and no checkpoint"):
        guard.roll_back(model, None, 7, log)
    events.clear()

    ckpt.save(tmp_path, 4, model, None, {})
    with torch.no_grad():
        model.weight.fill_(100.0)  # blown up while finite: not saved, and a rollback is due at once
    guard = train.NanGuard(limit=5, explode=10.0, out=tmp_path)
    assert guard.poison(model) == "the weights have exploded (max |w| 100)" and guard.due()
    guard.roll_back(model, None, 9, log)
    assert not guard.due() and model.weight.max() == 1.0  # step 4's weights
    assert events == [{"kind": "event", "event": "rollback", "step": 9, "restored": 4}]
    guard.streak = 5
    guard.roll_back(model, None, 12, log)
    guard.streak = 5  # the third time back to step 4 with no clean save point between: it stops
    with pytest.raises(train.TrainError, match="rolled back to step 4 3 times in a row"):
        guard.roll_back(model, None, 15, log)
    guard = train.NanGuard(limit=5, explode=10.0, out=tmp_path, rollbacks=2)
    assert guard.poison(model) is None and guard.rollbacks == 0  # a clean save point: counts afresh
    assert not train.NanGuard(limit=0, explode=10.0, out=tmp_path, streak=100).due()  # 0: never


def test_rollback_without_a_checkpoint_is_a_clear_error(corpus, tmp_path, monkeypatch):
    real = train.micro_step
    monkeypatch.setattr(train, "micro_step", lambda *a: real(*a) * float("nan"))
    text = run("--data", corpus, *BASE, "--max-steps", 12, "--nan-guard", 2, "--out-dir", tmp_path,
               expect=2)
    assert "no checkpoint" in text and "Traceback" not in text


def start_train(corpus, out):
    """A long train.py run in a child process, its output (stdout and stderr) readable line by
    line."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", str(corpus), *map(str, BASE),
           "--max-steps", "100000", "--out-dir", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_sigterm_saves_and_exits_cleanly(corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_train(corpus, out)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 3:"):
            proc.send_signal(signal.SIGTERM)
            break
    seen.append(proc.stdout.read())
    code = proc.wait(timeout=120)
    output = "".join(seen)
    assert code == 0, f"exit status {code}:\n{output}"
    stopped = [l for l in output.splitlines() if "stopped by SIGTERM" in l]
    assert stopped, output
    step = int(stopped[0].split("at step ")[1].split(";")[0])
    assert step >= 3 and (out / f"meta_step_{step}.json").exists(), output


# Muon runs its Newton-Schulz steps in bf16, which turns the last bits in which the two
# processes' gradient sums differ into bf16 roundings of the update: a looser match.
@pytest.mark.parametrize("optimizer, tol", [("adamw", 1e-5), ("muon", 1e-4)])
def test_two_process_gloo_matches_one_process_and_resumes_on_another_world_size(
        corpus, tmp_path, optimizer, tol):
    args = ["--data", corpus, *BASE, "--batch-size", "2", "--max-steps", 6, "--save-every", 3,
            "--optimizer", optimizer]
    run(*args, "--out-dir", tmp_path / "one")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *map(str, args), "--max-steps", "3",
           "--out-dir", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 2" in proc.stdout and "2 ranks" in proc.stdout
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3]
    for s in two:  # same samples per step; only the order of the sums differs
        assert abs(one[s] - two[s]) < tol
    # resume the 2-process run in 1 process: it continues the same data
    run(*args, "--out-dir", tmp_path / "two")
    two = losses(tmp_path / "two")
    for s in range(4, 7):
        assert abs(one[s] - two[s]) < 10 * tol


@pytest.mark.smoke
def test_dry_run_writes_nothing_and_synthetic_says_so(corpus, tmp_path):
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--dry-run", "--out-dir", out)
    assert "step 2:" in text and "val loss" in text and not out.exists()
    # CPU bf16 autocast
    text = run("--data", corpus, *BASE, "--dtype", "bf16", "--dry-run", "--out-dir", out)
    assert "dtype bf16" in text and "step 2:" in text and not out.exists()
    text = run("--data", "synthetic", *BASE, "--vocab-size", 300, "--max-steps", 2,
               "--out-dir", out)
    assert "SYNTHETIC" in text


def test_the_header_names_the_mimo_rank(tmp_path):
    args = ["--data", "synthetic", *BASE, "--vocab-size", 300, "--dry-run", "--out-dir",
            tmp_path / "run"]
    model_line = lambda text: next(  # noqa: E731
        line for line in text.splitlines() if "parameters (" in line)
    assert "vocab 300, mimo rank 4)" in model_line(run(*args, "--mimo-rank", 4))
    assert "mimo" not in model_line(run(*args))  # SISO: rank 1 is not named


def test_blended_sources(corpus, tmp_path):
    text = run("--data", f"{corpus}:3", "--data", f"{corpus}:1", *BASE, "--max-steps", 2,
               "--out-dir", tmp_path)
    assert "(75% of the samples)" in text and "(25% of the samples)" in text


@pytest.mark.smoke
@pytest.mark.parametrize("extra,message", [
    (["--vocab-size", "100"], "vocab_size 100"),
    (["--total-batch-size", "100"], "not a multiple of --seq-len"),
    (["--total-batch-size", "96"], "not a multiple of micro_batch"),
    (["--resume", "7"], "step 7"),
    (["--resume", "latest"], "expected auto, never or a step number"),
    (["--lr", "0"], "--lr must be positive"),
    (["--lr", "-1"], "--lr must be positive"),
])
def test_clean_errors(corpus, tmp_path, extra, message):
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, *extra, expect=2)
    assert message in text and "Traceback" not in text and text.startswith("error:")
    assert not out.exists()  # refused before anything was written


@pytest.mark.smoke
@pytest.mark.parametrize("extra", [
    ["--model", "huge"], ["--schedule", "linear"], ["--dtype", "fp8"], ["--device", "tpu"],
    ["--seed", "-1"], ["--keep-last", "-1"], ["--save-every", "0"], ["--eval-every", "0"],
    ["--eval-batches", "0"], ["--log-every", "0"], ["--max-steps", "0"], ["--nan-guard", "-1"],
])
def test_flags_out_of_range_are_usage_errors(corpus, tmp_path, extra):
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--out-dir", out, *extra, expect=2)
    assert (f"Invalid value for '{extra[0]}'" in text and "Traceback" not in text
            and not out.exists())


@pytest.mark.smoke
def test_missing_data_and_refusal_to_mix_runs(corpus, tmp_path):
    text = run("--data", tmp_path / "nope", *BASE, "--out-dir", tmp_path / "x", expect=2)
    assert "nope" in text and "Traceback" not in text
    text = run("--data", corpus, *BASE, "--out-dir", tmp_path / "x", "--resume", 5, expect=2)
    assert "step 5" in text and not (tmp_path / "x").exists()  # a refused run leaves nothing behind
    out = tmp_path / "run"
    run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out)
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, "--resume", "never",
               expect=2)
    assert "already holds checkpoints" in text
    run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, "--resume", "never",
        "--overwrite")
    moved = list(out.glob("previous-*/meta_step_2.json"))
    assert len(moved) == 1 and (out / "meta_step_2.json").exists()


def test_sample_greedy_equals_generate(corpus, tmp_path):
    out = tmp_path / "run"
    run("--data", corpus, *BASE, "--max-steps", 20, "--out-dir", out)
    result = runner.invoke(sample.app, ["--out-dir", str(out), "--prompt", "def ",
                                        "--max-new-tokens", "40", "--top-k", "1",
                                        "--temperature", "1.0"])
    assert result.exit_code == 0, result.output
    model, meta, step = official.load_model(out)
    tokenizer = data.load_tokenizer(meta["tokenizer"], out)
    assert step == 20
    # The prompt starts a document: after an end-of-text token, as in training.
    prompt = [tokenizer.eos_id] + tokenizer.encode("def ")
    ids = model.generate(torch.tensor([prompt]), 40, top_k=1)[0, 5:].tolist()
    if tokenizer.eos_id in ids:
        ids = ids[: ids.index(tokenizer.eos_id)]
    assert result.output == "def " + tokenizer.decode(ids) + "\n"
    result = runner.invoke(sample.app, ["--out-dir", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no such directory" in result.output


def test_sample_refuses_an_empty_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where an empty path ("." to pathlib) would point
    result = runner.invoke(sample.app, ["--out-dir", ""])
    assert result.exit_code == 2, result.output
    assert (" ".join(result.stderr.split()) == "error: --out-dir: expected a path, found an "
            "empty string")
    assert list(tmp_path.iterdir()) == []


def test_sample_never_draws_ids_beyond_the_tokenizer(tmp_path):
    # a model trained with --vocab-size 2000 on byte data: an untrained one puts most mass on
    # ids 257..1999
    from model import PRESETS

    model = Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=2000))
    ckpt.save(tmp_path, 1, model, None, {"tokenizer": {"name": "byte"}})
    result = runner.invoke(sample.app, ["--out-dir", str(tmp_path), "--max-new-tokens", "30",
                                        "--temperature", "1"])
    assert result.exit_code == 0, result.output


def test_init_from_a_run_or_an_export_starts_from_those_weights_and_nothing_else(
        corpus, tmp_path, monkeypatch):
    src = tmp_path / "src"
    run("--data", corpus, *BASE, "--max-steps", 6, "--out-dir", src)
    official.export(src, tmp_path / "export")
    source = weights(src, 6)
    real, first = train.micro_step, {}

    def record_start(model, x, y, autocast):
        first.setdefault("params", {k: v.detach().clone() for k, v in model.state_dict().items()})
        first.setdefault("x", x.clone())
        return real(model, x, y, autocast)

    monkeypatch.setattr(train, "micro_step", record_start)
    for path in (src, tmp_path / "export"):
        first.clear()
        out = tmp_path / f"from-{path.name}"
        text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out, "--init-from", path)
        # the recipe of the preset of that shape
        assert f"init from  {path}" in text and "tiny" in text
        # exactly the source's weights (an export drops the padding rows)
        for k, v in first["params"].items():
            want = source[k] if "embed" not in k and "lm_head" not in k else source[k][:257]
            assert torch.equal(v if v.shape == want.shape else v[:257], want), k
        meta = json.loads((out / "meta_step_2.json").read_text())
        # fresh data and schedule
        assert meta["tokens_seen"] == 2 * 256 and meta["data"]["consumed"] == 2 * 8
        fresh = first["x"]
    first.clear()
    run("--data", corpus, *BASE, "--max-steps", 1, "--out-dir", tmp_path / "scratch")
    assert torch.equal(first["x"], fresh)  # the same data order as a run from scratch
    for extra, message in ((["--model", "small"], "may not change it"),
                           (["--vocab-size", "300"], "may not change it")):
        text = run("--data", corpus, *BASE, "--out-dir", tmp_path / "x", "--init-from", src,
                   *extra, expect=2)
        assert message in text and not (tmp_path / "x").exists()
    text = run("--data", corpus, *BASE, "--out-dir", tmp_path / "x", "--init-from",
               tmp_path / "nowhere", expect=2)
    assert "expected a train.py run directory" in text


def test_eval_records_bits_per_byte_only_when_the_manifest_counts_bytes(corpus, tmp_path):
    import shutil
    val = json.loads((corpus / "manifest.json").read_text())["splits"]["val"]
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out)
    (record,) = records(out, "eval")
    # The split's bytes per token stand in for those of the windows evaluated.
    expected = record["val_loss"] / math.log(2) * val["tokens"] / val["bytes"]
    assert record["val_bpb"] == pytest.approx(expected, rel=1e-12)
    assert list(record).index("val_bpb") == list(record).index("val_loss") + 1
    assert f"bpb {record['val_bpb']:.4f}" in text
    # A manifest from before the byte counts: the eval is as it was.
    old = tmp_path / "old"
    shutil.copytree(corpus, old)
    drop_byte_counts(old)
    text = run("--data", old, *BASE, "--max-steps", 2, "--out-dir", tmp_path / "run2")
    (again,) = records(tmp_path / "run2", "eval")
    assert "val_bpb" not in again and "bpb" not in text
    assert again["val_loss"] == record["val_loss"]


# -----------------------------------------------------------------------------
# --optimizer muon


def muon_config(**overrides):
    """The fields of TrainConfig that build_optimizers reads."""
    fields = dict(optimizer="muon", lr=3e-3, muon_lr=6e-3, weight_decay=0.1, device="cpu")
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.smoke
@pytest.mark.parametrize("mimo_rank", [1, 2])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(mimo_rank):
    from model import PRESETS

    config = dataclasses.replace(PRESETS["tiny"], vocab_size=300, mimo_rank=mimo_rank)
    model = Mamba3LM(config)
    muon, adamw = train.build_optimizers(model, muon_config())
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    # Every parameter is in exactly one group.
    grouped = [p for opt in (muon, adamw) for g in opt.param_groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped})
    assert {id(p) for p in grouped} == {id(p) for p in model.parameters()}
    # Muon: the Linear weights inside the blocks, and nothing else; all 2-D.
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = sorted(names[id(p)] for g in muon.param_groups for p in g["params"])
    linear = sorted(f"{n}.weight" for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear) and n.startswith("blocks."))
    assert in_muon == linear and all(p.dim() == 2 for p in muon.param_groups[0]["params"])
    # AdamW: the embedding (tied to the LM head) decays, the vectors do not, whatever their
    # number of dimensions (B_bias and MIMO's vectors are not 1-D).
    decayed, flat = adamw.param_groups
    assert [names[id(p)] for p in decayed["params"]] == ["embed.weight"]
    assert decayed["weight_decay"] == 0.1 and flat["weight_decay"] == 0.0
    assert any(p.dim() > 1 for p in flat["params"])
    assert train.lr_scales([muon, adamw], muon_config()) == [2.0, 1.0, 1.0]
    # The memory check counts Muon's one buffer against AdamW's two moments.
    in_muon_numel = sum(p.numel() for p in muon.param_groups[0]["params"])
    total = model.num_params()
    want = 12 * in_muon_numel + 16 * (total - in_muon_numel)
    assert train.training_state_bytes(config, "muon") == want
    assert train.training_state_bytes(config, "adamw") == 16 * total
    # AdamW alone is one optimizer over model.param_groups, as before Muon.
    (only,) = train.build_optimizers(model, muon_config(optimizer="adamw"))
    assert isinstance(only, torch.optim.AdamW) and len(only.param_groups) == 2


def test_muons_momentum_warms_up_over_100_steps():
    momentum = train.muon_momentum
    assert momentum(0) == 0.85 and momentum(100) == 0.95 and momentum(5000) == 0.95
    assert momentum(50) == pytest.approx(0.90)


def newton_schulz(G, steps=5):
    """The quintic Newton-Schulz iteration toward the orthogonal factor of G (float64)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / G.norm()
    tall = G.size(0) > G.size(1)
    if tall:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.T
    return X


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_a_muon_step_is_nesterov_momentum_orthogonalized(shape):
    # Two steps of the run's Muon on one matrix against the update written out here:
    # momentum, the Nesterov look-ahead, Newton-Schulz, the RMS-matching LR, decoupled decay.
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(*shape))
    lr, wd, mu = 0.01, 0.1, 0.95
    opt = torch.optim.Muon([W], lr=lr, weight_decay=wd, momentum=mu, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    buf = torch.zeros(shape, dtype=torch.float64)
    # The LR matched to AdamW's update RMS.
    scale = lr * 0.2 * max(shape) ** 0.5
    for _ in range(3):
        before = W.detach().double().clone()
        G = torch.randn(*shape)
        W.grad = G.clone()
        opt.step()
        G = G.double()
        buf = mu * buf + (1 - mu) * G
        update = newton_schulz((1 - mu) * G + mu * buf)
        want = before * (1 - lr * wd) - scale * update
        # torch runs the iteration in bf16, which bounds the agreement to about 2% of the
        # step; momentum without the look-ahead would be 35-45% off from the second step.
        error = (want - W.detach().double()).norm() / (scale * update.norm())
        assert error < 4e-2
    # The result is near-orthogonal: singular values near 1 (the quintic's band).
    s = torch.linalg.svdvals(newton_schulz(torch.randn(*shape, dtype=torch.float64)))
    assert s.min() > 0.6 and s.max() < 1.3


def test_a_muon_run_resumes_bit_for_bit(corpus, tmp_path, sigterm_in_step):
    args = ["--data", corpus, *BASE, "--max-steps", 8, "--save-every", 4, "--optimizer", "muon"]
    text = run(*args, "--out-dir", tmp_path / "straight")
    assert "Muon (the blocks' matrices, lr 0.003) and AdamW (lr 0.003" in text
    # SIGTERM in step 5 (steps count from 0): step 6 is saved.
    sigterm_in_step.stop(5)
    text = run(*args, "--out-dir", tmp_path / "resumed")
    assert "stopped by SIGTERM at step 6" in text
    saved = torch.load(tmp_path / "resumed" / "optim_step_6.pt", weights_only=True)
    muon_state, adamw_state = saved["optimizer"]
    assert "momentum_buffer" in muon_state["state"][0] and "exp_avg" in adamw_state["state"][0]
    sigterm_in_step.resume()
    run(*args, "--out-dir", tmp_path / "resumed")
    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")
    assert_same_weights(weights(tmp_path / "straight", 8), weights(tmp_path / "resumed", 8))
    config = json.loads((tmp_path / "resumed" / "config.json").read_text())
    assert config["optimizer"] == "muon" and config["muon_lr"] == 3e-3


@pytest.mark.smoke
def test_muon_refusals(corpus, tmp_path):
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--optimizer", "muon", "--fsdp", "--out-dir", out,
               expect=2)
    assert "--optimizer muon cannot run with --fsdp" in text and not out.exists()
    for value in ("0", "-1"):
        text = run("--data", corpus, *BASE, "--optimizer", "muon", "--muon-lr", value,
                   "--out-dir", out, expect=2)
        assert f"--muon-lr must be positive, found {float(value)}" in text
    assert not out.exists()


def test_a_run_does_not_switch_optimizers(corpus, tmp_path):
    out = tmp_path / "run"
    run("--data", corpus, *BASE, "--max-steps", 2, "--out-dir", out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}
    text = run("--data", corpus, *BASE, "--max-steps", 4, "--optimizer", "muon",
               "--out-dir", out, expect=2)
    assert "was trained with --optimizer adamw" in text
    assert "resume it with --optimizer adamw" in text
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}
    assert after == before
