import dataclasses
import math

import pytest
import torch

from kernels import rotate
from model import PRESETS, Mamba3LM, ModelConfig


def tiny(vocab_size=100, **kw):
    return Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab_size, **kw))


@pytest.mark.smoke
def test_shapes_and_initial_loss():
    model = tiny(vocab_size=1000)
    idx = torch.randint(0, 1000, (3, 21))
    targets = torch.randint(0, 1000, (3, 21))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 21, 1000)  # the padded rows (1024) never show
    assert abs(loss.item() - math.log(1000)) < 0.1
    logits, loss = model(idx)
    assert loss is None and logits.shape == (3, 21, 1000)


def test_ignore_index_and_padded_vocab():
    model = tiny(vocab_size=100)
    assert model.config.padded_vocab == 128 and model.embed.weight.shape == (128, 64)
    idx = torch.randint(0, 100, (2, 9))
    targets = idx.clone()
    targets[:, :4] = -1
    _, loss = model(idx, targets)
    logits, _ = model(idx)
    expected = torch.nn.functional.cross_entropy(logits[:, 4:].flatten(0, 1), idx[:, 4:].flatten())
    assert torch.allclose(loss, expected)


def test_head_and_embedding_share_storage():
    model = tiny()
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    # the shared tensor is one parameter, counted and optimised once
    assert sum(p is model.embed.weight for p in model.parameters()) == 1


@pytest.mark.smoke
def test_stepwise_decoding_reproduces_the_parallel_forward():
    model = tiny().double().eval()
    idx = torch.randint(0, 100, (2, 40))  # 40 tokens: two full chunks of 16 and a partial one
    logits, _ = model(idx)
    cache = model.init_cache(2)
    stepped = torch.stack([model.step(idx[:, t], cache) for t in range(40)], dim=1)
    assert (stepped - logits).abs().max() <= 1e-10


@pytest.mark.parametrize("split", [1, 16, 23])
def test_prefill_then_step_from_the_middle(split):
    model = tiny().double().eval()
    idx = torch.randint(0, 100, (2, 40))
    logits, _ = model(idx)
    cache = model.init_cache(2)
    last = model.prefill(idx[:, :split], cache)
    assert (last - logits[:, split - 1]).abs().max() <= 1e-10
    for t in range(split, 40):
        out = model.step(idx[:, t], cache)
        assert (out - logits[:, t]).abs().max() <= 1e-10


@pytest.mark.smoke
def test_generate_greedy_is_argmax_of_the_forward():
    model = tiny().double().eval()
    idx = torch.randint(0, 100, (2, 7))
    out = model.generate(idx, 6, temperature=0)
    assert out.shape == (2, 13) and torch.equal(out[:, :7], idx)
    for t in range(7, 13):  # each greedy token is the argmax of the full forward over what came before
        logits, _ = model(out[:, :t])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1))
    assert out.max() < 100


@pytest.mark.smoke
def test_top_k_sampling_stays_in_the_top_k():
    model = tiny().eval()
    idx = torch.randint(0, 100, (4, 5))
    logits, _ = model(idx)
    allowed = torch.topk(logits[:, -1], 3, dim=-1).indices
    g = torch.Generator().manual_seed(0)
    out = model.generate(idx, 1, temperature=2.0, top_k=3, generator=g)
    assert all(out[b, -1] in allowed[b] for b in range(4))


def expected_params(cfg: ModelConfig) -> int:
    """Parameter count from the config alone."""
    D, E, H, N, G, S = cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.d_state, cfg.ngroups, cfg.n_angles
    in_proj = D * (2 * E + 2 * G * N + 3 * H + S)
    mixer = in_proj + E * D + H + 2 * N + 2 * H * N + H  # + dt_bias, B/C norms, B/C biases, D
    mlp = 3 * D * cfg.mlp_hidden + D if cfg.mlp_hidden else 0  # + its norm
    block = D + mixer + mlp
    vocab = -(-cfg.vocab_size // 64) * 64
    return vocab * D + cfg.n_layer * block + D


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta_with_the_expected_count(name):
    with torch.device("meta"):
        model = Mamba3LM(PRESETS[name])
    assert model.num_params() == expected_params(PRESETS[name])
    assert model.flops_per_token(2048) > 6 * model.num_params() - 6 * model.embed.weight.numel()


def test_paper_sizes_at_the_paper_vocab():
    # the paper's ~186M and ~443M parameters with its 128k vocabulary
    for name, expected in (("180m", 186e6), ("440m", 443e6)):
        cfg = dataclasses.replace(PRESETS[name], vocab_size=128256)
        assert abs(expected_params(cfg) - expected) / expected < 0.01


def test_param_groups_split_decay_from_no_decay():
    model = tiny()
    decay, no_decay = model.param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)].split(".")[-1] for p in no_decay["params"]}
    assert no_decay_names == {"dt_bias", "D", "B_bias", "C_bias", "B_norm_weight", "C_norm_weight", "weight"}
    assert all(p.dim() == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny()
    idx = torch.randint(0, 100, (2, 20))
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.grad_checkpointing = flag
        _, loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_rotation_is_a_rotation():
    v = torch.randn(3, 5, 2, 10, dtype=torch.float64)
    phi = torch.rand(3, 5, 2, 3, dtype=torch.float64) * 6
    r = rotate(v, phi)
    assert torch.allclose(r.norm(dim=-1), v.norm(dim=-1))
    assert torch.equal(r[..., 6:], v[..., 6:])  # dims past 2S pass through
    assert torch.allclose(rotate(r, -phi), v)


@pytest.mark.smoke
def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="headdim"):
        ModelConfig(d_model=100, headdim=64)


def test_tiny_memorises_a_fixed_batch():
    model = tiny(vocab_size=64)
    x = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(model.param_groups(0.0), lr=3e-3)
    losses = []
    for _ in range(80):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.5 and losses[-1] < 0.1 * losses[0]


# --- document-boundary resets (reset_token) ---

EOS = 3


def packed_ids(B=2, L=40, seed=0):
    """Token ids in [4, 100) with EOS placed so that documents start at a chunk's first token (16), its last (31)
    and right after another EOS (32) in row 0, and near the end in row 1 (chunk size 16)."""
    idx = torch.randint(4, 100, (B, L), generator=torch.Generator().manual_seed(seed))
    idx[0, [15, 30, 31]] = EOS
    idx[1, 38] = EOS
    return idx


def test_reset_token_is_a_config_field_off_by_default():
    assert ModelConfig().reset_token is None
    assert dataclasses.asdict(dataclasses.replace(PRESETS["tiny"], reset_token=EOS))["reset_token"] == EOS
    model = tiny(reset_token=EOS)
    reset = model.resets(packed_ids())
    assert reset.dtype == torch.bool and not reset[:, 0].any()
    assert reset[0].nonzero().flatten().tolist() == [16, 31, 32] and reset[1].nonzero().flatten().tolist() == [39]
    assert tiny().resets(packed_ids()) is None


@pytest.mark.smoke
def test_packed_documents_equal_documents_run_alone():
    model = tiny(reset_token=EOS).double().eval()
    idx = packed_ids()
    logits, _ = model(idx)
    for b in range(2):
        ends = (idx[b] == EOS).nonzero().flatten().tolist()
        for start, end in zip([0] + [e + 1 for e in ends], [e + 1 for e in ends] + [idx.shape[1]]):
            alone, _ = model(idx[b:b + 1, start:end])
            assert (alone[0] - logits[b, start:end]).abs().max() <= 1e-10, (b, start, end)
    plain, _ = tiny().double().eval()(idx)  # without reset_token the documents do see each other
    assert (plain[0, 16:] - logits[0, 16:]).abs().max() > 1e-3


def test_stepwise_decoding_with_eos_reproduces_the_parallel_forward():
    model = tiny(reset_token=EOS).double().eval()
    idx = packed_ids()
    logits, _ = model(idx)
    cache = model.init_cache(2)
    stepped = torch.stack([model.step(idx[:, t], cache) for t in range(idx.shape[1])], dim=1)
    assert (stepped - logits).abs().max() <= 1e-10


@pytest.mark.parametrize("split", [16, 31, 33])
def test_prefill_across_eos_then_step(split):
    model = tiny(reset_token=EOS).double().eval()
    idx = packed_ids()
    logits, _ = model(idx)
    cache = model.init_cache(2)
    assert (model.prefill(idx[:, :split], cache) - logits[:, split - 1]).abs().max() <= 1e-10
    for t in range(split, idx.shape[1]):
        assert (model.step(idx[:, t], cache) - logits[:, t]).abs().max() <= 1e-10


def test_generation_after_eos_equals_generation_from_scratch():
    model = tiny(reset_token=EOS).double().eval()
    g = torch.Generator().manual_seed(1)
    before, prompt = torch.randint(4, 100, (2, 9), generator=g), torch.randint(4, 100, (2, 4), generator=g)
    packed = torch.cat([before, torch.full((2, 1), EOS), prompt], dim=1)
    after_eos = model.generate(packed, 8, temperature=0)[:, -8:]
    assert torch.equal(after_eos, model.generate(prompt, 8, temperature=0)[:, -8:])
    # a prompt that ends with EOS leaves a cleared cache: the next token is scored as a document's first
    cache, fresh = model.init_cache(2), model.init_cache(2)
    model.prefill(torch.cat([before, torch.full((2, 1), EOS)], dim=1), cache)
    assert (model.step(prompt[:, 0], cache) - model.step(prompt[:, 0], fresh)).abs().max() <= 1e-10


@pytest.mark.smoke
def test_mixer_is_out_proj_of_region_of_in_proj():
    model = tiny()
    mixer = model.blocks[0].mixer
    u = torch.randn(2, 7, 64)
    expected = mixer.out_proj(mixer.region(mixer.in_proj(u)))
    assert torch.equal(mixer(u), expected)
    mixer.in_proj, mixer.out_proj = torch.nn.Identity(), torch.nn.Identity()  # what the traffic count does
    zxbcdt = torch.randn(2, 7, sum(mixer.split))
    assert torch.equal(mixer(zxbcdt), mixer.region(zxbcdt))


def assert_compiled_matches_eager_under_autocast(model, x):
    """Loss and gradients of `model` on x under CPU bf16 autocast, eager against
    torch.compile (aot_eager), to bf16's precision."""
    grads = []
    for fn in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = fn(x[:, :-1], x[:, 1:])
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = grads
    assert torch.allclose(eager_loss, compiled_loss, rtol=1e-3)
    for a, b in zip(eager_grads, compiled_grads):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-3 * a.abs().max().item())


def test_compiled_model_under_cpu_bf16_autocast_matches_eager():
    # train.py's default on CPUs with bf16 arithmetic: the chunked scan's hand-written backward must run in its
    # compute dtype even when torch.compile traces it under the caller's autocast
    torch.manual_seed(0)
    model = Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=257))
    assert_compiled_matches_eager_under_autocast(model, torch.randint(0, 257, (2, 33)))
