"""Plot training runs from their metrics.jsonl: loss, learning rate and throughput against
the tokens seen.

    python plot.py out --out run.png                    # one run
    python plot.py runs/small runs/tiny --out cmp.png   # several, named by directory

A run directory's metrics.jsonl holds one JSON object per line, with its "kind" (train, eval
or event) and "step". Train and eval records carry the "tokens" seen; for older runs that is
the step times config.json's total_batch_size. A step logged twice (redone after a crash)
counts as its later record.
"""
import json
from pathlib import Path
from typing import List

import typer
from rich.console import Console

from data import DataError, cli_errors, refuse_empty_path

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


class PlotError(ValueError):
    """Bad input: the message names the file, what was expected and what was found."""


def image_formats():
    """The image suffixes matplotlib writes, without their dot."""
    # matplotlib is slow to import, so --help and the refusals before this one skip it.
    from matplotlib.backend_bases import FigureCanvasBase
    return FigureCanvasBase.get_supported_filetypes()


def read_metrics(run_dir: Path) -> dict:
    """{"train": [records], "eval": [records]} of one run: each step's last record, with its
    tokens."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir}: expected a train.py run directory holding metrics.jsonl, "
                        "found none")
    by_step = {"train": {}, "eval": {}}
    # errors="replace": a line that is not text fails below, as invalid JSON, with its number.
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(f"{path}:{lineno}: expected one JSON object per line, found "
                                f"invalid JSON ({e})") from None
            # An event, or any other kind (a list even), is not drawn.
            if isinstance(rec, dict) and rec.get("kind") not in ("train", "eval"):
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise PlotError(f"{path}:{lineno}: expected a JSON object (train and eval "
                                f"records with an integer step), found {line[:80]!r}")
            # A step redone after a crash replaces the first attempt's record.
            by_step[rec["kind"]][rec["step"]] = rec
    metrics = {}
    for kind, records in by_step.items():
        metrics[kind] = [records[step] for step in sorted(records)]
    untold = [r for r in metrics["train"] + metrics["eval"] if "tokens" not in r]
    if not untold:
        return metrics
    # An older run did not log its tokens: its config.json gives the tokens per step.
    config = run_dir / "config.json"
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
    """(tokens, values) of one metric; a missing or null value (skipped steps only) is a
    gap."""
    tokens = [r["tokens"] for r in records]
    values = []
    for r in records:
        if r.get(key) is None:
            values.append(float("nan"))
        else:
            values.append(r[key])
    return tokens, values


def plot(runs: dict, out: Path):
    """Draw {name: read_metrics(...)} as three panels sharing the tokens axis, saved to
    `out`."""
    # Figure, not pyplot: no GUI backend, and no global figure to close.
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(9, 9))
    ax_loss, ax_lr, ax_speed = fig.subplots(3, 1, sharex=True, height_ratios=[2, 1, 1])
    for i, (name, m) in enumerate(runs.items()):
        color = f"C{i}"
        ax_loss.plot(*series(m["train"], "loss"), color=color, label=f"{name} train")
        if m["eval"]:
            ax_loss.plot(*series(m["eval"], "val_loss"), color=color, ls="--", marker="o",
                         ms=4, label=f"{name} val")
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


# path_type=str hands each path over as typed, so that an empty one can be refused.
@app.command()
def main(
    run_dirs: List[Path] = typer.Argument(..., metavar="RUN_DIR", path_type=str,
                                          help="train.py run directories (--out-dir), each "
                                          "with metrics.jsonl; several are overlaid, labelled "
                                          "with their directory names."),
    out: Path = typer.Option(..., "--out", "-o", path_type=str,
                             help="The image to write: .png (or another format matplotlib "
                             "writes, by its suffix: .svg, .pdf)."),
):
    """Plot train and validation loss, learning rate and tokens/s against tokens seen."""
    # Every input is checked before the image is drawn, so a refusal writes nothing.
    with cli_errors(PlotError, DataError):
        for run_dir in run_dirs:
            refuse_empty_path("RUN_DIR", run_dir)
        refuse_empty_path("--out", out)
        run_dirs = [Path(p) for p in run_dirs]
        out = Path(out)
        # The suffix picks the format, as matplotlib's savefig reads it.
        formats = image_formats()
        if out.suffix[1:].lower() not in formats:
            raise PlotError(f"--out {out}: expected an image suffix "
                            f"({', '.join(sorted(formats))}), found {out.suffix or 'none'}")
        names = [p.resolve().name for p in run_dirs]
        # runs/a/out and runs/b/out share a name: their paths tell them apart.
        if len(set(names)) < len(names):
            names = [str(p) for p in run_dirs]
        runs = {}
        for name, run_dir in zip(names, run_dirs):
            runs[name] = read_metrics(run_dir)
        try:
            plot(runs, out)
        # No such directory, a read-only one, a directory of that name, a full disk.
        except OSError as e:
            raise PlotError(f"--out {out}: could not write it ({e.strerror or e})") from None
    Console(highlight=False).print(f"wrote {out}", markup=False)


if __name__ == "__main__":
    app()
