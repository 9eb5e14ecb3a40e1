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
    matrix D, the scores Q K^T and M) and spends its time in batched matmuls. The same equations are what the
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
        Xu = X * u[..., None]  # (b, C, P)
        dS = torch.bmm(Xu.transpose(1, 2), K).view(BH, nc, P, N)
        # the states entering the chunks, one chunk after the other (nc = L / C: a short loop)
        a = cs[:, -1].exp().view(BH, nc, 1, 1)  # each chunk's total decay
        Sin = torch.empty_like(dS)
        S = Sin0
        for c in range(nc):
            Sin[:, c] = S
            S = torch.addcmul(dS[:, c], a[:, c], S)
        Sin = Sin.view(b, P, N)
        D = decay_matrix(cs)
        scores = torch.bmm(Q, K.transpose(1, 2))  # (b, C, C)
        M = _weights(D, w, g).mul_(scores)
        # kept for the backward: D, scores and M (on a CPU, recomputing M costs as much as keeping it)
        ctx.save_for_backward(X, Q, K, cs, w, g, D, scores, M, Sin)
        QS = torch.bmm(Q, Sin.transpose(1, 2), out=Xu)  # Xu's buffer is free again: one 4 MB page-fault less
        return torch.bmm(M, X).addcmul_(cs.exp()[..., None], QS), S

    @staticmethod
    def backward(ctx, dY, dS_final):
        X, Q, K, cs, w, g, D, scores, M, Sin = ctx.saved_tensors
        dY = dY.contiguous()  # it arrives as a view of (B, L, H, P); four matmuls read it
        b, C, P = X.shape
        BH, N = dS_final.shape[0], Q.shape[-1]
        nc = b // BH
        e = cs.exp()
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
        # inter-chunk: exp(cs) * (Q Sin^T)
        T = torch.bmm(dY, Sin)  # (b, C, N)
        dcs += e * torch.linalg.vecdot(T, Q)
        dQ.addcmul_(e[..., None], T)
        dYe = dY * e[..., None]  # (b, C, P)
        dSin = torch.bmm(dYe.transpose(1, 2), Q).view(BH, nc, P, N)
        # the loop over the chunks, backwards: G is the gradient of the state leaving chunk c
        a = cs[:, -1].exp().view(BH, nc, 1, 1)
        G = dS_final
        for c in reversed(range(nc)):  # dSin's slots take the gradient of each chunk's dS as they free up
            G, dSin[:, c] = torch.addcmul(dSin[:, c], a[:, c], G), G
        dS = dSin
        # Sout_c = a_c Sin_c + dS_c with a_c = exp(cs_last): cs_last gets a_c <G_c, Sin_c>
        da = torch.linalg.vecdot(dS.flatten(2), Sin.view(BH, nc, P * N)) * a.view(BH, nc)
        # what each chunk adds: dS = (X * u)^T K with u_s = f_s w_s, f_s = exp(cs_last - cs_s)
        dS = dS.view(b, P, N)
        f = (cs[:, -1:] - cs).exp()
        u = f * w
        # (the dead buffers of dY * e and T take the products: on a CPU, fresh 4 MB buffers cost page faults)
        dXu = torch.bmm(K, dS.transpose(1, 2), out=dYe)  # (b, C, P)
        dX.addcmul_(dXu, u[..., None])
        dK.addcmul_(u[..., None], torch.bmm(X, dS, out=T))
        du = torch.linalg.vecdot(dXu, X)  # (b, C)
        dw += du * f
        dcs -= du * u
        dcs[:, -1] += (du * u).sum(-1) + da.view(b)
        return dX, dQ, dK, dcs, dw, dg, G  # G is now the gradient of Sin0


def _chunk_glue(gamma, beta, state, x, k, dtype):
    """What both chunked paths compute on (B, L, H) scalars before the chunks: w_s = gamma_s + beta_{s+1}
    (token s's input also enters the next step's trapezoid; 0 after the last token), and the state entering
    the first chunk, S0 plus the first token's beta term (which needs x_prev and k_prev)."""
    S0, k_prev, x_prev = _initial_state(state, x, k, dtype)
    w = gamma.to(dtype) + F.pad(beta[:, 1:].to(dtype), (0, 0, 0, 1))  # (B, L, H)
    Sin0 = S0 + beta[:, 0, :, None, None].to(dtype) * x_prev[..., :, None] * k_prev[..., None, :]  # (B, H, P, N)
    return w, Sin0


def ssd_chunked(x, q, k, log_a, gamma, beta, state=None, chunk_size=64):
    """The chunked form of MAMBA3.md §2: chunks of C tokens become the batch of the matmuls in ChunkedScan.
    cs is the inclusive cumsum of log_a inside a chunk and w_s = gamma_s + beta_{s+1}."""
    B, L, H, P = x.shape
    N = q.shape[-1]
    C = chunk_size
    dtype = _compute_dtype(x, q, k, log_a, gamma, beta)
    with torch.autocast(x.device.type, enabled=False):
        w, Sin0 = _chunk_glue(gamma, beta, state, x, k, dtype)
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
        Y, S = ChunkedScan.apply(X, Q, K, cs, w, g, Sin0.view(B * H, P, N))  # (b, C, P), (B*H, P, N)
        y = Y.view(B, H, nc, C, P).permute(0, 2, 3, 1, 4).reshape(B, nc * C, H, P)[:, :L]
    return y.to(x.dtype), _final_state(S.view(B, H, P, N), x, k)


# -----------------------------------------------------------------------------
# the chunked form in Triton
#
# The same equations as ChunkedScan, tile by tile. One program per chunk (pid = (b * H + h) * nc + c) and, on the
# second grid axis, per tile of P or N. x, q, k, y and their gradients are read and written in place through
# their (b, l, h) strides (last dim contiguous), masking the tokens past L in the last chunk instead of padding
# copies; the per-token scalars cs, w, gamma are (B*H, nc, C), padded past L with tokens that neither decay nor
# add input (so they load without masks), and the per-chunk states are (B*H, nc, P, N). Two dtypes, both tl.constexpr: DT, the one operand dtype of every
# tl.dot (the inputs' dtype: bf16, fp16 or fp32), and ACC, the dtype of cumsums, states, scalars and
# accumulators (float32; float64 only for float64 inputs, which is what the oracle tests use).

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform (macOS); impl="triton" then says so, everything else works
    triton = None

if triton is not None:
    # Under TRITON_INTERPRET=1 (read when the kernels below are decorated, i.e. at import) they run as numpy on
    # CPU tensors: the tests run them that way. Its one gap that matters here: no bfloat16 arithmetic (see _dot).
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))
    _TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}

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
    def _chunk_coords(pid, H, nc, C: tl.constexpr):
        # chunk pid -> batch b, head h and its C token positions t in the sequence
        bh, c = pid // nc, pid % nc
        return bh // H, bh % H, c * C + tl.arange(0, C)

    @triton.jit
    def _load_rows(ptr, s_b, s_l, s_h, b, h, t, L, d, ncols):
        # the (C, tile) block of a (B, L, H, ncols) tensor at tokens t and columns d; zeros past L and ncols
        mask = (t[:, None] < L) & (d[None, :] < ncols)
        return tl.load(ptr + b * s_b + h * s_h + t[:, None] * s_l + d[None, :], mask=mask, other=0.0)

    @triton.jit
    def _store_rows(ptr, s_b, s_l, s_h, b, h, t, L, d, ncols, value):
        mask = (t[:, None] < L) & (d[None, :] < ncols)
        tl.store(ptr + b * s_b + h * s_h + t[:, None] * s_l + d[None, :], value.to(ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _load_state(ptr, pid, p, n, P, N):
        # the (p, n) tile of chunk pid's (P, N) state
        return tl.load(ptr + pid * P * N + p[:, None] * N + n[None, :], mask=(p[:, None] < P) & (n[None, :] < N),
                       other=0.0)

    @triton.jit
    def _chunk_scalars(cs_ptr, w_ptr, g_ptr, pid, C: tl.constexpr):
        """cs, w, gamma of chunk pid (C,) and what is built from them:
            e_i = exp(cs_i)               the decay from the chunk's start through token i
            f_i = exp(cs_last - cs_i)     the decay from token i to the chunk's end;  u_i = f_i w_i
            D_ij = exp(cs_i - cs_j) for j <= i, else 0
            W_ij = D_ij w_j for j < i, gamma_i on the diagonal, 0 above
        Every exponent is <= 0 (log_a <= 0); D's differences above the diagonal are > 0 (and possibly huge), so
        they are clamped to 0 first and masked after."""
        i = tl.arange(0, C)
        cs, w, g = tl.load(cs_ptr + pid * C + i), tl.load(w_ptr + pid * C + i), tl.load(g_ptr + pid * C + i)
        f = tl.exp(tl.load(cs_ptr + pid * C + C - 1) - cs)
        D = tl.where(i[:, None] >= i[None, :], tl.exp(tl.minimum(cs[:, None] - cs[None, :], 0.0)), 0.0)
        W = tl.where(i[:, None] > i[None, :], D * w[None, :], tl.where(i[:, None] == i[None, :], g[:, None], 0.0))
        return cs, w, tl.exp(cs), f, f * w, D, W

    @triton.jit
    def _chunk_state(x_ptr, sx_b, sx_l, sx_h, k_ptr, sk_b, sk_l, sk_h, cs_ptr, w_ptr, out_ptr, L, H, P, N, nc,
                     C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, BACKWARD: tl.constexpr):
        """What a chunk adds to the state at its end, one (BP, BN) tile per program; grid (chunks, P/BP, N/BN):
            forward:   dS_c   = (X * u)^T K      u_i = exp(cs_last - cs_i) w_i
            backward:  dSin_c = (dY * e)^T Q     e_i = exp(cs_i), with (dY, Q) in the (x, k) slots: the gradient
                       that chunk c's outputs Y = exp(cs) * (Q Sin_c^T) + ... send to the state entering it."""
        pid = tl.program_id(0).to(tl.int64)
        b, h, t = _chunk_coords(pid, H, nc, C)
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        n = tl.program_id(2) * BN + tl.arange(0, BN)
        i = tl.arange(0, C)
        cs = tl.load(cs_ptr + pid * C + i)
        if BACKWARD:
            s = tl.exp(cs)
        else:
            s = tl.exp(tl.load(cs_ptr + pid * C + C - 1) - cs) * tl.load(w_ptr + pid * C + i)
        X = _load_rows(x_ptr, sx_b, sx_l, sx_h, b, h, t, L, p, P)  # (C, BP)
        K = _load_rows(k_ptr, sk_b, sk_l, sk_h, b, h, t, L, n, N)  # (C, BN)
        out = _dot(tl.trans(X * s[:, None]), K, DT)  # (BP, BN)
        tl.store(out_ptr + pid * P * N + p[:, None] * N + n[None, :], out, mask=(p[:, None] < P) & (n[None, :] < N))

    @triton.jit
    def _state_fwd(S_ptr, cs_ptr, Sin0_ptr, Sfinal_ptr, nc, PN, C: tl.constexpr, BLOCK: tl.constexpr):
        """The chunks chained one after the other: sequential in c, parallel over (b, h) and BLOCK-sized tiles of
        the flattened (P, N) state; grid (B*H, PN/BLOCK).
            Sin_0 = S0 + beta_0 x_prev k_prev^T (given),   Sin_{c+1} = exp(cs_last,c) Sin_c + dS_c
        S_ptr holds dS_c on entry and Sin_c on exit; Sfinal gets Sin_nc, the true state after the last token
        (its w has no next beta)."""
        bh = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        S = tl.load(Sin0_ptr + bh * PN + j, mask=j < PN, other=0.0)
        for c in range(nc):
            chunk = bh * nc + c
            ptrs = S_ptr + chunk * PN + j
            dS = tl.load(ptrs, mask=j < PN, other=0.0)
            tl.store(ptrs, S, mask=j < PN)
            S = tl.exp(tl.load(cs_ptr + chunk * C + C - 1)) * S + dS
        tl.store(Sfinal_ptr + bh * PN + j, S, mask=j < PN)

    @triton.jit
    def _chunk_output(x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h,
                      y_ptr, sy_b, sy_l, sy_h, cs_ptr, w_ptr, g_ptr, Sin_ptr, L, H, P, N, nc,
                      C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
        """A chunk's outputs, one P tile per program; grid (chunks, P/BP); the sums over N run in BN tiles:
            Y = (W o (Q K^T)) X + exp(cs) * (Q Sin^T)
        the intra-chunk (masked) form plus what the state entering the chunk contributes."""
        pid = tl.program_id(0).to(tl.int64)
        b, h, t = _chunk_coords(pid, H, nc, C)
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        scores = tl.zeros((C, C), ACC)  # Q K^T
        QS = tl.zeros((C, BP), ACC)  # Q Sin^T
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            Q = _load_rows(q_ptr, sq_b, sq_l, sq_h, b, h, t, L, n, N)  # (C, BN)
            K = _load_rows(k_ptr, sk_b, sk_l, sk_h, b, h, t, L, n, N)
            scores += _dot(Q, tl.trans(K), DT)
            QS += _dot(Q, tl.trans(_load_state(Sin_ptr, pid, p, n, P, N)), DT)
        cs, w, e, f, u, D, W = _chunk_scalars(cs_ptr, w_ptr, g_ptr, pid, C)
        X = _load_rows(x_ptr, sx_b, sx_l, sx_h, b, h, t, L, p, P)  # (C, BP)
        Y = _dot(scores * W, X, DT) + e[:, None] * QS
        _store_rows(y_ptr, sy_b, sy_l, sy_h, b, h, t, L, p, P, Y)

    @triton.jit
    def _state_bwd(dS_ptr, Sin_ptr, cs_ptr, dSfinal_ptr, dSin0_ptr, da_ptr, nc, PN,
                   C: tl.constexpr, BLOCK: tl.constexpr):
        """The chain in reverse, for the gradient G of the state leaving each chunk; grid (B*H, PN/BLOCK):
            G_{nc-1} = dS_final,   G_{c-1} = exp(cs_last,c) G_c + dSin_c
        dS_ptr holds dSin_c (from _chunk_state on dY, Q) on entry and G_c on exit; dSin0 gets the gradient of the
        state entering chunk 0. Since Sout_c = a_c Sin_c + ..., a_c = exp(cs_last,c) gets a_c <G_c, Sin_c> in
        cs_last's gradient: each program writes its tile's share to da (chunks, tiles), summed in torch."""
        bh = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        G = tl.load(dSfinal_ptr + bh * PN + j, mask=j < PN, other=0.0)
        for r in range(nc):
            chunk = bh * nc + nc - 1 - r
            a = tl.exp(tl.load(cs_ptr + chunk * C + C - 1))
            ptrs = dS_ptr + chunk * PN + j
            dSin = tl.load(ptrs, mask=j < PN, other=0.0)
            tl.store(ptrs, G, mask=j < PN)
            Sin = tl.load(Sin_ptr + chunk * PN + j, mask=j < PN, other=0.0)
            tl.store(da_ptr + chunk * tl.num_programs(1) + tl.program_id(1), a * tl.sum(G * Sin))
            G = a * G + dSin
        tl.store(dSin0_ptr + bh * PN + j, G, mask=j < PN)

    @triton.jit
    def _chunk_bwd_dx(x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h,
                      dy_ptr, sdy_b, sdy_l, sdy_h, dx_ptr, sdx_b, sdx_l, sdx_h, cs_ptr, w_ptr, g_ptr, Sin_ptr, G_ptr,
                      dcs_ptr, dw_ptr, dg_ptr, L, H, P, N, nc,
                      C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
        """dX for one P tile of a chunk, and that tile's share of the per-token scalar gradients; grid
        (chunks, P/BP). With M = W o (Q K^T) (Y = M X + ...) and G the gradient of the state leaving the chunk
        (Sout = a Sin + (X * u)^T K):
            dX  = M^T dY + u * (K G^T)
            R   = (dY X^T) o (Q K^T) o D        (dW o D: what W's entries, through D, w and gamma, receive)
            dgamma_i = R_ii,   dw_j = sum_{i>j} R_ij + du_j f_j,   du_i = x_i . (K G^T)_i
            dcs_i = sum_{j<i} R_ij w_j - w_i sum_{l>i} R_li + e_i dY_i . (Q Sin^T)_i - du_i u_i
                    + [i = last] sum_j du_j u_j
        Every term is a sum over P, so each P tile writes its share to (P tiles, chunks, C), summed in torch."""
        pid = tl.program_id(0).to(tl.int64)
        b, h, t = _chunk_coords(pid, H, nc, C)
        p = tl.program_id(1) * BP + tl.arange(0, BP)
        scores = tl.zeros((C, C), ACC)  # Q K^T
        KG = tl.zeros((C, BP), ACC)  # K G^T
        QS = tl.zeros((C, BP), ACC)  # Q Sin^T
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            Q = _load_rows(q_ptr, sq_b, sq_l, sq_h, b, h, t, L, n, N)  # (C, BN)
            K = _load_rows(k_ptr, sk_b, sk_l, sk_h, b, h, t, L, n, N)
            scores += _dot(Q, tl.trans(K), DT)
            KG += _dot(K, tl.trans(_load_state(G_ptr, pid, p, n, P, N)), DT)
            QS += _dot(Q, tl.trans(_load_state(Sin_ptr, pid, p, n, P, N)), DT)
        cs, w, e, f, u, D, W = _chunk_scalars(cs_ptr, w_ptr, g_ptr, pid, C)
        X = _load_rows(x_ptr, sx_b, sx_l, sx_h, b, h, t, L, p, P)  # (C, BP)
        dY = _load_rows(dy_ptr, sdy_b, sdy_l, sdy_h, b, h, t, L, p, P)
        dX = _dot(tl.trans(scores * W), dY, DT) + u[:, None] * KG
        _store_rows(dx_ptr, sdx_b, sdx_l, sdx_h, b, h, t, L, p, P, dX)
        i = tl.arange(0, C)
        R = _dot(dY, tl.trans(X), DT) * scores * D
        below = tl.where(i[:, None] > i[None, :], R, 0.0)
        col = tl.sum(below, axis=0)  # sum_{l>j} R_lj
        du = tl.sum(X * KG, axis=1)
        dcs = tl.sum(below * w[None, :], axis=1) - w * col + e * tl.sum(dY * QS, axis=1) - du * u
        dcs += tl.where(i == C - 1, tl.sum(du * u), 0.0)
        share = (tl.program_id(1) * tl.num_programs(0) + pid) * C + i
        tl.store(dcs_ptr + share, dcs)
        tl.store(dw_ptr + share, col + du * f)
        tl.store(dg_ptr + share, tl.sum(tl.where(i[:, None] == i[None, :], R, 0.0), axis=1))

    @triton.jit
    def _chunk_bwd_dqk(x_ptr, sx_b, sx_l, sx_h, q_ptr, sq_b, sq_l, sq_h, k_ptr, sk_b, sk_l, sk_h,
                       dy_ptr, sdy_b, sdy_l, sdy_h, dq_ptr, sdq_b, sdq_l, sdq_h, dk_ptr, sdk_b, sdk_l, sdk_h,
                       cs_ptr, w_ptr, g_ptr, Sin_ptr, G_ptr, L, H, P, N, nc,
                       C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, ACC: tl.constexpr):
        """dQ and dK for one N tile of a chunk; grid (chunks, N/BN); the sums over P run in BP tiles:
            dQ = (dM o W) K   + e * (dY Sin)        dM = dY X^T
            dK = (dM o W)^T Q + u * (X G)           G: the gradient of the state leaving the chunk"""
        pid = tl.program_id(0).to(tl.int64)
        b, h, t = _chunk_coords(pid, H, nc, C)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        dM = tl.zeros((C, C), ACC)
        dYS = tl.zeros((C, BN), ACC)  # dY Sin
        XG = tl.zeros((C, BN), ACC)  # X G
        for p0 in range(0, P, BP):
            p = p0 + tl.arange(0, BP)
            X = _load_rows(x_ptr, sx_b, sx_l, sx_h, b, h, t, L, p, P)  # (C, BP)
            dY = _load_rows(dy_ptr, sdy_b, sdy_l, sdy_h, b, h, t, L, p, P)
            dM += _dot(dY, tl.trans(X), DT)
            dYS += _dot(dY, _load_state(Sin_ptr, pid, p, n, P, N), DT)
            XG += _dot(X, _load_state(G_ptr, pid, p, n, P, N), DT)
        cs, w, e, f, u, D, W = _chunk_scalars(cs_ptr, w_ptr, g_ptr, pid, C)
        dscores = dM * W
        Q = _load_rows(q_ptr, sq_b, sq_l, sq_h, b, h, t, L, n, N)  # (C, BN)
        K = _load_rows(k_ptr, sk_b, sk_l, sk_h, b, h, t, L, n, N)
        _store_rows(dq_ptr, sdq_b, sdq_l, sdq_h, b, h, t, L, n, N, _dot(dscores, K, DT) + e[:, None] * dYS)
        _store_rows(dk_ptr, sdk_b, sdk_l, sdk_h, b, h, t, L, n, N, _dot(tl.trans(dscores), Q, DT) + u[:, None] * XG)


def _tile(d):
    # a power of 2 in [16, 32]: tl.dot needs every side >= 16; the masks cover what a tile overhangs (so any P
    # and N work; powers of 2 >= 16 waste nothing). Why at most 32: compiled with ptxas for sm_80 and sm_90 at
    # P=64, N=128, C=64 (8 warps), 64-wide tiles spill registers in the per-chunk kernels, 32-wide ones do not;
    # the price is recomputing Q K^T or dY X^T once per extra tile, cheap next to the state traffic.
    return min(32, max(16, 1 << (d - 1).bit_length()))


def _strided(t):
    # a token tensor and its (b, l, h) strides; the kernels need the last dim contiguous
    t = t if t.stride(-1) == 1 else t.contiguous()
    return (t, *t.stride()[:3])


class TritonScan(torch.autograd.Function):
    """ChunkedScan's equations as Triton kernels. x (B, L, H, P), q, k (B, L, H, N) in their own dtype and
    layout; cs, w, g (B*H, nc, C) and Sin0 (B*H, P, N) in the accumulation dtype. Launches, in order:
        forward:  _chunk_state (dS_c), _state_fwd (Sin_c, final S), _chunk_output (Y)
        backward: _chunk_state on (dY, Q) (dSin_c), _state_bwd (G_c, dSin0, da_c),
                  _chunk_bwd_dx (dX, dcs, dw, dgamma), _chunk_bwd_dqk (dQ, dK)"""

    @staticmethod
    def forward(ctx, x, q, k, cs, w, g, Sin0):
        # the kernels index these as dense arrays (a reshape can hand back a strided view, e.g. when B = 1)
        cs, w, g, Sin0 = cs.contiguous(), w.contiguous(), g.contiguous(), Sin0.contiguous()
        B, L, H, P = x.shape
        N = q.shape[-1]
        BH, nc, C = cs.shape
        # one operand dtype for every dot: the inputs' common dtype (float64 all through for the oracle tests)
        dot_dtype = torch.float64 if cs.dtype == torch.float64 else torch.promote_types(
            torch.promote_types(x.dtype, q.dtype), k.dtype)
        # the per-chunk kernels hold several (C, C) blocks: 8 warps share them at C = 64
        ctx.meta = meta = dict(C=C, BP=_tile(P), BN=_tile(N), DT=_TL_DTYPE[dot_dtype], ACC=_TL_DTYPE[cs.dtype],
                               num_warps=8 if C >= 64 else 4)
        ctx.block = block = min(1024, 1 << (P * N - 1).bit_length())  # state-passing tile of the flat (P, N)
        dims = (L, H, P, N, nc)
        xs, qs, ks = _strided(x), _strided(q), _strided(k)
        with torch.cuda.device(x.device.index if x.is_cuda else -1):  # launch on x's GPU (-1: no-op)
            states = cs.new_empty(BH, nc, P, N)  # dS_c, then Sin_c
            _chunk_state[(BH * nc, triton.cdiv(P, meta["BP"]), triton.cdiv(N, meta["BN"]))](
                *xs, *ks, cs, w, states, *dims, C=C, BP=meta["BP"], BN=meta["BN"], DT=meta["DT"], BACKWARD=False)
            S = torch.empty_like(Sin0)
            _state_fwd[(BH, triton.cdiv(P * N, block))](states, cs, Sin0, S, nc, P * N, C=C, BLOCK=block)
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            _chunk_output[(BH * nc, triton.cdiv(P, meta["BP"]))](*xs, *qs, *ks, *_strided(y), cs, w, g, states,
                                                                 *dims, **meta)
        ctx.save_for_backward(x, q, k, cs, w, g, states)
        return y, S

    @staticmethod
    def backward(ctx, dy, dS):
        x, q, k, cs, w, g, Sin = ctx.saved_tensors
        meta, block = ctx.meta, ctx.block
        B, L, H, P = x.shape
        N = q.shape[-1]
        BH, nc, C = cs.shape
        dims = (L, H, P, N, nc)
        xs, qs, ks, dys = _strided(x), _strided(q), _strided(k), _strided(dy)
        n_p, n_n, n_s = triton.cdiv(P, meta["BP"]), triton.cdiv(N, meta["BN"]), triton.cdiv(P * N, block)
        with torch.cuda.device(x.device.index if x.is_cuda else -1):
            G = cs.new_empty(BH, nc, P, N)  # dSin_c, then the gradient of the state leaving chunk c
            _chunk_state[(BH * nc, n_p, n_n)](*dys, *qs, cs, w, G, *dims, C=C, BP=meta["BP"], BN=meta["BN"],
                                              DT=meta["DT"], BACKWARD=True)
            dSin0, da = torch.empty_like(dS), cs.new_empty(BH * nc, n_s)
            _state_bwd[(BH, n_s)](G, Sin, cs, dS.contiguous(), dSin0, da, nc, P * N, C=C, BLOCK=block)
            dx, dq, dk = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (x, q, k))
            dcs, dw, dg = (cs.new_empty(n_p, BH * nc, C) for _ in range(3))  # shares of the P tiles
            _chunk_bwd_dx[(BH * nc, n_p)](*xs, *qs, *ks, *dys, *_strided(dx), cs, w, g, Sin, G, dcs, dw, dg,
                                          *dims, **meta)
            _chunk_bwd_dqk[(BH * nc, n_n)](*xs, *qs, *ks, *dys, *_strided(dq), *_strided(dk), cs, w, g, Sin, G,
                                           *dims, **meta)
        dcs = dcs.sum(0)
        dcs[:, -1] += da.sum(-1)  # each chunk's total decay exp(cs_last)
        return dx, dq, dk, dcs.view(BH, nc, C), dw.sum(0).view(BH, nc, C), dg.sum(0).view(BH, nc, C), dSin0


def ssd_triton(x, q, k, log_a, gamma, beta, state=None, chunk_size=64):
    """The chunked form of MAMBA3.md §2 through the Triton kernels above (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1). The glue here is on (B, L, H) scalars only: w, the in-chunk cumsum cs and the state
    entering the first chunk; autograd carries their gradients back to log_a, gamma, beta and the state."""
    if triton is None:
        raise RuntimeError("ssd: impl='triton' needs Triton, which does not import here (it ships for Linux); "
                           "use impl='torch'")
    if not x.is_cuda and not _INTERPRETED:
        raise RuntimeError("ssd: impl='triton' on CPU tensors runs only through Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported, or use impl='torch'")
    C = chunk_size
    if C < 16 or C & (C - 1):
        raise ValueError(f"ssd: impl='triton' needs chunk_size a power of 2 >= 16 (tl.dot's minimum), got {C}")
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
        y, S = TritonScan.apply(x, q, k, cs, per_chunk(w), per_chunk(gamma), Sin0.reshape(B * H, P, N))
    return y, _final_state(S.view(B, H, P, N), x, k)


# -----------------------------------------------------------------------------
# dispatch


def triton_available():
    """Whether Triton imported here (on a GPU, or under TRITON_INTERPRET=1 on CPU tensors)."""
    return triton is not None


def ssd(x, q, k, log_a, gamma, beta, state=None, chunk_size=64, impl="auto"):
    """The Mamba-3 scan. Returns y (B, L, H, P) in x's dtype and the final state (S, k_prev, x_prev).

    impl: "recurrent" (the oracle), "torch" (chunked, autograd), "triton" (fused kernels), or "auto":
    Triton for CUDA tensors when it imports, else torch. The environment variable MAMBA3_IMPL overrides
    "auto" (handy to A/B the paths without touching code)."""
    if impl == "auto":
        impl = os.environ.get("MAMBA3_IMPL") or ("triton" if x.is_cuda and triton_available() else "torch")
    if impl not in IMPLS[1:]:
        raise ValueError(f"ssd: impl must be one of {IMPLS} (or MAMBA3_IMPL one of {IMPLS[1:]}), got {impl!r}")
    _check_shapes(x, q, k, log_a, gamma, beta)
    if impl == "recurrent":
        return ssd_recurrent(x, q, k, log_a, gamma, beta, state)
    if impl == "triton":
        return ssd_triton(x, q, k, log_a, gamma, beta, state, chunk_size)
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
