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
(mimo_o): R times the scan's FLOPs on the same state. Decoding runs the recurrence one
token per step and reproduces the forward's logits.

    model = Mamba3LM(PRESETS["small"])
    logits, loss = model(idx, targets)           # idx, targets: (B, L) int64
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=50)
"""
import contextlib
import math
from dataclasses import dataclass
from typing import Optional

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


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model, cfg.norm_eps)
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
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
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
        every matmul (the LM head included, the embedding lookup not), plus the scan's
        matmuls per chunk of C tokens, C*R rows at MIMO rank R: Q K^T and M X (2CR^2(N+P)
        per token and head) and the state in and out (4RPN)."""
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
        scan = cfg.n_layer * cfg.n_heads * per_head
        return 6 * matmul_params + 3 * scan

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

    def init_cache(self, batch_size):
        """Per layer: phases Phi (B, H, S), state S (B, H, P, N), and the last token's k
        (B, H, N), or its R k's (B, H, R, N) at MIMO rank R, and its x (B, H, P) (its R
        inputs are lifted from it again). Phi and S are float32 (float64 for a float64
        model)."""
        cfg = self.config
        p = self.embed.weight
        fdt = torch.float64 if p.dtype == torch.float64 else torch.float32
        B = batch_size
        H = cfg.n_heads
        P = cfg.headdim
        N = cfg.d_state
        S = cfg.n_angles
        k_shape = (B, H, N) if cfg.mimo_rank == 1 else (B, H, cfg.mimo_rank, N)
        caches = []
        for _ in range(cfg.n_layer):
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
        """tokens (B,) -> logits (B, vocab_size) by one O(1) step of the recurrence, in
        place."""
        return self.prefill(tokens[:, None], cache, impl="recurrent")

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Yield (B,) tokens: prefill idx (B, L), then decode one by one (temperature 0:
        greedy)."""
        cache = self.init_cache(idx.shape[0])
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


def activation_bytes(config, tokens, recompute=False):
    """About how many bytes the activations of a training micro-batch of `tokens` tokens
    take (recompute: under gradient checkpointing, which keeps one block's whole)."""
    n = config.n_layer
    # Bytes per d_model and token, over all layers.
    if recompute:
        layers = ACT_BYTES + RECOMPUTED_BYTES * n
    else:
        layers = ACT_BYTES * n
    return tokens * (LOGIT_BYTES * config.padded_vocab + config.d_model * layers)
