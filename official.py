"""The official mamba_ssm format, both ways, and models from run directories.

    python official.py export RUN_DIR OUT_DIR [--step N]

writes a checkpoint for eval.py, and for MambaLMHeadModel.from_pretrained and `lm_eval` with
a mamba_ssm new enough to hold Mamba3 (MAMBA_SSM_NEEDS says which). read_pretrained()
brings such a directory, or a run directory, back for `train.py --init-from`. load_model()
rebuilds the model of a run directory's checkpoint (sample.py, export, --init-from).

The official Mamba3 layer with its output norm off is our mixer: the same in_proj layout and
math, MIMO with is_mimo and mimo_rank R. Its blocks are ours and its head is tied. The names
and shapes that differ:

    ours                   official                          change
    embed.weight (V64, D)  backbone.embedding.weight         vocab_size rows, and
                           lm_head.weight                    tied to it
    blocks.i.norm1, norm2  backbone.layers.i.norm, norm2
    blocks.i.mixer.*       backbone.layers.i.mixer.*         B_norm_weight is B_norm.weight
    mixer.B_bias, C_bias   (H, 1, N) for SISO                a MIMO rank axis of 1
    mixer.mimo_x, _z, _o   the same, (H, R, P)               MIMO only
    blocks.i.mlp.up, gate  backbone.layers.i.mlp.fc1 (2F, D) [up; gate], as GatedMLP splits
    blocks.i.mlp.down      backbone.layers.i.mlp.fc2
    norm_f                 backbone.norm_f

A hybrid's attention layers (attn_layers) are the official MHA's, listed in attn_layer_idx
with their shape in attn_cfg: the same in_proj ([Q | K | V] rows) and out_proj, NeoX rotary
on the first rotary_emb_dim channels, causal, without the MHA's convolution and MLP (d_conv 0,
mlp_dim 0).

For MIMO, our chunk_size counts rows and the official one tokens (theirs is ours / R). The
official kernel rotates state dim n with n + N/2 where we rotate (2n, 2n + 1): a fixed
permutation of the state dims. An official MIMO layer of rank 1 comes in as SISO, its
mimo_x, mimo_z and mimo_o folded into in_proj and out_proj. What the official modules cannot
rebuild is refused.
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

# The file that marks a directory as an export, which the next export may replace. It holds our
# own config and the tokenizer spec.
MARKER = "mamba3_lite.json"

# The files an export writes. Any other file in its directory is the user's and is kept.
FILES = {"config.json", "pytorch_model.bin", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "README.md", MARKER}

# The words of every refusal to export.
NOT_OFFICIAL = "cannot be exported to the official mamba_ssm format"

# GatedMLP rounds its hidden size up to a multiple of this.
MLP_MULTIPLE = 128

# The official MIMO kernel asserts chunks of at least this many tokens. A chunk size changes
# only how the scan is cut, never what it computes, so an export may round ours up to it.
MIN_CHUNK_TOKENS = 8

# What loads an export: the official Mamba3 layer as our model computes it is on
# state-spaces/mamba's main branch, not in a pip release yet.
MAMBA_SSM_NEEDS = (
    "mamba_ssm built from source from state-spaces/mamba's main branch at or after PRs #962 "
    "(the heavy-tailed activation of A) and #968 (Mamba3 layers in MixerModel), on a CUDA "
    "GPU: `pip install --no-build-isolation git+https://github.com/state-spaces/mamba.git`. "
    "The pip release mamba-ssm 2.3.2.post1 cannot load it: its MixerModel builds no Mamba3 "
    "layer, and its Mamba3 computes A with a softplus instead of the heavy-tailed activation "
    "this model was trained with")

# The official model fixes every RMSNorm's epsilon at this.
NORM_EPS = 1e-5

# MambaConfig's fields with their defaults, for config.json files that leave some out.
CONFIG_DEFAULTS = dict(d_intermediate=0, attn_layer_idx=[], attn_cfg={}, rms_norm=True,
                       residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
                       tie_embeddings=True)

# Mamba3's arguments with their defaults, likewise for ssm_cfg.
MAMBA3_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5,
                       dt_min=1e-3, dt_max=1e-1, dt_init_floor=1e-4, A_floor=1e-4,
                       chunk_size=64, is_outproj_norm=False, is_mimo=False)

# The arguments that ModelConfig names the same way.
SHARED = [k for k in MAMBA3_DEFAULTS if hasattr(ModelConfig, k)]

# Arguments without effect here: mimo_rank without is_mimo, fuse_pregate_headwise_norm
# without the output norm.
MAMBA3_INERT = {"layer", "mimo_rank", "fuse_pregate_headwise_norm", "dropout"}

# The official MHA's arguments with their defaults (mamba_ssm/modules/mha.py), for attn_cfg.
MHA_DEFAULTS = dict(num_heads_kv=None, head_dim=None, mlp_dim=0, qkv_proj_bias=True,
                    out_proj_bias=True, softmax_scale=None, causal=False, d_conv=0,
                    rotary_emb_dim=0, rotary_emb_base=10000.0,
                    rotary_emb_interleaved=False)

# Our mixer's tensors, and those only MIMO has (the same names both ways).
MIXER_NAMES = ("in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm_weight",
               "C_norm_weight", "D", "out_proj.weight")
MIMO_NAMES = ("mimo_x", "mimo_z", "mimo_o")


# -----------------------------------------------------------------------------
# the two formats: configs and state dicts, each way


def official_config(cfg, where) -> dict:
    """Our ModelConfig -> the MambaConfig (config.json) of that model, or a CheckpointError."""
    rope = cfg.rope_fraction
    angles = cfg.n_angles
    # Every problem is named at once, so that one retraining fixes them all.
    problems = []
    if rope not in (0.5, 1.0):
        problems.append(f"rope_fraction {rope}: the official Mamba3 layer accepts only 0.5 "
                        "and 1.0")
    elif angles == 0 or angles % 2:
        problems.append(f"d_state {cfg.d_state} with rope_fraction {rope} gives {angles} "
                        "rotary angles: the official kernel needs an even number, at least 2")
    if cfg.mlp_hidden % MLP_MULTIPLE:
        problems.append(f"mlp_hidden {cfg.mlp_hidden}: the official GatedMLP rounds its "
                        f"hidden size up to a multiple of {MLP_MULTIPLE} (another model); "
                        f"train with a multiple of {MLP_MULTIPLE}")
    if cfg.norm_eps != NORM_EPS:
        problems.append(f"norm_eps {cfg.norm_eps}: the official model fixes every RMSNorm "
                        f"epsilon at {NORM_EPS}")
    if problems:
        raise CheckpointError(f"{where} {NOT_OFFICIAL}: {'; '.join(problems)}")
    attn_layer_idx = []
    attn_cfg = {}
    if cfg.attn_layers:
        shape = cfg.attn_shape
        attn_layer_idx = sorted(cfg.attn_layers)
        # Every argument written out: the official MHA's defaults (biases on, not
        # causal) are not ours.
        attn_cfg = dict(num_heads=shape.heads, num_heads_kv=shape.kv_heads,
                        head_dim=shape.head_dim, rotary_emb_dim=shape.rotary_dim,
                        rotary_emb_base=cfg.attn_rotary_base, causal=True,
                        qkv_proj_bias=cfg.attn_qkv_bias, out_proj_bias=cfg.attn_out_bias,
                        mlp_dim=0, d_conv=0)
    ssm_cfg = {"layer": "Mamba3"}
    for k in SHARED:
        ssm_cfg[k] = getattr(cfg, k)
    ssm_cfg["is_mimo"] = cfg.mimo_rank > 1
    # The official chunk_size counts tokens, ours rows (mimo_rank of them per token). A
    # chunk below the kernels' least is rounded up: the same function, cut otherwise.
    ssm_cfg["chunk_size"] = max(cfg.chunk_tokens, MIN_CHUNK_TOKENS)
    ssm_cfg["is_outproj_norm"] = False
    if cfg.mimo_rank > 1:
        ssm_cfg["mimo_rank"] = cfg.mimo_rank
    # residual_in_fp32 is what our bf16 training does, and fused_add_norm is the same math in
    # one kernel. No padding rows: the official model gives each one a logit, and ours
    # (untrained) would take probability mass.
    return dict(CONFIG_DEFAULTS, d_model=cfg.d_model, d_intermediate=cfg.mlp_hidden,
                n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                attn_layer_idx=attn_layer_idx, attn_cfg=attn_cfg,
                pad_vocab_size_multiple=1)


def attention_from_official(c, problems):
    """The ModelConfig fields of a MambaConfig's attn_layer_idx and attn_cfg (c, with its
    defaults filled); what our attention cannot be is added to `problems`."""
    layers = c["attn_layer_idx"] or []
    # Without attention layers, ModelConfig's defaults.
    if not layers:
        fields = {}
        for field in dataclasses.fields(ModelConfig):
            if field.name.startswith("attn_"):
                fields[field.name] = field.default
        return fields
    given = c["attn_cfg"] or {}
    attn = {**MHA_DEFAULTS, **given}
    unknown = sorted(given.keys() - MHA_DEFAULTS.keys() - {"num_heads"})
    if unknown:
        problems.append(f"attn_cfg options this reader does not know: {', '.join(unknown)}")
    if "num_heads" not in given:
        problems.append("attn_cfg without num_heads")
    # The fields the official MHA has and ours has not, each named.
    if attn["d_conv"]:
        problems.append(f"attn_cfg d_conv {attn['d_conv']}: a convolution before "
                        "attention")
    if attn["mlp_dim"]:
        problems.append(f"attn_cfg mlp_dim {attn['mlp_dim']}: an MLP inside the attention "
                        "mixer")
    if not attn["causal"]:
        problems.append("attn_cfg causal false (a language model attends causally)")
    if attn["rotary_emb_interleaved"]:
        problems.append("attn_cfg rotary_emb_interleaved true (ours is the NeoX half "
                        "split)")
    if attn["softmax_scale"] is not None:
        problems.append(f"attn_cfg softmax_scale {attn['softmax_scale']} (ours is "
                        "1/sqrt(head_dim))")
    heads = given.get("num_heads")
    head_dim = attn["head_dim"]
    # The official default head dim, d_model / num_heads.
    if head_dim is None and isinstance(heads, int) and heads > 0:
        head_dim = c["d_model"] // heads
    return dict(attn_layers=tuple(layers), attn_heads=heads,
                attn_kv_heads=attn["num_heads_kv"] or heads, attn_head_dim=head_dim,
                attn_rotary_dim=attn["rotary_emb_dim"],
                attn_rotary_base=float(attn["rotary_emb_base"]),
                attn_qkv_bias=bool(attn["qkv_proj_bias"]),
                attn_out_bias=bool(attn["out_proj_bias"]))


def config_from_official(config: dict, where) -> dict:
    """A MambaConfig (config.json) -> ModelConfig fields, or a CheckpointError naming
    `where`."""
    core = {"d_model", "n_layer", "vocab_size", "ssm_cfg"}
    missing = core - config.keys()
    unknown = config.keys() - CONFIG_DEFAULTS.keys() - core
    c = {**CONFIG_DEFAULTS, **config}
    ssm = {**MAMBA3_DEFAULTS, **(c.get("ssm_cfg") or {})}
    extra = sorted(ssm.keys() - MAMBA3_DEFAULTS.keys() - MAMBA3_INERT)
    # The official defaults: a Mamba1 layer, and MIMO of rank 4.
    layer = ssm.get("layer", "Mamba1")
    R = 1
    if ssm["is_mimo"]:
        R = ssm.get("mimo_rank", 4)
    # Every problem is named at once, so that one look at config.json shows them all.
    problems = []
    if missing:
        problems.append(f"missing {', '.join(sorted(missing))}")
    if unknown:
        problems.append(f"unknown fields {', '.join(sorted(unknown))}")
    if layer != "Mamba3":
        problems.append(f"ssm_cfg layer {layer}, not Mamba3")
    if extra:
        problems.append(f"ssm_cfg options this reader does not know: {', '.join(extra)}")
    if not isinstance(R, int) or R < 1:
        problems.append(f"mimo_rank {R!r}")
    if ssm["is_outproj_norm"]:
        problems.append("a norm before out_proj (is_outproj_norm)")
    attention = attention_from_official(c, problems)
    if not c["rms_norm"]:
        problems.append("LayerNorm blocks (rms_norm false)")
    if not c["tie_embeddings"]:
        problems.append("a separate LM head (tie_embeddings false)")
    if ssm["expand"] != int(ssm["expand"]):
        problems.append(f"expand {ssm['expand']}")
    if ssm["rope_fraction"] not in (0.5, 1.0):
        problems.append(f"rope_fraction {ssm['rope_fraction']}")
    if problems:
        raise CheckpointError(f"{where}: {'; '.join(problems)}. mamba3-lite reads Mamba-3 "
                              "SISO and MIMO models with RMSNorm, gated MLPs and a tied LM "
                              "head, and hybrids with causal attention layers")
    # GatedMLP rounds its hidden size up to a multiple of MLP_MULTIPLE.
    multiples = -(-c["d_intermediate"] // MLP_MULTIPLE)
    mlp_hidden = multiples * MLP_MULTIPLE
    fields = {k: ssm[k] for k in SHARED}
    return dict(fields, vocab_size=c["vocab_size"], n_layer=c["n_layer"],
                d_model=c["d_model"], expand=int(ssm["expand"]), mlp_hidden=mlp_hidden,
                norm_eps=NORM_EPS, reset_token=None, mimo_rank=R,
                chunk_size=ssm["chunk_size"] * R, **attention)


def _names(cfg, mimo=False):
    """{official key: our keys} of every tensor but lm_head. The MIMO vectors are there for a
    MIMO model, and with mimo=True for an official MIMO layer of rank 1 too."""
    mixer = list(MIXER_NAMES)
    if mimo or cfg.mimo_rank > 1:
        mixer += MIMO_NAMES
    # The attention mixer's tensors have the official MHA's names.
    attention = ["in_proj.weight", "out_proj.weight"]
    if cfg.attn_qkv_bias:
        attention.append("in_proj.bias")
    if cfg.attn_out_bias:
        attention.append("out_proj.bias")
    layer = {"norm.weight": ["norm1.weight"]}
    attn_layer = {"norm.weight": ["norm1.weight"]}
    for name in mixer:
        # Our B_norm_weight is their B_norm.weight.
        theirs = name.replace("norm_w", "norm.w")
        layer[f"mixer.{theirs}"] = [f"mixer.{name}"]
    for name in attention:
        attn_layer[f"mixer.{name}"] = [f"mixer.{name}"]
    if cfg.mlp_hidden:
        for block in (layer, attn_layer):
            block["norm2.weight"] = ["norm2.weight"]
            # GatedMLP's fc1 is our up and gate stacked, as it splits them.
            block["mlp.fc1.weight"] = ["mlp.up.weight", "mlp.gate.weight"]
            block["mlp.fc2.weight"] = ["mlp.down.weight"]
    names = {"backbone.embedding.weight": ["embed.weight"],
             "backbone.norm_f.weight": ["norm_f.weight"]}
    for i in range(cfg.n_layer):
        block = layer
        if i in cfg.attn_layers:
            block = attn_layer
        for theirs, ours in block.items():
            names[f"backbone.layers.{i}.{theirs}"] = [f"blocks.{i}.{a}" for a in ours]
    return names


def _reorder_state_dims(state, cfg, back=False):
    """A copy of our state dict with each mixer's state dims in the official MIMO kernel's
    order, or with back=True from that order to ours.

    We rotate the pairs (2n, 2n + 1) of the first 2S state dims, the official kernel n with
    n + N/2. What has a state axis: B and C's rows of in_proj (mimo_rank x ngroups blocks of N
    rows after z and x), their norm weights and their biases.
    """
    N = cfg.d_state
    S = cfg.n_angles
    half = N // 2
    evens = [2 * n for n in range(S)]
    odds = [2 * n + 1 for n in range(S)]
    # Their dim n is our 2n for n < S, then our S + n up to N/2. Their N/2 + n is our 2n + 1
    # for n < S, then our N/2 + n.
    first_half = evens + list(range(2 * S, half + S))
    second_half = odds + list(range(half + S, N))
    order = torch.tensor(first_half + second_half)
    if back:
        order = order.argsort()
    lo = 2 * cfg.d_inner
    hi = lo + 2 * cfg.mimo_rank * cfg.ngroups * N
    state = dict(state)
    for i in range(cfg.n_layer):
        # Attention layers have no state dims.
        if i in cfg.attn_layers:
            continue
        m = f"blocks.{i}.mixer."
        W = state[m + "in_proj.weight"]
        bc = W[lo:hi].unflatten(0, (-1, N))[:, order].flatten(0, 1)
        state[m + "in_proj.weight"] = torch.cat([W[:lo], bc, W[hi:]])
        for name in ("B_norm_weight", "C_norm_weight", "B_bias", "C_bias"):
            state[m + name] = state[m + name][..., order]
    return state


def _per_block(keys):
    """The keys, each block's number written N, once each ("nothing" for none)."""
    # blocks.0.mlp.fc.weight and blocks.1.mlp.fc.weight are both blocks.N.mlp.fc.weight.
    names = {re.sub(r"^blocks\.\d+\.", "blocks.N.", k) for k in keys}
    return ", ".join(sorted(names)) or "nothing"


def official_state_dict(state, cfg, where) -> dict:
    """Our state dict -> the official one, or a CheckpointError naming what its blocks cannot
    hold (another MLP in model.py, say)."""
    ours = set()
    for keys in _names(cfg).values():
        ours.update(keys)
    extra = state.keys() - ours - {"lm_head.weight"}
    lacking = ours - state.keys()
    if extra or lacking:
        cannot = _per_block(extra)
        need = _per_block(lacking)
        raise CheckpointError(f"{where} {NOT_OFFICIAL}: the official blocks hold RMSNorm, the "
                              "Mamba3 mixer, RMSNorm and a gated MLP (fc1 = [up; gate], "
                              f"fc2 = down), nothing else: they cannot hold {cannot}; they "
                              f"need {need}")
    if cfg.mimo_rank > 1:
        state = _reorder_state_dims(state, cfg)
    out = {}
    for theirs, keys in _names(cfg).items():
        out[theirs] = torch.cat([state[k] for k in keys])
    # The official biases have a MIMO rank axis, of size 1 for SISO: (H, N) -> (H, 1, N).
    if cfg.mimo_rank == 1:
        for name in out:
            if name.endswith(("B_bias", "C_bias")):
                out[name] = out[name][:, None]
    # The embedding without its padding rows, and the head tied to it.
    emb = out["backbone.embedding.weight"][: cfg.vocab_size].clone()
    out["backbone.embedding.weight"] = emb
    out["lm_head.weight"] = emb
    return out


def _fold_rank_one(out, vectors, cfg):
    """Fold an official MIMO layer of rank 1 into our SISO one, in place: with v = x * mimo_x
    and z * mimo_z, in_proj's x and z rows are scaled; with mimo_o * y, out_proj's columns."""
    HP = cfg.n_heads * cfg.headdim
    for i in range(cfg.n_layer):
        if i in cfg.attn_layers:
            continue
        m = f"blocks.{i}.mixer."
        W = out[m + "in_proj.weight"]
        Wo = out[m + "out_proj.weight"]
        mx = vectors[m + "mimo_x"].reshape(HP).to(W.dtype)
        mz = vectors[m + "mimo_z"].reshape(HP).to(W.dtype)
        mo = vectors[m + "mimo_o"].reshape(HP).to(W.dtype)
        # in_proj's rows are z, then x, then the rest.
        scale = torch.cat([mz, mx, mx.new_ones(len(W) - 2 * HP)])
        out[m + "in_proj.weight"] = W * scale[:, None]
        out[m + "out_proj.weight"] = Wo * mo


def state_dict_from_official(state, cfg, where, mimo=False) -> dict:
    """An official state dict (of MIMO layers if `mimo`, of cfg's rank or 1) -> ours, checked
    against our model (a CheckpointError names `where`); padding rows zeros, extra rows cut."""
    # An official MIMO layer of rank 1 is our SISO layer once its vectors are folded in.
    fold = bool(mimo) and cfg.mimo_rank == 1
    misfit = f"{where} does not fit its config.json"
    names = _names(cfg, fold)
    missing = names.keys() - state.keys()
    unexpected = state.keys() - {*names, "lm_head.weight"}
    if missing or unexpected:
        raise CheckpointError(f"{misfit}: missing {sorted(missing) or 'none'}; unexpected "
                              f"{sorted(unexpected) or 'none'}")
    emb = state["backbone.embedding.weight"]
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], emb):
        raise CheckpointError(f"{where}: lm_head.weight is not the tied "
                              "backbone.embedding.weight")
    # The shape of the MIMO vectors that fold into our SISO weights.
    shape = (cfg.n_heads, 1, cfg.headdim)
    if fold:
        for k in state:
            if k.endswith(MIMO_NAMES) and state[k].shape != shape:
                raise CheckpointError(f"{misfit}: {k} is {tuple(state[k].shape)}, not {shape}")
    out = {}
    for theirs, ours in names.items():
        # fc1 comes in two: [up; gate].
        if len(ours) == 2:
            parts = state[theirs].chunk(2)
        else:
            parts = [state[theirs]]
        for k, v in zip(ours, parts):
            out[k] = v
    # (H, 1, N) -> (H, N). Another MIMO rank than 1 is refused below, by the shapes.
    if cfg.mimo_rank == 1:
        for name in out:
            if name.endswith(("B_bias", "C_bias")):
                out[name] = out[name].squeeze(1)
    padded = F.pad(emb, (0, 0, 0, cfg.padded_vocab - len(emb)))
    out["lm_head.weight"] = padded
    out["embed.weight"] = padded
    vectors = {}
    if fold:
        for k in list(out):
            if k.endswith(MIMO_NAMES):
                vectors[k] = out.pop(k)
    # Our own model checks the shapes, on the meta device, so without allocating it.
    with torch.device("meta"):
        try:
            Mamba3LM(cfg).load_state_dict(out, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"{misfit}: {str(e).splitlines()[-1].strip()}") from None
    if fold:
        _fold_rank_one(out, vectors, cfg)
    if mimo:
        return _reorder_state_dims(out, cfg, back=True)
    return out


# -----------------------------------------------------------------------------
# models from run directories, and from official directories for --init-from


def load_model(run_dir, step=None):
    """(model in eval mode, meta, step) of a run's checkpoint, by default the newest that
    loads."""
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"{run_dir}: no such directory; expected a train.py --out-dir "
                              "holding checkpoints")

    def build(s):
        """The model that the meta of step s describes, with its weights."""
        # ckpt.save records the model's config in the meta.
        config = ckpt.read_meta(run_dir, s)["model_config"]
        # A field that this version of ModelConfig dropped is passed over.
        fields = {k: v for k, v in config.items() if k in ModelConfig.__dataclass_fields__}
        model = Mamba3LM(ModelConfig(**fields))
        model.eval()
        meta = ckpt.load(run_dir, s, model)
        return model, meta

    # By default the newest step that loads: a corrupt one falls back to an older one.
    if step is None:
        step, loaded = ckpt.newest(run_dir, build)
        if loaded is not None:
            model, meta = loaded
            return model, meta, step
        steps = ckpt.list_steps(run_dir)
        if not steps:
            raise CheckpointError(f"{run_dir}: no complete checkpoint found (expected "
                                  "model_step_N.safetensors, optim_step_N.pt and "
                                  "meta_step_N.json)")
        # None loads: the oldest once more, whose error says why.
        step = steps[0]
    model, meta = build(step)
    return model, meta, step


def check_impl(model):
    """Refuse, before a command writes anything, a MAMBA3_IMPL that cannot run here or (on a
    GPU) a MIMO rank the fused kernels cannot take."""
    # kernels.py sees either only when two tokens run through the model.
    impl = os.environ.get("MAMBA3_IMPL")
    device = next(model.parameters()).device
    mimo_on_gpu = model.config.mimo_rank > 1 and device.type == "cuda"
    if not impl and not mimo_on_gpu:
        return
    try:
        with torch.no_grad():
            model(torch.zeros(1, 2, dtype=torch.long, device=device))
    except (ValueError, RuntimeError) as e:
        if impl:
            raise ValueError(f"MAMBA3_IMPL={impl}: {e}") from None
        raise ValueError(str(e)) from None


def read_pretrained(path):
    """(ModelConfig fields, state dict in our names, tokenizer spec or None) to start from, of
    a train.py run directory or a directory in the official format (an export, anyone's
    Mamba-3)."""
    p = Path(path)
    # A run directory: its newest checkpoint that loads, as a resume would pick it.
    if ckpt.step_files(p):
        model, meta, _ = load_model(p)
        return dataclasses.asdict(model.config), model.state_dict(), meta.get("tokenizer")
    weights = [p / n for n in ("model.safetensors", "pytorch_model.bin") if (p / n).is_file()]
    if not weights or not (p / "config.json").is_file():
        raise CheckpointError(f"{p}: expected a train.py run directory or a mamba_ssm one "
                              "(config.json with model.safetensors or pytorch_model.bin)")
    weights_file = weights[0]
    try:
        mamba_config = json.loads((p / "config.json").read_text())
        if weights_file.suffix == ".safetensors":
            state = safetensors.torch.load_file(weights_file)
        else:
            state = torch.load(weights_file, map_location="cpu", weights_only=True)
        if not isinstance(mamba_config, dict) or not isinstance(state, dict):
            raise TypeError("expected MambaConfig fields and a state dict")
    # JSON, safetensors and pickle each have their own errors.
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{p}: config.json or {weights_file.name} cannot be read "
                              f"({type(e).__name__}: {e})") from None
    config = config_from_official(mamba_config, p / "config.json")
    # Our own export also holds our config and the tokenizer, in the marker.
    marker = {}
    if (p / MARKER).is_file():
        marker = json.loads((p / MARKER).read_text()) or {}
    ours = marker.get("model_config", {})
    config["reset_token"] = ours.get("reset_token")
    # Our export may have rounded the chunk up for the official kernels: the marker keeps
    # the one the model trained with, so a round trip gives back the same config.
    if "chunk_size" in ours:
        config["chunk_size"] = ours["chunk_size"]
    try:
        cfg = ModelConfig(**config)
    # A shape our model cannot take: heads that do not divide, say.
    except ValueError as e:
        raise CheckpointError(f"{p / 'config.json'}: {e}") from None
    is_mimo = mamba_config["ssm_cfg"].get("is_mimo")
    state = state_dict_from_official(state, cfg, weights_file, is_mimo)
    return config, state, marker.get("tokenizer")


# -----------------------------------------------------------------------------
# the export


def byte_tokenizer_json() -> str:
    """data.ByteTokenizer as a Hugging Face tokenizer.json: a byte-level BPE without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's byte-level alphabet: the printable Latin-1 bytes stand for themselves, and the
    # other 68 move to U+0100 and on.
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    moved = iter(range(256, 324))
    chars = []
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(next(moved)))
    vocab = {c: b for b, c in enumerate(chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # "<|endoftext|>", id 256 as ByteTokenizer has it.
    tok.add_special_tokens([data.EOS_TOKENS[0]])
    return tok.to_str()


def _tokenizer_files(spec, run_dir):
    """{name: bytes} with which AutoTokenizer loads the export as the run's tokenizer."""
    # None for GPT-2, as the Hub's "gpt2" has tiktoken's ids, nor for an unknown tokenizer.
    name = (spec or {}).get("name")
    if name not in ("byte", "file"):
        return {}
    # This refuses a file that is missing or not the spec's, as sample.py does.
    data.load_tokenizer(spec, run_dir)
    if name == "byte":
        eos_token = data.EOS_TOKENS[0]
        blob = byte_tokenizer_json().encode()
    else:
        eos_token = spec.get("eos_token")
        blob = (Path(run_dir) / spec["file"]).read_bytes()
    # split_special_tokens: text that spells the EOS token stays text, as prepare.py
    # encodes it.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    config_blob = json.dumps(config, indent=2).encode()
    return {"tokenizer.json": blob, "tokenizer_config.json": config_blob}


def eval_command(out):
    """The eval.py command that scores the export in `out`, on any machine."""
    return (f"python eval.py {out} --tasks lambada_openai,hellaswag,piqa,arc_easy "
            "--out results.json")


def usage(out, marker):
    """(how to load it, the harness command, warnings) for the export in `out`."""
    name = (marker["tokenizer"] or {}).get("name")
    reset = marker["model_config"].get("reset_token")
    known = {"gpt2": "gpt2", "byte": str(out), "file": str(out)}
    tokenizer = known.get(name, "TOKENIZER")
    load = (f'MambaLMHeadModel.from_pretrained("{out}", device="cuda")  '
            '# mamba_ssm.models.mixer_seq_simple, CUDA only')
    command = ("lm_eval --model mamba_ssm "
               f"--model_args pretrained={out},tokenizer={tokenizer},dtype=float32 "
               "--tasks lambada_openai,hellaswag,piqa,arc_easy --device cuda --batch_size 16")
    notes = []
    if tokenizer == "TOKENIZER":
        notes.append("the run recorded no tokenizer: replace TOKENIZER by the Hugging Face "
                     "tokenizer that made its ids")
    if reset is not None:
        notes.append(f"this model resets its state after token {reset} (reset_token), but the "
                     "official model does not reset at EOS: give it one document per sequence")
    config = marker["model_config"]
    # A rotary dim of None is the whole head.
    rotary = bool(config.get("attn_layers")) and config.get("attn_rotary_dim") != 0
    if rotary:
        notes.append("its attention layers use rotary embedding, which the official MHA "
                     "takes from flash_attn: `pip install flash-attn` beside mamba-ssm")
    return load, command, notes


def _is_export_target(out):
    """Whether `out` may be written: absent, an empty directory, or an earlier export."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    empty = not any(out.iterdir())
    return empty or (out / MARKER).is_file()


def export(run_dir, out_dir, step=None) -> Path:
    """Write a run's checkpoint (default: the newest that verifies) to `out_dir`, new or an
    earlier export (replaced whole, a user's files kept), or refuse before writing anything."""
    run_dir = Path(run_dir)
    out = Path(out_dir)
    if not _is_export_target(out):
        raise CheckpointError(f"{out} exists and is not an earlier export (it has no "
                              f"{MARKER}); choose another OUT_DIR, or empty it yourself")
    # Everything is read and converted before anything is written, so a refusal changes
    # nothing on disk.
    model, meta, step = load_model(run_dir, step)
    where = f"{run_dir} step {step}"
    config = official_config(model.config, where)
    state = official_state_dict(model.state_dict(), model.config, where)
    spec = meta.get("tokenizer")
    # A tokenizer file of the run is written as the export's tokenizer.json.
    exported_spec = spec
    if (spec or {}).get("name") == "file":
        exported_spec = {**spec, "file": "tokenizer.json"}
    marker = {"format": "mamba3-lite official-format export", "version": 1,
              "source": str(run_dir), "step": step,
              "model_config": dataclasses.asdict(model.config), "tokenizer": exported_spec}
    load, command, notes = usage(out, marker)
    readme = ("# A Mamba-3 language model in the official mamba_ssm format\n\n"
              f"Exported by mamba3-lite from `{run_dir}` step {step}.\n\n"
              "Evaluate it on a CPU or a GPU without mamba_ssm, from a mamba3-lite "
              "checkout (`pip install -r requirements.txt`):\n\n"
              f"    {eval_command(out)}\n\n"
              f"Load it with the official code, which needs {MAMBA_SSM_NEEDS}:\n\n"
              f"    {load}\n\n"
              "With that mamba_ssm and `pip install lm-eval`, lm-evaluation-harness's "
              "own mamba_ssm model evaluates it too (CUDA only):\n\n"
              f"    {command}\n\n")
    for note in notes:
        readme += f"Note: {note}.\n"
    files = _tokenizer_files(spec, run_dir)
    files["config.json"] = json.dumps(config, indent=2).encode()
    files[MARKER] = json.dumps(marker, indent=2).encode()
    files["README.md"] = readme.encode()

    def fill(stage):
        torch.save(state, stage / "pytorch_model.bin")
        # safetensors asks for tied tensors as copies.
        untied = {**state, "lm_head.weight": state["lm_head.weight"].clone()}
        safetensors.torch.save_file(untied, stage / "model.safetensors",
                                    metadata={"format": "pt"})
        # safetensors' own mode is 0600, whatever the umask.
        (stage / "model.safetensors").chmod(ckpt.FILE_MODE)
        for name, blob in files.items():
            (stage / name).write_bytes(blob)
        # Every file is durable before the swap makes them the export.
        for p in stage.iterdir():
            data.fsync(p)

    try:
        data.replace_dir(out, fill, ours=lambda old: FILES)
    # A full disk, in the dialects of the three writers.
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        what = getattr(e, "filename", None) or out
        why = getattr(e, "strerror", None) or e
        raise CheckpointError(f"could not write {what} ({why}); free disk space or fix the "
                              f"permissions, then run again: {out} is unchanged") from None
    return out


# -----------------------------------------------------------------------------
# command line: python official.py export RUN_DIR OUT_DIR [--step N]


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="rich",
                  help="The official mamba_ssm format (export, read_pretrained, load_model).")


# A callback makes the app a group, so that the command line names `export`.
@app.callback()
def group():
    pass


# path_type=str hands each path over as typed, so that an empty one can be refused.
@app.command("export")
def export_main(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", path_type=str,
                                   help="A train.py --out-dir."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", path_type=str,
                                   help="Where to write; an earlier export is replaced, files "
                                   "you added to it are kept."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step (default: the "
                                       "newest that verifies)."),
):
    """Export a checkpoint to the official mamba_ssm format (config.json + pytorch_model.bin), which
    MambaLMHeadModel.from_pretrained and lm-evaluation-harness (--model mamba_ssm) load."""
    # ValueError: an empty path, data.DataError, another export under way.
    with data.cli_errors(CheckpointError, ValueError):
        data.refuse_empty_path("RUN_DIR", run_dir)
        data.refuse_empty_path("OUT_DIR", out_dir)
        run_dir = Path(run_dir)
        out = export(run_dir, out_dir, step)
    # The marker names the step exported, which by default was the newest that verified.
    marker = json.loads((out / MARKER).read_text())
    load, command, notes = usage(out, marker)
    names = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"exported {run_dir} step {marker['step']} to {out}: {names}\n"
          f"  load      {load}\n"
          f"  evaluate  {eval_command(out)}\n"
          f"  or        {command}\n"
          f"  (loading it and lm_eval --model mamba_ssm need {MAMBA_SSM_NEEDS})")
    for note in notes:
        typer.echo(f"warning: {note}", err=True)


if __name__ == "__main__":
    app()
