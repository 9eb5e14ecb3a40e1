"""plot.py: metrics.jsonl of one or more runs -> one image; redone steps; bad input."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import plot

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, records, total_batch_size=1000):
    run_dir.mkdir(parents=True)
    config = {"total_batch_size": total_batch_size, "seq_len": 100}
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def train(step, loss, **kw):
    lr = 1e-3 * min(1, step / 20)
    return dict(kind="train", step=step, loss=loss, lr=lr, tok_per_s=5000 + step, **kw)


def two_runs(tmp_path):
    """Run "resumed" crashed after step 60 and was resumed from its step-40 checkpoint: steps 50
    and 60 are logged twice, the second time with other values; run "plain" has no validation and
    logs its own tokens."""
    first = [train(s, 5 - s / 50) for s in range(10, 70, 10)]
    first += [dict(kind="eval", step=50, val_loss=4.2)]
    redone = [dict(kind="event", event="checkpoint", step=40), dict(kind=["?"]), train(50, 3.5),
              dict(kind="eval", step=50, val_loss=3.9),
              train(60, None), train(70, 3.3), dict(kind="eval", step=70, val_loss=3.6)]
    write_run(tmp_path / "resumed", first + redone)
    plain = [train(s, 4 - s / 100, tokens=s * 512) for s in range(5, 100, 5)]
    write_run(tmp_path / "plain", plain, 9999)
    return tmp_path / "resumed", tmp_path / "plain"


def test_records_per_step_the_last_one_with_tokens_seen(tmp_path):
    resumed, plain = two_runs(tmp_path)
    m = plot.read_metrics(resumed)
    assert [r["step"] for r in m["train"]] == [10, 20, 30, 40, 50, 60, 70]
    assert [r["loss"] for r in m["train"][4:]] == [3.5, None, 3.3]  # the redone steps' records win
    evals = [(r["step"], r["val_loss"], r["tokens"]) for r in m["eval"]]
    assert evals == [(50, 3.9, 50_000), (70, 3.6, 70_000)]
    assert [r["tokens"] for r in m["train"]] == [s * 1000 for s in range(10, 80, 10)]
    tokens, loss = plot.series(m["train"], "loss")
    assert tokens[5] == 60_000 and math.isnan(loss[5])  # a window of skipped steps is a gap
    m = plot.read_metrics(plain)
    assert m["eval"] == []
    assert [r["tokens"] for r in m["train"]] == [s * 512 for s in range(5, 100, 5)]


def test_cli_overlays_runs_into_one_png(tmp_path):
    resumed, plain = two_runs(tmp_path)
    out = tmp_path / "runs.png"
    # As a user runs it: a fresh process without a display.
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"}
    cmd = [sys.executable, str(ROOT / "plot.py"), str(resumed), str(plain), "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    png = out.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 30_000
    # the IHDR chunk's width and height
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 600 and height > 600
    r = CliRunner().invoke(plot.app, [str(resumed), "--out", str(tmp_path / "one.svg")])
    assert r.exit_code == 0 and (tmp_path / "one.svg").read_text().lstrip().startswith("<?xml")


def test_an_empty_path_is_refused_naming_it(tmp_path, monkeypatch):
    resumed, _ = two_runs(tmp_path)
    monkeypatch.chdir(tmp_path)  # where an empty path ("." to pathlib) would point
    before = sorted(os.listdir(tmp_path))
    for args, name in (([str(resumed), "--out", ""], "--out"),
                       (["", "--out", "x.png"], "RUN_DIR"),
                       ([str(resumed), "", "--out", "x.png"], "RUN_DIR")):
        r = CliRunner().invoke(plot.app, args)
        assert r.exit_code == 2, (args, r.output)
        assert (" ".join(r.stderr.split()) == f"error: {name}: expected a path, found an empty "
                "string")
    assert sorted(os.listdir(tmp_path)) == before
    # As a user runs it: refused before matplotlib is imported.
    code = ("import sys, runpy; sys.argv = ['plot.py', 'x', '--out', '']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 2, e.code\n"
            "assert 'matplotlib' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.smoke
def test_bad_input_is_one_paragraph_and_exit_2(tmp_path):
    resumed, _ = two_runs(tmp_path)
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken"
    write_run(broken, [train(10, 4.0)])
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 20, "loss": 3.\n')  # a line cut short
    write_run(tmp_path / "list", [train(10, 4.0), [1, 2]])
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "metrics.jsonl").write_text(json.dumps(train(10, 4.0)) + "\n")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "metrics.jsonl").write_bytes(b"\xff\xfe\x00not text\n")  # not UTF-8
    out, t = str(tmp_path / "x.png"), tmp_path
    cases = [
        ([str(resumed), str(t / "empty")], out, f"{t / 'empty'}: expected a train.py run directory"),
        ([str(broken)], out, f"{broken / 'metrics.jsonl'}:2: expected one JSON object per line"),
        ([str(t / "list")], out, f"{t / 'list' / 'metrics.jsonl'}:2: expected a JSON object"),
        ([str(t / "binary")], out, f"{t / 'binary' / 'metrics.jsonl'}:1: expected one JSON object"),
        ([str(t / "no-config")], out, f"{t / 'no-config' / 'config.json'}: expected train.py's config"),
        ([str(resumed)], str(t / "missing" / "x.png"),
         f"--out {t / 'missing' / 'x.png'}: could not write it (No such file or directory)"),
        ([str(resumed)], str(t / "x.txt"), f"--out {t / 'x.txt'}: expected an image suffix"),
    ]
    for run_dirs, target, message in cases:
        r = CliRunner().invoke(plot.app, [*run_dirs, "--out", target])
        assert r.exit_code == 2, (message, r.output)
        assert " ".join(r.stderr.split()).startswith("error: " + message), r.stderr
        assert r.exception is None or isinstance(r.exception, SystemExit)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary", "broken", "empty", "list",
                                                          "no-config", "plain", "resumed"]
