"""The whole path a new user takes, once, at tiny shapes: prepare -> train -> SIGTERM -> resume
(bit-identical to a run that never stopped) -> sample -> export -> train --init-from the export."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import official
import sample
import train

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()

# Two micro-steps of 4 sequences of 32 tokens a step, float32 so that the numbers do not depend
# on whether this CPU has bf16 arithmetic.
TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--total-batch-size", "256",
        "--log-every", "1", "--eval-every", "1000", "--eval-batches", "2", "--warmup-steps", "2",
        "--dtype", "fp32"]


def invoke(app, args, expect=0):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == expect, f"{result.output}\n{result.exception!r}"
    return result.output


@pytest.mark.smoke
def test_prepare_train_stop_resume_sample_export_init_from(tmp_path, sigterm_in_step):
    # A small corpus of Python files, prepared through prepare.py's real command line.
    src = tmp_path / "src"
    src.mkdir()
    for f in sorted(Path(json.__file__).parent.glob("*.py")):
        (src / f.name).write_text(f.read_text())
    corpus = tmp_path / "corpus"
    cmd = [sys.executable, str(ROOT / "prepare.py"), str(src), "--out-dir", str(corpus),
           "--tokenizer", "byte", "--val-fraction", "0.2", "--workers", "1"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    assert (corpus / "manifest.json").exists()

    args = ["--data", corpus, *TINY, "--max-steps", 6, "--save-every", 3]
    invoke(train.app, [*args, "--out-dir", tmp_path / "straight"])

    # The second run gets SIGTERM during step 4 (steps count from 0): it finishes that step,
    # saves step 5 and exits 0; started again, it resumes from step 5.
    sigterm_in_step.stop(4)
    out = tmp_path / "resumed"
    text = invoke(train.app, [*args, "--out-dir", out])
    assert "stopped by SIGTERM at step 5" in text
    sigterm_in_step.resume()
    text = invoke(train.app, [*args, "--out-dir", out])
    assert "resumed from" in text
    straight = load_file(str(tmp_path / "straight" / "model_step_6.safetensors"))
    resumed = load_file(str(out / "model_step_6.safetensors"))
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k

    # Greedy sampling prints the prompt and its continuation.
    text = invoke(sample.app, ["--out-dir", out, "--prompt", "def ", "--max-new-tokens", 20,
                               "--temperature", 0])
    assert text.startswith("def ") and len(text) > len("def ")

    # The export loads back through --init-from with exactly the run's weights.
    invoke(official.app, ["export", out, tmp_path / "export"])
    text = invoke(train.app, ["--data", corpus, *TINY, "--max-steps", 1,
                              "--out-dir", tmp_path / "from-export",
                              "--init-from", tmp_path / "export"])
    assert f"init from  {tmp_path / 'export'}" in text
    # What --init-from reads of the export is the run's last weights. The export keeps only the
    # tokenizer's 257 rows of the embedding; the rows that pad the vocabulary come back as zeros.
    _, state, tokenizer = official.read_pretrained(tmp_path / "export")
    assert tokenizer == {"name": "byte"}
    assert state.keys() == resumed.keys()
    for k, v in state.items():
        want = resumed[k]
        if "embed" in k or "lm_head" in k:
            v = v[:257]
            want = want[:257]
        assert torch.equal(v, want), k
