"""ckpt.py: round trips are bit-exact, partial and damaged checkpoints are never used, kills are survived."""
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import time
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ckpt
from ckpt import CheckpointError


@dataclasses.dataclass
class TinyConfig:
    vocab: int = 17
    dim: int = 8
    dropout: float = 0.0  # does not change any shape: only the config check can tell models apart
    sizes: tuple = (1, 2)  # a tuple comes back from JSON as a list; the check must not mind


class TinyLM(nn.Module):
    """Embedding and LM head share one weight, like model.py's; plus buffers of other dtypes."""

    def __init__(self, config=TinyConfig()):
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.dim)
        self.norm = nn.LayerNorm(config.dim)
        self.gain = nn.Parameter(torch.ones(config.dim, dtype=torch.bfloat16))
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))  # 0-dim
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, idx):
        return self.head(self.norm(self.emb(idx)) * self.gain.float())


def make(seed, config=TinyConfig(), train_steps=2):
    torch.manual_seed(seed)
    model = TinyLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(train_steps):
        train_step(model, opt)
    return model, opt


def train_step(model, opt):
    idx = torch.arange(12).reshape(3, 4) % model.config.vocab
    loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.steps += 1


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def same_optimizer(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(sa["state"][i].keys() == sb["state"][i].keys()
               and all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for k in sa["state"][i])
               for i in sa["state"])


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_in(d):
    return sorted(os.listdir(d))


# -----------------------------------------------------------------------------
# round trips


@pytest.mark.smoke
def test_round_trip_is_bit_exact_and_training_continues_identically(tmp_path):
    a, opt_a = make(0)
    meta_in = {"tag": "run1", "lr_sched": {"step": 2, "warmup": 10}, "tokens": 123456789012, "loss": 2.5,
               "flags": [True, None, "x"]}
    paths = ckpt.save(tmp_path, 2, a, opt_a, meta_in)
    assert [p.name for p in paths] == ["model_step_2.safetensors", "optim_step_2.pt", "meta_step_2.json"]
    assert files_in(tmp_path) == ["meta_step_2.json", "model_step_2.safetensors", "optim_step_2.pt"]

    b, opt_b = make(1)
    assert not same_state(a, b)
    meta = ckpt.load(tmp_path, 2, b, opt_b)
    assert same_state(a, b) and same_optimizer(opt_a, opt_b)
    assert {k: meta[k] for k in meta_in} == meta_in
    assert meta["step"] == 2 and meta["model_config"] == {"vocab": 17, "dim": 8, "dropout": 0.0, "sizes": [1, 2]}
    assert meta["versions"]["torch"] == torch.__version__
    assert json.loads((tmp_path / "meta_step_2.json").read_text()) == meta
    for name in ("model_step_2.safetensors", "optim_step_2.pt"):
        assert meta["files"][name]["bytes"] == (tmp_path / name).stat().st_size
        assert meta["files"][name]["sha256"] == sha256(tmp_path / name)

    # The safetensors library reads our file back to the same tensors, dtypes included.
    on_disk = load_file(tmp_path / "model_step_2.safetensors")
    assert on_disk.keys() == a.state_dict().keys()
    assert all(on_disk[k].dtype == v.dtype and torch.equal(on_disk[k], v) for k, v in a.state_dict().items())

    # Resumed training is the same training, bit for bit.
    train_step(a, opt_a)
    train_step(b, opt_b)
    assert same_state(a, b) and same_optimizer(opt_a, opt_b)


def test_big_tensors_hash_right(tmp_path):
    model = nn.Linear(1024, 600)  # a 2.4 MB weight
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    ckpt.save(tmp_path, 1, model, opt, {})
    meta = json.loads((tmp_path / "meta_step_1.json").read_text())
    for name in ("model_step_1.safetensors", "optim_step_1.pt"):
        assert meta["files"][name]["sha256"] == sha256(tmp_path / name)
    other = nn.Linear(1024, 600)
    opt2 = torch.optim.AdamW(other.parameters())
    ckpt.load(tmp_path, 1, other, opt2)
    assert same_state(model, other) and same_optimizer(opt, opt2)


@pytest.mark.smoke
def test_optimizer_file_loads_with_weights_only(tmp_path):
    model, opt = make(0)
    ckpt.save(tmp_path, 5, model, opt, {})
    state = torch.load(tmp_path / "optim_step_5.pt", weights_only=True)
    assert set(state) == {"optimizer", "rng"} and set(state["rng"]) == {"torch", "cuda", "python", "numpy"}
    fresh = torch.optim.AdamW(make(1, train_steps=0)[0].parameters())
    fresh.load_state_dict(state["optimizer"])
    assert same_optimizer(opt, fresh)


def two_optimizers(model):
    """Muon's split, with SGD standing in for it: the matrices in one optimizer, the rest in
    another."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.SGD(matrices, lr=1e-2, momentum=0.9),
            torch.optim.AdamW(rest, lr=1e-2)]


def test_a_list_of_optimizers_round_trips_each_state(tmp_path):
    torch.manual_seed(0)
    a = TinyLM()
    opts_a = two_optimizers(a)
    for _ in range(2):
        for opt in opts_a:
            train_step(a, opt)
    ckpt.save(tmp_path, 2, a, opts_a, {})
    saved = torch.load(tmp_path / "optim_step_2.pt", weights_only=True)["optimizer"]
    assert [s["param_groups"][0]["lr"] for s in saved] == [1e-2, 1e-2] and len(saved) == 2
    assert "momentum_buffer" in saved[0]["state"][0] and "exp_avg" in saved[1]["state"][0]
    torch.manual_seed(1)
    b = TinyLM()
    opts_b = two_optimizers(b)
    ckpt.load(tmp_path, 2, b, opts_b)
    assert same_state(a, b)
    assert all(same_optimizer(x, y) for x, y in zip(opts_a, opts_b))
    for opt_a, opt_b in zip(opts_a, opts_b):
        train_step(a, opt_a)
        train_step(b, opt_b)
    assert same_state(a, b)
    # Another number of optimizers does not fit, and changes nothing.
    c, opt_c = make(2)
    before = {k: v.clone() for k, v in c.state_dict().items()}
    with pytest.raises(CheckpointError, match="holds the state of 2 optimizers, the run has 1"):
        ckpt.load(tmp_path, 2, c, opt_c)
    assert all(torch.equal(v, before[k]) for k, v in c.state_dict().items())
    # One optimizer and a list of one are the same checkpoint, in the format of one.
    ckpt.save(tmp_path, 3, c, [opt_c], {})
    saved = torch.load(tmp_path / "optim_step_3.pt", weights_only=True)["optimizer"]
    assert isinstance(saved, dict) and saved.keys() == opt_c.state_dict().keys()
    d, opt_d = make(3)
    ckpt.load(tmp_path, 3, d, opt_d)
    assert same_state(c, d) and same_optimizer(opt_c, opt_d)


def test_rng_states_are_restored_on_request(tmp_path):
    def draw():
        return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist(), np.random.randn()

    model, opt = make(0)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state, which must survive too
    ckpt.save(tmp_path, 1, model, opt, {})
    first = draw()
    ckpt.load(tmp_path, 1, model, opt)  # restore_rng=False: the streams go on
    assert draw() != first
    ckpt.load(tmp_path, 1, model, opt, restore_rng=True)
    assert draw() == first


@pytest.mark.smoke
def test_tied_weights_stay_tied_and_are_written_as_copies(tmp_path):
    a, opt_a = make(0)
    ckpt.save(tmp_path, 1, a, opt_a, {})
    on_disk = load_file(tmp_path / "model_step_1.safetensors")
    assert torch.equal(on_disk["emb.weight"], on_disk["head.weight"])

    b, opt_b = make(1)
    emb_ptr = b.emb.weight.data_ptr()
    ckpt.load(tmp_path, 1, b, opt_b)
    assert b.head.weight is b.emb.weight and b.emb.weight.data_ptr() == emb_ptr
    assert torch.equal(b.emb.weight, a.emb.weight)
    with torch.no_grad():
        b.emb.weight[0, 0] = 42.0
    assert b.head.weight[0, 0] == 42.0


def test_optimizer_none_saves_rng_only(tmp_path):
    model, _ = make(0)
    ckpt.save(tmp_path, 1, model, None, {})
    assert torch.load(tmp_path / "optim_step_1.pt", weights_only=True)["optimizer"] is None
    other, opt = make(1)
    ckpt.load(tmp_path, 1, other)
    assert same_state(model, other)
    with pytest.raises(CheckpointError, match="without optimizer state"):
        ckpt.load(tmp_path, 1, other, opt)


def test_resaving_a_step_replaces_it(tmp_path):
    model, opt = make(0)
    ckpt.save(tmp_path, 3, model, opt, {"v": 1})
    train_step(model, opt)
    ckpt.save(tmp_path, 3, model, opt, {"v": 2})
    assert files_in(tmp_path) == ["meta_step_3.json", "model_step_3.safetensors", "optim_step_3.pt"]
    other, opt2 = make(1)
    assert ckpt.load(tmp_path, 3, other, opt2)["v"] == 2
    assert same_state(model, other) and same_optimizer(opt, opt2)


def test_model_py_tiny_round_trip(tmp_path):
    model_py = pytest.importorskip("model")
    torch.manual_seed(0)
    a = model_py.Mamba3LM(model_py.PRESETS["tiny"])
    opt_a = torch.optim.AdamW(a.parameters())
    idx = torch.randint(0, a.config.vocab_size, (2, 16))
    _, loss = a(idx, idx)
    loss.backward()
    opt_a.step()
    ckpt.save(tmp_path, 1, a, opt_a, {})
    torch.manual_seed(1)
    b = model_py.Mamba3LM(model_py.PRESETS["tiny"])
    opt_b = torch.optim.AdamW(b.parameters())
    meta = ckpt.load(tmp_path, 1, b, opt_b)
    assert same_state(a, b) and same_optimizer(opt_a, opt_b)
    assert meta["model_config"] == json.loads(json.dumps(dataclasses.asdict(a.config)))
    with torch.no_grad():
        assert torch.equal(a(idx)[0], b(idx)[0])


# -----------------------------------------------------------------------------
# wrappers


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit
def test_compile_and_ddp_prefixes_never_reach_the_file(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain_keys = set(make(0, train_steps=0)[0].state_dict())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for i, wrap in enumerate([torch.compile, DDP, lambda m: torch.compile(DDP(m))]):
            model, opt = make(i)
            d = tmp_path / str(i)
            ckpt.save(d, 1, wrap(model), opt, {})
            assert set(load_file(d / "model_step_1.safetensors")) == plain_keys
            other, _ = make(10 + i)
            ckpt.load(d, 1, wrap(other))  # loading through a wrapper works as well
            assert same_state(model, other)
    finally:
        dist.destroy_process_group()


def test_a_submodule_called_module_is_not_a_wrapper(tmp_path):
    model = nn.Module()
    model.module = nn.Linear(2, 2)
    model.other = nn.Linear(2, 2)
    ckpt.save(tmp_path, 1, model, None, {})
    assert set(load_file(tmp_path / "model_step_1.safetensors")) == set(model.state_dict())
    assert "module.weight" in model.state_dict()


# -----------------------------------------------------------------------------
# what save refuses


@pytest.mark.parametrize("value, where", [
    ({1, 2}, "meta['x']"),
    (np.float32(1.5), "meta['x']"),
    (float("nan"), "meta['x']"),
    ({"a": [1, {2: "b"}]}, "meta['x']['a'][1]"),
    (torch.tensor(1.0), "meta['x']"),
])
def test_non_json_meta_is_refused_before_anything_is_written(tmp_path, value, where):
    model, opt = make(0)
    with pytest.raises(CheckpointError) as e:
        ckpt.save(tmp_path / "ck", 1, model, opt, {"x": value})
    assert where in str(e.value)
    assert not (tmp_path / "ck").exists()


def test_non_plain_optimizer_state_is_refused_before_anything_is_written(tmp_path):
    model, opt = make(0)
    opt.param_groups[0]["scheduler"] = object()
    with pytest.raises(CheckpointError, match="weights_only"):
        ckpt.save(tmp_path / "ck", 1, model, opt, {})
    assert not (tmp_path / "ck").exists()


# -----------------------------------------------------------------------------
# discovery and retention


def test_missing_and_empty_directories(tmp_path):
    model, opt = make(0)
    for d in (tmp_path / "nope", tmp_path):
        assert ckpt.list_steps(d) == [] and ckpt.latest_step(d) is None
        assert ckpt.load_latest(d, model, opt) == (None, None)
        with pytest.raises(CheckpointError, match="steps there: none"):
            ckpt.load(d, 1, model, opt)


@pytest.mark.smoke
def test_missing_step_lists_the_steps_that_exist(tmp_path):
    model, opt = make(0)
    for step in (2, 1):
        ckpt.save(tmp_path, step, model, opt, {})
    for read in (lambda: ckpt.load(tmp_path, 5, model, opt), lambda: ckpt.read_meta(tmp_path, 5)):
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 .*steps there: \[1, 2\]"):
            read()


def test_read_meta_reads_without_loading(tmp_path):
    a, opt_a = make(0)
    ckpt.save(tmp_path, 4, a, opt_a, {"tokenizer": {"name": "byte"}})
    b, opt_b = make(1)
    meta = ckpt.read_meta(tmp_path, 4)
    assert meta["tokenizer"] == {"name": "byte"} and meta["model_config"]["dim"] == 8
    assert not same_state(a, b)
    assert ckpt.load(tmp_path, 4, b, opt_b) == meta
    (tmp_path / "optim_step_4.pt").unlink()
    with pytest.raises(CheckpointError, match="optim_step_4.pt is missing"):
        ckpt.read_meta(tmp_path, 4)


def test_retention_sorts_by_step_number(tmp_path):
    model, opt = make(0)
    for step in (9, 10, 100):
        ckpt.save(tmp_path, step, model, opt, {}, keep_last=2)
    assert ckpt.list_steps(tmp_path) == [10, 100]
    assert len(files_in(tmp_path)) == 6


@pytest.mark.smoke
def test_retention_keeps_the_step_just_written_and_damaged_steps(tmp_path):
    model, opt = make(0)
    for step in (1, 50, 60):
        ckpt.save(tmp_path, step, model, opt, {})
    with open(tmp_path / "optim_step_1.pt", "r+b") as f:
        f.truncate(100)  # step 1 no longer counts, so retention must not touch it
    with pytest.warns(UserWarning, match="optim_step_1.pt has 100 bytes"):
        ckpt.save(tmp_path, 5, model, opt, {}, keep_last=1)
    assert ckpt.list_steps(tmp_path) == [5, 60]
    assert {"meta_step_1.json", "model_step_1.safetensors", "optim_step_1.pt"} <= set(files_in(tmp_path))


def test_partial_triples_and_tmp_files_are_ignored(tmp_path):
    model, opt = make(0)
    src = tmp_path / "src"
    for step in (3, 7):
        ckpt.save(src, step, model, opt, {})
    names = ckpt._names(7)
    subsets = [[n] for n in names] + [[a, b] for i, a in enumerate(names) for b in names[i + 1:]]
    for i, keep in enumerate(subsets):
        d = tmp_path / f"case{i}"
        d.mkdir()
        for name in ckpt._names(3) + tuple(keep):
            shutil.copy(src / name, d / name)
        for name in names:  # what a save killed before its renames leaves behind
            shutil.copy(src / name, d / f".{name}.999999.tmp")
        with pytest.warns(UserWarning, match="step 7 .* is incomplete"):
            assert ckpt.list_steps(d) == [3]
        assert ckpt.latest_step(d) == 3
        with pytest.raises(CheckpointError, match="step 7 .* is incomplete"):
            ckpt.load(d, 7, model, opt)
        assert ckpt.load_latest(d, model, opt)[0] == 3


def test_an_incomplete_step_is_reported_once(tmp_path):
    model, opt = make(0)
    ckpt.save(tmp_path, 1, model, opt, {})
    (tmp_path / "model_step_1.safetensors").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert ckpt.list_steps(tmp_path) == []
    assert len(caught) == 1 and "model_step_1.safetensors is missing" in str(caught[0].message)


def test_leftover_tmp_files_are_removed_by_the_next_save(tmp_path):
    # what killed saves leave: one writer per directory, so every temporary file of a step is a leftover
    stale = [tmp_path / ".optim_step_4.pt.tmp", tmp_path / ".model_step_4.safetensors.12345.tmp"]
    other = [tmp_path / ".notes.tmp", tmp_path / "optim_step_4.pt.tmp"]  # not ckpt's temporary names
    for p in stale + other:
        p.write_bytes(b"x")
    model, opt = make(0)
    ckpt.save(tmp_path, 5, model, opt, {})
    assert not any(p.exists() for p in stale) and all(p.exists() for p in other)


# -----------------------------------------------------------------------------
# damage


def flip_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["model_step_2.safetensors", "optim_step_2.pt"])
@pytest.mark.parametrize("damage", [flip_bit, truncate])
def test_damage_is_detected_and_load_latest_falls_back(tmp_path, name, damage):
    good, opt_good = make(0)
    ckpt.save(tmp_path, 1, good, opt_good, {})
    newer, opt_newer = make(1)
    ckpt.save(tmp_path, 2, newer, opt_newer, {})
    damage(tmp_path / name)

    model, opt = make(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if damage is truncate:  # sizes are checked by discovery
        with pytest.warns(UserWarning, match=f"step 2 .* {name} has"):
            assert ckpt.latest_step(tmp_path) == 1
    else:  # a flipped bit keeps the size: discovery lists the step, load's hash check refuses it
        assert ckpt.latest_step(tmp_path) == 2
    with pytest.raises(CheckpointError, match=f"step 2.*{name}|{name}.*step 2"):
        ckpt.load(tmp_path, 2, model, opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step, _ = ckpt.load_latest(tmp_path, model, opt)
    assert step == 1 and same_state(good, model) and same_optimizer(opt_good, opt)
    assert (tmp_path / name).exists()  # never deleted


def test_bit_flip_fallback_warns(tmp_path):
    model, opt = make(0)
    for step in (1, 2):
        ckpt.save(tmp_path, step, model, opt, {})
    flip_bit(tmp_path / "model_step_2.safetensors")
    assert ckpt.read_meta(tmp_path, 2)["step"] == 2  # sizes only
    with pytest.raises(ckpt.CorruptCheckpoint, match="model_step_2.safetensors is corrupt"):
        ckpt.read_meta(tmp_path, 2, verify=True)
    with pytest.warns(UserWarning, match="model_step_2.safetensors is corrupt"):
        assert ckpt.load_latest(tmp_path, model, opt)[0] == 1


def test_unreadable_meta_is_skipped(tmp_path):
    model, opt = make(0)
    for step in (1, 2):
        ckpt.save(tmp_path, step, model, opt, {})
    (tmp_path / "meta_step_2.json").write_text('{"step": 2, "fil')
    with pytest.warns(UserWarning, match="meta_step_2.json is not a valid meta file"):
        assert ckpt.list_steps(tmp_path) == [1]


def test_a_meta_without_a_files_sha256_is_refused_as_invalid_not_a_key_error(tmp_path):
    model, opt = make(0)
    ckpt.save(tmp_path, 1, model, opt, {})
    meta = json.loads((tmp_path / "meta_step_1.json").read_text())
    del meta["files"]["model_step_1.safetensors"]["sha256"]  # a hand-edited meta: sizes still agree
    (tmp_path / "meta_step_1.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="meta_step_1.json is not a valid meta file"):
        ckpt.load(tmp_path, 1, model, opt)


# -----------------------------------------------------------------------------
# loading into a different model


def test_config_mismatch_is_an_error_unless_not_strict(tmp_path):
    a, opt_a = make(0)
    ckpt.save(tmp_path, 1, a, opt_a, {})
    b, opt_b = make(1, TinyConfig(dropout=0.1))
    with pytest.raises(CheckpointError, match=r"dropout: checkpoint 0\.0, model 0\.1") as e:
        ckpt.load(tmp_path, 1, b, opt_b)
    assert "vocab" not in str(e.value) and "sizes" not in str(e.value)
    with pytest.warns(UserWarning, match="dropout"):
        ckpt.load(tmp_path, 1, b, opt_b, strict=False)
    assert same_state(a, b)


def test_key_mismatch_lists_missing_and_unexpected_keys(tmp_path):
    a, opt_a = make(0)
    ckpt.save(tmp_path, 1, a, opt_a, {})
    b, _ = make(1)
    b.register_buffer("extra", torch.zeros(2))
    del b.mask
    with pytest.raises(CheckpointError, match="extra: not in the checkpoint; mask: not in the model"):
        ckpt.load(tmp_path, 1, b)
    ckpt.load(tmp_path, 1, b, strict=False)  # the keys both have
    assert torch.equal(b.emb.weight, a.emb.weight) and torch.equal(b.extra, torch.zeros(2))


def test_shape_mismatch_is_always_an_error(tmp_path):
    a, opt_a = make(0)
    ckpt.save(tmp_path, 1, a, opt_a, {})
    b, _ = make(1, TinyConfig(dim=4))
    with pytest.raises(CheckpointError, match="dim: checkpoint 8, model 4"):
        ckpt.load(tmp_path, 1, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"shape of emb.weight: checkpoint \[17, 8\], model \[17, 4\]"):
            ckpt.load(tmp_path, 1, b, strict=False)


# -----------------------------------------------------------------------------
# fault injection


def _saver(d, committed):
    """Child: resume from the newest checkpoint, then train-and-save forever (until SIGKILLed)."""
    torch.set_num_threads(1)
    model, opt = make(0, train_steps=0)
    step, _ = ckpt.load_latest(d, model, opt)
    step = step or 0
    while True:
        step += 1
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # AdamW counts its steps: a resume that lost or repeated one would show
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)  # the weights say which step they belong to
        ckpt.save(d, step, model, opt, {"saved_at": step}, keep_last=2)
        committed.send(step)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the partial steps that kills leave behind
def test_sigkill_at_random_instants_never_leaves_an_unloadable_latest_step(tmp_path):
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    model, opt = make(1, train_steps=0)
    previous = None
    for kill in range(24):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_saver, args=(tmp_path, send), daemon=True)
        child.start()
        # The first kills may come before anything is committed; later ones after one more commit,
        # so the run makes progress, then anywhere in the next few saves.
        if kill >= 4:
            assert receive.poll(60), "the child committed nothing in 60 s"
        time.sleep(rng.uniform(0, 0.03))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, f"the child died on its own (exit code {child.exitcode})"

        latest = ckpt.latest_step(tmp_path)
        if latest is None:
            assert previous is None, f"step {previous} vanished"
        else:
            assert previous is None or latest >= previous
            meta = ckpt.load(tmp_path, latest, model, opt)
            assert meta["saved_at"] == latest
            assert all(torch.all(p == latest) for p in model.parameters())
            assert all(s["step"].item() == latest for s in opt.state.values())
        previous = latest
    assert previous is not None and previous >= 20


# -----------------------------------------------------------------------------
# the edges: interrupted retention, corrupt steps under retention, malformed files, failed writes


def test_an_interrupted_retention_leaves_orphans_the_next_save_removes(tmp_path):
    model, opt = make(0)
    for step in (1, 2):
        ckpt.save(tmp_path, step, model, opt, {})
    (tmp_path / "meta_step_1.json").unlink()  # retention deletes the meta first; killed right after
    with pytest.warns(UserWarning, match="step 1 .* is incomplete"):
        assert ckpt.list_steps(tmp_path) == [2]
    ckpt.save(tmp_path, 3, model, opt, {})
    assert files_in(tmp_path) == sorted(ckpt._names(2) + ckpt._names(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left to warn about
        assert ckpt.list_steps(tmp_path) == [2, 3]


def test_retention_never_deletes_a_step_that_fails_verification(tmp_path):
    model, opt = make(0)
    for step in (1, 2):
        ckpt.save(tmp_path, step, model, opt, {})
    flip_bit(tmp_path / "model_step_1.safetensors")  # same size: only its hash can tell
    ckpt._written.clear()  # as in a later process, which did not write steps 1 and 2 itself
    with pytest.warns(UserWarning, match="retention keeps checkpoint step 1: .* is corrupt"):
        ckpt.save(tmp_path, 3, model, opt, {}, keep_last=1)
    assert ckpt.list_steps(tmp_path) == [1, 3]  # 2 verified and was deleted; 1 is kept for a human to look at


@pytest.mark.parametrize("name", ["model_step_2.safetensors", "optim_step_2.pt"])
def test_a_malformed_file_whose_hash_matches_falls_back(tmp_path, name):
    good, opt_good = make(0)
    ckpt.save(tmp_path, 1, good, opt_good, {})
    ckpt.save(tmp_path, 2, *make(1), {})
    (tmp_path / name).write_bytes(b"not a checkpoint at all")
    meta = json.loads((tmp_path / "meta_step_2.json").read_text())
    meta["files"][name] = {"bytes": 23, "sha256": sha256(tmp_path / name)}
    (tmp_path / "meta_step_2.json").write_text(json.dumps(meta))
    model, opt = make(2)
    with pytest.raises(ckpt.CorruptCheckpoint, match=f"{name} matches its sha256 but"):
        ckpt.load(tmp_path, 2, model, opt)
    with pytest.warns(UserWarning, match="trying an earlier step"):
        assert ckpt.load_latest(tmp_path, model, opt)[0] == 1
    assert same_state(model, good) and same_optimizer(opt, opt_good)


def test_a_failed_write_is_a_clear_error_and_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    model, opt = make(0)
    ckpt.save(tmp_path, 1, model, opt, {})
    before = {n: (tmp_path / n).read_bytes() for n in files_in(tmp_path)}

    def disk_full(obj, path, *args, **kwargs):
        open(path, "wb").write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint step 2 in .* GB free there.*untouched"):
        ckpt.save(tmp_path, 2, model, opt, {})
    assert {n: (tmp_path / n).read_bytes() for n in files_in(tmp_path)} == before


def test_one_writer_per_directory(tmp_path):
    with ckpt.lock(tmp_path / "ck"):
        with pytest.raises(CheckpointError, match=rf"in use by another run \(PID {os.getpid()} on "):
            ckpt.lock(tmp_path / "ck")
    ckpt.lock(tmp_path / "ck").close()  # closing the first released it
