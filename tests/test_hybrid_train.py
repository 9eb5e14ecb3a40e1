"""train.py with attention layers (--attn-layers): the flags, their refusals, exact resume after
a kill, --init-from keeping the source's layout, and FSDP against DDP on two gloo ranks."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt
import official
from test_train import (BASE, ROOT, assert_same_weights, corpus, losses, records,  # noqa: F401
                        run, weights)

HYBRID = ["--attn-layers", "1", "--attn-kv-heads", "2", "--attn-rotary-dim", "8"]


@pytest.mark.parametrize("flags, message", [
    (["--attn-layers", "2"], "[2]: 2 is not a layer of this model; its 2 layers are 0 to 1"),
    (["--attn-layers", "1,1"], "names a layer twice"),
    (["--attn-layers", "one"], "expected layer indices from 0"),
    (["--attn-layers", "1", "--attn-heads", "3"], "do not divide d_model 64"),
    (["--attn-layers", "1", "--attn-kv-heads", "3"], "3 does not divide the 4 attention heads"),
    (["--attn-layers", "1", "--attn-rotary-dim", "7"], "must be even"),
    (["--attn-layers", "1", "--attn-rotary-dim", "32"], "from 0 to the head dim 16"),
])
def test_impossible_hybrids_are_refused_before_anything_is_written(corpus, tmp_path, flags,
                                                                   message):
    out = tmp_path / "run"
    text = run("--data", corpus, *BASE, "--out-dir", out, *flags, expect=2)
    assert message in " ".join(text.split()) and "Traceback" not in text
    assert not out.exists()


def test_a_hybrid_resumes_bit_identically_after_kill_9(corpus, tmp_path):
    args = ["--data", corpus, *BASE, *HYBRID, "--reset-at-eos", "--max-steps", 20,
            "--save-every", 8]
    text = run(*args, "--out-dir", tmp_path / "straight")
    assert "attention in layers [1] (4 heads, 2 KV heads of 16)" in text
    meta = ckpt.read_meta(tmp_path / "straight", 20)
    assert meta["model_config"]["attn_layers"] == [1]
    # killed with SIGKILL in step 11, three steps after the checkpoint of step 8
    child = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import train
        forward, calls = train.micro_step, []
        def die_in_step_11(model, x, y, autocast):
            calls.append(1)
            if len(calls) == 2 * 10 + 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return forward(model, x, y, autocast)
        train.micro_step = die_in_step_11
        sys.argv = ["train.py"] + {[str(a) for a in args + ["--out-dir", tmp_path / "killed"]]!r}
        train.app()
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    text = run(*args, "--out-dir", tmp_path / "killed")
    assert "resumed from" in text
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    assert [r["step"] for r in records(tmp_path / "killed")] == list(range(1, 21))
    assert_same_weights(weights(tmp_path / "straight", 20), weights(tmp_path / "killed", 20))


def test_init_from_keeps_the_source_layout(corpus, tmp_path):
    src = tmp_path / "src"
    run("--data", corpus, *BASE, *HYBRID, "--max-steps", 2, "--out-dir", src)
    official.export(src, tmp_path / "export")
    for path in (src, tmp_path / "export"):
        out = tmp_path / f"from-{path.name}"
        text = run("--data", corpus, *BASE, "--max-steps", 1, "--init-from", path,
                   "--out-dir", out)
        assert "attention in layers [1] (4 heads, 2 KV heads of 16)" in text
        config = ckpt.read_meta(out, 1)["model_config"]
        assert config["attn_layers"] == [1] and config["attn_rotary_dim"] == 8
    text = run("--data", corpus, *BASE, "--max-steps", 1, "--init-from", src,
               "--attn-layers", "0", "--out-dir", tmp_path / "other", expect=2)
    assert "has attention in layers [1] with its own shape: --attn-layers may not" in text
    assert not (tmp_path / "other").exists()


def test_fsdp_trains_a_hybrid_as_ddp_does(corpus, tmp_path):
    from test_fsdp import assert_close, launch

    # one thread per process, as test_fsdp.py runs its ranks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        header = launch(corpus, tmp_path / "fsdp", "--fsdp", *HYBRID)
        launch(corpus, tmp_path / "ddp", *HYBRID)
    finally:
        torch.set_num_threads(threads)
    assert "world size 2, FSDP" in header and "attention in layers [1]" in header
    fsdp = tmp_path / "fsdp"
    ddp = tmp_path / "ddp"
    assert sorted(losses(fsdp)) == list(range(1, 21))
    assert_close(losses(fsdp), losses(ddp))
    assert_close(weights(fsdp, 20), weights(ddp, 20))
    # the attention block is sharded and saved whole, as the others
    assert weights(fsdp, 20)["blocks.1.mixer.in_proj.weight"].shape == (4 * 16 + 2 * 2 * 16, 64)
