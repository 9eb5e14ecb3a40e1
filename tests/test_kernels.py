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
    """MAMBA3.md §2's masked form, written independently of kernels.py: one (L x L) weight matrix per
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
    y_last, _ = kernels.recurrent_step(S, k_prev, x_prev, x, q, k, log_a, gamma, beta)
    assert (y_last - y_full[:, 40]).abs().max() <= 1e-10


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
