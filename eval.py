"""Score a Mamba-3 model on lm-evaluation-harness tasks, without mamba_ssm, on a CPU or a GPU.

    python eval.py out --tasks hellaswag,arc_easy,piqa,lambada_openai --limit 200
    python eval.py exported/ --tasks my_task --include my_tasks/ --out results.json
    python eval.py out --data data/demo     # bits per byte on a prepared val split

SOURCE is a train.py run directory (its newest good step, or --step), our export, or an official
Mamba-3 directory (config.json with model.safetensors or pytorch_model.bin, SISO or MIMO).

The harness asks a model three things, and Mamba3Harness answers each with the recurrence:
- loglikelihood: the log-probability of a continuation after a context, and whether greedy
  decoding would have written it. Requests run in batches, longest first, right-padded: the
  model is causal, so padding after a sequence never reaches a scored token.
- loglikelihood_rolling: the log-probability of a whole text, for perplexities. One pass in
  windows, each window starting from the state the previous one left, which is the same as one
  forward over the whole text (a Transformer would have to restart its windows instead).
- generate_until: greedy text after a context, from a prefill and then one O(1) step per token,
  until a stop string of the request, an end-of-text token or max_gen_toks tokens.

--data DIR adds the model's bits per byte on the val split of a prepare.py output: every token
of the split scored after all the tokens before it (the first after an EOS), in windows with
the state carried, so one forward over the whole split; then

    bits per byte = sum over tokens of -ln p(token) / ln 2 / the UTF-8 bytes of the text.

An EOS is a token the model must predict, so it is in the sum, but it is no text, so it adds
no bytes (nanochat leaves such tokens out of both). The figure compares across tokenizers,
where a loss per token does not. With the byte tokenizer the bytes are the tokens less the
EOS of each document, so bits per byte = loss / ln 2 * tokens / (tokens - documents).
"""
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional
from urllib.parse import urlparse

import lm_eval
import numpy as np
import torch
import typer
from lm_eval.api.model import LM
from lm_eval.utils import make_table
from rich.console import Console
from rich.progress import Progress

import ckpt
import official
from ckpt import CheckpointError
from data import cli_errors, load_tokenizer, open_tokens, write_atomic
from model import Mamba3LM, ModelConfig, pick_device

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="rich")

# Tokens per window of a rolling log-likelihood. The state carries across windows, so this
# only bounds the memory of the logits, never the context the model sees.
ROLLING_WINDOW = 1024

# The harness's usual cap on generated tokens when a task names none.
MAX_GEN_TOKS = 256


class EvalError(ValueError):
    """Bad input to eval.py, said in one paragraph."""


def wide(x):
    """x in float32, or kept in float64: log-softmax sums need at least float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def progress(total, what):
    """A progress bar on a terminal's stderr, none in logs."""
    bar = Progress(console=Console(stderr=True), transient=True,
                   disable=not sys.stderr.isatty())
    bar.start()
    task = bar.add_task(what, total=total)
    return bar, task


# -----------------------------------------------------------------------------
# our model as the harness's LM


@dataclass
class Scored:
    """A request's tokens, [EOS] + context + continuation, and how many end it to be scored."""
    tokens: list
    n_scored: int


class Mamba3Harness(LM):
    """A Mamba3LM and its tokenizer behind lm-eval's three requests.

    Every context is read after an end-of-text token, the same in all three requests: prepare.py
    ends each document with one, so a document start is what the model saw in training. An empty
    context is then the EOS alone, and the first token of a rolling text is scored after it.
    Decoding is greedy whatever a task's generation_kwargs ask.
    """

    def __init__(self, model, tokenizer, batch_size=16, dtype=None,
                 window=ROLLING_WINDOW):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # torch.bfloat16 runs the model under autocast; None runs it in its own dtype.
        self.dtype = dtype
        self.window = window
        self.eos = tokenizer.eos_id

    @property
    def where(self):
        return next(self.model.parameters()).device

    def precision(self):
        """The autocast of self.dtype, or nothing."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.where.type, dtype=self.dtype)

    def batches(self, items, what):
        """(positions, items) in batches, longest first, with a progress bar."""
        # Neighbours in length share a batch, so little of it is padding; the longest batch
        # comes first, so one that does not fit in memory fails at once.
        order = sorted(range(len(items)), key=lambda i: -len(items[i]))
        bar, task = progress(len(items), what)
        try:
            for start in range(0, len(order), self.batch_size):
                positions = order[start:start + self.batch_size]
                yield positions, [items[i] for i in positions]
                bar.advance(task, len(positions))
        finally:
            bar.stop()

    def padded(self, sequences):
        """Token lists -> (B, longest) int64 on the model's device, right-padded with EOS."""
        longest = max(len(s) for s in sequences)
        # Any id would do as padding: it comes after the real tokens, which a causal model
        # never lets see it.
        idx = torch.full((len(sequences), longest), self.eos, dtype=torch.long)
        for row, tokens in enumerate(sequences):
            idx[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return idx.to(self.where)

    # --- loglikelihood ---

    def encode_pair(self, context, continuation):
        """(context, continuation) -> Scored. The pair is tokenized whole and split where the
        context's tokens end, so a token spanning the seam is not cut in two; spaces that end
        the context move to the continuation first, where the harness means them to be."""
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        whole = self.tokenizer.encode(stripped + continuation)
        n_context = len(self.tokenizer.encode(stripped))
        return Scored([self.eos] + whole, len(whole) - n_context)

    def score(self, batch):
        """A batch of Scored -> [(log-probability, is_greedy)]."""
        idx = self.padded([s.tokens for s in batch])
        with self.precision():
            h = self.model.hidden(idx)
            # Only the positions that predict scored tokens get logits: the head is the widest
            # matmul, and its (B, L, vocab) output the largest tensor.
            rows = []
            for row, s in enumerate(batch):
                first = len(s.tokens) - 1 - s.n_scored
                rows.append(h[row, first:first + s.n_scored])
            logits = wide(self.model.logits(torch.cat(rows)))
        logp = logits.log_softmax(-1)
        # A continuation is greedy when every one of its tokens is the argmax after the
        # tokens before it, which are the continuation's own: exactly what greedy decoding
        # would have written.
        greedy = logits.argmax(-1)
        results = []
        start = 0
        for s in batch:
            end = start + s.n_scored
            target = torch.tensor(s.tokens[len(s.tokens) - s.n_scored:], device=self.where)
            picked = logp[start:end].gather(-1, target[:, None])
            is_greedy = bool((greedy[start:end] == target).all())
            results.append((float(picked.sum()), is_greedy))
            start = end
        return results

    @torch.no_grad()
    def loglikelihood(self, requests):
        pairs = [self.encode_pair(*r.args) for r in requests]
        results = [(0.0, True)] * len(pairs)
        # An empty continuation has log-probability 0 and needs no model.
        todo = [i for i, p in enumerate(pairs) if p.n_scored]
        tokens = [pairs[i].tokens for i in todo]
        for positions, _ in self.batches(tokens, "loglikelihood"):
            batch = [pairs[todo[i]] for i in positions]
            for i, result in zip(positions, self.score(batch)):
                results[todo[i]] = result
        return results

    # --- loglikelihood_rolling ---

    def clear_after_reset(self, last, cache):
        """Zero the cached state of each row whose window ended on reset_token, as prefill does:
        the next window starts a new document there."""
        reset = self.model.config.reset_token
        if reset is None:
            return
        done = last == reset
        for layer in cache:
            for t in layer.values():
                t.masked_fill_(done.view(-1, *(1,) * (t.dim() - 1)), 0)

    def rolling(self, docs):
        """Token lists, each [EOS] + a text's tokens -> the summed log-probability of each text,
        window by window with the state carried between windows."""
        idx = self.padded(docs)
        inputs = idx[:, :-1]
        targets = idx[:, 1:]
        lengths = torch.tensor([len(d) - 1 for d in docs], device=self.where)
        scored = torch.arange(inputs.shape[1], device=self.where) < lengths[:, None]
        # The cache holds each row's state between windows: the next window continues the
        # recurrence where this one stopped, as one forward over the whole text would.
        cache = self.model.init_cache(len(docs))
        totals = [0.0] * len(docs)
        for start in range(0, inputs.shape[1], self.window):
            x = inputs[:, start:start + self.window]
            with self.precision():
                logits = wide(self.model.logits(self.model.hidden(x, cache)))
            y = targets[:, start:start + self.window]
            logp = logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
            # Padding past a text's end is not the text's: it scores nothing.
            logp = torch.where(scored[:, start:start + self.window], logp, 0)
            for row, value in enumerate(logp.sum(1).tolist()):
                totals[row] += value
            self.clear_after_reset(x[:, -1], cache)
        return totals

    @torch.no_grad()
    def loglikelihood_rolling(self, requests):
        docs = [[self.eos] + self.tokenizer.encode(r.args[0]) for r in requests]
        results = [0.0] * len(docs)
        for positions, batch in self.batches(docs, "rolling loglikelihood"):
            for i, total in zip(positions, self.rolling(batch)):
                results[i] = total
        return results

    # --- generate_until ---

    def generate(self, context, until, max_tokens):
        """Greedy text after context, cut before the first stop string of `until`."""
        ids = [self.eos] + self.tokenizer.encode(context)
        idx = torch.tensor([ids], dtype=torch.long, device=self.where)
        new = []
        text = ""
        with self.precision():
            for token in self.model.stream(idx, max_tokens, temperature=0):
                if int(token[0]) == self.eos:
                    break
                new.append(int(token[0]))
                # Stop strings are text, and a token may hold part of one, so the text so far
                # is decoded and searched after each token.
                text = self.tokenizer.decode(new)
                if any(stop in text for stop in until):
                    break
        for stop in until:
            text = text.split(stop)[0]
        return text

    @torch.no_grad()
    def generate_until(self, requests):
        bar, task = progress(len(requests), "generate_until")
        texts = []
        try:
            for r in requests:
                context, kwargs = r.args
                until = kwargs.get("until") or []
                if isinstance(until, str):
                    until = [until]
                max_tokens = kwargs.get("max_gen_toks", MAX_GEN_TOKS)
                texts.append(self.generate(context, until, max_tokens))
                bar.advance(task)
        finally:
            bar.stop()
        return texts


# -----------------------------------------------------------------------------
# bits per byte on a prepared split


@dataclass
class BitsPerByte:
    """A split's summed -ln p (nats), its tokens and the bytes of its text."""
    path: str
    nats: float
    tokens: int
    text_bytes: int

    @property
    def bits_per_byte(self):
        return self.nats / np.log(2) / self.text_bytes

    @property
    def loss(self):
        """Nats per token, as train.py's val_loss measures them."""
        return self.nats / self.tokens


def open_val(directory):
    """The val split of a prepare.py output, refused when its manifest counts no bytes."""
    path = Path(directory)
    if not (path / "manifest.json").is_file():
        raise EvalError(f"--data {path}: expected a prepare.py output directory (with its "
                        "manifest.json), found none; bits per byte need the bytes of the "
                        "text, which only prepare.py records")
    source = open_tokens(path, "val")
    if source.text_bytes is None:
        raise EvalError(f"--data {path}: its manifest.json counts no bytes of text (made by "
                        "a prepare.py from before the count); run prepare.py on the same "
                        "inputs again to write one that does")
    return source


def check_data_tokenizer(source, spec, vocab):
    """Refuse a split whose tokens are not the model's tokenizer's ids."""
    theirs = source.tokenizer or {}
    mine = spec or {}
    differ = theirs.get("name") != mine.get("name")
    # Two tokenizer files are the same file when both record the same hash.
    if theirs.get("sha256") and mine.get("sha256"):
        differ = differ or theirs["sha256"] != mine["sha256"]
    if differ:
        raise EvalError(f"--data {source.path}: made with the tokenizer {theirs}, and the "
                        f"model reads {mine}: bits per byte need data made with the model's "
                        "tokenizer; prepare it with that one, or give the right --tokenizer")
    source.check_vocab(vocab)


@torch.no_grad()
def split_nats(harness, source):
    """The summed -ln p of every token of `source`, each after all the tokens before it
    (the first after an EOS, as at every document start), in windows of harness.window
    tokens with the state carried from each to the next: one forward over the split."""
    model = harness.model
    n = source.num_tokens
    cache = model.init_cache(1)
    nats = 0.0
    # The token before the window's first: an EOS before the split's first token.
    previous = harness.eos
    bar, task = progress(n, "bits per byte")
    try:
        for start in range(0, n, harness.window):
            # (W,) the tokens this window predicts, and (W,) the tokens it reads
            read = source.read(start, min(harness.window, n - start))
            targets = torch.from_numpy(read.astype(np.int64))
            inputs = torch.cat([torch.tensor([previous]), targets[:-1]])
            x = inputs[None].to(harness.where)
            y = targets[None].to(harness.where)
            with harness.precision():
                logits = wide(model.logits(model.hidden(x, cache)))
            logp = logits.log_softmax(-1).gather(-1, y[..., None])
            nats -= logp.double().sum().item()
            harness.clear_after_reset(x[:, -1], cache)
            previous = int(targets[-1])
            bar.advance(task, len(targets))
    finally:
        bar.stop()
    return nats


def bits_per_byte(harness, source) -> BitsPerByte:
    nats = split_nats(harness, source)
    return BitsPerByte(str(source.path), nats, source.num_tokens, source.text_bytes)


# -----------------------------------------------------------------------------
# the model and tokenizer of a SOURCE


@dataclass
class Source:
    model: Mamba3LM
    tokenizer: object
    step: Optional[int]
    spec: dict


def read_source(path, step):
    """(model, step, tokenizer spec or None) of a run directory, an export or an official
    Mamba-3 directory."""
    path = Path(path)
    if not path.is_dir():
        raise EvalError(f"{path}: no such directory; expected a train.py run directory, an "
                        "export of one, or an official Mamba-3 directory (config.json with "
                        "model.safetensors or pytorch_model.bin)")
    # Checkpoint files make a run directory, even when none of them verifies: load_model then
    # says which and why.
    if ckpt.step_files(path):
        model, meta, step = official.load_model(path, step)
        return model, step, meta.get("tokenizer")
    if step is not None:
        raise EvalError(f"--step {step}: {path} is not a train.py run directory, and only a "
                        "run has steps to choose from; leave --step out")
    config, state, spec = official.read_pretrained(path)
    model = Mamba3LM(ModelConfig(**config))
    model.load_state_dict(state)
    # Our export records the step it came from; an official directory has none.
    marker = path / official.MARKER
    if marker.is_file():
        step = json.loads(marker.read_text()).get("step")
    return model.eval(), step, spec


def pick_tokenizer(flag, spec, path):
    """The tokenizer of --tokenizer, else of the source's spec, else the directory's
    tokenizer.json; refused when none of them is there."""
    if flag in ("gpt2", "byte"):
        return load_tokenizer({"name": flag})
    # Anything else names a tokenizer.json file.
    if flag:
        file = Path(flag)
        if not file.is_file():
            raise EvalError(f"--tokenizer {flag}: expected gpt2, byte or the path of a "
                            "tokenizer.json file, found no such file")
        return load_tokenizer({"name": "file", "file": str(file.resolve())})
    if spec is not None:
        return load_tokenizer(spec, path)
    if (Path(path) / "tokenizer.json").is_file():
        return load_tokenizer({"name": "file", "file": "tokenizer.json"}, path)
    raise EvalError(f"{path}: no tokenizer is known (no tokenizer in the run's meta or the "
                    "export, no tokenizer.json in the directory); give the one that made its "
                    "token ids with --tokenizer gpt2, --tokenizer byte or --tokenizer "
                    "PATH/tokenizer.json")


def load_source(path, step, tokenizer_flag) -> Source:
    model, step, spec = read_source(path, step)
    tokenizer = pick_tokenizer(tokenizer_flag, spec, path)
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise EvalError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids and the model "
                        f"{vocab}, so it is not the model's tokenizer; give the right one with "
                        "--tokenizer")
    # A model wider than its tokenizer must not predict ids without text, as in sample.py.
    model.config.vocab_size = tokenizer.vocab_size
    return Source(model, tokenizer, step, tokenizer.spec)


# -----------------------------------------------------------------------------
# tasks


def offline_unless_hub_reachable():
    """Set the Hugging Face Hub's offline switches when the Hub cannot be reached, before the
    datasets library is imported: a dataset that needs a download then fails at once instead
    of after minutes of retries, and one already cached still loads."""
    if os.environ.get("HF_HUB_OFFLINE"):
        return
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["HF_DATASETS_OFFLINE"] = "1"


def task_manager(names, include):
    """lm-eval's TaskManager that knows every name, or an EvalError naming the unknown ones.
    Indexing lm-eval's own thousands of YAML files takes seconds, so tasks that --include
    holds alone are looked up there alone."""
    # Imported here, not at the top: it imports the datasets library, which reads the Hub's
    # offline switches once, when first imported.
    from lm_eval.tasks import TaskManager
    if include is not None:
        manager = TaskManager(include_path=str(include), include_defaults=False)
        if all(name in manager.all_tasks for name in names):
            return manager
    manager = TaskManager(include_path=None if include is None else str(include))
    # A task may also be named by the path of its YAML file.
    unknown = [n for n in names if n not in manager.all_tasks and not Path(n).is_file()]
    if unknown:
        where = "its own tasks" if include is None else f"its own tasks or {include}"
        raise EvalError(f"unknown task {', '.join(unknown)}: lm-eval has no task, group or tag "
                        f"of that name in {where}; list them with `lm-eval ls tasks`, or "
                        "write a task YAML and give its directory with --include DIR")
    return manager


def run_tasks(harness, names, manager, num_fewshot, limit):
    """lm-eval's results dict of the tasks `names`, or an EvalError when a dataset needs a
    download that cannot happen."""
    # Imported here for the same reason as TaskManager.
    from lm_eval import simple_evaluate
    try:
        return simple_evaluate(model=harness, tasks=names, num_fewshot=num_fewshot,
                               limit=limit, batch_size=harness.batch_size,
                               task_manager=manager, log_samples=False)
    except ConnectionError as e:
        # Only loading a task's dataset reaches the network: nothing has been scored yet.
        raise EvalError(f"{', '.join(names)}: a dataset must be downloaded from the Hugging "
                        f"Face Hub, which cannot be reached ({e}); run once where it can be "
                        "(datasets caches it), or give the task as a YAML over local files "
                        "(dataset_path: json, dataset_kwargs: data_files) in a directory "
                        "named by --include DIR") from None
    except FileNotFoundError as e:
        # A local task's data files: lm-eval hands relative paths to the datasets library,
        # which reads them from the working directory, not from the YAML's.
        raise EvalError(f"{', '.join(names)}: a data file of the task is missing ({e}); "
                        "relative data_files in a task YAML are read from the current "
                        "directory: run from there, or write absolute paths") from None


# -----------------------------------------------------------------------------
# command line


def check_flags(limit, out, include, names, data):
    """Refuse what needs no model to refuse, before any work. names is None without
    --tasks."""
    if names is None and data is None:
        raise EvalError("nothing to score: give lm-eval task names with --tasks (such as "
                        "--tasks hellaswag,arc_easy), a prepared directory with --data DIR "
                        "for bits per byte, or both")
    if names is not None and not names:
        raise EvalError("--tasks names no task; give lm-eval task names such as "
                        "--tasks hellaswag,arc_easy")
    if limit is not None and limit < 1:
        raise EvalError(f"--limit {limit}: give at least 1 example per task, or leave --limit "
                        "out to score them all")
    if out is not None and not out.parent.is_dir():
        raise EvalError(f"--out {out}: the directory {out.parent} does not exist; create it "
                        "or write elsewhere")
    if include is not None and not include.is_dir():
        raise EvalError(f"--include {include}: expected a directory of task YAML files, found "
                        "no such directory")


def pick_dtype(flag, device):
    """--dtype auto|bf16|fp32 -> (its name, the autocast dtype or None)."""
    if flag == "auto":
        flag = "bf16" if device == "cuda" else "fp32"
    if flag == "bf16":
        return flag, torch.bfloat16
    return flag, None


@app.command()
def main(
    source: Path = typer.Argument(..., metavar="SOURCE", help="A train.py run directory, an "
                                  "export, or an official Mamba-3 directory."),
    tasks: Optional[str] = typer.Option(None, help="lm-eval task names, comma-separated "
                                        "(hellaswag,arc_easy,piqa,lambada_openai)."),
    num_fewshot: Optional[int] = typer.Option(None, min=0, help="Few-shot examples per "
                                              "prompt (default: each task's own)."),
    limit: Optional[int] = typer.Option(None, help="Score only the first N examples of each "
                                        "task, for a quick look."),
    batch_size: int = typer.Option(16, min=1, help="Requests per forward."),
    device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", help="auto: CUDA if "
                                                          "present."),
    dtype: Literal["auto", "bf16", "fp32"] = typer.Option("auto", help="auto: bf16 autocast "
                                                          "on a GPU, float32 on a CPU."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step of a run directory "
                                       "(default: the newest that verifies)."),
    include: Optional[Path] = typer.Option(None, help="A directory of task YAML files to add "
                                           "(lm-eval's include_path)."),
    tokenizer: Optional[str] = typer.Option(None, help="gpt2, byte or a tokenizer.json path "
                                            "(default: the source's own)."),
    out: Optional[Path] = typer.Option(None, help="Write the results as JSON to this file."),
    data: Optional[Path] = typer.Option(None, help="A prepare.py output directory: print "
                                        "the model's bits per byte on its val split."),
):
    """Score a Mamba-3 model on lm-evaluation-harness tasks, or its bits per byte on
    prepared data (--data), or both."""
    started = time.time()
    names = None
    if tasks is not None:
        names = [n.strip() for n in tasks.split(",") if n.strip()]
    results = None
    bpb = None
    # ValueError: data.DataError, pick_device's, and EvalError.
    with cli_errors(CheckpointError, ValueError):
        check_flags(limit, out, include, names, data)
        device = pick_device(device)
        val = None
        if data is not None:
            val = open_val(data)
        loaded = load_source(source, step, tokenizer)
        if val is not None:
            check_data_tokenizer(val, loaded.spec, loaded.model.config.vocab_size)
        dtype_name, autocast = pick_dtype(dtype, device)
        manager = None
        if names:
            offline_unless_hub_reachable()
            manager = task_manager(names, include)
        model = loaded.model.to(device)
        # A MAMBA3_IMPL that cannot run here is refused in one sentence, before any scoring.
        official.check_impl(model)
        harness = Mamba3Harness(model, loaded.tokenizer, batch_size, autocast)
        if names:
            results = run_tasks(harness, names, manager, num_fewshot, limit)
        if val is not None:
            bpb = bits_per_byte(harness, val)
    if results is not None:
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
    if bpb is not None:
        print(f"bits per byte {bpb.bits_per_byte:.4f} on {bpb.path} val: loss "
              f"{bpb.loss:.4f} nats per token over {bpb.tokens:,} tokens, "
              f"{bpb.text_bytes:,} bytes of text")
    if out is None:
        return
    report = {}
    if results is not None:
        report["results"] = results["results"]
    report.update(source=str(source), step=loaded.step, tokenizer=loaded.spec,
                  dtype=dtype_name, device=device, lm_eval_version=lm_eval.__version__,
                  seconds=round(time.time() - started, 3), tasks=names,
                  num_fewshot=num_fewshot, limit=limit)
    if results is not None and results.get("groups"):
        report["groups"] = results["groups"]
    if bpb is not None:
        report["bits_per_byte"] = {"data": bpb.path, "split": "val",
                                   "bits_per_byte": bpb.bits_per_byte, "loss": bpb.loss,
                                   "tokens": bpb.tokens, "bytes": bpb.text_bytes}
    write_atomic(out, json.dumps(report, indent=2, default=str).encode())
    print(f"wrote {out}")


if __name__ == "__main__":
    app()
