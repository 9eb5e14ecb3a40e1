"""The official mamba_ssm format, both ways, and models from run directories.

    python official.py export RUN_DIR OUT_DIR [--step N]   # for from_pretrained and `lm_eval`

read_pretrained() brings such a directory, or a run directory, back for `train.py --init-from`;
load_model() rebuilds the model of a run directory's checkpoint (sample.py, export, --init-from).

The official Mamba3 layer with the output norm off is our mixer (the same in_proj layout and math;
MIMO with is_mimo and mimo_rank R), its blocks are ours and its head is tied. What differs:

    ours                    official                               change
    embed.weight (V64, D)   backbone.embedding.weight, lm_head.weight  vocab_size rows, tied
    blocks.i.norm1, norm2   backbone.layers.i.norm, norm2
    blocks.i.mixer.*        backbone.layers.i.mixer.*              B_norm_weight -> B_norm.weight
    mixer.B_bias, C_bias    (H, 1, N) for SISO                     a MIMO rank axis, 1 here
    mixer.mimo_x, _z, _o    the same, (H, R, P)                    MIMO only
    blocks.i.mlp.up, gate   backbone.layers.i.mlp.fc1 (2F, D)      [up; gate], as GatedMLP splits
    blocks.i.mlp.down       backbone.layers.i.mlp.fc2
    norm_f                  backbone.norm_f

For MIMO, our chunk_size counts rows and the official one tokens (theirs is ours / R), and the
official kernel rotates state dim n with n + N/2 where we rotate (2n, 2n + 1): a fixed permutation
of the state dims. An official MIMO layer of rank 1 comes in as SISO, its mimo_x, mimo_z and mimo_o
folded into in_proj and out_proj. What the official modules cannot rebuild is refused.
"""
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Optional

import safetensors.torch
import torch
import torch.nn.functional as F
import typer

import ckpt
import data
from ckpt import CheckpointError
from model import Mamba3LM, ModelConfig

MARKER = "mamba3_lite.json"  # marks an export (the next may replace it); our config and tokenizer
FILES = {"config.json", "pytorch_model.bin", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "README.md", MARKER}  # an export's own: the rest is the user's
NOT_OFFICIAL = "cannot be exported to the official mamba_ssm format"  # (what export refuses)
MLP_MULTIPLE, NORM_EPS = 128, 1e-5  # GatedMLP rounds its hidden size up to the first; RMSNorm's eps
# MambaConfig's fields and Mamba3's arguments with their defaults, for config.json files without
CONFIG_DEFAULTS = dict(d_intermediate=0, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                       residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
                       tie_embeddings=True)
MAMBA3_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, dt_min=1e-3,
                       dt_max=1e-1, dt_init_floor=1e-4, A_floor=1e-4, chunk_size=64,
                       is_outproj_norm=False, is_mimo=False)
SHARED = [k for k in MAMBA3_DEFAULTS if hasattr(ModelConfig, k)]  # ModelConfig's names for them too
# no effect here (mimo_rank without is_mimo, fuse_pregate_headwise_norm without the output norm)
MAMBA3_INERT = {"layer", "mimo_rank", "fuse_pregate_headwise_norm", "dropout"}
MIXER_NAMES = ("in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm_weight", "C_norm_weight",
               "D", "out_proj.weight")
MIMO_NAMES = ("mimo_x", "mimo_z", "mimo_o")  # MIMO's own, the same names both ways

# -----------------------------------------------------------------------------
# the two formats: configs and state dicts, each way


def official_config(cfg, where) -> dict:
    """Our ModelConfig -> the MambaConfig (config.json) of that model, or a CheckpointError."""
    rope, S, F = cfg.rope_fraction, cfg.n_angles, MLP_MULTIPLE
    problems = [what for bad, what in [
        (rope not in (0.5, 1.0), f"rope_fraction {rope}: the official Mamba3 layer accepts only "
         "0.5 and 1.0"),
        (rope in (0.5, 1.0) and (S == 0 or S % 2), f"d_state {cfg.d_state} with rope_fraction "
         f"{rope} gives {S} rotary angles: the official kernel needs an even number, at least 2"),
        (cfg.mlp_hidden % F, f"mlp_hidden {cfg.mlp_hidden}: the official GatedMLP rounds its hidden"
         f" size up to a multiple of {F} (another model); train with a multiple of {F}"),
        (cfg.norm_eps != NORM_EPS, f"norm_eps {cfg.norm_eps}: the official model fixes every "
         f"RMSNorm epsilon at {NORM_EPS}")] if bad]
    if problems:
        raise CheckpointError(f"{where} {NOT_OFFICIAL}: {'; '.join(problems)}")
    mimo = {"mimo_rank": cfg.mimo_rank} if cfg.mimo_rank > 1 else {}
    ssm_cfg = {"layer": "Mamba3", **{k: getattr(cfg, k) for k in SHARED}, "is_mimo": bool(mimo),
               "chunk_size": cfg.chunk_tokens, "is_outproj_norm": False, **mimo}
    # residual_in_fp32 is what our bf16 training does, fused_add_norm the same math in one kernel;
    # no padding rows: the official model gives each a logit, and ours (untrained) would take mass
    return dict(CONFIG_DEFAULTS, d_model=cfg.d_model, d_intermediate=cfg.mlp_hidden,
                n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                pad_vocab_size_multiple=1)


def config_from_official(config: dict, where) -> dict:
    """A MambaConfig (config.json) -> ModelConfig fields, or a CheckpointError naming `where`."""
    core = {"d_model", "n_layer", "vocab_size", "ssm_cfg"}
    missing, unknown = core - config.keys(), config.keys() - CONFIG_DEFAULTS.keys() - core
    c = {**CONFIG_DEFAULTS, **config}
    ssm = {**MAMBA3_DEFAULTS, **(c.get("ssm_cfg") or {})}
    extra = sorted(ssm.keys() - MAMBA3_DEFAULTS.keys() - MAMBA3_INERT)
    layer = ssm.get("layer", "Mamba1")  # (the official default)
    R = ssm.get("mimo_rank", 4) if ssm["is_mimo"] else 1  # (the official default)
    problems = [what for bad, what in [
        (missing, f"missing {', '.join(sorted(missing))}"),
        (unknown, f"unknown fields {', '.join(sorted(unknown))}"),
        (layer != "Mamba3", f"ssm_cfg layer {layer}, not Mamba3"),
        (extra, f"ssm_cfg options this reader does not know: {', '.join(extra)}"),
        (not isinstance(R, int) or R < 1, f"mimo_rank {R!r}"),
        (ssm["is_outproj_norm"], "a norm before out_proj (is_outproj_norm)"),
        (c["attn_layer_idx"], f"attention layers {c['attn_layer_idx']}"),
        (not c["rms_norm"], "LayerNorm blocks (rms_norm false)"),
        (not c["tie_embeddings"], "a separate LM head (tie_embeddings false)"),
        (ssm["expand"] != int(ssm["expand"]), f"expand {ssm['expand']}"),
        (ssm["rope_fraction"] not in (0.5, 1.0), f"rope_fraction {ssm['rope_fraction']}")] if bad]
    if problems:
        raise CheckpointError(f"{where}: {'; '.join(problems)}. mamba3-lite reads Mamba-3 SISO "
                              "and MIMO models with RMSNorm, gated MLPs and a tied LM head")
    mlp_hidden = -(-c["d_intermediate"] // MLP_MULTIPLE) * MLP_MULTIPLE  # as GatedMLP rounds it
    return dict({k: ssm[k] for k in SHARED}, vocab_size=c["vocab_size"], n_layer=c["n_layer"],
                d_model=c["d_model"], expand=int(ssm["expand"]), mlp_hidden=mlp_hidden,
                norm_eps=NORM_EPS, reset_token=None, mimo_rank=R, chunk_size=ssm["chunk_size"] * R)


def _names(cfg, mimo=False):
    # {official key: our keys}, lm_head aside, with the MIMO vectors for MIMO (`mimo`: rank 1 too)
    mixer = MIXER_NAMES + MIMO_NAMES * (mimo or cfg.mimo_rank > 1)
    layer = {"norm.weight": ["norm1.weight"]}
    layer |= {f"mixer.{a.replace('norm_w', 'norm.w')}": [f"mixer.{a}"] for a in mixer}
    if cfg.mlp_hidden:
        layer |= {"norm2.weight": ["norm2.weight"], "mlp.fc1.weight": ["mlp.up.weight",
                  "mlp.gate.weight"], "mlp.fc2.weight": ["mlp.down.weight"]}
    names = {"embedding.weight": ["embed.weight"], "norm_f.weight": ["norm_f.weight"]} | {
        f"layers.{i}.{b}": [f"blocks.{i}.{a}" for a in ours] for i in range(cfg.n_layer)
        for b, ours in layer.items()}
    return {"backbone." + b: ours for b, ours in names.items()}


def _reorder_state_dims(state, cfg, back=False):
    # a copy (ours) with each mixer's state dims in the official MIMO kernel's order, or `back`:
    # B and C's rows of in_proj (R x G blocks of N, after z | x), norm weights and biases
    N, S, h, lo = cfg.d_state, cfg.n_angles, cfg.d_state // 2, 2 * cfg.d_inner
    order = torch.tensor([2 * n for n in range(S)] + list(range(2 * S, h + S)) +
                         [2 * n + 1 for n in range(S)] + list(range(h + S, N)))
    order, hi = order.argsort() if back else order, lo + 2 * cfg.mimo_rank * cfg.ngroups * N
    state = dict(state)
    for m in (f"blocks.{i}.mixer." for i in range(cfg.n_layer)):
        W = state[m + "in_proj.weight"]
        state[m + "in_proj.weight"] = torch.cat([W[:lo], W[lo:hi].unflatten(0, (-1, N))[:, order]
                                                 .flatten(0, 1), W[hi:]])
        for name in ("B_norm_weight", "C_norm_weight", "B_bias", "C_bias"):
            state[m + name] = state[m + name][..., order]
    return state


def official_state_dict(state, cfg, where) -> dict:
    """Our state dict -> the official one, or a CheckpointError naming what its blocks cannot hold
    (another MLP in model.py, say)."""
    ours = {k for ks in _names(cfg).values() for k in ks}
    extra, lacking = state.keys() - ours - {"lm_head.weight"}, ours - state.keys()
    if extra or lacking:  # blocks.0.mlp.fc.weight, blocks.1.mlp.fc.weight -> blocks.N.mlp.fc.weight
        extra, lacking = (", ".join(sorted({re.sub(r"^blocks\.\d+\.", "blocks.N.", k) for k in ks}))
                          or "nothing" for ks in (extra, lacking))
        raise CheckpointError(f"{where} {NOT_OFFICIAL}: the official blocks hold RMSNorm, the "
                              "Mamba3 mixer, RMSNorm and a gated MLP (fc1 = [up; gate], fc2 = "
                              f"down), nothing else: they cannot hold {extra}; they need {lacking}")
    state = _reorder_state_dims(state, cfg) if cfg.mimo_rank > 1 else state
    out = {theirs: torch.cat([state[k] for k in keys]) for theirs, keys in _names(cfg).items()}
    for name in [k for k in out if k.endswith(("B_bias", "C_bias")) and cfg.mimo_rank == 1]:
        out[name] = out[name][:, None]  # (H, N) -> (H, 1, N): the official MIMO rank axis
    emb = out["backbone.embedding.weight"][: cfg.vocab_size].clone()  # unpadded, and tied:
    out["lm_head.weight"] = out["backbone.embedding.weight"] = emb
    return out


def state_dict_from_official(state, cfg, where, mimo=False) -> dict:
    """An official state dict (of MIMO layers if `mimo`, of cfg's rank or 1) -> ours, checked
    against our model (a CheckpointError names `where`); padding rows zeros, extra rows cut."""
    fold, misfit = mimo and cfg.mimo_rank == 1, f"{where} does not fit its config.json"
    names = _names(cfg, fold)
    missing, unexpected = names.keys() - state.keys(), state.keys() - {*names, "lm_head.weight"}
    if missing or unexpected:
        raise CheckpointError(f"{misfit}: missing {sorted(missing) or 'none'}; unexpected "
                              f"{sorted(unexpected) or 'none'}")
    emb = state["backbone.embedding.weight"]
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], emb):
        raise CheckpointError(f"{where}: lm_head.weight is not the tied backbone.embedding.weight")
    shape = (cfg.n_heads, 1, cfg.headdim)  # of the vectors folded into ours below
    for k in [k for k in state if fold and k.endswith(MIMO_NAMES) and state[k].shape != shape]:
        raise CheckpointError(f"{misfit}: {k} is {tuple(state[k].shape)}, not {shape}")
    out = {k: v for theirs, ours in names.items() for k, v in  # fc1 in two: [up; gate]
           zip(ours, state[theirs].chunk(2) if len(ours) == 2 else [state[theirs]])}
    for name in [k for k in out if k.endswith(("B_bias", "C_bias")) and cfg.mimo_rank == 1]:
        out[name] = out[name].squeeze(1)  # (H, 1, N) -> (H, N); another rank is refused below
    out["lm_head.weight"] = out["embed.weight"] = F.pad(emb, (0, 0, 0, cfg.padded_vocab - len(emb)))
    vectors = {k: out.pop(k) for k in list(out) if k.endswith(MIMO_NAMES)} if fold else {}
    with torch.device("meta"):  # shapes checked by our own model, without allocating it
        try:
            Mamba3LM(cfg).load_state_dict(out, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{misfit}: {str(e).splitlines()[-1].strip()}") from None
    HP = cfg.n_heads * cfg.headdim
    for m in (f"blocks.{i}.mixer." for i in range(cfg.n_layer) if fold):
        # an official MIMO layer of rank 1 as our SISO one: v = x * mimo_x and z * mimo_z are
        # in_proj's x and z rows scaled, mimo_o * y is out_proj's columns scaled
        W, Wo = out[m + "in_proj.weight"], out[m + "out_proj.weight"]
        mx, mz, mo = (vectors[m + n].reshape(HP).to(W.dtype) for n in MIMO_NAMES)
        out[m + "in_proj.weight"] = W * torch.cat([mz, mx, mx.new_ones(len(W) - 2 * HP)])[:, None]
        out[m + "out_proj.weight"] = Wo * mo
    return _reorder_state_dims(out, cfg, back=True) if mimo else out


# -----------------------------------------------------------------------------
# models from run directories, and from official directories for --init-from


def load_model(run_dir, step=None):
    """(model in eval mode, meta, step) of a run's checkpoint, by default the newest that loads."""
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"{run_dir}: no such directory; expected a train.py --out-dir "
                              "holding checkpoints")

    def build(s):  # the model the meta of step s describes, with its weights
        config = ckpt.read_meta(run_dir, s)["model_config"]  # (ckpt.save records the config)
        fields = {k: v for k, v in config.items() if k in ModelConfig.__dataclass_fields__}
        model = Mamba3LM(ModelConfig(**fields))  # (a field this version dropped is passed over)
        return model.eval(), ckpt.load(run_dir, s, model)

    if step is None:
        step, loaded = ckpt.newest(run_dir, build)
        if loaded is not None:
            return (*loaded, step)
        if not (steps := ckpt.list_steps(run_dir)):
            raise CheckpointError(f"{run_dir}: no complete checkpoint found (expected "
                                  "model_step_N.safetensors, optim_step_N.pt and meta_step_N.json)")
        step = steps[0]  # none loads: the oldest once more, whose error says why
    return (*build(step), step)


def check_impl(model):
    """Refuse, before a command writes anything, a MAMBA3_IMPL that cannot run here or (on a GPU) a
    MIMO rank the fused kernels cannot take: kernels.py sees either only when two tokens run."""
    impl, device = os.environ.get("MAMBA3_IMPL"), next(model.parameters()).device
    if impl or (model.config.mimo_rank > 1 and device.type == "cuda"):
        try:
            with torch.no_grad():
                model(torch.zeros(1, 2, dtype=torch.long, device=device))
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"MAMBA3_IMPL={impl}: {e}" if impl else str(e)) from None


def read_pretrained(path):
    """(ModelConfig fields, state dict in our names, tokenizer spec or None) to start from, of a
    train.py run directory or a directory in the official format (an export, anyone's Mamba-3)."""
    p = Path(path)
    if ckpt.step_files(p):
        model, meta, _ = load_model(p)
        return dataclasses.asdict(model.config), model.state_dict(), meta.get("tokenizer")
    weights = [p / n for n in ("model.safetensors", "pytorch_model.bin") if (p / n).is_file()]
    if not weights or not (p / "config.json").is_file():
        raise CheckpointError(f"{p}: expected a train.py run directory or a mamba_ssm one "
                              "(config.json with model.safetensors or pytorch_model.bin)")
    try:
        mamba_config = json.loads((p / "config.json").read_text())
        state = (safetensors.torch.load_file(weights[0]) if weights[0].suffix == ".safetensors"
                 else torch.load(weights[0], map_location="cpu", weights_only=True))
        if not isinstance(mamba_config, dict) or not isinstance(state, dict):
            raise TypeError("expected MambaConfig fields and a state dict")
    except Exception as e:  # noqa: BLE001 - JSON, safetensors and pickle each have their own errors
        raise CheckpointError(f"{p}: config.json or {weights[0].name} cannot be read "
                              f"({type(e).__name__}: {e})") from None
    config = config_from_official(mamba_config, p / "config.json")
    marker = (json.loads((p / MARKER).read_text()) if (p / MARKER).is_file() else None) or {}
    config["reset_token"] = marker.get("model_config", {}).get("reset_token")  # (our own export's)
    try:
        cfg = ModelConfig(**config)
    except ValueError as e:  # a shape our model cannot take (heads that do not divide, say)
        raise CheckpointError(f"{p / 'config.json'}: {e}") from None
    state = state_dict_from_official(state, cfg, weights[0], mamba_config["ssm_cfg"].get("is_mimo"))
    return config, state, marker.get("tokenizer")


# -----------------------------------------------------------------------------
# the export


def byte_tokenizer_json() -> str:
    """data.ByteTokenizer as a Hugging Face tokenizer.json: a byte-level BPE without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    # GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, 68 move to U+0100..
    printable, moved = {*range(33, 127), *range(161, 173), *range(174, 256)}, iter(range(256, 324))
    chars = [chr(b) if b in printable else chr(next(moved)) for b in range(256)]
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([data.EOS_TOKENS[0]])  # "<|endoftext|>", id 256 as ByteTokenizer has it
    return tok.to_str()


def _tokenizer_files(spec, run_dir):
    # {name: bytes} so that AutoTokenizer loads the export as the run's tokenizer; none for GPT-2
    # (the Hub's "gpt2" has tiktoken's ids) or an unknown tokenizer
    name = (spec or {}).get("name")
    if name not in ("byte", "file"):
        return {}
    data.load_tokenizer(spec, run_dir)  # refuses a file missing or not the spec's, as in sample.py
    # split_special_tokens: text that spells the EOS token stays text, as prepare.py encodes it
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "eos_token": data.EOS_TOKENS[0] if name == "byte" else spec.get("eos_token"),
              "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    blob = (byte_tokenizer_json().encode() if name == "byte" else
            (Path(run_dir) / spec["file"]).read_bytes())
    return {"tokenizer.json": blob, "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def usage(out, marker):
    """(how to load it, the harness command, warnings) for the export in `out`."""
    name, reset = (marker["tokenizer"] or {}).get("name"), marker["model_config"].get("reset_token")
    tokenizer = {"gpt2": "gpt2", "byte": str(out), "file": str(out)}.get(name, "TOKENIZER")
    load = (f'MambaLMHeadModel.from_pretrained("{out}", device="cuda")  '
            '# mamba_ssm.models.mixer_seq_simple, CUDA only')
    command = (f"lm_eval --model mamba_ssm --model_args pretrained={out},tokenizer={tokenizer},"
               "dtype=float32 --tasks lambada_openai,hellaswag,piqa,arc_easy --device cuda "
               "--batch_size 16")
    notes = ["the run recorded no tokenizer: replace TOKENIZER by the Hugging Face tokenizer that "
             "made its ids"] * (tokenizer == "TOKENIZER") + [
        f"this model resets its state after token {reset} (reset_token), but the official model "
        "does not reset at EOS: give it one document per sequence"] * (reset is not None)
    return load, command, notes


def export(run_dir, out_dir, step=None) -> Path:
    """Write a run's checkpoint (default: the newest that verifies) to `out_dir`, new or an earlier
    export (replaced whole, a user's files kept), or refuse before writing anything."""
    run_dir, out = Path(run_dir), Path(out_dir)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MARKER).is_file())):
        raise CheckpointError(f"{out} exists and is not an earlier export (it has no {MARKER}); "
                              "choose another OUT_DIR, or empty it yourself")
    model, meta, step = load_model(run_dir, step)
    config = official_config(model.config, f"{run_dir} step {step}")
    state = official_state_dict(model.state_dict(), model.config, f"{run_dir} step {step}")
    spec = meta.get("tokenizer")
    marker = {"format": "mamba3-lite official-format export", "version": 1, "source": str(run_dir),
              "step": step, "model_config": dataclasses.asdict(model.config),
              "tokenizer": {**spec, "file": "tokenizer.json"} if (spec or {}).get("name") == "file"
              else spec}
    load, command, notes = usage(out, marker)
    readme = ("# A Mamba-3 language model in the official mamba_ssm format\n\nExported by "
              f"mamba3-lite from `{run_dir}` step {step}. Load it:\n\n    {load}\n\nEvaluate it "
              f"with lm-evaluation-harness (`pip install lm-eval mamba-ssm`):\n\n    {command}\n\n"
              + "".join(f"Note: {n}.\n" for n in notes))
    files = _tokenizer_files(spec, run_dir) | {"config.json": json.dumps(config, indent=2).encode(),
                                               MARKER: json.dumps(marker, indent=2).encode(),
                                               "README.md": readme.encode()}

    def fill(stage):
        torch.save(state, stage / "pytorch_model.bin")
        untied = {**state, "lm_head.weight": state["lm_head.weight"].clone()}  # as safetensors asks
        safetensors.torch.save_file(untied, stage / "model.safetensors", metadata={"format": "pt"})
        (stage / "model.safetensors").chmod(ckpt.FILE_MODE)  # (safetensors' own is 0600)
        for name, blob in files.items():
            (stage / name).write_bytes(blob)
        for p in stage.iterdir():
            data.fsync(p)  # durable before the swap makes them the export

    try:
        data.replace_dir(out, fill, ours=lambda old: FILES)
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:  # a full disk, in 3 dialects
        raise CheckpointError(f"could not write {getattr(e, 'filename', None) or out} "
                              f"({getattr(e, 'strerror', None) or e}); free disk space or fix the "
                              f"permissions, then run again: {out} is unchanged") from None
    return out


# -----------------------------------------------------------------------------
# command line: python official.py export RUN_DIR OUT_DIR [--step N]

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich",
                  help="The official mamba_ssm format (export, read_pretrained, load_model).")
app.callback()(lambda: None)  # a group, so that the command line names `export`


@app.command("export")
def export_main(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A train.py --out-dir."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Where to write; an earlier export "
                                   "is replaced, files you added to it are kept."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step (default: the newest "
                                       "that verifies)."),
):
    """Export a checkpoint to the official mamba_ssm format (config.json + pytorch_model.bin), which
    MambaLMHeadModel.from_pretrained and lm-evaluation-harness (--model mamba_ssm) load."""
    with data.cli_errors(CheckpointError, ValueError):  # ValueError: data.DataError, another export
        out = export(run_dir, out_dir, step)
    load, command, notes = usage(out, marker := json.loads((out / MARKER).read_text()))
    names = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported {run_dir} step {marker['step']} to {out}: {names}\n  load      {load}\n"
          f"  evaluate  {command}")
    for n in notes:
        typer.echo(f"warning: {n}", err=True)


if __name__ == "__main__":
    app()
