"""The README's commands stay true: CI runs exactly its full test command, and its quickstart names
real flags."""
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
            assert re.match(r"^[a-z]+>=[0-9.]+", line), line
