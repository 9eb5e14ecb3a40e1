"""The Mamba-3 language model (arXiv 2603.15569): config and presets, the mixer (SISO, or
MIMO of rank mimo_rank), pre-norm blocks, the tied LM head, recurrent decoding and a FLOPs
count. The math between in_proj and out_proj, and the scan, live in kernels.py.

A block is

    h = h + Mixer(RMSNorm(h))
    h = h + SwiGLU(RMSNorm(h))      SwiGLU(h) = down(silu(gate(h)) * up(h))

with the MLP omitted when mlp_hidden is 0; then a final RMSNorm and an LM head tied to the
embedding. The mixer is a bias-free in_proj to z | x | B | C | dd_dt | dd_A | trap | angle,
then kernels.mixer, then a bias-free out_proj. MIMO (mimo_rank R > 1) has R ranks of B and
C, lifts x and z per head to R inputs and gates (mimo_x, mimo_z) and sums the R outputs
(mimo_o): R times the scan's FLOPs on the same state. A hybrid's attn_layers have causal
attention as their mixer instead (Attention, the official MHA's layout). Decoding runs the
recurrence one token per step (and a KV cache in attention layers) and reproduces the
forward's logits.

    model = Mamba3LM(PRESETS["small"])
    logits, loss = model(idx, targets)           # idx, targets: (B, L) int64
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=50)
"""
import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import kernels


@dataclass
class ModelConfig:
    # The real vocabulary; the model pads it to a multiple of 64.
    vocab_size: int = 50257
    n_layer: int = 12
    d_model: int = 768
    # d_inner = expand * d_model.
    expand: int = 2
    # P, the channels of a head.
    headdim: int = 64
    # N, the state dimensions.
    d_state: int = 128
    # G: the heads of a group share B and C.
    ngroups: int = 1
    # The share of the state dimensions rotated by the data-dependent angles.
    rope_fraction: float = 0.5
    # R: 1 is SISO; R > 1 sums R rank-1 updates into the state per token (MIMO).
    mimo_rank: int = 1
    # The SwiGLU hidden size; 0 drops the MLP.
    mlp_hidden: int = 1536
    # The scan's chunk in rows: chunk_size // R tokens of R rows each. The official layer
    # counts tokens and advises 64 / R for MIMO: 64 rows either way.
    chunk_size: int = 64
    A_floor: float = 1e-4
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    norm_eps: float = 1e-5
    # The state resets after this token (a document's EOS); None: never.
    reset_token: Optional[int] = None
    # The layers whose mixer is attention, by index (a hybrid); empty: every layer is a
    # Mamba-3 one. The attention's shape follows; None derives it (see attn_shape).
    attn_layers: tuple = ()
    attn_heads: Optional[int] = None
    # Grouped-query attention: the query heads share this many key and value heads.
    attn_kv_heads: Optional[int] = None
    attn_head_dim: Optional[int] = None
    # The channels of each query and key head that rotary embedding turns (even).
    attn_rotary_dim: Optional[int] = None
    attn_rotary_base: float = 10000.0
    attn_qkv_bias: bool = False
    attn_out_bias: bool = False

    @property
    def d_inner(self):
        return self.expand * self.d_model

    @property
    def n_heads(self):
        """H."""
        return self.d_inner // self.headdim

    @property
    def n_angles(self):
        """S, the pairs of state dimensions that rotate."""
        return int(self.d_state * self.rope_fraction / 2)

    @property
    def chunk_tokens(self):
        """C, the tokens of a chunk."""
        return self.chunk_size // self.mimo_rank

    @property
    def attn_shape(self):
        """The attention's AttnShape. The head dim defaults to d_model / attn_heads when
        the heads are given, else to the Mamba headdim (64 in the GPU presets); the heads
        to d_model / head dim; the KV heads to the heads (no grouping); the rotary dims to
        the whole head."""
        head_dim = self.attn_head_dim
        if head_dim is None and self.attn_heads:
            head_dim = self.d_model // self.attn_heads
        if head_dim is None:
            head_dim = self.headdim
        heads = self.attn_heads
        if heads is None:
            heads = self.d_model // head_dim
        kv_heads = self.attn_kv_heads
        if kv_heads is None:
            kv_heads = heads
        rotary_dim = self.attn_rotary_dim
        if rotary_dim is None:
            rotary_dim = head_dim
        return AttnShape(heads, kv_heads, head_dim, rotary_dim)

    @property
    def padded_vocab(self):
        """The vocabulary rounded up to a multiple of 64."""
        return -(-self.vocab_size // 64) * 64

    def __post_init__(self):
        if self.d_inner % self.headdim or self.n_heads % self.ngroups:
            raise ValueError(f"d_inner = expand * d_model = {self.d_inner} must be a "
                             f"multiple of headdim {self.headdim}, and its heads of "
                             f"ngroups {self.ngroups}")
        if self.vocab_size < 1 or self.n_layer < 1:
            raise ValueError(f"vocab_size and n_layer must be positive, got "
                             f"{self.vocab_size} and {self.n_layer}")
        if self.mimo_rank < 1 or self.chunk_size % self.mimo_rank:
            raise ValueError(f"mimo_rank (--mimo-rank) must be at least 1 and divide "
                             f"chunk_size {self.chunk_size} (chunk_size // mimo_rank "
                             f"tokens of mimo_rank rows make a chunk), got "
                             f"{self.mimo_rank}")
        # A JSON config holds a list.
        self.attn_layers = tuple(self.attn_layers)
        if self.attn_layers:
            self.check_attention()

    def check_attention(self):
        """Refuse attention layers or an attention shape that cannot be built, naming the
        field and its train.py flag."""
        layers = list(self.attn_layers)
        for i in layers:
            if not isinstance(i, int) or not 0 <= i < self.n_layer:
                raise ValueError(f"attn_layers (--attn-layers) {layers}: {i!r} is not a "
                                 f"layer of this model; its {self.n_layer} layers are 0 to "
                                 f"{self.n_layer - 1}")
        if len(set(layers)) < len(layers):
            raise ValueError(f"attn_layers (--attn-layers) {layers} names a layer twice; "
                             "name each attention layer once")
        for name in ("attn_heads", "attn_kv_heads", "attn_head_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be at least 1, got {value}")
        shape = self.attn_shape
        # Without a head dim of its own, the heads split d_model evenly.
        if self.attn_head_dim is None and shape.heads * shape.head_dim != self.d_model:
            raise ValueError(f"attention heads of {shape.head_dim} channels (--attn-heads "
                             f"{shape.heads}) do not divide d_model {self.d_model}: choose "
                             "--attn-heads that divide it, or give --attn-head-dim")
        if shape.heads < 1 or shape.heads % shape.kv_heads:
            raise ValueError(f"attn_kv_heads (--attn-kv-heads) {shape.kv_heads} does not "
                             f"divide the {shape.heads} attention heads (--attn-heads): "
                             "each KV head serves an equal group of query heads")
        rotary = shape.rotary_dim
        if rotary < 0 or rotary % 2 or rotary > shape.head_dim:
            raise ValueError(f"attn_rotary_dim (--attn-rotary-dim) {rotary}: rotary "
                             "embedding turns pairs of channels, so it must be even, from "
                             f"0 to the head dim {shape.head_dim}")
        if not self.attn_rotary_base > 0:
            raise ValueError(f"attn_rotary_base (--attn-rotary-base) "
                             f"{self.attn_rotary_base}: expected a positive number")


class AttnShape(NamedTuple):
    """The attention's heads, KV heads, channels per head, and rotated channels per head."""
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int


# The paper's size classes (expand 2, N 128, P 64) plus two CPU-sized ones. vocab_size is
# GPT-2's here; train.py sets it from the data. The peak learning rates of the recipe live
# in train.py.
PRESETS = {
    "tiny": ModelConfig(n_layer=2, d_model=64, headdim=16, d_state=16, mlp_hidden=128,
                        chunk_size=16),
    "small": ModelConfig(n_layer=4, d_model=256, d_state=32, mlp_hidden=512),
    "180m": ModelConfig(n_layer=12, d_model=768, mlp_hidden=1536),
    "440m": ModelConfig(n_layer=24, d_model=1024, mlp_hidden=2048),
    "880m": ModelConfig(n_layer=24, d_model=1536, mlp_hidden=3072),
    "1.5b": ModelConfig(n_layer=24, d_model=2048, mlp_hidden=4096),
}

# Dense bf16 peak FLOP/s by GPU name: MFU = flops_per_token x tokens/s / peak.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
}


def peak_flops(device_name):
    """The peak of the first table entry in a GPU's name (torch.cuda.get_device_name()),
    or None."""
    for name, flops in PEAK_FLOPS.items():
        if name in device_name:
            return flops
    return None


def pick_device(flag):
    """--device auto|cpu|cuda -> "cpu" or "cuda" (a ValueError for cuda without one)."""
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if flag == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device; use "
                         "--device cpu (or auto)")
    return flag


def bf16_native(device):
    """Whether bf16 autocast pays off on "cuda" or "cpu": bf16 matmuls run at several times
    the float32 rate on GPUs and on CPUs with bf16 instructions (AVX512-BF16, AMX)."""
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    # oneDNN says whether it has bf16 kernels for this CPU.
    with contextlib.suppress(AttributeError, RuntimeError):
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return False


# The names of a layer's decoding state, in the order kernels.mixer takes and returns them.
CACHE_KEYS = ("phi", "S", "k_prev", "x_prev")


class Mamba3Mixer(nn.Module):
    """One Mamba-3 layer: in_proj, the region (data-dependent dt / A / trapezoid / rotary
    angles, the scan, the D skip and the silu(z) gate: kernels.mixer) and out_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.n_heads
        P = cfg.headdim
        N = cfg.d_state
        R = cfg.mimo_rank
        # in_proj's output: z | x | B | C | dd_dt | dd_A | trap | angle, B and C with R
        # ranks each.
        self.split = kernels.split_sizes(H, P, cfg.ngroups, N, cfg.n_angles, R)
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split), bias=False)

        # dt_bias = softplus^-1(dt0), with dt0 log-uniform in [dt_min, dt_max]: the heads
        # start with timescales spread across that range.
        low = math.log(cfg.dt_min)
        high = math.log(cfg.dt_max)
        dt0 = torch.exp(torch.empty(H).uniform_(low, high))  # (H,)
        dt0 = dt0.clamp(min=cfg.dt_init_floor)
        self.dt_bias = nn.Parameter(dt0 + torch.log(-torch.expm1(-dt0)))
        self.B_norm_weight = nn.Parameter(torch.ones(N))
        self.C_norm_weight = nn.Parameter(torch.ones(N))

        # The B and C biases are per head and rank: (H, N) for SISO, the official (H, 1, N)
        # squeezed, and (H, R, N) for MIMO. Ones, as in the paper's ablations.
        bias_shape = (H, N) if R == 1 else (H, R, N)
        self.B_bias = nn.Parameter(torch.ones(bias_shape))
        self.C_bias = nn.Parameter(torch.ones(bias_shape))

        # MIMO lifts x and z per head and channel to R inputs and gates, and sums the R
        # outputs back. The official init makes the layer start as the mean of R copies of
        # a SISO one.
        if R > 1:
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1 / R))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1 / R))
        self.D = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=False)

    def forward(self, u, cache=None, impl="auto", reset=None):
        """u (B, L, d_model) -> (B, L, d_model), from and to the state in `cache` (this
        layer's of init_cache) if given; reset (B, L) bool: where a document starts."""
        return self.out_proj(self.region(self.in_proj(u), cache, impl, reset))

    def region(self, zxbcdt, cache=None, impl="auto", reset=None):
        """in_proj's output -> out_proj's input (B, L, d_inner), in zxbcdt's dtype."""
        cfg = self.cfg
        state = None
        if cache is not None:
            state = tuple(cache[k] for k in CACHE_KEYS)
        mimo = None
        if cfg.mimo_rank > 1:
            mimo = (self.mimo_x, self.mimo_z, self.mimo_o)
        out, state = kernels.mixer(
            zxbcdt, self.dt_bias, self.B_norm_weight, self.C_norm_weight, self.B_bias,
            self.C_bias, self.D, headdim=cfg.headdim, ngroups=cfg.ngroups,
            n_angles=cfg.n_angles, chunk_size=cfg.chunk_tokens, A_floor=cfg.A_floor,
            eps=cfg.norm_eps, reset=reset, state=state, impl=impl, mimo=mimo)
        # The cache moves forward in place, so that the caller's object holds the new
        # state.
        if cache is not None:
            for name, value in zip(CACHE_KEYS, state):
                cache[name].copy_(value)
        return out


# -----------------------------------------------------------------------------
# Attention, the mixer of a hybrid's attention layers.


def rotary(x, positions, rotary_dim, base):
    """x (B, L, heads, d) with its first rotary_dim channels turned by rotary embedding,
    the NeoX half split: channel i < r/2 pairs with channel i + r/2, and the pair turns by
    the angle position * base^(-2i/r), r = rotary_dim. positions (B, L) int64."""
    if rotary_dim == 0:
        return x
    half = rotary_dim // 2
    # float32 angles (float64 for a float64 model), as the official cos/sin tables are.
    fdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    exponents = torch.arange(0, rotary_dim, 2, dtype=fdt, device=x.device) / rotary_dim
    inv_freq = 1.0 / base ** exponents  # (r/2,)
    angles = positions.to(fdt)[..., None] * inv_freq  # (B, L, r/2)
    # One angle per token, shared by the heads.
    cos = angles.cos()[:, :, None]  # (B, L, 1, r/2)
    sin = angles.sin()[:, :, None]
    x1 = x[..., :half].to(fdt)
    x2 = x[..., half:rotary_dim].to(fdt)
    turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([turned.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def documents(reset, length, device):
    """reset (B, L) bool or None -> (positions, segments): each token's position in its
    document (B, L) or (1, L) int64, and which document of the window it is in (B, L), 0
    for the first (None without resets)."""
    i = torch.arange(length, device=device)
    if reset is None:
        return i[None], None
    # The index where each token's document starts: the latest reset at or before it.
    starts = torch.where(reset, i, 0).cummax(dim=1).values  # (B, L)
    return i - starts, reset.long().cumsum(dim=1)


class Attention(nn.Module):
    """Causal softmax attention laid out as the official MHA (mamba_ssm/modules/mha.py):
    one in_proj whose rows are [Q | K | V] (heads x head_dim rows of queries, then
    kv_heads x head_dim of keys and of values), rotary embedding of q and k, and out_proj.

        attn(q, k, v)_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(head_dim)) v_j

    over the tokens j of token i's document. Query head h reads KV head h // (heads /
    kv_heads). With a cache it attends to the cached keys of each row's document too, and
    keeps the keys and values of the document it ends in."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.shape = cfg.attn_shape
        self.base = cfg.attn_rotary_base
        q_dim = self.shape.heads * self.shape.head_dim
        kv_dim = self.shape.kv_heads * self.shape.head_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split), bias=cfg.attn_qkv_bias)
        self.out_proj = nn.Linear(q_dim, cfg.d_model, bias=cfg.attn_out_bias)

    def forward(self, u, cache=None, impl="auto", reset=None):
        """u (B, L, d_model) -> (B, L, d_model); reset (B, L) bool: where a document
        starts; cache: this layer's of init_cache, which moves on in place. (impl is the
        Mamba layers' and means nothing here.)"""
        B, L, _ = u.shape
        shape = self.shape
        q, k, v = self.in_proj(u).split(self.split, dim=-1)
        q = q.unflatten(-1, (shape.heads, shape.head_dim))  # (B, L, heads, d)
        k = k.unflatten(-1, (shape.kv_heads, shape.head_dim))  # (B, L, kv_heads, d)
        v = v.unflatten(-1, (shape.kv_heads, shape.head_dim))
        positions, segments = documents(reset, L, u.device)
        if cache is not None:
            # The first document of the window goes on from the cached one.
            continued = cache["n"][:, None] + torch.arange(L, device=u.device)
            if segments is None:
                positions = continued
            else:
                positions = torch.where(segments == 0, continued, positions)
        q = rotary(q, positions.expand(B, L), shape.rotary_dim, self.base)
        k = rotary(k, positions.expand(B, L), shape.rotary_dim, self.base)
        # (B, heads, L, d) from here on, as scaled_dot_product_attention takes them.
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is None:
            out = self.attend(q, k, v, causal_mask(segments))
        else:
            out = self.attend_cached(q, k, v, positions, segments, cache)
        out = out.transpose(1, 2).flatten(2)  # (B, L, heads * d)
        return self.out_proj(out)

    def attend(self, q, k, v, mask):
        """softmax(q k^T / sqrt(d)) v, causal where mask is None, else where mask (B, 1,
        L, S) is True. k and v are repeated from kv_heads to heads first."""
        group = self.shape.heads // self.shape.kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def attend_cached(self, q, k, v, positions, segments, cache):
        """attend() over the cache's keys and then the window's, and the cache moved on.

        The cache holds, per row, the keys and values of its current document only: slot
        p is the token at position p, and n (B,) counts them (a row cleared to n = 0
        starts a new document). The window's first document sees the n cached tokens;
        a later one (after a reset) sees none."""
        B, _, L, _ = q.shape
        n = cache["n"]
        # The longest cached document: the slots past it are empty in every row.
        used = int(n.max())
        past_k = cache["k"][:, :, :used]
        past_v = cache["v"][:, :, :used]
        if segments is None:
            segments = torch.zeros(B, L, dtype=torch.long, device=q.device)
        first = segments == 0  # (B, L)
        slots = torch.arange(used, device=q.device)
        sees_past = (slots < n[:, None])[:, None, :] & first[:, :, None]  # (B, L, used)
        mask = torch.cat([sees_past, causal_mask(segments)[:, 0]], dim=-1)
        out = self.attend(q, torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2),
                          mask[:, None])

        # Each row keeps the tokens of the document its window ends in, at their
        # positions.
        keep = segments == segments[:, -1:]  # (B, L)
        length = positions[:, -1] + 1  # (B,)
        need = int(length.max())
        room = cache["k"].shape[2]
        if need > room:
            # Grown by at least double, so that decoding token by token copies the cache
            # only log(length) times.
            grow = max(need, 2 * room) - room
            cache["k"] = F.pad(cache["k"], (0, 0, 0, grow))
            cache["v"] = F.pad(cache["v"], (0, 0, 0, grow))
        rows, tokens = keep.nonzero(as_tuple=True)
        at = positions[rows, tokens]
        cache["k"][rows, :, at] = k[rows, :, tokens].to(cache["k"].dtype)
        cache["v"][rows, :, at] = v[rows, :, tokens].to(cache["v"].dtype)
        cache["n"].copy_(length)
        return out


def causal_mask(segments):
    """(B, 1, L, L) bool: token i sees token j <= i of its own document (segments (B, L),
    as documents() gives them), a block-diagonal causal mask; None without segments, for
    plain causal attention."""
    if segments is None:
        return None
    L = segments.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]  # (B, L, L)
    return (same & causal)[:, None]


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Block(nn.Module):
    """A pre-norm block, its mixer Mamba-3 or (attention=True) attention."""

    def __init__(self, cfg: ModelConfig, attention=False):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, cfg.norm_eps)
        if attention:
            self.mixer = Attention(cfg)
        else:
            self.mixer = Mamba3Mixer(cfg)
        self.norm2 = None
        self.mlp = None
        if cfg.mlp_hidden:
            self.norm2 = nn.RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp = SwiGLU(cfg)

    def forward(self, h, cache=None, impl="auto", reset=None):
        h = h + self.mixer(self.norm1(h), cache, impl, reset)
        if self.mlp is not None:
            h = h + self.mlp(self.norm2(h))
        return h


def sample_next(logits, temperature=1.0, top_k=None, generator=None):
    """logits (B, V) -> (B,) int64: greedy at temperature 0, else sampled among the
    top_k."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class Mamba3LM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Recompute each block in backward: less memory, about a third more compute.
        self.grad_checkpointing = False
        self.embed = nn.Embedding(config.padded_vocab, config.d_model)
        blocks = []
        for i in range(config.n_layer):
            blocks.append(Block(config, attention=i in config.attn_layers))
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = nn.RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab, bias=False)
        # Tied: one tensor, two uses.
        self.lm_head.weight = self.embed.weight

        # The embedding starts N(0, 0.02); the Linear layers keep PyTorch's default. The
        # two projections that write into the residual stream are scaled by
        # 1/sqrt(2 n_layer), so that the stream's variance does not grow with depth (two
        # writes per block).
        nn.init.normal_(self.embed.weight, std=0.02)
        scale = 1 / math.sqrt(2 * config.n_layer)
        with torch.no_grad():
            for block in self.blocks:
                block.mixer.out_proj.weight.mul_(scale)
                if block.mlp is not None:
                    block.mlp.down.weight.mul_(scale)

    def num_params(self):
        """Parameters, the tied embedding / LM head once (padded vocabulary rows
        included)."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay):
        """The parameters by role, as optimizer groups: [matrices, the rest]. The weight
        matrices of the Linear and Embedding layers decay. The rest do not: the official
        layer exempts dt_bias and D by name, and the norm weights, B/C biases and mimo
        vectors are per-channel scales, which decay would pull toward 0."""
        matrices = {}
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                matrices[id(module.weight)] = module.weight
        rest = [p for p in self.parameters() if id(p) not in matrices]
        return [{"params": list(matrices.values()), "weight_decay": weight_decay},
                {"params": rest, "weight_decay": 0.0}]

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward = 3x forward): 6 per weight of
        every matmul (the LM head included, the embedding lookup not), plus, in each Mamba
        layer, the scan's matmuls per chunk of C tokens, C*R rows at MIMO rank R: Q K^T and
        M X (2CR^2(N+P) per token and head) and the state in and out (4RPN); and in each
        attention layer the scores q.k and the weighted values, 2 x 2 x L x d per token
        (d = heads x head_dim, L = seq_len) halved for causality: 2Ld."""
        cfg = self.config
        matmul_params = 0
        for module in self.modules():
            if isinstance(module, nn.Linear):
                matmul_params += module.weight.numel()
        C = min(cfg.chunk_tokens, seq_len)
        R = cfg.mimo_rank
        P = cfg.headdim
        N = cfg.d_state
        per_head = 2 * C * R * R * (N + P) + 4 * R * P * N
        n_attn = len(cfg.attn_layers)
        scan = (cfg.n_layer - n_attn) * cfg.n_heads * per_head
        shape = cfg.attn_shape
        d = shape.heads * shape.head_dim
        attention = n_attn * 2 * seq_len * d
        return 6 * matmul_params + 3 * (scan + attention)

    def resets(self, idx):
        """(B, L) bool: True after each reset_token (None without one). Position 0 is never
        marked: a cached call after a reset_token starts from a cleared cache (prefill
        clears it)."""
        if self.config.reset_token is None:
            return None
        return F.pad(idx[:, :-1] == self.config.reset_token, (1, 0))

    def hidden(self, idx, cache=None, impl="auto"):
        """idx (B, L) -> final-normed hidden states (B, L, d_model)."""
        h = self.embed(idx)  # (B, L, d_model)
        reset = self.resets(idx)
        caches = cache or [None] * len(self.blocks)
        recompute = self.grad_checkpointing and torch.is_grad_enabled() and cache is None
        for block, layer_cache in zip(self.blocks, caches):
            if recompute:
                h = checkpoint(block, h, None, impl, reset, use_reentrant=False)
            else:
                h = block(h, layer_cache, impl, reset)
        return self.norm_f(h)

    def logits(self, h):
        # The padded rows are never predicted.
        return self.lm_head(h)[..., : self.config.vocab_size]

    def forward(self, idx, targets=None):
        """idx (B, L) int64 -> (logits (B, L, vocab_size), loss or None). Targets equal
        to -1 are ignored."""
        logits = self.logits(self.hidden(idx))
        loss = None
        if targets is not None:
            flat = logits.float().flatten(0, 1)  # (B * L, vocab_size)
            loss = F.cross_entropy(flat, targets.flatten(), ignore_index=-1)
        return logits, loss

    # Recurrent decoding.

    def init_cache(self, batch_size, max_len=0):
        """Per Mamba layer: phases Phi (B, H, S), state S (B, H, P, N), and the last token's
        k (B, H, N), or its R k's (B, H, R, N) at MIMO rank R, and its x (B, H, P) (its R
        inputs are lifted from it again). Phi and S are float32 (float64 for a float64
        model). Per attention layer: the keys k and values v of each row's current
        document (B, kv_heads, T, head_dim), slot p the token at position p, and n (B,)
        int64 their count; T starts at max_len (room the caller expects to use) and grows
        when a document outgrows it. Zeroing a row of every tensor (as prefill does after a
        reset_token) starts a new document there."""
        cfg = self.config
        p = self.embed.weight
        fdt = torch.float64 if p.dtype == torch.float64 else torch.float32
        B = batch_size
        H = cfg.n_heads
        P = cfg.headdim
        N = cfg.d_state
        S = cfg.n_angles
        k_shape = (B, H, N) if cfg.mimo_rank == 1 else (B, H, cfg.mimo_rank, N)
        shape = cfg.attn_shape
        kv_shape = (B, shape.kv_heads, max_len, shape.head_dim)
        caches = []
        for i in range(cfg.n_layer):
            if i in cfg.attn_layers:
                caches.append(dict(
                    k=p.new_zeros(kv_shape),
                    v=p.new_zeros(kv_shape),
                    n=torch.zeros(B, dtype=torch.long, device=p.device),
                ))
                continue
            caches.append(dict(
                phi=p.new_zeros(B, H, S, dtype=fdt),
                S=p.new_zeros(B, H, P, N, dtype=fdt),
                k_prev=p.new_zeros(k_shape),
                x_prev=p.new_zeros(B, H, P),
            ))
        return caches

    @torch.no_grad()
    def prefill(self, idx, cache, impl="auto"):
        """idx (B, L) through the chunked scan (or impl) from the cache's state, which
        moves on in place -> the last logits (B, vocab_size)."""
        logits = self.logits(self.hidden(idx, cache, impl)[:, -1])
        # A sequence whose last consumed token is reset_token goes on as a fresh document.
        if self.config.reset_token is not None:
            done = idx[:, -1] == self.config.reset_token  # (B,)
            for layer in cache:
                for t in layer.values():
                    # done viewed as (B, 1, ...), to broadcast over t's other dims.
                    mask = done.view(-1, *(1,) * (t.dim() - 1))
                    t.masked_fill_(mask, 0)
        return logits

    def step(self, tokens, cache):
        """tokens (B,) -> logits (B, vocab_size) by one O(1) step of the recurrence (and
        O(context) in attention layers), in place."""
        return self.prefill(tokens[:, None], cache, impl="recurrent")

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Yield (B,) tokens: prefill idx (B, L), then decode one by one (temperature 0:
        greedy)."""
        # The attention layers' room for the prompt and every new token, allocated once.
        cache = self.init_cache(idx.shape[0], idx.shape[1] + max_new_tokens)
        logits = self.prefill(idx, cache)
        for i in range(max_new_tokens):
            token = sample_next(logits, temperature, top_k, generator)
            yield token
            if i + 1 < max_new_tokens:
                logits = self.step(token, cache)

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """idx (B, L) -> (B, L + max_new_tokens)."""
        new = list(self.stream(idx, max_new_tokens, temperature, top_k, generator))
        columns = [t[:, None] for t in new]  # each (B, 1)
        return torch.cat([idx] + columns, dim=1)


# A training step's memory, measured on a CPU (peak RSS, float32). Per token: 213-243 bytes
# per d_model and layer (321 for tiny), or 28-32 under gradient checkpointing plus one
# block's whole; and 11 per vocabulary row (logits, softmax, gradients). The optimizer's
# bytes per parameter are train.py's PARAM_BYTES.
ACT_BYTES = 256
RECOMPUTED_BYTES = 32
LOGIT_BYTES = 12
# An attention layer counts as a Mamba layer (its projections and their inputs are
# smaller), plus the float32 scores and softmax weights that PyTorch's plain attention
# keeps for backward: this many bytes per token, head and key. The Flash and
# memory-efficient kernels keep none, and neither did torch 2.13's CPU kernel when
# measured (autograd's saved tensors of `small` with one attention layer of four, at 128
# and 512 tokens: the attention layer kept 22-24 KB a token against a Mamba layer's
# 44 KB), so this is an upper bound that holds whichever kernel runs.
SCORE_BYTES = 8


def activation_bytes(config, tokens, recompute=False, seq_len=None):
    """About how many bytes the activations of a training micro-batch of `tokens` tokens
    take (recompute: under gradient checkpointing, which keeps one block's whole), in
    windows of seq_len tokens (for the attention scores; None counts none)."""
    n = config.n_layer
    # Bytes per d_model and token, over all layers.
    if recompute:
        layers = ACT_BYTES + RECOMPUTED_BYTES * n
    else:
        layers = ACT_BYTES * n
    total = tokens * (LOGIT_BYTES * config.padded_vocab + config.d_model * layers)
    n_attn = len(config.attn_layers)
    if seq_len and n_attn:
        # Recomputed, one attention layer's scores live at a time.
        if recompute:
            n_attn = 1
        heads = config.attn_shape.heads
        total += tokens * n_attn * heads * seq_len * SCORE_BYTES
    return total
