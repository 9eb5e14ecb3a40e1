"""train.py --fsdp on two gloo ranks on the CPU: DDP's training, the same checkpoints, exact resume.

The ranks are forked from this process, which has imported torch and train.py already (a torchrun
launch spends seconds importing them again for every run); they meet as torchrun's workers do,
through RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. When a rank dies the other is killed, as
torchrun kills the rest of a failed run."""
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ckpt
import train
from model import Mamba3LM, ModelConfig
from test_train import (BASE, assert_same_weights, corpus, losses, records, run,  # noqa: F401
                        weights)

# 8 sequences of 32 tokens per step: 2 micro-steps of 2 sequences on each of 2 ranks,
# 4 in one process
ARGS = [*BASE, "--batch-size", "2", "--max-steps", "20", "--save-every", "5"]


@pytest.fixture(autouse=True)
def one_thread():
    """One thread per process, as in the ranks: two threads each on two busy cores take several
    times longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rank(rank, port, args, log, fault):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # (not pytest's capture, which is the parent's)
    sys.stdout = sys.stderr = open(log, "w", buffering=1)
    os.dup2(sys.stdout.fileno(), 1)
    os.dup2(sys.stdout.fileno(), 2)
    if fault is not None:
        fault(rank)
    train.app([str(a) for a in args])  # exits: the rank's exit status


def launch(corpus, out, *extra, fault=None, codes=(0, 0)):
    """train.py on 2 ranks (DDP, or FSDP with --fsdp in `extra`); returns rank 0's output."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args, logs = (["--data", corpus, *ARGS, *extra, "--out-dir", out],
                  [f"{out}.{r}.log" for r in (0, 1)])
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_rank, args=(r, port, args, logs[r], fault)) for r in (0, 1)]
    for p in ranks:
        p.start()
    deadline = time.time() + 90
    while any(p.is_alive() for p in ranks):
        if any(p.exitcode not in (None, 0) for p in ranks) or time.time() > deadline:
            for p in ranks:
                p.kill()
        multiprocessing.connection.wait([p.sentinel for p in ranks], timeout=1)
    output = open(logs[0]).read()
    # (a code of a set: either; rank 0 may see its peer die and stop in one paragraph
    # before it is killed)
    found = tuple(p.exitcode for p in ranks)
    assert all(c in want if isinstance(want, set) else c == want
               for c, want in zip(found, codes)), (found, output + open(logs[1]).read())
    return output


def branch(src, dst, step):
    """A copy of run directory `src` with the checkpoints after `step` removed."""
    shutil.copytree(src, dst)
    for s, paths in ckpt.step_files(dst).items():
        for p in paths if s > step else []:
            p.unlink()
    return dst


def assert_close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert (abs(a[k] - b[k]) < tol if isinstance(a[k], float)
                else (a[k] - b[k]).abs().max() < tol), k


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The same 20 steps with FSDP and with DDP, saved every 5 (the last 3 kept)."""
    d = tmp_path_factory.mktemp("runs")
    header = launch(corpus, d / "fsdp", "--fsdp")
    assert "world size 2, FSDP" in header and "2 accumulation x 2 ranks" in header
    launch(corpus, d / "ddp")
    return d / "fsdp", d / "ddp"


def test_fsdp_trains_as_ddp_does(runs):
    fsdp, ddp = runs
    assert sorted(losses(fsdp)) == list(range(1, 21))
    assert_close(losses(fsdp), losses(ddp))
    for step in (10, 20):
        assert_close(weights(fsdp, step), weights(ddp, step))


def test_an_fsdp_checkpoint_is_any_checkpoint(runs):
    fsdp, ddp = runs
    assert not dist.is_initialized()  # one plain process reads it
    meta = ckpt.read_meta(fsdp, 20)
    model = Mamba3LM(ModelConfig(**meta["model_config"]))
    optimizer = torch.optim.AdamW(model.param_groups(0.1))
    ckpt.load(fsdp, 20, model, optimizer)
    assert_same_weights(weights(fsdp, 20), model.state_dict())
    # the optimizer file is keyed as DDP's is: by number, in the optimizer's order,
    # the tied tensor once
    ours, theirs = (torch.load(d / "optim_step_20.pt", weights_only=True)["optimizer"]
                    for d in runs)
    assert ([g["params"] for g in ours["param_groups"]]
            == [g["params"] for g in theirs["param_groups"]])
    assert (ours["state"].keys() == theirs["state"].keys()
            == set(range(len(list(model.parameters())))))
    for i, state in ours["state"].items():
        assert_close(state, theirs["state"][i])


def _two_optimizers(model):
    """Muon's split, with SGD standing in for it: the matrices in one optimizer, the rest in
    another."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.SGD(matrices, lr=0.1, momentum=0.9), torch.optim.AdamW(rest, lr=0.1)]


def _small_model_one_step(shard):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4))
    if shard:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    optimizers = _two_optimizers(model)
    torch.manual_seed(1)  # the same batch on each rank: the mean gradient is one process's
    model(torch.randn(6, 8)).square().mean().backward()
    for optimizer in optimizers:
        optimizer.step()
    return model, optimizers


def _save_and_reload_two_optimizers(rank, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ckpt.save(out, 1, *_small_model_one_step(shard=True), {})
    dist.barrier()
    model, optimizers = _small_model_one_step(shard=True)
    ckpt.load(out, 1, model, optimizers)
    ckpt.save(out, 2, model, optimizers, {})  # what the load set, gathered again
    dist.destroy_process_group()


def test_a_list_of_optimizers_of_a_sharded_model_is_saved_as_one_process_saves_it(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_save_and_reload_two_optimizers, args=(r, port, tmp_path))
             for r in (0, 1)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(90)
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in ranks] == [0, 0]
    ckpt.save(tmp_path / "plain", 1, *_small_model_one_step(shard=False), {})
    def optimizer_states(path):
        return torch.load(path, weights_only=True)["optimizer"]

    sharded = optimizer_states(tmp_path / "optim_step_1.pt")
    reloaded = optimizer_states(tmp_path / "optim_step_2.pt")
    plain = optimizer_states(tmp_path / "plain" / "optim_step_1.pt")
    assert len(sharded) == len(plain) == 2
    for ours, again, theirs in zip(sharded, reloaded, plain):
        assert ([g["params"] for g in ours["param_groups"]]
                == [g["params"] for g in theirs["param_groups"]])
        assert ours["state"].keys() == again["state"].keys() == theirs["state"].keys()
        for i in ours["state"]:
            assert_close(ours["state"][i], theirs["state"][i], tol=1e-6)
            assert all(torch.equal(v, again["state"][i][k]) for k, v in ours["state"][i].items())
    model, optimizers = _small_model_one_step(shard=False)
    ckpt.load(tmp_path, 1, model, optimizers)  # and one plain process reads it


def _sigterm_in_step_12(rank):
    """Rank 1 (which writes nothing) is sent SIGTERM in step 12: both finish it and save step 13."""
    real, calls = train.micro_step, []

    def micro_step(model, x, y, autocast):
        calls.append(1)
        if len(calls) == 2 * 12 + 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(model, x, y, autocast)

    train.micro_step = micro_step


def _die_in_the_second_save(rank):
    """Rank 1 is killed in the optimizer's gather of the run's 2nd save; rank 0, waiting
    in it, too."""
    import torch.distributed.checkpoint.state_dict as dcp  # ckpt.py imports it where used
    real, calls = dcp.get_optimizer_state_dict, []

    def gather(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dcp.get_optimizer_state_dict = gather


def test_fsdp_stops_on_a_signal_and_resumes_after_kill_9_in_a_save_bit_identically(
        runs, corpus, tmp_path):
    out = tmp_path / "run"
    assert "stopped by a signal on another rank at step 13" in launch(
        corpus, out, "--fsdp", fault=_sigterm_in_step_12)
    assert ckpt.list_steps(out) == [5, 10, 13]
    output = launch(corpus, out, "--fsdp", fault=_die_in_the_second_save,
                    codes=({2, -signal.SIGKILL}, -signal.SIGKILL))
    assert "Traceback" not in output and ("lost another rank" in output or "error" not in output)
    assert ckpt.list_steps(out) == [10, 13, 15]  # (and they verify:)
    assert all(ckpt.read_meta(out, step, verify=True) for step in (10, 13, 15))
    assert "resumed from" in launch(corpus, out, "--fsdp")
    assert losses(out) == losses(runs[0])  # exactly
    assert [r["step"] for r in records(out)] == list(range(1, 21))
    assert_same_weights(weights(runs[0], 20), weights(out, 20))


def test_checkpoints_resume_across_fsdp_ddp_and_one_process(runs, corpus, tmp_path):
    fsdp, ddp = runs
    to_ddp, to_one, to_fsdp = (tmp_path / name for name in ("to_ddp", "to_one", "to_fsdp"))
    launch(corpus, branch(fsdp, to_ddp, 15))
    run("--data", corpus, *ARGS, "--out-dir", branch(fsdp, to_one, 15))
    launch(corpus, branch(ddp, to_fsdp, 15), "--fsdp")
    for out in to_ddp, to_one, to_fsdp:
        assert "resume" in [r["event"] for r in records(out, "event")]
        assert_close(losses(out), losses(fsdp))
        assert_close(weights(out, 20), weights(fsdp, 20))


def _explode_a_padded_row_on_rank_1(rank):
    """In step 5, rank 1's shard of the embedding gets a row of 1e6. The row is padding that no
    token uses and no logit reads: the loss is unchanged, only max |w| on one rank shows it."""
    real, calls = train.micro_step, []

    def micro_step(model, x, y, autocast):
        calls.append(1)
        if len(calls) == 2 * 5 + 1 and rank == 1:
            assert model.config.padded_vocab > model.config.vocab_size
            with torch.no_grad():
                model.embed.weight.to_local()[-1] = 1e6
        return real(model, x, y, autocast)

    train.micro_step = micro_step


def test_weights_exploded_in_one_shard_roll_every_rank_back(corpus, tmp_path):
    out = tmp_path / "run"
    text = launch(corpus, out, "--fsdp", "--max-steps", 8, "--save-every", 3,
                  fault=_explode_a_padded_row_on_rank_1)
    assert "step 6: not saved: the weights have exploded" in text
    assert "restored the weights of step 3" in text
    assert ckpt.list_steps(out) == [3, 6, 8]
    assert max(t.abs().max() for t in weights(out, 8).values()) < 100


@pytest.mark.smoke
def test_fsdp_without_torchrun_is_a_world_of_one(runs, corpus, tmp_path):
    fsdp = runs[0]
    text = run("--data", corpus, *ARGS, "--fsdp", "--out-dir", branch(fsdp, tmp_path / "one", 15))
    assert ("world size 1, FSDP (without torchrun: nothing to shard)" in text
            and "resumed from" in text)
    assert not dist.is_initialized()  # the process group of one is gone with the run
    assert_close(losses(tmp_path / "one"), losses(fsdp))
    assert_close(weights(tmp_path / "one", 20), weights(fsdp, 20))
