"""impl="triton": the Triton kernels run through Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1 before triton is imported), against the recurrent oracle. float64 runs check the algebra
to ~1e-10; float32 runs check the stated tolerances; bf16 and fp16 agree loosely. Errors are measured as
max |a - ref| / max |ref| over each tensor, against the float64 oracle. Plus dispatch, and (slow) a compile
of every kernel for a real GPU target, which the interpreter alone would not catch."""
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import ssd  # noqa: E402
from test_kernels import make_inputs, make_state, run_packed_and_alone  # noqa: E402

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


@interpreter
def test_packed_window_equals_documents_run_alone():
    # resets at a chunk's first and last token, two in a row, and at t = 0 over an initial state (C = 16)
    B, H, P, N, L = 2, 2, 16, 32, 53
    inputs = make_inputs(B, L, H, P, N)
    state = make_state(B, H, P, N)
    g = torch.Generator().manual_seed(7)
    dy, dS = torch.randn(B, L, H, P, generator=g, dtype=F64), torch.randn(B, H, P, N, generator=g, dtype=F64)
    packed, alone = run_packed_and_alone("triton", inputs, state, dy, dS)
    for name, a, b in zip(NAMES, packed, alone):
        assert (a - b).abs().max() <= 1e-10, name


# --- the fused mixer region (kernels.mixer_triton) against its torch twin and the recurrence ---

PARAMS = ["dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias", "D"]
MIXER_NAMES = ["out", "zxbcdt"] + PARAMS


def make_mixer(B, L, H, P, G, N, S, dtype=F64, seed=0):
    """in_proj's output zxbcdt (B, L, 2HP + 2GN + 3H + S) and the region's parameters, values of a trained
    layer's order (dt ~ 0.1, norms and biases near 1)."""
    g = torch.Generator().manual_seed(seed)
    zx = torch.randn(B, L, sum(kernels.split_sizes(H, P, G, N, S)), generator=g, dtype=F64)
    params = [torch.randn(H, generator=g, dtype=F64) - 2, 1 + 0.3 * torch.randn(N, generator=g, dtype=F64),
              1 + 0.3 * torch.randn(N, generator=g, dtype=F64), torch.randn(H, N, generator=g, dtype=F64),
              torch.randn(H, N, generator=g, dtype=F64), torch.randn(H, generator=g, dtype=F64)]
    return zx.to(dtype), params


def run_mixer(fn, zx, params, reset, sizes, seed=3, **kw):
    """out and the gradients of sum(out * dout) w.r.t. zxbcdt and every parameter, dout fixed at random."""
    leaves = [zx.clone().requires_grad_()] + [p.clone().requires_grad_() for p in params]
    out = fn(*leaves, **sizes, reset=reset, **kw)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    (out * dout).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def mixer_case(B, L, H, P, G, N, S, C, with_resets, dtype=F64):
    zx, params = make_mixer(B, L, H, P, G, N, S, dtype)
    reset = None
    if with_resets:  # a chunk's first and last token, two in a row, t = 0, and past the last full chunk
        reset = torch.zeros(B, L, dtype=torch.bool)
        reset[0, [t for t in (0, C - 1, C, C + 1, L - 2) if t < L]] = True
    return zx, params, reset, dict(headdim=P, ngroups=G, n_angles=S, chunk_size=C)


@interpreter
@pytest.mark.parametrize("B,L,H,P,G,N,S,C,with_resets", [
    (2, 37, 4, 16, 2, 32, 5, 16, True),  # groups > 1, an odd number of angles, L not a multiple of C
    (1, 64, 2, 16, 1, 16, 4, 32, False),  # L a multiple of C
    (2, 50, 2, 12, 1, 20, 3, 64, True),  # one partial chunk; P and N / 2 not powers of 2 (masked tiles)
    (1, 1, 2, 16, 1, 16, 2, 16, False),  # a single token
])
def test_mixer_float64_matches_the_torch_twin(B, L, H, P, G, N, S, C, with_resets):
    zx, params, reset, sizes = mixer_case(B, L, H, P, G, N, S, C, with_resets)
    ref = run_mixer(kernels.mixer_torch, zx, params, reset, sizes)
    out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    for name, a, r in zip(MIXER_NAMES, out, ref):
        assert a.dtype == r.dtype and rel_err(a, r) <= 1e-10, (name, rel_err(a, r))


@interpreter
def test_mixer_float64_matches_the_recurrence():
    zx, params, reset, sizes = mixer_case(2, 37, 4, 16, 2, 32, 5, 16, True)
    ref = run_mixer(kernels.mixer_torch, zx, params, reset, sizes, impl="recurrent")
    out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    for name, a, r in zip(MIXER_NAMES, out, ref):
        assert rel_err(a, r) <= 1e-10, (name, rel_err(a, r))


@interpreter
@pytest.mark.parametrize("dtype,tol_out,tol_grad", [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 3e-2, 4e-2)])
def test_mixer_lower_precisions_against_float64(dtype, tol_out, tol_grad):
    # zxbcdt in dtype (the parameters stay float32, as under autocast), against the float64 twin on the same
    # rounded zxbcdt: what is measured is the kernels' own rounding (bf16 dot operands: ~4e-3 each)
    zx, params, reset, sizes = mixer_case(2, 53, 2, 16, 1, 32, 8, 16, True, dtype)
    ref = run_mixer(kernels.mixer_torch, zx.double(), params, reset, sizes)
    out = run_mixer(kernels.mixer_triton, zx, [p.float() for p in params], reset, sizes)
    assert out[0].dtype == out[1].dtype == dtype and all(g.dtype == torch.float32 for g in out[2:])
    for name, a, r in zip(MIXER_NAMES, out, ref):
        tol = tol_out if name == "out" else tol_grad
        assert torch.isfinite(a).all() and rel_err(a, r) <= tol, (name, rel_err(a, r))


def test_mixer_bad_input_is_a_clear_error():
    zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, 16, 4, 16, False)
    for change, match in ((dict(chunk_size=24), "chunk_size"), (dict(headdim=8), "zxbcdt"),
                          (dict(n_angles=9), "zxbcdt")):
        with pytest.raises(ValueError, match=match):
            kernels.mixer_triton(zx, *params, **{**sizes, **change})
    with pytest.raises(ValueError, match="reset"):
        kernels.mixer_triton(zx, *params, **sizes, reset=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="float16, bfloat16"):
        kernels.mixer_triton(zx.to(torch.int32), *params, **sizes)
    for N, S in ((8, 5), (17, 4)):  # more angles than pairs of state dims; an odd d_state
        zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, N, S, 16, False)
        with pytest.raises(ValueError, match="d_state even and n_angles <= d_state / 2"):
            kernels.mixer_triton(zx, *params, **sizes)


def test_mixer_dispatch(monkeypatch):
    zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, 16, 4, 16, False)
    calls = []
    monkeypatch.setattr(kernels, "mixer_triton", lambda *a, **k: calls.append("triton") or (zx[..., :32], None))
    monkeypatch.delenv("MAMBA3_IMPL", raising=False)
    out, state = kernels.mixer(zx, *params, **sizes)  # CPU tensors: the torch twin
    assert calls == [] and state is None and out.shape == (1, 8, 32)
    monkeypatch.setenv("MAMBA3_IMPL", "triton")
    kernels.mixer(zx, *params, **sizes)
    assert calls == ["triton"]
    phi, S = torch.zeros(1, 2, 4, dtype=F64), torch.zeros(1, 2, 16, 16, dtype=F64)
    cache = (phi, S, torch.zeros(1, 2, 16, dtype=F64), torch.zeros(1, 2, 16, dtype=F64))
    _, state = kernels.mixer(zx, *params, **sizes, state=cache)  # a decoding state: the twin, scan in Triton
    assert calls == ["triton"] and state[1].shape == S.shape


@interpreter
def test_mixer_custom_ops_pass_opcheck():
    zx, params, reset, sizes = mixer_case(1, 20, 2, 16, 1, 16, 3, 16, True, torch.float32)
    params = [p.float().requires_grad_() for p in params]
    zx.requires_grad_()
    args = (zx, *params, reset, sizes["headdim"], 1, sizes["n_angles"], 16, 1e-4, 1e-5)
    torch.library.opcheck(torch.ops.mamba3.mixer_fwd.default, args)
    out, states, phase = torch.ops.mamba3.mixer_fwd(*args)
    torch.library.opcheck(torch.ops.mamba3.mixer_bwd.default,
                          (torch.randn_like(out), zx.detach(), *(p.detach() for p in params), reset, states, phase,
                           *args[-6:]))


@interpreter
def test_model_on_the_fused_path_matches_the_torch_path(monkeypatch):
    import dataclasses

    from model import PRESETS, Mamba3LM

    torch.manual_seed(0)
    model = Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=50, reset_token=3)).double()
    idx = torch.randint(0, 50, (2, 37))
    idx[0, [5, 16, 17]] = 3
    grads = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("MAMBA3_IMPL", impl)
        model.zero_grad()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        grads[impl] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["torch"], grads["triton"]):
        assert rel_err(a, b) <= 1e-10


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
    zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, 16, 4, 16, False)
    with pytest.raises(ValueError, match="power of 2"):
        ssd(*inputs, chunk_size=24, impl="triton")
    monkeypatch.setattr(kernels, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        ssd(*inputs, chunk_size=16, impl="triton")
    monkeypatch.setattr(kernels, "triton", types.SimpleNamespace(__version__="3.5.1"))
    for run in (lambda: ssd(*inputs, chunk_size=16, impl="triton"), lambda: kernels.mixer_triton(zx, *params, **sizes)):
        with pytest.raises(RuntimeError, match=r"needs Triton >= 3\.6 but found Triton 3\.5\.1.*MAMBA3_IMPL=torch"):
            run()
    monkeypatch.setattr(kernels, "triton", None)
    assert not kernels.triton_available()
    with pytest.raises(RuntimeError, match="needs Triton"):
        ssd(*inputs, chunk_size=16, impl="triton")
    y, _ = ssd(*inputs, chunk_size=16)  # auto still works, on the torch path
    assert torch.isfinite(y).all()


# Compiles every kernel, as kernels.py launches it at the 440m layer's sizes (P 64, N 128, C 64, H 32, bf16), for
# sm_80 and sm_90. No GPU is needed: Triton lowers to PTX and runs ptxas on the CPU. It catches what the
# interpreter lets through (loop-carried dtype changes, non-constexpr shapes, ops a GPU lacks); the sm_90 code of
# the kernels with matmuls must use wgmma. Integer arguments and pointers are specialised as at launch time
# (multiples of 16 are marked so, which lets loads vectorise).
COMPILE = r"""
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels as K

H, G, P, N, S, C, L = 32, 1, 64, 128, 32, 64, 2048
W = 2 * H * P + 2 * G * N + 3 * H + S
tiles = K._tiles(C, P, N, torch.bfloat16, torch.float32)
halves = K._mixer_tiles(C, P, N, torch.bfloat16, torch.float32)  # q, k and the state as even and odd dims
options = {"num_warps": tiles.pop("num_warps"), "num_stages": tiles.pop("num_stages")}
assert options == {"num_warps": halves.pop("num_warps"), "num_stages": halves.pop("num_stages")}
ints = dict(L=L, nc=L // C, s_b=L * W, s_l=W, so_b=L * H * P, so_l=H * P, sd_b=L * H * P, sd_l=H * P, sg_b=L * W,
            sg_l=W, **{f"s{t}_{d}": s for t, n in (("x", P), ("q", N), ("k", N), ("y", P), ("dy", P))
                       for d, s in (("b", L * H * n), ("l", H * n), ("h", n))})
scalars = {"cs_ptr", "w_ptr", "g_ptr", "Sin0_ptr", "S_ptr", "dS_ptr", "dcs_ptr", "dw_ptr", "dg_ptr", "dSin0_ptr",
           "phase_ptr", "dparam_ptr", "dt_bias_ptr", "Bw_ptr", "Cw_ptr", "Bb_ptr", "Cb_ptr", "D_ptr"}
mixer = dict(halves, H=H, G=G, P=P, N=N, S=S)
launches = [(K._mixer_fwd, dict(mixer, HAS_RESET=r)) for r in (False, True)]
launches += [(K._mixer_bwd, dict(mixer, HAS_RESET=r)) for r in (False, True)]
launches += [(K._sum_heads, dict(H=H, G=G, P=P, N=N, S=S, TB=32, NB=N, SB=S, ACC=tl.float32)),
             (K._scan_fwd, dict(tiles, H=H, P=P, N=N, HAS_RESET=True)),
             (K._scan_bwd, dict(tiles, H=H, P=P, N=N, HAS_RESET=True))]
for arch in (80, 90):
    for fn, constexprs in launches:
        sig, attrs = {}, {}
        for i, p in enumerate(fn.params):
            if p.is_constexpr:
                sig[p.name] = "constexpr"
                continue
            if p.name == "states":
                block = [tiles["PP"], constexprs["NH"] if "NH" in constexprs else tiles["NP"]]
                sig[p.name] = f"tensordesc<bf16[{block[0]}, {block[1]}]>"
            elif p.name.endswith("_ptr"):
                sig[p.name] = {"reset_ptr": "*u8"}.get(p.name, "*fp32" if p.name in scalars else "*bf16")
            else:
                sig[p.name] = "fp32" if p.name in ("A_floor", "eps") else "i32"
            if p.name.endswith("_ptr") or ints.get(p.name, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", arch, 64 if arch >= 90 else 32),
                                options={"num_warps": 4} if fn is K._sum_heads else
                                dict(options, **K._bwd_options(arch // 10)) if fn is K._mixer_bwd else options)
        wgmma = "wgmma" in kernel.asm["ptx"]
        print("compiled", arch, fn.__name__, "wgmma" if wgmma else "-")
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
    lines = done.stdout.splitlines()
    assert len(lines) == 14, done.stdout
    for line in lines:  # sm_90 code of every kernel with a tl.dot uses wgmma (_sum_heads has none)
        assert line.endswith("wgmma") == (line.startswith("compiled 90") and "_sum_heads" not in line), line


@pytest.mark.slow
@interpreter
def test_compiled_model_matches_eager_through_the_custom_op(monkeypatch):
    # torch.compile(fullgraph=True, inductor) traces the fused region as the opaque custom op mamba3::mixer_fwd
    # (its fake implementation gives the shapes) and its registered backward; loss and gradients match eager
    import dataclasses

    from model import PRESETS, Mamba3LM

    monkeypatch.setenv("MAMBA3_IMPL", "triton")
    # compiled afresh: a graph cached by another version of kernels.py would bring that version's output shapes
    # (the caches' keys do not cover a custom op's fake implementation)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    calls = []
    forward, backward = kernels._mixer_forward, kernels._mixer_backward
    monkeypatch.setattr(kernels, "_mixer_forward", lambda *a: calls.append("fwd") or forward(*a))
    monkeypatch.setattr(kernels, "_mixer_backward", lambda *a: calls.append("bwd") or backward(*a))
    torch.manual_seed(0)
    model = Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=50, n_layer=1, reset_token=3))
    idx = torch.randint(0, 50, (2, 21))
    idx[0, 5] = 3
    results = []
    for fn in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad()
        _, loss = fn(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    torch._dynamo.reset()
    assert calls == ["fwd", "bwd", "fwd", "bwd"]
    for a, b in zip(*results):
        assert rel_err(a, b) <= 1e-5
