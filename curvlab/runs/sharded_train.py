"""Training with FSDP2 (``curvlab train --fsdp`` under ``torchrun``): sharded parameters and optimizer
state, sharded (DCP) checkpoints, exact resume.

The run is :func:`curvlab.runs.train.train`'s, in its loop (:func:`curvlab.runs.train.train_loop`) with
the :data:`SHARDED` layout: the model is sharded by FSDP2 over the ranks
(:func:`curvlab.runs.dcp.shard_run`) in place of DistributedDataParallel; each rank trains on rows
``rank::world`` of the same global batch and FSDP2's reduce-scatter averages the gradients, as DDP's
all-reduce does, so the run is the one-process run up to rounding. The optimizer steps on the shards
(Muon gathers each whole matrix on one rank, :mod:`curvlab.optim._sharded`). Checkpoints are DCP
directories ``ckpt_<step>`` (:func:`curvlab.runs.dcp.save_sharded_checkpoint`) listed in the run's
``index.json``; a run resumes from the last one, under the same world size, bit for bit. Every rank
evaluates all validation windows (an FSDP2 forward needs every rank), and rank 0 writes metrics.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from curvlab.engine.dtensors import require_process_group
from curvlab.engine.loss import count_loss_terms, token_cross_entropy
from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import add_to_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.dcp import load_sharded_into, save_sharded_checkpoint, shard_run
from curvlab.runs.train import Run, RunLayout, TrainResult, build_run, train_loop
from curvlab.util.distributed import barrier, device_for_rank, rank_and_world


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


def _forward(run: Run, world: int) -> nn.Module:
    return run.model  # FSDP2's own hooks gather the parameters and reduce-scatter the gradients


def _save(run: Run, val_loss: float, train_loss: float, is_main: bool) -> None:
    out, name = Path(run.cfg.out), sharded_checkpoint_name(run.step)
    save_sharded_checkpoint(run, out / name, val_loss, train_loss)
    if is_main:
        add_to_index(out, run.step, val_loss, name)
    barrier()


def _load(run: Run, path: Path) -> None:
    if not path.is_dir():
        raise CurvlabError(f"{path}: not a sharded checkpoint; resume this run without --fsdp")
    load_sharded_into(run, path)


# the model sharded by FSDP2 (shard_run); every rank writes its shards of each checkpoint, a DCP directory
SHARDED = RunLayout(forward=_forward, evaluate=evaluate_sharded, save=_save, load=_load)


def train_sharded(cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes with FSDP2 over the ranks of the process group, in
    :func:`curvlab.runs.train.train_loop` with the :data:`SHARDED` layout.

    Raises:
        CurvlabError: no process group; another process holds ``out`` (:mod:`curvlab.util.lock`); a
            resume with another config or from unsharded checkpoints.
        TrainingDiverged: a non-finite training loss (the last good checkpoint is kept).
        Stopped: a SIGINT or SIGTERM, honoured after the step in progress on every rank
            (:mod:`curvlab.util.safe_stop`); the rerun resumes from the last checkpoint.
    """
    require_process_group()
    rank, world = rank_and_world()
    run = build_run(replace(cfg, device=device_for_rank(cfg.device)), rank, world)
    shard_run(run)
    # no shadow or control states under FSDP2 yet (the CLI refuses --shadow with --fsdp): were they
    # built, they would read the gradients of the unsharded model, which no longer trains
    run.shadow, run.controls = None, {}
    return train_loop(
        run, layout=SHARDED, progress=progress, rank=rank, world=world, desc=f"train {cfg.optimizer} (fsdp)"
    )
