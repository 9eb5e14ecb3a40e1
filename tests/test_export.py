"""official.py, the official mamba_ssm format: export writes what MambaLMHeadModel.from_pretrained
builds and loads, read_pretrained brings it (or a run directory) back bit for bit, and bad input is
refused without damage."""
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import safetensors
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import ckpt
import data
import official
from ckpt import CheckpointError
from data import ByteTokenizer
from model import Mamba3LM, ModelConfig

ROOT = Path(__file__).resolve().parent.parent

# two groups and a vocabulary that is not a multiple of 64: the group layout and padding are tested
CONFIG = ModelConfig(vocab_size=257, n_layer=2, d_model=64, headdim=16, d_state=16, ngroups=2,
                     mlp_hidden=128, chunk_size=16)


def make_run(run_dir, config=CONFIG, steps=(3,), tokenizer={"name": "byte"}, seed=0):
    """A run directory with `steps` checkpoints of a random model whose every parameter is perturbed
    (so no norm weight, bias or D is left at its initial ones). Returns the last step's model."""
    torch.manual_seed(seed)
    model = Mamba3LM(config)
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ckpt.save(run_dir, step, model, None, {"tokenizer": tokenizer})
    return model


def official_layout(c):
    """Key -> shape of the state dict that mamba_ssm's MambaLMHeadModel(MambaConfig(**c)) creates,
    written from reading its modules: a MixerModel `backbone` (embedding, layers, norm_f) and a tied
    `lm_head`; the vocabulary rounded up to pad_vocab_size_multiple; each layer a Block with `norm`
    (RMSNorm, weight only), a Mamba3 `mixer` and, when d_intermediate > 0, `norm2` and a GatedMLP
    `mlp` whose hidden size is d_intermediate rounded up to 128 and whose fc1 makes both halves. The
    Mamba3 in_proj makes z and x (d_inner each), B and C (ngroups * d_state each, times the MIMO
    rank, 1 here), dd_dt, dd_A and trap (one per head each) and the rotary angles: d_state *
    rope_fraction, made even, in pairs."""
    ssm = c["ssm_cfg"]
    D, N, G = c["d_model"], ssm["d_state"], ssm["ngroups"]
    d_inner = ssm["expand"] * D
    H = d_inner // ssm["headdim"]
    S = int(N * ssm["rope_fraction"]) // 2 * 2 // 2
    V = math.ceil(c["vocab_size"] / c["pad_vocab_size_multiple"]) * c["pad_vocab_size_multiple"]
    F = math.ceil(c["d_intermediate"] / 128) * 128
    layout = {"backbone.embedding.weight": (V, D), "lm_head.weight": (V, D),
              "backbone.norm_f.weight": (D,)}
    for i in range(c["n_layer"]):
        p = f"backbone.layers.{i}."
        layout.update({p + "norm.weight": (D,),
                       p + "mixer.in_proj.weight": (2 * d_inner + 2 * G * N + 3 * H + S, D),
                       p + "mixer.dt_bias": (H,), p + "mixer.B_bias": (H, 1, N),
                       p + "mixer.C_bias": (H, 1, N), p + "mixer.B_norm.weight": (N,),
                       p + "mixer.C_norm.weight": (N,), p + "mixer.D": (H,),
                       p + "mixer.out_proj.weight": (D, d_inner)})
        if F:
            layout.update({p + "norm2.weight": (D,), p + "mlp.fc1.weight": (2 * F, D),
                           p + "mlp.fc2.weight": (D, F)})
    return layout


def logits_of(config, state, idx):
    model = Mamba3LM(ModelConfig(**config))
    model.load_state_dict(state)
    with torch.no_grad():
        return model(idx)[0]


@pytest.mark.smoke
def test_export_is_what_the_official_model_builds(tmp_path):
    model = make_run(tmp_path / "run")
    out = official.export(tmp_path / "run", tmp_path / "out")

    config = json.loads((out / "config.json").read_text())
    # exactly MambaConfig's fields, and Mamba3's arguments for our layer
    assert config == {
        "d_model": 64, "d_intermediate": 128, "n_layer": 2, "vocab_size": 257,
        "ssm_cfg": {"layer": "Mamba3", "d_state": 16, "expand": 2, "headdim": 16, "ngroups": 2,
                    "rope_fraction": 0.5, "dt_min": 1e-3, "dt_max": 0.1, "dt_init_floor": 1e-4,
                    "A_floor": 1e-4, "chunk_size": 16, "is_outproj_norm": False, "is_mimo": False},
        "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True,
        "pad_vocab_size_multiple": 1, "tie_embeddings": True}

    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == official_layout(config)
    same = load_file(out / "model.safetensors")
    assert state.keys() == same.keys() and all(torch.equal(state[k], same[k]) for k in state)
    # the embedding keeps exactly the vocabulary's rows; the head is the same tensor (tied)
    assert torch.equal(state["backbone.embedding.weight"], model.embed.weight[:257])
    assert state["lm_head.weight"].data_ptr() == state["backbone.embedding.weight"].data_ptr()

    # the official forward of the pieces that change layout, in our words: GatedMLP splits fc1's
    # output into (y, gate) and returns fc2(y * silu(gate)); Mamba3 squeezes the bias's rank axis
    h = torch.randn(3, 64)
    y, gate = (h @ state["backbone.layers.1.mlp.fc1.weight"].T).chunk(2, dim=-1)
    official_mlp = (y * F.silu(gate)) @ state["backbone.layers.1.mlp.fc2.weight"].T
    torch.testing.assert_close(official_mlp, model.blocks[1].mlp(h), rtol=1e-6, atol=1e-6)
    assert torch.equal(state["backbone.layers.0.mixer.C_bias"][:, 0], model.blocks[0].mixer.C_bias)

    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "mamba3_lite.json", "model.safetensors", "pytorch_model.bin",
        "tokenizer.json", "tokenizer_config.json"]
    note = (out / "README.md").read_text()
    assert f"lm_eval --model mamba_ssm --model_args pretrained={out},tokenizer={out}," in note
    assert "MambaLMHeadModel.from_pretrained" in note
    # what loads it, and what cannot
    for words in ("#962", "#968", "2.3.2.post1", "softplus", f"python eval.py {out} --tasks"):
        assert words in note, words


@pytest.mark.smoke
def test_round_trip_is_bit_identical(tmp_path):
    model = make_run(tmp_path / "run")
    official.export(tmp_path / "run", tmp_path / "out")
    idx = torch.randint(0, 257, (2, 40))
    with torch.no_grad():
        expected = model(idx)[0]
    for path in (tmp_path / "run", tmp_path / "out"):
        config, state, spec = official.read_pretrained(path)
        assert config == dataclasses.asdict(model.config) and spec == {"name": "byte"}
        for k, v in model.state_dict().items():
            if path.name == "out" and k in ("embed.weight", "lm_head.weight"):
                # the padding rows no token uses are not exported: they come back as zeros
                assert torch.equal(state[k][:257], v[:257]) and not state[k][257:].any()
            else:
                assert torch.equal(state[k], v), k
        assert torch.equal(logits_of(config, state, idx), expected)


@pytest.mark.smoke
def test_a_foreign_official_checkpoint(tmp_path):
    """Someone's Mamba-3 directory: config.json leaves out fields that have official defaults, the
    vocabulary is padded to a multiple of 8, only pytorch_model.bin, no tokenizer."""
    model = make_run(tmp_path / "run", dataclasses.replace(CONFIG, vocab_size=260))
    out = official.export(tmp_path / "run", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    for key in ("residual_in_fp32", "fused_add_norm", "attn_cfg", "tie_embeddings"):
        del config[key]
    for key in ("chunk_size", "A_floor", "is_mimo", "dt_min"):
        del config["ssm_cfg"][key]
    config["pad_vocab_size_multiple"] = 8
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    embedding = torch.cat([state["backbone.embedding.weight"], torch.randn(4, 64)])  # 264 rows
    state["backbone.embedding.weight"] = state["lm_head.weight"] = embedding
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text(json.dumps(config))
    torch.save(state, theirs / "pytorch_model.bin")

    ours, weights, spec = official.read_pretrained(theirs)
    assert spec is None and ours["reset_token"] is None
    assert ours == {**dataclasses.asdict(model.config), "chunk_size": 64}  # the official default
    assert torch.equal(weights["embed.weight"][:264], embedding) and not weights["embed.weight"][264:].any()
    idx = torch.randint(0, 260, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(logits_of(ours, weights, idx), model(idx)[0], rtol=0, atol=1e-5)


@pytest.mark.smoke
@pytest.mark.parametrize("change, message", [
    (dict(mlp_hidden=96), "mlp_hidden 96: the official GatedMLP rounds its hidden size up to a multiple of 128"),
    (dict(rope_fraction=0.25), "rope_fraction 0.25: the official Mamba3 layer accepts only 0.5 and 1.0"),
    (dict(d_state=12), "d_state 12 with rope_fraction 0.5 gives 3 rotary angles"),
    (dict(norm_eps=1e-6), "norm_eps 1e-06: the official model fixes every RMSNorm epsilon at 1e-05"),
])
def test_options_the_official_format_lacks_are_refused(tmp_path, change, message):
    make_run(tmp_path / "run", dataclasses.replace(CONFIG, **change))
    with pytest.raises(CheckpointError, match="cannot be exported to the official mamba_ssm format") as e:
        official.export(tmp_path / "run", tmp_path / "out")
    assert message in str(e.value) and str(tmp_path / "run") in str(e.value)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["run"]


def test_runs_without_a_good_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        official.export(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        official.export(tmp_path / "empty", tmp_path / "out")

    make_run(tmp_path / "run", steps=(1, 2))
    with open(tmp_path / "run" / "model_step_2.safetensors", "r+b") as f:  # same size, other bytes
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\1\2\3")
    with pytest.warns(UserWarning, match="model_step_2.safetensors is corrupt.*trying an earlier step"):
        out = official.export(tmp_path / "run", tmp_path / "out")
    assert json.loads((out / "mamba3_lite.json").read_text())["step"] == 1
    with pytest.raises(CheckpointError, match="corrupt"):  # an explicit step is not replaced by another
        official.export(tmp_path / "run", tmp_path / "out2", step=2)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7 .* steps there: \[1, 2\]"):
        official.export(tmp_path / "run", tmp_path / "out2", step=7)
    only = tmp_path / "run" / "model_step_1.safetensors"
    only.write_bytes(b"x" * only.stat().st_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match="model_step_1.safetensors is corrupt"):
            official.read_pretrained(tmp_path / "run")
    assert not (tmp_path / "out2").exists()


def entries(d):
    """What a directory holds, less the `.NAME.lock` files data.replace_dir leaves beside OUT."""
    return sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock"))


def test_the_export_target(tmp_path):
    make_run(tmp_path / "run", steps=(1, 2))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"{foreign} exists and is not an earlier export"):
        official.export(tmp_path / "run", foreign)
    assert os.listdir(foreign) == ["notes.txt"] and (foreign / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an earlier export"):
        official.export(tmp_path / "run", tmp_path / "file")
    assert (tmp_path / "file").read_text() == "mine"

    (tmp_path / "empty").mkdir()
    official.export(tmp_path / "run", tmp_path / "empty", step=1)  # an empty directory is fine
    out = official.export(tmp_path / "run", tmp_path / "out", step=1)
    official.export(tmp_path / "run", out)  # an earlier export is replaced
    assert json.loads((out / "mamba3_lite.json").read_text())["step"] == 2
    (out / "eval-results.json").write_text("{}")  # a user's file in an earlier export is kept
    with pytest.warns(UserWarning, match="kept eval-results.json"):
        official.export(tmp_path / "run", out, step=1)
    assert json.loads((out / "mamba3_lite.json").read_text())["step"] == 1
    assert (out / "eval-results.json").read_text() == "{}"
    assert entries(tmp_path) == ["empty", "file", "foreign", "out", "run"]  # no stage or old dirs


def test_a_failed_export_changes_nothing(tmp_path, monkeypatch):
    make_run(tmp_path / "run", steps=(1, 2))
    out = official.export(tmp_path / "run", tmp_path / "out", step=1)
    (out / "eval-results.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device", str(f))

    with monkeypatch.context() as m:
        m.setattr(torch, "save", disk_full)
        with pytest.raises(CheckpointError, match=f"could not write .*pytorch_model.bin \\(No space "
                           f"left on device\\); .* {out} is unchanged"):
            official.export(tmp_path / "run", out)
    # what torch.save and safetensors raise when the disk fills up (seen on a full 4 MB tmpfs)
    for module, name, error in [
            (torch, "save", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 302208")),
            (safetensors.torch, "save_file", safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"))]:
        def disk_full(*args, error=error, **kwargs):
            raise error

        with monkeypatch.context() as m:
            m.setattr(module, name, disk_full)
            with pytest.raises(CheckpointError, match=f"could not write .*; .* {out} is unchanged"):
                official.export(tmp_path / "run", out)
    rename = os.rename

    def fail_the_swap(src, dst):  # the new export's rename into place, once the old one is aside
        if src == tmp_path / ".out.stage" and dst == out:
            raise OSError(5, "Input/output error", str(dst))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", fail_the_swap)
    with pytest.raises(CheckpointError, match=f"Input/output error.* {out} is unchanged"):
        official.export(tmp_path / "run", out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert entries(tmp_path) == ["out", "run"]


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["ssm_cfg"].update(is_mimo=True), r"missing \['backbone.layers.0.mixer.mimo_o', "),
    (lambda c: c["ssm_cfg"].update(is_mimo=True, mimo_rank=0), "mimo_rank 0"),
    (lambda c: c["ssm_cfg"].update(is_mimo=True, mimo_rank="2"), "mimo_rank '2'"),
    (lambda c: c["ssm_cfg"].update(is_outproj_norm=True), "a norm before out_proj"),
    (lambda c: c["ssm_cfg"].update(layer="Mamba2"), "ssm_cfg layer Mamba2, not Mamba3"),
    (lambda c: c["ssm_cfg"].update(rope_fraction=0.25), "rope_fraction 0.25"),
    (lambda c: c["ssm_cfg"].update(conv_size=4), "options this reader does not know: conv_size"),
    (lambda c: c.update(attn_layer_idx=[1]), "attn_cfg without num_heads; attn_cfg causal false"),
    (lambda c: c.update(attn_layer_idx=[1], attn_cfg=dict(num_heads=4, causal=True, d_conv=4)),
     "attn_cfg d_conv 4: a convolution before attention"),
    (lambda c: c.update(attn_layer_idx=[1], attn_cfg=dict(num_heads=4, causal=True, mlp_dim=64)),
     "attn_cfg mlp_dim 64: an MLP inside the attention mixer"),
    (lambda c: c.update(attn_layer_idx=[1], attn_cfg=dict(num_heads=4, causal=True,
                                                         rotary_emb_interleaved=True)),
     "rotary_emb_interleaved true"),
    (lambda c: c.update(attn_layer_idx=[1], attn_cfg=dict(num_heads=4, causal=True, window=8)),
     "attn_cfg options this reader does not know: window"),
    (lambda c: c.update(attn_layer_idx=[1], attn_cfg=dict(num_heads=4, causal=True)),
     r"missing \['backbone.layers.1.mixer.in_proj.bias'"),
    (lambda c: c.update(rms_norm=False), "LayerNorm blocks"),
    (lambda c: c.update(tie_embeddings=False), "a separate LM head"),
    (lambda c: c.pop("d_model"), "missing d_model"),
    (lambda c: c.update(norm_epsilon=1e-6), "unknown fields norm_epsilon"),
    (lambda c: c.update(d_intermediate=256), r"size mismatch for blocks.1.mlp.down.weight"),
])
def test_what_read_pretrained_refuses_in_a_config(tmp_path, edit, message):
    make_run(tmp_path / "run")
    out = official.export(tmp_path / "run", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as e:
        official.read_pretrained(out)
    assert str(out) in str(e.value)


def test_what_read_pretrained_refuses_in_weights(tmp_path):
    make_run(tmp_path / "run")
    out = official.export(tmp_path / "run", tmp_path / "out")
    state = load_file(out / "model.safetensors")
    del state["backbone.layers.1.mixer.D"]
    state["backbone.layers.1.mixer.E"] = torch.ones(8)
    save_file(state, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors does not fit its config.json: missing "
                       r"\['backbone.layers.1.mixer.D'\]; unexpected \['backbone.layers.1.mixer.E'\]"):
        official.read_pretrained(out)
    (out / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="config.json or model.safetensors cannot be read"):
        official.read_pretrained(out)
    (out / "model.safetensors").unlink()
    official.read_pretrained(out)  # pytorch_model.bin alone is the official format
    (out / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=f"{out}: expected a train.py run directory"):
        official.read_pretrained(out)
    with pytest.raises(CheckpointError, match="expected a train.py run directory"):
        official.read_pretrained(tmp_path / "missing")


def test_byte_tokenizer_json_is_the_byte_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(official.byte_tokenizer_json())
    tok.encode_special_tokens = True  # as tokenizer_config.json's split_special_tokens asks of transformers
    ours = ByteTokenizer()
    texts = ["def f(x):\n    return x  # é, 漢字, 🙂\t\r\n", "  two spaces", "\x00\x7f\xff", "a<|endoftext|>b"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == ours.encode(text) and tok.decode(ids) == text
    assert tok.token_to_id("<|endoftext|>") == ours.eos_id and tok.get_vocab_size() == ours.vocab_size


def test_tokenizer_files(tmp_path):
    tokenizer_json = official.byte_tokenizer_json().encode()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tokenizer.json").write_bytes(tokenizer_json)
    spec = {"name": "file", "file": "tokenizer.json", "sha256": hashlib.sha256(tokenizer_json).hexdigest(),
            "eos_token": "<|endoftext|>"}
    make_run(tmp_path / "run", tokenizer=spec)
    out = official.export(tmp_path / "run", tmp_path / "out")
    assert (out / "tokenizer.json").read_bytes() == tokenizer_json
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    assert official.read_pretrained(out)[2] == spec
    (tmp_path / "run" / "tokenizer.json").write_text("{}")
    with pytest.raises(data.DataError, match="tokenizer.json: expected sha256 .* found another file"):
        official.export(tmp_path / "run", tmp_path / "out")

    make_run(tmp_path / "gpt2", tokenizer={"name": "gpt2"})
    out = official.export(tmp_path / "gpt2", tmp_path / "gpt2-out")
    assert not (out / "tokenizer.json").exists()
    assert f"pretrained={out},tokenizer=gpt2," in (out / "README.md").read_text()


def test_reset_token_is_exported_with_a_warning(tmp_path):
    model = make_run(tmp_path / "run", dataclasses.replace(CONFIG, reset_token=256))
    out = official.export(tmp_path / "run", tmp_path / "out")
    assert "the official model does not reset at EOS" in (out / "README.md").read_text()
    assert official.read_pretrained(out)[0] == dataclasses.asdict(model.config)
    result = CliRunner().invoke(official.app, ["export", str(tmp_path / "run"), str(out)])
    assert result.exit_code == 0 and "does not reset at EOS" in result.output


def test_cli(tmp_path):
    runner = CliRunner()
    make_run(tmp_path / "run")
    result = runner.invoke(official.app, ["export", str(tmp_path / "run"), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert f"exported {tmp_path / 'run'} step 3 to {tmp_path / 'out'}" in result.output
    assert "lm_eval --model mamba_ssm --model_args pretrained=" in result.output
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x").write_text("")
    for args, message in ((["export", str(tmp_path / "nowhere"), str(tmp_path / "out2")],
                           "no such directory"),
                          (["export", str(tmp_path / "run"), str(tmp_path / "foreign")],
                           "not an earlier export")):
        result = runner.invoke(official.app, args)
        assert result.exit_code == 2 and "error:" in result.output and message in result.output
        assert "Traceback" not in result.output
    # the README's command, in a process of its own
    proc = subprocess.run([sys.executable, str(ROOT / "official.py"), "export", str(tmp_path / "run"),
                           str(tmp_path / "out"), "--step", "3"], capture_output=True, text=True)
    assert proc.returncode == 0 and "exported" in proc.stdout, proc.stderr


def test_an_empty_path_is_refused_naming_it(tmp_path):
    make_run(tmp_path / "run")
    before = sorted(os.listdir(tmp_path))
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where an empty OUT_DIR ("." to pathlib) would write
    try:
        for args, name in (([str(tmp_path / "run"), ""], "OUT_DIR"), (["", "out"], "RUN_DIR")):
            result = CliRunner().invoke(official.app, ["export", *args])
            assert result.exit_code == 2, result.output
            assert (" ".join(result.stderr.split())
                    == f"error: {name}: expected a path, found an empty string")
    finally:
        os.chdir(cwd)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("name", ["out", "exp[1]"])  # a name that is also a glob pattern is itself
def test_an_export_killed_part_way_is_finished_or_undone_by_the_next(tmp_path, monkeypatch, name):
    make_run(tmp_path / "run", steps=(1, 2))
    out = official.export(tmp_path / "run", tmp_path / name, step=1)
    (out / "eval-results.json").write_text("{}")
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    stage, old = tmp_path / f".{name}.stage", tmp_path / f".{name}.old"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # killed between its two renames: no OUT, the earlier export in .OUT.old, the new one beside it.
    # The next export puts the earlier one back first: here it fails, and leaves that one in place.
    os.rename(out, old)
    shutil.copytree(old, stage)
    with monkeypatch.context() as m:
        m.setattr(torch, "save", disk_full)
        unchanged = f"No space left on device.* {re.escape(str(out))} is unchanged"
        with pytest.raises(CheckpointError, match=unchanged):
            official.export(tmp_path / "run", out, step=2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert entries(tmp_path) == sorted([name, "run"])
    # killed while it wrote its stage: the stage is dropped, the export goes ahead
    stage.mkdir()
    (stage / "pytorch_model.bin").write_bytes(b"half")
    with pytest.warns(UserWarning, match="kept eval-results.json"):
        official.export(tmp_path / "run", out, step=2)
    assert json.loads((out / "mamba3_lite.json").read_text())["step"] == 2
    assert entries(tmp_path) == sorted([name, "run"])
    # killed after the second rename, with the user's file still in the old one: the next export
    # finishes the swap, and the user's file moves into the new one
    shutil.copytree(out, old)
    (out / "eval-results.json").unlink()
    with pytest.warns(UserWarning, match="kept eval-results.json"):
        official.export(tmp_path / "run", out, step=1)
    assert (out / "eval-results.json").read_text() == "{}"
    assert json.loads((out / "mamba3_lite.json").read_text())["step"] == 1
    assert entries(tmp_path) == sorted([name, "run"])


def test_an_export_in_progress_is_left_alone(tmp_path):
    make_run(tmp_path / "run")
    out = official.export(tmp_path / "run", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    stage = tmp_path / ".out.stage"
    stage.mkdir()  # what the running export has written so far
    with open(tmp_path / ".out.lock", "a") as held:  # as a running export holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(data.DataError, match=f"{out} is being written by another process"):
            official.export(tmp_path / "run", out)
        result = CliRunner().invoke(official.app, ["export", str(tmp_path / "run"), str(out)])
        assert result.exit_code == 2 and "being written by another process" in result.output
    assert stage.is_dir() and {p.name: p.read_bytes() for p in out.iterdir()} == before
    official.export(tmp_path / "run", out)  # released: the next export goes ahead
    assert entries(tmp_path) == ["out", "run"]


def test_blocks_the_official_format_cannot_hold_are_refused(tmp_path, monkeypatch):
    class GeluMLP(torch.nn.Module):  # model.py with a plain MLP in place of SwiGLU
        def __init__(self, cfg):
            super().__init__()
            self.up = torch.nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
            self.down = torch.nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)
            self.scale = torch.nn.Parameter(torch.ones(cfg.mlp_hidden))

        def forward(self, h):
            return self.down(F.gelu(self.up(h)) * self.scale)

    monkeypatch.setattr("model.SwiGLU", GeluMLP)
    make_run(tmp_path / "run")
    with pytest.raises(CheckpointError, match="cannot be exported to the official mamba_ssm format") as e:
        official.export(tmp_path / "run", tmp_path / "out")
    assert ("a gated MLP (fc1 = [up; gate], fc2 = down), nothing else: they cannot hold "
            "blocks.N.mlp.scale; they need blocks.N.mlp.gate.weight") in str(e.value)
    assert os.listdir(tmp_path) == ["run"]
