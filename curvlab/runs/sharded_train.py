"""Training with FSDP2 (``curvlab train --fsdp`` under ``torchrun``): sharded parameters and optimizer
state, sharded (DCP) checkpoints, exact resume.

The run is :func:`curvlab.runs.train.train`'s, with the model sharded by FSDP2 over the ranks
(:func:`curvlab.runs.dcp.shard_run`) in place of DistributedDataParallel: each rank trains on rows
``rank::world`` of the same global batch and FSDP2's reduce-scatter averages the gradients, as DDP's
all-reduce does, so the run is the one-process run up to rounding. The optimizer steps on the shards
(Muon gathers each whole matrix on one rank, :mod:`curvlab.optim._sharded`). Checkpoints are DCP
directories ``ckpt_<step>`` (:func:`curvlab.runs.dcp.save_sharded_checkpoint`) listed in the run's
``index.json``; a run resumes from the last one, under the same world size, bit for bit. Every rank
evaluates all validation windows (an FSDP2 forward needs every rank), and rank 0 writes metrics.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from curvlab.engine.dtensors import require_process_group
from curvlab.engine.loss import count_loss_terms, token_cross_entropy
from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import add_to_index, read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.dcp import load_sharded_into, save_sharded_checkpoint, shard_run
from curvlab.runs.metrics import METRICS_FILE, truncate_metrics
from curvlab.runs.train import Run, TrainingDiverged, TrainResult, build_run, check_resume, stopped_where
from curvlab.util.atomic import atomic_write_text, remove_stale_temporaries
from curvlab.util.distributed import all_reduce_sum, barrier, device_for_rank, rank_and_world
from curvlab.util.lock import own_directory
from curvlab.util.safe_stop import check_stop, stop_at_safe_points


def sharded_checkpoint_name(step: int) -> str:
    return f"ckpt_{step:06d}"


@torch.no_grad()
def evaluate_sharded(run: Run) -> float:
    """Mean validation loss over every token of the validation windows, each rank evaluating them all."""
    was_training = run.model.training
    run.model.eval()
    total, count = 0.0, 0
    for x, y in run.val_batches:
        x, y = x.to(run.device), y.to(run.device)
        with run.autocast():
            loss = token_cross_entropy(run.model(x), y)
        n = count_loss_terms((x, y))
        total, count = total + float(loss) * n, count + n
    run.model.train(was_training)
    return total / count


def _save(run: Run, out: Path, val_loss: float, train_loss: float, is_main: bool) -> None:
    name = sharded_checkpoint_name(run.step)
    save_sharded_checkpoint(run, out / name, val_loss, train_loss)
    if is_main:
        add_to_index(out, run.step, val_loss, name)
    barrier()


def train_sharded(cfg: TrainConfig, progress: bool = True) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes with FSDP2 over the ranks of the process group.

    Raises:
        CurvlabError: no process group; another process holds ``out`` (:mod:`curvlab.util.lock`); a
            resume with another config or from unsharded checkpoints.
        TrainingDiverged: a non-finite training loss (the last good checkpoint is kept).
        Stopped: a SIGINT or SIGTERM, honoured after the step in progress on every rank
            (:mod:`curvlab.util.safe_stop`); the rerun resumes from the last checkpoint.
    """
    with stop_at_safe_points(), own_directory(cfg.out, "train"):  # rank 0 holds out for every rank
        return _train_sharded(cfg, progress)


def _train_sharded(cfg: TrainConfig, progress: bool) -> TrainResult:
    require_process_group()
    rank, world = rank_and_world()
    out, is_main = Path(cfg.out), rank == 0
    cfg = replace(cfg, device=device_for_rank(cfg.device))
    run = build_run(cfg, rank, world)
    shard_run(run)
    if is_main:  # what a killed write left (kill -9 mid-index-write): never read, so removed
        remove_stale_temporaries(out)
    index = read_index(out)
    barrier()  # every rank has decided whether to resume before rank 0 writes anything
    resumed_from = 0
    if index:
        check_resume(out, cfg)
        last = out / index[-1]["path"]
        if not last.is_dir():
            raise CurvlabError(f"{last}: not a sharded checkpoint; resume this run without --fsdp")
        load_sharded_into(run, last)
        resumed_from = run.step
    elif is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.json", json.dumps(cfg.to_dict(), indent=1))
    barrier()
    metrics_path = out / METRICS_FILE
    if is_main:  # a resumed run rewrites what came after its checkpoint
        truncate_metrics(out, run.step)
    if not index:
        _save(run, out, evaluate_sharded(run), float("nan"), is_main)
    run.model.train()
    tokens_per_step = cfg.batch_size * run.loader.seq_len
    val_loss, elapsed, steps_done = float("nan"), 0.0, 0
    last_checkpoint = run.step
    bar = tqdm(range(run.step, cfg.steps), desc=f"train {cfg.optimizer} (fsdp)", disable=not (progress and is_main))
    with open(metrics_path, "a") if is_main else contextlib.nullcontext() as log:
        for _ in bar:
            start = time.perf_counter()
            x, y = (t.to(run.device) for t in run.loader.next())
            with run.autocast():
                loss = token_cross_entropy(run.model(x), y)
            global_loss = all_reduce_sum(loss.detach().double()) / world
            if not torch.isfinite(global_loss):
                raise TrainingDiverged(f"non-finite training loss at step {run.step + 1}")
            loss.backward()  # (FSDP2 reduce-scatters the gradients, averaged over the ranks)
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
            lr = run.optimizer.param_groups[0]["lr"]
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.step += 1
            elapsed += time.perf_counter() - start
            steps_done += 1
            checkpoint_now = run.step % cfg.ckpt_every == 0 or run.step == cfg.steps
            evaluate_now = checkpoint_now or run.step % cfg.eval_every == 0
            val_loss = evaluate_sharded(run) if evaluate_now else float("nan")
            record = {"step": run.step, "train_loss": float(global_loss), "lr": lr}
            record["tokens"] = run.step * tokens_per_step
            if evaluate_now:
                record["val_loss"] = val_loss
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if checkpoint_now:
                _save(run, out, val_loss, float(global_loss), is_main)
                last_checkpoint = run.step
            # (every rank agrees: the ranks stop after the same step)
            check_stop(stopped_where(out, run.step, last_checkpoint), world)
    barrier()
    index = read_index(out)
    tps = tokens_per_step * steps_done / elapsed if elapsed else float("nan")
    return TrainResult(str(out), run.step, index[-1]["val_loss"] if index else val_loss, tps, resumed_from)
