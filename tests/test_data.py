"""data.py: every token source kind, windows, order, ranks, resume, blending, validation, errors."""
import json
import struct

import numpy as np
import pytest
import torch

import data
from data import (BatchConfig, Batches, DataError, NoSplit, check_vocab, open_blend, open_tokens,
                  val_batches)

L = 7  # a small seq_len makes many windows out of small files


# -----------------------------------------------------------------------------
# writing every source kind by hand, from the formats' specs (data.py's docstrings)


def write_manifest_dir(d, splits_tokens, dtype="uint16", vocab_size=60000, eos_id=0,
                       shard_sizes=(100, 37, 250)):
    """A prepare.py-style directory; each split's stream cut into shards of the given sizes
    (cycled)."""
    d.mkdir(parents=True, exist_ok=True)
    manifest = {"format": data.MANIFEST_FORMAT, "version": data.MANIFEST_VERSION, "dtype": dtype,
                "vocab_size": vocab_size, "eos_id": eos_id, "tokenizer": {"name": "byte"},
                "splits": {}}
    for split, stream in splits_tokens.items():
        shards, i, k = [], 0, 0
        while i < len(stream):
            part = np.asarray(stream[i : i + shard_sizes[k % len(shard_sizes)]], dtype=dtype)
            name = f"{split}_{k:05d}.bin"
            part.tofile(d / name)
            shards.append({"file": name, "tokens": len(part), "documents": 1,
                           "max_token_id": int(part.max()), "sha256": "not checked by data.py"})
            i, k = i + len(part), k + 1
        manifest["splits"][split] = {"tokens": len(stream), "documents": len(shards),
                                     "max_token_id": int(max(stream)), "shards": shards}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix, sequences, dtype, docs=None):
    """PREFIX.bin + PREFIX.idx as Megatron-LM writes them: header, int32 lengths, int64 byte
    pointers, int64 doc starts."""
    dtype = np.dtype(dtype)
    lengths = np.array([len(s) for s in sequences], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * dtype.itemsize
    docs = np.arange(len(sequences) + 1) if docs is None else np.asarray(docs)
    docs = docs.astype(np.int64)
    with open(str(prefix) + ".idx", "wb") as f:
        header = struct.pack("<QBQQ", 1, MEGATRON_CODES[dtype.type], len(sequences), len(docs))
        f.write(b"MMIDIDX\x00\x00" + header)
        f.write(lengths.tobytes() + pointers.tobytes() + docs.tobytes())
    np.concatenate([np.asarray(s, dtype) for s in sequences]).tofile(str(prefix) + ".bin")
    return prefix


def stream_of(n, seed=0, high=60000):
    """n tokens whose windows are all distinct, so a window can be recognised by its tokens."""
    return np.random.default_rng(seed).permutation(high)[:n].astype(np.int64) if n <= high else None


def make_source(kind, tmp_path, n=500):
    """(source, the token stream it must read as)."""
    s = stream_of(n)
    if kind == "manifest":
        return open_tokens(write_manifest_dir(tmp_path / "m", {"train": s, "val": s[:50]})), s
    if kind == "raw":
        s.astype(np.uint16).tofile(tmp_path / "train.bin")
        return open_tokens(tmp_path / "train.bin"), s
    if kind == "raw_uint32":
        s32 = s + 70000  # beyond uint16, so a wrong dtype could not pass
        s32.astype(np.uint32).tofile(tmp_path / "tok.u32")
        return open_tokens(tmp_path / "tok.u32", dtype="uint32"), s32
    if kind == "nanogpt_dir":
        s.astype(np.uint16).tofile(tmp_path / "train.bin")
        s[:60].astype(np.uint16).tofile(tmp_path / "val.bin")
        return open_tokens(tmp_path), s
    if kind == "shard_dir":
        d = tmp_path / "shards"
        d.mkdir()
        cuts = [0, 9, 10, 10, 130, 131, 300, n]  # includes a 1-token and an empty shard
        for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
            s[a:b].astype(np.uint16).tofile(d / f"shard_{k}.bin")
        return open_tokens(d), s
    if kind.startswith("megatron"):
        dtype = np.uint16 if kind == "megatron_uint16" else np.int32
        rng = np.random.default_rng(1)
        cuts = np.sort(rng.choice(np.arange(1, n), 40, replace=False))
        seqs = np.split(s, cuts)
        return open_tokens(write_megatron(tmp_path / "mega", seqs, dtype)), s
    raise ValueError(kind)


KINDS = ["manifest", "raw", "raw_uint32", "nanogpt_dir", "shard_dir", "megatron_uint16",
         "megatron_int32"]


def window_index(stream):
    return {tuple(stream[i * L : i * L + L]): i for i in range((len(stream) - 1) // L)}


def batches(sources, seq_len, micro_batch, global_batch, weights=None, **cfg):
    """Batches with these settings (the rest of BatchConfig's fields by keyword)."""
    return Batches(sources, BatchConfig(seq_len, micro_batch, global_batch, **cfg), weights)


def take(batches, n):
    return [next(batches) for _ in range(n)]


# -----------------------------------------------------------------------------
# sources and windows


@pytest.mark.smoke
@pytest.mark.parametrize("kind", KINDS)
def test_windows_on_every_source_kind(kind, tmp_path):
    source, s = make_source(kind, tmp_path)
    assert source.num_tokens == len(s)
    W = (len(s) - 1) // L
    # Slow, obviously correct twin: slicing the stream.
    want = np.stack([s[i * L : i * L + L + 1] for i in range(W)])
    np.testing.assert_array_equal(source.windows(np.arange(W), L), want)
    # One epoch of Batches visits every window exactly once, including the last (complete) one.
    b = Batches(source, BatchConfig(L, micro_batch=1, global_batch=1, seed=3))
    index = window_index(s)
    seen = []
    for x, y in take(b, W):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (1, L)
        assert torch.equal(x[:, 1:], y[:, :-1])
        i = index[tuple(x[0].tolist())]
        np.testing.assert_array_equal(y[0].numpy(), s[i * L + 1 : i * L + L + 1])
        seen.append(i)
    assert sorted(seen) == list(range(W))


@pytest.mark.smoke
@pytest.mark.parametrize("kind", ["manifest", "shard_dir", "megatron_int32"])
def test_reads_spanning_files_equal_the_stream(kind, tmp_path):
    source, s = make_source(kind, tmp_path)
    for start in range(0, len(s), 3):
        for n in (0, 1, 2, 9, 40, 131):
            if start + n <= len(s):
                got = source.read(start, n)
                assert got.dtype == source.dtype
                np.testing.assert_array_equal(got, s[start : start + n])
    first = source.files[0]
    inside = source.read(1, 3)
    assert not inside.flags.owndata  # a view of the memory map, not a copy
    assert np.shares_memory(inside, source.tokens[0]) and first.exists()
    with pytest.raises(IndexError):
        source.read(len(s) - 2, 3)


def test_raw_dtype_and_split_rules(tmp_path):
    s = stream_of(100)
    s.astype(np.uint16).tofile(tmp_path / "train.bin")
    assert open_tokens(tmp_path / "train.bin").dtype == np.uint16
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"odd.bin: expected a whole number of uint32 tokens.*found "
                                        r"3 bytes"):
        open_tokens(tmp_path / "odd.bin", dtype="uint32")
    with pytest.raises(NoSplit, match="one token stream"):
        open_tokens(tmp_path / "train.bin", split="val")
    assert open_blend([str(tmp_path / "train.bin")], vocab_size=1 << 16)[2] is None  # no validation
    assert open_tokens(tmp_path).num_tokens == 100  # a nanoGPT directory without val.bin
    with pytest.raises(NoSplit, match="val.bin"):
        open_tokens(tmp_path, split="val")
    assert open_blend([str(tmp_path)], vocab_size=1 << 16)[2] is None


def test_manifest_splits_and_metadata(tmp_path):
    s = stream_of(300)
    d = write_manifest_dir(tmp_path / "m", {"train": s, "val": s[:40]}, vocab_size=60000, eos_id=5)
    train, val = open_tokens(d), open_tokens(d, "val")
    assert (train.num_tokens, val.num_tokens) == (300, 40)
    assert (train.vocab_size, train.eos_id, train.tokenizer) == (60000, 5, {"name": "byte"})
    assert train.id_range() == (0, int(s.max())) and val.id_range() == (0, int(s[:40].max()))
    assert open_blend([str(d)])[2].num_tokens == 40  # the val split is what train.py evaluates on


def test_a_source_starts_at_a_byte_offset(tmp_path):
    # A format whose files begin with a header (llm.c's .bin: 256 int32, magic 20240520,
    # version 1, token count, then uint16 tokens) maps each file from where its tokens begin.
    s = stream_of(300)
    files = []
    for k, (a, b) in enumerate([(0, 120), (120, 120), (120, 300)]):
        header = np.zeros(256, np.int32)
        header[:3] = 20240520, 1, b - a
        files.append(tmp_path / f"part_{k}.bin")
        files[-1].write_bytes(header.tobytes() + s[a:b].astype(np.uint16).tobytes())
    source = data.TokenSource(tmp_path, files, np.uint16, offset=1024)
    # The header-only file adds no tokens, and no header is read as tokens.
    assert source.num_tokens == 300 and source.files == [files[0], files[2]]
    assert source.id_range() == (int(s.min()), int(s.max()))
    np.testing.assert_array_equal(source.read(0, 300), s)
    np.testing.assert_array_equal(source.read(110, 20), s[110:130])
    W = (len(s) - 1) // L
    want = np.stack([s[i * L : i * L + L + 1] for i in range(W)])
    np.testing.assert_array_equal(source.windows(np.arange(W), L), want)
    # One file: the windows are rows of its one memory map.
    one = data.TokenSource(files[0], files[:1], np.uint16, offset=1024)
    np.testing.assert_array_equal(one.windows(np.arange(10), L), want[:10])
    x, y = next(Batches(source, BatchConfig(L, micro_batch=2, seed=1)))
    assert tuple(x[0].tolist()) in window_index(s)
    (tmp_path / "odd.bin").write_bytes(bytes(1024) + b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"odd.bin: expected a whole number of uint16 tokens "
                                        r"\(2 bytes each\), found 3 bytes after its 1024-byte "
                                        r"header; wrong --data-dtype"):
        data.TokenSource(tmp_path, [tmp_path / "odd.bin"], np.uint16, offset=1024)
    (tmp_path / "short.bin").write_bytes(bytes(100))
    with pytest.raises(DataError, match=r"short.bin: expected a 1024-byte header at least, found "
                                        r"100 bytes"):
        data.TokenSource(tmp_path, [tmp_path / "short.bin"], np.uint16, offset=1024)


def test_the_formats_are_listed_once(tmp_path):
    # Messages (and train.py's help) list the formats from the one table, FORMAT_OPENERS.
    whats = [fmt.what for fmt in data.FORMAT_OPENERS]
    assert data.FORMATS == ", ".join(whats[:-1]) + ", or " + whats[-1]
    with pytest.raises(DataError) as e:
        open_tokens(tmp_path / "nope")
    missing = f"{tmp_path / 'nope'}: no such file or directory"
    assert str(e.value) == f"{missing}; expected {data.FORMATS}"


# -----------------------------------------------------------------------------
# bad input: each one a DataError naming the file


def test_missing_and_unknown_paths_name_the_formats(tmp_path):
    with pytest.raises(DataError, match=r"nope.*no such file.*Megatron"):
        open_tokens(tmp_path / "nope")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "readme.txt").write_text("hi")
    with pytest.raises(DataError, match=r"junk.*readme.txt"):
        open_tokens(tmp_path / "junk")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train_00000.bin").write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match="interrupted prepare.py"):
        open_tokens(tmp_path / "half")


@pytest.mark.smoke
def test_manifest_errors(tmp_path):
    s = stream_of(300)
    d = write_manifest_dir(tmp_path / "m", {"train": s})
    with pytest.raises(NoSplit, match=r"'val' split.*--val-fraction 0"):
        open_tokens(d, "val")
    with pytest.raises(DataError, match="dtype"):
        open_tokens(d, dtype="uint32")
    shard = d / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # one token short
    with pytest.raises(DataError, match=r"train_00001.bin: expected 74 bytes.*found 72"):
        open_tokens(d)
    shard.unlink()
    with pytest.raises(DataError, match=r"train_00001.bin: listed in manifest.json but missing"):
        open_tokens(d)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"manifest.json: expected a JSON manifest"):
        open_tokens(d)
    (d / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match=r"expected format 'mamba3-lite-tokens', found 'other'"):
        open_tokens(d)
    m = json.loads((write_manifest_dir(tmp_path / "n", {"train": s}) / "manifest.json").read_text())
    train, shard = m["splits"]["train"], m["splits"]["train"]["shards"][0]
    for bad, message in [
            ({**m, "splits": []}, "expected splits to be an object, found []"),
            ({**m, "vocab_size": None},
             "expected vocab_size to be a whole number >= 1, found null"),
            ({**m, "dtype": "int8"}, 'expected dtype to be "uint16" or "uint32", found "int8"'),
            ({k: v for k, v in m.items() if k != "eos_id"}, "expected eos_id to be a whole number "
             ">= 0, found no such field"),
            ({**m, "splits": {"train": {**train, "shards": None}}},
             "expected splits.train.shards to be a list, found null"),
            ({**m, "splits": {"train": {**train, "tokens": 1.5}}},
             "expected splits.train.tokens to be a whole number >= 0, found 1.5"),
            ({**m, "splits": {"train": {**train, "shards": [{**shard, "tokens": "100"}]}}},
             'expected splits.train.shards[0].tokens to be a whole number >= 0, found "100"'),
            ({**m, "splits": {"train": {**train, "shards": [{**shard, "file": "../x.bin"}]}}},
             'expected splits.train.shards[0].file to be a file name, found "../x.bin"')]:
        # hand-edited: one message naming the field and what it holds
        (d / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(DataError) as e:
            open_tokens(d)
        assert str(e.value).startswith(f"{d / 'manifest.json'}: {message}; prepare.py writes")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_back_exactly(dtype, tmp_path):
    rng = np.random.default_rng(7)
    # many documents, some empty
    seqs = [rng.integers(0, 30000, rng.integers(0, 50)) for _ in range(300)]
    docs = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 300), 99, replace=False)), [300]])
    source = open_tokens(write_megatron(tmp_path / "ds", seqs, dtype, docs))
    assert source.dtype == np.dtype(dtype)
    stream = np.concatenate(seqs)
    np.testing.assert_array_equal(source.read(0, source.num_tokens), stream)
    for name in ("ds.bin", "ds.idx"):  # the prefix, or either file of the pair
        assert open_tokens(tmp_path / name).num_tokens == len(stream)


def megatron_variants(tmp_path):
    """(what is broken, prefix, the file the message must name, a fragment of the message)."""
    seqs = [np.arange(i, i + 5 + i % 3) for i in range(20)]
    out = []

    def fresh(name):
        return write_megatron(tmp_path / name, seqs, np.uint16)

    p = fresh("magic")
    raw = bytearray(open(str(p) + ".idx", "rb").read())
    raw[0:4] = b"XXXX"
    open(str(p) + ".idx", "wb").write(raw)
    out.append(("bad magic", p, "magic.idx", "magic"))

    p = fresh("size")
    open(str(p) + ".idx", "ab").write(b"\x00" * 8)
    out.append(("wrong size", p, "size.idx", "expected 442 bytes"))

    p = fresh("pointers")
    raw = bytearray(open(str(p) + ".idx", "rb").read())
    o = 34 + 4 * 20 + 8 * 5  # pointer of sequence 5
    raw[o : o + 8] = struct.pack("<q", 2)
    open(str(p) + ".idx", "wb").write(raw)
    out.append(("non-monotonic pointers", p, "pointers.idx", "increasing pointers"))

    p = fresh("truncated")
    b = open(str(p) + ".bin", "rb").read()
    open(str(p) + ".bin", "wb").write(b[:-10])
    out.append(("truncated .bin", p, "truncated.bin", "truncated"))

    p = fresh("version")
    raw = bytearray(open(str(p) + ".idx", "rb").read())
    raw[9:17] = struct.pack("<Q", 2)
    open(str(p) + ".idx", "wb").write(raw)
    out.append(("version", p, "version.idx", "expected version 1"))

    p = fresh("code")
    raw = bytearray(open(str(p) + ".idx", "rb").read())
    raw[17] = 6  # float64: not token ids
    open(str(p) + ".idx", "wb").write(raw)
    out.append(("dtype code", p, "code.idx", "dtype code"))

    p = fresh("docs")
    raw = bytearray(open(str(p) + ".idx", "rb").read())
    raw[-8:] = struct.pack("<q", 19)  # documents must end at the sequence count
    open(str(p) + ".idx", "wb").write(raw)
    out.append(("document boundaries", p, "docs.idx", "document boundaries"))

    p = fresh("empty")
    open(str(p) + ".idx", "wb").close()
    out.append(("an empty .idx", p, "empty.idx", "found 0 bytes"))
    return out


def test_each_corrupted_megatron_variant_is_a_clear_error(tmp_path):
    variants = megatron_variants(tmp_path)
    assert len(variants) == 8
    for what, prefix, file, fragment in variants:
        with pytest.raises(DataError) as e:
            open_tokens(prefix)
        message = str(e.value)
        assert file in message and fragment in message, (what, message)


def test_check_vocab(tmp_path):
    s = stream_of(300)
    d = write_manifest_dir(tmp_path / "m", {"train": s}, vocab_size=60000)
    source = open_tokens(d)
    check_vocab(source, int(s.max()) + 1)  # exactly fits
    top = int(s.max())
    with pytest.raises(DataError, match=rf"m: expected token ids in \[0, {top}\).*found {top}"):
        check_vocab(source, int(s.max()))
    # A raw source has no manifest: its max comes from a scan of the files.
    np.array([3, 9, 4000, 2], np.uint16).tofile(tmp_path / "r.bin")
    raw = open_tokens(tmp_path / "r.bin")
    assert raw.id_range() == (2, 4000)
    with pytest.raises(DataError, match="found 4000"):
        check_vocab(raw, 4000)
    # Signed Megatron tokens can be negative, which no vocabulary holds.
    src = open_tokens(write_megatron(tmp_path / "neg", [np.array([1, -3, 2])], np.int32))
    with pytest.raises(DataError, match="found -3"):
        check_vocab(src, 100)


# -----------------------------------------------------------------------------
# order, ranks, resume


def windows_of(batches_list, index):
    return [index[tuple(row)] for x, _ in batches_list for row in x.tolist()]


def test_a_changed_shard_is_caught_past_4g_tokens(tmp_path):
    # Batches passes uint32 window ids; the file a window starts in must be found without wrapping
    # at 2**32
    with open(tmp_path / "a.bin", "wb") as f:
        f.truncate(1 << 32)  # 2**32 uint8 zeros, a sparse file: no disk used
    # 200: edited after the manifest said max 9
    np.array([1, 2, 3, 200, 5], np.uint8).tofile(tmp_path / "b.bin")
    source = data.TokenSource(tmp_path, [tmp_path / "a.bin", tmp_path / "b.bin"], np.uint8,
                              max_token_id=9)
    check_vocab(source, 100)
    source.unchecked.discard(0)  # as if a.bin were checked already: a 4 GiB scan takes seconds
    with pytest.raises(DataError, match=r"b.bin: token id 200 at token offset 3"):
        source.windows(np.array([(1 << 32) // 4], np.uint32), 4)


def test_order_is_a_function_of_seed_and_epoch(tmp_path):
    source, s = make_source("raw", tmp_path, n=300)
    W, index = (len(s) - 1) // L, window_index(s)
    def run(seed):
        return windows_of(take(batches(source, L, 1, 1, seed=seed), 3 * W), index)

    a = run(0)
    assert a == run(0)
    epochs = [a[e * W : (e + 1) * W] for e in range(3)]
    assert all(sorted(e) == list(range(W)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert run(1)[:W] != epochs[0]


def test_one_step_sees_the_same_samples_for_any_world_size_and_micro_batch(tmp_path):
    source, s = make_source("shard_dir", tmp_path, n=500)
    index, G = window_index(s), 8

    def step_windows(world_size, micro_batch, steps=4):
        ranks = [batches(source, L, micro_batch, G, rank=r, world_size=world_size, seed=5)
                 for r in range(world_size)]
        accum = G // (micro_batch * world_size)
        assert ranks[0].accum_steps == accum
        out = []
        for _ in range(steps):
            # in global-sample order: micro-step m, then rank r
            out.append([w for _ in range(accum) for b in ranks
                        for w in windows_of([next(b)], index)])
        return out

    reference = step_windows(1, 8)
    for world_size, micro_batch in [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]:
        assert step_windows(world_size, micro_batch) == reference, (world_size, micro_batch)


def test_indivisible_global_batch_is_refused(tmp_path):
    source, _ = make_source("raw", tmp_path)
    with pytest.raises(DataError) as e:
        batches(source, L, micro_batch=2, global_batch=10, world_size=4)
    assert str(e.value) == ("global batch 10 sequences (--total-batch-size 70 / --seq-len 7) is "
                            "not a multiple of micro_batch 2 (--batch-size) x world_size 4 = 8; "
                            "pick sizes where it is, for example --total-batch-size 56 (8 "
                            "sequences)")
    with pytest.raises(DataError, match="seq_len"):
        batches(source, 10_000, 1, 1)


@pytest.mark.smoke
@pytest.mark.parametrize("prefetch", [False, True])
def test_mid_epoch_resume_continues_identically(prefetch, tmp_path):
    source, s = make_source("manifest", tmp_path, n=500)
    index, G = window_index(s), 6
    full = batches(source, L, 3, G, seed=9)
    reference = windows_of(take(full, 40), index)  # 120 samples: crosses the epoch boundary at 71

    first = batches(source, L, 3, G, seed=9, prefetch=prefetch)
    got = windows_of(take(first, 10), index)  # 5 optimizer steps
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state["consumed"] == 30 and state["source_consumed"] == [30]
    first.close()
    second = batches(source, L, 3, G, seed=9, prefetch=prefetch)
    second.load_state_dict(state)
    got += windows_of(take(second, 30), index)
    second.close()
    assert got == reference

    # Elastic: resume the same state on 2 ranks with micro batch 1 (accum 3): the same samples.
    ranks = [batches(source, L, 1, G, rank=r, world_size=2, seed=9) for r in range(2)]
    for b in ranks:
        b.load_state_dict(state)
    elastic = [w for _ in range(3 * 10) for b in ranks for w in windows_of([next(b)], index)]
    assert elastic == reference[30:90]


def test_state_mismatch_is_a_clear_error(tmp_path):
    source, _ = make_source("raw", tmp_path)
    b = batches(source, L, 2, 4, seed=1)
    take(b, 3)
    state = b.state_dict()
    with pytest.raises(DataError, match="global_batch = 4, but this run has global_batch = 8"):
        batches(source, L, 2, 8, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed = 1, but this run has seed = 2"):
        batches(source, L, 2, 4, seed=2).load_state_dict(state)


def test_prefetch_state_is_what_the_consumer_took(tmp_path):
    source, _ = make_source("raw", tmp_path)
    b = batches(source, L, 2, 4, prefetch=True)
    plain = batches(source, L, 2, 4)
    for i in range(1, 6):
        x, _ = next(b)
        assert torch.equal(x, next(plain)[0])
        assert b.state_dict()["consumed"] == 2 * i
    b.close()


# -----------------------------------------------------------------------------
# blending


# The last weights defeat the simpler rule "largest deficit first", which strays more than one
# sample.
@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1, 2], [0.61, 0.13, 0.2, 0.06],
                                     [0.01, 0.7, 0.03, 0.03, 0.79]])
def test_blend_tracks_the_weights_on_every_prefix(weights, tmp_path):
    sources = []
    for k in range(len(weights)):  # disjoint token ranges: a sample's tokens name its source
        (np.arange(100 + 13 * k) + 1000 * k).astype(np.uint16).tofile(tmp_path / f"{k}.bin")
        sources.append(open_tokens(tmp_path / f"{k}.bin"))
    b = batches(sources, L, 1, 1, weights=weights, seed=2)
    w = np.array(weights, float) / sum(weights)
    counts = np.zeros(len(weights))
    for n in range(1, 601):
        x, _ = next(b)
        counts[int(x[0, 0]) // 1000] += 1
        assert np.all(np.abs(counts - n * w) < 1), (n, counts, n * w)
    # per source, the samples follow that source's own epochs
    state = b.state_dict()
    assert state["source_consumed"] == counts.astype(int).tolist()
    again = batches(sources, L, 1, 1, weights=weights, seed=2)
    again.load_state_dict(state)
    cont = batches(sources, L, 1, 1, weights=weights, seed=2)
    take(cont, 600)
    for _ in range(20):
        assert torch.equal(next(again)[0], next(cont)[0])
    with pytest.raises(DataError, match="weights"):
        batches(sources, L, 1, 1, weights=[1] * len(weights), seed=2).load_state_dict(state)


@pytest.mark.smoke
def test_blending_data_of_two_tokenizers_is_refused(tmp_path):
    a = write_manifest_dir(tmp_path / "a", {"train": stream_of(300)})
    b = write_manifest_dir(tmp_path / "b", {"train": stream_of(300, seed=1)})
    assert len(data.open_blend([str(a), f"{b}:3"])[0]) == 2  # one tokenizer: fine
    m = json.loads((b / "manifest.json").read_text())
    (b / "manifest.json").write_text(json.dumps({**m, "tokenizer": {"name": "gpt2"}}))
    with pytest.raises(DataError, match=r"--data .*b: made with the tokenizer \{'name': 'gpt2'\}"):
        data.open_blend([str(a), f"{b}:3"])


def test_blend_samples_are_the_same_across_world_sizes(tmp_path):
    sources = []
    for k in range(2):
        (np.arange(200) + 1000 * k).astype(np.uint16).tofile(tmp_path / f"{k}.bin")
        sources.append(open_tokens(tmp_path / f"{k}.bin"))
    one = batches(sources, L, 4, 4, weights=[0.7, 0.3])
    ref = [tuple(r) for _ in range(5) for r in next(one)[0].tolist()]
    ranks = [batches(sources, L, 1, 4, rank=r, world_size=2, weights=[0.7, 0.3]) for r in range(2)]
    got = [tuple(next(b)[0][0].tolist()) for _ in range(10) for b in ranks]
    assert got == ref


# -----------------------------------------------------------------------------
# validation windows


def test_val_batches_are_the_first_windows_fixed_and_split_over_ranks(tmp_path):
    source, s = make_source("manifest", tmp_path, n=500)
    W = (len(s) - 1) // L  # 71
    one = [(x.clone(), y.clone()) for x, y in val_batches(source, BatchConfig(L, 4), 5)]
    assert len(one) == 5
    x_all = torch.cat([x for x, _ in one])
    np.testing.assert_array_equal(x_all.numpy(),
                                  np.stack([s[i * L : i * L + L] for i in range(20)]))
    again = list(val_batches(source, BatchConfig(L, 4), 5))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one, again))
    for ws in (2, 3):
        parts = [list(val_batches(source, BatchConfig(L, 4, rank=r, world_size=ws), 5))
                 for r in range(ws)]
        assert sorted(tuple(x.flatten().tolist()) for p in parts for x, _ in p) == sorted(
            tuple(x.flatten().tolist()) for x, _ in one)
    # more batches asked for than exist: the full batches that exist
    assert len(list(val_batches(source, BatchConfig(L, 4), 100))) == W // 4
    # fewer windows than one micro batch: a single smaller batch
    small = open_tokens(write_manifest_dir(tmp_path / "s", {"train": s[:30]}))
    (x, y), = list(val_batches(small, BatchConfig(L, 8), 3))
    assert x.shape == (4, L) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_equal_cpu_batches(tmp_path):
    source, _ = make_source("raw", tmp_path)
    for prefetch in (False, True):
        gpu = batches(source, L, 4, 8, device="cuda", prefetch=prefetch)
        cpu = batches(source, L, 4, 8)
        for _ in range(5):
            (xg, yg), (xc, yc) = next(gpu), next(cpu)
            assert xg.is_cuda and torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
        gpu.close()
    xv, _ = next(val_batches(source, BatchConfig(L, 4, device="cuda"), 1))
    assert xv.is_cuda
