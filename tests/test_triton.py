"""impl="triton": the fused mixer kernels run through Triton's interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1 before triton is imported), against their torch twin and the
recurrent oracle. float64 runs check the algebra to ~1e-10; float32 runs check the stated
tolerances; bf16 and fp16 agree loosely. Errors are measured as max |a - ref| / max |ref| over each
tensor, against float64. Plus dispatch, and (slow) a compile of every kernel for a real GPU target,
which the interpreter alone would not catch."""
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402

F64 = torch.float64
interpreter = pytest.mark.interpreter


def rel_err(a, ref):
    err, scale = (a.double() - ref.double()).abs().max().item(), ref.double().abs().max().item()
    return err / scale if scale > 0 else err  # a gradient may be exactly 0


# --- the fused mixer region (kernels.mixer_triton) against its torch twin and the recurrence ---

PARAMS = ["dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias", "D"]
MIXER_NAMES = ["out", "zxbcdt"] + PARAMS


def make_mixer(B, L, H, P, G, N, S, dtype=F64, seed=0):
    """in_proj's output zxbcdt (B, L, 2HP + 2GN + 3H + S) and the region's parameters, values of a
    trained layer's order (dt ~ 0.1, norms and biases near 1)."""
    g = torch.Generator().manual_seed(seed)
    zx = torch.randn(B, L, sum(kernels.split_sizes(H, P, G, N, S)), generator=g, dtype=F64)
    params = [torch.randn(H, generator=g, dtype=F64) - 2,
              1 + 0.3 * torch.randn(N, generator=g, dtype=F64),
              1 + 0.3 * torch.randn(N, generator=g, dtype=F64),
              torch.randn(H, N, generator=g, dtype=F64),
              torch.randn(H, N, generator=g, dtype=F64), torch.randn(H, generator=g, dtype=F64)]
    return zx.to(dtype), params


def run_mixer(fn, zx, params, reset, sizes, seed=3, **kw):
    """out and the gradients of sum(out * dout) w.r.t. zxbcdt and every parameter,
    dout fixed at random."""
    leaves = [zx.clone().requires_grad_()] + [p.clone().requires_grad_() for p in params]
    out = fn(*leaves, **sizes, reset=reset, **kw)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)
    (out * dout).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def mixer_case(B, L, H, P, G, N, S, C, with_resets, dtype=F64):
    zx, params = make_mixer(B, L, H, P, G, N, S, dtype)
    reset = None
    # a chunk's first and last token, two in a row, t = 0, and past the last full chunk
    if with_resets:
        reset = torch.zeros(B, L, dtype=torch.bool)
        reset[0, [t for t in (0, C - 1, C, C + 1, L - 2) if t < L]] = True
    return zx, params, reset, dict(headdim=P, ngroups=G, n_angles=S, chunk_size=C)


@interpreter
@pytest.mark.parametrize("B,L,H,P,G,N,S,C,with_resets", [
    (1, 64, 2, 16, 1, 16, 4, 32, False),  # L a multiple of C (groups: the next test's case)
    # one partial chunk; P and N / 2 not powers of 2 (masked tiles)
    (2, 50, 2, 12, 1, 20, 3, 64, True),
    (1, 1, 2, 16, 1, 16, 2, 16, False),  # a single token
])
def test_mixer_float64_matches_the_torch_twin(B, L, H, P, G, N, S, C, with_resets):
    zx, params, reset, sizes = mixer_case(B, L, H, P, G, N, S, C, with_resets)
    ref = run_mixer(kernels.mixer_torch, zx, params, reset, sizes)
    out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    for name, a, r in zip(MIXER_NAMES, out, ref):
        assert a.dtype == r.dtype and rel_err(a, r) <= 1e-10, (name, rel_err(a, r))


@interpreter
def test_mixer_float64_matches_the_recurrence_and_the_twin():
    # groups > 1, an odd number of angles, L not a multiple of C
    zx, params, reset, sizes = mixer_case(2, 37, 4, 16, 2, 32, 5, 16, True)
    out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    for impl in ("recurrent", "torch"):
        ref = run_mixer(kernels.mixer_torch, zx, params, reset, sizes, impl=impl)
        for name, a, r in zip(MIXER_NAMES, out, ref):
            assert a.dtype == r.dtype and rel_err(a, r) <= 1e-10, (impl, name, rel_err(a, r))


@interpreter
@pytest.mark.smoke
def test_a_small_mixer_case_matches_the_recurrence():
    # The smoke tier's one interpreter case: two chunks, a reset, every output and gradient.
    zx, params, reset, sizes = mixer_case(1, 24, 1, 16, 1, 16, 2, 16, True)
    out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    ref = run_mixer(kernels.mixer_torch, zx, params, reset, sizes, impl="recurrent")
    for name, a, r in zip(MIXER_NAMES, out, ref):
        assert a.dtype == r.dtype and rel_err(a, r) <= 1e-10, (name, rel_err(a, r))


# --- the fused forward from a decoding state (prefill), against the recurrence ---


def decoding_state(B, H, P, N, S, R=1, seed=5):
    """A decoding state away from zeros, as mixer_torch takes it: phases Phi (B, H, S), S
    (B, H, P, N), the last token's k (B, H, N) (or its R k's (B, H, R, N)) and x (B, H, P)."""
    g = torch.Generator().manual_seed(seed)
    k_shape = (B, H, N) if R == 1 else (B, H, R, N)
    return (6 * torch.rand(B, H, S, generator=g, dtype=F64), torch.randn(B, H, P, N, generator=g,
            dtype=F64), torch.randn(k_shape, generator=g, dtype=F64),
            torch.randn(B, H, P, generator=g, dtype=F64))


def assert_same_run(got, ref, tol=1e-10):
    """(out, state) against (out, state): the same dtypes and shapes, values to tol."""
    names = ["out", "phi", "S", "k_prev", "x_prev"]
    for name, a, r in zip(names, [got[0], *got[1]], [ref[0], *ref[1]]):
        assert a.dtype == r.dtype and a.shape == r.shape, (name, a.dtype, r.dtype, a.shape, r.shape)
        assert rel_err(a, r) <= tol, (name, rel_err(a, r))


@interpreter
@pytest.mark.parametrize("with_resets", [False, True])
def test_the_fused_forward_from_a_state_matches_the_recurrence(with_resets):
    # SISO, float64: out and the state after the last token from a state away from zeros. With
    # resets, row 0 has one at t = 0 (the state it came with is dropped) and inside the chunks; row
    # 1 has none (its state reaches every token)
    zx, params, reset, sizes = mixer_case(2, 21, 1, 16, 1, 16, 4, 16, with_resets)
    state = decoding_state(2, 1, 16, 16, 4)
    with torch.no_grad():
        got = kernels.mixer_triton(zx, *params, **sizes, reset=reset, state=state)
    ref = kernels.mixer_torch(zx, *params, **sizes, reset=reset, state=state, impl="recurrent")
    assert_same_run(got, ref)


@interpreter
@pytest.mark.smoke
def test_a_state_carried_over_two_fused_calls_is_one_call():
    # the first 9 tokens, then the other 12 from the state they left: one call's out and state
    # (float64; a reset in each part and one at the second call's first token)
    zx, params, _, sizes = mixer_case(1, 21, 1, 16, 1, 16, 4, 16, False)
    reset = torch.zeros(1, 21, dtype=torch.bool)
    reset[0, [4, 9, 15]] = True
    state = decoding_state(1, 1, 16, 16, 4)
    with torch.no_grad():
        out1, state1 = kernels.mixer_triton(zx[:, :9], *params, **sizes, reset=reset[:, :9],
                                            state=state)
        out2, state2 = kernels.mixer_triton(zx[:, 9:], *params, **sizes, reset=reset[:, 9:],
                                            state=state1)
        one = kernels.mixer_triton(zx, *params, **sizes, reset=reset, state=state)
    assert_same_run((torch.cat([out1, out2], 1), state2), one)
    ref = kernels.mixer_torch(zx, *params, **sizes, reset=reset, state=state, impl="recurrent")
    assert_same_run(one, ref)


@pytest.fixture
def exact_float32(monkeypatch):
    """float32 products in true float32 ("ieee", FMA units on a GPU) instead of tf32: the algebra at
    float32's precision, which tf32's 10 mantissa bits would hide."""
    tiles = kernels._mixer_tiles
    monkeypatch.setattr(kernels, "_mixer_tiles", lambda *args: dict(tiles(*args), PREC="ieee"))


@interpreter
@pytest.mark.parametrize("dtype,tol_out,tol_grad", [(torch.float32, 2e-5, 2e-5),
                                                    (torch.bfloat16, 3e-2, 4e-2),
                                                    (torch.float16, 3e-3, 5e-3)])
def test_mixer_lower_precisions_against_float64(dtype, tol_out, tol_grad, exact_float32):
    # zxbcdt in dtype (the parameters stay float32, as under autocast), against the float64 twin on
    # the same rounded zxbcdt: what is measured is the kernels' own rounding (dot operands: ~4e-3
    # each in bf16, ~5e-4 in fp16)
    zx, params, reset, sizes = mixer_case(2, 53, 2, 16, 1, 32, 8, 16, True, dtype)
    ref = run_mixer(kernels.mixer_torch, zx.double(), params, reset, sizes)
    out = run_mixer(kernels.mixer_triton, zx, [p.float() for p in params], reset, sizes)
    assert out[0].dtype == out[1].dtype == dtype and all(g.dtype == torch.float32 for g in out[2:])
    for name, a, r in zip(MIXER_NAMES, out, ref):
        tol = tol_out if name == "out" else tol_grad
        assert torch.isfinite(a).all() and rel_err(a, r) <= tol, (name, rel_err(a, r))


@interpreter
@pytest.mark.parametrize("B,L,H,P,G,N,S,C", [(2, 53, 2, 16, 1, 32, 8, 16),
                                             (1, 130, 1, 64, 1, 128, 32, 64)])
def test_mixer_float32_takes_tf32_products(B, L, H, P, G, N, S, C):
    # float32 zxbcdt: the products on tensor cores with tf32 operands (10 mantissa bits, cut as the
    # hardware reads them; the interpreter does the same), in chunks of at most 32; everything else
    # float32. The error is the order of fp16's, a tenth of bf16's (also at the 440m layer's widths,
    # P 64 N 128 C 64, second case)
    assert kernels._mixer_tiles(C, P, N, torch.float32)["PREC"] == "tf32"
    assert kernels._mixer_tiles(C, P, N, torch.float32)["C"] == min(C, 32)
    zx, params, reset, sizes = mixer_case(B, L, H, P, G, N, S, C, True, torch.float32)
    ref = run_mixer(kernels.mixer_torch, zx.double(), params, reset, sizes)
    out = run_mixer(kernels.mixer_triton, zx, [p.float() for p in params], reset, sizes)
    errors = {name: rel_err(a, r) for name, a, r in zip(MIXER_NAMES, out, ref)}
    assert errors["out"] <= 3e-3 and max(errors.values()) <= 8e-3, errors
    # tf32 indeed (float32's own: ~1e-6)
    assert min(errors.values()) > 0 and errors["out"] > 2e-4, errors


@interpreter
def test_mixer_float32_long_sequence(exact_float32):
    # 2048 tokens = 32 chunks of 64 passing the state along, float32 against the float64 twin
    B, L, H, P, G, N, S, C = 1, 2048, 1, 16, 1, 16, 4, 64
    zx, params = make_mixer(B, L, H, P, G, N, S)
    dd_A = 2 * H * P + 2 * G * N + H
    # f(dd_A) ~ 0.01: slow decays (log_a ~ -3e-3), the state reaches far back
    zx[..., dd_A:dd_A + H] -= 100
    sizes = dict(headdim=P, ngroups=G, n_angles=S, chunk_size=C)
    ref = run_mixer(kernels.mixer_torch, zx, params, None, sizes)
    out = run_mixer(kernels.mixer_triton, zx.float(), [p.float() for p in params], None, sizes)
    for name, a, r in zip(MIXER_NAMES, out, ref):
        assert rel_err(a, r) <= (1e-4 if name == "out" else 1e-3), (name, rel_err(a, r))


@interpreter
# dt ~ 30: total forgetting; dt ~ 1e-13: none, no input
@pytest.mark.parametrize("dt_shift", [30.0, -30.0])
# the interpreter evaluates both sides of _dt_lam's softplus tl.where: 0 / 0 where 1 + e^v rounds
# to 1, not selected
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_mixer_extreme_decays_stay_finite(dt_shift, exact_float32):
    # one head (the interpreter runs a program per head; heads do not meet)
    zx, params, reset, sizes = mixer_case(2, 130, 1, 16, 1, 16, 4, 64, True)
    params[0] = params[0] + dt_shift
    ref = run_mixer(kernels.mixer_torch, zx, params, reset, sizes)
    out = run_mixer(kernels.mixer_triton, zx.float(), [p.float() for p in params], reset, sizes)
    for name, a, r in zip(MIXER_NAMES, out, ref):
        assert torch.isfinite(a).all() and rel_err(a, r) <= 1e-4, (name, rel_err(a, r))


TUNED = ("_mixer_fwd", "_mixer_bwd", "_sum_heads")


def tiny_bf16_case():
    zx, params, reset, sizes = mixer_case(1, 20, 2, 16, 1, 16, 4, 16, True, torch.bfloat16)
    return zx, [p.float() for p in params], reset, sizes


@interpreter
def test_every_launch_config_gives_the_same_bits(monkeypatch):
    # each config the tuner may pick on a GPU of compute capability 8.x or 9.x, forced on every
    # kernel in turn: the same bits as the default (under the interpreter, which takes the default
    # alone and times nothing)
    zx, params, reset, sizes = tiny_bf16_case()
    configs, tiles = kernels.launch_configs, kernels._mixer_tiles(16, 16, 16, torch.bfloat16)
    assert all(len(configs(k, 0, tiles)) == 1 for k in TUNED)
    ref = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    for major in (8, 9):
        assert any(len(configs(k, major, tiles)) > 1 for k in TUNED)
        for i in range(1, max(len(configs(k, major, tiles)) for k in TUNED)):
            # the i-th config of each kernel (or its last)
            def ith(kernel, _, tiles, i=i, major=major):
                options = configs(kernel, major, tiles)
                return [options[min(i, len(options) - 1)]]

            monkeypatch.setattr(kernels, "launch_configs", ith)
            out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
            for name, a, r in zip(MIXER_NAMES, out, ref):
                assert torch.equal(a, r), (major, i, name)
    assert kernels.TUNED == {}


@interpreter
def test_the_tuner_times_each_config_once_and_its_runs_leave_one_runs_result(monkeypatch):
    # two configs a kernel, timed by a stand-in for do_bench that runs each (do_bench runs it many
    # times) and finds the second faster: every kernel keeps that one, is timed at its first launch
    # only, and what the extra runs leave is what one run leaves (no kernel adds into its outputs)
    zx, params, reset, sizes = tiny_bf16_case()
    ref = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
    two, timed = [{"num_warps": 4}, {"num_warps": 8}], []

    def time_it(launch):
        launch()
        timed.append(launch)
        return 2.0 if len(timed) % 2 else 1.0

    monkeypatch.setattr(kernels, "launch_configs", lambda *args: two)
    monkeypatch.setattr(kernels, "_time", time_it)
    monkeypatch.setattr(kernels, "TUNED", {})
    for _ in range(2):
        out = run_mixer(kernels.mixer_triton, zx, params, reset, sizes)
        for name, a, r in zip(MIXER_NAMES, out, ref):
            assert torch.equal(a, r), name
    assert len(timed) == 2 * len(TUNED)
    assert sorted(key[0] for key in kernels.TUNED) == sorted(TUNED)
    assert all(options == two[1] for options in kernels.TUNED.values())


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
    # a decoding state of the wrong shapes; one that would need a gradient (no backward from a state)
    state = decoding_state(1, 2, 16, 16, 4)
    with pytest.raises(ValueError, match=r"decoding state is \(Phi, S, k_prev, x_prev\).*init_cache"):
        kernels.mixer_triton(zx, *params, **sizes, state=state[:3] + (state[3][:, :1],))
    with pytest.raises(RuntimeError, match=r"forward only \(prefill\).*torch.no_grad\(\).*"
                                           "MAMBA3_IMPL=torch"):
        kernels.mixer_triton(zx.requires_grad_(), *params, **sizes, state=state)
    for N, S in ((8, 5), (17, 4)):  # more angles than pairs of state dims; an odd d_state
        zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, N, S, 16, False)
        with pytest.raises(ValueError, match="d_state even and n_angles <= d_state / 2"):
            kernels.mixer_triton(zx, *params, **sizes)


def test_mixer_dispatch(monkeypatch):
    zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, 16, 4, 16, False)
    calls = []

    def fused(*args, state=None, **kw):
        if state is None:
            calls.append("triton")
            return zx[..., :32]
        calls.append("triton from a state")
        return zx[..., :32], state
    monkeypatch.setattr(kernels, "mixer_triton", fused)
    monkeypatch.delenv("MAMBA3_IMPL", raising=False)
    out, state = kernels.mixer(zx, *params, **sizes)  # CPU tensors: the torch twin
    assert calls == [] and state is None and out.shape == (1, 8, 32)
    monkeypatch.setenv("MAMBA3_IMPL", "triton")
    kernels.mixer(zx, *params, **sizes)
    assert calls == ["triton"]
    phi, S = torch.zeros(1, 2, 4, dtype=F64), torch.zeros(1, 2, 16, 16, dtype=F64)
    cache = (phi, S, torch.zeros(1, 2, 16, dtype=F64), torch.zeros(1, 2, 16, dtype=F64))
    # a decoding state and no gradient wanted (prefill): the fused forward from that state
    kernels.mixer(zx, *params, **sizes, state=cache)
    assert calls == ["triton", "triton from a state"]
    # with a gradient wanted: the twin with the chunked scan (ssd itself would refuse
    # impl="triton"), since the fused forward from a state has no backward
    _, state = kernels.mixer(zx.clone().requires_grad_(), *params, **sizes, state=cache)
    assert len(calls) == 2 and state[1].shape == S.shape


GPUS = {"H200": types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0,
                                      shared_memory_per_block_optin=232448),
        "A100": types.SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8, minor=0,
                                      shared_memory_per_block_optin=166912),
        "4090": types.SimpleNamespace(name="NVIDIA GeForce RTX 4090", major=8, minor=9,
                                      shared_memory_per_block_optin=101376),
        "T4": types.SimpleNamespace(name="Tesla T4", major=7, minor=5,
                                    shared_memory_per_block_optin=65536)}


@pytest.mark.parametrize("gpu,dtype,refusal", [
    ("H200", F64, "float64: the fused backward would need 256 KB"),
    ("T4", torch.bfloat16, "Tesla T4 has compute capability 7.5"),
    ("4090", torch.float32, "NVIDIA GeForce RTX 4090 gives a block 99 KB of shared memory and the "
                            "fused float32 backward may ask 160 KB"),
    ("H200", torch.bfloat16, None), ("H200", torch.float32, None), ("A100", torch.float32, None),
    ("4090", torch.bfloat16, None)])
def test_what_the_fused_kernels_cannot_run_is_the_torch_path_or_a_refusal(
        monkeypatch, gpu, dtype, refusal):
    # decided from the dtype and the GPU's properties before anything launches: "auto" takes the
    # PyTorch path with one warning, impl="triton" refuses in one sentence naming MAMBA3_IMPL=torch.
    # (CPU tensors play CUDA ones.)
    zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, 16, 4, 16, False, dtype)
    monkeypatch.delenv("MAMBA3_IMPL", raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: GPUS[gpu])
    monkeypatch.setattr(kernels, "mixer_triton", lambda *a, **k: "fused")
    if refusal is None:
        assert (kernels.fused_refusal(zx) is None
                and kernels.mixer(zx, *params, **sizes)[0] == "fused")
        return
    assert kernels.fused_refusal(zx).startswith(refusal)
    with pytest.warns(UserWarning, match=f"^mixer: {refusal}.*PyTorch path") as notes:
        out, _ = kernels.mixer(zx, *params, **sizes)
    assert len([n for n in notes if str(n.message).startswith("mixer:")]) == 1
    ref, _ = kernels.mixer_torch(zx, *params, **sizes)
    assert torch.equal(out, ref)
    monkeypatch.undo()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: GPUS[gpu])
    with pytest.raises(RuntimeError, match=f"^mixer: impl='triton' cannot run here: {refusal}"
                                           ".*MAMBA3_IMPL=torch"):
        kernels.mixer_triton(zx, *params, **sizes)


@interpreter
def test_mixer_custom_ops_pass_opcheck():
    # one head: the ops' registration is the point (the interpreter runs a program per head)
    zx, params, reset, sizes = mixer_case(1, 20, 1, 16, 1, 16, 3, 16, True, torch.float32)
    params = [p.float().requires_grad_() for p in params]
    zx.requires_grad_()
    args = (zx, *params, reset, sizes["headdim"], 1, sizes["n_angles"], 16, 1e-4, 1e-5)
    torch.library.opcheck(torch.ops.mamba3.mixer_fwd.default, args)
    out, states, phase = torch.ops.mamba3.mixer_fwd(*args)
    torch.library.opcheck(torch.ops.mamba3.mixer_bwd.default,
                          (torch.randn_like(out), zx.detach(), *(p.detach() for p in params),
                           reset, states, phase, *args[-6:]))


def test_clear_errors_without_triton_or_interpreter(monkeypatch):
    zx, params, _, sizes = mixer_case(1, 8, 2, 16, 1, 16, 4, 16, False)
    monkeypatch.delenv("MAMBA3_IMPL", raising=False)
    monkeypatch.setattr(kernels, "_INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.mixer_triton(zx, *params, **sizes)
    monkeypatch.setattr(kernels, "triton", types.SimpleNamespace(__version__="3.5.1"))
    with pytest.raises(RuntimeError,
                       match=r"needs Triton >= 3\.6 but found Triton 3\.5\.1.*MAMBA3_IMPL=torch"):
        kernels.mixer_triton(zx, *params, **sizes)
    monkeypatch.setattr(kernels, "triton", None)
    assert not kernels.triton_available()
    with pytest.raises(RuntimeError, match="needs Triton"):
        kernels.mixer_triton(zx, *params, **sizes)
    out, _ = kernels.mixer(zx, *params, **sizes)  # auto still works, on the torch path
    assert torch.isfinite(out).all()


# Compiles the kernels for sm_90 as kernels.py launches them, one configuration at a time: bf16 at
# the 440m layer's sizes (H 32, P 64, N 128, C 64); bf16 with resets, two groups and the 180m
# preset's 24 heads (an in_proj row of 3,688 elements, not a multiple of 16, so no stride
# specialization); float32 (tf32 products, chunks of 32); bf16 and _sum_heads also in every other
# launch config the tuner times on sm_90 (kernels.TUNE). No GPU is needed: Triton lowers to PTX and
# runs ptxas on the CPU. It catches what the interpreter lets through (loop-carried dtype changes,
# non-constexpr shapes, ops a GPU lacks); the kernels with matmuls must use wgmma, and their spills
# and shared memory stay within the offline figures. Integer arguments and pointers are specialised
# as at launch time (multiples of 16 are marked so, which lets loads vectorise).
COMPILE = r"""
import contextlib, io, json, re, sys
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels as K

P, N, S, C, L = 64, 128, 32, 64, 2048
scalars = {"phase_ptr", "dparam_ptr", "dt_bias_ptr", "Bw_ptr", "Cw_ptr", "Bb_ptr", "Cb_ptr",
           "D_ptr", "dmimo_ptr", "mx_ptr", "mz_ptr", "mo_ptr"}
# ptxas runs, and reports
triton.knobs.nvidia.dump_ptxas_log = triton.knobs.compilation.always_compile = True
for name, dtype, H, G, reset, R in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    # q, k and the state as even and odd dims; C rows a chunk
    tiles = K._mixer_tiles(C // R, P, N, dtype, R)
    W, nc = 2 * H * P + 2 * R * G * N + 3 * H + S, L * R // tiles["C"]
    ty = {torch.bfloat16: "bf16"}.get(dtype, "fp32")
    ints = dict(L=L, nc=nc, s_b=L * W, s_l=W, so_b=L * H * P, so_l=H * P, sd_b=L * H * P,
                sd_l=H * P, sg_b=L * W, sg_l=W)
    mixer = dict(tiles, H=H, G=G, P=P, N=N, S=S, HAS_RESET=reset)
    # the training forward: no decoding state, its five arguments None (constexprs at launch)
    no_state = {name: None for name in ("S_in_ptr", "phi_in_ptr", "S_out_ptr", "phi_out_ptr",
                                        "k_out_ptr")}
    launches = [(K._mixer_fwd, dict(mixer, HAS_STATE=False, **no_state)), (K._mixer_bwd, mixer)]
    if G > 1:
        launches += [(K._sum_heads,
                      dict(H=H, G=G, P=P, N=N, S=S, TB=32, NB=N, SB=S, ACC=tl.float32))]
    # every config the tuner has on sm_90 for bf16 and _sum_heads; elsewhere its first, the default
    launches = [(fn, constexprs, tuned, options) for fn, constexprs in launches
                for tuned, options in enumerate(K.launch_configs(fn.__name__, 9, tiles))
                if not tuned or name == "bf16" or fn is K._sum_heads]
    for fn, constexprs, tuned, options in launches:
        sig, attrs = {}, {}
        for i, p in enumerate(fn.params):
            if p.is_constexpr or p.name in constexprs:
                sig[p.name] = "constexpr"
                continue
            if p.name == "states":
                sig[p.name] = f"tensordesc<{ty}[{tiles['PP']}, {tiles['NH']}]>"
            elif p.name.endswith("_ptr"):
                pointer = "*fp32" if p.name in scalars else "*" + ty
                sig[p.name] = {"reset_ptr": "*u8"}.get(p.name, pointer)
            else:
                sig[p.name] = "fp32" if p.name in ("A_floor", "eps") else "i32"
            if p.name.endswith("_ptr") or ints.get(p.name, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        with contextlib.redirect_stdout(io.StringIO()) as log:  # ptxas -v's report
            source = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
            kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
        print(json.dumps(dict(config=name, kernel=fn.__name__, tuned=tuned, spills=int(spills[1]),
                              shared=kernel.metadata.shared, wgmma="wgmma" in kernel.asm["ptx"])))
"""
# (config, zxbcdt dtype, H, G, resets, MIMO rank) and the most spill bytes each kernel may have
# there on sm_90: today's figures (Triton 3.9; 3.6 spills more) with a little room; with resets no
# more than without (SISO). MIMO at R = 4: a chunk of 16 tokens of 4 rows, SISO's 64-row tiles, so
# it fits the 99 KB of sm_86/sm_89 too
CONFIGS = [("bf16", "bfloat16", 32, 1, False, 1), ("bf16, resets", "bfloat16", 32, 1, True, 1),
           ("fp32", "float32", 32, 1, False, 1),
           ("bf16, 2 groups, 24 heads", "bfloat16", 24, 2, False, 1),
           ("bf16, R = 4", "bfloat16", 32, 1, False, 4),
           ("bf16, R = 4, resets", "bfloat16", 32, 1, True, 4)]
MIMO_SPILLS = {"_mixer_fwd": 256, "_mixer_bwd": 5632}
SPILLS = {"bf16": {"_mixer_fwd": 0, "_mixer_bwd": 2812},
          "fp32": {"_mixer_fwd": 64, "_mixer_bwd": 2048},
          "bf16, 2 groups, 24 heads": {"_mixer_fwd": 0, "_mixer_bwd": 3200, "_sum_heads": 0},
          "bf16, R = 4": MIMO_SPILLS, "bf16, R = 4, resets": MIMO_SPILLS}


@pytest.mark.slow
def test_kernels_compile_for_sm90_in_every_configuration():
    import json

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend to compile with")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # two processes, half the configurations each: ptxas and Triton's passes use one core apiece
    halves = [subprocess.Popen([sys.executable, "-c", COMPILE, json.dumps(CONFIGS[i::2])], cwd=root,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in (0, 1)]
    outputs = [half.communicate(timeout=480) + (half.returncode,) for half in halves]
    for _, err, code in outputs:
        assert code == 0, err[-3000:]
    order = {name: i for i, (name, *_) in enumerate(CONFIGS)}
    # stable: each config's launches keep their order
    rows = sorted((json.loads(line) for out, _, _ in outputs for line in out.splitlines()),
                  key=lambda r: order[r["config"]])
    defaults = {(r["config"], r["kernel"]): r for r in rows if not r["tuned"]}
    assert list(defaults) == [
        (c, k) for c, _, _, G, _, _ in CONFIGS
        for k in ("_mixer_fwd", "_mixer_bwd") + (("_sum_heads",) if G > 1 else ())]
    assert len(rows) > len(defaults)  # the tuner's other configs
    spills = {key: r["spills"] for key, r in defaults.items()}
    # every kernel with a tl.dot uses wgmma (_sum_heads has none); sm_86/sm_89 give a block 99 KB
    for r in rows:
        assert r["wgmma"] == (r["kernel"] != "_sum_heads") and r["shared"] <= 99 * 1024, r
        limit = (SPILLS[r["config"]][r["kernel"]] if r["config"] in SPILLS
                 else spills["bf16", r["kernel"]])
        # no other config spills more than a quarter above its default (kernels.TUNE)
        if r["tuned"]:
            limit = 1.25 * spills[r["config"], r["kernel"]] + 64
        assert r["spills"] <= limit, r


@pytest.fixture
def no_compile_caches():
    """Compile afresh: a graph cached by another version of kernels.py would bring that version's
    output shapes (the caches' keys do not cover a custom op's fake implementation).

    torch's own config.patch, not monkeypatch: these config modules keep their values outside
    __dict__, and pytest 9.2's monkeypatch undoes a setattr on them by deleting the attribute."""
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield


@pytest.mark.slow
@interpreter
@pytest.mark.parametrize("R,backend", [(1, "inductor"), (2, "aot_eager")])
def test_compiled_model_matches_eager_through_the_custom_op(monkeypatch, exact_float32,
                                                            no_compile_caches, R, backend):
    # (true float32 products: with tf32's cut operands the last bits that compile changes
    # elsewhere would show)
    # torch.compile(fullgraph=True) traces the fused region as the opaque custom op
    # mamba3::mixer_fwd (its fake implementation gives the shapes, MIMO's gradients' too) and its
    # registered backward; loss and gradients match eager. MIMO on aot_eager: the op's tracing is
    # the point there, inductor's code around it SISO's
    import dataclasses

    from model import PRESETS, Mamba3LM

    monkeypatch.setenv("MAMBA3_IMPL", "triton")
    calls = []
    launch = kernels._tuned  # the custom ops' kernel launches
    monkeypatch.setattr(kernels, "_tuned",
                        lambda fn, *a, **k: calls.append(fn.fn.__name__) or launch(fn, *a, **k))
    torch.manual_seed(0)
    # two heads: the tracing is the point, and the interpreter runs a program per head
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=50, n_layer=1, reset_token=3,
                                 mimo_rank=R, d_model=16)
    model = Mamba3LM(config)
    # every parameter away from its init (MIMO's ones and 1/R), so each one matters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 50, (2, 13))  # one chunk: the tracing is the point, not the scan
    idx[0, 5] = 3
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend=backend)):
        model.zero_grad()
        _, loss = fn(idx[:, :-1], idx[:, 1:])
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    torch._dynamo.reset()
    assert calls == ["_mixer_fwd", "_mixer_bwd", "_sum_heads"] * 2
    for a, b in zip(*results):
        assert rel_err(a, b) <= 1e-5
