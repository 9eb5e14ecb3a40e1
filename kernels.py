"""The Mamba-3 layer's math: the scan `ssd` (recurrence and chunked form)
and the mixer region, from in_proj's output to out_proj's input, in PyTorch
(`mixer_torch`) and fused Triton (`mixer_triton`).

The scan, per batch element and head, with S the (P x N) state and R ranks
(MIMO; R = 1 is SISO): token t brings the rows of X_t (R x P), K_t, Q_t
(R x N); the state takes the sum of their rank-1 updates
(X^T K = sum_r x_r k_r^T) in both trapezoid terms, and every rank reads it:

    S_t = exp(log_a_t) * (S_{t-1} + beta_t * X_{t-1}^T K_{t-1})
          + gamma_t * X_t^T K_t
    Y_t = Q_t S_t^T               (row r: y_{t,r} = S_t q_{t,r})

x (B, L, H, P), q, k (B, L, H, N) (SISO), or with the rank axis
(B, L, H, R, P|N); log_a, gamma, beta (B, L, H). The state in and out:
(S (B, H, P, N) float32, the last token's k's and x's). reset (B, L) bool
marks document starts: the state entering a marked t is zero.

The chunked form. Cut the sequence into chunks of C tokens, C*R rows
(row i: rank i % R of token i // R, whose scalars it takes); inside a chunk
let cs_i be the running sum of log_a up to token i, and
w_s = gamma_s + beta_{s+1} (token s's input enters the state now with
gamma_s and one step later with the next token's beta). Then, with Sin the
state entering the chunk,

    Y    = (W o Q K^T) X + e * (Q Sin^T)
    Sout = a Sin + (X * u)^T K
    W_ij = exp(cs_i - cs_j) w_j   (j's token before i's),
           gamma_i                (one token: a full R x R block)

with e_i = exp(cs_i), u_j = f_j w_j, f_j = exp(cs_last - cs_j),
a = exp(cs_last), W = 0 above its block diagonal. (The state carried
between chunks already holds the next token's beta term.) A reset cuts a
chunk into segments: seg_i counts the resets up to i, and every decay that
would cross one is zero: W_ij needs seg_i == seg_j, e_i seg_i == 0,
f_j seg_j == seg_last, a seg_last == 0.

The mixer region. in_proj's output splits, per token, into z, x (H*P each)
| B, C (R*G*N each: R ranks outermost of G groups, shared by a group's
heads) | dd_dt, dd_A, trap (H each) | angle (S).

    dt = softplus(dd_dt + dt_bias)
    A = -max(f(dd_A), A_floor),   f(v) = 1 + v (v >= 0), 1/(1 - v)
    log_a = A dt,   lam = sigmoid(trap)
    gamma = lam dt,   beta = (1 - lam) dt
    Phi_t = Phi_{t-1} + pi tanh(angle_t) dt_t   per head, S angles;
            restarts at resets (Phi_{-1} = 0)
    k_r = Rot(Phi)(RMSNorm(B_r) + B_bias[h, r])
    q_r = Rot(Phi)(RMSNorm(C_r) + C_bias[h, r])
    x_r = x * mimo_x[h, r],   z_r = z * mimo_z[h, r]
          (MIMO; SISO: x_1 = x, z_1 = z)
    out = sum_r mimo_o[h, r] * (y_r + D x_r) * silu(z_r)
          (SISO: mimo_o = 1)

with y = ssd(x_r, q_r, k_r, log_a, gamma, beta), biases (H, R, N)
((H, N) for SISO), mimo vectors (H, R, P). Rot turns each pair of state
dims (2i, 2i+1), i < S, by Phi_i; the other dims pass.
"""
import collections
import math
import os
import re
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

IMPLS = ("auto", "torch", "triton", "recurrent")


def _compute_dtype(*tensors):
    # float64 inputs stay float64 throughout, as the oracle tests need;
    # otherwise the state and the cumsums are float32.
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _check_reset(reset, B, L, what):
    if reset is None:
        return
    if reset.dtype != torch.bool or reset.shape != (B, L):
        raise ValueError(f"{what}: reset must be a (B, L) = {(B, L)} bool "
                         f"tensor, got {reset.dtype} {tuple(reset.shape)}")


# -----------------------------------------------------------------------------
# the scan in PyTorch: the recurrence (the oracle) and the chunked form


def recurrent_step(S, k_prev, x_prev, x, q, k, log_a, gamma, beta):
    """One token of the recurrence, out of place (for autograd).

    S (B, H, P, N); k_prev, k, q (B, H, R, N); x_prev, x (B, H, R, P);
    log_a, gamma, beta (B, H) -> (y (B, H, R, P), S_new).
    """
    a = log_a.exp()[..., None, None]
    gamma = gamma[..., None, None]
    beta = beta[..., None, None]
    S = a * (S + beta * (x_prev.mT @ k_prev)) + gamma * (x.mT @ k)
    y = (S @ q.mT).mT
    return y, S


def ssd_recurrent(x, q, k, log_a, gamma, beta, state, reset=None):
    """The recurrence, one token at a time (ssd's ranked case): slow, the
    ground truth."""
    S, k_prev, x_prev = state
    inputs = [t.to(S.dtype) for t in (x, q, k, log_a, gamma, beta)]
    ys = []
    for t in range(x.shape[1]):
        if reset is not None:
            # A document starts at t: nothing before it reaches it.
            # keep (B, 1, 1, 1)
            keep = (~reset[:, t]).to(S.dtype)[:, None, None, None]
            S = S * keep
            k_prev = k_prev * keep
            x_prev = x_prev * keep
        # Token t's x, q, k, log_a, gamma and beta, in that order.
        token = [v[:, t] for v in inputs]
        y, S = recurrent_step(S, k_prev, x_prev, *token)
        ys.append(y)
        # The next token's beta term reads this token's k and x.
        k_prev = token[2]
        x_prev = token[0]
    y = torch.stack(ys, dim=1).to(x.dtype)
    return y, (S, k[:, -1].clone(), x[:, -1].clone())


def _rows(v, R):
    # A token's value (b, C) on each of its R rows: (b, C*R).
    if R == 1:
        return v
    return v.repeat_interleave(R, dim=1)


def _per_token(v, R):
    # Row values (b, C*R) summed over each token's R rows: (b, C).
    if R == 1:
        return v
    return v.view(v.shape[0], -1, R).sum(-1)


def _own(A, R):
    # A (b, C*R, C*R) between the rows of one token, as a (b, R, R, C)
    # view; with R = 1, the diagonal.
    b, n, _ = A.shape
    blocks = A.view(b, n // R, R, n // R, R)
    return blocks.diagonal(dim1=1, dim2=3)


class ChunkedScan(torch.autograd.Function):
    """The chunked form on b = B*H*nc chunks of C*R rows, by hand (autograd
    saves more C x C tiles).

    The chunk's backward, for both fast paths (_mixer_bwd in a scaled
    form), with dY and G the gradients of Y and Sout,
    D_ij = exp(cs_i - cs_j) for j <= i in one segment, M = W o Q K^T:

        dM = dY X^T
        dX = M^T dY + u * (K G^T)
        dQ = (dM o W) K + e * (dY Sin)
        dK = (dM o W)^T Q + u * (X G)
        dSin = a G + (e * dY)^T Q         (the chunk before's G)
        Rm = dM o (Q K^T) o D             (what W passes on to w and cs)
        du_j = x_j . (K G^T)_j
        dgamma_i = Rm_ii
        dw_j = sum_{i>j} Rm_ij + du_j f_j
        dcs_i = sum_{j<i} Rm_ij w_j - w_i sum_{l>i} Rm_li
                + e_i dY_i . (Q Sin^T)_i - du_i u_i
                + [i = last] (sum_j du_j u_j + a <G, Sin>)

    (cs_i enters W_ij (j < i) with +, W_li (l > i) with -, e_i, and u_i
    with -; cs_last every u_j and a.) dlog_a is dcs's reverse running sum;
    dgamma_s and dbeta_{s+1} get dw_s. With R > 1 it holds per token once
    its rows are summed: Rm_ii sums its own R x R block.
    """

    @staticmethod
    def forward(ctx, X, Q, K, cs, w, g, Sin0, seg):
        # X (b, C*R, P), Q, K (b, C*R, N), cs, w, g (b, C),
        # Sin0 (B*H, P, N), seg (b, C) or None.
        b, CR, P = X.shape
        BH, _, N = Sin0.shape
        C = cs.shape[1]
        nc = b // BH
        R = CR // C
        # The decays: e, f (b, C) and a (b,).
        e = cs.exp()
        f = (cs[:, -1:] - cs).exp()
        a = cs[:, -1].exp()
        # D (b, C, C), as in the class docstring.
        D = cs[:, :, None] - cs[:, None, :]
        D = D.clamp_(max=0).exp_().tril_()
        if seg is not None:
            # No decay crosses a reset.
            last = seg[:, -1:]
            e = e * (seg == 0)
            f = f * (seg == last)
            a = a * (last[:, 0] == 0)
            D.mul_(seg[:, :, None] == seg[:, None, :])
        # What each chunk adds to the state (its last w already holds the
        # next token's beta): Xu (b, C*R, P), dS (B*H, nc, P, N).
        Xu = X * _rows(f * w, R)[..., None]
        dS = torch.bmm(Xu.transpose(1, 2), K).view(BH, nc, P, N)
        # The states entering the chunks, one chunk after the other
        # (nc = L / C: a short loop).
        a = a.view(BH, nc, 1, 1)
        Sin = torch.empty_like(dS)
        S = Sin0
        for c in range(nc):
            Sin[:, c] = S
            S = torch.addcmul(dS[:, c], a[:, c], S)
        Sin = Sin.view(b, P, N)
        # W = D o w on the chunk's rows, gamma on each token's own R x R
        # block.
        W = D * w[:, None, :]
        if R > 1:
            # A copy: with one token a chunk, reshape would keep expand's
            # shared memory.
            W = W[:, :, None, :, None].expand(b, C, R, C, R)
            W = W.reshape(b, CR, CR).contiguous()
        _own(W, R).copy_(g[:, None, None, :])
        # scores (b, C*R, C*R)
        scores = torch.bmm(Q, K.transpose(1, 2))
        M = W.mul_(scores)
        # M is saved: keeping it costs about what redoing it would.
        ctx.save_for_backward(X, Q, K, w, g, e, f, a, D, scores, M, Sin)
        # Q Sin^T goes into Xu's dead buffer: on a CPU a fresh 4 MB buffer
        # costs page faults.
        QS = torch.bmm(Q, Sin.transpose(1, 2), out=Xu)
        Y = torch.bmm(M, X).addcmul_(_rows(e, R)[..., None], QS)
        return Y, S

    @staticmethod
    def backward(ctx, dY, dS_final):
        # In the compute dtype, as the forward ran (torch.compile traces
        # it under autocast).
        with torch.autocast(dY.device.type, enabled=False):
            saved = ctx.saved_tensors
            X, Q, K, w, g, e, f, a, D, scores, M, Sin = saved
            # dY is a view of (B, L, H, R, P); four matmuls read it.
            dY = dY.to(X.dtype).contiguous()
            b, CR, P = X.shape
            BH = dS_final.shape[0]
            N = Q.shape[-1]
            C = e.shape[1]
            nc = b // BH
            R = CR // C
            w_rows = _rows(w, R)
            e_rows = _rows(e, R)[..., None]
            # Intra-chunk: Y = M X.
            dX = torch.bmm(M.transpose(1, 2), dY)
            dMD = torch.bmm(dY, X.transpose(1, 2))
            # dM o D (b, C*R, C*R), then dM o W.
            dMD.view(b, C, R, C, R).mul_(D[:, :, None, :, None])
            dMW = dMD * w_rows[:, None, :]
            _own(dMW, R).copy_(_own(dMD, R) * g[:, None, None, :])
            dQ = torch.bmm(dMW, K)
            dK = torch.bmm(dMW.transpose(1, 2), Q)
            Rm = dMD.mul_(scores)
            dg = _own(Rm, R).sum((1, 2))
            # sum_{l>=j} Rm_lj: the diagonal terms cancel in dcs and leave
            # dw.
            colR = Rm.sum(1)
            dw = _per_token(colR, R) - dg
            Rm_w = torch.bmm(Rm, w_rows[..., None])[..., 0]
            dcs = _per_token(Rm_w - w_rows * colR, R)
            # Inter-chunk: e * (Q Sin^T). T (b, C*R, N).
            T = torch.bmm(dY, Sin)
            dcs += e * _per_token(torch.linalg.vecdot(T, Q), R)
            dQ.addcmul_(e_rows, T)
            # dYe (b, C*R, P)
            dYe = dY * e_rows
            dSin = torch.bmm(dYe.transpose(1, 2), Q).view(BH, nc, P, N)
            # The loop over the chunks, backwards: G is the gradient of the
            # state leaving chunk c; dSin's slots take each chunk's G as
            # they free up.
            a = a.view(BH, nc, 1, 1)
            G = dS_final
            for c in reversed(range(nc)):
                G_in = torch.addcmul(dSin[:, c], a[:, c], G)
                dSin[:, c] = G
                G = G_in
            # da = a <G, Sin>
            GSin = torch.linalg.vecdot(dSin.flatten(2), Sin.view(BH, nc, -1))
            da = GSin * a.view(BH, nc)
            # Each chunk added (X * u)^T K.
            dS = dSin.view(b, P, N)
            u = f * w
            u_rows = _rows(u, R)[..., None]
            # Into the dead buffers of dY * e and T, as in the forward.
            # dXu (b, C*R, P)
            dXu = torch.bmm(K, dS.transpose(1, 2), out=dYe)
            dX.addcmul_(dXu, u_rows)
            dK.addcmul_(u_rows, torch.bmm(X, dS, out=T))
            # du (b, C)
            du = _per_token(torch.linalg.vecdot(dXu, X), R)
            dw += du * f
            dcs -= du * u
            dcs[:, -1] += (du * u).sum(-1) + da.view(b)
            # G is now the gradient of Sin0.
            return dX, dQ, dK, dcs, dw, dg, G, None


def ssd_chunked(x, q, k, log_a, gamma, beta, state, chunk_size=64,
                reset=None):
    """The chunked form (ssd's ranked case): C-token chunks are the batch
    of ChunkedScan's bmms."""
    B, L, H, R, P = x.shape
    N = q.shape[-1]
    C = chunk_size
    S0, k_prev, x_prev = state
    dtype = S0.dtype
    with torch.autocast(x.device.type, enabled=False):
        # w_s = gamma_s + beta_{s+1} (0 after the last token): w (B, L, H).
        beta_next = F.pad(beta[:, 1:].to(dtype), (0, 0, 0, 1))
        w = gamma.to(dtype) + beta_next
        # The state entering the first chunk is S0 plus the first token's
        # beta term: Sin0 (B, H, P, N).
        beta0 = beta[:, 0, :, None, None, None].to(dtype)
        first = beta0 * x_prev[..., :, None] * k_prev[..., None, :]
        Sin0 = S0 + first.sum(2)
        # Padded to whole chunks with tokens that change nothing, then
        # chunk-major: (B, L, H, R, D) -> (B*H*nc, C*R, D).
        pad = (-L) % C
        nc = -(-L // C)

        def chunks(t):
            t = t.to(dtype)
            if pad:
                t = F.pad(t, (0, 0) * 3 + (0, pad))
            t = t.view(B, nc, C, H, t.shape[3], -1)
            t = t.permute(0, 3, 1, 2, 4, 5)
            return t.reshape(B * H * nc, -1, t.shape[-1])

        def token_chunks(t):
            # A per-token scalar (B, L, H) -> (B*H*nc, C).
            return chunks(t[..., None, None])[..., 0]

        # X, Q, K (b, C*R, P|N), b = B*H*nc
        X = chunks(x)
        Q = chunks(q)
        K = chunks(k)
        # log_a, gamma, w (b, C)
        la = token_chunks(log_a)
        g = token_chunks(gamma)
        w = token_chunks(w)
        # cs (b, C) is <= 0 and decreasing.
        cs = la.cumsum(dim=-1)
        seg = None
        if reset is not None:
            # The resets counted inside each chunk (b, C).
            seg = F.pad(reset, (0, pad)).view(B, 1, nc, C)
            seg = seg.expand(B, H, nc, C).reshape(-1, C).cumsum(-1)
        Sin0 = Sin0.view(B * H, P, N)
        Y, S = ChunkedScan.apply(X, Q, K, cs, w, g, Sin0, seg)
        y = Y.view(B, H, nc, C, R, P).permute(0, 2, 3, 1, 4, 5)
        y = y.reshape(B, nc * C, H, R, P)[:, :L]
    final = (S.view(B, H, P, N), k[:, -1].clone(), x[:, -1].clone())
    return y.to(x.dtype), final


# -----------------------------------------------------------------------------
# the mixer region in PyTorch: the fused kernels' readable twin (and the
# decoding cache's path)


def _f32(t):
    # dt, A, the angles and the phases are float32 (or float64 when the
    # whole model is).
    if t.dtype in (torch.float32, torch.float64):
        return t
    return t.float()


def rotate(v, phi):
    """Rotate pairs (2i, 2i+1), i < S, of v's last dim by the angles phi
    (..., S); the rest pass."""
    S = phi.shape[-1]
    v0 = v[..., 0:2 * S:2]
    v1 = v[..., 1:2 * S:2]
    rest = v[..., 2 * S:]
    cos = phi.cos()
    sin = phi.sin()
    turned = [v0 * cos - v1 * sin, v0 * sin + v1 * cos]
    rotated = torch.stack(turned, dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1)


def phases(v, reset=None, phi0=None):
    """Phi_t = Phi_{t-1} + v_t along dim 1 of v (B, L, ...), restarting at
    each reset (B, L) (Phi_t = v_t there) and starting from phi0 (B, ...)
    where no reset has happened yet."""
    phi = v.cumsum(1)
    start = None
    if phi0 is not None:
        start = phi0[:, None]
    if reset is not None:
        # Subtract the running sum just before the latest reset at or
        # before t (-1: no reset yet). ones: the trailing dims of v.
        ones = (1,) * (v.dim() - 2)
        steps = torch.arange(reset.shape[1], device=reset.device)
        last = torch.where(reset, steps, -1)
        last = last.cummax(1).values.view(*reset.shape, *ones)
        # The running sum up to t - 1.
        before = F.pad(phi, (0, 0) * len(ones) + (1, 0))[:, :-1]
        latest = last.clamp(min=0).expand_as(phi)
        phi = phi - before.gather(1, latest)
        if phi0 is not None:
            # phi0 counts until the first reset.
            start = torch.where(last < 0, start, 0)
    if start is None:
        return phi
    return phi + start


def split_sizes(H, P, G, N, S, R=1):
    """in_proj's output, in order: z | x | B | C | dd_dt | dd_A | trap |
    angle (B, C: R ranks)."""
    return [H * P, H * P, R * G * N, R * G * N, H, H, H, S]


def _lift(t, m):
    # t times a mimo vector m (MIMO), or t itself (SISO: m is None).
    if m is None:
        return t
    return t * m.to(t.dtype)


def mixer_torch(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias,
                C_bias, D, *, headdim, ngroups, n_angles, chunk_size=64,
                A_floor=1e-4, eps=1e-5, reset=None, state=None,
                impl="torch", mimo=None):
    """The mixer region in PyTorch ops (scan: ssd(impl=impl)) ->
    (out (B, L, H*P), state).

    mimo: None (SISO) or (mimo_x, mimo_z, mimo_o). state: None or a
    decoding cache (Phi (B, H, S), S, k_prev (B, H, [R,] N),
    x_prev (B, H, P)), returned after the last token (None without).
    """
    H = B_bias.shape[0]
    N = B_bias.shape[-1]
    R = 1
    if mimo is not None:
        R = mimo[0].shape[1]
    B, L, _ = zxbcdt.shape
    P = headdim
    G = ngroups
    sizes = split_sizes(H, P, G, N, n_angles, R)
    z, x, Bm, Cm, dd_dt, dd_A, trap, angle = zxbcdt.split(sizes, -1)
    # dt (B, L, H)
    dt = F.softplus(_f32(dd_dt) + dt_bias)
    dd_A = _f32(dd_A)
    # A = -max(f(dd_A), A_floor) with the heavy-tailed f(v) = 1 + v
    # (v >= 0), 1 / (1 - v) (v < 0); log_a (B, L, H) is < 0.
    f = torch.where(dd_A >= 0, 1 + dd_A, 1 / (1 - dd_A.clamp(max=0)))
    log_a = -f.clamp(min=A_floor) * dt
    lam = torch.sigmoid(_f32(trap))
    gamma = lam * dt
    beta = (1 - lam) * dt
    # Data-dependent rotary phases, accumulated per head and kept in
    # [0, 2 pi). theta (B, L, S)
    theta = math.pi * torch.tanh(_f32(angle))
    phi0 = None
    if state is not None:
        phi0 = state[0]
    theta_dt = theta[:, :, None, :] * dt[..., None]
    phi = torch.remainder(phases(theta_dt, reset, phi0), 2 * math.pi)
    # The same phases for every rank: (B, L, H, 1, S).
    phi_r = phi[:, :, :, None]
    # B and C (R ranks of G groups, rank outermost): RMS-normalised per
    # rank and group, per-head biases, rotated; in float32, as the fused
    # kernels (bf16 in, float32 statistics).
    Bn = _f32(Bm).view(B, L, R, G, N)
    Cn = _f32(Cm).view(B, L, R, G, N)
    Bn = F.rms_norm(Bn, (N,), B_norm_weight, eps).transpose(2, 3)
    Cn = F.rms_norm(Cn, (N,), C_norm_weight, eps).transpose(2, 3)
    Bn = Bn.repeat_interleave(H // G, dim=2)
    Cn = Cn.repeat_interleave(H // G, dim=2)
    # k, q (B, L, H, R, N)
    k = rotate(_f32(Bn + B_bias.view(H, R, N)), phi_r).to(x.dtype)
    q = rotate(_f32(Cn + C_bias.view(H, R, N)), phi_r).to(x.dtype)
    # x and z lifted to R inputs and gates per head: x_r = x * mimo_x[h, r],
    # z_r = z * mimo_z[h, r], (B, L, H, R, P) each.
    mimo_x = mimo_z = mimo_o = None
    if mimo is not None:
        mimo_x, mimo_z, mimo_o = mimo
    x = x.view(B, L, H, 1, P)
    z = z.view(B, L, H, 1, P)
    x_r = _lift(x, mimo_x)
    z_r = _lift(z, mimo_z)
    scan_state = None
    if state is not None:
        # The cache holds x: its inputs are lifted again.
        x_prev = _lift(state[3][:, :, None], mimo_x)
        scan_state = (state[1], state[2].view(B, H, R, N), x_prev)
    y, final = ssd(x_r, q, k, log_a, gamma, beta, scan_state, chunk_size,
                   impl, reset)
    # The D skip and the gate: y (B, L, H, R, P).
    y = (y + D[:, None, None].to(y.dtype) * x_r) * F.silu(z_r)
    if mimo is not None:
        y = (y * mimo_o.to(y.dtype)).sum(3)
    out = y.reshape(B, L, -1)
    if state is None:
        return out, None
    k_last = final[1].view_as(state[2])
    return out, (phi[:, -1], final[0], k_last, x[:, -1, :, 0])


# -----------------------------------------------------------------------------
# the mixer region in Triton: _mixer_fwd forward; _mixer_bwd, then
# _sum_heads, backward
#
# One program per (b, h) walks the chunks with the (P x N) float32 state
# on chip and saves the state entering each; the backward walks them in
# reverse with the state's gradient G on chip. A chunk is C rows (row i:
# rank i % R of token i // R), a token's scalars counted on its first row.
# Tiles: PP >= P, and N as its even and odd dims, two of NH >= N / 2
# (_qk). The tl.constexprs: DT is the dots' operand dtype (zxbcdt's), ACC
# that of the cumsums, states and accumulators; PREC is _mixer_tiles'.

try:
    import triton
    import triton.language as tl
except ImportError:
    # No Triton on this platform (macOS); impl="triton" then says so.
    triton = None

# The oldest Triton the kernels compile under (what torch 2.11 installs).
TRITON_NEEDED = "3.6"


def _version(v):
    # "3.6.0+git..." -> (3, 6)
    major, minor = re.match(r"(\d+)\.(\d+)", v).groups()
    return (int(major), int(minor))


def _triton_fits():
    # Whether Triton imported, in a version the kernels compile under.
    if triton is None:
        return False
    return _version(triton.__version__) >= _version(TRITON_NEEDED)


if _triton_fits():
    from triton.tools.tensor_descriptor import TensorDescriptor

    # TRITON_INTERPRET=1 (read at import) runs the kernels as numpy on CPU
    # tensors, as the tests do. It is what triton.jit decides by.
    _INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)
    if _INTERPRETED and _version(triton.__version__) < (3, 7):
        # Triton 3.6's interpreter takes int() of a 1-element array for a
        # loop bound, which NumPy refuses.
        from triton.runtime import interpreter as _interpreter

        def _patch_lang_tensor(tensor, scope,
                               patch=_interpreter._patch_lang_tensor):
            patch(tensor, scope)

            def index(self):
                return int(self.handle.data.squeeze())
            scope.set_attr(tensor, "__index__", index)
        _interpreter._patch_lang_tensor = _patch_lang_tensor

    _TL_DTYPE = {
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.float32: tl.float32,
        torch.float64: tl.float64,
    }
    _PI = tl.constexpr(math.pi)

    # Jit code takes namedtuples: these name what the helpers return.
    # A program's (b, h) of grid (B*H,) and its index vectors: a chunk's
    # rows i (C,) with each row's token and rank, the state's rows p (PP,)
    # and half-columns j (NH,); and head h's dt_bias and D.
    _Program = collections.namedtuple(
        "_Program", "bh b h i p j tok rank dt_bias D")
    # Chunk c's rows (C,): tokens t, which are < L where valid, a token's
    # first row, the rows' pointers into zxbcdt, the resets counted through
    # each row's token (seg) and the first row of the latest (start).
    _Chunk = collections.namedtuple(
        "_Chunk", "t valid first rows seg start")
    # A chunk's per-token scalars for one head, (C,) each; *_n: the next
    # token's.
    _Scalars = collections.namedtuple(
        "_Scalars", "dt dsp lam dt_n dsp_n lam_n fA dfA A gamma w cs")

    @triton.jit
    def _dot(a, b, DT: tl.constexpr, PREC: tl.constexpr, acc=None):
        # a b (+ acc: an addend, since a product gets a costlier layout)
        # from operands in DT. PREC is "ieee" or "tf32" (tensor cores read
        # 10 of float32's 23 mantissa bits). The interpreter (numpy) gets
        # bf16 as float32 and tf32 with 13 bits cut, as on a GPU.
        a = a.to(DT)
        b = b.to(DT)
        if _INTERPRETED and DT == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if _INTERPRETED and PREC == "tf32":
            cut = 0xFFFFE000
            a = a.to(tl.uint32, bitcast=True) & cut
            a = a.to(tl.float32, bitcast=True)
            b = b.to(tl.uint32, bitcast=True) & cut
            b = b.to(tl.float32, bitcast=True)
        # A static if: the else is not traced, where acc.dtype would fail.
        if acc is None:
            return tl.dot(a, b, input_precision=PREC)
        else:
            # out_dtype, since Triton 3.6 would assume float32.
            return tl.dot(a, b, acc, input_precision=PREC,
                          out_dtype=acc.dtype)

    @triton.jit
    def _dot_t(ae, ao, be, bo, DT: tl.constexpr, PREC: tl.constexpr):
        # a b^T for a and b given as their even and odd dims.
        even = _dot(ae, tl.trans(be), DT, PREC)
        return even + _dot(ao, tl.trans(bo), DT, PREC)

    @triton.jit
    def _at(v, i, k):
        # v's entry at row k, as a scalar (v: (C,)).
        return tl.sum(tl.where(i == k, v, 0), axis=0)

    @triton.jit
    def _by_rank(v, C: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
        # (C, W) rows -> (R, W): each rank's sum over the chunk's tokens.
        return tl.sum(tl.reshape(v, (C // R, R, W)), 0)

    @triton.jit
    def _in_bounds(valid, cols, ncols: tl.constexpr, TILE: tl.constexpr):
        # Rows `valid` x columns < ncols of a (C, TILE) block; no column
        # test without padding.
        mask = valid[:, None]
        if ncols != TILE:
            mask = mask & (cols < ncols)[None, :]
        return mask

    @triton.jit
    def _program(dt_bias_ptr, D_ptr, H: tl.constexpr, C: tl.constexpr,
                 R: tl.constexpr, PP: tl.constexpr, NH: tl.constexpr,
                 ACC: tl.constexpr):
        """This program's head and index vectors, a _Program."""
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
        i = tl.arange(0, C)
        p = tl.arange(0, PP)
        j = tl.arange(0, NH)
        tok = i // R
        rank = i % R
        dt_bias = tl.load(dt_bias_ptr + h).to(ACC)
        D = tl.load(D_ptr + h).to(ACC)
        return _Program(bh, b, h, i, p, j, tok, rank, dt_bias, D)

    @triton.jit
    def _maximum(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _chunk_tokens(zx_ptr, s_b, s_l, reset_ptr, b, c, L, i,
                      C: tl.constexpr, R: tl.constexpr,
                      HAS_RESET: tl.constexpr):
        """Chunk c's rows i, a _Chunk; without resets seg and start are
        zeros."""
        t = c * (C // R) + i // R
        valid = t < L
        first = i % R == 0
        rows = zx_ptr + b * s_b + t * s_l
        if HAS_RESET:
            r = tl.load(reset_ptr + b * L + t, mask=valid & first, other=0)
            r = r.to(tl.int32)
            seg = tl.cumsum(r, 0)
            starts = tl.where(r != 0, i, 0)
            start = tl.associative_scan(starts, 0, _maximum)
        else:
            seg = tl.zeros(t.shape, tl.int32)
            start = tl.zeros(t.shape, tl.int32)
        return _Chunk(t, valid, first, rows, seg, start)

    @triton.jit
    def _dt_lam(rows, valid, h, col_dt, col_trap, dt_bias,
                ACC: tl.constexpr):
        # Head h's dt = softplus(dd_dt + dt_bias) (0 past L), softplus'
        # and lam = sigmoid(trap). log1p(x) is log(1 + x) x / ((1 + x) - 1),
        # accurate where 1 + x rounds (dt ~1e-3).
        dd_dt = tl.load(rows + col_dt + h, mask=valid, other=0.0)
        dd_dt = dd_dt.to(ACC)
        trap = tl.load(rows + col_trap + h, mask=valid, other=0.0)
        trap = trap.to(ACC)
        v = dd_dt + dt_bias
        ex = tl.exp(tl.minimum(v, 20.0))
        one = 1.0 + ex
        log1p = tl.where(one == 1.0, ex, tl.log(one) * ex / (one - 1.0))
        dt = tl.where(v > 20.0, v, log1p)
        dsp = tl.where(v > 20.0, 1.0, ex / one)
        dt = tl.where(valid, dt, 0.0)
        lam = 1.0 / (1.0 + tl.exp(-trap))
        return dt, dsp, lam

    @triton.jit
    def _scalars(chunk, s_l, L, h, dt_bias, A_floor, H: tl.constexpr,
                 G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                 R: tl.constexpr, ACC: tl.constexpr):
        """Head h's per-token scalars on the chunk's rows, a _Scalars."""
        rows = chunk.rows
        valid = chunk.valid
        col_dt = 2 * H * P + 2 * R * G * N
        col_trap = col_dt + 2 * H
        dt, dsp, lam = _dt_lam(rows, valid, h, col_dt, col_trap, dt_bias,
                               ACC)
        rows_n = rows + s_l
        valid_n = chunk.t + 1 < L
        dt_n, dsp_n, lam_n = _dt_lam(rows_n, valid_n, h, col_dt, col_trap,
                                     dt_bias, ACC)
        dd_A = tl.load(rows + col_dt + H + h, mask=valid, other=0.0)
        dd_A = dd_A.to(ACC)
        # f(v) = 1 + v (v >= 0), 1 / (1 - v), and f'.
        neg = 1.0 / (1.0 - tl.minimum(dd_A, 0.0))
        fA = tl.where(dd_A >= 0, 1.0 + dd_A, neg)
        dfA = tl.where(dd_A >= 0, 1.0, neg * neg)
        A = -tl.maximum(fA, A_floor)
        gamma = lam * dt
        w = gamma + (1.0 - lam_n) * dt_n
        cs = tl.cumsum(tl.where(chunk.first, A * dt, 0.0), 0)
        return _Scalars(dt, dsp, lam, dt_n, dsp_n, lam_n, fA, dfA, A,
                        gamma, w, cs)

    @triton.jit
    def _decays(cs, seg, start, i, tok, C: tl.constexpr):
        """decay_ij = exp(cs_i - cs_j) (C, C) for j's token up to i's, and
        e, f, a; all 0 across resets."""
        cs_last = _at(cs, i, C - 1)
        seg_last = _at(seg, i, C - 1)
        before = tok[None, :] <= tok[:, None]
        same = before & (i[None, :] >= start[:, None])
        diff = tl.minimum(cs[:, None] - cs[None, :], 0.0)
        decay = tl.where(same, tl.exp(diff), 0.0)
        e = tl.where(seg == 0, tl.exp(cs), 0.0)
        f = tl.where(seg == seg_last, tl.exp(cs_last - cs), 0.0)
        a = tl.where(seg_last == 0, tl.exp(cs_last), 0.0)
        return decay, e, f, a

    @triton.jit
    def _over_w(v, w):
        # v / w where w > 0, else 0 (there v = 0 too, or what it feeds is
        # multiplied by 0).
        return tl.where(w > 0, v / tl.where(w > 0, w, 1.0), 0.0)

    @triton.jit
    def _sum_in(s, s1, v1, s2, v2):
        # The sums v1, v2 of two ranges of rows, counted where their
        # segment s1, s2 is s.
        return tl.where(s1 == s, v1, 0.0) + tl.where(s2 == s, v2, 0.0)

    @triton.jit
    def _last_segment(s1, v1, s2, v2):
        # Two ranges of rows as (their last row's segment, their sum in
        # it); seg never decreases.
        s = tl.maximum(s1, s2)
        return s, _sum_in(s, s1, v1, s2, v2)

    @triton.jit
    def _first_segment(s1, v1, s2, v2):
        # The same for a backward scan (the first row's segment).
        s = tl.minimum(s1, s2)
        return s, _sum_in(s, s1, v1, s2, v2)

    @triton.jit
    def _seg_cumsum(v, seg, REVERSE: tl.constexpr,
                    HAS_RESET: tl.constexpr):
        # v's (C, NH) running sum inside each segment, either way: a scan
        # of (segment, sum) pairs, since a product with the segment mask
        # would be a float32 dot on FMA units, spilled. Without resets, a
        # plain cumsum.
        if not HAS_RESET:
            return tl.cumsum(v, 0, reverse=REVERSE)
        segs = tl.broadcast_to(seg[:, None], v.shape)
        if REVERSE:
            sums = tl.associative_scan((segs, v), 0, _first_segment,
                                       reverse=True)
            return sums[1]
        return tl.associative_scan((segs, v), 0, _last_segment)[1]

    @triton.jit
    def _phase(chunk, col_ang, S, j, dt, carry, ACC: tl.constexpr,
               HAS_RESET: tl.constexpr):
        """tanh(angle) (C, NH) and the phases
        carry + cumsum(pi tanh(angle) dt), reset-aware."""
        mask = chunk.valid[:, None] & (j < S)[None, :]
        ptrs = chunk.rows[:, None] + col_ang + j[None, :]
        ang = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
        # tanh without overflow
        ex = tl.exp(-2.0 * tl.abs(ang))
        th = tl.where(ang < 0, -1.0, 1.0) * (1.0 - ex) / (1.0 + ex)
        v = tl.where(chunk.first[:, None], (_PI * th) * dt[:, None], 0.0)
        Phi = _seg_cumsum(v, chunk.seg, False, HAS_RESET)
        # The carry reaches the rows before the chunk's first reset.
        in_carry = (chunk.seg == 0)[:, None]
        return th, Phi + tl.where(in_carry, carry[None, :], 0.0)

    @triton.jit
    def _pairs(ptr, j, N: tl.constexpr, ACC: tl.constexpr):
        # An (N,) parameter's even and odd entries, read each chunk: a
        # hoisted tile would hold registers.
        m = j < N // 2
        even = tl.load(ptr + 2 * j, mask=m, other=0.0).to(ACC)
        odd = tl.load(ptr + 2 * j + 1, mask=m, other=0.0).to(ACC)
        return even, odd

    @triton.jit
    def _load_mimo(ptr, h, rank, p, P: tl.constexpr, R: tl.constexpr,
                   ACC: tl.constexpr):
        # mimo_x, mimo_z or mimo_o (H, R, P) of head h at each row's rank:
        # (C, PP).
        ptrs = ptr + ((h * R + rank) * P)[:, None] + p[None, :]
        return tl.load(ptrs, mask=(p < P)[None, :], other=0.0).to(ACC)

    @triton.jit
    def _token_store(ptr, s_l, c, L, p, v, P: tl.constexpr,
                     C: tl.constexpr, R: tl.constexpr, PP: tl.constexpr):
        # v (C, PP) summed over each token's R rows, to ptr + t s_l + p
        # for chunk c's tokens t.
        v = tl.sum(tl.reshape(v, (C // R, R, PP)), 1)
        t = c * (C // R) + tl.arange(0, C // R)
        tl.store(ptr + t[:, None] * s_l + p[None, :],
                 v.to(ptr.dtype.element_ty),
                 mask=_in_bounds(t < L, p, P, PP))

    @triton.jit
    def _pairs_store(ptr, ve, vo, mask):
        # Even and odd dims back to their interleaved places (ptr: the
        # even ones').
        tl.store(ptr, ve.to(ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + 1, vo.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _state_pairs(ptr, bh, p, j, P: tl.constexpr, N: tl.constexpr,
                     ACC: tl.constexpr):
        # Program bh's (P, N) state at ptr as its even and odd dims,
        # (PP, NH) each, zeros where the tiles overhang.
        ptrs = ptr + bh * P * N + p[:, None] * N + 2 * j[None, :]
        mask = (p < P)[:, None] & (j < N // 2)[None, :]
        even = tl.load(ptrs, mask=mask, other=0.0).to(ACC)
        odd = tl.load(ptrs + 1, mask=mask, other=0.0).to(ACC)
        return even, odd

    @triton.jit
    def _qk(ptrs, valid, w_ptr, b_ptr, h, rank, j, cos, sin, eps,
            N: tl.constexpr, R: tl.constexpr, NH: tl.constexpr,
            ACC: tl.constexpr):
        """k (from the rows' B, B's norm weight and bias) or q (C's) as
        even and odd dims (C, NH), then the normed dims and 1 / rms.

        Two strided loads, not one tile: a pair stays in one layout."""
        we, wo = _pairs(w_ptr, j, N, ACC)
        if R == 1:
            be, bo = _pairs(b_ptr + h * N, j, N, ACC)
            be = be[None, :]
            bo = bo[None, :]
        else:
            b_rows = b_ptr + ((h * R + rank) * N)[:, None]
            be, bo = _pairs(b_rows, j[None, :], N, ACC)
        ptr = ptrs[:, None] + 2 * j[None, :]
        mask = _in_bounds(valid, j, N // 2, NH)
        xe = tl.load(ptr, mask=mask, other=0.0).to(ACC)
        xo = tl.load(ptr + 1, mask=mask, other=0.0).to(ACC)
        sum_sq = tl.sum(xe * xe, 1) + tl.sum(xo * xo, 1)
        rstd = 1.0 / tl.sqrt(sum_sq / N + eps)
        he = xe * rstd[:, None]
        ho = xo * rstd[:, None]
        ve = he * we[None, :] + be
        vo = ho * wo[None, :] + bo
        keep = valid[:, None]
        turned_e = tl.where(keep, ve * cos - vo * sin, 0.0)
        turned_o = tl.where(keep, ve * sin + vo * cos, 0.0)
        return turned_e, turned_o, he, ho, rstd

    @triton.jit
    def _qk_backward(dKe, dKo, cos, sin, he, ho, rstd, w_ptr, dbias,
                     dweight, j, N: tl.constexpr, C: tl.constexpr,
                     R: tl.constexpr, NH: tl.constexpr, ACC: tl.constexpr):
        # From a turned q or k's gradient, stores the bias's and the norm
        # weight's (the chunk's sums) and returns the B or C row's:
        # dx = rstd (dh - h mean(h dh)). The weight is read again, which is
        # cheaper than holding it through the chunk.
        we, wo = _pairs(w_ptr, j, N, ACC)
        dve = dKe * cos + dKo * sin
        dvo = dKo * cos - dKe * sin
        dhe = dve * we[None, :]
        dho = dvo * wo[None, :]
        mean = (tl.sum(dhe * he, 1) + tl.sum(dho * ho, 1)) / N
        mean = mean[:, None]
        dxe = rstd[:, None] * (dhe - he * mean)
        dxo = rstd[:, None] * (dho - ho * mean)
        if R == 1:
            ptrs = dbias + 2 * j
            _pairs_store(ptrs, tl.sum(dve, 0), tl.sum(dvo, 0), j < N // 2)
        else:
            # (R, N): each rank's sum.
            ptrs = dbias + (tl.arange(0, R) * N)[:, None] + 2 * j[None, :]
            dbe = _by_rank(dve, C, R, NH)
            dbo = _by_rank(dvo, C, R, NH)
            _pairs_store(ptrs, dbe, dbo, (j < N // 2)[None, :])
        ptrs = dweight + 2 * j
        dwe = tl.sum(dve * he, 0)
        dwo = tl.sum(dvo * ho, 0)
        _pairs_store(ptrs, dwe, dwo, j < N // 2)
        return dxe, dxo

    @triton.jit
    def _mixer_fwd(zx_ptr, s_b, s_l, reset_ptr, dt_bias_ptr, Bw_ptr,
                   Cw_ptr, Bb_ptr, Cb_ptr, D_ptr, mx_ptr, mz_ptr, mo_ptr,
                   out_ptr, so_b, so_l, states, phase_ptr, S_in_ptr,
                   phi_in_ptr, S_out_ptr, phi_out_ptr, k_out_ptr, L, nc,
                   A_floor, eps, H: tl.constexpr, G: tl.constexpr,
                   P: tl.constexpr, N: tl.constexpr, S: tl.constexpr,
                   C: tl.constexpr, R: tl.constexpr, PP: tl.constexpr,
                   NH: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr,
                   PREC: tl.constexpr, HAS_RESET: tl.constexpr,
                   HAS_STATE: tl.constexpr):
        """The mixer region forward, grid (B*H,), to out (B, L, H*P).

        Without a state (training): starts from zeros and saves the state
        entering each chunk in DT (`states`: (B*H*nc*PP, 2NH), even dims
        then odd) and its phase (B*H, nc, S) for the backward.

        With HAS_STATE (prefill, no backward): starts from S_in (B*H, P, N)
        (the state entering the first chunk: the first token's beta term
        already added) and the phases phi_in (B*H, S), saves nothing, and
        writes the final state to S_out, phi_out and the last token's k's
        to k_out (B*H, R, N). The state pointers are None without it, and
        states and phase_ptr with it.
        """
        pg = _program(dt_bias_ptr, D_ptr, H, C, R, PP, NH, ACC)
        b, h, bh = pg.b, pg.h, pg.bh
        i, p, j = pg.i, pg.p, pg.j
        tok, rank = pg.tok, pg.rank
        col_ang = 2 * H * P + 2 * R * G * N + 3 * H
        # Each row's rank of its head's group's B; its C is R*G*N columns
        # later.
        col_B = 2 * H * P + (h // (H // G)) * N + rank * (G * N)
        # The state as its even and odd dims, (PP, NH) each, and the
        # phases carried into the chunk.
        Se = tl.zeros((PP, NH), ACC)
        So = tl.zeros((PP, NH), ACC)
        carry = tl.zeros((NH,), ACC)
        if HAS_STATE:
            Se, So = _state_pairs(S_in_ptr, bh, p, j, P, N, ACC)
            carry = tl.load(phi_in_ptr + bh * S + j, mask=j < S, other=0.0)
            carry = carry.to(ACC)
        for c in range(nc):
            chunk = _chunk_tokens(zx_ptr, s_b, s_l, reset_ptr, b, c, L, i,
                                  C, R, HAS_RESET)
            sc = _scalars(chunk, s_l, L, h, pg.dt_bias, A_floor, H, G, P,
                          N, R, ACC)
            # The phases, and from them k and q (in DT: they only feed
            # dots).
            if not HAS_STATE:
                tl.store(phase_ptr + (bh * nc + c) * S + j, carry,
                         mask=j < S)
            _, Phi = _phase(chunk, col_ang, S, j, sc.dt, carry, ACC,
                            HAS_RESET)
            is_last = (i == C - 1)[:, None]
            last = tl.sum(tl.where(is_last, Phi, 0.0), axis=0)
            # The next chunk's carry, in [0, 2 pi).
            carry = last - 2 * _PI * tl.floor(last / (2 * _PI))
            cos = tl.cos(Phi)
            sin = tl.sin(Phi)
            k_rows = chunk.rows + col_B
            Ke, Ko = _qk(k_rows, chunk.valid, Bw_ptr, Bb_ptr, h, rank, j,
                         cos, sin, eps, N, R, NH, ACC)[:2]
            q_rows = chunk.rows + col_B + R * G * N
            Qe, Qo = _qk(q_rows, chunk.valid, Cw_ptr, Cb_ptr, h, rank, j,
                         cos, sin, eps, N, R, NH, ACC)[:2]
            if HAS_STATE:
                # The last token's k's (its R rows), which the next call's
                # first beta term reads.
                k_ptrs = k_out_ptr + ((bh * R + rank) * N)[:, None]
                k_ptrs = k_ptrs + 2 * j[None, :]
                k_mask = (chunk.t == L - 1)[:, None] & (j < N // 2)[None, :]
                _pairs_store(k_ptrs, Ke, Ko, k_mask)
            Kwe = (Ke * sc.w[:, None]).to(DT)
            Kwo = (Ko * sc.w[:, None]).to(DT)
            Qe = Qe.to(DT)
            Qo = Qo.to(DT)
            # The scan, scaled: M o (Q Kw^T) = W o (Q K^T) with M the decay
            # between tokens and gamma / w within one, and Kw = w k (W is a
            # tile times a row vector, which spills); then the D skip and
            # the gate.
            decay, e, f, a = _decays(sc.cs, chunk.seg, chunk.start, i, tok,
                                     C)
            xz = chunk.rows[:, None] + h * P + p[None, :]
            xz_mask = _in_bounds(chunk.valid, p, P, PP)
            X = tl.load(xz + H * P, mask=xz_mask, other=0.0)
            if R > 1:
                # The rows' inputs x_r = x mimo_x[h, r].
                X = X.to(ACC) * _load_mimo(mx_ptr, h, rank, p, P, R, ACC)
                X = X.to(DT)
            if not HAS_STATE:
                row = ((bh * nc + c) * PP).to(tl.int32)
                states.store([row, 0], Se.to(DT))
                states.store([row, NH], So.to(DT))
            scores = _dot_t(Qe, Qo, Kwe, Kwo, DT, PREC)
            QS = _dot_t(Qe, Qo, Se.to(DT), So.to(DT), DT, PREC)
            own = tok[:, None] == tok[None, :]
            gamma_w = _over_w(sc.gamma, sc.w)[:, None]
            MS = tl.where(own, gamma_w, decay) * scores
            Y = _dot(MS, X, DT, PREC) + e[:, None] * QS
            Xf = tl.trans((X * f[:, None]).to(DT))
            Se = a * Se + _dot(Xf, Kwe, DT, PREC)
            So = a * So + _dot(Xf, Kwo, DT, PREC)
            Z = tl.load(xz, mask=xz_mask, other=0.0).to(ACC)
            if R > 1:
                Z = Z * _load_mimo(mz_ptr, h, rank, p, P, R, ACC)
            out = (Y + pg.D * X.to(ACC)) * Z * tl.sigmoid(Z)
            out_row = out_ptr + b * so_b
            if R == 1:
                ptrs = out_row + chunk.t[:, None] * so_l + h * P + p[None, :]
                out = out.to(out_ptr.dtype.element_ty)
                tl.store(ptrs, out, mask=xz_mask)
            else:
                # sum_r mimo_o[h, r] y_r: a token from its R rows.
                ptr = out_row + h * P
                out = out * _load_mimo(mo_ptr, h, rank, p, P, R, ACC)
                _token_store(ptr, so_l, c, L, p, out, P, C, R, PP)
        if HAS_STATE:
            # The state after the last token (padding rows change
            # nothing) and its phases.
            ptrs = S_out_ptr + bh * P * N + p[:, None] * N + 2 * j[None, :]
            mask = (p < P)[:, None] & (j < N // 2)[None, :]
            _pairs_store(ptrs, Se, So, mask)
            tl.store(phi_out_ptr + bh * S + j, carry, mask=j < S)

    @triton.jit
    def _mixer_bwd(zx_ptr, s_b, s_l, reset_ptr, dt_bias_ptr, Bw_ptr,
                   Cw_ptr, Bb_ptr, Cb_ptr, D_ptr, mx_ptr, mz_ptr, mo_ptr,
                   dout_ptr, sd_b, sd_l, states, phase_ptr, dzx_ptr, sg_b,
                   sg_l, part_ptr, dparam_ptr, dmimo_ptr, L, nc, A_floor,
                   eps, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                   N: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
                   R: tl.constexpr, PP: tl.constexpr, NH: tl.constexpr,
                   DT: tl.constexpr, ACC: tl.constexpr,
                   PREC: tl.constexpr, HAS_RESET: tl.constexpr):
        """The mixer region backward, grid (B*H,): the chunks in reverse,
        each recomputed, with G and the phase carry's gradient on chip.

        Writes head h's columns of dzxbcdt, its share of the shared ones
        to part (B, L, H, 2RN + S), per-chunk parameter gradient sums to
        dparam (B*H, nc, 2RN + 2N + 2) and dmimo (B*H, nc, 3, R, P).
        ChunkedScan's gradients, scaled (Kw = w k, M, f for u):
        Rw = dM o M o (Q Kw^T) and df = x . (Kw G^T) carry the w factors,
        so dw = (sum_l Rw_lj + df_j f_j) / w_j, dK = w dKw. A chunk's first
        token's beta enters w in chunk c - 1, so its gradients are written
        one iteration later (pend_*).
        """
        pg = _program(dt_bias_ptr, D_ptr, H, C, R, PP, NH, ACC)
        b, h, bh = pg.b, pg.h, pg.bh
        i, p, j = pg.i, pg.p, pg.j
        tok, rank = pg.tok, pg.rank
        D = pg.D
        col_dt = 2 * H * P + 2 * R * G * N
        col_B = 2 * H * P + (h // (H // G)) * N + rank * (G * N)
        # The width of a row of part.
        width = 2 * R * N + S
        # G, the gradient of the state leaving the chunk, as even and odd
        # dims, and that of the phases carried out of it.
        Ge = tl.zeros((PP, NH), ACC)
        Go = tl.zeros((PP, NH), ACC)
        dcarry = tl.zeros((NH,), ACC)
        # The gradients of the next chunk's first dt and lam, held back.
        pend_dt = tl.zeros_like(pg.dt_bias)
        pend_lam = tl.zeros_like(pg.dt_bias)
        for step in range(nc):
            c = nc - 1 - step
            chunk = _chunk_tokens(zx_ptr, s_b, s_l, reset_ptr, b, c, L, i,
                                  C, R, HAS_RESET)
            t = chunk.t
            sc = _scalars(chunk, s_l, L, h, pg.dt_bias, A_floor, H, G, P,
                          N, R, ACC)
            w = sc.w
            carry = tl.load(phase_ptr + (bh * nc + c) * S + j, mask=j < S,
                            other=0.0)
            th, Phi = _phase(chunk, col_dt + 3 * H, S, j, sc.dt, carry, ACC,
                             HAS_RESET)
            cos = tl.cos(Phi)
            sin = tl.sin(Phi)
            k_rows = chunk.rows + col_B
            Ke, Ko, xBe, xBo, rB = _qk(k_rows, chunk.valid, Bw_ptr, Bb_ptr,
                                       h, rank, j, cos, sin, eps, N, R, NH,
                                       ACC)
            q_rows = chunk.rows + col_B + R * G * N
            Qe, Qo, xCe, xCo, rC = _qk(q_rows, chunk.valid, Cw_ptr, Cb_ptr,
                                       h, rank, j, cos, sin, eps, N, R, NH,
                                       ACC)
            if R == 1:
                qk = tl.sum(Qe * Ke + Qo * Ko, 1)
            Kwe = (Ke * w[:, None]).to(DT)
            Kwo = (Ko * w[:, None]).to(DT)
            xBe = xBe.to(DT)
            xBo = xBo.to(DT)
            Qe = Qe.to(DT)
            Qo = Qo.to(DT)
            xCe = xCe.to(DT)
            xCo = xCo.to(DT)
            xz_mask = _in_bounds(chunk.valid, p, P, PP)
            xz = chunk.rows[:, None] + h * P + p[None, :]
            X = tl.load(xz + H * P, mask=xz_mask, other=0.0)
            if R > 1:
                X = X.to(ACC) * _load_mimo(mx_ptr, h, rank, p, P, R, ACC)
                X = X.to(DT)
            row = ((bh * nc + c) * PP).to(tl.int32)
            Se = states.load([row, 0])
            So = states.load([row, NH])
            # The gate and the D skip, out = (y + D x) * z * sigmoid(z),
            # with y recomputed. own: a token's own R x R block.
            decay, e, f, a = _decays(sc.cs, chunk.seg, chunk.start, i, tok,
                                     C)
            own = tok[:, None] == tok[None, :]
            M = tl.where(own, _over_w(sc.gamma, w)[:, None], decay)
            scores = _dot_t(Qe, Qo, Kwe, Kwo, DT, PREC)
            QS = _dot_t(Qe, Qo, Se, So, DT, PREC)
            MS = M * scores
            # Y with the D skip.
            Y = _dot(MS, X, DT, PREC, D * X.to(ACC)) + e[:, None] * QS
            Z = tl.load(xz, mask=xz_mask, other=0.0).to(ACC)
            dout_rows = dout_ptr + b * sd_b + t[:, None] * sd_l
            dout = tl.load(dout_rows + h * P + p[None, :], mask=xz_mask,
                           other=0.0).to(ACC)
            g_rows = dzx_ptr + b * sg_b + t * sg_l
            dxz = g_rows[:, None] + h * P + p[None, :]
            if R > 1:
                # z_r = z mimo_z and out = sum_r mimo_o y_r gated:
                # per-(b, h, chunk) sums into dmimo's rows gm.
                z_in = Z
                mz = _load_mimo(mz_ptr, h, rank, p, P, R, ACC)
                mo = _load_mimo(mo_ptr, h, rank, p, P, R, ACC)
                Z = z_in * mz
                gm = dmimo_ptr + (bh * nc + c) * 3 * R * P
                gm = gm + (tl.arange(0, R) * P)[:, None] + p[None, :]
                tl.store(gm + 2 * R * P,
                         _by_rank(dout * Y * Z * tl.sigmoid(Z), C, R, PP),
                         mask=(p < P)[None, :])
                dout = dout * mo
            sz = tl.sigmoid(Z)
            dY = dout * Z * sz
            dZ = dout * Y * sz * (1.0 + Z * (1.0 - sz))
            if R == 1:
                tl.store(dxz, dZ.to(dzx_ptr.dtype.element_ty), mask=xz_mask)
            else:
                tl.store(gm + R * P, _by_rank(dZ * z_in, C, R, PP),
                         mask=(p < P)[None, :])
                ptr = dzx_ptr + b * sg_b + h * P
                _token_store(ptr, sg_l, c, L, p, dZ * mz, P, C, R, PP)
            # dM's diagonal
            dYX = tl.sum(dY * X.to(ACC), axis=1)
            # dparam's row: dB_bias, dC_bias (R*N each), dB_norm_w,
            # dC_norm_w (N each), ddt_bias, dD.
            prow = dparam_ptr + (bh * nc + c) * (2 * R * N + 2 * N + 2)
            tl.store(prow + 2 * R * N + 2 * N + 1, tl.sum(dYX))
            dcs = e * tl.sum(dY * QS, axis=1)
            # KGt (C, P)
            KGt = _dot_t(Kwe, Kwo, Ge, Go, DT, PREC)
            df = tl.sum(X.to(ACC) * KGt, axis=1)
            dX = _dot(tl.trans(MS), dY, DT, PREC, D * dY) + f[:, None] * KGt
            if R == 1:
                ptrs = dxz + H * P
                tl.store(ptrs, dX.to(dzx_ptr.dtype.element_ty), mask=xz_mask)
            else:
                # x and mimo_x read again: cheaper than held through the
                # chunk.
                x_ptrs = chunk.rows[:, None] + H * P + h * P + p[None, :]
                x_in = tl.load(x_ptrs, mask=xz_mask, other=0.0)
                mx = _load_mimo(mx_ptr, h, rank, p, P, R, ACC)
                tl.store(gm, _by_rank(dX * x_in.to(ACC), C, R, PP),
                         mask=(p < P)[None, :])
                ptr = dzx_ptr + b * sg_b + (H + h) * P
                _token_store(ptr, sg_l, c, L, p, dX * mx, P, C, R, PP)
            dM = _dot(dY, tl.trans(X), DT, PREC)
            dMM = dM * M
            if R == 1:
                dg = dYX * qk
            else:
                # The token's own block of dM o (Q K^T), where
                # Q K^T = (Q Kw^T) / w.
                own_dM = tl.where(own, dM * scores, 0.0)
                dg = _over_w(tl.sum(own_dM, axis=1), w)
            Rw = tl.where(tok[None, :] < tok[:, None], dM * MS, 0.0)
            col = tl.sum(Rw, axis=0)
            dcs += tl.sum(Rw, axis=1) - col - df * f
            dw = _over_w(col + df * f, w)
            # <G, Sin>
            GS = tl.sum(Ge * Se.to(ACC)) + tl.sum(Go * So.to(ACC))
            dcs_last = tl.sum(df * f, axis=0) + a * GS
            dcs += tl.where(i == C - 1, dcs_last, 0.0)
            # k: its phase gradient, and this head's share of dB (the
            # group's heads share B).
            dMMt = tl.trans(dMM.to(DT))
            dKe = _dot(dMMt, Qe, DT, PREC)
            dKe += f[:, None] * _dot(X, Ge, DT, PREC)
            dKo = _dot(dMMt, Qo, DT, PREC)
            dKo += f[:, None] * _dot(X, Go, DT, PREC)
            # A turned pair moves as (-v1, v0): dPhi = dv1 v0 - dv0 v1 (Kw
            # and dKw give k's).
            dPhi = dKo * Kwe - dKe * Kwo
            dKe = w[:, None] * dKe
            dKo = w[:, None] * dKo
            dBe, dBo = _qk_backward(dKe, dKo, cos, sin, xBe, xBo, rB,
                                    Bw_ptr, prow, prow + 2 * R * N, j, N,
                                    C, R, NH, ACC)
            # rank * N: each rank's columns; 0 on the first rows, which
            # write the angles.
            share = ((b * L + t) * H + h) * width + rank * N
            share = part_ptr + share[:, None]
            nm = _in_bounds(chunk.valid, j, N // 2, NH)
            _pairs_store(share + 2 * j[None, :], dBe, dBo, nm)
            # q likewise, and the state's gradient for the chunk before.
            dQe = _dot(dMM.to(DT), Kwe, DT, PREC)
            dQe += e[:, None] * _dot(dY, Se, DT, PREC)
            dQo = _dot(dMM.to(DT), Kwo, DT, PREC)
            dQo += e[:, None] * _dot(dY, So, DT, PREC)
            dYe = tl.trans((dY * e[:, None]).to(DT))
            Ge = a * Ge + _dot(dYe, Qe, DT, PREC)
            Go = a * Go + _dot(dYe, Qo, DT, PREC)
            dPhi += dQo * Qe - dQe * Qo
            dCe, dCo = _qk_backward(dQe, dQo, cos, sin, xCe, xCo, rC,
                                    Cw_ptr, prow + R * N,
                                    prow + 2 * R * N + N, j, N, C, R, NH,
                                    ACC)
            _pairs_store(share + R * N + 2 * j[None, :], dCe, dCo, nm)
            # The carry is the last token's phase. dv_j (v = theta dt) is
            # dPhi from j on, in j's segment.
            is_last = (i == C - 1)[:, None]
            dPhi += tl.where(is_last, dcarry[None, :], 0.0)
            dv = _seg_cumsum(dPhi, chunk.seg, True, HAS_RESET)
            in_carry = (chunk.seg == 0)[:, None]
            dcarry = tl.sum(tl.where(in_carry, dPhi, 0.0), axis=0)
            dangle = dv * sc.dt[:, None] * _PI * (1.0 - th * th)
            angle_mask = (chunk.valid & chunk.first)[:, None]
            angle_mask = angle_mask & (j < S)[None, :]
            angle_ptrs = share + 2 * R * N + j[None, :]
            dangle = dangle.to(part_ptr.dtype.element_ty)
            tl.store(angle_ptrs, dangle, mask=angle_mask)
            # The per-token scalars, on each token's first row:
            # log_a = A dt, gamma = lam dt, beta = (1 - lam) dt, theta dt;
            # w_s = gamma_s + beta_{s+1}, so dbeta_s = dw_{s-1}.
            dla = tl.cumsum(dcs, 0, reverse=True)
            # The scalars again (five loads a token): cheaper than holding
            # them through the chunk.
            sc = _scalars(chunk, s_l, L, h, pg.dt_bias, A_floor, H, G, P,
                          N, R, ACC)
            dgamma = dg + dw
            if R > 1:
                # Summed over each token's rows, on each of them.
                dgamma = tl.where(own, dgamma[None, :], 0.0)
                dgamma = tl.sum(dgamma, axis=1)
            # dw summed over the rows of the token before each row's (0 on
            # the first).
            after = tok[:, None] == tok[None, :] + 1
            dbeta = tl.sum(tl.where(after, dw[None, :], 0.0), axis=1)
            d_dt = dla * sc.A + dgamma * sc.lam + dbeta * (1.0 - sc.lam)
            d_dt += tl.sum(dv * _PI * th, axis=1)
            dlam = (dgamma - dbeta) * sc.dt
            # A's gradient passes where A is above its floor.
            above = sc.fA >= A_floor
            d_dd_A = tl.where(above, -dla * sc.dt * sc.dfA, 0.0)
            ty = dzx_ptr.dtype.element_ty
            tl.store(g_rows + col_dt + H + h, d_dd_A.to(ty),
                     mask=chunk.valid & chunk.first)
            # The next chunk's first token, held back one iteration, gets
            # its beta term (our dw).
            dw_last = tl.sum(tl.where(tok == C // R - 1, dw, 0.0), axis=0)
            lam1 = _at(sc.lam_n, i, C - 1)
            dt1 = _at(sc.dt_n, i, C - 1)
            t1 = (c + 1) * (C // R)
            d_dd_dt1 = pend_dt + dw_last * (1.0 - lam1)
            d_dd_dt1 = d_dd_dt1 * _at(sc.dsp_n, i, C - 1)
            d_trap1 = (pend_lam - dw_last * dt1) * lam1 * (1.0 - lam1)
            # The next chunk's first token, where there is one.
            has_next = t1 < L
            row1 = dzx_ptr + b * sg_b + t1 * sg_l
            tl.store(row1 + col_dt + h, d_dd_dt1.to(ty), mask=has_next)
            tl.store(row1 + col_dt + 2 * H + h, d_trap1.to(ty),
                     mask=has_next)
            # This chunk's tokens; its first waits for chunk c - 1 (unless
            # c = 0, where t < C / R).
            d_dd_dt = d_dt * sc.dsp
            d_trap = dlam * sc.lam * (1.0 - sc.lam)
            done = (i > 0) | (t < C // R)
            done = chunk.valid & chunk.first & done
            tl.store(g_rows + col_dt + h, d_dd_dt.to(ty), mask=done)
            tl.store(g_rows + col_dt + 2 * H + h, d_trap.to(ty), mask=done)
            # d dt_bias
            d_bias_ptr = prow + 2 * R * N + 2 * N
            d_bias = tl.sum(tl.where(done, d_dd_dt, 0.0), axis=0)
            d_bias += tl.where(has_next, d_dd_dt1, 0.0)
            tl.store(d_bias_ptr, d_bias)
            pend_dt = _at(d_dt, i, 0)
            pend_lam = _at(dlam, i, 0)

    @triton.jit
    def _sum_heads(part_ptr, dzx_ptr, sg_b, sg_l, L, R, H: tl.constexpr,
                   G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                   S: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr,
                   SB: tl.constexpr, ACC: tl.constexpr):
        """dB, dC and dangle: the heads' shares in part summed in a fixed
        order; grid (B, L/TB)."""
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * TB + tl.arange(0, TB)
        nn = tl.arange(0, NB)
        ss = tl.arange(0, SB)
        valid = t < L
        mN = valid[:, None] & (nn < N)[None, :]
        mS = valid[:, None] & (ss < S)[None, :]
        width = 2 * R * N + S
        shares = part_ptr + ((b * L + t) * H * width)[:, None]
        g_rows = dzx_ptr + b * sg_b + t[:, None] * sg_l
        col_B = 2 * H * P
        ty = dzx_ptr.dtype.element_ty
        for g in range(G):
            for r in range(R):
                dB = tl.zeros((TB, NB), ACC)
                dC = tl.zeros((TB, NB), ACC)
                for k in range(H // G):
                    share = shares + (g * (H // G) + k) * width + r * N
                    dB_k = tl.load(share + nn[None, :], mask=mN, other=0.0)
                    dB += dB_k.to(ACC)
                    dC_k = tl.load(share + R * N + nn[None, :], mask=mN,
                                   other=0.0)
                    dC += dC_k.to(ACC)
                dB_ptrs = g_rows + col_B + (r * G + g) * N + nn[None, :]
                tl.store(dB_ptrs, dB.to(ty), mask=mN)
                dC_ptrs = g_rows + col_B + ((R + r) * G + g) * N
                tl.store(dC_ptrs + nn[None, :], dC.to(ty), mask=mN)
        dangle = tl.zeros((TB, SB), ACC)
        for k in range(H):
            ptrs = shares + k * width + 2 * R * N + ss[None, :]
            dangle += tl.load(ptrs, mask=mS, other=0.0).to(ACC)
        col_ang = 2 * H * P + 2 * R * G * N + 3 * H
        tl.store(g_rows + col_ang + ss[None, :], dangle.to(ty), mask=mS)


def _pow2(d, least=16):
    # Tile sides are powers of 2 (tl.arange) and >= 16 (tl.dot); masks
    # cover what a tile overhangs.
    return max(least, 1 << (d - 1).bit_length())


def _mixer_tiles(chunk_size, P, N, dtype, R=1):
    """A mixer launch's constexprs for zxbcdt of `dtype`.

    float32 takes tf32 products (true float32 ones run on FMA units, and
    spill) in chunks of <= 32 rows (at 64 sm_90 would need 224 KB).
    """
    C = chunk_size * R
    precision = "ieee"
    if dtype == torch.float32:
        C = min(C, 32)
        precision = "tf32"
    acc = torch.float32
    if dtype == torch.float64:
        acc = torch.float64
    return dict(C=C, R=R, PP=_pow2(P), NH=_pow2(N // 2),
                DT=_TL_DTYPE[dtype], ACC=_TL_DTYPE[acc], PREC=precision)


# What each kernel's tuner times besides its default, by compute
# capability major: options that leave every result bit (stages and a
# register cap never change the arithmetic; warps may split tl.sum
# differently), of those that fit (tools/gpu_evidence.py compile
# --configs candidates).
TUNE = {
    ("_mixer_fwd", 9): [{"num_stages": 2}],
    ("_mixer_bwd", 9): [{"num_stages": 2}],
    ("_mixer_bwd", 8): [{"num_stages": 2}],
    ("_sum_heads", 8): [{"num_warps": 8}, {"num_stages": 1}],
    ("_sum_heads", 9): [{"num_warps": 8}, {"num_stages": 1}],
}


def launch_configs(kernel, major, tiles):
    """The launch options kernel's tuner times on compute capability
    major.x (0: the interpreter), the default first.

    Registers limit the mixer kernels: 8 warps for wide tiles, no early
    loads; the sm_8x backward spills less at 255 registers, 4 warps for
    64-row chunks (gpu_evidence.py).
    """
    if kernel == "_sum_heads":
        base = {"num_warps": 4, "num_stages": 3}
    else:
        C = tiles["C"]
        wide = max(tiles["PP"], 2 * tiles["NH"])
        warps = 4
        if C * wide >= 32 * 128:
            warps = 8
        base = {"num_warps": warps, "num_stages": 1}
        if kernel == "_mixer_bwd" and major == 8 and warps == 8:
            # The sm_8x backward: 255 registers, and 4 warps for 64-row
            # chunks.
            if C >= 64:
                warps = 4
            base |= {"num_warps": warps, "maxnreg": 255}
    extras = TUNE.get((kernel, major), [])
    return [base] + [base | extra for extra in extras]


# (kernel, device, constexprs) -> the launch options that ran it fastest
# there.
TUNED = {}


def _time(launch):
    # Milliseconds: the mean of ~100 ms of runs. A config that asks more
    # shared memory than this GPU gives a block never wins.
    try:
        return triton.testing.do_bench(launch)
    except triton.runtime.errors.OutOfResources:
        return math.inf


def _tuned(kernel, grid, *args, **constexprs):
    """kernel[grid](*args) in the fastest of its launch_configs, timed at a
    shape's first launch on each device, on its own arguments (the kernels
    only store: timing leaves one run's)."""
    name = kernel.fn.__name__
    device = args[0].device
    major = 0
    if args[0].is_cuda:
        major = torch.cuda.get_device_capability(device)[0]
    configs = launch_configs(name, major, constexprs)
    key = (name, str(device), tuple(constexprs.items()))
    if len(configs) > 1 and key not in TUNED:
        def time_with(options):
            return _time(lambda: kernel[grid](*args, **constexprs, **options))
        TUNED[key] = min(configs, key=time_with)
    options = TUNED.get(key, configs[0])
    kernel[grid](*args, **constexprs, **options)


# The most shared memory (KiB) a backward block asks over Triton 3.6-3.9
# and sm_80-sm_90 (float32: 160 under Triton 3.7, more than sm_86/89
# give).
_SHARED_KIB = {torch.float32: 160, torch.bfloat16: 89, torch.float16: 89}


def fused_refusal(x):
    """Why the fused kernels cannot run for zxbcdt x on its GPU, in one
    sentence, or None."""
    if not x.is_cuda:
        return None
    gpu = torch.cuda.get_device_properties(x.device)
    has = getattr(gpu, "shared_memory_per_block_optin", 0) // 1024
    if x.dtype == torch.float64:
        return ("float64: the fused backward would need 256 KB of shared "
                "memory a block, more than any GPU has")
    if gpu.major < 8:
        return (f"{gpu.name} has compute capability {gpu.major}.{gpu.minor}"
                f": the fused kernels need 8.0 or newer (bf16 and tf32 "
                f"tensor cores)")
    asks = _SHARED_KIB.get(x.dtype, 0)
    if has and has < asks:
        dtype = str(x.dtype).removeprefix("torch.")
        return (f"{gpu.name} gives a block {has} KB of shared memory and "
                f"the fused {dtype} backward may ask {asks} KB (bf16 "
                f"autocast asks less)")
    return None


@dataclass
class _Launch:
    """A mixer launch's shapes and inputs, once _setup has checked them."""
    B: int
    L: int
    H: int
    P: int
    G: int
    N: int
    S: int
    # chunk_size as asked; tiles["C"] is the rows a kernel's chunk holds.
    C: int
    R: int
    tiles: dict
    # The number of chunks.
    nc: int
    # The accumulator dtype.
    acc: torch.dtype
    # zxbcdt with unit stride in its last dim.
    zx: torch.Tensor
    # The mimo vectors, contiguous, or Nones (SISO).
    mimo: list
    # reset as uint8, or None.
    reset: Optional[torch.Tensor]

    def constexprs(self):
        # The mixer kernels' constexprs, in the order the tuner's key
        # keeps them.
        return dict(H=self.H, G=self.G, P=self.P, N=self.N, S=self.S,
                    HAS_RESET=self.reset is not None, **self.tiles)


def _setup(zxbcdt, B_bias, sizes, mimo, reset):
    """A launch's _Launch, once the inputs and the kernels fit together.

    Checked here, by the op and its fake alike, so that eager calls and
    torch.compile traces refuse the same.
    """
    P, G, S, C = sizes
    H = B_bias.shape[0]
    N = B_bias.shape[-1]
    R = 1
    if mimo[0] is not None:
        R = mimo[0].shape[1]
    if mimo[0] is not None and (R < 2 or R > 32 or R & (R - 1)):
        raise ValueError(
            f"mixer: impl='triton' needs mimo_rank (--mimo-rank) 1 (SISO) "
            f"or a power of 2 from 2 to 32 (a token's rows in a chunk); "
            f"got {R}: use impl='torch' (MAMBA3_IMPL=torch) for other "
            f"ranks")
    width = sum(split_sizes(H, P, G, N, S, R))
    if (zxbcdt.dim() != 3 or zxbcdt.shape[1] == 0
            or zxbcdt.shape[2] != width or zxbcdt.dtype not in _TL_DTYPE):
        raise ValueError(
            f"mixer: impl='triton' takes zxbcdt (B, L >= 1, 2HP + 2RGN + "
            f"3H + S = {width}) for H={H}, P={P}, R={R}, G={G}, N={N}, "
            f"S={S} in float16, bfloat16, float32 or float64; got "
            f"{tuple(zxbcdt.shape)} {zxbcdt.dtype}")
    # The op's schema makes C an int.
    if C * R < 16 or C & (C - 1) or H % G or N % 2 or 2 * S > N:
        raise ValueError(
            f"mixer: impl='triton' needs chunk_size a power of 2 with "
            f"chunk_size x mimo_rank >= 16 (tl.dot's minimum), ngroups "
            f"dividing the {H} heads, d_state even and n_angles <= "
            f"d_state / 2; got chunk_size={C}, rank {R}, ngroups={G}, "
            f"d_state={N}, n_angles={S}")
    B, L = zxbcdt.shape[:2]
    _check_reset(reset, B, L, "mixer")
    tiles = _mixer_tiles(C, P, N, zxbcdt.dtype, R)
    # A chunk of C rows holds C / R tokens.
    nc = -(-L // (tiles["C"] // R))
    zx = zxbcdt
    if zxbcdt.stride(-1) != 1:
        zx = zxbcdt.contiguous()
    mimo = [None if m is None else m.contiguous() for m in mimo]
    if reset is not None:
        reset = reset.contiguous().view(torch.uint8)
    return _Launch(B=B, L=L, H=H, P=P, G=G, N=N, S=S, C=C, R=R,
                   tiles=tiles, nc=nc, acc=_compute_dtype(zxbcdt), zx=zx,
                   mimo=mimo, reset=reset)


def _halves(states, tiles):
    # (PP, NH) halves of saved states through a descriptor: ~100 fewer
    # registers than pointers.
    PP = tiles["PP"]
    NH = tiles["NH"]
    return TensorDescriptor.from_tensor(states.view(-1, 2 * NH), [PP, NH])


def _on_device(t):
    # Launches go to t's GPU; for CPU tensors, device -1 is a no-op.
    index = -1
    if t.is_cuda:
        index = t.device.index
    return torch.cuda.device(index)


def _kernel_inputs(run, dt_bias, B_norm_weight, C_norm_weight, B_bias,
                   C_bias, D):
    # The arguments both mixer kernels start with: zxbcdt and its strides,
    # reset, the parameters and the mimo vectors.
    zx = run.zx
    return [zx, zx.stride(0), zx.stride(1), run.reset, dt_bias,
            B_norm_weight, C_norm_weight, B_bias.contiguous(),
            C_bias.contiguous(), D, *run.mimo]


def _forward_outputs(run):
    # out (B, L, H*P), states (B*H, nc, PP, 2NH), phase (B*H, nc, S).
    BH = run.B * run.H
    out = run.zx.new_empty(run.B, run.L, run.H * run.P)
    states = run.zx.new_empty(BH, run.nc, run.tiles["PP"],
                              2 * run.tiles["NH"])
    phase = run.zx.new_empty(BH, run.nc, run.S, dtype=run.acc)
    return out, states, phase


# The fused region as two custom ops with fake implementations and an
# autograd formula, opaque to torch.compile. The mimo vectors come last,
# None for SISO (empty tensors their gradients).
Tensor = torch.Tensor
Mimo = Optional[torch.Tensor]


@torch.library.custom_op("mamba3::mixer_fwd", mutates_args=())
def _mixer_fwd_op(zxbcdt: Tensor, dt_bias: Tensor, B_norm_weight: Tensor,
                  C_norm_weight: Tensor, B_bias: Tensor, C_bias: Tensor,
                  D: Tensor, reset: Optional[Tensor], headdim: int,
                  ngroups: int, n_angles: int, chunk_size: int,
                  A_floor: float, eps: float, mimo_x: Mimo = None,
                  mimo_z: Mimo = None, mimo_o: Mimo = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Launch _mixer_fwd: (out (B, L, H*P), states (B*H, nc, PP, 2NH),
    phase (B*H, nc, S))."""
    sizes = (headdim, ngroups, n_angles, chunk_size)
    run = _setup(zxbcdt, B_bias, sizes, (mimo_x, mimo_z, mimo_o), reset)
    inputs = _kernel_inputs(run, dt_bias, B_norm_weight, C_norm_weight,
                            B_bias, C_bias, D)
    with _on_device(run.zx):
        out, states, phase = _forward_outputs(run)
        # No decoding state: its five pointers are None.
        no_state = [None] * 5
        _tuned(_mixer_fwd, (run.B * run.H,), *inputs, out, out.stride(0),
               out.stride(1), _halves(states, run.tiles), phase, *no_state,
               run.L, run.nc, A_floor, eps, **run.constexprs(),
               HAS_STATE=False)
    return out, states, phase


@_mixer_fwd_op.register_fake
def _(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D,
      reset, headdim, ngroups, n_angles, chunk_size, A_floor, eps,
      mimo_x=None, mimo_z=None, mimo_o=None):
    sizes = (headdim, ngroups, n_angles, chunk_size)
    run = _setup(zxbcdt, B_bias, sizes, (mimo_x, mimo_z, mimo_o), reset)
    return _forward_outputs(run)


@torch.library.custom_op("mamba3::mixer_bwd", mutates_args=())
def _mixer_bwd_op(dout: Tensor, zxbcdt: Tensor, dt_bias: Tensor,
                  B_norm_weight: Tensor, C_norm_weight: Tensor,
                  B_bias: Tensor, C_bias: Tensor, D: Tensor,
                  reset: Optional[Tensor], states: Tensor, phase: Tensor,
                  headdim: int, ngroups: int, n_angles: int,
                  chunk_size: int, A_floor: float, eps: float,
                  mimo_x: Mimo = None, mimo_z: Mimo = None,
                  mimo_o: Mimo = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Launch _mixer_bwd, _sum_heads: dzxbcdt and the parameters'
    gradients (SISO mimo: empty)."""
    sizes = (headdim, ngroups, n_angles, chunk_size)
    run = _setup(zxbcdt, B_bias, sizes, (mimo_x, mimo_z, mimo_o), reset)
    inputs = _kernel_inputs(run, dt_bias, B_norm_weight, C_norm_weight,
                            B_bias, C_bias, D)
    B, L, H, P, N, R = run.B, run.L, run.H, run.P, run.N, run.R
    zx = run.zx
    nc = run.nc
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    # The width of a row of dparam.
    width = 2 * R * N + 2 * N + 2
    with _on_device(zx):
        dzx = torch.empty_like(zx, memory_format=torch.contiguous_format)
        part = zx.new_empty(B, L, H, 2 * R * N + run.S)
        dparam = zx.new_empty(B * H, nc, width, dtype=run.acc)
        dmimo = None
        if mimo_x is not None:
            dmimo = zx.new_empty(B * H, nc, 3, R, P, dtype=run.acc)
        _tuned(_mixer_bwd, (B * H,), *inputs, dout, dout.stride(0),
               dout.stride(1), _halves(states, run.tiles), phase, dzx,
               dzx.stride(0), dzx.stride(1), part, dparam, dmimo, L, nc,
               A_floor, eps, **run.constexprs())
        _tuned(_sum_heads, (B, triton.cdiv(L, 32)), part, dzx,
               dzx.stride(0), dzx.stride(1), L, R, H=H, G=run.G, P=P, N=N,
               S=run.S, TB=32, NB=_pow2(N), SB=_pow2(run.S),
               ACC=_TL_DTYPE[run.acc])
    # The parameters' per-(b, h, chunk) sums added up, as copies: a custom
    # op's outputs may not alias. dparam (H, 2RN + 2N + 2)
    dparam = dparam.view(B, H, nc, width).sum((0, 2))
    dbias = dparam[:, :2 * R * N].view(H, 2, *B_bias.shape[1:])
    dB_bias, dC_bias = dbias.unbind(1)
    dB_w, dC_w = dparam[:, 2 * R * N:-2].view(H, 2, N).sum(0)
    grads = (dparam[:, -2], dB_w, dC_w, dB_bias, dC_bias, dparam[:, -1])
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    grads = [g.to(p.dtype, copy=True) for g, p in zip(grads, params)]
    if mimo_x is None:
        empty = [zx.new_empty(0) for _ in range(3)]
        return (dzx, *grads, *empty)
    # 3 x (H, R, P)
    dmimo = dmimo.view(B, H, nc, 3, R, P).sum((0, 2)).unbind(1)
    dmimo = [g.to(m.dtype, copy=True) for g, m in zip(dmimo, run.mimo)]
    return (dzx, *grads, *dmimo)


@_mixer_bwd_op.register_fake
def _(dout, zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias,
      D, reset, states, phase, headdim, ngroups, n_angles, chunk_size,
      A_floor, eps, mimo_x=None, mimo_z=None, mimo_o=None):
    tensors = (zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias,
               C_bias, D)
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format)
             for t in tensors]
    mimo = []
    for m in (mimo_x, mimo_z, mimo_o):
        if m is None:
            mimo.append(zxbcdt.new_empty(0))
        else:
            mimo.append(torch.empty_like(m))
    return (*grads, *mimo)


def _mixer_setup_context(ctx, inputs, output):
    # inputs: the seven tensors, reset, six sizes, the mimo vectors.
    ctx.sizes = inputs[8:14]
    # states and phase
    ctx.mark_non_differentiable(*output[1:])
    # No zero-filled gradients for states and phase, which go unread.
    ctx.set_materialize_grads(False)
    # The mimo vectors come last.
    ctx.save_for_backward(*inputs[:8], *output[1:], *inputs[14:])


def _mixer_grad(ctx, dout, _dstates, _dphase):
    saved = ctx.saved_tensors
    grads = _mixer_bwd_op(dout, *saved[:10], *ctx.sizes, *saved[10:])
    mimo = []
    for m, g in zip(saved[10:], grads[7:]):
        if m is None:
            mimo.append(None)
        else:
            mimo.append(g)
    # No gradients for reset and the six sizes.
    return (*grads[:7], *[None] * 7, *mimo)


_mixer_fwd_op.register_autograd(_mixer_grad,
                                setup_context=_mixer_setup_context)


def _state_outputs(run):
    # out (B, L, H*P); the state after the last token: S (B, H, P, N) and
    # Phi (B, H, S) in the accumulator dtype, k (B, H, R, N) in zxbcdt's.
    B, H = run.B, run.H
    out = run.zx.new_empty(B, run.L, H * run.P)
    S = run.zx.new_empty(B, H, run.P, run.N, dtype=run.acc)
    phi = run.zx.new_empty(B, H, run.S, dtype=run.acc)
    k = run.zx.new_empty(B, H, run.R, run.N)
    return out, S, phi, k


# The forward from a decoding state (prefill): no autograd formula, since
# nothing is saved for a backward; mixer_triton refuses it where a
# gradient is wanted.
@torch.library.custom_op("mamba3::mixer_fwd_state", mutates_args=())
def _mixer_fwd_state_op(zxbcdt: Tensor, dt_bias: Tensor,
                        B_norm_weight: Tensor, C_norm_weight: Tensor,
                        B_bias: Tensor, C_bias: Tensor, D: Tensor,
                        reset: Optional[Tensor], S_in: Tensor,
                        phi_in: Tensor, headdim: int, ngroups: int,
                        n_angles: int, chunk_size: int, A_floor: float,
                        eps: float, mimo_x: Mimo = None, mimo_z: Mimo = None,
                        mimo_o: Mimo = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch _mixer_fwd from S_in (B, H, P, N), the state entering the
    first chunk, and the phases phi_in (B, H, S): (out (B, L, H*P),
    S (B, H, P, N), Phi (B, H, S), k (B, H, R, N)) after the last token."""
    sizes = (headdim, ngroups, n_angles, chunk_size)
    run = _setup(zxbcdt, B_bias, sizes, (mimo_x, mimo_z, mimo_o), reset)
    inputs = _kernel_inputs(run, dt_bias, B_norm_weight, C_norm_weight,
                            B_bias, C_bias, D)
    S_in = S_in.to(run.acc).contiguous()
    phi_in = phi_in.to(run.acc).contiguous()
    with _on_device(run.zx):
        out, S, phi, k = _state_outputs(run)
        # Nothing saved: no states, no phases.
        _tuned(_mixer_fwd, (run.B * run.H,), *inputs, out, out.stride(0),
               out.stride(1), None, None, S_in, phi_in, S, phi, k, run.L,
               run.nc, A_floor, eps, **run.constexprs(), HAS_STATE=True)
    return out, S, phi, k


@_mixer_fwd_state_op.register_fake
def _(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D,
      reset, S_in, phi_in, headdim, ngroups, n_angles, chunk_size, A_floor,
      eps, mimo_x=None, mimo_z=None, mimo_o=None):
    sizes = (headdim, ngroups, n_angles, chunk_size)
    run = _setup(zxbcdt, B_bias, sizes, (mimo_x, mimo_z, mimo_o), reset)
    return _state_outputs(run)


def _needs_grad(tensors):
    # Whether autograd would record a graph through any of the tensors.
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def _entering_state(zxbcdt, dt_bias, state, headdim, ngroups, n_angles,
                    mimo_x, N, R):
    """A decoding state (mixer_torch's) as the fused forward starts from
    it: (S_in (B, H, P, N), Phi (B, H, S)) in the accumulator dtype.

    S_in = S + beta_0 sum_r x_r^T k_r, with x_r, k_r the previous token's
    (its x lifted by mimo_x) and beta_0 = (1 - lam_0) dt_0 the first
    token's: the state ssd_chunked carries into its first chunk. A reset
    at t = 0 clears it in the kernel, as it clears the phases.
    """
    phi, S, k_prev, x_prev = state
    H = dt_bias.shape[0]
    P = headdim
    B = zxbcdt.shape[0]
    k_shape = (B, H, N)
    if R > 1:
        k_shape = (B, H, R, N)
    shapes = [tuple(t.shape) for t in state]
    wanted = [(B, H, n_angles), (B, H, P, N), k_shape, (B, H, P)]
    if shapes != wanted:
        raise ValueError(
            f"mixer: a decoding state is (Phi, S, k_prev, x_prev) of "
            f"shapes {wanted} for this zxbcdt (model.init_cache makes "
            f"one); got {shapes}")
    acc = _compute_dtype(zxbcdt)
    sizes = split_sizes(H, P, ngroups, N, n_angles, R)
    parts = zxbcdt[:, 0].split(sizes, -1)
    # The first token's dt and lam, as mixer_torch computes them: (B, H).
    dt = F.softplus(_f32(parts[4]) + dt_bias)
    lam = torch.sigmoid(_f32(parts[6]))
    beta = ((1 - lam) * dt).to(acc)
    # x_r (B, H, R, P), k_r (B, H, R, N)
    x_r = _lift(x_prev[:, :, None], mimo_x).to(acc)
    k_r = k_prev.view(B, H, R, N).to(acc)
    S_in = S.to(acc) + beta[..., None, None] * (x_r.mT @ k_r)
    return S_in, phi.to(acc)


def mixer_triton(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias,
                 C_bias, D, *, headdim, ngroups, n_angles, chunk_size=64,
                 A_floor=1e-4, eps=1e-5, reset=None, mimo=None, state=None):
    """mixer_torch's out from the custom op mamba3::mixer_fwd; with a
    decoding state (mixer_torch's), (out, state after the last token) from
    mamba3::mixer_fwd_state, which runs without gradients (prefill)."""
    torch_path = "use impl='torch' (MAMBA3_IMPL=torch)"
    if not _triton_fits():
        if triton:
            found = f"found Triton {triton.__version__}"
        else:
            found = "none imports (Linux only)"
        raise RuntimeError(
            f"mixer: impl='triton' needs Triton >= {TRITON_NEEDED} but "
            f"{found}; install or upgrade it, or {torch_path}")
    why = fused_refusal(zxbcdt)
    if why:
        raise RuntimeError(
            f"mixer: impl='triton' cannot run here: {why}; {torch_path}")
    if not zxbcdt.is_cuda and not _INTERPRETED:
        raise RuntimeError(
            f"mixer: impl='triton' on CPU tensors runs only through "
            f"Triton's interpreter: set TRITON_INTERPRET=1 before "
            f"importing triton, or {torch_path}")
    mimo_vectors = mimo or ()
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    if state is None:
        outputs = _mixer_fwd_op(zxbcdt, *params, reset, headdim, ngroups,
                                n_angles, chunk_size, float(A_floor),
                                float(eps), *mimo_vectors)
        return outputs[0]
    if _needs_grad([zxbcdt, *params, *mimo_vectors, *state]):
        raise RuntimeError(
            f"mixer: impl='triton' from a decoding state runs forward "
            f"only (prefill): call it under torch.no_grad(), or "
            f"{torch_path} for gradients")
    N = B_bias.shape[-1]
    R = 1
    mimo_x = None
    if mimo is not None:
        R = mimo[0].shape[1]
        mimo_x = mimo[0]
    S_in, phi_in = _entering_state(zxbcdt, dt_bias, state, headdim,
                                   ngroups, n_angles, mimo_x, N, R)
    out, S, phi, k_last = _mixer_fwd_state_op(
        zxbcdt, *params, reset, S_in, phi_in, headdim, ngroups, n_angles,
        chunk_size, float(A_floor), float(eps), *mimo_vectors)
    # The last token's x (B, H, P): the cache holds x, not its R inputs.
    H = dt_bias.shape[0]
    x_cols = zxbcdt[:, -1, H * headdim:2 * H * headdim]
    x_last = x_cols.reshape(-1, H, headdim).clone()
    return out, (phi, S, k_last.view_as(state[2]), x_last)


# -----------------------------------------------------------------------------
# dispatch


def triton_available():
    """Whether Triton imported here (on a GPU, or under TRITON_INTERPRET=1
    on CPU tensors)."""
    return triton is not None


def _resolve(impl, x):
    if impl == "auto":
        fast = "torch"
        if x.is_cuda and triton_available():
            fast = "triton"
        impl = os.environ.get("MAMBA3_IMPL") or fast
    if impl not in IMPLS[1:]:
        raise ValueError(f"impl must be one of {IMPLS} (or MAMBA3_IMPL one "
                         f"of {IMPLS[1:]}), got {impl!r}")
    return impl


def ssd(x, q, k, log_a, gamma, beta, state=None, chunk_size=64,
        impl="auto", reset=None):
    """The scan (the module docstring's shapes): y as x, and the final
    state (S, k_prev, x_prev).

    impl: "recurrent", "torch" (chunked) or "auto" ("torch" unless
    MAMBA3_IMPL says "recurrent"). Triton runs the scan only inside the
    mixer region: impl="triton" is refused here.
    """
    if impl == "triton":
        raise ValueError(
            "ssd: the scan alone has no Triton kernel (Triton runs it "
            "inside the mixer region: mixer(impl='triton')); use "
            "impl='torch' or 'recurrent'")
    if _resolve(impl, x) == "recurrent":
        impl = "recurrent"
    else:
        impl = "torch"
    shapes = [tuple(t.shape) for t in (x, q, k, log_a, gamma, beta)]
    scalars_fit = all(s == shapes[0][:3] for s in shapes[3:])
    if (x.dim() not in (4, 5) or x.shape[1] == 0 or q.shape != k.shape
            or q.shape[:-1] != x.shape[:-1] or not scalars_fit):
        raise ValueError(
            f"ssd: x must be (B, L >= 1, H, [R,] P), q and k "
            f"(B, L, H, [R,] N), log_a, gamma and beta (B, L, H); got "
            f"{shapes}")
    _check_reset(reset, x.shape[0], x.shape[1], "ssd")
    if x.dim() == 4:
        # SISO: the same scan with a rank axis of one.
        if state is not None:
            state = (state[0], state[1][:, :, None], state[2][:, :, None])
        y, (S, k_last, x_last) = ssd(
            x[:, :, :, None], q[:, :, :, None], k[:, :, :, None], log_a,
            gamma, beta, state, chunk_size, impl, reset)
        return y[:, :, :, 0], (S, k_last[:, :, 0], x_last[:, :, 0])
    # Both forms start from (S0, k_prev, x_prev) in the compute dtype,
    # zeros without a state.
    if state is None:
        B, _, H, R, P = x.shape
        N = k.shape[-1]
        state = (x.new_zeros(B, H, P, N), k.new_zeros(B, H, R, N),
                 x.new_zeros(B, H, R, P))
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    state = tuple(t.to(dtype) for t in state)
    if impl == "recurrent":
        return ssd_recurrent(x, q, k, log_a, gamma, beta, state, reset)
    return ssd_chunked(x, q, k, log_a, gamma, beta, state, chunk_size,
                       reset)


def mixer(zxbcdt, dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D,
          *, headdim, ngroups, n_angles, chunk_size=64, A_floor=1e-4,
          eps=1e-5, reset=None, state=None, impl="auto", mimo=None):
    """The mixer region, in_proj's output -> out_proj's input:
    (out (B, L, H*P), state).

    impl: "recurrent" or "torch" (mixer_torch), "triton" (mixer_triton;
    with a decoding state, only where no gradient is wanted, else
    mixer_torch's chunked scan), or "auto" (MAMBA3_IMPL, else Triton for
    CUDA tensors when it imports). Where the fused kernels cannot run
    (fused_refusal), "auto" warns and takes the PyTorch path, "triton"
    refuses.
    """
    asked = impl
    if impl == "auto":
        asked = os.environ.get("MAMBA3_IMPL")
    impl = _resolve(impl, zxbcdt)
    why = None
    if impl == "triton" and asked is None:
        why = fused_refusal(zxbcdt)
    # A warning in a compile trace breaks the graph.
    if why and not torch.compiler.is_compiling():
        warnings.warn(f"mixer: {why}; it runs on the PyTorch path "
                      f"(MAMBA3_IMPL=torch chooses that without this note)",
                      stacklevel=2)
    params = (dt_bias, B_norm_weight, C_norm_weight, B_bias, C_bias, D)
    kw = dict(headdim=headdim, ngroups=ngroups, n_angles=n_angles,
              chunk_size=chunk_size, A_floor=A_floor, eps=eps, reset=reset)
    if impl == "triton" and not why:
        if state is None:
            out = mixer_triton(zxbcdt, *params, mimo=mimo, **kw)
            return out, None
        # A decoding state without gradients (prefill, a rolling
        # evaluation): the fused forward from that state.
        tensors = [zxbcdt, *params, *(mimo or ()), *state]
        if not _needs_grad(tensors):
            return mixer_triton(zxbcdt, *params, mimo=mimo, state=state,
                                **kw)
    # A state with gradients, or where Triton cannot run: the PyTorch path.
    scan = impl
    if impl == "triton":
        scan = "torch"
    return mixer_torch(zxbcdt, *params, state=state, impl=scan, mimo=mimo,
                       **kw)
