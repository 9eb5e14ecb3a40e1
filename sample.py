"""Generate text from a checkpoint: prefill the prompt with the chunked scan, then decode one token at a time
with the O(1) recurrent step, streaming the text as it comes.

    python sample.py --out-dir out --prompt "def " --max-new-tokens 300 --temperature 0.8 --top-k 50
"""
import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Literal, Optional

import torch
import typer
from rich.console import Console
from rich.markup import escape

import ckpt
import data
from model import Mamba3LM, ModelConfig
from data import load_tokenizer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")


def load_model(out_dir, step=None):
    """(model in eval mode, meta, step) rebuilt from a checkpoint of a train.py run directory: its config from the
    meta, then the weights. Without a step, the newest that verifies (a corrupt one is reported and passed)."""
    if not Path(out_dir).is_dir():
        raise ckpt.CheckpointError(f"{out_dir}: no such directory; expected a train.py --out-dir holding checkpoints")
    steps = [step] if step is not None else list(reversed(ckpt.list_steps(out_dir)))
    if not steps:
        raise ckpt.CheckpointError(f"{out_dir}: no complete checkpoint found (expected model_step_N.safetensors, "
                                   f"optim_step_N.pt and meta_step_N.json)")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for s in steps:
        meta = ckpt.read_meta(out_dir, s)
        if not isinstance(meta.get("model_config"), dict):
            raise ckpt.CheckpointError(f"checkpoint step {s} in {out_dir} records no model_config: not a mamba3-lite model")
        model = Mamba3LM(ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in fields}))
        try:
            ckpt.load(out_dir, s, model)
            return model.eval(), meta, s
        except ckpt.CorruptCheckpoint as e:
            if step is not None or s == steps[-1]:
                raise
            warnings.warn(f"{e}; trying an earlier step")


def stream_text(model, tokenizer, prompt_ids, max_new_tokens, temperature, top_k, generator, out=None):
    """Print the continuation as it is generated; returns the generated ids. Stops at the end-of-text token.
    Text is printed up to the last whole character, so a multi-byte character split across tokens shows once."""
    out = out or sys.stdout
    device = model.embed.weight.device
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    ids, shown = [], 0
    for token in model.stream(idx, max_new_tokens, temperature, top_k, generator):
        t = int(token[0])
        if t == tokenizer.eos_id:
            break
        ids.append(t)
        text = tokenizer.decode(ids)
        end = len(text.rstrip("\ufffd"))  # hold back a character that is still incomplete
        out.write(text[shown:end])
        out.flush()
        shown = end
    out.write(tokenizer.decode(ids)[shown:] + "\n")
    return ids


@app.command()
def main(
    out_dir: Path = typer.Option("out", help="The run directory train.py wrote (its --out-dir)."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step (default: the newest that verifies)."),
    prompt: str = typer.Option("", help="Text to continue (default: start a new document after end-of-text)."),
    max_new_tokens: int = typer.Option(200, min=1, help="Tokens to generate per sample."),
    temperature: float = typer.Option(0.8, min=0, help="Softmax temperature; 0 is greedy."),
    top_k: Optional[int] = typer.Option(None, min=1, help="Sample among the K most likely tokens only."),
    num_samples: int = typer.Option(1, min=1, help="Independent samples."),
    seed: int = typer.Option(0, min=0, help="Seed of the sampling."),
    device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", help="auto: CUDA when available."),
):
    """Generate text from a checkpoint of train.py."""
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    try:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ckpt.CheckpointError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu")
        model, meta, step = load_model(out_dir, step)
        if meta.get("tokenizer") is None:
            raise ckpt.CheckpointError(f"{out_dir} step {step}: the meta records no tokenizer (trained on data without "
                                       f"a manifest, or on synthetic tokens), so its tokens cannot become text")
        model, tokenizer = model.to(device), load_tokenizer(meta["tokenizer"], out_dir)
        # a model wider than its tokenizer (train.py --vocab-size) must not sample ids that have no text
        model.config.vocab_size = min(model.config.vocab_size, tokenizer.vocab_size)
        prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
        generator = torch.Generator(device=device).manual_seed(seed)
        for i in range(num_samples):
            if num_samples > 1:
                print(f"--- sample {i + 1} (step {step})")
            sys.stdout.write(prompt)
            stream_text(model, tokenizer, prompt_ids, max_new_tokens, temperature, top_k, generator)
    except (ckpt.CheckpointError, data.DataError) as e:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2)


if __name__ == "__main__":
    app()
