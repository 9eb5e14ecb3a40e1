r"""Generate text from a checkpoint: prefill the prompt (the chunked scan on a CPU, the fused
Triton forward on a GPU), then decode one token at a time with the O(1) recurrent step,
streaming the text as it comes. Each sample is a new document: it starts after an
end-of-text token, as every document did in training.

    python sample.py --out-dir out --prompt "def " --max-new-tokens 300 \
        --temperature 0.8 --top-k 50
"""
from pathlib import Path
from typing import Literal, Optional

import torch
import typer

from ckpt import CheckpointError
from data import cli_errors, load_tokenizer, refuse_empty_path
from model import pick_device
from official import check_impl, load_model

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="rich")


def stream_text(tokens, tokenizer):
    """Print the text of `tokens` (model.stream's) as they come, up to the end-of-text token. A
    multi-byte character split across tokens shows once, whole."""
    ids = []
    shown = 0
    for token in tokens:
        if int(token[0]) == tokenizer.eos_id:
            break
        ids.append(int(token[0]))
        text = tokenizer.decode(ids)
        # A character that is still incomplete decodes as U+FFFD: it is held back.
        end = len(text.rstrip("\ufffd"))
        print(text[shown:end], end="", flush=True)
        shown = end
    print(tokenizer.decode(ids)[shown:])


# path_type=str hands --out-dir over as typed, so that an empty one can be refused.
@app.command()
def main(
    out_dir: Path = typer.Option("out", path_type=str, help="The run directory train.py wrote "
                                 "(its --out-dir)."),
    step: Optional[int] = typer.Option(None, min=0, help="Checkpoint step (default: the "
                                       "newest that verifies)."),
    prompt: str = typer.Option("", help="Text that begins each sample, a new document "
                               "(after end-of-text, as in training)."),
    max_new_tokens: int = typer.Option(200, min=1, help="Tokens to generate per sample."),
    temperature: float = typer.Option(0.8, min=0, help="Softmax temperature; 0 is greedy."),
    top_k: Optional[int] = typer.Option(None, min=1, help="Sample among the K most likely "
                                        "tokens."),
    num_samples: int = typer.Option(1, min=1, help="Independent samples."),
    seed: int = typer.Option(0, min=0, max=2**63 - 1, help="Seed of the sampling."),
    device: Literal["auto", "cpu", "cuda"] = typer.Option("auto", help="auto: CUDA if "
                                                          "present."),
):
    """Generate text from a checkpoint of train.py."""
    # ValueError: an empty path, data.DataError, pick_device's refusal.
    with cli_errors(CheckpointError, ValueError):
        refuse_empty_path("--out-dir", out_dir)
        out_dir = Path(out_dir)
        device = pick_device(device)
        model, meta, step = load_model(out_dir, step)
        if meta.get("tokenizer") is None:
            raise CheckpointError(f"{out_dir} step {step}: the meta records no tokenizer "
                                  "(trained on data without a manifest, or on synthetic "
                                  "tokens), so its tokens cannot become text")
        model = model.to(device)
        tokenizer = load_tokenizer(meta["tokenizer"], out_dir)
        # A MAMBA3_IMPL that cannot run here is one sentence, before any text.
        check_impl(model)
        # A model wider than its tokenizer (train.py --vocab-size) must not sample ids that
        # have no text.
        model.config.vocab_size = min(model.config.vocab_size, tokenizer.vocab_size)
        # A sample is a new document, which in training always followed an end-of-text
        # token; the prompt, if any, is its beginning. eval.py starts its contexts alike.
        prompt_ids = [tokenizer.eos_id] + tokenizer.encode(prompt)
        idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        # One generator for all the samples, so that a --seed gives the same ones every time.
        generator = torch.Generator(device=device).manual_seed(seed)
        for i in range(num_samples):
            if num_samples > 1:
                print(f"--- sample {i + 1} (step {step})")
            print(prompt, end="")
            tokens = model.stream(idx, max_new_tokens, temperature, top_k, generator)
            stream_text(tokens, tokenizer)


if __name__ == "__main__":
    app()
