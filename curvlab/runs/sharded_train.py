"""Training with FSDP2 (``curvlab train --fsdp`` under ``torchrun``): sharded parameters and optimizer
state, sharded (DCP) checkpoints, exact resume.

The run is :func:`curvlab.runs.train.train_loop`'s with the :data:`SHARDED` layout: the model sharded by
FSDP2 (:func:`curvlab.runs.dcp.shard_run`) in place of DistributedDataParallel, whose reduce-scatter
averages the gradients as DDP's all-reduce does, so the run is the one-process run up to rounding (Muon
gathers each whole matrix on one rank, :mod:`curvlab.optim._sharded`). Checkpoints are DCP directories
``ckpt_<step>`` (:func:`curvlab.runs.dcp.save_sharded_checkpoint`) listed in ``index.json``; a run resumes
from the last one, under the same world size, bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from torch import nn

from curvlab.engine.dtensors import require_process_group
from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import add_to_index, checkpoint_name
from curvlab.runs.config import TrainConfig
from curvlab.runs.dcp import load_sharded_into, save_sharded_checkpoint, shard_run
from curvlab.runs.train import Run, RunLayout, TrainResult, build_run, evaluate, train_loop
from curvlab.util.distributed import barrier, device_for_rank, rank_and_world


def _forward(run: Run, world: int) -> nn.Module:
    return run.model  # FSDP2's own hooks gather the parameters and reduce-scatter the gradients


def _save(run: Run, val_loss: float, train_loss: float, is_main: bool) -> None:
    out, name = Path(run.cfg.out), checkpoint_name(run.step).removesuffix(".pt")  # (a directory)
    save_sharded_checkpoint(run, out / name, val_loss, train_loss)
    if is_main:
        add_to_index(out, run.step, val_loss, name)
    barrier()


def _load(run: Run, path: Path) -> None:
    if not path.is_dir():
        raise CurvlabError(f"{path}: not a sharded checkpoint; resume this run without --fsdp")
    load_sharded_into(run, path)


# the model sharded by FSDP2 (shard_run); every rank writes its shards of each checkpoint, a DCP directory
SHARDED = RunLayout(forward=_forward, evaluate=functools.partial(evaluate, every_window=True), save=_save, load=_load)


def train_sharded(cfg: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes with FSDP2 over the ranks of the process group, in
    :func:`curvlab.runs.train.train_loop` with the :data:`SHARDED` layout.

    Raises what ``train_loop`` raises, and ``CurvlabError`` without a process group or on a resume from
    unsharded checkpoints.
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
