"""The Mamba-3 scan, `ssd`, three ways: the token-by-token recurrence (the oracle, and what a decode step
uses), the chunked PyTorch path (vectorised across chunks, differentiable through autograd) and Triton
forward and backward kernels. MAMBA3.md §2 is the definition; names follow it.

Per batch element b and head h, with S the (P x N) state:

    S_t = exp(log_a_t) * (S_{t-1} + beta_t * x_{t-1} k_{t-1}^T) + gamma_t * x_t k_t^T
    y_t = S_t q_t

Shapes: x (B, L, H, P); q, k (B, L, H, N); log_a, gamma, beta (B, L, H). The state passed in and out is
the tuple (S (B, H, P, N) float32, k_prev (B, H, N), x_prev (B, H, P)): exactly what a continuation call
or a decoder needs.
"""
import os

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


def ssd_recurrent(x, q, k, log_a, gamma, beta, state=None):
    """MAMBA3.md §2's recurrence, one token at a time. Slow; the ground truth for every other path."""
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    S, k_prev, x_prev = _initial_state(state, x, k, dtype)
    xc, qc, kc = x.to(dtype), q.to(dtype), k.to(dtype)
    la, g, b = log_a.to(dtype), gamma.to(dtype), beta.to(dtype)
    ys = []
    for t in range(x.shape[1]):
        y, S = recurrent_step(S, k_prev, x_prev, xc[:, t], qc[:, t], kc[:, t], la[:, t], g[:, t], b[:, t])
        ys.append(y)
        k_prev, x_prev = kc[:, t], xc[:, t]
    return torch.stack(ys, dim=1).to(x.dtype), _final_state(S, x, k)


# -----------------------------------------------------------------------------
# the chunked form in PyTorch


def decay_matrix(cs):
    """cs (b, C) -> D (b, C, C) with D_ij = exp(cs_i - cs_j) for j <= i and 0 above the diagonal.
    Only differences <= 0 are exponentiated: the ones above the diagonal (> 0, possibly huge) are clamped
    to 0 first and then masked."""
    return (cs[:, :, None] - cs[:, None, :]).clamp_(max=0).exp_().tril_()


def _weights(D, w, g):
    """The intra-chunk weights W: D_ij w_j below the diagonal, gamma_i on it (D is 0 above)."""
    W = D * w[:, None, :]
    W.diagonal(dim1=1, dim2=2).copy_(g)
    return W


class ChunkedScan(torch.autograd.Function):
    """The chunked scan on chunk-major tensors (b = B*H*nc chunks of C tokens), forward and backward written
    out by hand. Autograd would keep and copy several C x C temporaries per chunk; this keeps two (the decay
    matrix D and the scores Q K^T) and spends its time in batched matmuls. The same equations are what the
    Triton kernels compute tile by tile. Per chunk, with Sin the state entering it:

        Y    = (W o (Q K^T)) X + exp(cs) * (Q Sin^T)       W_ij = D_ij w_j (j < i), gamma_i (j = i), 0 (j > i)
        Sout = exp(cs_last) Sin + (X * u)^T K              u_s = exp(cs_last - cs_s) w_s

    and a short loop over the chunks chains them: Sin_{c+1} = Sout_c."""

    @staticmethod
    def forward(ctx, X, Q, K, cs, w, g, Sin0):  # (b, C, P), (b, C, N) x2, (b, C) x3, (BH, P, N)
        b, C, P = X.shape
        BH, _, N = Sin0.shape
        nc = b // BH
        # what each chunk adds to the state at its end (its last token's w already holds the next beta)
        u = (cs[:, -1:] - cs).exp() * w  # (b, C)
        dS = torch.bmm((X * u[..., None]).transpose(1, 2), K).view(BH, nc, P, N)
        # the states entering the chunks, one chunk after the other (nc = L / C: a short loop)
        a = cs[:, -1].exp().view(BH, nc)  # each chunk's total decay
        Sin = torch.empty_like(dS)
        S = Sin0
        for c in range(nc):
            Sin[:, c] = S
            S = a[:, c, None, None] * S + dS[:, c]
        Sin = Sin.view(b, P, N)
        D = decay_matrix(cs)
        scores = torch.bmm(Q, K.transpose(1, 2))  # (b, C, C)
        ctx.save_for_backward(X, Q, K, cs, w, g, D, scores, Sin)
        Y = torch.bmm(scores * _weights(D, w, g), X)
        return Y.addcmul_(cs.exp()[..., None], torch.bmm(Q, Sin.transpose(1, 2))), S

    @staticmethod
    def backward(ctx, dY, dS_final):
        X, Q, K, cs, w, g, D, scores, Sin = ctx.saved_tensors
        b, C, P = X.shape
        BH, N = dS_final.shape[0], Q.shape[-1]
        nc = b // BH
        W = _weights(D, w, g)
        e = cs.exp()
        # intra-chunk: Y = M X with M = scores o W
        dM = torch.bmm(dY, X.transpose(1, 2))  # (b, C, C)
        dX = torch.bmm((scores * W).transpose(1, 2), dY)
        dscores = dM * W
        dQ, dK = torch.bmm(dscores, K), torch.bmm(dscores.transpose(1, 2), Q)
        # W's gradient, through D: R = dW o D. W_ii = gamma_i (D_ii = 1); below, w_j and D_ij = exp(cs_i - cs_j),
        # so cs_i gets the row sum of R_ij w_j and cs_j loses the column sum (the diagonal terms cancel)
        R = dM.mul_(scores).mul_(D)
        dg = R.diagonal(dim1=1, dim2=2).clone()
        colR = R.sum(1)
        dw = colR - dg
        dcs = torch.bmm(R, w[..., None])[..., 0] - w * colR
        # inter-chunk: exp(cs) * (Q Sin^T)
        T = torch.bmm(dY, Sin)  # (b, C, N)
        dcs += e * (T * Q).sum(-1)
        dQ.addcmul_(e[..., None], T)
        dSin = torch.bmm((dY * e[..., None]).transpose(1, 2), Q).view(BH, nc, P, N)
        # the loop over the chunks, backwards: G is the gradient of the state leaving chunk c
        Sin = Sin.view(BH, nc, P, N)
        a = cs[:, -1].exp().view(BH, nc)
        dS, da = torch.empty_like(Sin), torch.empty_like(a)
        G = dS_final
        for c in reversed(range(nc)):
            dS[:, c] = G
            da[:, c] = (G * Sin[:, c]).sum((-1, -2)) * a[:, c]  # Sout_c = a_c Sin_c + dS_c, a_c = exp(cs_last)
            G = a[:, c, None, None] * G + dSin[:, c]
        # what each chunk adds: dS = (X * u)^T K with u_s = f_s w_s, f_s = exp(cs_last - cs_s)
        dS = dS.view(b, P, N)
        f = (cs[:, -1:] - cs).exp()
        u = f * w
        dXu = torch.bmm(K, dS.transpose(1, 2))  # (b, C, P)
        dX.addcmul_(dXu, u[..., None])
        dK += torch.bmm(X * u[..., None], dS)
        du = (dXu * X).sum(-1)  # (b, C)
        dw += du * f
        dcs -= du * u
        dcs[:, -1] += (du * u).sum(-1) + da.view(b)
        return dX, dQ, dK, dcs, dw, dg, G  # G is now the gradient of Sin0


def ssd_chunked(x, q, k, log_a, gamma, beta, state=None, chunk_size=64):
    """The chunked form of MAMBA3.md §2: chunks of C tokens become the batch of the matmuls in ChunkedScan.
    cs is the inclusive cumsum of log_a inside a chunk and w_s = gamma_s + beta_{s+1}."""
    B, L, H, P = x.shape
    N = q.shape[-1]
    C = chunk_size
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    S0, k_prev, x_prev = _initial_state(state, x, k, dtype)
    with torch.autocast(x.device.type, enabled=False):
        # w_s = gamma_s + beta_{s+1}: token s's input also enters the next step's trapezoid; 0 after the last
        w = gamma.to(dtype) + F.pad(beta[:, 1:].to(dtype), (0, 0, 0, 1))  # (B, L, H)
        # pad to whole chunks with tokens that change nothing (no decay, no input), then chunk-major:
        # (B, L, H, D) -> (B*H*nc, C, D)
        pad = (-L) % C
        nc = (L + pad) // C

        def chunks(t):
            t = F.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)) if pad else t.to(dtype)
            return t.view(B, nc, C, H, -1).permute(0, 3, 1, 2, 4).reshape(B * H * nc, C, -1)

        X, Q, K = chunks(x), chunks(q), chunks(k)  # (b, C, P|N), b = B*H*nc
        la, g, w = (chunks(t[..., None])[..., 0] for t in (log_a, gamma, w))  # (b, C)
        cs = la.cumsum(dim=-1)  # (b, C), <= 0 and decreasing
        # the state entering the first chunk: S0 plus the first token's beta term, which needs x_prev, k_prev
        Sin0 = S0 + beta[:, 0, :, None, None].to(dtype) * x_prev[..., :, None] * k_prev[..., None, :]
        Y, S = ChunkedScan.apply(X, Q, K, cs, w, g, Sin0.view(B * H, P, N))  # (b, C, P), (B*H, P, N)
        y = Y.view(B, H, nc, C, P).permute(0, 2, 3, 1, 4).reshape(B, nc * C, H, P)[:, :L]
    return y.to(x.dtype), _final_state(S.view(B, H, P, N), x, k)


# -----------------------------------------------------------------------------
# dispatch


def ssd(x, q, k, log_a, gamma, beta, state=None, chunk_size=64, impl="auto"):
    """The Mamba-3 scan. Returns y (B, L, H, P) in x's dtype and the final state (S, k_prev, x_prev).

    impl: "recurrent" (the oracle), "torch" (chunked, autograd), "triton" (fused kernels), or "auto":
    Triton for CUDA tensors when it imports, else torch. The environment variable MAMBA3_IMPL overrides
    "auto" (handy to A/B the paths without touching code)."""
    if impl == "auto":
        impl = os.environ.get("MAMBA3_IMPL") or "torch"
    if impl not in IMPLS[1:]:
        raise ValueError(f"ssd: impl must be one of {IMPLS} (or MAMBA3_IMPL one of {IMPLS[1:]}), got {impl!r}")
    _check_shapes(x, q, k, log_a, gamma, beta)
    if impl == "recurrent":
        return ssd_recurrent(x, q, k, log_a, gamma, beta, state)
    return ssd_chunked(x, q, k, log_a, gamma, beta, state, chunk_size)


def _check_shapes(x, q, k, log_a, gamma, beta):
    if x.dim() != 4 or x.shape[1] == 0:
        raise ValueError(f"ssd: x must be (B, L, H, P) with L >= 1, got {tuple(x.shape)}")
    B, L, H, _ = x.shape
    if q.shape != k.shape or q.shape[:3] != (B, L, H):
        raise ValueError(f"ssd: q and k must be (B, L, H, N) = ({B}, {L}, {H}, N), got {tuple(q.shape)} and {tuple(k.shape)}")
    for name, t in (("log_a", log_a), ("gamma", gamma), ("beta", beta)):
        if t.shape != (B, L, H):
            raise ValueError(f"ssd: {name} must be (B, L, H) = {(B, L, H)}, got {tuple(t.shape)}")
