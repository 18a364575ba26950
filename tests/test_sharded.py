"""Sharded parameters (FSDP2 and plain DTensors) on 2 and 4 gloo processes on the CPU, spawned by the test:
HVPs, quadratic forms, NDS, the Taylor split (both scopes) and the block matrix equal the one-process
results on the same global batch, the finite-difference HVP lies within its stated error, and bad input
gets one-line errors."""

import contextlib
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from typer.testing import CliRunner

from curvlab import block_matrix, forward_quadratic_forms, hvp, make_loss_fn, nds, taylor_split
from curvlab.analysis.sharded import open_sharded_checkpoint
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli import app
from curvlab.curvature.sharded_spectral import random_direction as sharded_random_direction
from curvlab.curvature.sharded_spectral import sharded_hutchinson, sharded_lanczos
from curvlab.curvature.spectral import lanczos
from curvlab.engine import params as param_dicts
from curvlab.engine.dtensors import full, shard_like
from curvlab.engine.finite_difference import finite_difference_hvp
from curvlab.engine.hvp import CurvaturePoint
from curvlab.engine.operator import hessian_operator
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, MICRO_OVERRIDES, get_config
from curvlab.optim.build import build_optimizer
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.dcp import convert_to_sharded, read_meta
from curvlab.runs.match import MatchCriteria
from curvlab.runs.metrics import METRICS_FILE
from curvlab.runs.sharded_train import train_sharded
from curvlab.runs.train import TrainingDiverged, train
from curvlab.steps.update import next_update
from curvlab.studies.compare import compare_runs
from curvlab.studies.track import track_run
from tests.builders import SMALL_MODEL, init_group, leave_group, random_direction, small_config, spawn

REL = 1e-10
# vocabulary 322 and block size 30: row counts that 4 ranks don't divide (uneven shards)
MODEL = {**MICRO_OVERRIDES, "vocab_size": 322, "block_size": 30}


def _init(rank, tmp, world, timeout=60):
    """Join :func:`~tests.builders.spawn`'s group; returns the ranks' CPU mesh."""
    init_group(rank, tmp, world, timeout)
    return init_device_mesh("cpu", (world,))


def _model():
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **MODEL)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name:  # LayerNorm gains away from 1, so that their curvature is not special
                p.add_(0.1 * torch.randn_like(p))
    return model


def _problem():
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, MODEL["vocab_size"], (2, 12), generator=g) for _ in range(4)]
    batches = [(x, x.clone()) for x in batches]
    batches[1][1][0, :4] = -100  # uneven loss terms (ignored labels); the shared batch keeps its own labels
    return model, params, batches, random_direction(params, 3), random_direction(params, 4)


def _measure(loss_fn, params, batch, v, z, everything=True):
    """The curvature quantities the suite compares, as plain (gathered) tensors and floats: at one point,
    the Taylor split and the block matrix, and with ``everything`` the one-point shortcuts and the
    finite-difference HVP too."""
    out = {}
    stacked = {n: torch.stack([v[n], z[n]]) for n in v}
    with CurvaturePoint(loss_fn, params, batch) as point:
        out["loss"] = point.loss
        out["gradient"] = full(point.gradient)
        out["hvp"] = full(point.hvp(v))
        out["hvps"] = full(point.hvps(stacked))
        out["point_qf"] = point.quadratic_forms(stacked)
    out["split"] = taylor_split(loss_fn, params, batch, z).to_dict()
    out["blocks"] = block_matrix(loss_fn, params, batch, z).to_dict()
    if everything:
        out["qf"] = forward_quadratic_forms(loss_fn, params, batch, stacked)
        out["hvp_fn"] = full(hvp(loss_fn, params, batch, v))
        out["nds"] = nds(loss_fn, params, batch, z)
        fd = finite_difference_hvp(loss_fn, params, batch, v)
        out["fd"] = (full(fd.hvp), fd.to_dict())
    return out


def _sharded_worker(rank, tmp, world, how):
    mesh = _init(rank, tmp, world)
    model, params, batches, v, z = _problem()
    if how == "fsdp":
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = {k: p.detach() for k, p in model.named_parameters()}
    else:  # plain DTensor parameters, rows split over the ranks
        sharded = {k: distribute_tensor(p, mesh, [Shard(0)]) for k, p in params.items()}
    loss_fn = make_loss_fn(model)
    vs, zs = shard_like(v, sharded), shard_like(z, sharded)
    # 2 ranks: every quantity, on batches shared out over the ranks and on one batch that each rank
    # computes whole; 4 ranks (slow on CI's 2 cores): the point, the split and the block matrix, shared out
    results = {"shared": _measure(loss_fn, sharded, batches, vs, zs, everything=world == 2)}
    if world == 2:
        results["one"] = _measure(loss_fn, sharded, batches[1], vs, zs)
    results["local_rows"] = sharded["lm_head.weight"].to_local().shape[0]
    errors = {}
    try:
        hvp(loss_fn, sharded, batches, vs, method="fwd_rev")
    except CurvlabError as e:
        errors["fwd_rev"] = str(e)
    try:
        hvp(loss_fn, sharded, batches, v)  # plain directions for sharded parameters
    except CurvlabError as e:
        errors["plain"] = str(e)
    try:
        block_matrix(loss_fn, sharded, batches, zs, block_method="alpha")
    except CurvlabError as e:
        errors["alpha"] = str(e)
    try:
        hessian_operator(loss_fn, sharded, batches)
    except CurvlabError as e:
        errors["operator"] = str(e)
    leave_group()
    try:
        hvp(loss_fn, sharded, batches, vs)  # the process group is gone
    except CurvlabError as e:
        errors["no_group"] = str(e)
    if rank == 0:
        torch.save({"results": results, "errors": errors}, f"{tmp}/out.pt")


def _close(a, b, what):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _close(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        scale = b.abs().max()
        assert float((a - b).abs().max()) <= REL * float(scale), what
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=REL, abs=1e-14, nan_ok=True), what  # (a NaN where both have one)
    else:
        assert a == b, what


@pytest.mark.heavy
@pytest.mark.parametrize("world,how", [(2, "fsdp"), (4, "dtensor")])
def test_sharded_curvature_equals_one_process(tmp_path, world, how):
    spawn(_sharded_worker, tmp_path, world, how)
    saved = torch.load(tmp_path / "out.pt", weights_only=False)
    model, params, batches, v, z = _problem()
    loss_fn = make_loss_fn(model)
    results = saved["results"]
    assert results["local_rows"] == -(-MODEL["vocab_size"] // world)  # rank 0's shard: sharded for real
    for name, batch in (("shared", batches), ("one", batches[1]))[: len(results) - 1]:
        got, want = results[name], _measure(loss_fn, params, batch, v, z, everything=world == 2)
        if world == 2:
            # the finite-difference HVP lies within its stated error of the exact one, and that error is small
            (fd, record), (_, record_one) = got.pop("fd"), want.pop("fd")
            diff = sum(float((fd[n] - want["hvp"][n]).norm()) ** 2 for n in params) ** 0.5
            norm = sum(float(t.norm()) ** 2 for t in want["hvp"].values()) ** 0.5
            assert diff <= record["error"] <= 1e-7 * norm, name
            assert record["error"] == pytest.approx(record_one["error"], rel=0.5)
        _close(got, want, name)
    errors = saved["errors"]
    assert "fwd_rev" in errors["fwd_rev"] and "refused" in errors["fwd_rev"] and "\n" not in errors["fwd_rev"]
    assert "plain tensor but the parameter is sharded" in errors["plain"]
    assert "no torch.distributed process group" in errors["no_group"]
    assert "block_method='hvp'" in errors["alpha"] and "sharded_lanczos" in errors["operator"]
    assert all("\n" not in m for m in errors.values())


def _updates(model, loss_fn, optimizer, batches):
    """Z at a fresh optimizer, one real step with that G, then G and Z at the next point: gathered."""
    options = {"polar_dtype": "float32"} if optimizer == "muon" else {}
    opt = build_optimizer(optimizer, model, **options)
    g1, z1 = next_update(model, opt, loss_fn, batches[:2], dtype=torch.float64)
    named = dict(model.named_parameters())
    for n, g in g1.items():
        named[n].grad = g.clone()
    opt.step()
    g2, z2 = next_update(model, opt, loss_fn, batches[2:], dtype=torch.float64)
    return {"z1": full(z1), "g2": full(g2), "z2": full(z2)}


def _update_worker(rank, tmp, world, optimizer):
    mesh = _init(rank, tmp, world)
    model, _, batches, _, _ = _problem()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out = _updates(model, make_loss_fn(model), optimizer, batches)
    placements = {tuple(p.placements) for p in model.parameters()}
    leave_group()
    if rank == 0:
        torch.save({"out": out, "placements": placements}, f"{tmp}/update.pt")


@pytest.mark.heavy
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_next_update_under_fsdp2_equals_one_process(tmp_path, optimizer):
    spawn(_update_worker, tmp_path, 2, optimizer)
    saved = torch.load(tmp_path / "update.pt", weights_only=False)
    assert saved["placements"] == {(Shard(0),)}  # the parameters stayed sharded through the steps
    model, _, batches, _, _ = _problem()
    want = _updates(model, make_loss_fn(model), optimizer, batches)
    rel = 1e-10 if optimizer == "adamw" else 1e-6  # Muon: float32 Newton-Schulz
    for key, tensors in want.items():
        for n, t in tensors.items():
            got = saved["out"][key][n]
            assert float((got - t).abs().max()) <= rel * float(t.abs().max()), (key, n)


def _one_process_hvp(model, params, batches, v):
    """The unsharded HVP, computed in a worker before its process group exists (plain parameters under
    one are shared out as data parallel): a fresh process like the ranks, not the test's own, whose
    global state earlier tests may have changed."""
    with CurvaturePoint(make_loss_fn(model), params, batches) as point:
        return point.hvp(v)


# the dead-rank test's process-group timeout from the failure on (set-up runs under _init's 60 s): 4 s for
# a stalled rank (the wait under test); 10 s for a dead one, whose two survivors must meet in the roll call
# within a quarter of it although the load may delay either (one may wait out the timeout in the failed
# collective first)
FAILURE_TIMEOUT_S = {"stall": 4, "exit": 10}
STALL_GUARD_S = 120  # how long the stalled rank waits for rank 0 to give up on it (a hang guard)


def _failing_worker(rank, tmp, world, how):
    """One HVP on every rank; then rank 1 stalls, or its process exits, as the second starts: the others'
    HVP fails, and each rank that survives writes its error. A stalled rank 1 stalls until rank 0 has
    written its error, and says whether that is what ended its stall (``released``) or the hang guard."""
    model, params, batches, v, z = _problem()
    reference = _one_process_hvp(model, params, batches, v) if rank == 0 else None
    mesh = _init(rank, tmp, world)
    sharded = {k: distribute_tensor(p, mesh, [Shard(0)]) for k, p in params.items()}
    point = CurvaturePoint(make_loss_fn(model), sharded, batches)
    first = full(point.hvp(shard_like(v, sharded)))
    if rank == 0:
        torch.save({"sharded": first, "one_process": reference}, f"{tmp}/first.pt")
    zs = shard_like(z, sharded)
    dist.barrier()  # every rank is set up: the timeout under test holds from here
    _set_pg_timeout(datetime.timedelta(seconds=FAILURE_TIMEOUT_S[how]))
    if rank == 1:
        if how == "exit":
            os._exit(0)  # dies (a clean exit code, so that the spawn waits for the others' errors)
        deadline = time.monotonic() + STALL_GUARD_S
        while not (released := Path(tmp, "error0.txt").is_file()) and time.monotonic() < deadline:
            time.sleep(0.2)  # stalls until rank 0 has given up on it
        Path(tmp, "stall1.txt").write_text("released" if released else "hang guard")
        os._exit(0)
    try:
        point.hvp(zs)
    except CurvlabError as e:
        Path(tmp, f"error{rank}.txt").write_text(str(e))
    os._exit(0)  # (no teardown: the process group is broken)


@pytest.mark.heavy
@pytest.mark.parametrize("how,world", [("stall", 2), ("exit", 3)])
def test_a_rank_that_dies_or_stalls_mid_hvp_is_named_by_every_surviving_rank(tmp_path, how, world):
    spawn(_failing_worker, tmp_path, world, how)
    for rank in {0, 2} & set(range(world)):  # every survivor, rank 0 (which hosts the store) and not
        message = Path(tmp_path, f"error{rank}.txt").read_text()
        assert message.startswith(f"rank 1 of {world} died or stalled during hvps: a collective failed on rank {rank}")
        assert "\n" not in message
    if how == "stall":  # named while rank 1 still stalled: the group's timeout ended the wait, not rank 1's exit
        assert (tmp_path / "stall1.txt").read_text() == "released"
    # the HVP before the failure: on 3 ranks, 4 batches share out unevenly (one rank runs a weight-0 batch)
    first = torch.load(tmp_path / "first.pt")
    _close(first["sharded"], first["one_process"], "hvp")


STRESS_REL = 1e-12  # float64 reduction-order noise is 1.8e-15 here (8 eps); the incident was 1.35e-10
STRESS_SPAWNS, STRESS_REPEATS = 5, 5  # per half: 5 fresh sets of 3 ranks, each 5 HVPs (25 alone, 25 loaded)


def _repeat_worker(rank, tmp, world, repeats):
    """The dead-rank test's 3-rank uneven-shard HVP, ``repeats`` times (a new point each), and rank 0's
    one-process HVP in this fresh process."""
    model, params, batches, v, _ = _problem()
    reference = _one_process_hvp(model, params, batches, v) if rank == 0 else None
    mesh = _init(rank, tmp, world)
    sharded = {k: distribute_tensor(p, mesh, [Shard(0)]) for k, p in params.items()}
    vs = shard_like(v, sharded)
    got = []
    for _ in range(repeats):
        with CurvaturePoint(make_loss_fn(model), sharded, batches) as point:
            got.append(full(point.hvp(vs)))
    leave_group()
    if rank == 0:
        torch.save({"one_process": reference, "sharded": got}, f"{tmp}/repeats.pt")


def _relative_error(got, want):
    """max over tensors of max|got - want| / max|want| (what _close bounds by REL)."""
    return max(float((got[n] - want[n]).abs().max()) / float(want[n].abs().max()) for n in want)


@pytest.mark.heavy
@pytest.mark.slow
def test_the_sharded_hvp_equals_one_process_in_every_repeat_alone_and_under_load(tmp_path):
    """50 HVPs of 3 DTensor-sharded ranks (uneven shards and shares), each within float64 reduction-order
    noise of the one-process HVP of a fresh process; half of them with a busy loop on every core. The
    fresh processes' one-process HVPs equal this process's too. (Slow: python -m pytest -m slow.)

    Written after one CI run of the dead-rank test saw 1.35e-10 against a reference computed in the
    pytest process. Not reproduced (this test: at most 1.77e-15, the same value every repeat). The global
    state earlier tests could change moves the reference by at most 2e-17 of its largest entry: torch's
    thread count 1-16, flush-denormal, mkldnn off, deterministic algorithms, float32 matmul precision;
    the ranks give bit-identical HVPs on 1 and 2 threads; the suite's only global change,
    set_num_threads(1) in the compare/track test, is restored. So no such state explains 1e-10 (which is
    10^5 times float64 reduction-order noise); the reference is now computed in a fresh process anyway."""
    model, params, batches, v, _ = _problem()
    here = _one_process_hvp(model, params, batches, v)
    errors, load = {}, {}
    for half in ("alone", "loaded"):
        cores = len(os.sched_getaffinity(0))
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores * (half == "loaded"))]
        try:
            for i in range(STRESS_SPAWNS):
                run = tmp_path / f"{half}-{i}"
                run.mkdir()
                spawn(_repeat_worker, run, 3, STRESS_REPEATS)
                saved = torch.load(run / "repeats.pt")
                errors[half, "one process", i] = _relative_error(saved["one_process"], here)
                for j, hv in enumerate(saved["sharded"]):
                    errors[half, "sharded", i, j] = _relative_error(hv, saved["one_process"])
            load[half] = os.getloadavg()[0]
        finally:
            for p in busy:
                p.kill()
                p.wait()
    assert len(errors) == 2 * STRESS_SPAWNS * (STRESS_REPEATS + 1)
    for half, what in [(h, w) for h in load for w in ("sharded", "one process")]:  # (shown with pytest -s)
        mine = [e for k, e in errors.items() if k[:2] == (half, what)]
        print(f"{half} (load {load[half]:.1f}), {what}: {len(mine)} errors, largest {max(mine):.3g}")
    worst = max(errors, key=errors.get)
    assert errors[worst] <= STRESS_REL, {k: e for k, e in errors.items() if e > STRESS_REL}


def _convert_worker(rank, tmp, world, ckpt):
    _init(rank, tmp, world)
    convert_to_sharded(load_checkpoint(ckpt), Path(tmp, "sharded"))
    leave_group()


@pytest.mark.heavy
def test_nds_on_a_sharded_checkpoint_under_torchrun_equals_the_unsharded_run(pcfg_data, tmp_path):
    train(_train_config(pcfg_data, tmp_path / "run", "muon", steps=2), progress=False)
    ckpt = tmp_path / "run" / "ckpt_000002.pt"
    spawn(_convert_worker, tmp_path, 2, str(ckpt))
    sharded = tmp_path / "sharded"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    options = ["--dtype", "float64", "--batches", "2", "--device", "cpu"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "curvlab"]
    r = subprocess.run(
        [*cmd, "nds", str(sharded), "--fsdp", "--out", str(tmp_path / "sharded.json"), *options],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "curvlab", "nds", str(ckpt), "--out", str(tmp_path / "one.json"), *options],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("sharded.json", "one.json"))
    for d in (got, want):
        d.pop("checkpoint"), d.pop("timing"), d.pop("digests", None)  # (the files: their names, times, digests)
    _close(got, want, "report")
    # curvlab train --fsdp writes sharded checkpoints that nds --fsdp reads
    fsdp_run = tmp_path / "fsdp-run"
    trained = subprocess.run(
        [*cmd, "train", "--fsdp", "--data", str(pcfg_data), "--out", str(fsdp_run), "--optimizer", "muon",
         "--opt", "polar_dtype=float32", "--steps", "2", "--ckpt-every", "2", "--batch-size", "4",
         "--warmup-steps", "1", "--val-windows", "8", "--device", "cpu", "--quiet",
         *[x for kv in SMALL_MODEL.items() for x in ("--model-opt", f"{kv[0]}={kv[1]}")]],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "trained muon to step 2 on 2 ranks" in trained.stdout
    assert [e["path"] for e in read_index(fsdp_run)] == ["ckpt_000000", "ckpt_000002"]
    assert (fsdp_run / "ckpt_000002" / "curvlab.json").is_file()
    # another world size, another model config: one line each
    with pytest.raises(CurvlabError, match=r"written by 2 ranks, opened on 1"):
        open_sharded_checkpoint(sharded)
    meta = json.loads((sharded / "curvlab.json").read_text())
    meta["config"]["model_overrides"]["n_embd"] = 48
    (sharded / "curvlab.json").write_text(json.dumps(meta))
    with pytest.raises(CurvlabError, match=r"from another model config"):
        open_sharded_checkpoint(sharded)


@pytest.mark.heavy
def test_a_one_rank_sharded_checkpoint_is_written_under_torchrun_and_gives_the_unsharded_nds(pcfg_data, tmp_path):
    """``torchrun --nproc_per_node 1 experiments/to_sharded.py`` (a one-rank process group, started by
    distributed_context under torchrun), then ``nds --fsdp`` on one rank equals the unsharded checkpoint's
    (both in fresh processes: three start torch, hence 25-40 s on 2 shared cores)."""
    train(_train_config(pcfg_data, tmp_path / "run", "adamw", steps=2), progress=False)
    ckpt, sharded = tmp_path / "run" / "ckpt_000002.pt", tmp_path / "one-rank"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    script = Path(__file__).resolve().parents[1] / "experiments" / "to_sharded.py"
    r = subprocess.run([*torchrun, script, ckpt, sharded], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_meta(sharded)["world_size"] == 1
    options = ["--dtype", "float64", "--batches", "2", "--device", "cpu"]
    reports = {
        "sharded": [*torchrun, "-m", "curvlab", "nds", str(sharded), "--fsdp"],
        "one": [sys.executable, "-m", "curvlab", "nds", str(ckpt)],
    }
    for name, cmd in reports.items():
        out = ["--out", str(tmp_path / f"{name}.json")]
        r = subprocess.run([*cmd, *out, *options], capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    got, want = (json.loads((tmp_path / f"{name}.json").read_text()) for name in reports)
    for d in (got, want):
        d.pop("checkpoint"), d.pop("timing"), d.pop("digests", None)  # (the files: their names, times, digests)
    _close(got, want, "report")


def _spectral(loss_fn, params, batches):
    with CurvaturePoint(loss_fn, params, batches) as point:
        top = sharded_lanczos(point, k=1, max_iter=60, tol=1e-7)
        trace = sharded_hutchinson(point, samples=3, seed=7)
        return top.to_dict(), full(top.eigenvectors[0]), trace.to_dict()


def _spectral_worker(rank, tmp, world):
    mesh = _init(rank, tmp, world)
    model, params, batches, _, _ = _problem()
    sharded = {k: distribute_tensor(p, mesh, [Shard(0)]) for k, p in params.items()}
    out = _spectral(make_loss_fn(model), sharded, batches)
    leave_group()
    if rank == 0:
        torch.save(out, f"{tmp}/spectral.pt")


@pytest.mark.heavy
def test_lanczos_and_hutchinson_on_sharded_parameters_equal_one_process(tmp_path):
    spawn(_spectral_worker, tmp_path, 2)
    (top, u, trace) = torch.load(tmp_path / "spectral.pt", weights_only=False)
    model, params, batches, _, _ = _problem()
    loss_fn = make_loss_fn(model)
    ref = lanczos(hessian_operator(loss_fn, params, batches), k=1, max_iter=80, tol=1e-9)
    assert top["converged"] and ref.converged, (top, ref.iterations)
    assert np.allclose(top["eigenvalues"], ref.eigenvalues, rtol=1e-7, atol=0)
    flat = torch.cat([u[n].reshape(-1) for n in params])
    assert abs(float(flat @ ref.eigenvectors[:, 0])) == pytest.approx(1.0, abs=1e-6)  # the same top eigenvector
    # Hutchinson: the same Rademacher vectors in one process, by exact HVPs
    values = []
    for i in range(3):
        z = sharded_random_direction(params, 7 + i, kind="rademacher")
        assert set(torch.unique(torch.cat([t.reshape(-1) for t in z.values()])).tolist()) == {-1.0, 1.0}
        values.append(param_dicts.dot(z, hvp(loss_fn, params, batches, z)))
    assert trace["trace"] == pytest.approx(float(np.mean(values)), rel=1e-10)
    assert trace["std_error"] == pytest.approx(float(np.std(values, ddof=1) / np.sqrt(3)), rel=1e-8)


def _train_config(data, out, optimizer, steps=4):
    options = {"polar_dtype": "float32"} if optimizer == "muon" else {}
    return small_config(
        data, out, optimizer=optimizer, optimizer_options=options, batch_size=4, steps=steps, val_windows=8,
        device="cpu",
    )  # fmt: skip


def _final_params(out):
    """The last sharded checkpoint's parameters, gathered (every rank calls it)."""
    target = open_sharded_checkpoint(Path(out) / read_index(out)[-1]["path"])
    return {n: p.detach().full_tensor() for n, p in target.model.named_parameters()}


def _fsdp_train_worker(rank, tmp, world, data, optimizer):
    from curvlab.data.shards import TrainBatches

    _init(rank, tmp, world)
    whole = train_sharded(_train_config(data, f"{tmp}/whole", optimizer), progress=False)
    original, calls = TrainBatches.next, {"n": 0}

    def crashing_next(self):  # the run is cut after 3 steps, then resumed from its step-2 checkpoint
        calls["n"] += 1
        if calls["n"] > 3:
            raise KeyboardInterrupt
        return original(self)

    TrainBatches.next = crashing_next
    with contextlib.suppress(KeyboardInterrupt):
        train_sharded(_train_config(data, f"{tmp}/cut", optimizer), progress=False)
    TrainBatches.next = original
    resumed = train_sharded(_train_config(data, f"{tmp}/cut", optimizer), progress=False)
    a, b = _final_params(f"{tmp}/whole"), _final_params(f"{tmp}/cut")
    diverging = replace(
        _train_config(data, f"{tmp}/nan", "sgd", steps=30), optimizer_options={"lr": 1e6}, grad_clip=None
    )
    with pytest.raises(TrainingDiverged) as diverged:
        train_sharded(diverging, progress=False)
    leave_group()
    if rank == 0:
        saved = {"whole": a, "cut": b, "val": whole.val_loss, "resumed_from": resumed.resumed_from}
        torch.save({**saved, "diverged": str(diverged.value)}, f"{tmp}/t.pt")


@pytest.mark.heavy
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_training_equals_one_process_and_resumes_exactly(pcfg_data, tmp_path, optimizer):
    spawn(_fsdp_train_worker, tmp_path, 2, str(pcfg_data), optimizer)
    saved = torch.load(tmp_path / "t.pt", weights_only=False)
    assert saved["resumed_from"] == 2
    one = train(_train_config(pcfg_data, tmp_path / "one", optimizer), progress=False)
    single = load_checkpoint(tmp_path / "one" / "ckpt_000004.pt")["model"]
    for name, tensor in single.items():
        assert torch.equal(saved["cut"][name], saved["whole"][name]), name  # the resumed run, bit for bit
        diff = (saved["whole"][name] - tensor).abs()
        # the gradients are summed in another order over the ranks (as under DDP, test_distributed.py)
        assert (diff > 1e-6 + 1e-4 * tensor.abs()).float().mean() <= 1e-2, name
        assert diff.max() <= 1e-4, name
    assert saved["val"] == pytest.approx(one.val_loss, rel=1e-5)
    # the one training loop: the sharded run writes the rows the one-process run writes, key for key, and
    # the resumed run rewrites those after its checkpoint, bit for bit
    whole, single = _metrics(tmp_path / "whole"), _metrics(tmp_path / "one")
    assert [list(row) for row in whole] == [list(row) for row in single]
    assert [(r["step"], r["lr"], r["tokens"]) for r in whole] == [(r["step"], r["lr"], r["tokens"]) for r in single]
    assert [r["train_loss"] for r in whole] == pytest.approx([r["train_loss"] for r in single], rel=1e-5)
    assert _metrics(tmp_path / "cut") == whole
    # a diverging sharded run names its last good checkpoint (a DCP directory), as the dense run does
    last = read_index(tmp_path / "nan")[-1]["path"]
    assert re.fullmatch(rf"non-finite training loss at step \d+; last good checkpoint: {last}", saved["diverged"])
    assert (tmp_path / "nan" / last / "curvlab.json").is_file()


def _metrics(out):
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def _convert_run_worker(rank, tmp, world, runs):
    """Every checkpoint of each unsharded run as a sharded one, in a sharded run directory beside it."""
    _init(rank, tmp, world)
    for run in runs:
        for entry in read_index(run):
            convert_to_sharded(load_checkpoint(Path(run, entry["path"])), Path(f"{run}-dcp", Path(entry["path"]).stem))
    leave_group()


def _without_paths(study: dict) -> dict:
    """A compare.json or track.json without what names files (the runs, the cached reports)."""
    study = json.loads(json.dumps(study))
    study.pop("runs", None), study.pop("run", None)
    for level in study.get("pairs", []):
        level["a"].pop("reports"), level["b"].pop("reports")
    return study


@pytest.mark.heavy
def test_compare_and_track_on_sharded_runs_under_torchrun_equal_the_unsharded_ones(pcfg_data, tmp_path):
    runs = {}
    for optimizer in ("adamw", "muon"):  # two tiny runs, then each as a sharded (DCP) run directory
        run = tmp_path / optimizer
        train(_train_config(pcfg_data, run, optimizer), progress=False)
        runs[optimizer] = run
    spawn(_convert_run_worker, tmp_path, 2, [str(r) for r in runs.values()])
    for run in runs.values():
        sharded = Path(f"{run}-dcp")
        (sharded / "config.json").write_text((run / "config.json").read_text())
        index = [{**e, "path": Path(e["path"]).stem} for e in read_index(run)]
        (sharded / "index.json").write_text(json.dumps(index))
    a, b = (str(runs[o]) for o in ("adamw", "muon"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "curvlab"]
    options = ["--dtype", "float64", "--batches", "2", "--device", "cpu", "--quiet", "--fsdp"]
    studies = (
        ["compare", f"{a}-dcp", f"{b}-dcp", "--levels", "2", "--tolerance", "1", "--phase", "any"],
        ["track", f"{b}-dcp"],
    )
    for study in studies:  # one output directory: track finds the report of compare's Muon checkpoint cached
        r = subprocess.run(
            [*cmd, *study, "--out", str(tmp_path / "sharded"), *options],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.count("wrote") == 1  # rank 0 alone reports (and writes)
    # the same studies on the unsharded runs, in this process, on one thread as each rank ran: Muon's bf16
    # Newton–Schulz turns another reduction order into ~1e-7 differences of its step (docs/science.md section 9)
    settings = AnalysisSettings(dtype="float64", batches=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compared = compare_runs(
            a, b, tmp_path / "one", MatchCriteria(levels=2, tolerance=1.0, phase="any"), settings, progress=False
        )
        tracked = track_run(b, tmp_path / "one", settings=settings, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert len(compared.levels) == 1 and [r.step for r in tracked] == [2, 4]
    assert compared.levels[0].b.step in (2, 4)
    values = [r.value(k) for r in tracked for k in ("nds", "within", "cross", "update_norm")]
    assert all(np.isfinite(v) and v != 0 for v in values)
    for name in ("compare", "track"):
        got = json.loads((tmp_path / "sharded" / f"{name}.json").read_text())
        want = json.loads((tmp_path / "one" / f"{name}.json").read_text())
        assert got.get("runs", [got.get("run")])[-1] == f"{b}-dcp"
        _close(_without_paths(got), _without_paths(want), name)
    # rank 0 cached each sharded report once (the Muon one compare made served track), under the unsharded key
    cached = list((tmp_path / "sharded" / "reports").glob("*.json"))
    assert len(cached) == 3 and all(settings.key() in p.name for p in cached)


def test_track_spectrum_with_fsdp_is_refused_in_one_line(tmp_path):
    r = CliRunner().invoke(app, ["track", str(tmp_path), "--fsdp", "--spectrum", "2", "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "--spectrum is not available with --fsdp" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "t").exists()


def test_a_sharded_checkpoint_of_another_format_or_schema_is_refused_in_one_line(tmp_path):
    rng = torch.get_rng_state()
    meta = {"format": "curvlab-dcp", "schema_version": 2, "world_size": 2, "rng": bytes(rng.tolist()).hex(),
            "val_loss": None, "train_loss": 3.5}  # fmt: skip
    cases = [
        (meta, None),
        ({**meta, "schema_version": 3}, "curvlab sharded checkpoint schema 3 is not 2"),
        ({**meta, "format": "other"}, r"not a curvlab sharded checkpoint \(format 'other' is not 'curvlab-dcp'\)"),
        ([meta], "curvlab sharded checkpoint schema None is not 2"),
        ({**meta, "rng": "not hex"}, "not a curvlab sharded checkpoint record \\(ValueError: .*\\)"),
    ]
    for i, (payload, match) in enumerate(cases):
        path = tmp_path / f"ckpt_{i}"
        path.mkdir()
        (path / "curvlab.json").write_text(json.dumps(payload))
        if match is None:
            got = read_meta(path)
            assert torch.equal(got.pop("rng"), rng) and math.isnan(got.pop("val_loss"))
            assert got == {k: v for k, v in meta.items() if k not in ("rng", "val_loss")}
            continue
        with pytest.raises(CurvlabError, match=f"^{re.escape(str(path / 'curvlab.json'))}: {match}$"):
            read_meta(path)
    # schema 1 kept its metadata in curvlab.pt, a pickle: refused by name, never opened (here: not even a pickle)
    old = tmp_path / "old"
    old.mkdir()
    (old / "curvlab.pt").write_bytes(b"unopened")
    with pytest.raises(CurvlabError, match=f"^{re.escape(str(old))}: a sharded checkpoint written by an older curvlab"):
        read_meta(old)
    with pytest.raises(CurvlabError, match=f"^{re.escape(str(tmp_path))}: not a curvlab sharded checkpoint"):
        read_meta(tmp_path)
