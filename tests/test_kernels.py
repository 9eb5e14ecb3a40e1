"""The scan: recurrent oracle vs the masked ("attention") form written here vs the chunked torch path."""
import math

import pytest
import torch

import kernels
from kernels import ssd

F64 = torch.float64


def make_inputs(B, L, H, P, N, dtype=F64, decay=(0.05, 1.0), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, H, P, generator=g, dtype=dtype)
    q = torch.randn(B, L, H, N, generator=g, dtype=dtype)
    k = torch.randn(B, L, H, N, generator=g, dtype=dtype)
    lo, hi = decay
    log_a = -(lo + (hi - lo) * torch.rand(B, L, H, generator=g, dtype=dtype))
    gamma = torch.rand(B, L, H, generator=g, dtype=dtype)
    beta = torch.rand(B, L, H, generator=g, dtype=dtype)
    return x, q, k, log_a, gamma, beta


def make_state(B, H, P, N, dtype=F64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, P, N, generator=g, dtype=dtype), torch.randn(B, H, N, generator=g, dtype=dtype),
            torch.randn(B, H, P, generator=g, dtype=dtype))


def ssd_masked(x, q, k, log_a, gamma, beta, state=None):
    """The scan's masked (attention) form, written independently of kernels.py: one (L x L) weight matrix per
    (b, h), with decay(t, s) = exp(sum_{r=s+1..t} log_a_r)."""
    B, L, H, P = x.shape
    cs = torch.cumsum(log_a, dim=1)  # (B, L, H)
    t, s = torch.arange(L)[:, None], torch.arange(L)[None, :]
    decay = torch.exp((cs[:, :, None, :] - cs[:, None, :, :]).masked_fill((s > t)[None, :, :, None], -math.inf))
    beta_next = torch.cat([beta[:, 1:], torch.zeros_like(beta[:, :1])], dim=1)
    W = decay * (gamma + beta_next)[:, None, :, :]  # W[b, t, s, h] for s < t
    eye = torch.eye(L, dtype=torch.bool)[None, :, :, None]
    W = torch.where(eye, gamma[:, :, None, :].expand(B, L, L, H), W.masked_fill(eye, 0))
    qk = torch.einsum("bthn,bshn->btsh", q, k)
    y = torch.einsum("btsh,btsh,bshp->bthp", W, qk, x)
    if state is not None:
        S0, k_prev, x_prev = state
        Sin = S0 + beta[:, 0, :, None, None] * x_prev[..., :, None] * k_prev[..., None, :]
        y = y + torch.exp(cs)[..., None] * torch.einsum("bhpn,bthn->bthp", Sin, q)
    return y


SHAPE = dict(B=2, H=3, P=5, N=4)


@pytest.mark.smoke
@pytest.mark.parametrize("L", [1, 7, 64, 100, 257])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_three_forms_agree_float64(L, chunk_size, with_state):
    B, H, P, N = SHAPE.values()
    inputs = make_inputs(B, L, H, P, N)
    state = make_state(B, H, P, N) if with_state else None
    y_rec, (S_rec, k_rec, x_rec) = ssd(*inputs, state=state, impl="recurrent")
    y_chk, (S_chk, k_chk, x_chk) = ssd(*inputs, state=state, chunk_size=chunk_size, impl="torch")
    y_msk = ssd_masked(*inputs, state=state)
    assert (y_rec - y_msk).abs().max() <= 1e-10
    assert (y_rec - y_chk).abs().max() <= 1e-10
    assert (S_rec - S_chk).abs().max() <= 1e-10
    assert torch.equal(k_rec, k_chk) and torch.equal(x_rec, x_chk)
    assert torch.equal(k_rec, inputs[2][:, -1]) and torch.equal(x_rec, inputs[0][:, -1])


def test_final_state_is_the_recurrence_state():
    # the state returned after L tokens, stepped once more, must give what one call over L+1 tokens gives
    B, H, P, N = SHAPE.values()
    inputs = make_inputs(B, 41, H, P, N)
    y_full, _ = ssd(*inputs, impl="recurrent")
    _, state = ssd(*(t[:, :40] for t in inputs), chunk_size=16, impl="torch")
    S, k_prev, x_prev = state
    x, q, k, log_a, gamma, beta = (t[:, 40] for t in inputs)
    one = lambda t: t[:, :, None]  # noqa: E731 - recurrent_step takes a rank axis (1 here)
    y_last, _ = kernels.recurrent_step(S, one(k_prev), one(x_prev), one(x), one(q), one(k), log_a, gamma, beta)
    assert (y_last[:, :, 0] - y_full[:, 40]).abs().max() <= 1e-10


@pytest.mark.smoke
@pytest.mark.parametrize("impl", ["recurrent", "torch"])
@pytest.mark.parametrize("split", [1, 16, 33])
def test_state_passing_equals_one_call(impl, split):
    B, H, P, N = SHAPE.values()
    inputs = make_inputs(B, 70, H, P, N)
    state0 = make_state(B, H, P, N)
    y, final = ssd(*inputs, state=state0, chunk_size=16, impl=impl)
    y1, mid = ssd(*(t[:, :split] for t in inputs), state=state0, chunk_size=16, impl=impl)
    y2, final2 = ssd(*(t[:, split:] for t in inputs), state=mid, chunk_size=16, impl=impl)
    assert (torch.cat([y1, y2], dim=1) - y).abs().max() <= 1e-10
    for a, b in zip(final, final2):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.smoke
@pytest.mark.parametrize("L,chunk_size", [(1, 16), (37, 16), (64, 16), (50, 64)])
def test_gradients_match_autograd_through_the_recurrence(L, chunk_size):
    B, H, P, N = SHAPE.values()
    inputs = make_inputs(B, L, H, P, N)
    state = make_state(B, H, P, N)
    g = torch.Generator().manual_seed(5)
    dy = torch.randn(B, L, H, P, generator=g, dtype=F64)
    dS = torch.randn(B, H, P, N, generator=g, dtype=F64)
    grads = {}
    for impl in ("recurrent", "torch"):
        leaves = [t.clone().requires_grad_() for t in inputs + state]
        y, (S, _, _) = ssd(*leaves[:6], state=tuple(leaves[6:]), chunk_size=chunk_size, impl=impl)
        ((y * dy).sum() + (S * dS).sum()).backward()
        grads[impl] = [t.grad for t in leaves]
    names = ["x", "q", "k", "log_a", "gamma", "beta", "S0", "k_prev", "x_prev"]
    for name, a, b in zip(names, grads["recurrent"], grads["torch"]):
        assert (a - b).abs().max() <= 1e-10, name


def test_gradients_with_unused_final_state():
    # the usual training case: only y feeds the loss, and no initial state is given
    B, H, P, N = SHAPE.values()
    inputs = make_inputs(B, 45, H, P, N)
    grads = {}
    for impl in ("recurrent", "torch"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y, _ = ssd(*leaves, chunk_size=16, impl=impl)
        (y * y).sum().backward()
        grads[impl] = [t.grad for t in leaves]
    for a, b in zip(grads["recurrent"], grads["torch"]):
        assert (a - b).abs().max() <= 1e-9


@pytest.mark.smoke
def test_float32_agrees_with_float64_oracle():
    # float32 tolerance: relative 1e-4 of the output's scale over a 300-token sequence
    B, H, P, N = 2, 4, 16, 16
    inputs = make_inputs(B, 300, H, P, N)
    y64, (S64, _, _) = ssd(*inputs, impl="recurrent")
    y32, (S32, _, _) = ssd(*(t.float() for t in inputs), impl="torch")
    assert y32.dtype == torch.float32 and S32.dtype == torch.float32
    assert (y32.double() - y64).abs().max() <= 1e-4 * y64.abs().max()
    assert (S32.double() - S64).abs().max() <= 1e-4 * S64.abs().max()


@pytest.mark.parametrize("impl", ["recurrent", "torch"])
@pytest.mark.parametrize("decay", [(0.0, 1e-6), (50.0, 1e4)])
def test_extreme_decays_stay_finite(impl, decay):
    B, H, P, N = SHAPE.values()
    inputs = [t.float().requires_grad_() for t in make_inputs(B, 130, H, P, N, decay=decay)]
    y, (S, _, _) = ssd(*inputs, chunk_size=64, impl=impl)
    (y.sum() + S.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(S).all()
    for t in inputs:
        assert torch.isfinite(t.grad).all()
    if decay[0] > 0:  # with total forgetting, y_t = gamma_t (q_t . k_t) x_t exactly
        x, q, k, _, gamma, _ = (t.detach() for t in inputs)
        own = gamma[..., None] * (q * k).sum(-1, keepdim=True) * x
        assert torch.allclose(y.detach(), own, rtol=1e-5, atol=1e-5)


def test_shapes_and_impl_are_checked(monkeypatch):
    inputs = make_inputs(1, 4, 2, 3, 4)
    with pytest.raises(ValueError, match="impl"):
        ssd(*inputs, impl="cuda")
    with pytest.raises(ValueError, match="log_a"):
        ssd(*inputs[:3], inputs[3][:, :2], *inputs[4:])
    monkeypatch.setenv("MAMBA3_IMPL", "nonsense")
    with pytest.raises(ValueError, match="MAMBA3_IMPL"):
        ssd(*inputs)
    monkeypatch.setenv("MAMBA3_IMPL", "recurrent")
    y_env, _ = ssd(*inputs)
    y_rec, _ = ssd(*inputs, impl="recurrent")
    assert torch.equal(y_env, y_rec)


def test_ssd_alone_has_no_triton_path(monkeypatch):
    # Triton runs the scan only inside the fused mixer region: impl="triton" is refused, and MAMBA3_IMPL=triton
    # (which picks the mixer's path) leaves the scan alone on the chunked form
    inputs = make_inputs(2, 20, 2, 4, 4)
    with pytest.raises(ValueError, match=r"no Triton kernel.*mixer\(impl='triton'\)"):
        ssd(*inputs, chunk_size=16, impl="triton")
    monkeypatch.setenv("MAMBA3_IMPL", "triton")
    y_env, _ = ssd(*inputs, chunk_size=16)
    y_torch, _ = ssd(*inputs, chunk_size=16, impl="torch")
    assert torch.equal(y_env, y_torch)


# --- document-boundary resets ---

# Packed windows with documents that start: at the first token of a chunk (16), at the last (31), two tokens in
# a row (32, 33: a one-token document between them) and at t = 0 over an initial state (row 1), with C = 16.
STARTS = [[16, 31, 32, 33], [0, 47]]


def resets(B, L, starts=STARTS):
    reset = torch.zeros(B, L, dtype=torch.bool)
    for b, row in enumerate(starts):
        reset[b, row] = True
    return reset


def documents(row, L):
    """[(start, end)] of the documents in row b of STARTS."""
    cuts = [0] + [s for s in row if s > 0] + [L]
    return list(zip(cuts[:-1], cuts[1:]))


def run_packed_and_alone(impl, inputs, state, dy, dS, chunk_size=16):
    """Outputs and gradients of sum(y dy) + sum(S dS) for the packed rows (with resets), and the same quantities
    assembled from every document run on its own (the first from the initial state unless row b resets at 0)."""
    B, L = inputs[0].shape[:2]
    leaves = [t.clone().requires_grad_() for t in inputs + state]
    y, (S, _, _) = ssd(*leaves[:6], state=tuple(leaves[6:]), chunk_size=chunk_size, impl=impl,
                       reset=resets(B, L))
    ((y * dy).sum() + (S * dS).sum()).backward()
    packed = [y.detach(), S.detach()] + [t.grad for t in leaves]

    alone = [torch.zeros_like(t) for t in packed]
    for b, row in enumerate(STARTS):
        for start, end in documents(row, L):
            pieces = [t[b:b + 1, start:end].clone().requires_grad_() for t in inputs]
            first_with_state = start == 0 and 0 not in row
            st = [t[b:b + 1].clone().requires_grad_() for t in state] if first_with_state else None
            yd, (Sd, _, _) = ssd(*pieces, state=tuple(st) if st else None, chunk_size=chunk_size, impl=impl)
            last = end == L
            loss = (yd * dy[b:b + 1, start:end]).sum() + ((Sd * dS[b:b + 1]).sum() if last else 0)
            loss.backward()
            alone[0][b, start:end] = yd.detach()[0]
            if last:
                alone[1][b] = Sd.detach()[0]
            for k, piece in enumerate(pieces):
                alone[2 + k][b, start:end] = piece.grad[0]
            if st:
                for k, s in enumerate(st):
                    alone[8 + k][b] = s.grad[0]
    return packed, alone


NAMES = ["y", "S", "x", "q", "k", "log_a", "gamma", "beta", "S0", "k_prev", "x_prev"]


@pytest.mark.smoke
@pytest.mark.parametrize("impl", ["recurrent", "torch"])
def test_packed_window_equals_documents_run_alone(impl):
    B, H, P, N, L = 2, 2, 5, 4, 53
    inputs = make_inputs(B, L, H, P, N)
    state = make_state(B, H, P, N)
    g = torch.Generator().manual_seed(7)
    dy, dS = torch.randn(B, L, H, P, generator=g, dtype=F64), torch.randn(B, H, P, N, generator=g, dtype=F64)
    packed, alone = run_packed_and_alone(impl, inputs, state, dy, dS)
    for name, a, b in zip(NAMES, packed, alone):
        assert (a - b).abs().max() <= 1e-10, name
    assert packed[8][1].abs().max() == 0  # row 1 resets at t = 0: its initial state reaches nothing


def test_resets_reach_the_chunked_path_as_in_the_recurrence():
    # many resets at random, chunk sizes that do and do not divide L, against the recurrence
    B, H, P, N, L = 2, 3, 4, 4, 45
    inputs = make_inputs(B, L, H, P, N)
    state = make_state(B, H, P, N)
    reset = torch.rand(B, L, generator=torch.Generator().manual_seed(3)) < 0.2
    y_rec, (S_rec, _, _) = ssd(*inputs, state=state, impl="recurrent", reset=reset)
    for C in (16, 32, 64):
        y, (S, _, _) = ssd(*inputs, state=state, chunk_size=C, impl="torch", reset=reset)
        assert (y - y_rec).abs().max() <= 1e-10 and (S - S_rec).abs().max() <= 1e-10


def test_phases_restart_at_resets():
    v = torch.rand(2, 9, 3, dtype=F64)
    phi0 = torch.rand(2, 3, dtype=F64)
    reset = torch.zeros(2, 9, dtype=torch.bool)
    reset[0, [0, 4, 5]] = True
    phi = kernels.phases(v, reset, phi0)
    expected = torch.empty_like(v)
    for b in range(2):
        run = phi0[b].clone()
        for t in range(9):
            run = v[b, t] if reset[b, t] else run + v[b, t]
            expected[b, t] = run
    assert torch.allclose(phi, expected, rtol=0, atol=1e-12)


def test_reset_must_be_a_bool_B_by_L_tensor():
    inputs = make_inputs(2, 6, 2, 3, 4)
    with pytest.raises(ValueError, match="reset"):
        ssd(*inputs, reset=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="reset"):
        ssd(*inputs, reset=torch.zeros(2, 5, dtype=torch.bool))
