"""Sharded checkpoints (``torch.distributed.checkpoint``, DCP) of FSDP2 runs, and their analysis.

A sharded checkpoint is a directory: DCP's files (each rank's shards of the model and optimizer state)
and ``curvlab.json``, written by rank 0, with what isn't sharded (world size, config, step, schedule,
loader and RNG states, losses) as plain JSON. Nothing here unpickles anything but tensors and plain data:
torch's files are read through :mod:`curvlab.runs._dcp_reader`, and schema 1's ``curvlab.pt`` (a
pickle) is refused unread. :func:`load_sharded_into` puts a checkpoint into a run sharded by
:func:`shard_run` under the world size that wrote it; :mod:`curvlab.analysis.sharded` opens one for the
analysis.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from curvlab.engine.dtensors import require_process_group
from curvlab.errors import CurvlabError
from curvlab.optim.build import build_optimizer
from curvlab.runs import _dcp_reader
from curvlab.runs.config import TrainConfig
from curvlab.runs.schedule import lr_multiplier
from curvlab.runs.train import Run, build_run, restore
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_json
from curvlab.util.distributed import barrier, rank_and_world

FORMAT = "curvlab-dcp"
SCHEMA_VERSION = 2  # 2: curvlab.json (plain JSON); 1 was curvlab.pt, a torch.save pickle
META = "curvlab.json"
OLD_META = "curvlab.pt"  # schema 1's: refused by name, never unpickled


class ShardedMeta:
    """A sharded checkpoint's ``META`` for :mod:`curvlab.util.schema`: the dict it is, its JSON forms decoded."""

    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION
    WHAT: ClassVar[str] = "curvlab sharded checkpoint"
    FIXED_KEYS: ClassVar[dict[str, Any]] = {"format": FORMAT}
    SEALED: ClassVar[bool] = False  # (its writer, save_sharded_checkpoint, writes no seal)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> dict[str, Any]:
        """``d`` with torch's RNG state (hex) as the uint8 tensor it is and a null loss (strict JSON's NaN) as NaN."""
        rng = bytes.fromhex(d["rng"])  # (a ValueError, or a TypeError for a non-string: one line in schema.load)
        losses = {k: float("nan") if d.get(k) is None else float(d[k]) for k in ("val_loss", "train_loss")}
        return {**d, "rng": torch.frombuffer(bytearray(rng), dtype=torch.uint8), **losses}


def shard_run(run: Run) -> None:
    """Shard ``run``'s model with FSDP2 over all ranks (each transformer block, then the root) and
    rebuild its optimizer and schedule on the sharded parameters (at their step-0 state)."""
    require_process_group()
    mesh = init_device_mesh(run.device.type, (dist.get_world_size(),))
    for block in run.model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(run.model, mesh=mesh)
    run.optimizer = build_optimizer(run.cfg.optimizer, run.model, **run.cfg.optimizer_options)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda step: lr_multiplier(step, run.cfg))


def _state(run: Run, optimizer: bool) -> dict[str, Any]:
    """The DCP state dict of ``run``; ``optimizer=False`` leaves out an optimizer with no state yet
    (``get_optimizer_state_dict`` would create it by a zero step, which Adam's bias correction counts)."""
    state = {"model": get_model_state_dict(run.model)}
    if optimizer:
        state["optimizer"] = get_optimizer_state_dict(run.model, run.optimizer)
    return state


def save_sharded_checkpoint(run: Run, path: str | Path, val_loss: float, train_loss: float = float("nan")) -> Path:
    """Write ``run`` (model sharded by :func:`shard_run`) as a sharded checkpoint directory; every rank calls it."""
    path = Path(path)
    rank, world = rank_and_world()
    has_state = bool(run.optimizer.state)  # (the same on every rank: all step together)
    dcp.save(_state(run, has_state), checkpoint_id=str(path))
    if rank == 0:
        meta = {
            "format": FORMAT,
            "optimizer_state": has_state,
            "schema_version": SCHEMA_VERSION,
            "world_size": world,
            "step": run.step,
            "config": run.cfg.to_dict(),
            "model_config": run.model.config.to_dict(),
            "scheduler": run.scheduler.state_dict(),
            "data": run.loader.state_dict(),
            "rng": bytes(torch.get_rng_state().tolist()).hex(),
            "val_loss": val_loss,
            "train_loss": train_loss,
        }
        atomic_write_json(path / META, meta)  # (a reader never sees half a file)
    barrier()
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``curvlab.json`` of a sharded checkpoint, checked for its format and schema."""
    path = Path(path)
    if not (path / META).is_file():
        if (path / OLD_META).is_file():
            raise CurvlabError(
                f"{path}: a sharded checkpoint written by an older curvlab ({OLD_META}, schema 1; this one reads "
                f"{META}, schema {SCHEMA_VERSION}): convert its unsharded checkpoint again (experiments/to_sharded.py)"
            )
        raise CurvlabError(f"{path}: not a curvlab sharded checkpoint (no {META})")
    return schema.load(path / META, ShardedMeta)


def convert_to_sharded(checkpoint: dict[str, Any], path: str | Path, data: str | Path | None = None) -> Path:
    """Write a curvlab (unsharded) checkpoint payload as a sharded checkpoint of the current world size."""
    cfg = TrainConfig.from_dict({**checkpoint["config"], **({"data": str(data)} if data else {})})
    run = build_run(replace(cfg, device="cpu"))
    restore(run, checkpoint)
    model_state, optim_state = run.model.state_dict(), run.optimizer.state_dict()
    shard_run(run)
    # every rank holds the whole payload and keeps its shards of it
    set_model_state_dict(run.model, model_state, options=StateDictOptions(full_state_dict=True))
    params = [p for g in run.optimizer.param_groups for p in g["params"]]  # (the order of the state's indices)
    for i, entry in optim_state["state"].items():
        p = params[i]
        for k, t in entry.items():
            if isinstance(t, torch.Tensor) and t.dim() > 0 and tuple(t.shape) == tuple(p.shape):
                entry[k] = distribute_tensor(t.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
    run.optimizer.load_state_dict(optim_state)
    run.scheduler.load_state_dict(checkpoint["scheduler"])
    return save_sharded_checkpoint(run, path, float(checkpoint.get("val_loss", float("nan"))))


def check_shapes(path: Path, run: Run) -> None:
    """The checkpoint's model tensors against the model its config builds (a different config: refused)."""
    stored = _dcp_reader.read_metadata(path).state_dict_metadata
    for name, p in run.model.named_parameters():
        meta = stored.get(f"model.{name}")
        if meta is None:
            raise CurvlabError(f"{path}: the checkpoint holds no {name!r}: it is from another model config")
        if tuple(meta.size) != tuple(p.shape):
            raise CurvlabError(
                f"{path}: {name!r} is {tuple(meta.size)} in the checkpoint but {tuple(p.shape)} in the model: "
                "the checkpoint is from another model config"
            )


def load_sharded_into(run: Run, path: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Put a sharded checkpoint's model, optimizer, schedule, loader and RNG states into ``run`` (sharded
    by :func:`shard_run`, under the world size that wrote it)."""
    path = Path(path)
    meta = read_meta(path) if meta is None else meta
    world = rank_and_world()[1]
    if meta["world_size"] != world:
        raise CurvlabError(
            f"{path}: written by {meta['world_size']} ranks, opened on {world}: run under "
            f"torchrun --nproc_per_node {meta['world_size']}"
        )
    check_shapes(path, run)
    has_state = bool(meta.get("optimizer_state", True))
    state = _state(run, has_state)  # (the optimizer's is a template here: every value is loaded over it)
    _dcp_reader.load(state, path)
    set_model_state_dict(run.model, state["model"])
    if has_state:
        set_optimizer_state_dict(run.model, run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(meta["scheduler"])
    run.loader.load_state_dict(meta["data"])
    torch.set_rng_state(meta["rng"])
    run.step = int(meta["step"])
