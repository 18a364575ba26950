"""Two gloo processes on the CPU, spawned by the test: distributed training, Muon and curvature equal
the single-process results, and a failing rank ends the group instead of hanging it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from typer.testing import CliRunner

from curvlab import make_loss_fn, taylor_split
from curvlab.analysis.spectrum import SpectrumRequest, checkpoint_spectrum
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli import app
from curvlab.optim.muon import Muon
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.train import train
from tests.builders import SMALL_MODEL, init_group, leave_group, random_direction, small_config, spawn
from tests.reference import TinyTransformer

pytestmark = pytest.mark.heavy  # every test starts processes
WORLD = 2


def _matrices_and_grads():
    g = torch.Generator().manual_seed(0)
    shapes = [(48, 16), (16, 64), (32, 32), (8, 40), (40, 40)]
    params = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    return params, grads


def _muon_steps(params, grads):
    opt = Muon(params, lr=0.02, weight_decay=0.01)
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def _muon_worker(rank, tmp, world):
    init_group(rank, tmp, world, timeout=30)
    params, grads = _matrices_and_grads()
    out = _muon_steps(params, grads)
    if rank == 0:
        torch.save(out, f"{tmp}/muon.pt")
    leave_group()


def test_distributed_muon_step_equals_single_process(tmp_path):
    spawn(_muon_worker, tmp_path, WORLD)
    shared = torch.load(tmp_path / "muon.pt")
    params, grads = _matrices_and_grads()
    single = _muon_steps(params, grads)
    for a, b in zip(shared, single):
        assert torch.equal(a, b)  # each matrix orthogonalized by one rank, bit for bit the same


def _curvature_problem():
    torch.manual_seed(0)
    model = TinyTransformer().double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 11, (2, 6), generator=g), torch.randint(0, 11, (2, 6), generator=g)) for _ in range(4)]
    batches[1][1][0, :3] = -100  # uneven loss terms (ignored labels)
    return make_loss_fn(model), params, batches, random_direction(params, 3)


def _curvature_worker(rank, tmp, world):
    init_group(rank, tmp, world, timeout=30)
    loss_fn, params, batches, z = _curvature_problem()
    split = taylor_split(loss_fn, params, batches, z)
    if rank == 0:
        torch.save(split.to_dict(), f"{tmp}/split.pt")
    leave_group()


def test_distributed_curvature_equals_single_process(tmp_path):
    spawn(_curvature_worker, tmp_path, WORLD)
    shared = torch.load(tmp_path / "split.pt")
    loss_fn, params, batches, z = _curvature_problem()
    single = taylor_split(loss_fn, params, batches, z).to_dict()
    for key in ("loss", "first_order", "curvature_penalty", "realized", "nds", "grad_norm", "cosine"):
        assert shared[key] == pytest.approx(single[key], rel=1e-12, abs=1e-15), key
        assert shared["hidden"][key if key != "loss" else "nds"] == pytest.approx(
            single["hidden"][key if key != "loss" else "nds"], rel=1e-12
        )


def _config(data, out, optimizer):
    options = {"polar_dtype": "float32"} if optimizer == "muon" else {}
    return small_config(
        data, out, optimizer=optimizer, optimizer_options=options, steps=6, eval_every=3, ckpt_every=3, val_windows=8,
        device="cpu",
    )  # fmt: skip


def _train_worker(rank, tmp, world, data, optimizer):
    init_group(rank, tmp, world, timeout=30)
    train(_config(data, f"{tmp}/{optimizer}-2", optimizer), progress=False)
    leave_group()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_on_two_ranks_equals_one(pcfg_data, tmp_path, optimizer):
    spawn(_train_worker, tmp_path, WORLD, str(pcfg_data), optimizer)
    one = train(_config(pcfg_data, tmp_path / f"{optimizer}-1", optimizer), progress=False)
    two_dir = tmp_path / f"{optimizer}-2"
    assert [e["step"] for e in read_index(two_dir)] == [0, 3, 6]
    a = load_checkpoint(two_dir / "ckpt_000006.pt")  # written by rank 0, loads in one process
    b = load_checkpoint(tmp_path / f"{optimizer}-1" / "ckpt_000006.pt")
    for name, tensor in b["model"].items():
        diff = (a["model"][name] - tensor).abs()
        loose = diff > 1e-6 + 1e-4 * tensor.abs()
        # DDP sums gradients in another order; where a gradient is ~0, Adam's m/sqrt(v) turns that rounding
        # into steps of up to ~lr, so a few entries may move apart, but never far
        assert loose.float().mean() <= 1e-2, name
        assert diff.max() <= 1e-4, name
    assert a["val_loss"] == pytest.approx(one.val_loss, rel=1e-5)
    assert not any(p.name.startswith(".") for p in two_dir.iterdir())


def _failing_worker(rank, tmp, world):
    init_group(rank, tmp, world, timeout=20)
    if rank == 1:
        raise ValueError("rank 1 was given bad input on purpose")
    try:
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that is gone
    except RuntimeError:
        # gloo's "connection closed by peer": the gone rank's cause is the error to report, not this one
        # (spawn reports whichever error it meets first, and under load this one could come first). Exit at
        # once: tearing down a gloo group whose peer is gone aborts the process (SIGABRT), another error
        os._exit(0)
    dist.destroy_process_group()


def test_a_failing_rank_ends_the_group_with_its_cause(tmp_path):
    """The group ends with rank 1's own error, not with rank 0's lost connection (rank 0's collective
    gives up after 20 s at most, so a group left hanging still ends, and fails here with another cause)."""
    with pytest.raises(mp.ProcessRaisedException, match="bad input on purpose"):
        spawn(_failing_worker, tmp_path, WORLD)


def test_torchrun_cli_trains_and_resumes(pcfg_data, tmp_path):
    """`torchrun` is `python -m torch.distributed.run`: called that way, nothing depends on PATH."""
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "curvlab", "train", "--data", str(pcfg_data),
        "--out", str(out), "--optimizer", "adamw", "--steps", "4", "--ckpt-every", "2", "--batch-size", "8",
        "--warmup-steps", "1", "--val-windows", "8", "--device", "cpu", "--quiet",
        *[x for kv in SMALL_MODEL.items() for x in ("--model-opt", f"{kv[0]}={kv[1]}")],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trained adamw to step 4 on 2 ranks" in r.stdout
    assert [e["step"] for e in read_index(out)] == [0, 2, 4]
    again = subprocess.run([*cmd[:cmd.index("--steps") + 1], "5", *cmd[cmd.index("--steps") + 2 :]],
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert again.returncode != 0 and "steps: 4 -> 5" in again.stderr
    bad = subprocess.run([*cmd[:cmd.index("--data") + 1], str(tmp_path / "nowhere"), *cmd[cmd.index("--data") + 2 :]],
                         capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert bad.returncode != 0 and "error: rank" in bad.stderr and "no such data directory" in bad.stderr


SPECTRUM_ARGS = ["--top", "2", "--max-iter", "12", "--batches", "2", "--dtype", "float64"]


def _spectrum_worker(rank, tmp, world, ckpt):
    init_group(rank, tmp, world, timeout=30)
    r = CliRunner().invoke(app, ["spectrum", ckpt, *SPECTRUM_ARGS, "--out", f"{tmp}/spectrum"])
    Path(tmp, f"cli{rank}.txt").write_text(f"{r.exit_code}\n{r.output}")
    leave_group()


def test_spectrum_command_on_two_ranks_shares_the_batches_and_equals_one(pcfg_data, tmp_path):
    """`curvlab spectrum` runs inside distributed_context: on 2 ranks each evaluates one of the 2 batches
    and the HVPs are summed (a rank that kept its half alone would find another spectrum); rank 0
    prints and writes."""
    cfg = _config(pcfg_data, tmp_path / "run", "adamw")
    train(TrainConfig.from_dict({**cfg.to_dict(), "steps": 2, "ckpt_every": 2, "warmup_steps": 1}), progress=False)
    ckpt = str(tmp_path / "run" / "ckpt_000002.pt")
    spawn(_spectrum_worker, tmp_path, WORLD, ckpt)
    one = checkpoint_spectrum(ckpt, SpectrumRequest(top=2, max_iter=12), AnalysisSettings(batches=2, dtype="float64"))
    half = checkpoint_spectrum(ckpt, SpectrumRequest(top=2, max_iter=12), AnalysisSettings(batches=1, dtype="float64"))
    code0, *out0 = (tmp_path / "cli0.txt").read_text().split("\n")
    code1, *out1 = (tmp_path / "cli1.txt").read_text().split("\n")
    assert code0 == "0" and code1 == "0", out0 + out1
    assert "wrote" in "\n".join(out0) and not "".join(out1).strip()
    two = json.loads((tmp_path / "spectrum" / "spectrum.json").read_text())
    assert two["top"]["eigenvalues"] == pytest.approx(one.top.eigenvalues.tolist(), rel=1e-6)
    assert two["top"]["eigenvalues"] != pytest.approx(half.top.eigenvalues.tolist(), rel=1e-3)
