import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

# Triton kernels are tested on CPU tensors through Triton's interpreter. The variable must be set
# before triton is first imported, which is why it lives here and not in a fixture.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="Run the full suite (what CI runs), not only the smoke tier.")


def pytest_collection_modifyitems(config, items):
    """Keep the smoke tier (tests marked smoke) unless --full is given or tests are named.

    A plain `python -m pytest -q` is the quick check a newcomer runs first, so it runs the tests
    marked smoke: every module and command line touched once, at tiny shapes. Naming files or
    tests on the command line runs all of them, as a developer working on one file expects.
    """
    if config.getoption("--full"):
        return
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return
    smoke = []
    others = []
    for item in items:
        if item.get_closest_marker("smoke"):
            smoke.append(item)
        else:
            others.append(item)
    config.hook.pytest_deselected(items=others)
    items[:] = smoke


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def sigterm_in_step(monkeypatch):
    """stop(step) makes train.py's next in-process run get SIGTERM in the first of the two
    micro-steps of `step` (steps count from 0): it finishes that step, saves step + 1 and
    exits 0. resume() puts the real micro_step back."""
    import signal

    import train

    real = train.micro_step

    def stop(step):
        calls = []

        def interrupted(model, x, y, autocast):
            calls.append(1)
            if len(calls) == 2 * step + 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return real(model, x, y, autocast)

        monkeypatch.setattr(train, "micro_step", interrupted)

    def resume():
        monkeypatch.setattr(train, "micro_step", real)

    return SimpleNamespace(stop=stop, resume=resume)


_passed = 0


def pytest_runtest_logreport(report):
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session, exitstatus):
    # A run in which nothing passed (everything skipped or deselected) is not a green run.
    if exitstatus == 0 and _passed == 0:
        session.exitstatus = 5
