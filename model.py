"""The Mamba-3 language model (arXiv 2603.15569): config and presets, the mixer (SISO, or MIMO of
rank mimo_rank), pre-norm blocks, the tied LM head, recurrent decoding and a FLOPs count. The math
between in_proj and out_proj, and the scan, live in kernels.py.

A block is h = h + Mixer(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h)) (SwiGLU: down(silu(gate(h)) *
up(h)), omitted when mlp_hidden is 0), then a final RMSNorm and an LM head tied to the embedding.
The mixer is a bias-free in_proj to z | x | B | C | dd_dt | dd_A | trap | angle, kernels.mixer and
a bias-free out_proj. MIMO (mimo_rank R > 1) has R ranks of B and C, lifts x and z per head to R
inputs and gates (mimo_x, mimo_z) and sums the R outputs (mimo_o): R times the scan's FLOPs on the
same state. Decoding runs the recurrence one token per step and reproduces the forward's logits.

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
    vocab_size: int = 50257  # the real vocabulary; padded to a multiple of 64 inside the model
    n_layer: int = 12
    d_model: int = 768
    expand: int = 2  # d_inner = expand * d_model
    headdim: int = 64  # P
    d_state: int = 128  # N
    ngroups: int = 1  # G: B and C are shared by the heads of a group
    rope_fraction: float = 0.5  # the share of state dims rotated by the data-dependent angles
    mimo_rank: int = 1  # R: 1 is SISO; R > 1 sums R rank-1 updates into the state per token (MIMO)
    mlp_hidden: int = 1536  # SwiGLU hidden size; 0 drops the MLP
    # the scan's chunk in rows: chunk_size // R tokens of R rows each (the official layer counts
    # tokens and advises 64 / R for MIMO: 64 rows either way)
    chunk_size: int = 64
    A_floor: float = 1e-4
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    norm_eps: float = 1e-5
    # the state resets after this token (a document's EOS); None: never
    reset_token: Optional[int] = None

    d_inner = property(lambda self: self.expand * self.d_model)
    n_heads = property(lambda self: self.d_inner // self.headdim)  # H
    n_angles = property(lambda self: int(self.d_state * self.rope_fraction / 2))  # S: rotated pairs
    chunk_tokens = property(lambda self: self.chunk_size // self.mimo_rank)  # C: tokens per chunk
    padded_vocab = property(lambda self: -(-self.vocab_size // 64) * 64)

    def __post_init__(self):
        if self.d_inner % self.headdim or self.n_heads % self.ngroups:
            raise ValueError(f"d_inner = expand * d_model = {self.d_inner} must be a multiple of "
                             f"headdim {self.headdim}, and its heads of ngroups {self.ngroups}")
        if self.vocab_size < 1 or self.n_layer < 1:
            raise ValueError(f"vocab_size and n_layer must be positive, got {self.vocab_size} and "
                             f"{self.n_layer}")
        if self.mimo_rank < 1 or self.chunk_size % self.mimo_rank:
            raise ValueError(f"mimo_rank (--mimo-rank) must be at least 1 and divide chunk_size "
                             f"{self.chunk_size} (chunk_size // mimo_rank tokens of mimo_rank rows "
                             f"make a chunk), got {self.mimo_rank}")


# The paper's size classes (expand 2, N 128, P 64) plus two CPU-sized ones. vocab_size is GPT-2's
# here; train.py sets it from the data. Peak learning rates for the recipe live in train.py.
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
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
              "L40S": 362e12, "L4": 121e12, "A10G": 125e12, "A10": 125e12, "RTX 4090": 165e12,
              "RTX 3090": 71e12, "V100": 125e12}


def peak_flops(device_name):
    """The peak of the first table entry in a GPU's name (torch.cuda.get_device_name()), or None."""
    return next((flops for name, flops in PEAK_FLOPS.items() if name in device_name), None)


def pick_device(flag):
    """--device auto|cpu|cuda -> "cpu" or "cuda" (a ValueError for cuda without one)."""
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if flag == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device; use --device "
                         "cpu (or auto)")
    return flag


def bf16_native(device):
    """Whether bf16 autocast pays off on "cuda" or "cpu": bf16 matmuls run at several times the
    float32 rate on GPUs and on CPUs with bf16 instructions (AVX512-BF16, AMX)."""
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    with contextlib.suppress(AttributeError, RuntimeError):
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN has bf16 kernels for this CPU
    return False


class Mamba3Mixer(nn.Module):
    """One Mamba-3 layer: in_proj, the region (data-dependent dt / A / trapezoid / rotary angles,
    the scan, the D skip and the silu(z) gate: kernels.mixer) and out_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, P, N, R = cfg.n_heads, cfg.headdim, cfg.d_state, cfg.mimo_rank
        # z | x | B | C | dd_dt | dd_A | trap | angle, B and C with R ranks each
        self.split = kernels.split_sizes(H, P, cfg.ngroups, N, cfg.n_angles, R)
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split), bias=False)
        # dt_bias = softplus^-1(dt0), dt0 log-uniform in [dt_min, dt_max]: timescales across heads
        dt0 = torch.exp(torch.empty(H).uniform_(math.log(cfg.dt_min), math.log(cfg.dt_max)))
        dt0 = dt0.clamp(min=cfg.dt_init_floor)
        self.dt_bias = nn.Parameter(dt0 + torch.log(-torch.expm1(-dt0)))
        self.B_norm_weight = nn.Parameter(torch.ones(N))
        self.C_norm_weight = nn.Parameter(torch.ones(N))
        # per head and rank (SISO: the official (H, 1, N) squeezed); ones, as the paper's ablations
        self.B_bias = nn.Parameter(torch.ones((H, N) if R == 1 else (H, R, N)))
        self.C_bias = nn.Parameter(torch.ones((H, N) if R == 1 else (H, R, N)))
        if R > 1:  # per head and channel: x and z lifted to R inputs and gates, the R outputs
            # summed back; the official init: the layer starts as the mean of R copies of a SISO one
            self.mimo_x = nn.Parameter(torch.full((H, R, P), 1 / R))
            self.mimo_z = nn.Parameter(torch.ones(H, R, P))
            self.mimo_o = nn.Parameter(torch.full((H, R, P), 1 / R))
        self.D = nn.Parameter(torch.ones(H))
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=False)

    def forward(self, u, cache=None, impl="auto", reset=None):
        """u (B, L, d_model) -> (B, L, d_model), from and to the state in `cache` (this layer's of
        init_cache) if given; reset (B, L) bool: where a document starts."""
        return self.out_proj(self.region(self.in_proj(u), cache, impl, reset))

    def region(self, zxbcdt, cache=None, impl="auto", reset=None):
        """in_proj's output -> out_proj's input (B, L, d_inner), in zxbcdt's dtype."""
        cfg = self.cfg
        state = None if cache is None else tuple(cache[k] for k in ("phi", "S", "k_prev", "x_prev"))
        mimo = (self.mimo_x, self.mimo_z, self.mimo_o) if cfg.mimo_rank > 1 else None
        out, state = kernels.mixer(zxbcdt, self.dt_bias, self.B_norm_weight, self.C_norm_weight,
                                   self.B_bias, self.C_bias, self.D, headdim=cfg.headdim,
                                   ngroups=cfg.ngroups, n_angles=cfg.n_angles,
                                   chunk_size=cfg.chunk_tokens, A_floor=cfg.A_floor,
                                   eps=cfg.norm_eps, reset=reset, state=state, impl=impl,
                                   mimo=mimo)
        if cache is not None:  # in place, so the caller's cache object moves forward
            for name, value in zip(("phi", "S", "k_prev", "x_prev"), state):
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
        self.norm2 = nn.RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.mlp_hidden else None
        self.mlp = SwiGLU(cfg) if cfg.mlp_hidden else None

    def forward(self, h, cache=None, impl="auto", reset=None):
        h = h + self.mixer(self.norm1(h), cache, impl, reset)
        if self.mlp is not None:
            h = h + self.mlp(self.norm2(h))
        return h


class Mamba3LM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.grad_checkpointing = False  # recompute each block in backward: less memory, ~1/3 more
        self.embed = nn.Embedding(config.padded_vocab, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = nn.RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one tensor, two uses
        # init: embedding N(0, 0.02); Linear layers keep PyTorch's default, and the two
        # projections that write into the residual stream are scaled by 1/sqrt(2 n_layer) so the
        # stream's variance does not grow with depth (two residual writes per block)
        nn.init.normal_(self.embed.weight, std=0.02)
        with torch.no_grad():
            for b in self.blocks:
                for proj in [b.mixer.out_proj] + ([b.mlp.down] if b.mlp is not None else []):
                    proj.weight.mul_(1 / math.sqrt(2 * config.n_layer))

    def num_params(self):
        """Parameters, the tied embedding / LM head once (padded vocabulary rows included)."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay):
        """AdamW groups: decay on the weight matrices of Linear and Embedding layers only. (The
        official layer exempts dt_bias and D by name; the norm weights, B/C biases and the mimo
        vectors are per-channel scales, which decay would pull toward 0.)"""
        matrices = (nn.Linear, nn.Embedding)
        decay = {id(m.weight): m.weight for m in self.modules() if isinstance(m, matrices)}
        no_decay = [p for p in self.parameters() if id(p) not in decay]
        return [{"params": list(decay.values()), "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward = 3x forward): 6 per weight of every matmul
        (the LM head included, the embedding lookup not), plus the scan's matmuls per chunk of C
        tokens, C*R rows at MIMO rank R: Q K^T and M X (2CR^2(N+P) per token and head) and the
        state in and out (4RPN)."""
        cfg = self.config
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        C, R, P, N = min(cfg.chunk_tokens, seq_len), cfg.mimo_rank, cfg.headdim, cfg.d_state
        scan = cfg.n_layer * cfg.n_heads * (2 * C * R * R * (N + P) + 4 * R * P * N)
        return 6 * matmul_params + 3 * scan

    def resets(self, idx):
        """(B, L) bool: True after each reset_token (None without one). Position 0 is never marked:
        a cached call after a reset_token starts from a cleared cache (prefill clears it)."""
        if self.config.reset_token is None:
            return None
        return F.pad(idx[:, :-1] == self.config.reset_token, (1, 0))

    def hidden(self, idx, cache=None, impl="auto"):
        """idx (B, L) -> final-normed hidden states (B, L, d_model)."""
        h = self.embed(idx)
        reset = self.resets(idx)
        for block, layer_cache in zip(self.blocks, cache or [None] * len(self.blocks)):
            if self.grad_checkpointing and torch.is_grad_enabled() and cache is None:
                h = checkpoint(block, h, None, impl, reset, use_reentrant=False)
            else:
                h = block(h, layer_cache, impl, reset)
        return self.norm_f(h)

    def logits(self, h):
        return self.lm_head(h)[..., : self.config.vocab_size]  # padded rows are never predicted

    def forward(self, idx, targets=None):
        """idx (B, L) int64 -> (logits (B, L, vocab_size), loss or None). Targets equal to -1 are
        ignored."""
        logits = self.logits(self.hidden(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    # --- recurrent decoding ---

    def init_cache(self, batch_size):
        """Per layer: phases Phi (B, H, S), state S (B, H, P, N), and the last token's k (B, H, N),
        or its R k's (B, H, R, N) at MIMO rank R, and its x (B, H, P) (its R inputs are lifted from
        it again). Phi and S are float32 (float64 for a float64 model)."""
        cfg, p = self.config, self.embed.weight
        fdt = torch.float64 if p.dtype == torch.float64 else torch.float32
        B, H, P, N, S = batch_size, cfg.n_heads, cfg.headdim, cfg.d_state, cfg.n_angles
        k = (B, H, N) if cfg.mimo_rank == 1 else (B, H, cfg.mimo_rank, N)
        return [dict(phi=p.new_zeros(B, H, S, dtype=fdt), S=p.new_zeros(B, H, P, N, dtype=fdt),
                     k_prev=p.new_zeros(k), x_prev=p.new_zeros(B, H, P))
                for _ in range(cfg.n_layer)]

    @torch.no_grad()
    def prefill(self, idx, cache, impl="auto"):
        """idx (B, L) through the chunked scan (or impl) from the cache's state, which moves on in
        place -> the last logits (B, vocab_size)."""
        logits = self.logits(self.hidden(idx, cache, impl)[:, -1])
        # a sequence whose last consumed token is reset_token goes on as a fresh document
        if self.config.reset_token is not None:
            done = idx[:, -1] == self.config.reset_token  # (B,)
            for layer in cache:
                for t in layer.values():
                    t.masked_fill_(done.view(-1, *(1,) * (t.dim() - 1)), 0)
        return logits

    def step(self, tokens, cache):
        """tokens (B,) -> logits (B, vocab_size) by one O(1) step of the recurrence, in place."""
        return self.prefill(tokens[:, None], cache, impl="recurrent")

    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """Yield (B,) tokens: prefill idx (B, L), then decode one by one (temperature 0: greedy)."""
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
        return torch.cat([idx] + [t[:, None] for t in new], dim=1)


def sample_next(logits, temperature=1.0, top_k=None, generator=None):
    """logits (B, V) -> (B,) int64: greedy at temperature 0, else sampled among the top_k."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


# A training step's memory, measured on a CPU (peak RSS, float32): per token 213-243 bytes per
# d_model and layer (321 for tiny), 28-32 under gradient checkpointing plus one block's whole, 11
# per vocabulary row (logits, softmax, gradients); per parameter 16: weights, grads, AdamW moments.
ACT_BYTES, RECOMPUTED_BYTES, LOGIT_BYTES, PARAM_BYTES = 256, 32, 12, 16


def activation_bytes(config, tokens, recompute=False):
    """About how many bytes the activations of a training micro-batch of `tokens` tokens take
    (recompute: under gradient checkpointing, which keeps one block's whole)."""
    n = config.n_layer
    layers = ACT_BYTES + RECOMPUTED_BYTES * n if recompute else ACT_BYTES * n  # bytes per d_model
    return tokens * (LOGIT_BYTES * config.padded_vocab + config.d_model * layers)
