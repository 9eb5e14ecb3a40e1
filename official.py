"""The official mamba_ssm format, both ways: `python ckpt.py export RUN_DIR OUT_DIR [--step N]` writes a
checkpoint as state-spaces/mamba's MambaLMHeadModel.from_pretrained loads it (and lm-evaluation-harness runs it:
`lm_eval --model mamba_ssm`), and read_pretrained() brings such a directory, or a run directory, back for
`train.py --init-from`.

The official Mamba3 layer with MIMO and the output norm off is our mixer (the same in_proj layout and math),
its blocks are ours (pre-norm RMSNorm, mixer, RMSNorm, gated MLP) and its head is tied. What differs is names
and the packing of a few tensors:

    ours                              official                                       change
    embed.weight (V64, D)             backbone.embedding.weight, lm_head.weight      first vocab_size rows, tied
    blocks.i.norm1 / norm2            backbone.layers.i.norm / norm2
    blocks.i.mixer.*                  backbone.layers.i.mixer.*                      B_norm_weight -> B_norm.weight
    blocks.i.mixer.B_bias, C_bias     (H, 1, N)                                      a MIMO rank axis, 1 here
    blocks.i.mlp.up, gate (F, D)      backbone.layers.i.mlp.fc1 (2F, D) = [up; gate] its forward splits fc1 in two
    blocks.i.mlp.down                 backbone.layers.i.mlp.fc2
    norm_f                            backbone.norm_f

Options the official modules cannot rebuild exactly are refused: an MLP hidden size that is not a multiple of
128 (GatedMLP rounds it up), rope_fraction other than 0.5 or 1.0, an odd or zero number of rotary angles, a
norm epsilon other than 1e-5. A model with reset_token is exported with a warning: the official model does
not reset its state at EOS. The vocabulary is written unpadded (pad_vocab_size_multiple 1): the official
model returns a logit for every row, and our never-trained padding rows would take probability from the
real tokens in anything that takes a softmax over all of them (the harness, sampling).
"""
import dataclasses
import glob
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

import safetensors.torch
import torch
import typer
from rich.console import Console
from rich.markup import escape

import ckpt
from ckpt import CheckpointError
from model import Mamba3LM, ModelConfig

MARKER = "mamba3_lite.json"  # marks an export (so the next one may replace it); keeps our config and tokenizer
FILES = {"config.json", "pytorch_model.bin", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "README.md", MARKER}
MLP_MULTIPLE, NORM_EPS = 128, 1e-5  # GatedMLP rounds its hidden size up to the first; every RMSNorm uses the second
# MambaConfig's fields and Mamba3's arguments with the official defaults, for config.json files that leave some out
CONFIG_DEFAULTS = dict(d_intermediate=0, attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True,
                       fused_add_norm=True, pad_vocab_size_multiple=8, tie_embeddings=True)
MAMBA3_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=1e-3, dt_max=1e-1,
                       dt_init_floor=1e-4, A_floor=1e-4, chunk_size=64, is_outproj_norm=False, is_mimo=False)
MAMBA3_INERT = {"layer", "mimo_rank", "fuse_pregate_headwise_norm", "dropout"}  # no effect on a SISO layer
MIXER_NAMES = [("in_proj.weight", "in_proj.weight"), ("dt_bias", "dt_bias"), ("B_bias", "B_bias"),
               ("C_bias", "C_bias"), ("B_norm_weight", "B_norm.weight"), ("C_norm_weight", "C_norm.weight"),
               ("D", "D"), ("out_proj.weight", "out_proj.weight")]


def official_config(cfg) -> dict:
    """Our ModelConfig -> the MambaConfig (config.json) with which the official modules rebuild our model
    exactly; a CheckpointError lists every option the format cannot express."""
    problems = []
    if cfg.rope_fraction not in (0.5, 1.0):
        problems.append(f"rope_fraction {cfg.rope_fraction}: the official Mamba3 layer accepts only 0.5 and 1.0")
    elif cfg.n_angles == 0 or cfg.n_angles % 2:
        problems.append(f"d_state {cfg.d_state} with rope_fraction {cfg.rope_fraction} gives {cfg.n_angles} rotary "
                        f"angles: the official layer needs at least one and its kernel an even number")
    if cfg.mlp_hidden % MLP_MULTIPLE:
        problems.append(f"mlp_hidden {cfg.mlp_hidden}: the official GatedMLP rounds its hidden size up to a multiple "
                        f"of {MLP_MULTIPLE}, which would be another model; train with a multiple of {MLP_MULTIPLE}")
    if cfg.norm_eps != NORM_EPS:
        problems.append(f"norm_eps {cfg.norm_eps}: the official model fixes every RMSNorm epsilon at {NORM_EPS}")
    if problems:
        raise CheckpointError("; ".join(problems))
    ssm_cfg = dict(layer="Mamba3", **{k: getattr(cfg, k) for k in MAMBA3_DEFAULTS if hasattr(cfg, k)},
                   is_outproj_norm=False, is_mimo=False)
    # residual_in_fp32 is what our bf16 training does; fused_add_norm is the same math in one official kernel
    return dict(d_model=cfg.d_model, d_intermediate=cfg.mlp_hidden, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size,
                ssm_cfg=ssm_cfg, attn_layer_idx=[], attn_cfg={}, rms_norm=True, residual_in_fp32=True,
                fused_add_norm=True, pad_vocab_size_multiple=1, tie_embeddings=True)


def config_from_official(config: dict, where) -> dict:
    """A MambaConfig (config.json) -> our ModelConfig fields; a CheckpointError naming `where` for a missing or
    unknown field and for what our model cannot be (other layers, MIMO, the output norm, attention, LayerNorm,
    an untied head)."""
    core = {"d_model", "n_layer", "vocab_size", "ssm_cfg"}
    missing, unknown = sorted(core - config.keys()), sorted(config.keys() - CONFIG_DEFAULTS.keys() - core)
    c = {**CONFIG_DEFAULTS, **config}
    ssm = {**MAMBA3_DEFAULTS, **(c.get("ssm_cfg") or {})}
    extra = sorted(ssm.keys() - MAMBA3_DEFAULTS.keys() - MAMBA3_INERT)
    problems = [what for what, bad in ((f"missing {', '.join(missing)}", missing),
                                        (f"unknown fields {', '.join(unknown)}", unknown),
                                        (f"ssm_cfg layer {ssm.get('layer', 'Mamba1')}, not Mamba3", ssm.get("layer") != "Mamba3"),
                                        (f"ssm_cfg options this reader does not know: {', '.join(extra)}", extra),
                                        ("MIMO layers (is_mimo)", ssm["is_mimo"]),
                                        ("a norm before out_proj (is_outproj_norm)", ssm["is_outproj_norm"]),
                                        (f"attention layers {c['attn_layer_idx']}", c["attn_layer_idx"]),
                                        ("LayerNorm blocks (rms_norm false)", not c["rms_norm"]),
                                        ("a separate LM head (tie_embeddings false)", not c["tie_embeddings"]),
                                        (f"expand {ssm['expand']}", ssm["expand"] != int(ssm["expand"])),
                                        (f"rope_fraction {ssm['rope_fraction']}", ssm["rope_fraction"] not in (0.5, 1.0)))
                 if bad]
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems) + ". mamba3-lite reads Mamba-3 SISO models with "
                              "RMSNorm, gated MLPs and a tied LM head")
    return dict(vocab_size=c["vocab_size"], n_layer=c["n_layer"], d_model=c["d_model"], expand=int(ssm["expand"]),
                mlp_hidden=-(-c["d_intermediate"] // MLP_MULTIPLE) * MLP_MULTIPLE, norm_eps=NORM_EPS, reset_token=None,
                **{k: ssm[k] for k in ("headdim", "d_state", "ngroups", "rope_fraction", "chunk_size", "A_floor",
                                       "dt_min", "dt_max", "dt_init_floor")})


def _name_pairs(cfg):
    """(our key, official key) of every tensor that keeps its values (fc1 and lm_head are special)."""
    pairs = [("embed.weight", "backbone.embedding.weight"), ("norm_f.weight", "backbone.norm_f.weight")]
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"backbone.layers.{i}."
        pairs += [(ours + "norm1.weight", theirs + "norm.weight")]
        pairs += [(ours + "mixer." + a, theirs + "mixer." + b) for a, b in MIXER_NAMES]
        if cfg.mlp_hidden:
            pairs += [(ours + "norm2.weight", theirs + "norm2.weight"), (ours + "mlp.down.weight", theirs + "mlp.fc2.weight")]
    return pairs


def official_state_dict(state, cfg) -> dict:
    """Our state dict -> the official one: the embedding without its padding rows and tied to lm_head."""
    out = {theirs: state[ours][:, None] if ours.endswith("_bias") and state[ours].dim() == 2 else state[ours].clone()
           for ours, theirs in _name_pairs(cfg)}  # B/C biases (H, N) -> (H, 1, N)
    out["lm_head.weight"] = out["backbone.embedding.weight"] = state["embed.weight"][: cfg.vocab_size].clone()
    for i in range(cfg.n_layer if cfg.mlp_hidden else 0):
        out[f"backbone.layers.{i}.mlp.fc1.weight"] = torch.cat([state[f"blocks.{i}.mlp.up.weight"],
                                                                state[f"blocks.{i}.mlp.gate.weight"]])
    return out


def state_dict_from_official(state, cfg, where) -> dict:
    """An official state dict -> ours for ModelConfig `cfg`, checked against our model (keys and shapes, with a
    CheckpointError naming `where`). Padding rows beyond the vocabulary are zeros: no token uses them."""
    expected = {k for _, k in _name_pairs(cfg)} | {"backbone.embedding.weight", "lm_head.weight"} | {
        f"backbone.layers.{i}.mlp.fc1.weight" for i in range(cfg.n_layer if cfg.mlp_hidden else 0)}
    missing, unexpected = sorted(expected - state.keys() - {"lm_head.weight"}), sorted(state.keys() - expected)
    if missing or unexpected:
        raise CheckpointError(f"{where} does not fit its config.json: missing {missing or 'none'}; unexpected "
                              f"{unexpected or 'none'}")
    emb = state["backbone.embedding.weight"]
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], emb):
        raise CheckpointError(f"{where}: lm_head.weight is not backbone.embedding.weight, though tie_embeddings says so")
    out = {ours: state[theirs][:, 0] if ours.endswith("_bias") and state[theirs].dim() == 3 else state[theirs]
           for ours, theirs in _name_pairs(cfg)}
    for i in range(cfg.n_layer if cfg.mlp_hidden else 0):
        out[f"blocks.{i}.mlp.up.weight"], out[f"blocks.{i}.mlp.gate.weight"] = \
            state[f"backbone.layers.{i}.mlp.fc1.weight"].chunk(2)
    out["embed.weight"] = emb.new_zeros(cfg.padded_vocab, emb.shape[1])
    out["embed.weight"][: min(len(emb), cfg.padded_vocab)] = emb[: cfg.padded_vocab]
    out["lm_head.weight"] = out["embed.weight"]
    with torch.device("meta"):  # shapes checked by our own model, without allocating it
        try:
            Mamba3LM(cfg).load_state_dict(out, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{where} does not fit its config.json: {str(e).splitlines()[-1].strip()}") from None
    return out


def byte_tokenizer_json() -> str:
    """A Hugging Face tokenizer.json with prepare.py's byte tokenizer's ids: 0..255 the bytes of the UTF-8
    text, 256 <|endoftext|> (a byte-level BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 move to U+0100 on
    printable, moved = {*range(33, 127), *range(161, 173), *range(174, 256)}, iter(range(256, 256 + 68))
    chars = [chr(b) if b in printable else chr(next(moved)) for b in range(256)]
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str()


def _tokenizer_files(spec, run_dir):
    """{name: bytes} so that AutoTokenizer loads the export as the run's tokenizer; none for GPT-2 (the Hub's
    "gpt2" has tiktoken's ids) or an unknown tokenizer."""
    name = (spec or {}).get("name")
    if name == "byte":
        data, eos = byte_tokenizer_json().encode(), "<|endoftext|>"
    elif name == "file":
        path = Path(run_dir) / spec["file"]
        data, eos = (path.read_bytes() if path.is_file() else b""), spec.get("eos_token")
        if not data or (spec.get("sha256") and hashlib.sha256(data).hexdigest() != spec["sha256"]):
            raise CheckpointError(f"{path}: missing, or not the tokenizer the run was trained with (its sha256 differs "
                                  f"from the spec); copy it from the data directory")
    else:
        return {}
    # split_special_tokens: text that spells the EOS token stays text, as prepare.py encodes it
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "split_special_tokens": True,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": data, "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def usage(out, marker):
    """(how to load it, the harness command, warnings) for the export in `out`."""
    name, cfg = (marker["tokenizer"] or {}).get("name"), marker["model_config"]
    tokenizer = {"gpt2": "gpt2", "byte": str(out), "file": str(out)}.get(name, "TOKENIZER")
    load = f'MambaLMHeadModel.from_pretrained("{out}", device="cuda")  # mamba_ssm.models.mixer_seq_simple, CUDA only'
    command = (f"lm_eval --model mamba_ssm --model_args pretrained={out},tokenizer={tokenizer},dtype=float32 "
               f"--tasks lambada_openai,hellaswag,piqa,arc_easy --device cuda --batch_size 16")
    notes = []
    if tokenizer == "TOKENIZER":
        notes.append("the run recorded no tokenizer: replace TOKENIZER by the Hugging Face tokenizer that made its ids")
    if cfg.get("reset_token") is not None:
        notes.append(f"this model resets its state after token {cfg['reset_token']} (reset_token), but the official "
                     f"model does not reset at EOS: give it one document per sequence")
    return load, command, notes


def export(run_dir, out_dir, step=None) -> Path:
    """Write checkpoint `step` of a train.py run directory (default: its newest step that verifies) into
    `out_dir` in the official format; returns out_dir. Refused with a CheckpointError naming the path before
    anything is written: no complete checkpoint, a step that does not verify, an option the format cannot
    express, a missing tokenizer file, an out_dir that is neither new, empty, nor an earlier export. An
    earlier export is replaced whole (built beside it, then swapped in); files a user added to it are kept, and
    what a killed export left is recovered first."""
    from sample import load_model  # a model from a run directory, as sample.py builds it

    run_dir, out = Path(run_dir), Path(out_dir)
    _recover(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir()) and not (out / MARKER).is_file()):
        raise CheckpointError(f"{out} exists and is not an earlier export (it has no {MARKER}); choose another "
                              f"OUT_DIR, or empty it yourself")
    model, meta, step = load_model(run_dir, step)
    try:
        config = official_config(model.config)
    except CheckpointError as e:
        raise CheckpointError(f"{run_dir} step {step} cannot be exported to the official mamba_ssm format: {e}") from None
    spec = meta.get("tokenizer")
    files = _tokenizer_files(spec, run_dir)
    marker = {"format": "mamba3-lite official-format export", "version": 1, "source": str(run_dir), "step": step,
              "model_config": dataclasses.asdict(model.config),
              "tokenizer": {**spec, "file": "tokenizer.json"} if (spec or {}).get("name") == "file" else spec}
    state = official_state_dict(model.state_dict(), model.config)
    load, command, notes = usage(out, marker)
    files |= {"config.json": json.dumps(config, indent=2).encode(), MARKER: json.dumps(marker, indent=2).encode(),
              "README.md": (f"# A Mamba-3 language model in the official mamba_ssm format\n\nExported by mamba3-lite "
                            f"from `{run_dir}` step {step}. Load it:\n\n    {load}\n\nEvaluate it with "
                            f"lm-evaluation-harness (`pip install lm-eval mamba-ssm`):\n\n    {command}\n\n"
                            + "".join(f"Note: {n}.\n" for n in notes)).encode()}
    staging, old = out.parent / f".{out.name}.export-{os.getpid()}", out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        torch.save(state, staging / "pytorch_model.bin")
        safetensors.torch.save_file({k: v.clone() for k, v in state.items()}, staging / "model.safetensors",
                                    metadata={"format": "pt"})  # (clones: safetensors refuses tied tensors)
        for name, data in files.items():
            (staging / name).write_bytes(data)
        if out.exists():  # the swap: the earlier export goes only once the new one is in place
            os.rename(out, old)
            os.rename(staging, out)
            _retire(old, out)
        else:
            os.rename(staging, out)
    except BaseException as e:
        if old.exists() and not out.exists():
            os.rename(old, out)
        shutil.rmtree(staging, ignore_errors=True)
        # disk full, permissions (torch.save and safetensors report a full disk with errors of their own)
        if isinstance(e, (OSError, RuntimeError, safetensors.SafetensorError)):
            raise CheckpointError(f"could not write {getattr(e, 'filename', None) or staging} "
                                  f"({getattr(e, 'strerror', None) or e}); free disk space or fix the permissions, "
                                  f"then run again: {out} is unchanged") from None
        raise
    return out


def _recover(out):
    """What an export killed during its swap left beside `out`: the earlier export in .OUT.old-PID goes back in
    place if OUT is missing (killed between the two renames), else the swap is finished (a user's files move
    into OUT); the new export's .OUT.export-PID, complete or not, is dropped."""
    name = glob.escape(out.name)  # OUT_DIR's name may hold [ or *: matched as itself
    for stale in sorted(out.parent.glob(f".{name}.old-*")) + sorted(out.parent.glob(f".{name}.export-*")):
        if not (pid := stale.name.rsplit("-", 1)[1]).isdigit():
            continue  # not an export's
        try:
            if int(pid) != os.getpid():  # ours: a killed export's PID come round again (a container's PID 1)
                os.kill(int(pid), 0)
                continue  # that export is still running
        except PermissionError:
            continue  # another user's live process has that PID (an export of theirs, in a shared directory?)
        except ProcessLookupError:
            pass
        if ".old-" not in stale.name:
            shutil.rmtree(stale)
        elif not out.exists():
            os.rename(stale, out)
        else:
            _retire(stale, out)


def _retire(old, out):
    # the replaced export goes, but a user's own files in it (evaluation results, say) move into the new one
    for p in old.iterdir():
        if p.name not in FILES and not (out / p.name).exists():
            os.rename(p, out / p.name)
    shutil.rmtree(old)


def read_pretrained(path):
    """Weights to start from: (ModelConfig fields, state dict in our names, tokenizer spec or None). `path` is a
    train.py run directory (its newest step that verifies) or a directory in the official format (an export,
    or anyone's Mamba-3 SISO checkpoint: config.json with model.safetensors or pytorch_model.bin)."""
    from sample import load_model

    p = Path(path)
    if p.is_dir() and ckpt.step_files(p):
        model, meta, _ = load_model(p)
        return dataclasses.asdict(model.config), model.state_dict(), meta.get("tokenizer")
    weights = [p / name for name in ("model.safetensors", "pytorch_model.bin") if (p / name).is_file()]
    if not weights or not (p / "config.json").is_file():
        raise CheckpointError(f"{p}: expected a train.py run directory (checkpoints) or a directory in the official "
                              f"mamba_ssm format (config.json with pytorch_model.bin or model.safetensors)")
    try:
        mamba_config = json.loads((p / "config.json").read_text())
        state = (safetensors.torch.load_file(weights[0]) if weights[0].suffix == ".safetensors"
                 else torch.load(weights[0], map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001 - JSON, safetensors and pickle each have their own errors
        raise CheckpointError(f"{p}: config.json or {weights[0].name} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(mamba_config, dict) or not isinstance(state, dict):
        raise CheckpointError(f"{p}: expected config.json to hold MambaConfig fields and {weights[0].name} a state dict")
    config = config_from_official(mamba_config, p / "config.json")
    marker = json.loads((p / MARKER).read_text()) if (p / MARKER).is_file() else None
    if marker:  # our own export: what config.json cannot say
        config["reset_token"] = marker["model_config"].get("reset_token")
    state = state_dict_from_official(state, ModelConfig(**config), weights[0])
    return config, state, marker["tokenizer"] if marker else None


# -----------------------------------------------------------------------------
# command line: python ckpt.py export RUN_DIR OUT_DIR [--step N]

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


@app.callback()
def commands():
    """Checkpoint tools (the library itself is ckpt.py: save, load, list_steps, ...)."""


@app.command("export")
def export_main(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A train.py --out-dir (checkpoint directory)."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Where to write; an earlier export is replaced."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step (default: the newest that verifies)."),
):
    """Export a checkpoint to the official mamba_ssm format (config.json + pytorch_model.bin), which
    MambaLMHeadModel.from_pretrained and lm-evaluation-harness (--model mamba_ssm) load."""
    errors = Console(stderr=True, highlight=False)
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        out = export(run_dir, out_dir, step)
    except CheckpointError as e:
        errors.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2)
    marker = json.loads((out / MARKER).read_text())
    load, command, notes = usage(out, marker)
    console = Console(highlight=False)
    console.print(f"exported {run_dir} step {marker['step']} to {out}: {', '.join(sorted(os.listdir(out)))}",
                  markup=False, soft_wrap=True)
    console.print(f"  load      {load}\n  evaluate  {command}", markup=False, soft_wrap=True)
    for n in notes:
        errors.print(f"[bold yellow]warning:[/bold yellow] {escape(n)}", soft_wrap=True)
