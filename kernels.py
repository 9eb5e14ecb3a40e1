"""The Mamba-3 layer's math: the scan `ssd` three ways (the token-by-token recurrence, the chunked PyTorch path,
Triton kernels) and the mixer region around it, from the in_proj output to the gated output that goes into
out_proj, two ways (`mixer_torch`, readable, and `mixer_triton`, fused kernels; `mixer` picks).

The scan, per batch element b and head h, with S the (P x N) state:

    S_t = exp(log_a_t) * (S_{t-1} + beta_t * x_{t-1} k_{t-1}^T) + gamma_t * x_t k_t^T
    y_t = S_t q_t

x (B, L, H, P); q, k (B, L, H, N); log_a, gamma, beta (B, L, H). The state passed in and out is the tuple
(S (B, H, P, N) float32, k_prev (B, H, N), x_prev (B, H, P)): exactly what a continuation call or a decoder
needs. An optional reset (B, L) bool marks document starts: where reset[b, t] is set, the state entering t is
zero (S_{t-1}, x_{t-1} and k_{t-1} all count as 0), so S_t = gamma_t x_t k_t^T.

The chunked form. Cut the sequence into chunks of C tokens; inside a chunk let cs_i be the running sum of
log_a up to token i, and w_s = gamma_s + beta_{s+1} (token s's input enters the state twice: with its own
gamma now and with the next token's beta one step later). Then, with Sin the state entering the chunk,

    Y    = (W o Q K^T) X + e * (Q Sin^T)            W_ij = exp(cs_i - cs_j) w_j (j < i), gamma_i (j = i), 0 above
    Sout = a Sin + (X * u)^T K                       e_i = exp(cs_i),  u_j = exp(cs_last - cs_j) w_j,  a = exp(cs_last)

(the state carried between chunks already holds the next token's beta term; only the state after the last
token of the sequence is the true S). A reset cuts a chunk into segments: seg_i counts the resets up to i, and
every decay that would cross one is zero: W_ij needs seg_i == seg_j, e_i needs seg_i == 0 (no reset since the
chunk began), u_j needs seg_j == seg_last, a needs seg_last == 0. Only masks; never a -inf in a cumsum.

The mixer region (the layer minus its two projections). in_proj's output splits, per token, into
z, x (H*P each) | B, C (G*N each, shared by the H/G heads of a group) | dd_dt, dd_A, trap (H each) | angle (S).

    dt = softplus(dd_dt + dt_bias)                  A = -max(f(dd_A), A_floor),  f(v) = 1 + v (v >= 0), 1/(1 - v)
    log_a = A dt,  lam = sigmoid(trap),  gamma = lam dt,  beta = (1 - lam) dt
    Phi_t = Phi_{t-1} + pi tanh(angle_t) dt_t       per head, S angles; restarts at a reset (Phi_{-1} = 0)
    k = Rot(Phi)(RMSNorm(B) + B_bias[h]),  q = Rot(Phi)(RMSNorm(C) + C_bias[h])
    out = (ssd(x, q, k, log_a, gamma, beta) + D x) * silu(z)

Rot turns each pair of state dims (2i, 2i+1), i < S, by the angle Phi_i; the other N - 2S dims pass through.
"""
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F

IMPLS = ("auto", "torch", "triton", "recurrent")


def _compute_dtype(*tensors):
    # float64 in, float64 throughout (the oracle tests); otherwise the state and cumsums are float32
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _initial_state(state, x, k, dtype):
    """(S0, k_prev, x_prev) in the compute dtype; zeros when no state is given."""
    B, _, H, P = x.shape
    N = k.shape[-1]
    if state is None:
        return (x.new_zeros(B, H, P, N, dtype=dtype), k.new_zeros(B, H, N, dtype=dtype),
                x.new_zeros(B, H, P, dtype=dtype))
    S0, k_prev, x_prev = state
    if S0.shape != (B, H, P, N) or k_prev.shape != (B, H, N) or x_prev.shape != (B, H, P):
        raise ValueError(f"ssd: state shapes {tuple(S0.shape)}, {tuple(k_prev.shape)}, {tuple(x_prev.shape)} "
                         f"do not match (B, H, P, N) = {(B, H, P, N)}")
    return S0.to(dtype), k_prev.to(dtype), x_prev.to(dtype)


def _final_state(S, x, k):
    # the true state after the last token, and that token's k and x (the next token's beta term needs them)
    return S.float() if S.dtype != torch.float64 else S, k[:, -1].clone(), x[:, -1].clone()


# -----------------------------------------------------------------------------
# the recurrence: the oracle


def recurrent_step(S, k_prev, x_prev, x, q, k, log_a, gamma, beta):
    """One token of the recurrence. S (B, H, P, N); k_prev, k, q (B, H, N); x_prev, x (B, H, P);
    log_a, gamma, beta (B, H). Returns (y (B, H, P), S_new); out of place so autograd can run through it."""
    a, gamma, beta = log_a.exp()[..., None, None], gamma[..., None, None], beta[..., None, None]
    S = a * (S + beta * x_prev[..., :, None] * k_prev[..., None, :]) + gamma * x[..., :, None] * k[..., None, :]
    y = (S @ q[..., :, None])[..., 0]
    return y, S


def ssd_recurrent(x, q, k, log_a, gamma, beta, state=None, reset=None):
    """The recurrence, one token at a time. Slow; the ground truth for every other path."""
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    S, k_prev, x_prev = _initial_state(state, x, k, dtype)
    xc, qc, kc = x.to(dtype), q.to(dtype), k.to(dtype)
    la, g, b = log_a.to(dtype), gamma.to(dtype), beta.to(dtype)
    ys = []
    for t in range(x.shape[1]):
        if reset is not None:  # a document starts at t: nothing before it reaches it
            keep = (~reset[:, t]).to(dtype)[:, None]
            S, k_prev, x_prev = S * keep[..., None, None], k_prev * keep[..., None], x_prev * keep[..., None]
        y, S = recurrent_step(S, k_prev, x_prev, xc[:, t], qc[:, t], kc[:, t], la[:, t], g[:, t], b[:, t])
        ys.append(y)
        k_prev, x_prev = kc[:, t], xc[:, t]
    return torch.stack(ys, dim=1).to(x.dtype), _final_state(S, x, k)


# -----------------------------------------------------------------------------
# the chunked form in PyTorch


def decay_matrix(cs, same=None):
    """cs (b, C) -> D (b, C, C) with D_ij = exp(cs_i - cs_j) for j <= i and 0 above the diagonal (and, given
    `same` (b, C, C), 0 between segments). Only differences <= 0 are exponentiated: the ones above the diagonal
    (> 0, possibly huge) are clamped to 0 first and then masked."""
    D = (cs[:, :, None] - cs[:, None, :]).clamp_(max=0).exp_().tril_()
    return D if same is None else D.mul_(same)


def _segment_decays(cs, seg):
    """The decays that cross a chunk boundary, zero where a reset lies in between. cs, seg (b, C) ->
    e (b, C): from the chunk's start to i; f (b, C): from j to the chunk's end; a (b,): over the whole chunk;
    and same (b, C, C), whether i and j lie in one segment (None without resets)."""
    e, f, a = cs.exp(), (cs[:, -1:] - cs).exp(), cs[:, -1].exp()
    if seg is None:
        return e, f, a, None
    last = seg[:, -1:]
    return e * (seg == 0), f * (seg == last), a * (last[:, 0] == 0), (seg[:, :, None] == seg[:, None, :]).to(cs.dtype)


def _weights(D, w, g):
    """The intra-chunk weights W: D_ij w_j below the diagonal, gamma_i on it (D is 0 above)."""
    W = D * w[:, None, :]
    W.diagonal(dim1=1, dim2=2).copy_(g)
    return W


class ChunkedScan(torch.autograd.Function):
    """The chunked scan on chunk-major tensors (b = B*H*nc chunks of C tokens), forward and backward written
    out by hand. Autograd would keep and copy several C x C temporaries per chunk; this keeps three (the decay
    matrix D, the scores Q K^T and M) and spends its time in batched matmuls. Per chunk, with Sin the state
    entering it (the module docstring's chunked form; seg (b, C), the resets counted inside each chunk, or None):

        Y    = (W o (Q K^T)) X + e * (Q Sin^T)       W_ij = D_ij w_j (j < i), gamma_i (j = i), 0 (j > i)
        Sout = a Sin + (X * u)^T K                   u = f * w

    and a short loop over the chunks chains them: Sin_{c+1} = Sout_c."""

    @staticmethod
    def forward(ctx, X, Q, K, cs, w, g, Sin0, seg):  # (b, C, P), (b, C, N) x2, (b, C) x3, (BH, P, N), (b, C)
        b, C, P = X.shape
        BH, _, N = Sin0.shape
        nc = b // BH
        e, f, a, same = _segment_decays(cs, seg)
        # what each chunk adds to the state at its end (its last token's w already holds the next beta)
        Xu = X * (f * w)[..., None]  # (b, C, P)
        dS = torch.bmm(Xu.transpose(1, 2), K).view(BH, nc, P, N)
        # the states entering the chunks, one chunk after the other (nc = L / C: a short loop)
        a = a.view(BH, nc, 1, 1)
        Sin = torch.empty_like(dS)
        S = Sin0
        for c in range(nc):
            Sin[:, c] = S
            S = torch.addcmul(dS[:, c], a[:, c], S)
        Sin = Sin.view(b, P, N)
        D = decay_matrix(cs, same)
        scores = torch.bmm(Q, K.transpose(1, 2))  # (b, C, C)
        M = _weights(D, w, g).mul_(scores)
        # kept for the backward: D, scores and M (on a CPU, recomputing M costs as much as keeping it)
        ctx.save_for_backward(X, Q, K, cs, w, g, D, scores, M, Sin, seg)
        QS = torch.bmm(Q, Sin.transpose(1, 2), out=Xu)  # Xu's buffer is free again: one 4 MB page-fault less
        return torch.bmm(M, X).addcmul_(e[..., None], QS), S

    @staticmethod
    def backward(ctx, dY, dS_final):
        # in the compute dtype, as the forward ran: torch.compile traces the backward under the caller's autocast
        with torch.autocast(dY.device.type, enabled=False):
            return ChunkedScan._backward(ctx, dY.float() if dY.dtype != torch.float64 else dY, dS_final)

    @staticmethod
    def _backward(ctx, dY, dS_final):
        X, Q, K, cs, w, g, D, scores, M, Sin, seg = ctx.saved_tensors
        dY = dY.contiguous()  # it arrives as a view of (B, L, H, P); four matmuls read it
        b, C, P = X.shape
        BH, N = dS_final.shape[0], Q.shape[-1]
        nc = b // BH
        e, f, a, _ = _segment_decays(cs, seg)
        # intra-chunk: Y = M X with M = scores o W; W = D o w_j below the diagonal and gamma_i on it (D_ii = 1)
        dX = torch.bmm(M.transpose(1, 2), dY)
        dMD = torch.bmm(dY, X.transpose(1, 2)).mul_(D)  # dM o D, (b, C, C)
        dscores = dMD * w[:, None, :]
        dscores.diagonal(dim1=1, dim2=2).copy_(dMD.diagonal(dim1=1, dim2=2) * g)  # dM o W
        dQ, dK = torch.bmm(dscores, K), torch.bmm(dscores.transpose(1, 2), Q)
        # W's gradient, through D: R = dW o D. W_ii = gamma_i; below, w_j and D_ij = exp(cs_i - cs_j), so cs_i
        # gets the row sum of R_ij w_j and cs_j loses the column sum (the diagonal terms cancel)
        R = dMD.mul_(scores)
        dg = R.diagonal(dim1=1, dim2=2).clone()
        colR = R.sum(1)
        dw = colR - dg
        dcs = torch.bmm(R, w[..., None])[..., 0] - w * colR
        # inter-chunk: e * (Q Sin^T)
        T = torch.bmm(dY, Sin)  # (b, C, N)
        dcs += e * torch.linalg.vecdot(T, Q)
        dQ.addcmul_(e[..., None], T)
        dYe = dY * e[..., None]  # (b, C, P)
        dSin = torch.bmm(dYe.transpose(1, 2), Q).view(BH, nc, P, N)
        # the loop over the chunks, backwards: G is the gradient of the state leaving chunk c
        a = a.view(BH, nc, 1, 1)
        G = dS_final
        for c in reversed(range(nc)):  # dSin's slots take the gradient of each chunk's dS as they free up
            G, dSin[:, c] = torch.addcmul(dSin[:, c], a[:, c], G), G
        dS = dSin
        # Sout_c = a_c Sin_c + dS_c: cs_last gets a_c <G_c, Sin_c> (a_c is 0 past a reset, and so is this)
        da = torch.linalg.vecdot(dS.flatten(2), Sin.view(BH, nc, P * N)) * a.view(BH, nc)
        # what each chunk adds: dS = (X * u)^T K with u_s = f_s w_s
        dS = dS.view(b, P, N)
        u = f * w
        # (the dead buffers of dY * e and T take the products: on a CPU, fresh 4 MB buffers cost page faults)
        dXu = torch.bmm(K, dS.transpose(1, 2), out=dYe)  # (b, C, P)
        dX.addcmul_(dXu, u[..., None])
        dK.addcmul_(u[..., None], torch.bmm(X, dS, out=T))
        du = torch.linalg.vecdot(dXu, X)  # (b, C)
        dw += du * f
        dcs -= du * u
        dcs[:, -1] += (du * u).sum(-1) + da.view(b)
        return dX, dQ, dK, dcs, dw, dg, G, None  # G is now the gradient of Sin0


def _chunk_glue(gamma, beta, state, x, k, dtype):
    """What both chunked paths compute on (B, L, H) scalars before the chunks: w_s = gamma_s + beta_{s+1}
    (token s's input also enters the next step's trapezoid; 0 after the last token), and the state entering
    the first chunk, S0 plus the first token's beta term (which needs x_prev and k_prev)."""
    S0, k_prev, x_prev = _initial_state(state, x, k, dtype)
    w = gamma.to(dtype) + F.pad(beta[:, 1:].to(dtype), (0, 0, 0, 1))  # (B, L, H)
    Sin0 = S0 + beta[:, 0, :, None, None].to(dtype) * x_prev[..., :, None] * k_prev[..., None, :]  # (B, H, P, N)
    return w, Sin0


def ssd_chunked(x, q, k, log_a, gamma, beta, state=None, chunk_size=64, reset=None):
    """The chunked form: chunks of C tokens become the batch of the matmuls in ChunkedScan."""
    B, L, H, P = x.shape
    N = q.shape[-1]
    C = chunk_size
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    with torch.autocast(x.device.type, enabled=False):
        w, Sin0 = _chunk_glue(gamma, beta, state, x, k, dtype)
        # pad to whole chunks with tokens that change nothing (no decay, no input, no reset), then chunk-major:
        # (B, L, H, D) -> (B*H*nc, C, D)
        pad = (-L) % C
        nc = (L + pad) // C

        def chunks(t):
            t = F.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)) if pad else t.to(dtype)
            return t.view(B, nc, C, H, -1).permute(0, 3, 1, 2, 4).reshape(B * H * nc, C, -1)

        X, Q, K = chunks(x), chunks(q), chunks(k)  # (b, C, P|N), b = B*H*nc
        la, g, w = (chunks(t[..., None])[..., 0] for t in (log_a, gamma, w))  # (b, C)
        cs = la.cumsum(dim=-1)  # (b, C), <= 0 and decreasing
        seg = None
        if reset is not None:  # the resets counted inside each chunk, (b, C): equal counts, one segment
            seg = F.pad(reset, (0, pad)).view(B, 1, nc, C).expand(B, H, nc, C).reshape(B * H * nc, C).cumsum(-1)
        Y, S = ChunkedScan.apply(X, Q, K, cs, w, g, Sin0.view(B * H, P, N), seg)  # (b, C, P), (B*H, P, N)
        y = Y.view(B, H, nc, C, P).permute(0, 2, 3, 1, 4).reshape(B, nc * C, H, P)[:, :L]
    return y.to(x.dtype), _final_state(S.view(B, H, P, N), x, k)


# -----------------------------------------------------------------------------
# the mixer region in PyTorch: the readable twin of the fused kernels (and the path with a decoding cache)


def _f32(t):
    # dt, A, the angles and the phases are computed in float32 (or float64 when the whole model is)
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def rotate(v, phi):
    """Rotate adjacent pairs (2i, 2i+1), i < S, of v's last dim by the angles phi (..., S); the rest passes."""
    S = phi.shape[-1]
    v0, v1, rest = v[..., 0:2 * S:2], v[..., 1:2 * S:2], v[..., 2 * S:]
    cos, sin = phi.cos(), phi.sin()
    rotated = torch.stack([v0 * cos - v1 * sin, v0 * sin + v1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


def phases(v, reset=None, phi0=None):
    """Phi_t = Phi_{t-1} + v_t along dim 1 of v (B, L, ...), restarting at each reset (B, L) (Phi_t = v_t there)
    and starting from phi0 (B, ...) where no reset has happened yet."""
    phi = v.cumsum(1)
    last = None
    if reset is not None:
        # subtract the running sum just before the latest reset at or before t (index -1: no reset yet)
        L = reset.shape[1]
        last = torch.where(reset, torch.arange(L, device=reset.device), -1).cummax(1).values  # (B, L)
        before = F.pad(phi, (0, 0) * (phi.dim() - 2) + (1, 0))[:, :-1]  # the running sum up to t - 1
        index = last.clamp(min=0).view(*last.shape, *(1,) * (phi.dim() - 2)).expand_as(phi)
        phi = phi - before.gather(1, index)
    if phi0 is not None:
        carried = phi0[:, None] if last is None else torch.where((last < 0).view(*last.shape, *(1,) * (phi.dim() - 2)),
                                                                 phi0[:, None], 0)
        phi = phi + carried
    return phi


def split_sizes(H, P, G, N, S):
    """in_proj's output, in order: z | x | B | C | dd_dt | dd_A | trap | angle."""
    return [H * P, H * P, G * N, G * N, H, H, H, S]


def mixer_torch(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, headdim, ngroups, n_angles,
                chunk_size=64, A_floor=1e-4, eps=1e-5, reset=None, state=None, impl="torch"):
    """The mixer region in PyTorch ops (the module docstring's equations), the scan through ssd(impl=impl).
    zxbcdt (B, L, 2HP + 2GN + 3H + S) -> out (B, L, H*P) in zxbcdt's dtype. state: None, or a decoding cache's
    (Phi (B, H, S), S, k_prev, x_prev); the state after the last token comes back with out (None without)."""
    H, N = B_bias.shape
    P, G = headdim, ngroups
    Bsz, L, _ = zxbcdt.shape
    z, x, Bm, Cm, dd_dt, dd_A, trap, angle = torch.split(zxbcdt, split_sizes(H, P, G, N, n_angles), dim=-1)

    dt = F.softplus(_f32(dd_dt) + dt_bias)  # (B, L, H)
    dd_A = _f32(dd_A)
    # A = -max(f(dd_A), A_floor) with the heavy-tailed f(v) = 1 + v (v >= 0), 1 / (1 - v) (v < 0)
    f = torch.where(dd_A >= 0, 1 + dd_A, 1 / (1 - dd_A.clamp(max=0)))
    log_a = -f.clamp(min=A_floor) * dt  # (B, L, H), < 0
    lam = torch.sigmoid(_f32(trap))
    gamma, beta = lam * dt, (1 - lam) * dt
    # data-dependent rotary phases, accumulated per head and kept in [0, 2 pi)
    theta = math.pi * torch.tanh(_f32(angle))  # (B, L, S)
    phi = phases(theta[:, :, None, :] * dt[..., None], reset, None if state is None else state[0])  # (B, L, H, S)
    phi = torch.remainder(phi, 2 * math.pi)

    # B and C: RMS-normalised per group, shared by the group's heads, plus per-head biases, then rotated
    # (in float32, as the fused kernels do: bf16 in, float32 statistics)
    Bn = F.rms_norm(_f32(Bm).view(Bsz, L, G, N), (N,), B_norm_weight, eps).repeat_interleave(H // G, dim=2)
    Cn = F.rms_norm(_f32(Cm).view(Bsz, L, G, N), (N,), C_norm_weight, eps).repeat_interleave(H // G, dim=2)
    k = rotate(_f32(Bn + B_bias), phi).to(x.dtype)  # (B, L, H, N)
    q = rotate(_f32(Cn + C_bias), phi).to(x.dtype)
    x = x.view(Bsz, L, H, P)

    y, final = ssd(x, q, k, log_a, gamma, beta, None if state is None else state[1:], chunk_size, impl, reset)
    y = y + D[:, None].to(y.dtype) * x
    out = y.reshape(Bsz, L, -1) * F.silu(z)
    return out, None if state is None else (phi[:, -1], *final)


# -----------------------------------------------------------------------------
# the chunked form in Triton
#
# One program per (b, h) walks the chunks in order and keeps the (P x N) state on chip in float32, so states
# cross chunks in registers, not through HBM; it saves the state entering each chunk (in the dot operand dtype)
# for the backward, which walks the chunks in reverse with the state's gradient G on chip. Token tensors are
# read and written in place through their strides, the tokens past L in the last chunk masked; tiles are padded
# to powers of 2 (PP >= P, NP >= N, at least 16 for tl.dot; the mixer's kernels hold N as its even and odd
# dims, two tiles of NH >= N / 2). Two dtypes, both tl.constexpr: DT, the one operand
# dtype of every tl.dot (the inputs' dtype: bf16, fp16 or fp32), and ACC, the dtype of cumsums, states, scalars
# and accumulators (float32; float64 for float64 inputs, as the oracle tests). The model's sizes (H, G, P, N, S)
# are tl.constexpr too: index arithmetic folds, and a kernel is compiled once per model shape.
#
# Two users share the per-chunk helpers: the scan alone (ssd(impl="triton"): _scan_fwd, _scan_bwd, one launch
# each) and the fused mixer region (mixer_triton: _mixer_fwd forward; _mixer_bwd, then _sum_heads backward).

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform (macOS); impl="triton" then says so, everything else works
    triton = None

TRITON_NEEDED = (3, 6)  # the oldest Triton the kernels compile under (what torch 2.11 installs)


def _version(v):
    return tuple(int(part) for part in v.split("+")[0].split(".")[:2])


if triton is not None and _version(triton.__version__) >= TRITON_NEEDED:
    from triton.tools.tensor_descriptor import TensorDescriptor

    # Under TRITON_INTERPRET=1 (read when the kernels below are decorated, i.e. at import) they run as numpy on
    # CPU tensors: the tests run them that way. Its one gap that matters here: no bfloat16 arithmetic (see _dot).
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))
    if _INTERPRETED and _version(triton.__version__) < (3, 7):
        # Triton 3.6's interpreter turns a loop bound into an int with int() of a one-element 1-d array, which
        # NumPy deprecated in 1.25 and now refuses, so `for c in range(nc)` stops; 3.7 squeezes it first, as here.
        from triton.runtime import interpreter as _interpreter

        def _patch_lang_tensor(tensor, scope, patch=_interpreter._patch_lang_tensor):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        _interpreter._patch_lang_tensor = _patch_lang_tensor
    _TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}
    _PI = tl.constexpr(math.pi)

    @triton.jit
    def _dot(a, b, DT: tl.constexpr):
        # one explicit operand dtype per product, float32 accumulation (float64 for float64 operands);
        # "ieee" so that float32 operands are not rounded to tf32 on GPUs
        a, b = a.to(DT), b.to(DT)
        if _INTERPRETED and DT == tl.bfloat16:
            # the interpreter would multiply bf16 bit patterns; the same bf16-rounded operands in float32 give
            # exactly what a GPU's bf16 dot with float32 accumulation gives
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _dot_acc(a, b, acc, DT: tl.constexpr):
        # acc + a b, as _dot. An explicit accumulator where it is not itself a product: a product's result added
        # to a zero-accumulator dot becomes that dot's accumulator, and a product that feeds another product gets
        # the costlier layout on GPUs (see _scaled_weights).
        a, b = a.to(DT), b.to(DT)
        if _INTERPRETED and DT == tl.bfloat16:
            a, b = a.to(tl.float32), b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)  # (3.6 would assume float32)

    @triton.jit
    def _last(v, i, C: tl.constexpr):
        # v's entry at i = C - 1, as a scalar (v: (C,))
        return tl.sum(tl.where(i == C - 1, v, 0), axis=0)

    @triton.jit
    def _first(v, i):
        return tl.sum(tl.where(i == 0, v, 0), axis=0)

    @triton.jit
    def _shift_down(v, i):
        # v_{i-1} at i (0 at i = 0): a (C, C) select and sum, cheap next to the chunk's matmuls
        return tl.sum(tl.where(i[:, None] == i[None, :] + 1, v[None, :], 0.0), axis=1)

    @triton.jit
    def _in_bounds(valid, cols, ncols: tl.constexpr, TILE: tl.constexpr):
        # rows `valid` x columns < ncols of a (C, TILE) block; the column test is left out when the tile has no
        # padding (ncols and TILE are compile-time constants: the model's sizes are usually powers of 2)
        mask = valid[:, None]
        if ncols != TILE:
            mask = mask & (cols < ncols)[None, :]
        return mask

    @triton.jit
    def _segments(reset_ptr, b, t, valid, L, HAS_RESET: tl.constexpr):
        # seg_i, the resets counted from the chunk's start through token i (zeros without resets)
        if HAS_RESET:
            return tl.cumsum(tl.load(reset_ptr + b * L + t, mask=valid, other=0).to(tl.int32), 0)
        return tl.zeros(t.shape, tl.int32)

    @triton.jit
    def _decays(cs, w, g, seg, i, C: tl.constexpr):
        """From a chunk's cs, w, gamma and seg (C,): the decays every chunk formula uses.
            same_ij  = j <= i and no reset between them (one segment)
            decay_ij = exp(cs_i - cs_j) where same_ij, else 0
            W_ij     = decay_ij w_j below the diagonal, gamma_i on it, 0 above
            e_i = exp(cs_i) (seg_i = 0),  f_j = exp(cs_last - cs_j) (seg_j = seg_last),  u = f w,
            a = exp(cs_last) (seg_last = 0): the decays across the chunk's start and end, 0 past a reset.
        Every exponent is <= 0 (log_a <= 0); the differences above the diagonal are > 0 (and possibly huge), so
        they are clamped to 0 first and masked after."""
        cs_last, seg_last = _last(cs, i, C), _last(seg, i, C)
        same = (i[None, :] <= i[:, None]) & (seg[:, None] == seg[None, :])
        decay = tl.where(same, tl.exp(tl.minimum(cs[:, None] - cs[None, :], 0.0)), 0.0)
        W = tl.where(i[:, None] == i[None, :], g[:, None], decay * w[None, :])
        e = tl.where(seg == 0, tl.exp(cs), 0.0)
        f = tl.where(seg == seg_last, tl.exp(cs_last - cs), 0.0)
        a = tl.where(seg_last == 0, tl.exp(cs_last), 0.0)
        return same, decay, W, e, f, f * w, a

    @triton.jit
    def _chunk_forward(Q, K, X, S, W, e, u, a, DT: tl.constexpr):
        """One chunk: Y = (W o Q K^T) X + e * (Q Sin^T) and the state leaving it, a Sin + (X * u)^T K. (Operands
        are cast to DT before they are transposed: a transposed bf16 tile is a view of shared memory, a
        transposed float32 one a shuffle through registers.)"""
        Y = _dot(W * _dot(Q, tl.trans(K.to(DT)), DT), X, DT) + e[:, None] * _dot(Q, tl.trans(S.to(DT)), DT)
        return Y, a * S + _dot(tl.trans((X * u[:, None]).to(DT)), K, DT)

    @triton.jit
    def _chunk_backward(Q, K, X, dY, scores, QS, S, G, decay, W, e, f, w, u, a, i, C: tl.constexpr,
                        DT: tl.constexpr):
        """The gradients of one chunk, G being the gradient of the state leaving it (Sout = a Sin + (X u)^T K):
            dX  = (W o Q K^T)^T dY + u * (K G^T)
            dQ  = (dM o W) K + e * (dY Sin)            dM = dY X^T
            dK  = (dM o W)^T Q + u * (X G)
            R   = dM o (Q K^T) o decay                 (what W's entries pass on to w and cs)
            dgamma_i = (dM o Q K^T)_ii,   dw_j = sum_{i>j} R_ij + du_j f_j,   du_i = x_i . (K G^T)_i
            dcs_i = sum_{j<i} R_ij w_j - w_i sum_{l>i} R_li + e_i dY_i . (Q Sin^T)_i - du_i u_i
                    + [i = last] (sum_j du_j u_j + a <G, Sin>)
            dSin = a G + (e * dY)^T Q                  (the G of the chunk before)"""
        KGt = _dot(K, tl.trans(G), DT)  # (C, P)
        dM = _dot(dY, tl.trans(X), DT)  # (C, C)
        dX = _dot(tl.trans(W * scores), dY, DT) + u[:, None] * KGt
        dWs = dM * W
        dQ = _dot(dWs, K, DT) + e[:, None] * _dot(dY, S, DT)
        dK = _dot(tl.trans(dWs), Q, DT) + u[:, None] * _dot(X, G, DT)
        dMs = dM * scores
        R = tl.where(i[None, :] < i[:, None], dMs * decay, 0.0)
        col = tl.sum(R, axis=0)  # sum_{l>j} R_lj
        du = tl.sum(X * KGt, axis=1)
        dg = tl.sum(tl.where(i[:, None] == i[None, :], dMs, 0.0), axis=1)
        dw = col + du * f
        dcs = tl.sum(R * w[None, :], axis=1) - w * col + e * tl.sum(dY * QS, axis=1) - du * u
        dcs += tl.where(i == C - 1, tl.sum(du * u, axis=0) + a * tl.sum(G * S), 0.0)
        return dX, dQ, dK, dcs, dw, dg, a * G + _dot(tl.trans(dY * e[:, None]), Q, DT)

    @triton.jit
    def _scan_chunk(x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h, cs_ptr, w_ptr, g_ptr,
                    reset_ptr, b, h, bh, c, nc, L, i, p, n, P: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
                    PP: tl.constexpr, NP: tl.constexpr, HAS_RESET: tl.constexpr):
        """What both scan kernels read of chunk c for (b, h): its tokens t, the row masks, q, k, x, and cs, w,
        gamma at cw (their offsets in the (B*H, nc, C) arrays) with the decays built from them."""
        t = c * C + i
        valid = t < L
        qk_mask = _in_bounds(valid, n, N, NP)
        x_mask = _in_bounds(valid, p, P, PP)
        Q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_l + h * sq_h + n[None, :], mask=qk_mask, other=0.0)
        K = tl.load(k_ptr + b * sk_b + t[:, None] * sk_l + h * sk_h + n[None, :], mask=qk_mask, other=0.0)
        X = tl.load(x_ptr + b * sx_b + t[:, None] * sx_l + h * sx_h + p[None, :], mask=x_mask, other=0.0)
        cw = (bh * nc + c) * C + i
        cs, w, g = tl.load(cs_ptr + cw), tl.load(w_ptr + cw), tl.load(g_ptr + cw)
        _, decay, W, e, f, u, a = _decays(cs, w, g, _segments(reset_ptr, b, t, valid, L, HAS_RESET), i, C)
        return t, qk_mask, x_mask, Q, K, X, cw, w, decay, W, e, f, u, a

    @triton.jit
    def _scan_fwd(x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h, y_ptr, sy_b, sy_l, sy_h,
                  cs_ptr, w_ptr, g_ptr, reset_ptr, Sin0_ptr, states, S_ptr, L, nc,
                  H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, C: tl.constexpr, PP: tl.constexpr,
                  NP: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                  HAS_RESET: tl.constexpr):
        """The scan alone, one program per (b, h); grid (B*H,). Reads x, q, k (B, L, H, .), the per-chunk cs, w,
        gamma (B*H, nc, C) and the state entering chunk 0 (B*H, P, N); writes y, the state entering each chunk
        (the descriptor `states` over (B*H*nc*PP, NP), padded tiles) for the backward, and the state after the
        last token (B*H, P, N). The state never leaves the chip between chunks: the chunks run one after the
        other, the (b, h) pairs in parallel."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        i, p, n = tl.arange(0, C), tl.arange(0, PP), tl.arange(0, NP)
        pn = p[:, None] * N + n[None, :]
        pn_mask = (p < P)[:, None] & (n < N)[None, :]
        S = tl.load(Sin0_ptr + bh * P * N + pn, mask=pn_mask, other=0.0).to(ACC)
        for c in range(nc):
            t, _, x_mask, Q, K, X, _, _, _, W, e, _, u, a = _scan_chunk(
                x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h, cs_ptr, w_ptr, g_ptr,
                reset_ptr, b, h, bh, c, nc, L, i, p, n, P, N, C, PP, NP, HAS_RESET)
            states.store([((bh * nc + c) * PP).to(tl.int32), 0], S.to(DT))
            Y, S = _chunk_forward(Q, K, X, S, W, e, u, a, DT)
            tl.store(y_ptr + b * sy_b + t[:, None] * sy_l + h * sy_h + p[None, :], Y.to(y_ptr.dtype.element_ty),
                     mask=x_mask)
        tl.store(S_ptr + bh * P * N + pn, S, mask=pn_mask)

    @triton.jit
    def _scan_bwd(x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h,
                  dy_ptr, sdy_b, sdy_l, sdy_h, dx_ptr, dq_ptr, dk_ptr, cs_ptr, w_ptr, g_ptr, reset_ptr, states,
                  dS_ptr, dcs_ptr, dw_ptr, dg_ptr, dSin0_ptr, L, nc,
                  H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, C: tl.constexpr, PP: tl.constexpr,
                  NP: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                  HAS_RESET: tl.constexpr):
        """The scan's backward, one program per (b, h) walking the chunks in reverse with G, the gradient of the
        state leaving the chunk, on chip (it starts as the final state's gradient dS (B*H, P, N)). Reads what
        _scan_fwd read plus dy and the saved states; writes dx, dq, dk (contiguous (B, L, H, .)), dcs, dw, dgamma
        (B*H, nc, C) and the gradient of the state entering chunk 0 (B*H, P, N)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        i, p, n = tl.arange(0, C), tl.arange(0, PP), tl.arange(0, NP)
        pn = p[:, None] * N + n[None, :]
        pn_mask = (p < P)[:, None] & (n < N)[None, :]
        G = tl.load(dS_ptr + bh * P * N + pn, mask=pn_mask, other=0.0).to(ACC)
        for r in range(nc):
            c = nc - 1 - r
            t, qk_mask, x_mask, Q, K, X, cw, w, decay, W, e, f, u, a = _scan_chunk(
                x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h, cs_ptr, w_ptr, g_ptr,
                reset_ptr, b, h, bh, c, nc, L, i, p, n, P, N, C, PP, NP, HAS_RESET)
            dY = tl.load(dy_ptr + b * sdy_b + t[:, None] * sdy_l + h * sdy_h + p[None, :], mask=x_mask, other=0.0)
            S = states.load([((bh * nc + c) * PP).to(tl.int32), 0])
            scores = _dot(Q, tl.trans(K), DT)
            QS = _dot(Q, tl.trans(S), DT)
            dX, dQ, dK, dcs, dw, dg, G = _chunk_backward(Q, K, X, dY, scores, QS, S.to(ACC), G, decay, W, e, f, w,
                                                         u, a, i, C, DT)
            tok = (b * L + t[:, None]) * H + h  # dx, dq, dk are fresh contiguous (B, L, H, .) tensors
            tl.store(dx_ptr + tok * P + p[None, :], dX.to(dx_ptr.dtype.element_ty), mask=x_mask)
            tl.store(dq_ptr + tok * N + n[None, :], dQ.to(dq_ptr.dtype.element_ty), mask=qk_mask)
            tl.store(dk_ptr + tok * N + n[None, :], dK.to(dk_ptr.dtype.element_ty), mask=qk_mask)
            tl.store(dcs_ptr + cw, dcs)
            tl.store(dw_ptr + cw, dw)
            tl.store(dg_ptr + cw, dg)
        tl.store(dSin0_ptr + bh * P * N + pn, G, mask=pn_mask)

    # --- the fused mixer region: everything from in_proj's output to the gated output, per (b, h) ---

    @triton.jit
    def _softplus(v):
        # softplus(v) and its derivative sigmoid(v), as torch computes them (the identity above 20); log1p(e^v)
        # through log(1 + x) x / ((1 + x) - 1), accurate where 1 + x rounds (dt is often ~1e-3)
        ex = tl.exp(tl.minimum(v, 20.0))
        one = 1.0 + ex
        log1p = tl.where(one == 1.0, ex, tl.log(one) * ex / (one - 1.0))
        return tl.where(v > 20.0, v, log1p), tl.where(v > 20.0, 1.0, ex / one)

    @triton.jit
    def _tanh(v):
        e = tl.exp(-2.0 * tl.abs(v))  # in (0, 1]: no overflow
        return tl.where(v < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)

    @triton.jit
    def _dt_lam(rows, valid, h, col_dt, col_trap, dt_bias, ACC: tl.constexpr):
        # dt = softplus(dd_dt + dt_bias) (0 past L: those tokens neither decay nor add), softplus' and
        # lam = sigmoid(trap) of head h at the token rows
        dd_dt = tl.load(rows + col_dt + h, mask=valid, other=0.0).to(ACC)
        trap = tl.load(rows + col_trap + h, mask=valid, other=0.0).to(ACC)
        dt, dsp = _softplus(dd_dt + dt_bias)
        return tl.where(valid, dt, 0.0), dsp, 1.0 / (1.0 + tl.exp(-trap))

    @triton.jit
    def _heavy_tail(dd_A):
        # f(v) = 1 + v (v >= 0), 1 / (1 - v) (v < 0), and f'(v)
        neg = 1.0 / (1.0 - tl.minimum(dd_A, 0.0))
        return tl.where(dd_A >= 0, 1.0 + dd_A, neg), tl.where(dd_A >= 0, 1.0, neg * neg)

    @triton.jit
    def _turn_rate(dve, dvo, ve, vo):
        # d/dPhi of turned pairs: a turned pair (v0, v1) moves as (-v1, v0), so the phase gets dv1 v0 - dv0 v1
        return dvo * ve - dve * vo

    @triton.jit
    def _phase(rows, valid, col_ang, S, j, dt, seg, same, carry, ACC: tl.constexpr, HAS_RESET: tl.constexpr):
        """tanh(angle) (C, NP / 2) (0 for the pairs j >= S, which therefore never turn) and the phases: the carry
        from the chunks before plus the running sum of theta dt = pi tanh(angle) dt inside the chunk, both
        restarting at a reset (with resets the running sum is a product with `same`, the one-segment mask)."""
        th = _tanh(tl.load(rows[:, None] + col_ang + j[None, :], mask=valid[:, None] & (j < S)[None, :],
                           other=0.0).to(ACC))
        v = (_PI * th) * dt[:, None]
        if HAS_RESET:
            Phi = _dot(same.to(ACC), v, ACC)
        else:
            Phi = tl.cumsum(v, 0)
        return th, Phi + tl.where((seg == 0)[:, None], carry[None, :], 0.0)

    @triton.jit
    def _qk(rows, valid, col, j, N: tl.constexpr, we, wo, be, bo, cos, sin, eps, NH: tl.constexpr,
            ACC: tl.constexpr):
        """One head's k (from B's columns at col) or q (from C's) as its even and odd dims, (C, NH) each:
        RMS-normalised over N, times the norm weight, plus the head's bias, each pair (2j, 2j + 1) turned by its
        phase (pad rows are zeros). Also returns what the backward needs besides: the normalised dims and 1 / rms.
        Two strided loads instead of one (C, N) tile: a pair's halves then sit in two tiles of one layout, and the
        turn is elementwise, with no reshape or shuffle between layouts."""
        ptr = rows[:, None] + col + 2 * j[None, :]
        mask = _in_bounds(valid, j, N // 2, NH)
        xe = tl.load(ptr, mask=mask, other=0.0).to(ACC)
        xo = tl.load(ptr + 1, mask=mask, other=0.0).to(ACC)
        rstd = 1.0 / tl.sqrt((tl.sum(xe * xe, 1) + tl.sum(xo * xo, 1)) / N + eps)
        he, ho = xe * rstd[:, None], xo * rstd[:, None]
        ve, vo = he * we[None, :] + be[None, :], ho * wo[None, :] + bo[None, :]
        keep = valid[:, None]
        return tl.where(keep, ve * cos - vo * sin, 0.0), tl.where(keep, ve * sin + vo * cos, 0.0), he, ho, rstd

    @triton.jit
    def _qk_backward(dKe, dKo, cos, sin, he, ho, rstd, we, wo, N):
        # from a turned q or k's gradient (even and odd dims) to that of the un-turned vector (= the bias's) and
        # of the B or C row: turn back, then through the weight and the RMS norm, dx = rstd (dh - h mean(h dh))
        dve, dvo = dKe * cos + dKo * sin, dKo * cos - dKe * sin
        dhe, dho = dve * we[None, :], dvo * wo[None, :]
        mean = ((tl.sum(dhe * he, 1) + tl.sum(dho * ho, 1)) / N)[:, None]
        return dve, dvo, rstd[:, None] * (dhe - he * mean), rstd[:, None] * (dho - ho * mean)

    @triton.jit
    def _scaled_weights(decay, gamma, w, i):
        """M, the chunk's weights for k's rows scaled by w (Kw = w k): decay below the diagonal, gamma / w on it,
        so that M o (Q Kw^T) = W o (Q K^T) (see _decays) and (X u)^T K = (X f)^T Kw. Then W, a product of a (C, C)
        tile and a row vector, is never built: on GPUs the (C, C) products that feed other products are laid out
        twice over (all warps along the rows), and W's extra tile and w's broadcast were what spilled. gamma / w
        lies in [0, 1] (w = gamma + the next token's beta, both >= 0; w = 0 only with gamma = 0)."""
        return tl.where(i[:, None] == i[None, :], _over_w(gamma, w)[:, None], decay)

    @triton.jit
    def _over_w(v, w):
        # v / w where w > 0, else 0 (there v = 0 too: a token that adds nothing to the state has no w terms)
        return tl.where(w > 0, v / tl.where(w > 0, w, 1.0), 0.0)

    @triton.jit
    def _pairs_store(ptr, ve, vo, mask):
        # even and odd dims back to their interleaved places (ptr: the even ones')
        tl.store(ptr, ve.to(ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + 1, vo.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mixer_scalars(zx_ptr, s_b, s_l, reset_ptr, b, h, c, L, dt_bias, A_floor, i, H: tl.constexpr, G: tl.constexpr,
                       P: tl.constexpr, N: tl.constexpr, C: tl.constexpr, ACC: tl.constexpr, HAS_RESET: tl.constexpr):
        """Chunk c's tokens for head h: their rows of zxbcdt (B, L, W), the resets counted inside the chunk, and
        the per-token scalars (dt and lam with their derivatives, for this token and the next; A and f(dd_A)'s
        derivative; w; cs, the running sum of log_a = A dt)."""
        col_dt = 2 * H * P + 2 * G * N
        t = c * C + i
        valid = t < L
        rows = zx_ptr + b * s_b + t * s_l
        seg = _segments(reset_ptr, b, t, valid, L, HAS_RESET)
        dt, dsp, lam = _dt_lam(rows, valid, h, col_dt, col_dt + 2 * H, dt_bias, ACC)
        # the next token's beta completes w (token s's input enters with gamma_s now and beta_{s+1} next step)
        dt_n, dsp_n, lam_n = _dt_lam(rows + s_l, t + 1 < L, h, col_dt, col_dt + 2 * H, dt_bias, ACC)
        dd_A = tl.load(rows + col_dt + H + h, mask=valid, other=0.0).to(ACC)
        fA, dfA = _heavy_tail(dd_A)
        A = -tl.maximum(fA, A_floor)
        gamma = lam * dt
        w = gamma + (1.0 - lam_n) * dt_n
        return t, valid, rows, seg, dt, dsp, lam, dt_n, dsp_n, lam_n, fA, dfA, A, gamma, w, tl.cumsum(A * dt, 0)

    @triton.jit
    def _one_segment(seg, i):
        # (C, C): j <= i and no reset between them
        return (i[None, :] <= i[:, None]) & (seg[:, None] == seg[None, :])

    @triton.jit
    def _pairs(ptr, j, N: tl.constexpr, ACC: tl.constexpr):
        # an (N,) parameter's even and odd entries (B's or C's norm weight, a head's bias), (NH,) each. Read once
        # per chunk, not once per program: a loop-invariant vector broadcast to a tile would be hoisted out of the
        # chunk loop and hold registers through it.
        m = j < N // 2
        return tl.load(ptr + 2 * j, mask=m, other=0.0).to(ACC), tl.load(ptr + 2 * j + 1, mask=m, other=0.0).to(ACC)

    @triton.jit
    def _mixer_fwd(zx_ptr, s_b, s_l, reset_ptr, dt_bias_ptr, Bw_ptr, Cw_ptr, Bb_ptr, Cb_ptr, D_ptr,
                   out_ptr, so_b, so_l, states, phase_ptr, L, nc, A_floor, eps,
                   H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, S: tl.constexpr,
                   C: tl.constexpr, PP: tl.constexpr, NH: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                   HAS_RESET: tl.constexpr):
        """The mixer region forward, one program per (b, h); grid (B*H,). Reads head h's columns of in_proj's
        output zxbcdt (B, L, 2HP + 2GN + 3H + S) (z, x, dd_dt, dd_A, trap; its group's B and C; the angles), the
        parameters and reset (B, L) if any; computes dt, A, the trapezoid, the phases, q and k in registers, runs
        the scan with the (P, N) state on chip, adds D x, gates with silu(z) and writes out (B, L, H*P). Saves only
        what the backward cannot recompute from zxbcdt: the state entering each chunk, in DT (the descriptor
        `states` over (B*H*nc*PP, 2NH), padded tiles, even state dims in the first NH columns, odd ones in the
        next), and the phase entering each chunk (B*H, nc, S). q, k and the state are kept as their even and odd
        dims, two tiles each (see _qk): a product over N is the sum of two products over N / 2."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        i, p, j = tl.arange(0, C), tl.arange(0, PP), tl.arange(0, NH)
        dt_bias, D = tl.load(dt_bias_ptr + h).to(ACC), tl.load(D_ptr + h).to(ACC)
        Se, So = tl.zeros((PP, NH), ACC), tl.zeros((PP, NH), ACC)
        carry = tl.zeros((NH,), ACC)
        col_B = 2 * H * P + (h // (H // G)) * N  # the head's group's B; its C follows G*N columns later
        for c in range(nc):
            t, valid, rows, seg, dt, _, _, _, _, _, _, _, A, gamma, w, cs = _mixer_scalars(
                zx_ptr, s_b, s_l, reset_ptr, b, h, c, L, dt_bias, A_floor, i, H, G, P, N, C, ACC, HAS_RESET)
            # the phases, and from them k and q (in DT: from here on they only feed dots)
            tl.store(phase_ptr + (bh * nc + c) * S + j, carry, mask=j < S)
            _, Phi = _phase(rows, valid, 2 * H * P + 2 * G * N + 3 * H, S, j, dt, seg, _one_segment(seg, i), carry, ACC,
                            HAS_RESET)
            last = tl.sum(tl.where((i == C - 1)[:, None], Phi, 0.0), axis=0)
            carry = last - 2 * _PI * tl.floor(last / (2 * _PI))  # the phase entering the next chunk, in [0, 2 pi)
            cos, sin = tl.cos(Phi), tl.sin(Phi)
            # (flat unpacks: Triton 3.6 and 3.7 cannot compile an assignment to nested tuples)
            we, wo = _pairs(Bw_ptr, j, N, ACC)
            be, bo = _pairs(Bb_ptr + h * N, j, N, ACC)
            Ke, Ko, _, _, _ = _qk(rows, valid, col_B, j, N, we, wo, be, bo, cos, sin, eps, NH, ACC)
            we, wo = _pairs(Cw_ptr, j, N, ACC)
            be, bo = _pairs(Cb_ptr + h * N, j, N, ACC)
            Qe, Qo, _, _, _ = _qk(rows, valid, col_B + G * N, j, N, we, wo, be, bo, cos, sin, eps, NH, ACC)
            Kwe, Kwo = (Ke * w[:, None]).to(DT), (Ko * w[:, None]).to(DT)
            Qe, Qo = Qe.to(DT), Qo.to(DT)
            # the scan (in the scaled form of _scaled_weights), the D skip and the gate
            _, decay, _, e, f, _, a = _decays(cs, w, gamma, seg, i, C)
            xz = rows[:, None] + h * P + p[None, :]
            xz_mask = _in_bounds(valid, p, P, PP)
            X = tl.load(xz + H * P, mask=xz_mask, other=0.0)
            row = ((bh * nc + c) * PP).to(tl.int32)
            states.store([row, 0], Se.to(DT))
            states.store([row, NH], So.to(DT))
            scores = _dot(Qe, tl.trans(Kwe), DT) + _dot(Qo, tl.trans(Kwo), DT)
            QS = _dot(Qe, tl.trans(Se.to(DT)), DT) + _dot(Qo, tl.trans(So.to(DT)), DT)
            Y = _dot(_scaled_weights(decay, gamma, w, i) * scores, X, DT) + e[:, None] * QS
            Xf = tl.trans((X * f[:, None]).to(DT))
            Se, So = a * Se + _dot(Xf, Kwe, DT), a * So + _dot(Xf, Kwo, DT)
            Z = tl.load(xz, mask=xz_mask, other=0.0).to(ACC)
            out = (Y + D * X.to(ACC)) * Z * tl.sigmoid(Z)
            tl.store(out_ptr + b * so_b + t[:, None] * so_l + h * P + p[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=xz_mask)

    @triton.jit
    def _mixer_bwd(zx_ptr, s_b, s_l, reset_ptr, dt_bias_ptr, Bw_ptr, Cw_ptr, Bb_ptr, Cb_ptr, D_ptr,
                   dout_ptr, sd_b, sd_l, states, phase_ptr, dzx_ptr, sg_b, sg_l, part_ptr, dparam_ptr,
                   L, nc, A_floor, eps,
                   H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, S: tl.constexpr,
                   C: tl.constexpr, PP: tl.constexpr, NH: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                   HAS_RESET: tl.constexpr):
        """The mixer region backward, one program per (b, h) walking the chunks in reverse with G (the gradient
        of the state leaving the chunk, as even and odd dims) and the phase carry's gradient on chip. Reads what
        _mixer_fwd read, the saved states and phase carries, and dout (B, L, H*P); recomputes the chunk (dt, q, k,
        y) from zxbcdt. Writes head h's gradient columns of dzxbcdt (z, x, dd_dt, dd_A, trap) and, for what the
        heads share (B, C within a group, the angles), this head's share to part (B, L, H, 2N + S), summed by
        _sum_heads; the parameters' gradients as per-(b, h, chunk) sums to dparam (B*H, nc, 4N + 2), summed in torch (a
        running sum on chip would hold eight (N / 2,) vectors in registers through the whole walk).
        The scan's gradients are those of the forward's scaled form (Kw = w k, M from _scaled_weights, f):
            dX = (M o Q Kw^T)^T dY + f * (Kw G^T)          dM = dY X^T,  A = dM o M
            dQ = A Kw + e * (dY Sin)                       dKw = A^T Q + f * (X G),  dK = w * dKw
            R = A o (Q Kw^T) below the diagonal            df_i = x_i . (Kw G^T)_i
            dgamma_i = dM_ii q_i . k_i                     dw_i = (sum_l R_li + df_i f_i) / w_i
            dcs_i = sum_j R_ij - sum_l R_li + e_i dY_i . (Q Sin^T)_i - df_i f_i
                    + [i = last] (sum_j df_j f_j + a <G, Sin>)
            dSin = a G + (e * dY)^T Q                      (the G of the chunk before)
        (R's column i and df_i f_i both carry a factor w_i, from Kw's row i; the diagonal's gamma / w does not
        depend on w in the product, gamma_i q_i . k_i). k's phase gradient is that of the turned pairs of Kw
        and dKw: w cancels, so k itself is not kept.
        One token's gradient needs the next chunk: beta_{cC} enters w at the last token of chunk c - 1, so each
        chunk's first token is written one iteration later (pend_*), when chunk c - 1 has its dw."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        i, p, j = tl.arange(0, C), tl.arange(0, PP), tl.arange(0, NH)
        dt_bias, D = tl.load(dt_bias_ptr + h).to(ACC), tl.load(D_ptr + h).to(ACC)
        Ge, Go = tl.zeros((PP, NH), ACC), tl.zeros((PP, NH), ACC)
        dcarry = tl.zeros((NH,), ACC)
        zero = tl.zeros_like(dt_bias)
        pend_dt, pend_lam = zero, zero
        col_dt = 2 * H * P + 2 * G * N
        col_B = 2 * H * P + (h // (H // G)) * N
        width = 2 * N + S  # of a row of part
        for r in range(nc):
            c = nc - 1 - r
            t, valid, rows, seg, dt, _, _, _, _, _, _, _, _, gamma, w, cs = _mixer_scalars(
                zx_ptr, s_b, s_l, reset_ptr, b, h, c, L, dt_bias, A_floor, i, H, G, P, N, C, ACC, HAS_RESET)
            same = _one_segment(seg, i)
            carry = tl.load(phase_ptr + (bh * nc + c) * S + j, mask=j < S, other=0.0)
            th, Phi = _phase(rows, valid, col_dt + 3 * H, S, j, dt, seg, same, carry, ACC, HAS_RESET)
            cos, sin = tl.cos(Phi), tl.sin(Phi)
            Bwe, Bwo = _pairs(Bw_ptr, j, N, ACC)
            be, bo = _pairs(Bb_ptr + h * N, j, N, ACC)
            Ke, Ko, xBe, xBo, rB = _qk(rows, valid, col_B, j, N, Bwe, Bwo, be, bo, cos, sin, eps, NH, ACC)
            Cwe, Cwo = _pairs(Cw_ptr, j, N, ACC)
            be, bo = _pairs(Cb_ptr + h * N, j, N, ACC)
            Qe, Qo, xCe, xCo, rC = _qk(rows, valid, col_B + G * N, j, N, Cwe, Cwo, be, bo, cos, sin, eps, NH, ACC)
            qk = tl.sum(Qe * Ke + Qo * Ko, 1)
            Kwe, Kwo = (Ke * w[:, None]).to(DT), (Ko * w[:, None]).to(DT)
            xBe, xBo = xBe.to(DT), xBo.to(DT)
            Qe, Qo, xCe, xCo = Qe.to(DT), Qo.to(DT), xCe.to(DT), xCo.to(DT)
            xz_mask = _in_bounds(valid, p, P, PP)
            xz = rows[:, None] + h * P + p[None, :]
            X = tl.load(xz + H * P, mask=xz_mask, other=0.0)
            row = ((bh * nc + c) * PP).to(tl.int32)
            Se, So = states.load([row, 0]), states.load([row, NH])
            # the gate and the D skip: out = (y + D x) * z * sigmoid(z); y recomputed
            _, decay, _, e, f, _, a = _decays(cs, w, gamma, seg, i, C)
            M = _scaled_weights(decay, gamma, w, i)
            scores = _dot(Qe, tl.trans(Kwe), DT) + _dot(Qo, tl.trans(Kwo), DT)
            QS = _dot(Qe, tl.trans(Se), DT) + _dot(Qo, tl.trans(So), DT)
            MS = M * scores
            Y = _dot_acc(MS, X, D * X.to(ACC), DT) + e[:, None] * QS  # with the D skip
            Z = tl.load(xz, mask=xz_mask, other=0.0).to(ACC)
            dout = tl.load(dout_ptr + b * sd_b + t[:, None] * sd_l + h * P + p[None, :], mask=xz_mask,
                           other=0.0).to(ACC)
            sz = tl.sigmoid(Z)
            dY = dout * Z * sz
            dZ = dout * Y * sz * (1.0 + Z * (1.0 - sz))
            g_rows = dzx_ptr + b * sg_b + t * sg_l
            xz = g_rows[:, None] + h * P + p[None, :]
            tl.store(xz, dZ.to(dzx_ptr.dtype.element_ty), mask=xz_mask)
            dYX = tl.sum(dY * X.to(ACC), axis=1)  # dM's diagonal
            dg = dYX * qk
            # this chunk's row of dparam: [dB_bias | dC_bias | dB_norm_weight | dC_norm_weight] (N each), d dt_bias, dD
            prow = dparam_ptr + (bh * nc + c) * (4 * N + 2)
            pm = j < N // 2
            tl.store(prow + 4 * N + 1, tl.sum(dYX))
            dcs = e * tl.sum(dY * QS, axis=1)
            # the scan's gradients, one product at a time (the formulas above)
            KGt = _dot(Kwe, tl.trans(Ge), DT) + _dot(Kwo, tl.trans(Go), DT)  # (C, P)
            df = tl.sum(X.to(ACC) * KGt, axis=1)
            dX = _dot_acc(tl.trans(MS), dY, D * dY, DT) + f[:, None] * KGt  # with the D skip's share
            tl.store(xz + H * P, dX.to(dzx_ptr.dtype.element_ty), mask=xz_mask)
            dM = _dot(dY, tl.trans(X), DT)
            dA = dM * M
            R = tl.where(i[None, :] < i[:, None], dM * MS, 0.0)
            col = tl.sum(R, axis=0)
            dcs += tl.sum(R, axis=1) - col - df * f
            dw = _over_w(col + df * f, w)
            GS = tl.sum(Ge * Se.to(ACC)) + tl.sum(Go * So.to(ACC))  # <G, Sin>
            dcs += tl.where(i == C - 1, tl.sum(df * f, axis=0) + a * GS, 0.0)
            # k: its phase gradient, and this head's share of dB (B is shared with the group's other heads)
            Xt = tl.trans(dA.to(DT))
            dKe = _dot(Xt, Qe, DT) + f[:, None] * _dot(X, Ge, DT)
            dKo = _dot(Xt, Qo, DT) + f[:, None] * _dot(X, Go, DT)
            dPhi = _turn_rate(dKe, dKo, Kwe, Kwo)  # = that of dK = w dKw and K = Kw / w
            dKe, dKo = w[:, None] * dKe, w[:, None] * dKo
            Bwe, Bwo = _pairs(Bw_ptr, j, N, ACC)  # read again: cheaper than held through the chunk
            dke, dko, dBe, dBo = _qk_backward(dKe, dKo, cos, sin, xBe, xBo, rB, Bwe, Bwo, N)
            _pairs_store(prow + 2 * j, tl.sum(dke, 0), tl.sum(dko, 0), pm)
            _pairs_store(prow + 2 * N + 2 * j, tl.sum(dke * xBe, 0), tl.sum(dko * xBo, 0), pm)
            share = part_ptr + ((b * L + t) * H + h)[:, None] * width
            nm = _in_bounds(valid, j, N // 2, NH)
            _pairs_store(share + 2 * j[None, :], dBe, dBo, nm)
            # q likewise, and the state's gradient for the chunk before
            dQe = _dot(dA.to(DT), Kwe, DT) + e[:, None] * _dot(dY, Se, DT)
            dQo = _dot(dA.to(DT), Kwo, DT) + e[:, None] * _dot(dY, So, DT)
            dYe = tl.trans((dY * e[:, None]).to(DT))
            Ge, Go = a * Ge + _dot(dYe, Qe, DT), a * Go + _dot(dYe, Qo, DT)
            dPhi += _turn_rate(dQe, dQo, Qe, Qo)
            Cwe, Cwo = _pairs(Cw_ptr, j, N, ACC)
            dqe, dqo, dCe, dCo = _qk_backward(dQe, dQo, cos, sin, xCe, xCo, rC, Cwe, Cwo, N)
            _pairs_store(prow + N + 2 * j, tl.sum(dqe, 0), tl.sum(dqo, 0), pm)
            _pairs_store(prow + 3 * N + 2 * j, tl.sum(dqe * xCe, 0), tl.sum(dqo * xCo, 0), pm)
            _pairs_store(share + N + 2 * j[None, :], dCe, dCo, nm)
            # the phases turn q and k; the last token's phase is also the next chunk's carry. dv_j = the sum of
            # dPhi_i over i >= j in j's segment (v = theta dt is what the phases add up)
            dPhi += tl.where((i == C - 1)[:, None], dcarry[None, :], 0.0)
            if HAS_RESET:
                dv = _dot(tl.trans(same.to(ACC)), dPhi, ACC)
            else:
                dv = tl.cumsum(dPhi, 0, reverse=True)
            dcarry = tl.sum(tl.where((seg == 0)[:, None], dPhi, 0.0), axis=0)
            dangle = dv * dt[:, None] * _PI * (1.0 - th * th)
            tl.store(share + 2 * N + j[None, :], dangle.to(part_ptr.dtype.element_ty),
                     mask=valid[:, None] & (j < S)[None, :])
            # the per-token scalars: log_a = A dt (cs is its running sum), gamma = lam dt, beta = (1 - lam) dt,
            # theta dt in the phases; w_s = gamma_s + beta_{s+1}, so token s's beta gradient is dw_{s-1}
            dla = tl.cumsum(dcs, 0, reverse=True)
            # the per-token scalars again (five loads a token): cheaper than holding them through the chunk
            _, _, _, _, dt, dsp, lam, dt_n, dsp_n, lam_n, fA, dfA, A, _, _, _ = _mixer_scalars(
                zx_ptr, s_b, s_l, reset_ptr, b, h, c, L, dt_bias, A_floor, i, H, G, P, N, C, ACC, HAS_RESET)
            dgamma = dg + dw
            dbeta = _shift_down(dw, i)
            d_dt = dla * A + dgamma * lam + dbeta * (1.0 - lam) + tl.sum(dv * _PI * th, axis=1)
            dlam = (dgamma - dbeta) * dt
            d_dd_A = tl.where(fA >= A_floor, -dla * dt * dfA, 0.0)
            tl.store(g_rows + col_dt + H + h, d_dd_A.to(dzx_ptr.dtype.element_ty), mask=valid)
            # the next chunk's first token, held back one iteration, now gets its beta term (dw at our last token)
            dw_last, lam1, dt1 = _last(dw, i, C), _last(lam_n, i, C), _last(dt_n, i, C)
            t1 = (c + 1) * C
            d_dd_dt1 = (pend_dt + dw_last * (1.0 - lam1)) * _last(dsp_n, i, C)
            d_trap1 = (pend_lam - dw_last * dt1) * lam1 * (1.0 - lam1)
            tl.store(dzx_ptr + b * sg_b + t1 * sg_l + col_dt + h, d_dd_dt1.to(dzx_ptr.dtype.element_ty), mask=t1 < L)
            tl.store(dzx_ptr + b * sg_b + t1 * sg_l + col_dt + 2 * H + h, d_trap1.to(dzx_ptr.dtype.element_ty),
                     mask=t1 < L)
            # this chunk's tokens; its first waits for chunk c - 1 (unless c = 0: no beta term before token 0)
            d_dd_dt, d_trap = d_dt * dsp, dlam * lam * (1.0 - lam)
            done = valid & ((i > 0) | (t < C))  # t < C: chunk 0
            tl.store(g_rows + col_dt + h, d_dd_dt.to(dzx_ptr.dtype.element_ty), mask=done)
            tl.store(g_rows + col_dt + 2 * H + h, d_trap.to(dzx_ptr.dtype.element_ty), mask=done)
            tl.store(prow + 4 * N, tl.sum(tl.where(done, d_dd_dt, 0.0), axis=0) + tl.where(t1 < L, d_dd_dt1, 0.0))
            pend_dt, pend_lam = _first(d_dt, i), _first(dlam, i)

    @triton.jit
    def _sum_heads(part_ptr, dzx_ptr, sg_b, sg_l, L, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                   N: tl.constexpr, S: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr,
                   ACC: tl.constexpr):
        """dB, dC and dangle, the columns of dzxbcdt that several heads share: the sums of the heads' shares in
        part (B, L, H, 2N + S) (a group's heads for its B and C, all heads for the angles), in a fixed order so
        the result is deterministic; grid (B, L / TB)."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * TB + tl.arange(0, TB)
        nn, ss = tl.arange(0, NB), tl.arange(0, SB)
        valid = t < L
        mN, mS = valid[:, None] & (nn < N)[None, :], valid[:, None] & (ss < S)[None, :]
        width = 2 * N + S
        shares = part_ptr + ((b * L + t) * H * width)[:, None]
        g_rows = dzx_ptr + b * sg_b + t[:, None] * sg_l
        col_B = 2 * H * P
        dangle = tl.zeros((TB, SB), ACC)
        for g in range(G):
            dB, dC = tl.zeros((TB, NB), ACC), tl.zeros((TB, NB), ACC)
            for k in range(H // G):
                share = shares + (g * (H // G) + k) * width
                dB += tl.load(share + nn[None, :], mask=mN, other=0.0).to(ACC)
                dC += tl.load(share + N + nn[None, :], mask=mN, other=0.0).to(ACC)
                dangle += tl.load(share + 2 * N + ss[None, :], mask=mS, other=0.0).to(ACC)
            tl.store(g_rows + col_B + g * N + nn[None, :], dB.to(dzx_ptr.dtype.element_ty), mask=mN)
            tl.store(g_rows + col_B + (G + g) * N + nn[None, :], dC.to(dzx_ptr.dtype.element_ty), mask=mN)
        col_ang = 2 * H * P + 2 * G * N + 3 * H
        tl.store(g_rows + col_ang + ss[None, :], dangle.to(dzx_ptr.dtype.element_ty), mask=mS)


def _pow2(d, least=16):
    # tile sides: powers of 2 (tl.arange) and >= 16 (tl.dot); masks cover what a tile overhangs
    return max(least, 1 << (d - 1).bit_length())


def _tiles(C, P, N, dot_dtype, acc_dtype):
    """The compile-time constants of a launch. One program holds a (P, N) float32 state (32 KB at 64 x 128, 32
    registers a thread at 8 warps) plus the chunk's (C, C), (C, P) and (C, N) blocks, so registers are what
    limits these kernels: 8 warps spread the tiles over 256 threads, and num_stages=1 keeps the compiler from
    holding the next chunks' loads in flight (prefetching, with one program per SM either way, cost more
    spilled registers than it hid latency: see the README's compile figures). Smaller tiles need fewer warps."""
    PP, NP = _pow2(P), _pow2(N)
    return dict(C=C, PP=PP, NP=NP, DT=_TL_DTYPE[dot_dtype], ACC=_TL_DTYPE[acc_dtype],
                num_warps=8 if C * max(PP, NP) >= 64 * 64 else 4, num_stages=1)


def _mixer_tiles(C, P, N, dot_dtype, acc_dtype):
    """_tiles for the mixer kernels, which hold q, k and the state as their even and odd dims: NH, the tile of
    N / 2 (at least 16, tl.dot's minimum) in place of NP."""
    tiles = _tiles(C, P, N, dot_dtype, acc_dtype)
    tiles["NH"] = _pow2(N // 2)
    del tiles["NP"]
    return tiles


def _bwd_options(major):
    """What _mixer_bwd's launch on a GPU of compute capability `major`.x changes of _mixer_tiles' options. On sm_8x
    Triton lays out every product of a loop body with all warps along its rows, 16 rows a warp: at 8 warps each
    64-row tile is computed and held twice, so 4 warps do the same work with half the registers of an SM and spill
    less (9.8 KB a thread against 10.4 on sm_80, 9.1 on sm_86 and sm_89). ptxas -O3 would give it only 32 to 40
    registers and a 41-48 KB stack: capped at 255 it takes them all. On sm_90 neither helps (the cap spills 3.0 KB
    against 2.8, 4 warps 9.7; bench.py compile)."""
    return {"num_warps": 4, "maxnreg": 255} if major == 8 else {}


def _halves(states, tiles):
    # a descriptor that moves one (PP, NH) half of a saved mixer state per load or store
    return TensorDescriptor.from_tensor(states.view(-1, 2 * tiles["NH"]), [tiles["PP"], tiles["NH"]])


def _state_tiles(BH, nc, tiles, dtype, device):
    """The saved per-chunk states, (B*H, nc, PP, NP) padded to whole tiles, and a descriptor that moves one
    (PP, NP) tile per load or store. The state lives in the matmul's register layout, and a per-element pointer
    store from there holds ~100 more registers a thread than the descriptor's copy through shared memory (a TMA
    copy on Hopper)."""
    states = torch.empty(BH, nc, tiles["PP"], tiles["NP"], dtype=dtype, device=device)
    return states, _descriptor(states, tiles)


def _descriptor(states, tiles):
    return TensorDescriptor.from_tensor(states.view(-1, tiles["NP"]), [tiles["PP"], tiles["NP"]])


def _strided(t):
    # a token tensor and its (b, l, h) strides; the kernels need the last dim contiguous
    t = t if t.stride(-1) == 1 else t.contiguous()
    return (t, *t.stride()[:3])


def _reset_bytes(reset):
    return None if reset is None else reset.contiguous().view(torch.uint8)


def _launchable(x, what):
    if triton is None:
        raise RuntimeError(f"{what}: impl='triton' needs Triton, which does not import here (it ships for Linux); "
                           "use impl='torch' (MAMBA3_IMPL=torch)")
    if _version(triton.__version__) < TRITON_NEEDED:
        raise RuntimeError(f"{what}: impl='triton' needs Triton >= {'.'.join(map(str, TRITON_NEEDED))} but found "
                           f"Triton {triton.__version__}; upgrade it, or use impl='torch' (MAMBA3_IMPL=torch)")
    if not x.is_cuda and not _INTERPRETED:
        raise RuntimeError(f"{what}: impl='triton' on CPU tensors runs only through Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported, or use impl='torch'")


def _check_chunk_size(C, what):
    if not isinstance(C, int) or C < 16 or C & (C - 1):
        raise ValueError(f"{what}: impl='triton' needs chunk_size a power of 2 >= 16 (tl.dot's minimum), got {C}")


class TritonScan(torch.autograd.Function):
    """ChunkedScan's equations through _scan_fwd / _scan_bwd. x (B, L, H, P), q, k (B, L, H, N) in their own
    dtype and layout; cs, w, g (B*H, nc, C) and Sin0 (B*H, P, N) in the accumulation dtype; reset (B, L) or None.
    One launch forward, one backward."""

    @staticmethod
    def forward(ctx, x, q, k, cs, w, g, Sin0, reset):
        # the kernels index these as dense arrays (a reshape can hand back a strided view, e.g. when B = 1)
        cs, w, g, Sin0 = cs.contiguous(), w.contiguous(), g.contiguous(), Sin0.contiguous()
        B, L, H, P = x.shape
        N = q.shape[-1]
        BH, nc, C = cs.shape
        # one operand dtype for every dot: the inputs' common dtype (float64 all through for the oracle tests)
        dot_dtype = torch.float64 if cs.dtype == torch.float64 else torch.promote_types(
            torch.promote_types(x.dtype, q.dtype), k.dtype)
        ctx.meta = meta = _tiles(C, P, N, dot_dtype, cs.dtype)
        reset = _reset_bytes(reset)
        with torch.cuda.device(x.device.index if x.is_cuda else -1):  # launch on x's GPU (-1: no-op)
            states, states_desc = _state_tiles(BH, nc, meta, dot_dtype, x.device)
            S = torch.empty_like(Sin0)
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            _scan_fwd[(BH,)](*_strided(x), *_strided(q), *_strided(k), *_strided(y), cs, w, g, reset, Sin0,
                             states_desc, S, L, nc, H=H, P=P, N=N, HAS_RESET=reset is not None, **meta)
        ctx.save_for_backward(x, q, k, cs, w, g, states, reset)
        return y, S

    @staticmethod
    def backward(ctx, dy, dS):
        x, q, k, cs, w, g, states, reset = ctx.saved_tensors
        B, L, H, P = x.shape
        N = q.shape[-1]
        BH, nc, C = cs.shape
        with torch.cuda.device(x.device.index if x.is_cuda else -1):
            dx, dq, dk = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (x, q, k))
            dcs, dw, dg = torch.empty_like(cs), torch.empty_like(cs), torch.empty_like(cs)
            dSin0 = torch.empty_like(dS)
            _scan_bwd[(BH,)](*_strided(x), *_strided(q), *_strided(k), *_strided(dy), dx, dq, dk, cs, w, g, reset,
                             _descriptor(states, ctx.meta), dS.contiguous(), dcs, dw, dg, dSin0, L, nc, H=H, P=P, N=N,
                             HAS_RESET=reset is not None, **ctx.meta)
        return dx, dq, dk, dcs, dw, dg, dSin0, None


def ssd_triton(x, q, k, log_a, gamma, beta, state=None, chunk_size=64, reset=None):
    """The chunked form through the Triton kernels (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). The
    glue here is on (B, L, H) scalars only: w, the in-chunk cumsum cs and the state entering the first chunk;
    autograd carries their gradients back to log_a, gamma, beta and the state."""
    _launchable(x, "ssd")
    C = chunk_size
    _check_chunk_size(C, "ssd")
    B, L, H, P = x.shape
    N = q.shape[-1]
    nc = -(-L // C)
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    with torch.autocast(x.device.type, enabled=False):
        w, Sin0 = _chunk_glue(gamma, beta, state, x, k, dtype)

        def per_chunk(t):  # (B, L, H) -> (B*H, nc, C), zeros past L: no decay, no input
            t = F.pad(t.to(dtype), (0, 0, 0, nc * C - L))
            return t.view(B, nc, C, H).permute(0, 3, 1, 2).reshape(B * H, nc, C)

        cs = per_chunk(log_a).cumsum(-1)  # (B*H, nc, C), <= 0 and decreasing inside each chunk
        y, S = TritonScan.apply(x, q, k, cs, per_chunk(w), per_chunk(gamma), Sin0.reshape(B * H, P, N), reset)
    return y, _final_state(S.view(B, H, P, N), x, k)


def _mixer_shapes(zxbcdt, B_bias, headdim, ngroups, n_angles, chunk_size):
    """(B, L, H, P, G, N, S, C), after checking that zxbcdt and the parameters fit together and the kernels."""
    H, N = B_bias.shape
    P, G, S, C = headdim, ngroups, n_angles, chunk_size
    _check_chunk_size(C, "mixer")
    if zxbcdt.dim() != 3 or zxbcdt.shape[1] == 0 or zxbcdt.shape[2] != sum(split_sizes(H, P, G, N, S)):
        raise ValueError(f"mixer: zxbcdt must be (B, L, 2HP + 2GN + 3H + S) = (B, L, "
                         f"{sum(split_sizes(H, P, G, N, S))}) with L >= 1 for H={H}, P={P}, G={G}, N={N}, S={S}; "
                         f"got {tuple(zxbcdt.shape)}")
    if H % G or N % 2 or 2 * S > N:
        raise ValueError(f"mixer: impl='triton' needs ngroups dividing the {H} heads, d_state even and n_angles <= "
                         f"d_state / 2; got ngroups={G}, d_state={N}, n_angles={S}")
    if zxbcdt.dtype not in _TL_DTYPE:
        raise ValueError(f"mixer: impl='triton' takes zxbcdt in float16, bfloat16, float32 or float64, "
                         f"got {zxbcdt.dtype}")
    return zxbcdt.shape[0], zxbcdt.shape[1], H, P, G, N, S, C


def _mixer_forward(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, headdim, ngroups,
                   n_angles, chunk_size, A_floor, eps):
    """Launch _mixer_fwd: (out (B, L, H*P), states (B*H, nc, PP, 2NH): even state dims, then odd ones, phase
    (B*H, nc, S))."""
    Bsz, L, H, P, G, N, S, C = _mixer_shapes(zxbcdt, B_bias, headdim, ngroups, n_angles, chunk_size)
    nc = -(-L // C)
    acc = _compute_dtype(zxbcdt)
    tiles = _mixer_tiles(C, P, N, zxbcdt.dtype, acc)
    zx = zxbcdt if zxbcdt.stride(-1) == 1 else zxbcdt.contiguous()
    with torch.cuda.device(zx.device.index if zx.is_cuda else -1):
        out = zx.new_empty(Bsz, L, H * P)
        states = zx.new_empty(Bsz * H, nc, tiles["PP"], 2 * tiles["NH"])
        phase = zx.new_empty(Bsz * H, nc, S, dtype=acc)
        _mixer_fwd[(Bsz * H,)](zx, zx.stride(0), zx.stride(1), _reset_bytes(reset), dt_bias, B_norm_weight,
                               C_norm_weight, B_bias.contiguous(), C_bias.contiguous(), D, out, out.stride(0),
                               out.stride(1), _halves(states, tiles), phase, L, nc, A_floor, eps, H=H, G=G, P=P, N=N,
                               S=S, HAS_RESET=reset is not None, **tiles)
    return out, states, phase


def _mixer_backward(dout, zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, states, phase,
                    headdim, ngroups, n_angles, chunk_size, A_floor, eps):
    """Launch _mixer_bwd and _sum_heads: (dzxbcdt, d dt_bias, d B_norm_weight, d C_norm_weight, d B_bias,
    d C_bias, d D); the parameters' per-(b, h, chunk) sums are added up here."""
    Bsz, L, H, P, G, N, S, C = _mixer_shapes(zxbcdt, B_bias, headdim, ngroups, n_angles, chunk_size)
    nc = -(-L // C)
    acc = _compute_dtype(zxbcdt)
    tiles = _mixer_tiles(C, P, N, zxbcdt.dtype, acc)
    zx = zxbcdt if zxbcdt.stride(-1) == 1 else zxbcdt.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    with torch.cuda.device(zx.device.index if zx.is_cuda else -1):
        dzx = torch.empty_like(zx, memory_format=torch.contiguous_format)
        part = zx.new_empty(Bsz, L, H, 2 * N + S)
        dparam = zx.new_empty(Bsz * H, nc, 4 * N + 2, dtype=acc)
        _mixer_bwd[(Bsz * H,)](zx, zx.stride(0), zx.stride(1), _reset_bytes(reset), dt_bias, B_norm_weight,
                               C_norm_weight, B_bias.contiguous(), C_bias.contiguous(), D, dout, dout.stride(0),
                               dout.stride(1), _halves(states, tiles), phase, dzx, dzx.stride(0), dzx.stride(1),
                               part, dparam, L, nc, A_floor, eps, H=H, G=G, P=P, N=N, S=S,
                               HAS_RESET=reset is not None,
                               **tiles | _bwd_options(torch.cuda.get_device_capability(zx.device)[0] if zx.is_cuda else 0))
        TB = 32
        _sum_heads[(Bsz, triton.cdiv(L, TB))](part, dzx, dzx.stride(0), dzx.stride(1), L, H=H, G=G, P=P, N=N, S=S,
                                             TB=TB, NB=_pow2(N), SB=_pow2(S), ACC=_TL_DTYPE[acc], num_warps=4)
    dparam = dparam.view(Bsz, H, nc, 4 * N + 2).sum((0, 2))  # (H, 4N + 2)
    grads = (dparam[:, 4 * N], dparam[:, 2 * N:3 * N].sum(0), dparam[:, 3 * N:4 * N].sum(0), dparam[:, :N],
             dparam[:, N:2 * N], dparam[:, 4 * N + 1])
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    return (dzx, *(g.to(p.dtype, copy=True) for g, p in zip(grads, params)))  # copies: outputs may not alias


if triton is not None:
    # The fused region as two custom ops (forward, backward) with fake implementations and an autograd formula,
    # so that torch.compile treats the Triton launches as opaque calls with known output shapes.

    @torch.library.custom_op("mamba3::mixer_fwd", mutates_args=())
    def _mixer_fwd_op(zxbcdt: torch.Tensor, dt_bias: torch.Tensor, B_norm_weight: torch.Tensor,
                      C_norm_weight: torch.Tensor, B_bias: torch.Tensor, C_bias: torch.Tensor, D: torch.Tensor,
                      reset: Optional[torch.Tensor], headdim: int, ngroups: int, n_angles: int, chunk_size: int,
                      A_floor: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _mixer_forward(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, headdim,
                              ngroups, n_angles, chunk_size, A_floor, eps)

    @_mixer_fwd_op.register_fake
    def _(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, headdim, ngroups, n_angles,
          chunk_size, A_floor, eps):
        Bsz, L, _ = zxbcdt.shape
        H, N = B_bias.shape
        nc = -(-L // chunk_size)
        return (zxbcdt.new_empty(Bsz, L, H * headdim), zxbcdt.new_empty(Bsz * H, nc, _pow2(headdim), 2 * _pow2(N // 2)),
                zxbcdt.new_empty(Bsz * H, nc, n_angles, dtype=_compute_dtype(zxbcdt)))

    @torch.library.custom_op("mamba3::mixer_bwd", mutates_args=())
    def _mixer_bwd_op(dout: torch.Tensor, zxbcdt: torch.Tensor, dt_bias: torch.Tensor, B_norm_weight: torch.Tensor,
                      C_norm_weight: torch.Tensor, B_bias: torch.Tensor, C_bias: torch.Tensor, D: torch.Tensor,
                      reset: Optional[torch.Tensor], states: torch.Tensor, phase: torch.Tensor, headdim: int,
                      ngroups: int, n_angles: int, chunk_size: int, A_floor: float,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor]:
        return _mixer_backward(dout, zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset,
                               states, phase, headdim, ngroups, n_angles, chunk_size, A_floor, eps)

    @_mixer_bwd_op.register_fake
    def _(dout, zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, states, phase, headdim,
          ngroups, n_angles, chunk_size, A_floor, eps):
        return (torch.empty_like(zxbcdt, memory_format=torch.contiguous_format), torch.empty_like(dt_bias),
                torch.empty_like(B_norm_weight), torch.empty_like(C_norm_weight), torch.empty_like(B_bias),
                torch.empty_like(C_bias), torch.empty_like(D))

    def _mixer_setup_context(ctx, inputs, output):
        *tensors, reset = inputs[:8]
        ctx.sizes = inputs[8:]
        _, states, phase = output
        ctx.mark_non_differentiable(states, phase)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for states and phase: nothing reads them
        ctx.save_for_backward(*tensors, reset, states, phase)

    def _mixer_grad(ctx, dout, _dstates, _dphase):
        grads = _mixer_bwd_op(dout, *ctx.saved_tensors, *ctx.sizes)
        return (*grads, None, None, None, None, None, None, None)

    _mixer_fwd_op.register_autograd(_mixer_grad, setup_context=_mixer_setup_context)


def mixer_triton(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, headdim, ngroups, n_angles,
                 chunk_size=64, A_floor=1e-4, eps=1e-5, reset=None):
    """mixer_torch's region (without a decoding state) as three Triton launches: _mixer_fwd forward, _mixer_bwd
    and _sum_heads backward, through the custom op mamba3::mixer_fwd. Returns out (B, L, H*P)."""
    _launchable(zxbcdt, "mixer")
    _mixer_shapes(zxbcdt, B_bias, headdim, ngroups, n_angles, chunk_size)
    _check_reset(reset, zxbcdt.shape[0], zxbcdt.shape[1], "mixer")
    return _mixer_fwd_op(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, headdim, ngroups,
                         n_angles, chunk_size, float(A_floor), float(eps))[0]


# -----------------------------------------------------------------------------
# dispatch


def triton_available():
    """Whether Triton imported here (on a GPU, or under TRITON_INTERPRET=1 on CPU tensors)."""
    return triton is not None


def _resolve(impl, x):
    if impl == "auto":
        impl = os.environ.get("MAMBA3_IMPL") or ("triton" if x.is_cuda and triton_available() else "torch")
    if impl not in IMPLS[1:]:
        raise ValueError(f"impl must be one of {IMPLS} (or MAMBA3_IMPL one of {IMPLS[1:]}), got {impl!r}")
    return impl


def ssd(x, q, k, log_a, gamma, beta, state=None, chunk_size=64, impl="auto", reset=None):
    """The Mamba-3 scan. Returns y (B, L, H, P) in x's dtype and the final state (S, k_prev, x_prev).

    impl: "recurrent" (the oracle), "torch" (chunked, autograd), "triton" (fused kernels), or "auto":
    Triton for CUDA tensors when it imports, else torch. The environment variable MAMBA3_IMPL overrides
    "auto" (handy to A/B the paths without touching code). reset (B, L) bool: the state entering a marked
    position is zero (a document starts there)."""
    impl = _resolve(impl, x)
    _check_shapes(x, q, k, log_a, gamma, beta)
    _check_reset(reset, x.shape[0], x.shape[1], "ssd")
    if impl == "recurrent":
        return ssd_recurrent(x, q, k, log_a, gamma, beta, state, reset)
    if impl == "triton":
        return ssd_triton(x, q, k, log_a, gamma, beta, state, chunk_size, reset)
    return ssd_chunked(x, q, k, log_a, gamma, beta, state, chunk_size, reset)


def mixer(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, headdim, ngroups, n_angles,
          chunk_size=64, A_floor=1e-4, eps=1e-5, reset=None, state=None, impl="auto"):
    """The mixer region, in_proj's output -> out_proj's input: (out (B, L, H*P), state). The fused Triton path
    when impl resolves to "triton" and no decoding state is given; otherwise mixer_torch with the scan's impl
    (a decoding state (Phi, S, k_prev, x_prev) goes in and the one after the last token comes out; else None)."""
    impl = _resolve(impl, zxbcdt)
    kw = dict(headdim=headdim, ngroups=ngroups, n_angles=n_angles, chunk_size=chunk_size, A_floor=A_floor, eps=eps,
              reset=reset)
    if impl == "triton" and state is None:
        return mixer_triton(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, **kw), None
    return mixer_torch(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, state=state, impl=impl, **kw)


def _check_shapes(x, q, k, log_a, gamma, beta):
    if x.dim() != 4 or x.shape[1] == 0:
        raise ValueError(f"ssd: x must be (B, L, H, P) with L >= 1, got {tuple(x.shape)}")
    B, L, H, _ = x.shape
    if q.shape != k.shape or q.shape[:3] != (B, L, H):
        raise ValueError(f"ssd: q and k must be (B, L, H, N) = ({B}, {L}, {H}, N), got {tuple(q.shape)} and {tuple(k.shape)}")
    for name, t in (("log_a", log_a), ("gamma", gamma), ("beta", beta)):
        if t.shape != (B, L, H):
            raise ValueError(f"ssd: {name} must be (B, L, H) = {(B, L, H)}, got {tuple(t.shape)}")


def _check_reset(reset, B, L, what):
    if reset is not None and (reset.dtype != torch.bool or reset.shape != (B, L)):
        raise ValueError(f"{what}: reset must be a (B, L) = {(B, L)} bool tensor, got {reset.dtype} "
                         f"{tuple(reset.shape)}")
