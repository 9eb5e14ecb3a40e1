"""Plot training runs from their metrics.jsonl: loss, learning rate and throughput against tokens.

    python plot.py out --out run.png                     # one run
    python plot.py runs/small runs/tiny --out cmp.png    # several, overlaid, named by directory

A run directory's metrics.jsonl holds one JSON object per line ("kind" train, eval or event, and
the "step"); train and eval records carry the "tokens" seen (older runs': step x config.json's
total_batch_size). A step logged twice (redone after a crash) counts as its later record.
"""
import json
from pathlib import Path
from typing import List

import typer
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figure to close
from matplotlib.ticker import EngFormatter
from rich.console import Console

from data import cli_errors

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


class PlotError(ValueError):
    """Bad input: the message names the file, what was expected and what was found."""


def read_metrics(run_dir: Path) -> dict:
    """{"train": [records], "eval": [records]} of one run: each step's last, with its tokens."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: expected a train.py run directory holding metrics.jsonl, "
                        "found none")
    by_step = {"train": {}, "eval": {}}
    # errors="replace": a line that is not text fails below, as invalid JSON, with its number
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in ((n, line) for n, line in enumerate(f, 1) if line.strip()):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path}:{lineno}: expected one JSON object per line, found "
                                f"invalid JSON ({e})") from None
            if isinstance(rec, dict) and rec.get("kind") not in ("train", "eval"):
                continue  # an event (or any other kind, a list even): not drawn
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise PlotError(f"{path}:{lineno}: expected a JSON object (train and eval records "
                                f"with an integer step), found {line[:80]!r}")
            by_step[rec["kind"]][rec["step"]] = rec  # a redone step replaces the first attempt's
    metrics = {kind: [recs[s] for s in sorted(recs)] for kind, recs in by_step.items()}
    if untold := [r for r in metrics["train"] + metrics["eval"] if "tokens" not in r]:
        config = run_dir / "config.json"  # an older run's: tokens per step from its config
        try:
            n = json.loads(config.read_text()).get("total_batch_size")
        except (OSError, ValueError, AttributeError) as e:
            raise PlotError(f"{config}: expected train.py's config with total_batch_size (tokens "
                            f"per step), could not read it ({e})") from None
        if not isinstance(n, int) or n < 1:
            raise PlotError(f"{config}: expected total_batch_size to be a positive number of "
                            f"tokens, found {n!r}")
        for rec in untold:
            rec["tokens"] = rec["step"] * n
    return metrics


def series(records, key):
    """(tokens, values) of one metric; a missing or null value (skipped steps only) is a gap."""
    values = [float("nan") if r.get(key) is None else r[key] for r in records]
    return [r["tokens"] for r in records], values


def plot(runs: dict, out: Path):
    """Draw {name: read_metrics(...)} as three panels sharing the tokens axis, saved to `out`."""
    fig = Figure(figsize=(9, 9))
    ax_loss, ax_lr, ax_speed = fig.subplots(3, 1, sharex=True, height_ratios=[2, 1, 1])
    for i, (name, m) in enumerate(runs.items()):
        color = f"C{i}"
        ax_loss.plot(*series(m["train"], "loss"), color=color, label=f"{name} train")
        if m["eval"]:
            ax_loss.plot(*series(m["eval"], "val_loss"), color=color, ls="--", marker="o", ms=4,
                         label=f"{name} val")
        ax_lr.plot(*series(m["train"], "lr"), color=color)
        ax_speed.plot(*series(m["train"], "tok_per_s"), color=color)
    ax_loss.set(ylabel="loss", title="loss (solid: train, dashed: validation)")
    ax_loss.legend()
    ax_lr.set(ylabel="learning rate")
    ax_speed.set(ylabel="tokens/s", xlabel="tokens seen")
    ax_speed.yaxis.set_major_formatter(EngFormatter())
    ax_speed.xaxis.set_major_formatter(EngFormatter())
    for ax in (ax_loss, ax_lr, ax_speed):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


@app.command()
def main(
    run_dirs: List[Path] = typer.Argument(..., metavar="RUN_DIR", help="train.py run directories "
                                          "(--out-dir), each with metrics.jsonl; several are "
                                          "overlaid, labelled with their directory names."),
    out: Path = typer.Option(..., "--out", "-o", help="The image to write: .png (or another format "
                             "matplotlib writes, by its suffix: .svg, .pdf)."),
):
    """Plot train and validation loss, learning rate and tokens/s against tokens seen."""
    with cli_errors(PlotError):
        formats = FigureCanvasBase.get_supported_filetypes()
        if out.suffix[1:].lower() not in formats:
            raise PlotError(f"--out {out}: expected an image suffix "
                            f"({', '.join(sorted(formats))}), found {out.suffix or 'none'}")
        names = [p.resolve().name for p in run_dirs]
        if len(set(names)) < len(names):  # runs/a/out and runs/b/out: the paths tell them apart
            names = [str(p) for p in run_dirs]
        runs = {name: read_metrics(p) for name, p in zip(names, run_dirs)}
        try:
            plot(runs, out)
        except OSError as e:  # no such directory, a read-only one, one of that name, a full disk
            raise PlotError(f"--out {out}: could not write it ({e.strerror or e})") from None
    Console(highlight=False).print(f"wrote {out}", markup=False)


if __name__ == "__main__":
    app()
