"""MIMO (ModelConfig.mimo_rank R > 1), in float64 against the recurrence: the scan's paths, the
layer's parameters and gradients, decoding, the official format (against the official semantics
written here from its TileLang kernel), and --mimo-rank."""
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import ckpt
import kernels
import official
import train
from kernels import ssd
from model import PRESETS, Mamba3LM, ModelConfig

F64 = torch.float64


def scan_inputs(B, L, H, R, P, N, seed=0):
    """x, q, k with a rank axis, the decays and trapezoid weights, and an initial state."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=F64)  # noqa: E731
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    inputs = [randn(B, L, H, R, P), randn(B, L, H, R, N), randn(B, L, H, R, N),
              -(0.05 + rand(B, L, H)), rand(B, L, H), rand(B, L, H)]
    return inputs, (randn(B, H, P, N), randn(B, H, R, N), randn(B, H, R, P))


def ssd_masked(x, q, k, log_a, gamma, beta, state):
    """The MIMO scan's masked form, written apart from kernels.py: y_{t,r} = sum_{s<=t} W[t, s]
    sum_u (q_{t,r} . k_{s,u}) x_{s,u} + exp(sum_{j<=t} log_a_j) Sin q_{t,r}, with W[t, t] = gamma_t
    and W[t, s] = decay(t, s) (gamma_s + beta_{s+1}) for s < t."""
    L = x.shape[1]
    cs = log_a.cumsum(1)
    t, s = torch.arange(L)[:, None], torch.arange(L)[None, :]
    later = (s > t)[None, :, :, None]
    decay = torch.exp((cs[:, :, None] - cs[:, None, :]).masked_fill(later, -math.inf))
    w = gamma + F.pad(beta[:, 1:], (0, 0, 0, 1))
    eye = torch.eye(L, dtype=torch.bool)[None, :, :, None]
    W = torch.where(eye, gamma[:, :, None], decay * w[:, None])
    y = torch.einsum("btsh,bthrn,bshun,bshup->bthrp", W, q, k, x)
    S0, k_prev, x_prev = state
    Sin = S0 + beta[:, 0, :, None, None] * torch.einsum("bhrp,bhrn->bhpn", x_prev, k_prev)
    return y + cs.exp()[..., None, None] * torch.einsum("bhpn,bthrn->bthrp", Sin, q)


@pytest.mark.smoke
@pytest.mark.parametrize("L, C, R", [(1, 4, 2), (7, 4, 3), (37, 8, 2), (33, 16, 4)])
def test_scan_paths_agree(L, C, R):
    inputs, state = scan_inputs(2, L, 3, R, 5, 4)
    y_rec, (S_rec, k_rec, x_rec) = ssd(*inputs, state=state, impl="recurrent")
    y_chk, (S_chk, k_chk, x_chk) = ssd(*inputs, state=state, chunk_size=C, impl="torch")
    assert (y_rec - ssd_masked(*inputs, state)).abs().max() <= 1e-10
    assert (y_rec - y_chk).abs().max() <= 1e-10 and (S_rec - S_chk).abs().max() <= 1e-10
    assert torch.equal(k_rec, k_chk) and torch.equal(x_rec, x_chk)
    assert torch.equal(k_rec, inputs[2][:, -1]) and torch.equal(x_rec, inputs[0][:, -1])
    # the state is linear in the inputs: the sum of R SISO states, one per rank (S0 in the first),
    # which every rank reads
    x, q, k = inputs[:3]
    S0, k_prev, x_prev = state

    def siso(u, r):  # the SISO scan of rank u's inputs, read by rank r's queries
        st = (S0 if u == 0 else torch.zeros_like(S0), k_prev[:, :, u], x_prev[:, :, u])
        return ssd(x[:, :, :, u], q[:, :, :, r], k[:, :, :, u], *inputs[3:], state=st,
                   impl="recurrent")

    assert (sum(siso(u, 0)[1][0] for u in range(R)) - S_rec).abs().max() <= 1e-10
    for r in range(R):
        assert (sum(siso(u, r)[0] for u in range(R)) - y_rec[:, :, :, r]).abs().max() <= 1e-10


def test_rank_one_is_the_siso_scan():
    inputs, state = scan_inputs(2, 21, 2, 1, 4, 4)
    one = [t[:, :, :, 0] for t in inputs[:3]] + inputs[3:]
    y, (S, k_last, x_last) = ssd(*inputs, state=state, chunk_size=8)
    y1, (S1, k1, x1) = ssd(*one, state=(state[0], state[1][:, :, 0], state[2][:, :, 0]),
                           chunk_size=8)
    assert torch.equal(y[:, :, :, 0], y1) and torch.equal(S, S1)
    assert torch.equal(k_last[:, :, 0], k1) and torch.equal(x_last[:, :, 0], x1)


@pytest.mark.parametrize("L, C", [(1, 4), (19, 8), (24, 8)])
def test_scan_gradients_match_autograd_through_the_recurrence(L, C):
    inputs, state = scan_inputs(2, L, 2, 3, 4, 4)
    reset = torch.zeros(2, L, dtype=torch.bool)
    reset[0, L // 2], reset[1, 0] = True, True
    g = torch.Generator().manual_seed(5)
    dy = torch.randn(inputs[0].shape, generator=g, dtype=F64)
    dS = torch.randn(2, 2, 4, 4, generator=g, dtype=F64)
    grads = {}
    for impl in ("recurrent", "torch"):
        leaves = [t.clone().requires_grad_() for t in inputs + list(state)]
        y, (S, _, _) = ssd(*leaves[:6], state=tuple(leaves[6:]), chunk_size=C, impl=impl,
                           reset=reset)
        ((y * dy).sum() + (S * dS).sum()).backward()
        grads[impl] = [t.grad for t in leaves]
    names = ["x", "q", "k", "log_a", "gamma", "beta", "S0", "k_prev", "x_prev"]
    for name, a, b in zip(names, grads["recurrent"], grads["torch"]):
        assert (a - b).abs().max() <= 1e-10, name


def test_resets():
    # documents that start at a chunk's first token (8), right after it (9: a one-token document),
    # mid-chunk (19), and at t = 0 over an initial state (row 1); chunks of 4 and 8 tokens, and one
    # longer than L
    inputs, state = scan_inputs(2, 29, 2, 2, 3, 4)
    reset = torch.zeros(2, 29, dtype=torch.bool)
    reset[0, [8, 9, 19]], reset[1, 0] = True, True
    y_rec, (S_rec, _, _) = ssd(*inputs, state=state, impl="recurrent", reset=reset)
    for C in (4, 8, 32):
        y, (S, _, _) = ssd(*inputs, state=state, chunk_size=C, impl="torch", reset=reset)
        assert (y - y_rec).abs().max() <= 1e-10 and (S - S_rec).abs().max() <= 1e-10
    # a reset at t zeroes what enters t, every rank's: each document is a call of its own
    for b, start, end in [(0, 8, 9), (0, 9, 19), (0, 19, 29), (1, 0, 29)]:
        y_doc, _ = ssd(*(v[b:b + 1, start:end] for v in inputs), impl="recurrent")
        assert (y_doc[0] - y_rec[b, start:end]).abs().max() <= 1e-10


# --- the layer and the model ---


def tiny(R, vocab_size=100, **kw):
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=vocab_size, mimo_rank=R, **kw)
    model = Mamba3LM(cfg).double()
    with torch.no_grad():  # every parameter away from its init (ones, 1/R), so each one matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_parameters_shapes_and_init():
    siso = Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=100))
    names = {n for n, _ in siso.named_parameters()}
    assert not any("mimo" in n for n in names) and siso.blocks[0].mixer.B_bias.shape == (8, 16)
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=100, mimo_rank=4)
    model = Mamba3LM(cfg)
    mixer = model.blocks[0].mixer
    H, P, N, G, S = cfg.n_heads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.n_angles
    mimo = {f"blocks.{i}.mixer.{v}" for i in range(2) for v in ("mimo_x", "mimo_z", "mimo_o")}
    assert {n for n, _ in model.named_parameters()} - names == mimo
    assert mixer.in_proj.weight.shape == (2 * H * P + 2 * 4 * G * N + 3 * H + S, cfg.d_model)
    assert mixer.B_bias.shape == mixer.C_bias.shape == (H, 4, N)
    assert torch.equal(mixer.B_bias, torch.ones(H, 4, N))
    assert torch.equal(mixer.mimo_x, torch.full((H, 4, P), 0.25))  # the official init
    assert torch.equal(mixer.mimo_o, mixer.mimo_x)
    assert torch.equal(mixer.mimo_z, torch.ones(H, 4, P))
    extra = cfg.n_layer * (2 * 3 * G * N * cfg.d_model + 2 * 3 * H * N + 3 * H * 4 * P)
    assert model.num_params() == siso.num_params() + extra
    # the mimo vectors are not decayed (like the norm weights), the matrices are
    decay, no_decay = model.param_groups(0.1)
    assert all(p.dim() == 2 for p in decay["params"])
    exempt = {id(p) for p in no_decay["params"]}
    assert {id(mixer.mimo_x), id(mixer.mimo_z), id(mixer.mimo_o), id(mixer.B_bias)} <= exempt


@pytest.mark.smoke
def test_bad_ranks_are_refused_naming_the_flag():
    message = r"mimo_rank \(--mimo-rank\) must be at least 1 and divide chunk_size"
    for R in (0, 3):  # below 1, and a rank that does not divide the tiny preset's 16 rows a chunk
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(PRESETS["tiny"], mimo_rank=R)
    assert dataclasses.replace(PRESETS["small"], mimo_rank=4).chunk_tokens == 16  # 64 rows
    runner = CliRunner()
    for flag, says in (("0", "Invalid value for '--mimo-rank'"), ("3", "mimo_rank (--mimo-rank)")):
        result = runner.invoke(train.app, ["--data", "synthetic", "--mimo-rank", flag, "--dry-run"])
        assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.parametrize("R, kw", [(2, dict(ngroups=2)), (4, dict(rope_fraction=1.0)),
                                   (2, dict(reset_token=3))])
def test_torch_path_and_gradients_match_the_recurrence(R, kw):
    model = tiny(R, **kw)
    idx = torch.randint(0, 100, (2, 11))  # 11 tokens: chunks of 16 // R tokens and a partial one
    idx[0, [3, 4]] = 3
    runs = []
    for impl in ("torch", "recurrent"):
        model.zero_grad()
        logits = model.logits(model.hidden(idx, impl=impl))
        (logits * torch.linspace(-1, 1, 100, dtype=F64)).sum().backward()
        runs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lt, gt), (lr, gr) = runs
    assert (lt - lr).abs().max() <= 1e-10
    for name in gt:
        assert (gt[name] - gr[name]).abs().max() <= 1e-10 * max(1.0, gr[name].abs().max()), name
        assert gr[name].abs().max() > 0, name  # every parameter reaches the output


def test_mixer_gradients_by_finite_differences():
    # the region's input and every parameter of the layer's own (dt_bias, the norm weights, the
    # biases, D, mimo_x/z/o), through the chunked path (3 chunks), by torch.autograd.gradcheck
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=100, d_model=16, headdim=8, d_state=8,
                              mimo_rank=2, chunk_size=4)
    mixer = Mamba3LM(cfg).double().blocks[0].mixer
    zx = torch.randn(1, 5, sum(mixer.split), dtype=F64, requires_grad=True)
    params = [mixer.dt_bias, mixer.B_norm_weight, mixer.C_norm_weight, mixer.B_bias, mixer.C_bias,
              mixer.D, mixer.mimo_x, mixer.mimo_z, mixer.mimo_o]
    leaves = [p.detach().clone().requires_grad_() for p in params]

    def region(zx, *leaves):
        return kernels.mixer_torch(zx, *leaves[:6], headdim=8, ngroups=1, n_angles=cfg.n_angles,
                                   chunk_size=cfg.chunk_tokens, mimo=tuple(leaves[6:]))[0]

    assert torch.autograd.gradcheck(region, (zx, *leaves), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.smoke
@pytest.mark.parametrize("R, kw", [(2, dict(ngroups=2)), (4, dict(reset_token=3))])
def test_decoding_reproduces_the_forward(R, kw):
    model = tiny(R, **kw).eval()
    cfg = model.config
    idx = torch.randint(4, 100, (2, 14))
    idx[0, [4, 9]] = 3
    with torch.no_grad():
        logits, _ = model(idx)
        cache = model.init_cache(2)
        assert cache[0]["k_prev"].shape == (2, cfg.n_heads, R, cfg.d_state)
        assert cache[0]["x_prev"].shape == (2, cfg.n_heads, cfg.headdim)  # x, not the R inputs
        assert (model.prefill(idx[:, :5], cache) - logits[:, 4]).abs().max() <= 1e-10
        for t in range(5, 14):
            assert (model.step(idx[:, t], cache) - logits[:, t]).abs().max() <= 1e-10


def test_flops_per_token_grow_with_the_rank():
    cfg = PRESETS["180m"]
    with torch.device("meta"):
        flops = {R: Mamba3LM(dataclasses.replace(cfg, mimo_rank=R)).flops_per_token(2048)
                 for R in (1, 2, 4)}
    H, P, N, L = cfg.n_heads, cfg.headdim, cfg.d_state, cfg.n_layer
    scan = 3 * L * H * (2 * 64 * (N + P) + 4 * P * N)  # R = 1: chunks of 64 tokens
    for R in (2, 4):  # 64 rows a chunk: the intra-chunk matmuls and the state's in and out R-fold
        in_proj = 6 * L * 2 * (R - 1) * N * cfg.d_model  # R ranks of B and C
        assert flops[R] - flops[1] == (R - 1) * scan + in_proj


# --- the fused Triton kernels (through Triton's interpreter on CPU tensors) ---


def fused_case(B, L, H, P, G, N, S, C, R, resets, seed=0):
    """in_proj's output, the region's parameters (mimo vectors away from their init), a reset mask
    (a chunk's first and last token, two in a row, t = 0, near the end) and the sizes."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    zx = randn(B, L, sum(kernels.split_sizes(H, P, G, N, S, R)))
    params = [randn(H) - 2, 1 + 0.3 * randn(N), 1 + 0.3 * randn(N), randn(H, R, N), randn(H, R, N),
              randn(H)]
    mimo = [0.5 + torch.rand(H, R, P, generator=g, dtype=F64) for _ in range(3)]
    reset = None
    if resets:
        reset = torch.zeros(B, L, dtype=torch.bool)
        reset[0, [t for t in (0, C - 1, C, C + 1, L - 2) if t < L]] = True
    return zx, params + mimo, reset, dict(headdim=P, ngroups=G, n_angles=S, chunk_size=C)


def run_region(fn, zx, params, reset, sizes, **kw):
    """out and the gradients of sum(out * dout) for zxbcdt and every parameter, mimo's included."""
    leaves = [t.clone().requires_grad_() for t in [zx] + params]
    out = fn(*leaves[:7], **sizes, reset=reset, mimo=tuple(leaves[7:]), **kw)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    (out * dout.to(out.dtype)).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


REGION = ["out", "zxbcdt", "dt_bias", "B_norm_weight", "C_norm_weight", "B_bias", "C_bias", "D",
          "mimo_x", "mimo_z", "mimo_o"]


def assert_close(got, ref, tol=1e-10):
    for name, a, r in zip(REGION, got, ref):
        err = (a - r).abs().max() / r.abs().max()
        assert a.dtype == r.dtype and a.shape == r.shape and err <= tol, (name, err.item())


@pytest.mark.interpreter
@pytest.mark.parametrize("B, L, H, P, G, N, S, C, R, resets", [
    # groups, resets, odd angles, L not a multiple of C (a batch of 2: the recurrence test's)
    (1, 37, 4, 16, 2, 32, 5, 8, 2, True),
    (1, 19, 2, 16, 1, 16, 8, 4, 4, True),  # rope_fraction 1.0 (S = N / 2), 4 tokens of 4 rows
    (2, 13, 2, 12, 1, 20, 5, 16, 2, False),  # one partial chunk; P and N / 2 not powers of 2
    (1, 1, 2, 16, 1, 16, 4, 8, 2, False),  # a single token
])
def test_fused_mimo_matches_the_chunked_torch_path(B, L, H, P, G, N, S, C, R, resets):
    zx, params, reset, sizes = fused_case(B, L, H, P, G, N, S, C, R, resets)
    ref = run_region(kernels.mixer_torch, zx, params, reset, sizes)
    assert_close(run_region(kernels.mixer_triton, zx, params, reset, sizes), ref)


@pytest.mark.interpreter
def test_fused_mimo_matches_the_recurrence():
    # rope_fraction 0.5 (S = N / 4), two groups, resets, chunks of 8 tokens of 2 rows
    zx, params, reset, sizes = fused_case(2, 21, 4, 16, 2, 16, 2, 8, 2, True, seed=1)
    ref = run_region(kernels.mixer_torch, zx, params, reset, sizes, impl="recurrent")
    assert_close(run_region(kernels.mixer_triton, zx, params, reset, sizes), ref)


@pytest.mark.interpreter
def test_the_fused_mimo_forward_from_a_state_matches_the_recurrence():
    # float64, rank 2, from a state away from zeros: one call, and the same tokens in two calls
    # (the second from the state the first left) give the recurrence's out and final state. Row 0
    # has resets (one at t = 0: its incoming state is dropped), row 1 none
    zx, params, reset, sizes = fused_case(2, 19, 1, 16, 1, 16, 4, 8, 2, True)
    g = torch.Generator().manual_seed(5)
    state = (6 * torch.rand(2, 1, 4, generator=g, dtype=F64),
             torch.randn(2, 1, 16, 16, generator=g, dtype=F64),
             torch.randn(2, 1, 2, 16, generator=g, dtype=F64),
             torch.randn(2, 1, 16, generator=g, dtype=F64))
    kw = dict(sizes, mimo=tuple(params[6:]))
    ref, ref_state = kernels.mixer_torch(zx, *params[:6], **kw, reset=reset, state=state,
                                         impl="recurrent")
    with torch.no_grad():
        one = kernels.mixer_triton(zx, *params[:6], **kw, reset=reset, state=state)
        out1, state1 = kernels.mixer_triton(zx[:, :7], *params[:6], **kw, reset=reset[:, :7],
                                            state=state)
        out2, state2 = kernels.mixer_triton(zx[:, 7:], *params[:6], **kw, reset=reset[:, 7:],
                                            state=state1)
    for out, final in (one, (torch.cat([out1, out2], 1), state2)):
        for a, r in zip([out, *final], [ref, *ref_state]):
            err = (a - r).abs().max() / r.abs().max()
            assert a.dtype == r.dtype and a.shape == r.shape and err <= 1e-10, err.item()


@pytest.mark.interpreter
def test_fused_mimo_in_float32_and_bf16():
    # zxbcdt rounded to the dtype, parameters float32 (as under autocast), against float64 on the
    # same rounded input: the kernels' own rounding (tf32 products for float32, in chunks of 32
    # rows: 8 tokens, where bf16 takes the 64 rows of 16 tokens)
    zx, params, reset, sizes = fused_case(1, 29, 2, 16, 1, 32, 8, 16, 4, True)
    for dtype, tol in ((torch.float32, 8e-3), (torch.bfloat16, 5e-2)):
        zx_d = zx.to(dtype)
        ref = run_region(kernels.mixer_torch, zx_d.double(), params, reset, sizes)
        got = run_region(kernels.mixer_triton, zx_d, [p.float() for p in params], reset, sizes)
        for name, a, r in zip(REGION, got, ref):
            err = (a.double() - r).abs().max() / r.abs().max()
            assert torch.isfinite(a).all() and err <= tol, (dtype, name, err.item())


@pytest.mark.interpreter
@pytest.mark.parametrize("R", [1, 2])  # SISO and MIMO models
def test_the_model_on_the_fused_path_matches_the_torch_path(monkeypatch, R):
    # one layer of two heads: the wiring is the point (the interpreter runs a program per head)
    model = tiny(R, reset_token=3, n_layer=1, d_model=16)
    idx = torch.randint(0, 100, (2, 21))  # chunks of 16 tokens (SISO), 8 (R = 2): a partial last
    idx[0, [5, 8, 9]] = 3
    runs = {}
    for impl in ("torch", "triton"):
        monkeypatch.setenv("MAMBA3_IMPL", impl)
        model.zero_grad()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        runs[impl] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    for a, b in zip(runs["torch"], runs["triton"]):
        assert (a - b).abs().max() <= 1e-10 * max(1.0, b.abs().max())


@pytest.mark.interpreter
@pytest.mark.parametrize("R", [1, 2])  # SISO and MIMO models
def test_prefill_on_the_fused_path_matches_the_forward(monkeypatch, R):
    # model.prefill takes the fused forward from the cache's state (no gradient): a prompt in two
    # parts, then a recurrent step, give the forward's logits, and the cache the torch path's
    model = tiny(R, reset_token=3, n_layer=1, d_model=16).eval()
    idx = torch.randint(4, 100, (2, 12))
    idx[0, [0, 6]] = 3
    fused = []
    mixer_triton = kernels.mixer_triton

    def counted(*args, **kw):
        fused.append(kw.get("state") is not None)
        return mixer_triton(*args, **kw)
    monkeypatch.setattr(kernels, "mixer_triton", counted)
    with torch.no_grad():
        logits, _ = model(idx)
        caches = {}
        for impl in ("torch", "triton"):
            monkeypatch.setenv("MAMBA3_IMPL", impl)
            cache = caches[impl] = model.init_cache(2)
            model.prefill(idx[:, :5], cache)
            assert (model.prefill(idx[:, 5:11], cache) - logits[:, 10]).abs().max() <= 1e-10
            assert (model.step(idx[:, 11], cache) - logits[:, 11]).abs().max() <= 1e-10
    assert fused == [True, True]  # the two prefills from a state (the step is recurrent)
    for name, value in caches["triton"][0].items():
        assert (value - caches["torch"][0][name]).abs().max() <= 1e-10, name


@pytest.mark.interpreter
def test_the_fused_mimo_ops_pass_opcheck():
    # one head: the ops' registration is the point (the interpreter runs a program per head)
    zx, params, reset, sizes = fused_case(1, 11, 1, 16, 1, 16, 4, 8, 2, True)
    zx, params = zx.float().requires_grad_(), [p.float().requires_grad_() for p in params]
    sizes = (16, 1, 4, 8, 1e-4, 1e-5)
    args = (zx, *params[:6], reset, *sizes, *params[6:])
    torch.library.opcheck(torch.ops.mamba3.mixer_fwd.default, args)
    out, states, phase = torch.ops.mamba3.mixer_fwd(*args)
    torch.library.opcheck(torch.ops.mamba3.mixer_bwd.default,
                          (torch.randn_like(out), zx.detach(), *(p.detach() for p in params[:6]),
                           reset, states, phase, *sizes, *(p.detach() for p in params[6:])))


def test_dispatch_sends_mimo_to_the_fused_kernels(monkeypatch):
    model = tiny(2)
    mixer = model.blocks[0].mixer
    zx = torch.randn(1, 6, sum(mixer.split), dtype=F64)
    calls = []
    monkeypatch.setattr(kernels, "mixer_triton",
                        lambda *a, mimo, **kw: calls.append(mimo[0].shape) or zx[..., :128])
    # "auto" that picks Triton (for a CUDA tensor) takes the fused kernels, mimo vectors and all
    monkeypatch.setattr(kernels, "_resolve",
                        lambda impl, x: "triton" if impl in ("auto", "triton") else impl)
    mixer.region(zx)
    mixer.region(zx, impl="triton")
    assert calls == [(8, 2, 16)] * 2
    # a decoding state with gradients wanted (the parameters') takes the PyTorch path
    assert mixer.region(zx, model.init_cache(1)[0], impl="triton").shape == (1, 6, 128)
    assert len(calls) == 2


@pytest.mark.parametrize("R, chunk", [(3, 16), (64, 1)])
def test_a_rank_the_kernels_cannot_take_is_refused_naming_the_flag(R, chunk):
    zx, params, _, sizes = fused_case(1, 4, 2, 16, 1, 16, 4, chunk, R, False)
    with pytest.raises(ValueError, match=r"mimo_rank \(--mimo-rank\) 1 .* or a power of 2 from 2 "
                                         rf"to 32 .*got {R}: use impl='torch'"):
        kernels.mixer(zx, *params[:6], **sizes, mimo=tuple(params[6:]), impl="triton")
    # the PyTorch path takes any rank
    assert kernels.mixer(zx, *params[:6], **sizes, mimo=tuple(params[6:]))[0].shape == (1, 4, 32)


# --- formats: checkpoints, the official export and --init-from ---

CONFIG = ModelConfig(vocab_size=257, n_layer=2, d_model=64, headdim=16, d_state=16, ngroups=2,
                     mlp_hidden=128, chunk_size=16, mimo_rank=2)


def make_run(run_dir, config=CONFIG):
    torch.manual_seed(0)
    model = Mamba3LM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ckpt.save(run_dir, 1, model, None, {"tokenizer": {"name": "byte"}})
    return model


def official_mimo_logits(config, state, idx):
    """The official MambaLMHeadModel with Mamba3(is_mimo=True, is_outproj_norm=False) in float64,
    written from its module and its TileLang kernel, not from kernels.py: in_proj splits into z, x,
    B, C (R ranks of G groups of N, rank outermost: "(r g n)"), dd_dt, dd_A, trap and the angles;
    B and C are RMS-normalised, take the per-head, per-rank biases and are rotated by halves (dim n
    with n + N/2, n below the number of angles); x and z are lifted by mimo_x and mimo_z; the state
    takes the sum of the R ranks' k v^T in both trapezoid terms; each rank reads S q_r + D v_r,
    gated by silu(z_r); mimo_o sums them."""
    ssm, E = config["ssm_cfg"], config["ssm_cfg"]["expand"] * config["d_model"]
    N, G, P, R = ssm["d_state"], ssm["ngroups"], ssm["headdim"], ssm["mimo_rank"]
    H, A, half = E // P, int(N * ssm["rope_fraction"]) // 2 * 2 // 2, N // 2
    Bsz, L = idx.shape
    w = {k: v.double() for k, v in state.items()}
    rms = lambda t, weight: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * weight  # noqa
    h = w["backbone.embedding.weight"][idx]
    for i in range(config["n_layer"]):
        layer = f"backbone.layers.{i}."
        m = {k[len(layer + "mixer."):]: v for k, v in w.items() if k.startswith(layer + "mixer.")}
        zx = rms(h, w[layer + "norm.weight"]) @ m["in_proj.weight"].T
        z, x, Bm, Cm, dd_dt, dd_A, trap, angle = zx.split([E, E, R * G * N, R * G * N, H, H, H, A],
                                                         -1)
        dt = F.softplus(dd_dt + m["dt_bias"])
        heavy = torch.where(dd_A >= 0, 1 + dd_A, 1 / (1 - dd_A.clamp(max=0)))
        adt = -torch.clamp(heavy, min=ssm["A_floor"]) * dt
        lam = torch.sigmoid(trap)
        phase = torch.cumsum(torch.tanh(angle)[:, :, None] * math.pi * dt[..., None], dim=1)
        heads = torch.arange(H) // (H // G)
        k = rms(Bm.view(Bsz, L, R, G, N), m["B_norm.weight"])[:, :, :, heads]
        q = rms(Cm.view(Bsz, L, R, G, N), m["C_norm.weight"])[:, :, :, heads]
        k, q = k + m["B_bias"].transpose(0, 1), q + m["C_bias"].transpose(0, 1)  # (B, L, R, H, N)

        def rotate_halves(t):
            c, s = phase.cos()[:, :, None], phase.sin()[:, :, None]
            first, second = t[..., :A], t[..., half:half + A]
            t = t.clone()
            t[..., :A], t[..., half:half + A] = c * first - s * second, s * first + c * second
            return t

        k, q = rotate_halves(k), rotate_halves(q)
        v = x.view(Bsz, L, 1, H, P) * m["mimo_x"].transpose(0, 1)  # (B, L, R, H, P)
        zr = z.view(Bsz, L, 1, H, P) * m["mimo_z"].transpose(0, 1)
        S = torch.zeros(Bsz, H, P, N, dtype=F64)
        k_prev, v_prev, out = torch.zeros_like(k[:, 0]), torch.zeros_like(v[:, 0]), []
        for t in range(L):
            alpha = adt[:, t].exp()[..., None, None]
            beta = ((1 - lam[:, t]) * dt[:, t])[..., None, None] * alpha
            gamma = (lam[:, t] * dt[:, t])[..., None, None]
            S = (alpha * S + beta * torch.einsum("brhn,brhp->bhpn", k_prev, v_prev)
                 + gamma * torch.einsum("brhn,brhp->bhpn", k[:, t], v[:, t]))
            y = torch.einsum("bhpn,brhn->brhp", S, q[:, t]) + m["D"][:, None] * v[:, t]
            out.append(torch.einsum("brhp,hrp->bhp", y * F.silu(zr[:, t]), m["mimo_o"]))
            k_prev, v_prev = k[:, t], v[:, t]
        h = h + torch.stack(out, 1).reshape(Bsz, L, E) @ m["out_proj.weight"].T
        y, gate = (rms(h, w[layer + "norm2.weight"]) @ w[layer + "mlp.fc1.weight"].T).chunk(2, -1)
        h = h + (y * F.silu(gate)) @ w[layer + "mlp.fc2.weight"].T
    return rms(h, w["backbone.norm_f.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("change", [dict(), dict(rope_fraction=1.0, mimo_rank=4)])
def test_the_export_computes_in_the_official_semantics_what_it_computes_here(tmp_path, change):
    model = make_run(tmp_path / "run", dataclasses.replace(CONFIG, **change)).double().eval()
    cfg = model.config
    out = official.export(tmp_path / "run", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    ssm = config["ssm_cfg"]
    assert ssm["is_mimo"] is True and ssm["mimo_rank"] == cfg.mimo_rank
    # the official one counts tokens, at least the MIMO kernel's 8
    assert ssm["chunk_size"] == max(cfg.chunk_tokens, official.MIN_CHUNK_TOKENS)
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    H, R, N, P = cfg.n_heads, cfg.mimo_rank, cfg.d_state, cfg.headdim
    mixer = "backbone.layers.0.mixer."
    assert all(state[mixer + n].shape == (H, R, N) for n in ("B_bias", "C_bias"))
    assert all(state[mixer + n].shape == (H, R, P) for n in ("mimo_x", "mimo_z", "mimo_o"))
    idx = torch.randint(0, 257, (2, 13))
    with torch.no_grad():
        ours = model(idx)[0]
    assert (official_mimo_logits(config, state, idx) - ours).abs().max() <= 1e-10
    # and back: the same tensors; the run directory's checkpoint recorded the rank
    assert official.load_model(tmp_path / "run")[0].config.mimo_rank == cfg.mimo_rank
    fields, weights, _ = official.read_pretrained(out)
    assert fields == dataclasses.asdict(cfg)
    for k, v in make_run(tmp_path / "again", cfg).state_dict().items():
        if k not in ("embed.weight", "lm_head.weight"):  # (their padding rows are not exported)
            assert torch.equal(weights[k], v), k


@pytest.mark.smoke
def test_an_official_mimo_directory(tmp_path):
    """The published layout (config.json ssm_cfg with is_mimo; chunk_size in tokens, or left out
    with mimo_rank: the official 64 and 4), and a MIMO layer of rank 1, which comes in as SISO."""
    model = make_run(tmp_path / "run", dataclasses.replace(CONFIG, mimo_rank=4)).double().eval()
    out = official.export(tmp_path / "run", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    for key in ("chunk_size", "mimo_rank"):
        del config["ssm_cfg"][key]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text(json.dumps(config))
    torch.save(state, theirs / "pytorch_model.bin")
    fields, weights, _ = official.read_pretrained(theirs)
    assert fields["mimo_rank"] == 4 and fields["chunk_size"] == 4 * 64

    def logits(fields, weights, idx):
        loaded = Mamba3LM(ModelConfig(**fields)).double().eval()
        loaded.load_state_dict(weights)
        with torch.no_grad():
            return loaded(idx)[0]

    idx = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        assert (logits(fields, weights, idx) - model(idx)[0]).abs().max() <= 1e-10

    # rank 1: the first rank of B and C, random mimo vectors (float64: the fold's products stay
    # exact to 1e-16)
    config["ssm_cfg"].update(mimo_rank=1, chunk_size=16)
    one, g = {k: v.double() for k, v in state.items()}, torch.Generator().manual_seed(2)
    H, P, N, G = CONFIG.n_heads, CONFIG.headdim, CONFIG.d_state, CONFIG.ngroups
    B0, C0 = 2 * H * P, 2 * H * P + 4 * G * N  # where B's and C's rows start
    for i in range(2):
        m = f"backbone.layers.{i}.mixer."
        rows = one[m + "in_proj.weight"]
        one[m + "in_proj.weight"] = torch.cat([rows[:B0 + G * N], rows[C0:C0 + G * N],
                                               rows[C0 + 4 * G * N:]])
        for name in ("B_bias", "C_bias"):
            one[m + name] = one[m + name][:, :1].clone()
        for name in ("mimo_x", "mimo_z", "mimo_o"):
            one[m + name] = 0.5 + torch.rand(H, 1, P, generator=g, dtype=F64)
    (theirs / "config.json").write_text(json.dumps(config))
    torch.save(one, theirs / "pytorch_model.bin")
    fields, weights, _ = official.read_pretrained(theirs)
    assert fields["mimo_rank"] == 1 and not any("mimo" in k for k in weights)
    expected = official_mimo_logits(config, one, idx)
    assert (logits(fields, weights, idx) - expected).abs().max() <= 1e-10
    one["backbone.layers.1.mixer.mimo_o"] = torch.ones(H, 2, P)
    torch.save(one, theirs / "pytorch_model.bin")
    with pytest.raises(ckpt.CheckpointError,
                       match=rf"layers.1.mixer.mimo_o is \({H}, 2, {P}\), not \({H}, 1, {P}\)"):
        official.read_pretrained(theirs)


def test_an_export_writes_a_chunk_the_official_kernels_take(tmp_path):
    """Rank 16 at 64 rows a chunk is 4 tokens, and the official MIMO kernel asserts at least 8:
    the export writes 8, which computes the same function; our own config comes back whole."""
    cfg = dataclasses.replace(CONFIG, mimo_rank=16, chunk_size=64)
    model = make_run(tmp_path / "run", cfg).double().eval()
    out = official.export(tmp_path / "run", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert cfg.chunk_tokens == 4 and config["ssm_cfg"]["chunk_size"] == 8
    assert official.read_pretrained(out)[0]["chunk_size"] == 64
    # config.json alone, as anyone's checkpoint: chunks of 8 tokens, 128 rows
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        (theirs / name).write_bytes((out / name).read_bytes())
    fields, weights, _ = official.read_pretrained(theirs)
    assert fields["chunk_size"] == 128
    loaded = Mamba3LM(ModelConfig(**fields)).double().eval()
    loaded.load_state_dict(weights)
    # 21 tokens: several chunks of either size, and a partial last one
    idx = torch.randint(0, 257, (2, 21))
    with torch.no_grad():
        assert (loaded(idx)[0] - model(idx)[0]).abs().max() <= 1e-10
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert (official_mimo_logits(config, state, idx) - model(idx)[0]).abs().max() <= 1e-10


def test_init_from_refuses_another_rank(tmp_path):
    make_run(tmp_path / "run")
    init = official.read_pretrained(tmp_path / "run")[0]
    cfg = train.TrainConfig(data=["synthetic"], init_from=str(tmp_path / "run"), mimo_rank=4,
                            max_steps=1)
    with pytest.raises(train.TrainError, match="--model, --vocab-size and --mimo-rank may not"):
        train.resolve(cfg, init)
    assert train.resolve(dataclasses.replace(cfg, mimo_rank=2), init).mimo_rank == 2


def test_a_checkpoint_from_before_mimo_loads(tmp_path):
    model = make_run(tmp_path / "run", dataclasses.replace(CONFIG, mimo_rank=1))
    meta_path = tmp_path / "run" / "meta_step_1.json"
    meta = json.loads(meta_path.read_text())
    del meta["model_config"]["mimo_rank"]  # as written before the field existed
    meta_path.write_text(json.dumps(meta))
    loaded = official.load_model(tmp_path / "run")[0]
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
