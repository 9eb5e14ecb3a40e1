"""Hybrid models: attention layers among the Mamba-3 ones (ModelConfig.attn_layers), checked
against a plain O(L^2) softmax attention written here in float64."""
import dataclasses
import math

import pytest
import torch

from model import PRESETS, Attention, Mamba3LM, Mamba3Mixer, ModelConfig

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


@pytest.mark.smoke
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
