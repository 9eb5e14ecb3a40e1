"""The Mamba-3 layer's math: the scan `ssd` (recurrence and chunked form) and the mixer region, from
in_proj's output to out_proj's input, in PyTorch (`mixer_torch`) and fused Triton (`mixer_triton`).

The scan, per batch element and head, with S the (P x N) state and R ranks (MIMO; R = 1 is SISO):
token t brings the rows of X_t (R x P), K_t, Q_t (R x N); the state takes the sum of their rank-1
updates (X^T K = sum_r x_r k_r^T) in both trapezoid terms, and every rank reads it:

    S_t = exp(log_a_t) * (S_{t-1} + beta_t * X_{t-1}^T K_{t-1}) + gamma_t * X_t^T K_t
    Y_t = Q_t S_t^T                         (row r: y_{t,r} = S_t q_{t,r})

x (B, L, H, P), q, k (B, L, H, N) (SISO), or with the rank axis (B, L, H, R, P|N); log_a, gamma,
beta (B, L, H). The state in and out: (S (B, H, P, N) float32, the last token's k's and x's). reset
(B, L) bool marks document starts: the state entering a marked t is zero.

The chunked form. Cut the sequence into chunks of C tokens, C*R rows (row i: rank i % R of token
i // R, whose scalars it takes); inside a chunk let cs_i be the running sum of log_a up to token i,
and w_s = gamma_s + beta_{s+1} (token s's input enters the state now with gamma_s and one step
later with the next token's beta). Then, with Sin the state entering the chunk,

    Y    = (W o Q K^T) X + e * (Q Sin^T)       W_ij = exp(cs_i - cs_j) w_j (j's token before i's),
    Sout = a Sin + (X * u)^T K                        gamma_i (one token: a full R x R block)

with e_i = exp(cs_i), u_j = f_j w_j, f_j = exp(cs_last - cs_j), a = exp(cs_last), W = 0 above its
block diagonal. (The state carried between chunks already holds the next token's beta term.) A
reset cuts a chunk into segments: seg_i counts the resets up to i, and every decay that would cross
one is zero: W_ij needs seg_i == seg_j, e_i seg_i == 0, f_j seg_j == seg_last, a seg_last == 0.

The mixer region. in_proj's output splits, per token, into z, x (H*P each) | B, C (R*G*N each: R
ranks outermost of G groups, shared by a group's heads) | dd_dt, dd_A, trap (H each) | angle (S).

    dt = softplus(dd_dt + dt_bias),  A = -max(f(dd_A), A_floor),  f(v) = 1 + v (v >= 0), 1/(1 - v)
    log_a = A dt,  lam = sigmoid(trap),  gamma = lam dt,  beta = (1 - lam) dt
    Phi_t = Phi_{t-1} + pi tanh(angle_t) dt_t  per head, S angles; restarts at resets (Phi_{-1} = 0)
    k_r = Rot(Phi)(RMSNorm(B_r) + B_bias[h, r]),  q_r = Rot(Phi)(RMSNorm(C_r) + C_bias[h, r])
    x_r = x * mimo_x[h, r],  z_r = z * mimo_z[h, r]               (MIMO; SISO: x_1 = x, z_1 = z)
    out = sum_r mimo_o[h, r] * (y_r + D x_r) * silu(z_r)          (SISO: mimo_o = 1)

with y = ssd(x_r, q_r, k_r, log_a, gamma, beta), biases (H, R, N) ((H, N) for SISO), mimo vectors
(H, R, P). Rot turns each pair of state dims (2i, 2i+1), i < S, by Phi_i; the other dims pass.
"""
import collections
import math
import os
import re
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

IMPLS = ("auto", "torch", "triton", "recurrent")


def _compute_dtype(*tensors):
    # float64 in, float64 throughout (the oracle tests); otherwise the state and cumsums are float32
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# -----------------------------------------------------------------------------
# the scan in PyTorch: the recurrence (the oracle) and the chunked form


def recurrent_step(S, k_prev, x_prev, x, q, k, log_a, gamma, beta):
    """One token of the recurrence: S (B, H, P, N); k_prev, k, q (B, H, R, N); x_prev, x
    (B, H, R, P); log_a, gamma, beta (B, H) -> (y (B, H, R, P), S_new), out of place (autograd)."""
    a, gamma, beta = log_a.exp()[..., None, None], gamma[..., None, None], beta[..., None, None]
    S = a * (S + beta * (x_prev.mT @ k_prev)) + gamma * (x.mT @ k)
    return (S @ q.mT).mT, S


def ssd_recurrent(x, q, k, log_a, gamma, beta, state, reset=None):
    """The recurrence, one token at a time (ssd's ranked case): slow, the ground truth."""
    S, k_prev, x_prev = state
    inputs = [t.to(S.dtype) for t in (x, q, k, log_a, gamma, beta)]
    ys = []
    for t in range(x.shape[1]):
        if reset is not None:  # a document starts at t: nothing before it reaches it
            keep = (~reset[:, t]).to(S.dtype)[:, None, None, None]  # (B, 1, 1, 1)
            S, k_prev, x_prev = S * keep, k_prev * keep, x_prev * keep
        y, S = recurrent_step(S, k_prev, x_prev, *(v[:, t] for v in inputs))
        ys.append(y)
        k_prev, x_prev = inputs[2][:, t], inputs[0][:, t]
    return torch.stack(ys, dim=1).to(x.dtype), (S, k[:, -1].clone(), x[:, -1].clone())


def _rows(v, R):  # a token's value (b, C) on each of its R rows: (b, C*R)
    return v if R == 1 else v.repeat_interleave(R, dim=1)


def _per_token(v, R):  # row values (b, C*R) summed over each token's R rows: (b, C)
    return v if R == 1 else v.view(v.shape[0], -1, R).sum(-1)


def _own(A, R):  # A (b, C*R, C*R) between the rows of one token: a (b, R, R, C) view (R = 1: diag)
    b, n, _ = A.shape
    return A.view(b, n // R, R, n // R, R).diagonal(dim1=1, dim2=3)


class ChunkedScan(torch.autograd.Function):
    """The chunked form on b = B*H*nc chunks of C*R rows, by hand (autograd saves more C x C tiles).

    The chunk's backward, for both fast paths (_mixer_bwd in a scaled form), with dY and G the
    gradients of Y and Sout, D_ij = exp(cs_i - cs_j) for j <= i in one segment, M = W o Q K^T:

        dX = M^T dY + u * (K G^T)       dQ = (dM o W) K + e * (dY Sin)      dM = dY X^T
        dK = (dM o W)^T Q + u * (X G)   dSin = a G + (e * dY)^T Q (the chunk before's G)
        Rm = dM o (Q K^T) o D  (what W passes on to w and cs),  du_j = x_j . (K G^T)_j
        dgamma_i = Rm_ii,    dw_j = sum_{i>j} Rm_ij + du_j f_j
        dcs_i = sum_{j<i} Rm_ij w_j - w_i sum_{l>i} Rm_li + e_i dY_i . (Q Sin^T)_i - du_i u_i
                + [i = last] (sum_j du_j u_j + a <G, Sin>)

    (cs_i enters W_ij (j < i) with +, W_li (l > i) with -, e_i, and u_i with -; cs_last every u_j
    and a.) dlog_a is dcs's reverse running sum; dgamma_s and dbeta_{s+1} get dw_s. With R > 1 it
    holds per token once its rows are summed: Rm_ii sums its own R x R block."""

    @staticmethod
    def forward(ctx, X, Q, K, cs, w, g, Sin0, seg):
        # X (b, C*R, P), Q, K (b, C*R, N), cs, w, g (b, C), Sin0 (B*H, P, N), seg (b, C) or None
        (b, CR, P), (BH, _, N), C = X.shape, Sin0.shape, cs.shape[1]
        nc, R = b // BH, CR // C
        e, f, a = cs.exp(), (cs[:, -1:] - cs).exp(), cs[:, -1].exp()  # (b, C), (b, C), (b,)
        D = (cs[:, :, None] - cs[:, None, :]).clamp_(max=0).exp_().tril_()  # (b, C, C), as above
        if seg is not None:  # no decay crosses a reset
            last = seg[:, -1:]
            e, f, a = e * (seg == 0), f * (seg == last), a * (last[:, 0] == 0)
            D.mul_(seg[:, :, None] == seg[:, None, :])
        # what each chunk adds to the state (its last w already holds the next beta)
        Xu = X * _rows(f * w, R)[..., None]  # (b, C*R, P)
        dS = torch.bmm(Xu.transpose(1, 2), K).view(BH, nc, P, N)
        # the states entering the chunks, one chunk after the other (nc = L / C: a short loop)
        a, Sin, S = a.view(BH, nc, 1, 1), torch.empty_like(dS), Sin0
        for c in range(nc):
            Sin[:, c] = S
            S = torch.addcmul(dS[:, c], a[:, c], S)
        Sin = Sin.view(b, P, N)
        # W = D o w on the chunk's rows, gamma on each token's own R x R block
        W = D * w[:, None, :]
        if R > 1:  # (a copy: with one token a chunk, reshape would keep expand's shared memory)
            W = W[:, :, None, :, None].expand(b, C, R, C, R).reshape(b, CR, CR).contiguous()
        _own(W, R).copy_(g[:, None, None, :])
        scores = torch.bmm(Q, K.transpose(1, 2))  # (b, C*R, C*R)
        M = W.mul_(scores)
        ctx.save_for_backward(X, Q, K, w, g, e, f, a, D, scores, M, Sin)  # M: as cheap as redone
        # (into Xu's dead buffer: on a CPU a fresh 4 MB buffer costs page faults)
        QS = torch.bmm(Q, Sin.transpose(1, 2), out=Xu)
        return torch.bmm(M, X).addcmul_(_rows(e, R)[..., None], QS), S

    @staticmethod
    def backward(ctx, dY, dS_final):
        # in the compute dtype, as the forward ran (torch.compile traces it under autocast)
        with torch.autocast(dY.device.type, enabled=False):
            X, Q, K, w, g, e, f, a, D, scores, M, Sin = ctx.saved_tensors
            dY = dY.to(X.dtype).contiguous()  # a view of (B, L, H, R, P); four matmuls read it
            (b, CR, P), BH, N, C = X.shape, dS_final.shape[0], Q.shape[-1], e.shape[1]
            nc, R = b // BH, CR // C
            # intra-chunk: Y = M X
            dX = torch.bmm(M.transpose(1, 2), dY)
            dMD = torch.bmm(dY, X.transpose(1, 2))
            dMD.view(b, C, R, C, R).mul_(D[:, :, None, :, None])  # dM o D, (b, C*R, C*R)
            dMW = dMD * _rows(w, R)[:, None, :]
            _own(dMW, R).copy_(_own(dMD, R) * g[:, None, None, :])  # dM o W
            dQ, dK = torch.bmm(dMW, K), torch.bmm(dMW.transpose(1, 2), Q)
            Rm = dMD.mul_(scores)
            dg = _own(Rm, R).sum((1, 2))
            colR = Rm.sum(1)  # sum_{l>=j} Rm_lj: the diagonal terms cancel in dcs and leave dw
            dw = _per_token(colR, R) - dg
            dcs = _per_token(torch.bmm(Rm, _rows(w, R)[..., None])[..., 0] - _rows(w, R) * colR, R)
            # inter-chunk: e * (Q Sin^T)
            T = torch.bmm(dY, Sin)  # (b, C*R, N)
            dcs += e * _per_token(torch.linalg.vecdot(T, Q), R)
            dQ.addcmul_(_rows(e, R)[..., None], T)
            dYe = dY * _rows(e, R)[..., None]  # (b, C*R, P)
            dSin = torch.bmm(dYe.transpose(1, 2), Q).view(BH, nc, P, N)
            # the loop over the chunks, backwards: G is the gradient of the state leaving chunk c
            a, G = a.view(BH, nc, 1, 1), dS_final
            for c in reversed(range(nc)):  # dSin's slots take each chunk's G as they free up
                G, dSin[:, c] = torch.addcmul(dSin[:, c], a[:, c], G), G
            da = torch.linalg.vecdot(dSin.flatten(2), Sin.view(BH, nc, -1)) * a.view(BH, nc)
            dS, u = dSin.view(b, P, N), f * w  # da = a <G, Sin>; each chunk added (X * u)^T K
            # (into the dead buffers of dY * e and T, as in the forward)
            dXu = torch.bmm(K, dS.transpose(1, 2), out=dYe)  # (b, C*R, P)
            dX.addcmul_(dXu, _rows(u, R)[..., None])
            dK.addcmul_(_rows(u, R)[..., None], torch.bmm(X, dS, out=T))
            du = _per_token(torch.linalg.vecdot(dXu, X), R)  # (b, C)
            dw += du * f
            dcs -= du * u
            dcs[:, -1] += (du * u).sum(-1) + da.view(b)
            return dX, dQ, dK, dcs, dw, dg, G, None  # G is now the gradient of Sin0


def ssd_chunked(x, q, k, log_a, gamma, beta, state, chunk_size=64, reset=None):
    """The chunked form (ssd's ranked case): C-token chunks are the batch of ChunkedScan's bmms."""
    (B, L, H, R, P), N, C = x.shape, q.shape[-1], chunk_size
    (S0, k_prev, x_prev), dtype = state, state[0].dtype
    with torch.autocast(x.device.type, enabled=False):
        # w_s = gamma_s + beta_{s+1} (0 after the last token); the state entering the first chunk
        # is S0 plus the first token's beta term
        w = gamma.to(dtype) + F.pad(beta[:, 1:].to(dtype), (0, 0, 0, 1))  # (B, L, H)
        beta0 = beta[:, 0, :, None, None, None].to(dtype)
        Sin0 = S0 + (beta0 * x_prev[..., :, None] * k_prev[..., None, :]).sum(2)  # (B, H, P, N)
        # padded to whole chunks with tokens that change nothing, then chunk-major:
        # (B, L, H, R, D) -> (B*H*nc, C*R, D)
        pad, nc = (-L) % C, -(-L // C)

        def chunks(t):
            t = F.pad(t.to(dtype), (0, 0) * 3 + (0, pad)) if pad else t.to(dtype)
            t = t.view(B, nc, C, H, t.shape[3], -1).permute(0, 3, 1, 2, 4, 5)
            return t.reshape(B * H * nc, -1, t.shape[-1])
        X, Q, K = chunks(x), chunks(q), chunks(k)  # (b, C*R, P|N), b = B*H*nc
        la, g, w = (chunks(t[..., None, None])[..., 0] for t in (log_a, gamma, w))  # (b, C)
        cs = la.cumsum(dim=-1)  # (b, C), <= 0 and decreasing
        seg = None if reset is None else (  # the resets counted inside each chunk (b, C)
            F.pad(reset, (0, pad)).view(B, 1, nc, C).expand(B, H, nc, C).reshape(-1, C).cumsum(-1))
        Y, S = ChunkedScan.apply(X, Q, K, cs, w, g, Sin0.view(B * H, P, N), seg)
        y = Y.view(B, H, nc, C, R, P).permute(0, 2, 3, 1, 4, 5).reshape(B, nc * C, H, R, P)[:, :L]
    return y.to(x.dtype), (S.view(B, H, P, N), k[:, -1].clone(), x[:, -1].clone())


# -----------------------------------------------------------------------------
# the mixer region in PyTorch: the fused kernels' readable twin (and the decoding cache's path)


def _f32(t):
    # dt, A, the angles and the phases in float32 (or float64 when the whole model is)
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def rotate(v, phi):
    """Rotate pairs (2i, 2i+1), i < S, of v's last dim by the angles phi (..., S); the rest pass."""
    S = phi.shape[-1]
    v0, v1, rest = v[..., 0:2 * S:2], v[..., 1:2 * S:2], v[..., 2 * S:]
    cos, sin = phi.cos(), phi.sin()
    rotated = torch.stack([v0 * cos - v1 * sin, v0 * sin + v1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


def phases(v, reset=None, phi0=None):
    """Phi_t = Phi_{t-1} + v_t along dim 1 of v (B, L, ...), restarting at each reset (B, L)
    (Phi_t = v_t there) and starting from phi0 (B, ...) where no reset has happened yet."""
    phi, start = v.cumsum(1), None if phi0 is None else phi0[:, None]
    if reset is not None:
        # subtract the running sum just before the latest reset at or before t (-1: no reset yet)
        ones = (1,) * (v.dim() - 2)  # the trailing dims of v
        last = torch.where(reset, torch.arange(reset.shape[1], device=reset.device), -1)
        last = last.cummax(1).values.view(*reset.shape, *ones)
        before = F.pad(phi, (0, 0) * len(ones) + (1, 0))[:, :-1]  # the running sum up to t - 1
        phi = phi - before.gather(1, last.clamp(min=0).expand_as(phi))
        start = None if phi0 is None else torch.where(last < 0, start, 0)  # phi0 until a reset
    return phi if start is None else phi + start


def split_sizes(H, P, G, N, S, R=1):
    """in_proj's output, in order: z | x | B | C | dd_dt | dd_A | trap | angle (B, C: R ranks)."""
    return [H * P, H * P, R * G * N, R * G * N, H, H, H, S]


def mixer_torch(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, headdim,
                ngroups, n_angles, chunk_size=64, A_floor=1e-4, eps=1e-5, reset=None, state=None,
                impl="torch", mimo=None):
    """The mixer region in PyTorch ops (scan: ssd(impl=impl)) -> (out (B, L, H*P), state). mimo:
    None (SISO) or (mimo_x, mimo_z, mimo_o). state: None or a decoding cache (Phi (B, H, S), S,
    k_prev (B, H, [R,] N), x_prev (B, H, P)), returned after the last token (None without)."""
    H, N = B_bias.shape[0], B_bias.shape[-1]
    R = 1 if mimo is None else mimo[0].shape[1]
    (Bsz, L, _), P, G = zxbcdt.shape, headdim, ngroups
    z, x, Bm, Cm, dd_dt, dd_A, trap, angle = zxbcdt.split(split_sizes(H, P, G, N, n_angles, R), -1)
    dt = F.softplus(_f32(dd_dt) + dt_bias)  # (B, L, H)
    dd_A = _f32(dd_A)
    # A = -max(f(dd_A), A_floor) with the heavy-tailed f(v) = 1 + v (v >= 0), 1 / (1 - v) (v < 0)
    f = torch.where(dd_A >= 0, 1 + dd_A, 1 / (1 - dd_A.clamp(max=0)))
    log_a = -f.clamp(min=A_floor) * dt  # (B, L, H), < 0
    lam = torch.sigmoid(_f32(trap))
    gamma, beta = lam * dt, (1 - lam) * dt
    # data-dependent rotary phases, accumulated per head and kept in [0, 2 pi)
    theta = math.pi * torch.tanh(_f32(angle))  # (B, L, S)
    phi0 = None if state is None else state[0]
    phi = torch.remainder(phases(theta[:, :, None, :] * dt[..., None], reset, phi0), 2 * math.pi)
    phi_r = phi[:, :, :, None]  # (B, L, H, 1, S): the same phases for every rank
    # B and C (R ranks of G groups, rank outermost): RMS-normalised per rank and group, per-head
    # biases, rotated; in float32, as the fused kernels (bf16 in, float32 statistics)
    Bn = F.rms_norm(_f32(Bm).view(Bsz, L, R, G, N), (N,), B_norm_weight, eps).transpose(2, 3)
    Cn = F.rms_norm(_f32(Cm).view(Bsz, L, R, G, N), (N,), C_norm_weight, eps).transpose(2, 3)
    Bn, Cn = Bn.repeat_interleave(H // G, dim=2), Cn.repeat_interleave(H // G, dim=2)
    k = rotate(_f32(Bn + B_bias.view(H, R, N)), phi_r).to(x.dtype)  # (B, L, H, R, N)
    q = rotate(_f32(Cn + C_bias.view(H, R, N)), phi_r).to(x.dtype)
    # x and z lifted to R inputs and gates per head: v_r = x * mimo_x[h, r], z_r = z * mimo_z[h, r]
    mimo_x, mimo_z, mimo_o = (None,) * 3 if mimo is None else mimo
    lift = lambda t, m: t if m is None else t * m.to(t.dtype)  # noqa: E731
    x, z = x.view(Bsz, L, H, 1, P), z.view(Bsz, L, H, 1, P)
    v, z = lift(x, mimo_x), lift(z, mimo_z)  # (B, L, H, R, P)
    scan_state = None if state is None else (  # the cache holds x: its inputs are lifted again
        state[1], state[2].view(Bsz, H, R, N), lift(state[3][:, :, None], mimo_x))
    y, final = ssd(v, q, k, log_a, gamma, beta, scan_state, chunk_size, impl, reset)
    y = (y + D[:, None, None].to(y.dtype) * v) * F.silu(z)  # (B, L, H, R, P)
    out = (y if mimo is None else (y * mimo_o.to(y.dtype)).sum(3)).reshape(Bsz, L, -1)
    return out, None if state is None else (phi[:, -1], final[0], final[1].view_as(state[2]),
                                            x[:, -1, :, 0])


# -----------------------------------------------------------------------------
# the mixer region in Triton: _mixer_fwd forward; _mixer_bwd, then _sum_heads, backward
# One program per (b, h) walks the chunks with the (P x N) float32 state on chip and saves the
# state entering each; the backward walks them in reverse with the state's gradient G on chip. A
# chunk is C rows (row i: rank i % R of token i // R), a token's scalars counted on its first row.
# Tiles: PP >= P, and N as its even and odd dims, two of NH >= N / 2 (_qk). tl.constexpr: DT, the
# dots' operand dtype (zxbcdt's), ACC, that of cumsums, states and accumulators; PREC: _mixer_tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform (macOS); impl="triton" then says so
    triton = None

TRITON_NEEDED = "3.6"  # the oldest Triton the kernels compile under (what torch 2.11 installs)


def _version(v):
    return tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", v).groups())  # "3.6.0+git..." -> (3, 6)


if triton is not None and _version(triton.__version__) >= _version(TRITON_NEEDED):
    from triton.tools.tensor_descriptor import TensorDescriptor

    # TRITON_INTERPRET=1 (read at import) runs the kernels as numpy on CPU tensors, as the tests do
    _INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)  # what triton.jit decides by
    if _INTERPRETED and _version(triton.__version__) < (3, 7):
        # Triton 3.6's interpreter takes int() of a 1-element array for a loop bound (NumPy refuses)
        from triton.runtime import interpreter as _interpreter

        def _patch_lang_tensor(tensor, scope, patch=_interpreter._patch_lang_tensor):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        _interpreter._patch_lang_tensor = _patch_lang_tensor
    _TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}
    _PI = tl.constexpr(math.pi)

    # a chunk's per-token scalars for one head, (C,) each: a namedtuple, which jit code takes
    _Scalars = collections.namedtuple("_Scalars", "dt dsp lam dt_n dsp_n lam_n fA dfA A gamma w cs")

    @triton.jit
    def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr, acc=None):
        # a b (+ acc, not a product: that gets a costlier layout) from operands in DT; PREC "ieee"
        # or "tf32" (tensor cores read 10 of float32's 23 mantissa bits). The interpreter (numpy)
        # gets bf16 as float32 and tf32 with 13 bits cut, as on a GPU
        a, b = a.to(DT), b.to(DT)
        if _INTERPRETED and DT == tl.bfloat16:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if _INTERPRETED and PREC == "tf32":
            cut = 0xFFFFE000
            a = (a.to(tl.uint32, bitcast=True) & cut).to(tl.float32, bitcast=True)
            b = (b.to(tl.uint32, bitcast=True) & cut).to(tl.float32, bitcast=True)
        if acc is None:  # (a static if: the else is not traced, where acc.dtype would fail)
            return tl.dot(a, b, input_precision=PREC)
        else:  # out_dtype: Triton 3.6 would assume float32
            return tl.dot(a, b, acc, input_precision=PREC, out_dtype=acc.dtype)

    @triton.jit
    def _at(v, i, k):
        # v's entry at row k, as a scalar (v: (C,))
        return tl.sum(tl.where(i == k, v, 0), axis=0)

    @triton.jit
    def _by_rank(v, C: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
        # (C, W) rows -> (R, W): each rank's sum over the chunk's tokens
        return tl.sum(tl.reshape(v, (C // R, R, W)), 0)

    @triton.jit
    def _in_bounds(valid, cols, ncols: tl.constexpr, TILE: tl.constexpr):
        # rows `valid` x columns < ncols of a (C, TILE) block (no column test without padding)
        mask = valid[:, None]
        if ncols != TILE:
            mask = mask & (cols < ncols)[None, :]
        return mask

    @triton.jit
    def _chunk_tokens(zx_ptr, s_b, s_l, reset_ptr, b, c, L, i, C: tl.constexpr, R: tl.constexpr,
                      HAS_RESET: tl.constexpr):
        # chunk c's rows i: tokens t, t < L, a token's first row, zxbcdt's rows; seg: the resets
        # counted through each row's token, start: the first row of the latest one (else zeros)
        t = c * (C // R) + i // R
        valid, first = t < L, i % R == 0
        rows = zx_ptr + b * s_b + t * s_l
        if HAS_RESET:
            r = tl.load(reset_ptr + b * L + t, mask=valid & first, other=0).to(tl.int32)
            seg = tl.cumsum(r, 0)
            start = tl.associative_scan(tl.where(r != 0, i, 0), 0, _maximum)
        else:
            seg, start = tl.zeros(t.shape, tl.int32), tl.zeros(t.shape, tl.int32)
        return t, valid, first, rows, seg, start

    @triton.jit
    def _maximum(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _dt_lam(rows, valid, h, col_dt, col_trap, dt_bias, ACC: tl.constexpr):
        # head h's dt = softplus(dd_dt + dt_bias) (0 past L), softplus' and lam = sigmoid(trap);
        # log1p(x) as log(1 + x) x / ((1 + x) - 1), accurate where 1 + x rounds (dt ~1e-3)
        dd_dt = tl.load(rows + col_dt + h, mask=valid, other=0.0).to(ACC)
        trap = tl.load(rows + col_trap + h, mask=valid, other=0.0).to(ACC)
        v = dd_dt + dt_bias
        ex = tl.exp(tl.minimum(v, 20.0))
        one = 1.0 + ex
        log1p = tl.where(one == 1.0, ex, tl.log(one) * ex / (one - 1.0))
        dt, dsp = tl.where(v > 20.0, v, log1p), tl.where(v > 20.0, 1.0, ex / one)
        return tl.where(valid, dt, 0.0), dsp, 1.0 / (1.0 + tl.exp(-trap))

    @triton.jit
    def _scalars(rows, t, valid, first, s_l, L, h, dt_bias, A_floor, H: tl.constexpr,
                 G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, R: tl.constexpr,
                 ACC: tl.constexpr):
        """Head h's per-token scalars on the chunk's rows, an _Scalars (*_n: the next token's)."""
        col_dt = 2 * H * P + 2 * R * G * N
        dt, dsp, lam = _dt_lam(rows, valid, h, col_dt, col_dt + 2 * H, dt_bias, ACC)
        dt_n, dsp_n, lam_n = _dt_lam(rows + s_l, t + 1 < L, h, col_dt, col_dt + 2 * H, dt_bias, ACC)
        dd_A = tl.load(rows + col_dt + H + h, mask=valid, other=0.0).to(ACC)
        neg = 1.0 / (1.0 - tl.minimum(dd_A, 0.0))  # f(v) = 1 + v (v >= 0), 1 / (1 - v), and f'
        fA, dfA = tl.where(dd_A >= 0, 1.0 + dd_A, neg), tl.where(dd_A >= 0, 1.0, neg * neg)
        A = -tl.maximum(fA, A_floor)
        gamma = lam * dt
        w = gamma + (1.0 - lam_n) * dt_n
        cs = tl.cumsum(tl.where(first, A * dt, 0.0), 0)
        return _Scalars(dt, dsp, lam, dt_n, dsp_n, lam_n, fA, dfA, A, gamma, w, cs)

    @triton.jit
    def _decays(cs, seg, start, i, tok, C: tl.constexpr):
        """decay_ij = exp(cs_i - cs_j) (C, C) for j's token up to i's, e, f, a; 0 across resets."""
        cs_last, seg_last = _at(cs, i, C - 1), _at(seg, i, C - 1)
        same = (tok[None, :] <= tok[:, None]) & (i[None, :] >= start[:, None])
        decay = tl.where(same, tl.exp(tl.minimum(cs[:, None] - cs[None, :], 0.0)), 0.0)
        e = tl.where(seg == 0, tl.exp(cs), 0.0)
        f = tl.where(seg == seg_last, tl.exp(cs_last - cs), 0.0)
        a = tl.where(seg_last == 0, tl.exp(cs_last), 0.0)
        return decay, e, f, a

    @triton.jit
    def _over_w(v, w):
        # v / w where w > 0, else 0 (there v = 0 too, or what it feeds is multiplied by 0)
        return tl.where(w > 0, v / tl.where(w > 0, w, 1.0), 0.0)

    @triton.jit
    def _phase(rows, valid, first, col_ang, S, j, dt, seg, carry, ACC: tl.constexpr,
               HAS_RESET: tl.constexpr):
        """tanh(angle) (C, NH) and the phases, carry + cumsum(pi tanh(angle) dt), reset-aware."""
        mask = valid[:, None] & (j < S)[None, :]
        ang = tl.load(rows[:, None] + col_ang + j[None, :], mask=mask, other=0.0).to(ACC)
        ex = tl.exp(-2.0 * tl.abs(ang))  # tanh without overflow
        th = tl.where(ang < 0, -1.0, 1.0) * (1.0 - ex) / (1.0 + ex)
        v = tl.where(first[:, None], (_PI * th) * dt[:, None], 0.0)
        Phi = _seg_cumsum(v, seg, False, HAS_RESET)
        return th, Phi + tl.where((seg == 0)[:, None], carry[None, :], 0.0)

    @triton.jit
    def _seg_cumsum(v, seg, REVERSE: tl.constexpr, HAS_RESET: tl.constexpr):
        # v's (C, NH) running sum inside each segment, either way: a scan of (segment, sum) pairs
        # (a product with the segment mask, a float32 dot on FMA units, spilled); one without resets
        if not HAS_RESET:
            return tl.cumsum(v, 0, reverse=REVERSE)
        segs = tl.broadcast_to(seg[:, None], v.shape)
        if REVERSE:
            return tl.associative_scan((segs, v), 0, _first_segment, reverse=True)[1]
        return tl.associative_scan((segs, v), 0, _last_segment)[1]

    @triton.jit
    def _last_segment(s1, v1, s2, v2):
        # two ranges of rows as (their last row's segment, their sum in it): seg never decreases
        s = tl.maximum(s1, s2)
        return s, tl.where(s1 == s, v1, 0.0) + tl.where(s2 == s, v2, 0.0)

    @triton.jit
    def _first_segment(s1, v1, s2, v2):
        # the same for a backward scan (the first row's segment)
        s = tl.minimum(s1, s2)
        return s, tl.where(s1 == s, v1, 0.0) + tl.where(s2 == s, v2, 0.0)

    @triton.jit
    def _pairs(ptr, j, N: tl.constexpr, ACC: tl.constexpr):
        # an (N,) parameter's even and odd entries (read each chunk: a hoisted tile holds registers)
        m = j < N // 2
        even = tl.load(ptr + 2 * j, mask=m, other=0.0).to(ACC)
        return even, tl.load(ptr + 2 * j + 1, mask=m, other=0.0).to(ACC)

    @triton.jit
    def _lift(ptr, h, rank, p, P: tl.constexpr, R: tl.constexpr, ACC: tl.constexpr):
        # mimo_x, mimo_z or mimo_o (H, R, P) of head h at each row's rank: (C, PP)
        ptrs = ptr + ((h * R + rank) * P)[:, None] + p[None, :]
        return tl.load(ptrs, mask=(p < P)[None, :], other=0.0).to(ACC)

    @triton.jit
    def _token_store(ptr, s_l, c, L, p, v, P: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                     PP: tl.constexpr):
        # v (C, PP) summed over each token's R rows, to ptr + t s_l + p for chunk c's tokens t
        v = tl.sum(tl.reshape(v, (C // R, R, PP)), 1)
        t = c * (C // R) + tl.arange(0, C // R)
        tl.store(ptr + t[:, None] * s_l + p[None, :], v.to(ptr.dtype.element_ty),
                 mask=_in_bounds(t < L, p, P, PP))

    @triton.jit
    def _pairs_store(ptr, ve, vo, mask):
        # even and odd dims back to their interleaved places (ptr: the even ones')
        tl.store(ptr, ve.to(ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + 1, vo.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk(ptrs, valid, w_ptr, b_ptr, h, rank, j, cos, sin, eps, N: tl.constexpr, R: tl.constexpr,
            NH: tl.constexpr, ACC: tl.constexpr):
        """k (from the rows' B, B's norm weight and bias) or q (C's) as even and odd dims (C, NH),
        then the normed dims and 1 / rms (two strided loads, not one tile: a pair in one layout)."""
        we, wo = _pairs(w_ptr, j, N, ACC)
        if R == 1:
            be, bo = _pairs(b_ptr + h * N, j, N, ACC)
            be, bo = be[None, :], bo[None, :]
        else:
            be, bo = _pairs(b_ptr + ((h * R + rank) * N)[:, None], j[None, :], N, ACC)
        ptr = ptrs[:, None] + 2 * j[None, :]
        mask = _in_bounds(valid, j, N // 2, NH)
        xe = tl.load(ptr, mask=mask, other=0.0).to(ACC)
        xo = tl.load(ptr + 1, mask=mask, other=0.0).to(ACC)
        rstd = 1.0 / tl.sqrt((tl.sum(xe * xe, 1) + tl.sum(xo * xo, 1)) / N + eps)
        he, ho = xe * rstd[:, None], xo * rstd[:, None]
        ve, vo = he * we[None, :] + be, ho * wo[None, :] + bo
        keep = valid[:, None]
        turned_e = tl.where(keep, ve * cos - vo * sin, 0.0)
        return turned_e, tl.where(keep, ve * sin + vo * cos, 0.0), he, ho, rstd

    @triton.jit
    def _qk_backward(dKe, dKo, cos, sin, he, ho, rstd, w_ptr, dbias, dweight, j, N: tl.constexpr,
                     C: tl.constexpr, R: tl.constexpr, NH: tl.constexpr, ACC: tl.constexpr):
        # from a turned q or k's gradient, stores the bias's and norm weight's (the chunk's sums);
        # returns the B or C row's (dx = rstd (dh - h mean(h dh)))
        we, wo = _pairs(w_ptr, j, N, ACC)  # read again: cheaper than held through the chunk
        dve, dvo = dKe * cos + dKo * sin, dKo * cos - dKe * sin
        dhe, dho = dve * we[None, :], dvo * wo[None, :]
        mean = ((tl.sum(dhe * he, 1) + tl.sum(dho * ho, 1)) / N)[:, None]
        dxe, dxo = rstd[:, None] * (dhe - he * mean), rstd[:, None] * (dho - ho * mean)
        if R == 1:
            _pairs_store(dbias + 2 * j, tl.sum(dve, 0), tl.sum(dvo, 0), j < N // 2)
        else:  # (R, N): each rank's sum
            ptrs = dbias + (tl.arange(0, R) * N)[:, None] + 2 * j[None, :]
            _pairs_store(ptrs, _by_rank(dve, C, R, NH), _by_rank(dvo, C, R, NH),
                         (j < N // 2)[None, :])
        _pairs_store(dweight + 2 * j, tl.sum(dve * he, 0), tl.sum(dvo * ho, 0), j < N // 2)
        return dxe, dxo

    @triton.jit
    def _mixer_fwd(zx_ptr, s_b, s_l, reset_ptr, dt_bias_ptr, Bw_ptr, Cw_ptr, Bb_ptr, Cb_ptr, D_ptr,
                   mx_ptr, mz_ptr, mo_ptr, out_ptr, so_b, so_l, states, phase_ptr, L, nc, A_floor,
                   eps, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                   S: tl.constexpr, C: tl.constexpr, R: tl.constexpr, PP: tl.constexpr,
                   NH: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                   HAS_RESET: tl.constexpr):
        """The mixer region forward, grid (B*H,), to out (B, L, H*P). Saves the state entering each
        chunk in DT (`states`: (B*H*nc*PP, 2NH), even dims then odd) and its phase (B*H, nc, S)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        i, p, j = tl.arange(0, C), tl.arange(0, PP), tl.arange(0, NH)
        tok, rank = i // R, i % R
        dt_bias, D = tl.load(dt_bias_ptr + h).to(ACC), tl.load(D_ptr + h).to(ACC)
        Se, So, carry = tl.zeros((PP, NH), ACC), tl.zeros((PP, NH), ACC), tl.zeros((NH,), ACC)
        col_ang = 2 * H * P + 2 * R * G * N + 3 * H
        # each row's rank of its head's group's B; its C is R*G*N columns later
        col_B = 2 * H * P + (h // (H // G)) * N + rank * (G * N)
        for c in range(nc):
            t, valid, first, rows, seg, start = _chunk_tokens(zx_ptr, s_b, s_l, reset_ptr, b, c, L,
                                                              i, C, R, HAS_RESET)
            sc = _scalars(rows, t, valid, first, s_l, L, h, dt_bias, A_floor, H, G, P, N, R, ACC)
            # the phases, and from them k and q (in DT: they only feed dots)
            tl.store(phase_ptr + (bh * nc + c) * S + j, carry, mask=j < S)
            _, Phi = _phase(rows, valid, first, col_ang, S, j, sc.dt, seg, carry, ACC, HAS_RESET)
            last = tl.sum(tl.where((i == C - 1)[:, None], Phi, 0.0), axis=0)
            carry = last - 2 * _PI * tl.floor(last / (2 * _PI))  # the next chunk's, in [0, 2 pi)
            cos, sin = tl.cos(Phi), tl.sin(Phi)
            Ke, Ko = _qk(rows + col_B, valid, Bw_ptr, Bb_ptr, h, rank, j, cos, sin, eps, N, R, NH,
                         ACC)[:2]
            Qe, Qo = _qk(rows + col_B + R * G * N, valid, Cw_ptr, Cb_ptr, h, rank, j, cos, sin, eps,
                         N, R, NH, ACC)[:2]
            Kwe, Kwo = (Ke * sc.w[:, None]).to(DT), (Ko * sc.w[:, None]).to(DT)
            Qe, Qo = Qe.to(DT), Qo.to(DT)
            # the scan, scaled: M o (Q Kw^T) = W o (Q K^T) with M decay between tokens, gamma / w
            # within one, Kw = w k (W, a tile times a row vector, spilled); the D skip, the gate
            decay, e, f, a = _decays(sc.cs, seg, start, i, tok, C)
            xz = rows[:, None] + h * P + p[None, :]
            xz_mask = _in_bounds(valid, p, P, PP)
            X = tl.load(xz + H * P, mask=xz_mask, other=0.0)
            if R > 1:  # the rows' inputs v_r = x mimo_x[h, r]
                X = (X.to(ACC) * _lift(mx_ptr, h, rank, p, P, R, ACC)).to(DT)
            row = ((bh * nc + c) * PP).to(tl.int32)
            states.store([row, 0], Se.to(DT))
            states.store([row, NH], So.to(DT))
            scores = _dot(Qe, tl.trans(Kwe), DT, PREC) + _dot(Qo, tl.trans(Kwo), DT, PREC)
            QS = _dot(Qe, tl.trans(Se.to(DT)), DT, PREC) + _dot(Qo, tl.trans(So.to(DT)), DT, PREC)
            own = tok[:, None] == tok[None, :]
            MS = tl.where(own, _over_w(sc.gamma, sc.w)[:, None], decay) * scores
            Y = _dot(MS, X, DT, PREC) + e[:, None] * QS
            Xf = tl.trans((X * f[:, None]).to(DT))
            Se, So = a * Se + _dot(Xf, Kwe, DT, PREC), a * So + _dot(Xf, Kwo, DT, PREC)
            Z = tl.load(xz, mask=xz_mask, other=0.0).to(ACC)
            if R > 1:
                Z = Z * _lift(mz_ptr, h, rank, p, P, R, ACC)
            out = (Y + D * X.to(ACC)) * Z * tl.sigmoid(Z)
            if R == 1:
                tl.store(out_ptr + b * so_b + t[:, None] * so_l + h * P + p[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=xz_mask)
            else:  # sum_r mimo_o[h, r] y_r: a token from its R rows
                _token_store(out_ptr + b * so_b + h * P, so_l, c, L, p,
                             out * _lift(mo_ptr, h, rank, p, P, R, ACC), P, C, R, PP)

    @triton.jit
    def _mixer_bwd(zx_ptr, s_b, s_l, reset_ptr, dt_bias_ptr, Bw_ptr, Cw_ptr, Bb_ptr, Cb_ptr, D_ptr,
                   mx_ptr, mz_ptr, mo_ptr, dout_ptr, sd_b, sd_l, states, phase_ptr, dzx_ptr, sg_b,
                   sg_l, part_ptr, dparam_ptr, dmimo_ptr, L, nc, A_floor, eps,
                   H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                   S: tl.constexpr, C: tl.constexpr, R: tl.constexpr, PP: tl.constexpr,
                   NH: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                   HAS_RESET: tl.constexpr):
        """The mixer region backward, grid (B*H,): the chunks in reverse, each recomputed, with G
        and the phase carry's gradient on chip. Writes head h's columns of dzxbcdt, its share of the
        shared ones to part (B, L, H, 2RN + S), per-chunk parameter gradient sums to dparam
        (B*H, nc, 2RN + 2N + 2) and dmimo (B*H, nc, 3, R, P). ChunkedScan's gradients, scaled
        (Kw = w k, M, f for u): Rw = dM o M o (Q Kw^T) and df = x . (Kw G^T) carry the w factors, so
        dw = (sum_l Rw_lj + df_j f_j) / w_j, dK = w dKw. A chunk's first token's beta enters w in
        chunk c - 1, so its gradients are written one iteration later (pend_*)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        i, p, j = tl.arange(0, C), tl.arange(0, PP), tl.arange(0, NH)
        tok, rank = i // R, i % R
        dt_bias, D = tl.load(dt_bias_ptr + h).to(ACC), tl.load(D_ptr + h).to(ACC)
        Ge, Go, dcarry = tl.zeros((PP, NH), ACC), tl.zeros((PP, NH), ACC), tl.zeros((NH,), ACC)
        pend_dt, pend_lam = tl.zeros_like(dt_bias), tl.zeros_like(dt_bias)
        col_dt = 2 * H * P + 2 * R * G * N
        col_B = 2 * H * P + (h // (H // G)) * N + rank * (G * N)
        width = 2 * R * N + S  # of a row of part
        for step in range(nc):
            c = nc - 1 - step
            t, valid, first, rows, seg, start = _chunk_tokens(zx_ptr, s_b, s_l, reset_ptr, b, c, L,
                                                              i, C, R, HAS_RESET)
            sc = _scalars(rows, t, valid, first, s_l, L, h, dt_bias, A_floor, H, G, P, N, R, ACC)
            w = sc.w
            carry = tl.load(phase_ptr + (bh * nc + c) * S + j, mask=j < S, other=0.0)
            th, Phi = _phase(rows, valid, first, col_dt + 3 * H, S, j, sc.dt, seg, carry, ACC,
                             HAS_RESET)
            cos, sin = tl.cos(Phi), tl.sin(Phi)
            Ke, Ko, xBe, xBo, rB = _qk(rows + col_B, valid, Bw_ptr, Bb_ptr, h, rank, j, cos, sin,
                                       eps, N, R, NH, ACC)
            Qe, Qo, xCe, xCo, rC = _qk(rows + col_B + R * G * N, valid, Cw_ptr, Cb_ptr, h, rank, j,
                                       cos, sin, eps, N, R, NH, ACC)
            if R == 1:
                qk = tl.sum(Qe * Ke + Qo * Ko, 1)
            Kwe, Kwo = (Ke * w[:, None]).to(DT), (Ko * w[:, None]).to(DT)
            xBe, xBo = xBe.to(DT), xBo.to(DT)
            Qe, Qo, xCe, xCo = Qe.to(DT), Qo.to(DT), xCe.to(DT), xCo.to(DT)
            xz_mask = _in_bounds(valid, p, P, PP)
            xz = rows[:, None] + h * P + p[None, :]
            X = tl.load(xz + H * P, mask=xz_mask, other=0.0)
            if R > 1:
                X = (X.to(ACC) * _lift(mx_ptr, h, rank, p, P, R, ACC)).to(DT)
            row = ((bh * nc + c) * PP).to(tl.int32)
            Se, So = states.load([row, 0]), states.load([row, NH])
            # the gate and the D skip: out = (y + D x) * z * sigmoid(z); y recomputed
            decay, e, f, a = _decays(sc.cs, seg, start, i, tok, C)
            own = tok[:, None] == tok[None, :]  # a token's own R x R block
            M = tl.where(own, _over_w(sc.gamma, w)[:, None], decay)
            scores = _dot(Qe, tl.trans(Kwe), DT, PREC) + _dot(Qo, tl.trans(Kwo), DT, PREC)
            QS = _dot(Qe, tl.trans(Se), DT, PREC) + _dot(Qo, tl.trans(So), DT, PREC)
            MS = M * scores
            Y = _dot(MS, X, DT, PREC, D * X.to(ACC)) + e[:, None] * QS  # with the D skip
            Z = tl.load(xz, mask=xz_mask, other=0.0).to(ACC)
            dout = tl.load(dout_ptr + b * sd_b + t[:, None] * sd_l + h * P + p[None, :],
                           mask=xz_mask, other=0.0).to(ACC)
            g_rows = dzx_ptr + b * sg_b + t * sg_l
            xz = g_rows[:, None] + h * P + p[None, :]
            if R > 1:  # z_r = z mimo_z, out = sum_r mimo_o y_r gated: per-(b, h, chunk) sums
                z_in, mz, mo = Z, _lift(mz_ptr, h, rank, p, P, R, ACC), _lift(mo_ptr, h, rank, p,
                                                                             P, R, ACC)
                Z = z_in * mz
                gm = (dmimo_ptr + (bh * nc + c) * 3 * R * P + (tl.arange(0, R) * P)[:, None]
                      + p[None, :])
                tl.store(gm + 2 * R * P, _by_rank(dout * Y * Z * tl.sigmoid(Z), C, R, PP),
                         mask=(p < P)[None, :])
                dout = dout * mo
            sz = tl.sigmoid(Z)
            dY = dout * Z * sz
            dZ = dout * Y * sz * (1.0 + Z * (1.0 - sz))
            if R == 1:
                tl.store(xz, dZ.to(dzx_ptr.dtype.element_ty), mask=xz_mask)
            else:
                tl.store(gm + R * P, _by_rank(dZ * z_in, C, R, PP), mask=(p < P)[None, :])
                _token_store(dzx_ptr + b * sg_b + h * P, sg_l, c, L, p, dZ * mz, P, C, R, PP)
            dYX = tl.sum(dY * X.to(ACC), axis=1)  # dM's diagonal
            # dparam's row: dB_bias, dC_bias (R*N each), dB_norm_w, dC_norm_w (N each), ddt_bias, dD
            prow = dparam_ptr + (bh * nc + c) * (2 * R * N + 2 * N + 2)
            tl.store(prow + 2 * R * N + 2 * N + 1, tl.sum(dYX))
            dcs = e * tl.sum(dY * QS, axis=1)
            KGt = _dot(Kwe, tl.trans(Ge), DT, PREC) + _dot(Kwo, tl.trans(Go), DT, PREC)  # (C, P)
            df = tl.sum(X.to(ACC) * KGt, axis=1)
            dX = _dot(tl.trans(MS), dY, DT, PREC, D * dY) + f[:, None] * KGt
            if R == 1:
                tl.store(xz + H * P, dX.to(dzx_ptr.dtype.element_ty), mask=xz_mask)
            else:  # x and mimo_x read again: cheaper than held through the chunk
                x_in = tl.load(rows[:, None] + H * P + h * P + p[None, :], mask=xz_mask, other=0.0)
                mx = _lift(mx_ptr, h, rank, p, P, R, ACC)
                tl.store(gm, _by_rank(dX * x_in.to(ACC), C, R, PP), mask=(p < P)[None, :])
                _token_store(dzx_ptr + b * sg_b + (H + h) * P, sg_l, c, L, p, dX * mx, P, C, R, PP)
            dM = _dot(dY, tl.trans(X), DT, PREC)
            dMM = dM * M
            if R == 1:
                dg = dYX * qk
            else:  # the token's own block of dM o (Q K^T), Q K^T = (Q Kw^T) / w there
                dg = _over_w(tl.sum(tl.where(own, dM * scores, 0.0), axis=1), w)
            Rw = tl.where(tok[None, :] < tok[:, None], dM * MS, 0.0)
            col = tl.sum(Rw, axis=0)
            dcs += tl.sum(Rw, axis=1) - col - df * f
            dw = _over_w(col + df * f, w)
            GS = tl.sum(Ge * Se.to(ACC)) + tl.sum(Go * So.to(ACC))  # <G, Sin>
            dcs += tl.where(i == C - 1, tl.sum(df * f, axis=0) + a * GS, 0.0)
            # k: its phase gradient, and this head's share of dB (the group's heads share B)
            dMMt = tl.trans(dMM.to(DT))
            dKe = _dot(dMMt, Qe, DT, PREC) + f[:, None] * _dot(X, Ge, DT, PREC)
            dKo = _dot(dMMt, Qo, DT, PREC) + f[:, None] * _dot(X, Go, DT, PREC)
            # a turned pair moves as (-v1, v0): dPhi = dv1 v0 - dv0 v1 (Kw, dKw give k's)
            dPhi = dKo * Kwe - dKe * Kwo
            dKe, dKo = w[:, None] * dKe, w[:, None] * dKo
            dBe, dBo = _qk_backward(dKe, dKo, cos, sin, xBe, xBo, rB, Bw_ptr, prow,
                                    prow + 2 * R * N, j, N, C, R, NH, ACC)
            # (rank * N: each rank's columns; 0 on the first rows, which write the angles)
            share = part_ptr + (((b * L + t) * H + h) * width + rank * N)[:, None]
            nm = _in_bounds(valid, j, N // 2, NH)
            _pairs_store(share + 2 * j[None, :], dBe, dBo, nm)
            # q likewise, and the state's gradient for the chunk before
            dQe = _dot(dMM.to(DT), Kwe, DT, PREC) + e[:, None] * _dot(dY, Se, DT, PREC)
            dQo = _dot(dMM.to(DT), Kwo, DT, PREC) + e[:, None] * _dot(dY, So, DT, PREC)
            dYe = tl.trans((dY * e[:, None]).to(DT))
            Ge, Go = a * Ge + _dot(dYe, Qe, DT, PREC), a * Go + _dot(dYe, Qo, DT, PREC)
            dPhi += dQo * Qe - dQe * Qo
            dCe, dCo = _qk_backward(dQe, dQo, cos, sin, xCe, xCo, rC, Cw_ptr, prow + R * N,
                                    prow + 2 * R * N + N, j, N, C, R, NH, ACC)
            _pairs_store(share + R * N + 2 * j[None, :], dCe, dCo, nm)
            # the carry: the last token's phase; dv_j (v = theta dt): dPhi from j on, in j's segment
            dPhi += tl.where((i == C - 1)[:, None], dcarry[None, :], 0.0)
            dv = _seg_cumsum(dPhi, seg, True, HAS_RESET)
            dcarry = tl.sum(tl.where((seg == 0)[:, None], dPhi, 0.0), axis=0)
            dangle = dv * sc.dt[:, None] * _PI * (1.0 - th * th)
            tl.store(share + 2 * R * N + j[None, :], dangle.to(part_ptr.dtype.element_ty),
                     mask=(valid & first)[:, None] & (j < S)[None, :])
            # the per-token scalars, on each token's first row: log_a = A dt, gamma = lam dt,
            # beta = (1 - lam) dt, theta dt; w_s = gamma_s + beta_{s+1}, so dbeta_s = dw_{s-1}
            dla = tl.cumsum(dcs, 0, reverse=True)
            # the scalars again (five loads a token): cheaper than holding them through the chunk
            sc = _scalars(rows, t, valid, first, s_l, L, h, dt_bias, A_floor, H, G, P, N, R, ACC)
            dgamma = dg + dw
            if R > 1:  # summed over each token's rows, on each of them
                dgamma = tl.sum(tl.where(own, dgamma[None, :], 0.0), axis=1)
            # dw summed over the rows of the token before each row's (0 on the first)
            dbeta = tl.sum(tl.where(tok[:, None] == tok[None, :] + 1, dw[None, :], 0.0), axis=1)
            d_dt = dla * sc.A + dgamma * sc.lam + dbeta * (1.0 - sc.lam)
            d_dt += tl.sum(dv * _PI * th, axis=1)
            dlam = (dgamma - dbeta) * sc.dt
            d_dd_A = tl.where(sc.fA >= A_floor, -dla * sc.dt * sc.dfA, 0.0)
            ty = dzx_ptr.dtype.element_ty
            tl.store(g_rows + col_dt + H + h, d_dd_A.to(ty), mask=valid & first)
            # the next chunk's first token, held back one iteration, gets its beta term (our dw)
            dw_last = tl.sum(tl.where(tok == C // R - 1, dw, 0.0), axis=0)
            lam1, dt1 = _at(sc.lam_n, i, C - 1), _at(sc.dt_n, i, C - 1)
            t1 = (c + 1) * (C // R)
            d_dd_dt1 = (pend_dt + dw_last * (1.0 - lam1)) * _at(sc.dsp_n, i, C - 1)
            d_trap1 = (pend_lam - dw_last * dt1) * lam1 * (1.0 - lam1)
            tl.store(dzx_ptr + b * sg_b + t1 * sg_l + col_dt + h, d_dd_dt1.to(ty), mask=t1 < L)
            tl.store(dzx_ptr + b * sg_b + t1 * sg_l + col_dt + 2 * H + h, d_trap1.to(ty),
                     mask=t1 < L)
            # this chunk's tokens; its first waits for chunk c - 1 (unless c = 0)
            d_dd_dt, d_trap = d_dt * sc.dsp, dlam * sc.lam * (1.0 - sc.lam)
            done = valid & first & ((i > 0) | (t < C // R))  # t < C / R: chunk 0
            tl.store(g_rows + col_dt + h, d_dd_dt.to(ty), mask=done)
            tl.store(g_rows + col_dt + 2 * H + h, d_trap.to(ty), mask=done)
            tl.store(prow + 2 * R * N + 2 * N, tl.sum(tl.where(done, d_dd_dt, 0.0), axis=0)
                     + tl.where(t1 < L, d_dd_dt1, 0.0))  # d dt_bias
            pend_dt, pend_lam = _at(d_dt, i, 0), _at(dlam, i, 0)

    @triton.jit
    def _sum_heads(part_ptr, dzx_ptr, sg_b, sg_l, L, R, H: tl.constexpr, G: tl.constexpr,
                   P: tl.constexpr, N: tl.constexpr, S: tl.constexpr, TB: tl.constexpr,
                   NB: tl.constexpr, SB: tl.constexpr, ACC: tl.constexpr):
        """dB, dC and dangle: the heads' shares in part summed in a fixed order; grid (B, L/TB)."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * TB + tl.arange(0, TB)
        nn, ss = tl.arange(0, NB), tl.arange(0, SB)
        valid = t < L
        mN, mS = valid[:, None] & (nn < N)[None, :], valid[:, None] & (ss < S)[None, :]
        width = 2 * R * N + S
        shares = part_ptr + ((b * L + t) * H * width)[:, None]
        g_rows = dzx_ptr + b * sg_b + t[:, None] * sg_l
        col_B = 2 * H * P
        ty = dzx_ptr.dtype.element_ty
        for g in range(G):
            for r in range(R):
                dB, dC = tl.zeros((TB, NB), ACC), tl.zeros((TB, NB), ACC)
                for k in range(H // G):
                    share = shares + (g * (H // G) + k) * width + r * N
                    dB += tl.load(share + nn[None, :], mask=mN, other=0.0).to(ACC)
                    dC += tl.load(share + R * N + nn[None, :], mask=mN, other=0.0).to(ACC)
                tl.store(g_rows + col_B + (r * G + g) * N + nn[None, :], dB.to(ty), mask=mN)
                tl.store(g_rows + col_B + ((R + r) * G + g) * N + nn[None, :], dC.to(ty), mask=mN)
        dangle = tl.zeros((TB, SB), ACC)
        for k in range(H):
            dangle += tl.load(shares + k * width + 2 * R * N + ss[None, :], mask=mS,
                              other=0.0).to(ACC)
        col_ang = 2 * H * P + 2 * R * G * N + 3 * H
        tl.store(g_rows + col_ang + ss[None, :], dangle.to(ty), mask=mS)


def _pow2(d, least=16):
    # tile sides: powers of 2 (tl.arange) and >= 16 (tl.dot); masks cover what a tile overhangs
    return max(least, 1 << (d - 1).bit_length())


def _mixer_tiles(chunk_size, P, N, dtype, R=1):
    """A mixer launch's constexprs for zxbcdt of `dtype`. float32 takes tf32 products (true float32
    ones run on FMA units, and spill) in chunks of <= 32 rows (at 64 sm_90 would need 224 KB)."""
    C = min(chunk_size * R, 32) if dtype == torch.float32 else chunk_size * R
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(C=C, R=R, PP=_pow2(P), NH=_pow2(N // 2), DT=_TL_DTYPE[dtype], ACC=_TL_DTYPE[acc],
                PREC="tf32" if dtype == torch.float32 else "ieee")


# What each kernel's tuner times besides its default, by compute capability major: options that
# leave every result bit (stages and a register cap never change the arithmetic; warps may split
# tl.sum differently), of those that fit (tools/gpu_evidence.py compile --configs candidates).
TUNE = {("_mixer_fwd", 9): [{"num_stages": 2}], ("_mixer_bwd", 9): [{"num_stages": 2}],
         ("_mixer_bwd", 8): [{"num_stages": 2}],
         ("_sum_heads", 8): [{"num_warps": 8}, {"num_stages": 1}],
         ("_sum_heads", 9): [{"num_warps": 8}, {"num_stages": 1}]}


def launch_configs(kernel, major, tiles):
    """The launch options kernel's tuner times on compute capability major.x (0: the interpreter),
    the default first. Registers limit the mixer kernels: 8 warps for wide tiles, no early loads;
    the sm_8x backward spills less at 255 registers, 4 warps for 64-row chunks (gpu_evidence.py)."""
    if kernel == "_sum_heads":
        base = {"num_warps": 4, "num_stages": 3}
    else:
        C, wide = tiles["C"], max(tiles["PP"], 2 * tiles["NH"])
        base = {"num_warps": 8 if C * wide >= 32 * 128 else 4, "num_stages": 1}
        if kernel == "_mixer_bwd" and major == 8 and base["num_warps"] == 8:
            base |= {"num_warps": 4 if C >= 64 else 8, "maxnreg": 255}
    return [base] + [base | extra for extra in TUNE.get((kernel, major), [])]


TUNED = {}  # (kernel, device, constexprs) -> the launch options that ran it fastest there


def _time(launch):
    try:
        return triton.testing.do_bench(launch)  # milliseconds, the mean of ~100 ms of runs
    except triton.runtime.errors.OutOfResources:  # more shared memory than this GPU gives a block
        return math.inf


def _tuned(kernel, grid, *args, **constexprs):
    """kernel[grid](*args) in the fastest of its launch_configs, timed at a shape's first launch
    on each device, on its own arguments (the kernels only store: timing leaves one run's)."""
    major = torch.cuda.get_device_capability(args[0].device)[0] if args[0].is_cuda else 0
    configs = launch_configs(kernel.fn.__name__, major, constexprs)
    key = (kernel.fn.__name__, str(args[0].device), tuple(constexprs.items()))
    if len(configs) > 1 and key not in TUNED:
        TUNED[key] = min(configs, key=lambda options: _time(
            lambda: kernel[grid](*args, **constexprs, **options)))
    kernel[grid](*args, **constexprs, **TUNED.get(key, configs[0]))


# The most shared memory (KiB) a backward block asks over Triton 3.6-3.9 and sm_80-sm_90 (float32:
# 160 under Triton 3.7, more than sm_86/89 give)
_SHARED_KIB = {torch.float32: 160, torch.bfloat16: 89, torch.float16: 89}


def fused_refusal(x):
    """Why the fused kernels cannot run for zxbcdt x on its GPU, in one sentence, or None."""
    if not x.is_cuda:
        return None
    gpu = torch.cuda.get_device_properties(x.device)
    has = getattr(gpu, "shared_memory_per_block_optin", 0) // 1024
    if x.dtype == torch.float64:
        return ("float64: the fused backward would need 256 KB of shared memory a block, more than "
                "any GPU has")
    if gpu.major < 8:
        return (f"{gpu.name} has compute capability {gpu.major}.{gpu.minor}: the fused kernels "
                f"need 8.0 or newer (bf16 and tf32 tensor cores)")
    if has and has < _SHARED_KIB.get(x.dtype, 0):
        return (f"{gpu.name} gives a block {has} KB of shared memory and the fused "
                f"{str(x.dtype).removeprefix('torch.')} backward may ask {_SHARED_KIB[x.dtype]} KB "
                f"(bf16 autocast asks less)")
    return None


def _setup(zxbcdt, B_bias, sizes, mimo, reset):
    """A launch's shapes (B, L, H, P, G, N, S, C, R), tiles, chunks, accumulator dtype, zxbcdt,
    mimo vectors and reset, once the inputs and the kernels fit together (checked here, by the op
    and its fake alike, so that eager calls and torch.compile traces refuse the same)."""
    (P, G, S, C), H, N = sizes, B_bias.shape[0], B_bias.shape[-1]
    R = 1 if mimo[0] is None else mimo[0].shape[1]
    if mimo[0] is not None and (R < 2 or R > 32 or R & (R - 1)):
        raise ValueError(f"mixer: impl='triton' needs mimo_rank (--mimo-rank) 1 (SISO) or a power "
                         f"of 2 from 2 to 32 (a token's rows in a chunk); got {R}: use "
                         f"impl='torch' (MAMBA3_IMPL=torch) for other ranks")
    width = sum(split_sizes(H, P, G, N, S, R))
    if (zxbcdt.dim() != 3 or zxbcdt.shape[1] == 0 or zxbcdt.shape[2] != width
            or zxbcdt.dtype not in _TL_DTYPE):
        raise ValueError(f"mixer: impl='triton' takes zxbcdt (B, L >= 1, 2HP + 2RGN + 3H + S = "
                         f"{width}) for H={H}, P={P}, R={R}, G={G}, N={N}, S={S} in float16, "
                         f"bfloat16, float32 or float64; got {tuple(zxbcdt.shape)} {zxbcdt.dtype}")
    if C * R < 16 or C & (C - 1) or H % G or N % 2 or 2 * S > N:  # (the op's schema: C an int)
        raise ValueError(f"mixer: impl='triton' needs chunk_size a power of 2 with chunk_size x "
                         f"mimo_rank >= 16 (tl.dot's minimum), ngroups dividing the {H} heads, "
                         f"d_state even and n_angles <= d_state / 2; got chunk_size={C}, rank {R}, "
                         f"ngroups={G}, d_state={N}, n_angles={S}")
    _check_reset(reset, *zxbcdt.shape[:2], "mixer")
    tiles = _mixer_tiles(C, P, N, zxbcdt.dtype, R)
    nc = -(-zxbcdt.shape[1] // (tiles["C"] // R))  # a chunk of C rows holds C / R tokens
    zx = zxbcdt if zxbcdt.stride(-1) == 1 else zxbcdt.contiguous()
    mimo = [None if m is None else m.contiguous() for m in mimo]
    reset = None if reset is None else reset.contiguous().view(torch.uint8)
    shapes = (zxbcdt.shape[0], zxbcdt.shape[1], H, P, G, N, S, C, R)
    return shapes, tiles, nc, _compute_dtype(zxbcdt), zx, mimo, reset


def _halves(states, tiles):
    # (PP, NH) halves of saved states through a descriptor: ~100 fewer registers than pointers
    PP, NH = tiles["PP"], tiles["NH"]
    return TensorDescriptor.from_tensor(states.view(-1, 2 * NH), [PP, NH])


# The fused region as two custom ops with fake implementations and an autograd formula, opaque
# to torch.compile. The mimo vectors come last, None for SISO (empty tensors their gradients).
Tensor, Mimo = torch.Tensor, Optional[torch.Tensor]


@torch.library.custom_op("mamba3::mixer_fwd", mutates_args=())
def _mixer_fwd_op(zxbcdt: Tensor, dt_bias: Tensor, B_norm_weight: Tensor, C_norm_weight: Tensor,
                  B_bias: Tensor, C_bias: Tensor, D: Tensor, reset: Optional[Tensor], headdim: int,
                  ngroups: int, n_angles: int, chunk_size: int, A_floor: float, eps: float,
                  mimo_x: Mimo = None, mimo_z: Mimo = None, mimo_o: Mimo = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Launch _mixer_fwd: (out (B, L, H*P), states (B*H, nc, PP, 2NH), phase (B*H, nc, S))."""
    (Bsz, L, H, P, G, N, S, _, _), tiles, nc, acc, zx, mimo, reset = _setup(
        zxbcdt, B_bias, (headdim, ngroups, n_angles, chunk_size), (mimo_x, mimo_z, mimo_o), reset)
    with torch.cuda.device(zx.device.index if zx.is_cuda else -1):  # on zx's GPU (-1: no-op)
        out = zx.new_empty(Bsz, L, H * P)
        states = zx.new_empty(Bsz * H, nc, tiles["PP"], 2 * tiles["NH"])
        phase = zx.new_empty(Bsz * H, nc, S, dtype=acc)
        _tuned(_mixer_fwd, (Bsz * H,), zx, zx.stride(0), zx.stride(1), reset, dt_bias,
               B_norm_weight, C_norm_weight, B_bias.contiguous(), C_bias.contiguous(), D, *mimo,
               out, out.stride(0), out.stride(1), _halves(states, tiles), phase, L, nc, A_floor,
               eps, H=H, G=G, P=P, N=N, S=S, HAS_RESET=reset is not None, **tiles)
    return out, states, phase


@_mixer_fwd_op.register_fake
def _(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, headdim, ngroups,
      n_angles, chunk_size, A_floor, eps, mimo_x=None, mimo_z=None, mimo_o=None):
    (Bsz, L, H, P, _, _, S, _, _), tiles, nc, acc, zx, _, _ = _setup(
        zxbcdt, B_bias, (headdim, ngroups, n_angles, chunk_size), (mimo_x, mimo_z, mimo_o), reset)
    return (zx.new_empty(Bsz, L, H * P), zx.new_empty(Bsz * H, nc, tiles["PP"], 2 * tiles["NH"]),
            zx.new_empty(Bsz * H, nc, S, dtype=acc))


@torch.library.custom_op("mamba3::mixer_bwd", mutates_args=())
def _mixer_bwd_op(dout: Tensor, zxbcdt: Tensor, dt_bias: Tensor, B_norm_weight: Tensor,
                  C_norm_weight: Tensor, B_bias: Tensor, C_bias: Tensor, D: Tensor,
                  reset: Optional[Tensor], states: Tensor, phase: Tensor, headdim: int,
                  ngroups: int, n_angles: int, chunk_size: int, A_floor: float, eps: float,
                  mimo_x: Mimo = None, mimo_z: Mimo = None, mimo_o: Mimo = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor]:
    """Launch _mixer_bwd, _sum_heads: dzxbcdt and the parameters' gradients (SISO mimo: empty)."""
    (Bsz, L, H, P, G, N, S, _, R), tiles, nc, acc, zx, lifts, reset = _setup(
        zxbcdt, B_bias, (headdim, ngroups, n_angles, chunk_size), (mimo_x, mimo_z, mimo_o), reset)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    width = 2 * R * N + 2 * N + 2  # of a row of dparam
    with torch.cuda.device(zx.device.index if zx.is_cuda else -1):
        dzx = torch.empty_like(zx, memory_format=torch.contiguous_format)
        part = zx.new_empty(Bsz, L, H, 2 * R * N + S)
        dparam = zx.new_empty(Bsz * H, nc, width, dtype=acc)
        dmimo = None if mimo_x is None else zx.new_empty(Bsz * H, nc, 3, R, P, dtype=acc)
        _tuned(_mixer_bwd, (Bsz * H,), zx, zx.stride(0), zx.stride(1), reset, dt_bias,
               B_norm_weight, C_norm_weight, B_bias.contiguous(), C_bias.contiguous(), D, *lifts,
               dout, dout.stride(0), dout.stride(1), _halves(states, tiles), phase, dzx,
               dzx.stride(0), dzx.stride(1), part, dparam, dmimo, L, nc, A_floor, eps, H=H, G=G,
               P=P, N=N, S=S, HAS_RESET=reset is not None, **tiles)
        _tuned(_sum_heads, (Bsz, triton.cdiv(L, 32)), part, dzx, dzx.stride(0), dzx.stride(1), L, R,
               H=H, G=G, P=P, N=N, S=S, TB=32, NB=_pow2(N), SB=_pow2(S), ACC=_TL_DTYPE[acc])
    # the parameters' per-(b, h, chunk) sums added up; copies: a custom op's outputs may not alias
    dparam = dparam.view(Bsz, H, nc, width).sum((0, 2))  # (H, 2RN + 2N + 2)
    dB_bias, dC_bias = dparam[:, :2 * R * N].view(H, 2, *B_bias.shape[1:]).unbind(1)
    dB_w, dC_w = dparam[:, 2 * R * N:-2].view(H, 2, N).sum(0)
    grads = (dparam[:, -2], dB_w, dC_w, dB_bias, dC_bias, dparam[:, -1])
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    grads = [g.to(p.dtype, copy=True) for g, p in zip(grads, params)]
    if mimo_x is None:
        return (dzx, *grads, *(zx.new_empty(0) for _ in range(3)))
    dmimo = dmimo.view(Bsz, H, nc, 3, R, P).sum((0, 2)).unbind(1)  # 3 x (H, R, P)
    return (dzx, *grads, *(g.to(m.dtype, copy=True) for g, m in zip(dmimo, lifts)))


@_mixer_bwd_op.register_fake
def _(dout, zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset, states,
      phase, headdim, ngroups, n_angles, chunk_size, A_floor, eps, mimo_x=None, mimo_z=None,
      mimo_o=None):
    tensors = (zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    mimo = [zxbcdt.new_empty(0) if m is None else torch.empty_like(m)
            for m in (mimo_x, mimo_z, mimo_o)]
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors), *mimo)


def _mixer_setup_context(ctx, inputs, output):
    ctx.sizes = inputs[8:14]
    ctx.mark_non_differentiable(*output[1:])  # states and phase
    ctx.set_materialize_grads(False)  # no zero-filled gradients for states and phase: unread
    ctx.save_for_backward(*inputs[:8], *output[1:], *inputs[14:])  # (mimo: last)


def _mixer_grad(ctx, dout, _dstates, _dphase):
    saved = ctx.saved_tensors
    grads = _mixer_bwd_op(dout, *saved[:10], *ctx.sizes, *saved[10:])
    mimo = [None if m is None else g for m, g in zip(saved[10:], grads[7:])]
    return (*grads[:7], *[None] * 7, *mimo)


_mixer_fwd_op.register_autograd(_mixer_grad, setup_context=_mixer_setup_context)


def mixer_triton(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, headdim,
                 ngroups, n_angles, chunk_size=64, A_floor=1e-4, eps=1e-5, reset=None, mimo=None):
    """mixer_torch's out (without a decoding state) from the custom op mamba3::mixer_fwd."""
    torch_path = "use impl='torch' (MAMBA3_IMPL=torch)"
    if triton is None or _version(triton.__version__) < _version(TRITON_NEEDED):
        found = f"found Triton {triton.__version__}" if triton else "none imports (Linux only)"
        raise RuntimeError(f"mixer: impl='triton' needs Triton >= {TRITON_NEEDED} but {found}; "
                           f"install or upgrade it, or {torch_path}")
    if why := fused_refusal(zxbcdt):
        raise RuntimeError(f"mixer: impl='triton' cannot run here: {why}; {torch_path}")
    if not zxbcdt.is_cuda and not _INTERPRETED:
        raise RuntimeError(f"mixer: impl='triton' on CPU tensors runs only through Triton's "
                           f"interpreter: set TRITON_INTERPRET=1 before importing triton, or "
                           f"{torch_path}")
    return _mixer_fwd_op(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, reset,
                         headdim, ngroups, n_angles, chunk_size, float(A_floor), float(eps),
                         *(mimo or ()))[0]


# -----------------------------------------------------------------------------
# dispatch


def triton_available():
    """Whether Triton imported here (on a GPU, or under TRITON_INTERPRET=1 on CPU tensors)."""
    return triton is not None


def _resolve(impl, x):
    if impl == "auto":
        fast = "triton" if x.is_cuda and triton_available() else "torch"
        impl = os.environ.get("MAMBA3_IMPL") or fast
    if impl not in IMPLS[1:]:
        raise ValueError(f"impl must be one of {IMPLS} (or MAMBA3_IMPL one of {IMPLS[1:]}), "
                         f"got {impl!r}")
    return impl


def _check_reset(reset, B, L, what):
    if reset is not None and (reset.dtype != torch.bool or reset.shape != (B, L)):
        raise ValueError(f"{what}: reset must be a (B, L) = {(B, L)} bool tensor, got "
                         f"{reset.dtype} {tuple(reset.shape)}")


def ssd(x, q, k, log_a, gamma, beta, state=None, chunk_size=64, impl="auto", reset=None):
    """The scan (the module docstring's shapes): y as x, and the final state (S, k_prev, x_prev).
    impl: "recurrent", "torch" (chunked) or "auto" ("torch" unless MAMBA3_IMPL says "recurrent").
    Triton runs the scan only inside the mixer region: impl="triton" is refused here."""
    if impl == "triton":
        raise ValueError("ssd: the scan alone has no Triton kernel (Triton runs it inside the "
                         "mixer region: mixer(impl='triton')); use impl='torch' or 'recurrent'")
    impl = "recurrent" if _resolve(impl, x) == "recurrent" else "torch"
    shapes = [tuple(t.shape) for t in (x, q, k, log_a, gamma, beta)]
    if (x.dim() not in (4, 5) or x.shape[1] == 0 or q.shape != k.shape
            or q.shape[:-1] != x.shape[:-1] or any(s != shapes[0][:3] for s in shapes[3:])):
        raise ValueError(f"ssd: x must be (B, L >= 1, H, [R,] P), q and k (B, L, H, [R,] N), "
                         f"log_a, gamma and beta (B, L, H); got {shapes}")
    _check_reset(reset, x.shape[0], x.shape[1], "ssd")
    if x.dim() == 4:  # SISO: the same scan with a rank axis of one
        state = None if state is None else (state[0], state[1][:, :, None], state[2][:, :, None])
        y, (S, k_last, x_last) = ssd(x[:, :, :, None], q[:, :, :, None], k[:, :, :, None], log_a,
                                     gamma, beta, state, chunk_size, impl, reset)
        return y[:, :, :, 0], (S, k_last[:, :, 0], x_last[:, :, 0])
    # both forms start from (S0, k_prev, x_prev) in the compute dtype, zeros without a state
    if state is None:
        (B, _, H, R, P), N = x.shape, k.shape[-1]
        state = (x.new_zeros(B, H, P, N), k.new_zeros(B, H, R, N), x.new_zeros(B, H, R, P))
    state = tuple(t.to(_compute_dtype(x, q, k, log_a, gamma, beta)) for t in state)
    if impl == "recurrent":
        return ssd_recurrent(x, q, k, log_a, gamma, beta, state, reset)
    return ssd_chunked(x, q, k, log_a, gamma, beta, state, chunk_size, reset)


def mixer(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D, *, headdim, ngroups,
          n_angles, chunk_size=64, A_floor=1e-4, eps=1e-5, reset=None, state=None, impl="auto",
          mimo=None):
    """The mixer region, in_proj's output -> out_proj's input: (out (B, L, H*P), state).

    impl: "recurrent" or "torch" (mixer_torch), "triton" (mixer_triton; with a decoding state
    mixer_torch's chunked scan), or "auto" (MAMBA3_IMPL, else Triton for CUDA tensors when it
    imports). Where the fused kernels cannot run (fused_refusal), "auto" warns and takes the
    PyTorch path, "triton" refuses."""
    asked = impl if impl != "auto" else os.environ.get("MAMBA3_IMPL")
    impl = _resolve(impl, zxbcdt)
    why = impl == "triton" and asked is None and fused_refusal(zxbcdt)
    if why and not torch.compiler.is_compiling():  # (a warning in a compile trace breaks the graph)
        warnings.warn(f"mixer: {why}; it runs on the PyTorch path (MAMBA3_IMPL=torch chooses that "
                      f"without this note)", stacklevel=2)
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    kw = dict(headdim=headdim, ngroups=ngroups, n_angles=n_angles, chunk_size=chunk_size,
              A_floor=A_floor, eps=eps, reset=reset)
    if impl == "triton" and state is None and not why:
        return mixer_triton(zxbcdt, *params, mimo=mimo, **kw), None
    scan = "torch" if impl == "triton" else impl  # with a decoding state, or where Triton cannot
    return mixer_torch(zxbcdt, *params, state=state, impl=scan, mimo=mimo, **kw)
