"""eval.py: our model behind lm-evaluation-harness. Its loglikelihoods, rolling loglikelihoods and
greedy generations equal what the model computes directly; a run directory and its export score
the same; bad input is refused in one paragraph with exit 2 and nothing written. Offline: the
tasks are the YAML and JSONL files of tests/eval_tasks."""
import dataclasses
import json
import math
import os
from pathlib import Path

# The tests never reach the network. The Hub's offline switches are read when the datasets
# library is first imported, so they are set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from test_prepare import drop_byte_counts  # noqa: E402

import ckpt  # noqa: E402
import eval as eval_py  # noqa: E402
import official  # noqa: E402
from model import Mamba3LM, ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tests" / "eval_tasks"

# Small enough to run in milliseconds, and exportable to the official format (an MLP width that
# is a multiple of 128, an even number of rotary angles).
CONFIG = ModelConfig(vocab_size=257, n_layer=2, d_model=32, headdim=16, d_state=16,
                     mlp_hidden=128, chunk_size=8)
MIMO = ModelConfig(vocab_size=257, n_layer=2, d_model=32, headdim=16, d_state=16,
                   mlp_hidden=128, chunk_size=8, mimo_rank=2)


class CharTokenizer:
    """One character per id (U+0100 + id) and EOS 256: every generated token is whole text,
    so a stop string can be cut exactly, whatever bytes a random model writes."""
    vocab_size = 257
    eos_id = 256
    spec = {"name": "chars"}

    def encode(self, text):
        return [ord(c) - 0x100 for c in text]

    def decode(self, ids):
        return "".join(chr(0x100 + i) for i in ids)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These models are tiny: a second thread only adds waiting, many times the work itself on
    # a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(config=CONFIG, dtype=torch.float64, seed=0):
    """A random model with every parameter perturbed, and the slowest decays made slower, so
    that its output depends on tokens long before."""
    torch.manual_seed(seed)
    model = Mamba3LM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for block in model.blocks:
            block.mixer.dt_bias.sub_(2.0)
    return model.to(dtype).eval()


def random_text(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n,), generator=g).tolist()
    return CharTokenizer().decode(ids)


def request(kind, *args):
    return Instance(kind, doc={}, arguments=args, idx=0)


def direct_logp(model, tokens):
    """(B=1) log-softmax of one forward over `tokens`, float64."""
    logits, _ = model(torch.tensor([tokens]))
    return logits[0].double().log_softmax(-1)


# -----------------------------------------------------------------------------
# the three requests


@pytest.mark.smoke
@pytest.mark.parametrize("config", [CONFIG, MIMO], ids=["siso", "mimo"])
def test_loglikelihood_equals_the_model(config):
    model = make_model(config)
    tok = CharTokenizer()
    harness = eval_py.Mamba3Harness(model, tok, batch_size=3)
    eos = tok.eos_id
    pairs = []
    for i, (n_context, n_cont) in enumerate([(5, 3), (30, 1), (0, 4), (12, 9), (7, 2)]):
        pairs.append((random_text(n_context, i), random_text(n_cont, 100 + i)))
    # A continuation that is the model's greedy one: its flag must be True.
    context = random_text(9, 7)
    greedy = model.generate(torch.tensor([[eos] + tok.encode(context)]), 3, temperature=0)
    pairs.append((context, tok.decode(greedy[0, -3:].tolist())))
    results = harness.loglikelihood([request("loglikelihood", c, x) for c, x in pairs])
    flags = []
    for (context, continuation), (score, is_greedy) in zip(pairs, results):
        tokens = [eos] + tok.encode(context + continuation)
        n = len(continuation)
        logp = direct_logp(model, tokens)[-n - 1:-1]
        target = torch.tensor(tokens[-n:])
        expected = logp.gather(-1, target[:, None]).sum().item()
        assert score == pytest.approx(expected, abs=1e-6)
        assert is_greedy == bool((logp.argmax(-1) == target).all())
        flags.append(is_greedy)
    assert flags[-1] and not all(flags)


def test_loglikelihood_moves_context_spaces_to_the_continuation():
    from data import ByteTokenizer
    harness = eval_py.Mamba3Harness(make_model(), ByteTokenizer())
    scored = harness.encode_pair("a question ", "answer")
    assert scored.tokens == [256] + list(b"a question answer")
    assert scored.n_scored == len(" answer")


@pytest.mark.parametrize("config", [CONFIG, MIMO], ids=["siso", "mimo"])
def test_rolling_carries_the_state_and_equals_one_forward(config):
    model = make_model(config)
    tok = CharTokenizer()
    window = 16
    harness = eval_py.Mamba3Harness(model, tok, batch_size=2, window=window)
    texts = [random_text(n, n) for n in (150, 97, 64, 3)]
    results = harness.loglikelihood_rolling([request("loglikelihood_rolling", t)
                                            for t in texts])
    for text, total in zip(texts, results):
        tokens = [tok.eos_id] + tok.encode(text)
        logp = direct_logp(model, tokens)[:-1]
        picked = logp.gather(-1, torch.tensor(tokens[1:])[:, None])
        assert total == pytest.approx(picked.sum().item(), abs=1e-6)
    # Windows that each restarted the state would score the long text otherwise.
    tokens = [tok.eos_id] + tok.encode(texts[0])
    restarted = 0.0
    for start in range(0, len(tokens) - 1, window):
        piece = tokens[start:start + window + 1]
        logp = direct_logp(model, piece)[:-1]
        restarted += logp.gather(-1, torch.tensor(piece[1:])[:, None]).sum().item()
    assert abs(restarted - results[0]) > 1e-3


def test_rolling_clears_the_state_after_a_reset_token():
    # With reset_token the EOS, a window that ends on it must start the next from a clear
    # state, as the forward resets there.
    config = dataclasses.replace(CONFIG, reset_token=256)
    model = make_model(config)
    tok = CharTokenizer()
    harness = eval_py.Mamba3Harness(model, tok, window=1)
    text = random_text(20, 3)
    (total,) = harness.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    tokens = [tok.eos_id] + tok.encode(text)
    logp = direct_logp(model, tokens)[:-1]
    expected = logp.gather(-1, torch.tensor(tokens[1:])[:, None]).sum().item()
    assert total == pytest.approx(expected, abs=1e-6)


def test_generate_until_is_greedy_generate_cut_at_the_stop_string():
    model = make_model()
    tok = CharTokenizer()
    harness = eval_py.Mamba3Harness(model, tok)
    context = random_text(11, 5)
    idx = torch.tensor([[tok.eos_id] + tok.encode(context)])
    full = tok.decode(model.generate(idx, 20, temperature=0)[0, idx.shape[1]:].tolist())
    stop = full[6:8]
    cut = full[:full.index(stop)]
    requests = [request("generate_until", context, {"until": [stop], "max_gen_toks": 20}),
                request("generate_until", context, {"until": "never", "max_gen_toks": 9})]
    assert harness.generate_until(requests) == [cut, full[:9]]
    assert len(cut) < 8


# -----------------------------------------------------------------------------
# the command line


def make_run(run_dir, config=CONFIG, tokenizer={"name": "byte"}):
    model = make_model(config, dtype=torch.float32)
    ckpt.save(run_dir, 3, model, None, {"tokenizer": tokenizer})
    return model


def files_under(path):
    return sorted(str(p) for p in Path(path).rglob("*"))


def invoke(*args):
    return CliRunner().invoke(eval_py.app, [str(a) for a in args])


def test_generate_until_equals_sample_py_greedy(tmp_path):
    # Both start the context as a new document, after an end-of-text token.
    import sample
    import data

    make_run(tmp_path / "run")
    prompt = "def f(x):"
    result = CliRunner().invoke(sample.app, ["--out-dir", str(tmp_path / "run"), "--prompt",
                                             prompt, "--temperature", "0",
                                             "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    model, meta, _ = official.load_model(tmp_path / "run")
    tok = data.load_tokenizer(meta["tokenizer"], tmp_path / "run")
    harness = eval_py.Mamba3Harness(model, tok)
    (text,) = harness.generate_until([request("generate_until", prompt,
                                              {"until": [], "max_gen_toks": 12})])
    assert result.output == prompt + text + "\n"


def test_a_run_and_its_export_score_the_same(tmp_path, monkeypatch):
    # data_files in the task YAMLs are relative to the repository root.
    monkeypatch.chdir(ROOT)
    make_run(tmp_path / "run")
    official.export(tmp_path / "run", tmp_path / "export")
    reports = []
    for source in ("run", "export"):
        out = tmp_path / f"{source}.json"
        result = invoke(tmp_path / source, "--tasks", "tiny_choice,tiny_rolling", "--include",
                        TASKS, "--out", out, "--device", "cpu")
        assert result.exit_code == 0, result.output
        assert "tiny_choice" in result.output and "bits_per_byte" in result.output
        reports.append(json.loads(out.read_text()))
    run, export = reports
    assert run["step"] == export["step"] == 3
    assert run["tokenizer"] == export["tokenizer"] == {"name": "byte"}
    assert run["dtype"] == "fp32" and run["device"] == "cpu"
    assert run["lm_eval_version"] and run["seconds"] > 0
    assert run["results"]["tiny_choice"]["sample_len"] == 6
    for task, metrics in run["results"].items():
        for name, value in metrics.items():
            if isinstance(value, float):
                assert export["results"][task][name] == pytest.approx(value, rel=1e-6)


def test_a_mimo_run_generates_and_limit_takes_the_first_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    make_run(tmp_path / "run", config=MIMO)
    out = tmp_path / "r.json"
    result = invoke(tmp_path / "run", "--tasks", "tiny_choice,tiny_generate", "--include",
                    TASKS, "--limit", 2, "--out", out)
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())["results"]
    assert results["tiny_choice"]["sample_len"] == 2
    assert results["tiny_generate"]["sample_len"] == 2
    assert "exact_match,none" in results["tiny_generate"]


def test_no_hub_switches_the_hub_offline(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    # A closed port on this machine: the connection is refused at once.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    eval_py.offline_unless_hub_reachable()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


HUB_TASK = """task: needs_the_hub
dataset_path: nobody/no_such_dataset
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
"""


def refusal_args(case, tmp):
    """The command line of each refusal, in a fresh tmp with a good run in tmp/run."""
    run = tmp / "run"
    good = ["--tasks", "tiny_choice", "--include", TASKS, "--out", tmp / "r.json"]
    if case == "missing source":
        return [tmp / "nowhere", *good], "no such directory"
    if case == "neither run nor model":
        (tmp / "notes").mkdir()
        (tmp / "notes" / "a.txt").write_text("hello")
        return [tmp / "notes", *good], "expected a train.py run directory"
    if case == "unknown task":
        return [run, "--tasks", "no_such_task_anywhere", "--include", TASKS,
                "--out", tmp / "r.json"], "--include"
    if case == "download offline":
        (tmp / "hub").mkdir()
        (tmp / "hub" / "hub.yaml").write_text(HUB_TASK)
        return [run, "--tasks", "needs_the_hub", "--include", tmp / "hub",
                "--out", tmp / "r.json"], "--include"
    if case == "unknown tokenizer":
        return [run, *good, "--tokenizer", "no_such_tokenizer"], "--tokenizer"
    if case == "no tokenizer known":
        make_run(tmp / "bare", tokenizer=None)
        return [tmp / "bare", *good], "--tokenizer"
    if case == "limit 0":
        return [run, *good, "--limit", 0], "--limit 0"
    if case == "a task's data file missing":
        (tmp / "local").mkdir()
        yaml = (Path(TASKS) / "choice.yaml").read_text()
        (tmp / "local" / "choice.yaml").write_text(yaml.replace("tiny_choice", "moved_choice"))
        # Run from elsewhere, the task's relative data_files point nowhere.
        return [run, "--tasks", "moved_choice", "--include", tmp / "local",
                "--out", tmp / "r.json"], "relative data_files"
    if case == "out in a missing directory":
        return [run, "--tasks", "tiny_choice", "--include", TASKS,
                "--out", tmp / "absent" / "r.json"], "does not exist"
    raise AssertionError(case)


REFUSALS = ["missing source", "neither run nor model", "unknown task", "download offline",
            "unknown tokenizer", "no tokenizer known", "limit 0", "out in a missing directory",
            "a task's data file missing"]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.smoke) if c == "limit 0"
                                  else c for c in REFUSALS])
def test_refusals(case, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    if case == "a task's data file missing":
        monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "run")
    args, says = refusal_args(case, tmp_path)
    before = files_under(tmp_path)
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and says in result.output
    # One paragraph: the message is one line, however long.
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert files_under(tmp_path) == before


# -----------------------------------------------------------------------------
# bits per byte (--data)


def prepared(tmp, texts, name="data"):
    """A prepare.py output of `texts` with the byte tokenizer, every other one held out."""
    import prepare
    src = tmp / f"{name}-src"
    src.mkdir()
    for i, text in enumerate(texts):
        (src / f"{i:02d}.txt").write_text(text)
    prepare.prepare(prepare.find_inputs([src]), tmp / name, "byte", val_fraction=0.5,
                    workers=1, log=lambda *a: None)
    return tmp / name


def val_stream(directory):
    from data import open_tokens
    source = open_tokens(directory, "val")
    return source.read(0, source.num_tokens).astype(int).tolist()


@pytest.mark.parametrize("config", [CONFIG, MIMO], ids=["siso", "mimo"])
def test_bits_per_byte_is_one_forward_over_the_split(config, tmp_path):
    from data import ByteTokenizer
    texts = ["é" + "x" * i + "🙂 the end\n" for i in (40, 3, 77, 10, 25, 60)]
    directory = prepared(tmp_path, texts)
    model = make_model(config)
    harness = eval_py.Mamba3Harness(model, ByteTokenizer(), window=16)
    bpb = eval_py.bits_per_byte(harness, eval_py.open_val(directory))
    # The slow twin: one forward over [EOS] + the split, every token of it scored.
    stream = val_stream(directory)
    tokens = [256] + stream
    logp = direct_logp(model, tokens)[:-1]
    nats = -logp.gather(-1, torch.tensor(stream)[:, None]).sum().item()
    documents = stream.count(256)
    assert bpb.tokens == len(stream) and documents == 3
    assert bpb.text_bytes == len(stream) - documents
    assert bpb.nats == pytest.approx(nats, abs=1e-9)
    # A byte tokenizer: bits per byte are the loss in bits, per byte rather than per token.
    loss = nats / len(stream)
    expected = loss / math.log(2) * len(stream) / (len(stream) - documents)
    assert bpb.bits_per_byte == pytest.approx(expected, rel=1e-12)
    assert bpb.loss == pytest.approx(loss, rel=1e-12)


@pytest.mark.smoke
def test_data_prints_bits_per_byte_of_a_run(tmp_path):
    directory = prepared(tmp_path, ["short\n", "a longer document of text\n", "one more\n",
                                    "and the last one\n"])
    model = make_run(tmp_path / "run")
    out = tmp_path / "r.json"
    result = invoke(tmp_path / "run", "--data", directory, "--out", out, "--device", "cpu")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())["bits_per_byte"]
    stream = val_stream(directory)
    with torch.no_grad():
        logp = direct_logp(model.double(), [256] + stream)[:-1]
    nats = -logp.gather(-1, torch.tensor(stream)[:, None]).sum().item()
    expected = nats / math.log(2) / (len(stream) - stream.count(256))
    assert report["bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    assert report["tokens"] == len(stream) and report["split"] == "val"
    assert f"bits per byte {report['bits_per_byte']:.4f}" in result.output
    assert "results" not in json.loads(out.read_text())


def test_data_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    make_run(tmp_path / "run")
    old = prepared(tmp_path, ["some text\n", "more text\n"], name="old")
    drop_byte_counts(old)
    good = prepared(tmp_path, ["some text\n", "more text\n"], name="good")
    # The same ids as a file tokenizer: still not the tokenizer the data was made with.
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(official.byte_tokenizer_json())
    cases = [([], "nothing to score"),
             (["--data", tmp_path / "run"], "expected a prepare.py output directory"),
             (["--data", old], "counts no bytes"),
             (["--data", good, "--tokenizer", tokenizer], "made with the tokenizer")]
    before = files_under(tmp_path)
    for args, says in cases:
        result = invoke(tmp_path / "run", *args, "--out", tmp_path / "r.json")
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and says in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert files_under(tmp_path) == before
