"""The README's commands stay true: CI runs exactly its full test command, and its quickstart names
real flags."""
import ast
import re
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands():
    text = (ROOT / "README.md").read_text()
    quickstart = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in quickstart.splitlines() if line.startswith("    pip install")]


@pytest.mark.smoke
def test_ci_runs_the_readme_full_test_command():
    run_cmd, smoke_cmd, full_cmd = quickstart_commands()
    assert "train.py" in run_cmd
    assert smoke_cmd.endswith("python -m pytest -q")
    assert full_cmd == smoke_cmd + " --full"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert full_cmd in ci, f"{full_cmd!r} is not a line of .ci/run"


@pytest.mark.smoke
def test_quickstart_uses_existing_files_and_flags():
    import sample
    import train

    run_cmd = quickstart_commands()[0]
    for script, app in (("train.py", train.app), ("sample.py", sample.app)):
        part = run_cmd.split(f"python {script}", 1)[1].split("&&")[0]
        flags = re.findall(r"--[a-z-]+", part)
        names = {opt for p in typer.main.get_command(app).params for opt in p.opts}
        assert flags and set(flags) <= names, (script, flags)
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            assert re.match(r"^[a-z][a-z0-9_-]*>=[0-9.]+", line), line


def compressed_idioms(tree):
    """Where a line packs what plain statements would say: a walrus, a string or list multiplied by
    a condition, a generator unpacked into names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.NamedExpr):
            found.append((node.lineno, "walrus"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for seq, cond in ((node.left, node.right), (node.right, node.left)):
                is_seq = isinstance(seq, (ast.List, ast.Tuple, ast.JoinedStr))
                if isinstance(seq, ast.Constant) and isinstance(seq.value, str):
                    is_seq = True
                is_cond = isinstance(cond, (ast.Compare, ast.BoolOp))
                if isinstance(cond, ast.Call) and getattr(cond.func, "id", "") == "bool":
                    is_cond = True
                if is_seq and is_cond:
                    found.append((node.lineno, "sequence * condition"))
                    break
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.GeneratorExp):
            if any(isinstance(t, ast.Tuple) for t in node.targets):
                found.append((node.lineno, "generator unpacked"))
    return found


@pytest.mark.smoke
def test_the_product_files_read_plainly():
    # The signs that a line needs no decoding, measured on the product files (bench.py aside):
    # next to no packed idioms, few lines near the 100-column limit, comments on their own lines.
    files = sorted(p for p in ROOT.glob("*.py") if p.name != "bench.py")
    idioms = []
    chars = 0
    nonblank = 0
    for path in files:
        text = path.read_text()
        lines = text.splitlines()
        idioms += [(path.name, *hit) for hit in compressed_idioms(ast.parse(text))]
        long = [line for line in lines if 96 <= len(line) <= 100]
        assert len(long) <= 0.03 * len(lines), f"{path.name}: {len(long)} lines of 96-100 chars"
        comments = [line for line in lines if line.strip().startswith("#")]
        if path.stem in ("train", "data", "ckpt", "prepare", "official"):
            assert len(comments) >= 0.10 * len(lines), f"{path.name}: {len(comments)} comments"
        for line in lines:
            if line.strip():
                chars += len(line)
                nonblank += 1
    assert len(idioms) <= 5, idioms
    assert chars / nonblank <= 56, f"mean non-blank line {chars / nonblank:.1f} characters"
