"""Hybrid models: attention layers among the Mamba-3 ones (ModelConfig.attn_layers), checked
against a plain O(L^2) softmax attention written here in float64."""
import dataclasses
import math

import pytest
import torch

from model import PRESETS, Attention, Mamba3LM, Mamba3Mixer, ModelConfig
from test_model import assert_compiled_matches_eager_under_autocast

EOS = 3


def hybrid(vocab_size=100, attn_layers=(1,), **kw):
    """The tiny preset (2 layers, d_model 64) with attention in `attn_layers`."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=vocab_size,
                                 attn_layers=attn_layers, **kw)
    return Mamba3LM(config)


def plain_attention(mixer, u, positions=None, documents=None):
    """The attention mixer, written out the long way in float64: in_proj rows [Q | K | V],
    NeoX rotary on the first rotary dims (channel i with i + r/2, angle p / base^(2i/r)), and
    for each token i a softmax over the tokens j <= i of its document, query head h reading KV
    head h // (heads / kv_heads). positions and documents: lists of per-token ints for one row
    (default: one document from 0)."""
    shape = mixer.shape
    H, G, d, r = shape.heads, shape.kv_heads, shape.head_dim, shape.rotary_dim
    W = mixer.in_proj.weight.double()
    b = mixer.in_proj.bias
    Wo = mixer.out_proj.weight.double()
    B, L, _ = u.shape
    positions = positions or list(range(L))
    documents = documents or [0] * L
    out = torch.zeros(B, L, H * d, dtype=torch.float64)
    for row in range(B):
        qkv = u[row].double() @ W.T
        if b is not None:
            qkv = qkv + b.double()
        q = qkv[:, :H * d].reshape(L, H, d).clone()
        k = qkv[:, H * d:(H + G) * d].reshape(L, G, d).clone()
        v = qkv[:, (H + G) * d:].reshape(L, G, d)
        for t in range(L):
            for i in range(r // 2):
                angle = positions[t] / mixer.base ** (2 * i / r)
                c, s = math.cos(angle), math.sin(angle)
                for x in (q, k):
                    a1, a2 = x[t, :, i].clone(), x[t, :, i + r // 2].clone()
                    x[t, :, i] = a1 * c - a2 * s
                    x[t, :, i + r // 2] = a2 * c + a1 * s
        for h in range(H):
            g = h // (H // G)
            for i in range(L):
                seen = [j for j in range(i + 1) if documents[j] == documents[i]]
                scores = torch.stack([q[i, h] @ k[j, g] for j in seen]) / math.sqrt(d)
                weights = torch.softmax(scores, 0)
                out[row, i, h * d:(h + 1) * d] = sum(w * v[j, g] for w, j in zip(weights, seen))
    y = out @ Wo.T
    if mixer.out_proj.bias is not None:
        y = y + mixer.out_proj.bias.double()
    return y


@pytest.mark.smoke
def test_no_attention_layers_is_todays_model_bit_for_bit():
    torch.manual_seed(0)
    today = Mamba3LM(dataclasses.replace(PRESETS["tiny"], vocab_size=100))
    torch.manual_seed(0)
    same = hybrid(attn_layers=())
    assert all(torch.equal(a, b) for a, b in zip(today.state_dict().values(),
                                                  same.state_dict().values()))
    assert today.state_dict().keys() == same.state_dict().keys()
    idx = torch.randint(0, 100, (2, 9))
    assert torch.equal(today(idx)[0], same(idx)[0])


@pytest.mark.parametrize("shape", [
    dict(),  # 4 heads of 16 channels, rotary over the whole head
    dict(attn_heads=4, attn_kv_heads=2, attn_rotary_dim=8),  # grouped-query, partial rotary
    dict(attn_heads=8, attn_kv_heads=1, attn_rotary_dim=0),  # one KV head, no rotary
    dict(attn_heads=2, attn_head_dim=12, attn_rotary_dim=12, attn_qkv_bias=True,
         attn_out_bias=True),  # a head dim of its own, biases on
])
@pytest.mark.parametrize("L", [1, 7, 13])
def test_attention_is_plain_softmax_attention(shape, L):
    model = hybrid(**shape).double()
    mixer = model.blocks[1].mixer
    if mixer.in_proj.bias is not None:
        with torch.no_grad():
            mixer.in_proj.bias.normal_()
            mixer.out_proj.bias.normal_()
    u = torch.randn(2, L, 64, dtype=torch.float64)
    expected = plain_attention(mixer, u)
    assert (mixer(u) - expected).abs().max() <= 1e-10


def test_attention_layout_is_the_official_mha():
    model = hybrid(attn_heads=4, attn_kv_heads=2)
    mixer = model.blocks[1].mixer
    assert isinstance(model.blocks[0].mixer, Mamba3Mixer) and isinstance(mixer, Attention)
    names = {k for k in model.state_dict() if k.startswith("blocks.1.")}
    assert names == {"blocks.1.norm1.weight", "blocks.1.mixer.in_proj.weight",
                     "blocks.1.mixer.out_proj.weight", "blocks.1.norm2.weight",
                     "blocks.1.mlp.gate.weight", "blocks.1.mlp.up.weight",
                     "blocks.1.mlp.down.weight"}
    # [Q | K | V]: 4 heads of 16, then 2 KV heads of 16 each for K and V
    assert mixer.in_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 64)
    assert mixer.out_proj.weight.shape == (64, 64)



@pytest.mark.parametrize("change, message", [
    (dict(attn_layers=(2,)), r"attn_layers \(--attn-layers\) \[2\]: 2 is not a layer of this "
                             "model; its 2 layers are 0 to 1"),
    (dict(attn_layers=(-1,)), "-1 is not a layer"),
    (dict(attn_layers=(1, 1)), "names a layer twice"),
    (dict(attn_layers=(1,), attn_heads=3), r"do not divide d_model 64"),
    (dict(attn_layers=(1,), attn_heads=4, attn_kv_heads=3),
     r"attn_kv_heads \(--attn-kv-heads\) 3 does not divide the 4 attention heads"),
    (dict(attn_layers=(1,), attn_rotary_dim=5), r"\(--attn-rotary-dim\) 5: .* must be even"),
    (dict(attn_layers=(1,), attn_rotary_dim=18), "from 0 to the head dim 16"),
    (dict(attn_layers=(1,), attn_kv_heads=0), r"attn_kv_heads \(--attn-kv-heads\) must be"),
])
def test_impossible_attention_is_refused_naming_the_flag(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(PRESETS["tiny"], **change)


def test_attention_shape_defaults():
    assert PRESETS["180m"].attn_shape == (12, 12, 64, 64)  # the Mamba headdim, 64
    assert PRESETS["tiny"].attn_shape == (4, 4, 16, 16)
    assert dataclasses.replace(PRESETS["small"], attn_heads=8).attn_shape == (8, 8, 32, 32)
    config = ModelConfig(**dataclasses.asdict(dataclasses.replace(PRESETS["small"],
                                                                  attn_layers=[3])))
    assert config.attn_layers == (3,)  # a JSON list comes back a tuple


# --- document resets and decoding ---


def packed_ids(B=2, L=40, seed=0):
    """Ids in [4, 100) with EOS at 15, 30 and 31 in row 0 (an empty document between two
    EOS) and at 38 in row 1."""
    idx = torch.randint(4, 100, (B, L), generator=torch.Generator().manual_seed(seed))
    idx[0, [15, 30, 31]] = EOS
    idx[1, 38] = EOS
    return idx


def spans(row):
    """(start, end) of each document of a row of ids."""
    ends = (row == EOS).nonzero().flatten().tolist()
    starts = [0] + [e + 1 for e in ends]
    stops = [e + 1 for e in ends] + [len(row)]
    return [(a, b) for a, b in zip(starts, stops) if a < b]


def test_attention_with_resets_is_plain_attention_per_document():
    model = hybrid(attn_kv_heads=2, attn_rotary_dim=8, reset_token=EOS).double()
    mixer = model.blocks[1].mixer
    idx = torch.randint(4, 100, (2, 21))
    idx[0, [4, 9, 10]] = EOS
    idx[1, 19] = EOS
    u = torch.randn(2, 21, 64, dtype=torch.float64)
    reset = model.resets(idx)
    out = mixer(u, reset=reset)
    for row in range(2):
        documents = reset[row].long().cumsum(0).tolist()
        positions = [t - documents.index(documents[t]) for t in range(21)]
        expected = plain_attention(mixer, u[row:row + 1], positions, documents)
        assert (out[row] - expected[0]).abs().max() <= 1e-10


@pytest.mark.smoke
def test_packed_documents_equal_documents_run_alone():
    model = hybrid(attn_layers=(0,), attn_kv_heads=2, reset_token=EOS).double().eval()
    idx = packed_ids()
    logits, _ = model(idx)
    for b in range(2):
        for start, end in spans(idx[b]):
            alone, _ = model(idx[b:b + 1, start:end])
            assert (alone[0] - logits[b, start:end]).abs().max() <= 1e-10, (b, start, end)
    # without reset_token the documents do see each other
    plain = Mamba3LM(dataclasses.replace(model.config, reset_token=None)).double().eval()
    plain.load_state_dict(model.state_dict())
    assert (plain(idx)[0][0, 16:] - logits[0, 16:]).abs().max() > 1e-3


@pytest.mark.parametrize("reset_token", [None, EOS])
@pytest.mark.parametrize("split", [1, 16, 31, 33])
def test_prefill_then_step_equals_the_forward(reset_token, split):
    model = hybrid(attn_layers=(0, 1), attn_kv_heads=2, attn_rotary_dim=8,
                   reset_token=reset_token).double().eval()
    idx = packed_ids()
    logits, _ = model(idx)
    cache = model.init_cache(2)
    last = model.prefill(idx[:, :split], cache)
    assert (last - logits[:, split - 1]).abs().max() <= 1e-10
    for t in range(split, idx.shape[1]):
        out = model.step(idx[:, t], cache)
        assert (out - logits[:, t]).abs().max() <= 1e-10, t


def test_decoding_in_windows_holds_one_document_per_row():
    model = hybrid(reset_token=EOS).double().eval()
    idx = packed_ids()
    logits, _ = model(idx)
    # prefilled in windows of 7, room for 8 tokens asked for: the cache grows when needed
    cache = model.init_cache(2, max_len=8)
    for start in range(0, 40, 7):
        window = model.logits(model.hidden(idx[:, start:start + 7], cache))
        assert (window - logits[:, start:start + 7]).abs().max() <= 1e-10, start
        # what prefill does after a window that ends on EOS: the row starts afresh
        done = idx[:, min(start + 7, 40) - 1] == EOS
        for layer in cache:
            for t in layer.values():
                t.masked_fill_(done.view(-1, *(1,) * (t.dim() - 1)), 0)
    kv = cache[1]
    # row 0's last document started at 32, row 1's at 39: only those are kept; the room
    # doubled from 8 as row 1's first document (39 tokens) grew
    assert kv["n"].tolist() == [8, 1] and kv["k"].shape[2] == 64


def test_generate_greedy_is_argmax_of_the_forward_and_stays_in_its_room():
    model = hybrid().double().eval()
    idx = torch.randint(0, 100, (2, 7))
    out = model.generate(idx, 6, temperature=0)
    for t in range(7, 13):
        logits, _ = model(out[:, :t])
        assert torch.equal(out[:, t], logits[:, -1].argmax(-1))
    cache = model.init_cache(2, max_len=13)
    model.prefill(out[:, :7], cache)
    for t in range(7, 12):
        model.step(out[:, t], cache)
    assert cache[1]["k"].shape == (2, 4, 13, 16) and cache[1]["n"].tolist() == [12, 12]


def test_flops_and_memory_count_attention():
    import model as model_module

    small = PRESETS["small"]
    mixed = dataclasses.replace(small, attn_layers=(3,))
    with torch.device("meta"):
        ours = Mamba3LM(mixed)
        theirs = Mamba3LM(small)
    matmuls = sum(m.weight.numel() for m in ours.modules() if isinstance(m, torch.nn.Linear))
    C, N, P, H = small.chunk_tokens, small.d_state, small.headdim, small.n_heads
    scan = 3 * H * (2 * C * (N + P) + 4 * P * N)
    # scores and values: 2 x 2 x L x d per token, halved for causality, x3 for training
    attention = 3 * 2 * 256 * 256
    assert ours.flops_per_token(256) == 6 * matmuls + 3 * scan + attention
    assert ours.flops_per_token(2048) - theirs.flops_per_token(2048) > 0
    plain = model_module.activation_bytes(small, 1024, seq_len=256)
    assert plain == model_module.activation_bytes(small, 1024)
    scores = model_module.activation_bytes(mixed, 1024, seq_len=256) - plain
    assert scores == 1024 * 4 * 256 * model_module.SCORE_BYTES


def test_gradient_checkpointing_and_compile_under_autocast():
    model = hybrid(reset_token=EOS)
    idx = packed_ids()
    grads = []
    for flag in (False, True):
        model.zero_grad()
        model.grad_checkpointing = flag
        _, loss = model(idx, idx)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)
    model.grad_checkpointing = False
    assert_compiled_matches_eager_under_autocast(model, idx)


# --- the official format: attn_layer_idx and attn_cfg ---

# two groups, a vocabulary that is not a multiple of 64, attention in layer 1 of 3
HYBRID = ModelConfig(vocab_size=257, n_layer=3, d_model=64, headdim=16, d_state=16, ngroups=2,
                     mlp_hidden=128, chunk_size=16, attn_layers=(1,), attn_heads=4,
                     attn_kv_heads=2, attn_rotary_dim=8)


def official_mha(state, prefix, attn_cfg, d_model, x):
    """The official MHA's forward (mamba_ssm/modules/mha.py, no cache), in our words: in_proj,
    then q is the first num_heads * head_dim columns and kv the rest, as (2, num_heads_kv,
    head_dim); rotary embedding (flash_attn's, not interleaved: the first rotary_emb_dim / 2
    channels pair with the next as many, inv_freq = 1 / base^(arange(0, dim, 2) / dim)) on q
    and k; k and v repeat_interleave'd to num_heads; causal scaled_dot_product_attention;
    out_proj. x (B, L, d_model) float64."""
    H = attn_cfg["num_heads"]
    Hkv = attn_cfg["num_heads_kv"]
    d = attn_cfg["head_dim"]
    r = attn_cfg["rotary_emb_dim"]
    qkv = x @ state[prefix + "in_proj.weight"].double().T
    B, L, _ = x.shape
    q = qkv[..., :H * d].reshape(B, L, H, d)
    kv = qkv[..., H * d:].reshape(B, L, 2, Hkv, d)
    k, v = kv[:, :, 0], kv[:, :, 1]
    inv_freq = 1.0 / attn_cfg["rotary_emb_base"] ** (
        torch.arange(0, r, 2, dtype=torch.float64) / r)
    freqs = torch.outer(torch.arange(L, dtype=torch.float64), inv_freq)  # (L, r/2)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]

    def rotate(t):
        t1, t2, rest = t[..., :r // 2], t[..., r // 2:r], t[..., r:]
        return torch.cat([t1 * cos - t2 * sin, t1 * sin + t2 * cos, rest], dim=-1)

    q, k = rotate(q), rotate(k)
    k = torch.repeat_interleave(k, dim=2, repeats=H // Hkv)
    v = torch.repeat_interleave(v, dim=2, repeats=H // Hkv)
    context = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    return context.reshape(B, L, H * d) @ state[prefix + "out_proj.weight"].double().T


def test_a_hybrid_exports_as_the_official_hybrid(tmp_path):
    import json

    import official
    from test_export import make_run

    model = make_run(tmp_path / "run", HYBRID).double()
    out = official.export(tmp_path / "run", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["attn_layer_idx"] == [1]
    assert config["attn_cfg"] == {
        "num_heads": 4, "num_heads_kv": 2, "head_dim": 16, "rotary_emb_dim": 8,
        "rotary_emb_base": 10000.0, "causal": True, "qkv_proj_bias": False,
        "out_proj_bias": False, "mlp_dim": 0, "d_conv": 0}
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    layer = {k.split("layers.1.")[1]: v.shape for k, v in state.items() if ".layers.1." in k}
    assert layer == {"norm.weight": (64,), "mixer.in_proj.weight": (128, 64),
                     "mixer.out_proj.weight": (64, 64), "norm2.weight": (64,),
                     "mlp.fc1.weight": (256, 64), "mlp.fc2.weight": (64, 128)}
    # the official MHA's output equals our mixer's
    x = torch.randn(2, 11, 64, dtype=torch.float64)
    theirs = official_mha(state, "backbone.layers.1.mixer.", config["attn_cfg"], 64, x)
    with torch.no_grad():
        ours = model.blocks[1].mixer(x)
    assert (theirs - ours).abs().max() <= 1e-10
    assert "flash_attn" in (out / "README.md").read_text().replace("flash-attn", "flash_attn")


@pytest.mark.parametrize("mimo_rank", [1, 2])
def test_a_hybrid_round_trips_bit_for_bit(tmp_path, mimo_rank):
    import official
    from test_export import make_run

    config = dataclasses.replace(HYBRID, attn_qkv_bias=True, attn_out_bias=True,
                                 mimo_rank=mimo_rank)
    model = make_run(tmp_path / "run", config)
    official.export(tmp_path / "run", tmp_path / "out")
    idx = torch.randint(0, 257, (2, 40))
    with torch.no_grad():
        expected = model(idx)[0]
    config, state, _ = official.read_pretrained(tmp_path / "out")
    back = Mamba3LM(ModelConfig(**config))
    assert back.config.attn_shape == model.config.attn_shape
    assert back.config.attn_layers == (1,) and back.config.attn_out_bias
    back.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(back(idx)[0], expected)
