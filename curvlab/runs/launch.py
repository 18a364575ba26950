"""A training run as ``curvlab train`` starts it: dense (:func:`curvlab.runs.train.train`) or sharded by
FSDP2 (:func:`curvlab.runs.sharded_train.train_sharded`), as one process or as every rank under torchrun."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from curvlab.errors import CurvlabError
from curvlab.runs.config import TrainConfig
from curvlab.runs.monitor import MonitorSettings
from curvlab.runs.sharded_train import train_sharded
from curvlab.runs.train import TrainResult, train
from curvlab.util.distributed import distributed_context


@dataclass(frozen=True)
class Launched:
    """A finished run's :class:`~curvlab.runs.train.TrainResult` as this process saw it, and its ``rank`` of
    ``world`` (0 of 1 outside torchrun)."""

    result: TrainResult
    rank: int
    world: int


def launch(
    config: TrainConfig,
    *,
    monitor: MonitorSettings | None = None,
    tensorboard: str | Path | None = None,
    fsdp: bool = False,
    progress: bool = True,
) -> Launched:
    """Train (or resume) the run ``config`` describes, inside the process group torchrun asks for (none
    outside it). ``fsdp`` shards parameters and optimizer state over the ranks; ``monitor`` and
    ``tensorboard`` are as :func:`~curvlab.runs.train.train` takes them (the dense run's only).
    """
    if fsdp and (monitor is not None or tensorboard is not None or config.shadow):
        raise CurvlabError("--curvature-every, --tensorboard and --shadow are not available with --fsdp yet")
    with distributed_context() as (rank, world):
        if fsdp:
            result = train_sharded(config, progress=progress)
        else:
            result = train(config, progress=progress, rank=rank, world=world, monitor=monitor, tensorboard=tensorboard)
    return Launched(result=result, rank=rank, world=world)
