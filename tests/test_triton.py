"""impl="triton": the Triton kernels run through Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1 before triton is imported), against the recurrent oracle. float64 runs check the algebra
to ~1e-10; float32 runs check the stated tolerances; bf16 and fp16 agree loosely. Errors are measured as
max |a - ref| / max |ref| over each tensor, against the float64 oracle. Plus dispatch, and (slow) a compile
of every kernel for a real GPU target, which the interpreter alone would not catch."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import ssd  # noqa: E402
from test_kernels import make_inputs, make_state  # noqa: E402

F64 = torch.float64
interpreter = pytest.mark.interpreter
NAMES = ["y", "S", "x", "q", "k", "log_a", "gamma", "beta", "S0", "k_prev", "x_prev"]


def rel_err(a, ref):
    err, scale = (a.double() - ref.double()).abs().max().item(), ref.double().abs().max().item()
    return err / scale if scale > 0 else err  # some gradients are exactly 0 (e.g. log_a's for L = 1, no state)


def run(impl, inputs, state, chunk_size=16, seed=5):
    """y, the final S and the gradients of every input (and of the state when given) of the loss
    sum(y * dy) + sum(S * dS) with fixed random dy, dS."""
    leaves = [t.clone().requires_grad_() for t in inputs + (state or ())]
    y, (S, k_last, x_last) = ssd(*leaves[:6], state=tuple(leaves[6:]) if state else None,
                                 chunk_size=chunk_size, impl=impl)
    assert torch.equal(k_last, inputs[2][:, -1]) and torch.equal(x_last, inputs[0][:, -1])
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(y.shape, generator=g, dtype=F64).to(y.dtype)
    dS = torch.randn(S.shape, generator=g, dtype=F64).to(S.dtype)
    ((y * dy).sum() + (S * dS).sum()).backward()
    return [y.detach(), S.detach()] + [t.grad for t in leaves]


def compare(inputs, state, chunk_size, tol, dtype=F64):
    """Triton on inputs cast to dtype (log_a, gamma, beta and the state stay float32 or float64) vs the
    float64 oracle; every output and gradient within tol."""
    ref = run("recurrent", inputs, state, chunk_size)
    cast = lambda ts, dt: tuple(t.to(dt) for t in ts)  # noqa: E731
    scalar_dtype = F64 if dtype == F64 else torch.float32
    low = cast(inputs[:3], dtype) + cast(inputs[3:], scalar_dtype)
    low_state = cast(state, scalar_dtype) if state else None
    out = run("triton", low, low_state, chunk_size)
    assert out[0].dtype == dtype and out[1].dtype == scalar_dtype
    assert len(out) == len(ref) == (11 if state else 8)
    for name, a, r, t in zip(NAMES, out, ref, (None, None) + low + (low_state or ())):
        if t is not None:
            assert a.dtype == t.dtype, name  # gradients come back in their input's dtype
        assert torch.isfinite(a).all(), name
        assert rel_err(a, r) <= tol, (name, rel_err(a, r))


@interpreter
@pytest.mark.parametrize("L", [1, 15, 16, 53])  # 1, C - 1, C, 3C + 5 with C = 16
@pytest.mark.parametrize("with_state", [False, True])
def test_float64_matches_the_oracle(L, with_state):
    # P != N, so a transposed state or a swapped tile would show
    B, H, P, N = 2, 2, 16, 32
    compare(make_inputs(B, L, H, P, N), make_state(B, H, P, N) if with_state else None, 16, tol=1e-10)


@interpreter
@pytest.mark.parametrize("B,H,P,N,L,C", [
    (1, 3, 80, 40, 37, 16),  # B = 1; several P and N tiles, the last P tile mostly masked
    (2, 1, 5, 4, 37, 16),  # head dims below tl.dot's 16, masked
    (2, 2, 16, 16, 3 * 32 + 5, 32),
    (1, 2, 16, 16, 3 * 64 + 5, 64),
])
def test_float64_shapes_and_chunk_sizes(B, H, P, N, L, C):
    compare(make_inputs(B, L, H, P, N), make_state(B, H, P, N), C, tol=1e-10)


@interpreter
def test_float32_tolerances():
    # float32 inputs, float32 state and accumulation: relative 1e-4 forward, 1e-3 gradients (we see ~1e-6)
    B, H, P, N, L = 2, 2, 16, 32, 53
    inputs, state = make_inputs(B, L, H, P, N), make_state(B, H, P, N)
    ref = run("recurrent", inputs, state)
    out = run("triton", tuple(t.float() for t in inputs), tuple(t.float() for t in state))
    for name, a, r in zip(NAMES, out, ref):
        assert rel_err(a, r) <= (1e-4 if name in ("y", "S") else 1e-3), (name, rel_err(a, r))


@interpreter
def test_float32_long_sequence():
    # 2048 tokens = 32 chunks of 64 passing the state along, float32 against the float64 oracle
    B, H, P, N, L = 1, 1, 16, 16, 2048
    inputs = make_inputs(B, L, H, P, N, decay=(0.001, 0.1))  # slow decays: the state reaches far back
    ref = run("recurrent", inputs, None, chunk_size=64)
    out = run("triton", tuple(t.float() for t in inputs), None, chunk_size=64)
    for name, a, r in zip(NAMES, out, ref):
        assert rel_err(a, r) <= (1e-4 if name in ("y", "S") else 1e-3), (name, rel_err(a, r))


@interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_half_precision_inputs_agree_loosely(dtype, tol):
    # x, q, k in half precision (tl.dot operands in that dtype, float32 accumulation), log_a, gamma, beta
    # and the state in float32; bf16 rounds to ~4e-3 per operand, fp16 to ~5e-4. The oracle runs on the
    # same rounded inputs, so what is measured is the kernels' rounding only.
    B, H, P, N, L = 2, 2, 16, 32, 53
    x, q, k, *scalars = make_inputs(B, L, H, P, N)
    rounded = tuple(t.to(dtype).double() for t in (x, q, k)) + tuple(scalars)
    compare(rounded, make_state(B, H, P, N), 16, tol=tol, dtype=dtype)


@interpreter
@pytest.mark.parametrize("split", [1, 16, 33])
def test_state_passing_equals_one_call(split):
    B, H, P, N = 2, 2, 16, 32
    inputs = make_inputs(B, 70, H, P, N)
    state0 = make_state(B, H, P, N)
    y, final = ssd(*inputs, state=state0, chunk_size=16, impl="triton")
    y1, mid = ssd(*(t[:, :split] for t in inputs), state=state0, chunk_size=16, impl="triton")
    y2, final2 = ssd(*(t[:, split:] for t in inputs), state=mid, chunk_size=16, impl="triton")
    assert (torch.cat([y1, y2], dim=1) - y).abs().max() <= 1e-10
    for a, b in zip(final, final2):
        assert (a - b).abs().max() <= 1e-10


@interpreter
@pytest.mark.parametrize("decay", [(0.0, 1e-6), (50.0, 1e4)])
def test_extreme_decays_stay_finite(decay):
    B, H, P, N = 2, 2, 16, 16
    inputs = [t.float().requires_grad_() for t in make_inputs(B, 130, H, P, N, decay=decay)]
    y, (S, _, _) = ssd(*inputs, chunk_size=64, impl="triton")
    (y.sum() + S.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(S).all()
    for t in inputs:
        assert torch.isfinite(t.grad).all()
    x, q, k, _, gamma, _ = (t.detach() for t in inputs)
    if decay[0] > 0:  # total forgetting: y_t = gamma_t (q_t . k_t) x_t exactly
        own = gamma[..., None] * (q * k).sum(-1, keepdim=True) * x
        assert torch.allclose(y.detach(), own, rtol=1e-5, atol=1e-5)
    else:  # no forgetting: the torch path agrees (both float32)
        y_torch, _ = ssd(*(t.detach() for t in inputs), chunk_size=64, impl="torch")
        assert rel_err(y.detach(), y_torch) <= 1e-5


def test_auto_picks_torch_on_cpu_and_the_variable_overrides(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("impl='auto' must not pick Triton for CPU tensors")

    monkeypatch.setattr(kernels, "ssd_triton", no_triton)
    monkeypatch.delenv("MAMBA3_IMPL", raising=False)
    inputs = make_inputs(2, 20, 2, 4, 4)
    y_auto, _ = ssd(*inputs, chunk_size=16)
    y_torch, _ = ssd(*inputs, chunk_size=16, impl="torch")
    assert torch.equal(y_auto, y_torch)
    monkeypatch.setenv("MAMBA3_IMPL", "triton")
    with pytest.raises(AssertionError, match="must not pick"):
        ssd(*inputs, chunk_size=16)


def test_clear_errors_without_triton_or_interpreter(monkeypatch):
    inputs = make_inputs(1, 20, 2, 4, 4)
    with pytest.raises(ValueError, match="power of 2"):
        ssd(*inputs, chunk_size=24, impl="triton")
    monkeypatch.setattr(kernels, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ssd(*inputs, chunk_size=16, impl="triton")
    monkeypatch.setattr(kernels, "triton", None)
    assert not kernels.triton_available()
    with pytest.raises(RuntimeError, match="needs Triton"):
        ssd(*inputs, chunk_size=16, impl="triton")
    y, _ = ssd(*inputs, chunk_size=16)  # auto still works, on the torch path
    assert torch.isfinite(y).all()


# Compiles every kernel, as TritonScan launches it, for an sm_80 GPU at the model's sizes (P 64, N 128,
# C 64, bf16). No GPU is needed: Triton lowers to PTX and runs ptxas on the CPU. It catches what the
# interpreter lets through (loop-carried dtype changes, non-constexpr shapes, ops a GPU lacks).
COMPILE = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels as K

P, N, C = 64, 128, 64
tokens = {"x_ptr", "q_ptr", "k_ptr", "y_ptr", "dy_ptr", "dx_ptr", "dq_ptr", "dk_ptr"}
meta = dict(C=C, BP=K._tile(P), BN=K._tile(N), DT=tl.bfloat16, ACC=tl.float32)
state = dict(C=C, BLOCK=min(1024, P * N))
launches = [(K._chunk_state, dict(C=C, BP=meta["BP"], BN=meta["BN"], DT=tl.bfloat16, BACKWARD=b)) for b in (0, 1)]
launches += [(K._state_fwd, state), (K._chunk_output, meta), (K._state_bwd, state), (K._chunk_bwd_dx, meta),
             (K._chunk_bwd_dqk, meta)]
for fn, constexprs in launches:
    sig = {p.name: "constexpr" if p.is_constexpr else ("*bf16" if p.name in tokens else "*fp32")
           if p.name.endswith("_ptr") else "i32" for p in fn.params}
    options = {"num_warps": 8} if "ACC" in constexprs else {}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 80, 32),
                   options=options)
    print("compiled", fn.__name__)
"""


@pytest.mark.slow
def test_kernels_compile_for_a_gpu():
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile with")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 7
