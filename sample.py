"""Generate text from a checkpoint: prefill the prompt with the chunked scan, then decode one token at a time
with the O(1) recurrent step, streaming the text as it comes.

    python sample.py --ckpt out --prompt "def " --max-new-tokens 300 --temperature 0.8 --top-k 50
"""
import dataclasses
import sys
from pathlib import Path
from typing import Optional

import torch
import typer

import ckpt
import data
from model import Mamba3LM, ModelConfig
from prepare import load_tokenizer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def load_model(ckpt_dir, step=None, device="cpu"):
    """(model in eval mode, tokenizer, step) rebuilt from a checkpoint's meta: config, weights, tokenizer spec."""
    step = ckpt.latest_step(ckpt_dir) if step is None else step
    if step is None:
        raise ckpt.CheckpointError(f"{ckpt_dir}: no complete checkpoint found (expected model_step_N.safetensors, "
                                   f"optim_step_N.pt and meta_step_N.json)")
    meta = ckpt.read_meta(ckpt_dir, step)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{k: v for k, v in meta["model_config"].items() if k in fields})
    model = Mamba3LM(config)
    ckpt.load(ckpt_dir, step, model, map_location="cpu")
    spec = meta.get("tokenizer")
    if spec is None:
        raise ckpt.CheckpointError(f"{ckpt_dir} step {step}: the meta records no tokenizer (trained on data without a "
                                   f"manifest, or on synthetic tokens), so its tokens cannot be turned into text")
    tokenizer = load_tokenizer(spec, ckpt_dir)
    return model.to(device).eval(), tokenizer, step


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
    ckpt_dir: Path = typer.Option(..., "--ckpt", help="A train.py --out-dir (checkpoint directory)."),
    step: Optional[int] = typer.Option(None, help="Checkpoint step (default: the newest)."),
    prompt: str = typer.Option("", help="Text to continue (default: start a new document after end-of-text)."),
    max_new_tokens: int = typer.Option(200, help="Tokens to generate per sample."),
    temperature: float = typer.Option(0.8, help="Softmax temperature; 0 is greedy."),
    top_k: Optional[int] = typer.Option(None, help="Sample among the K most likely tokens only."),
    num_samples: int = typer.Option(1, help="Independent samples."),
    seed: int = typer.Option(0, help="Seed of the sampling."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Generate text from a checkpoint of train.py."""
    try:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model, tokenizer, step = load_model(ckpt_dir, step, device)
        prompt_ids = tokenizer.encode(prompt) if prompt else [tokenizer.eos_id]
        generator = torch.Generator(device=device).manual_seed(seed)
        for i in range(num_samples):
            if num_samples > 1:
                print(f"--- sample {i + 1} (step {step})")
            sys.stdout.write(prompt)
            stream_text(model, tokenizer, prompt_ids, max_new_tokens, temperature, top_k, generator)
    except (ckpt.CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2)


if __name__ == "__main__":
    app()
