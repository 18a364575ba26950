"""Checkpoints: save and load, atomic and versioned.

A checkpoint is a ``torch.save`` of a plain dict (loadable with ``weights_only=True``):

========== =====================================================================
format     ``"curvlab-checkpoint"``, and ``version`` (``CHECKPOINT_VERSION``)
step       optimizer steps taken so far
config     the training config (a dict), which also names the model config
model      the model's ``state_dict``
optimizer  the optimizer's ``state_dict`` (full state: momenta, Adam moments, counters)
scheduler  the LR scheduler's ``state_dict``
data       the train loader's state (its generator), positioned at the next batch
rng        torch's RNG state (dropout)
val_loss   validation loss at this step (NaN if not evaluated)
train_loss the last training loss
========== =====================================================================

Writes go to a temporary file that is renamed into place, so a crash mid-write leaves the previous
checkpoint valid. A run directory also keeps ``index.json``: ``[{step, val_loss, path}]`` for every
checkpoint, so matching by validation loss never has to open checkpoints.
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from curvlab.atomic import atomic_open, atomic_write_text
from curvlab.errors import CurvlabError

FORMAT = "curvlab-checkpoint"
CHECKPOINT_VERSION = 1
INDEX = "index.json"


def checkpoint_name(step: int) -> str:
    return f"ckpt_{step:06d}.pt"


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus format and version) to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        torch.save({"format": FORMAT, "version": CHECKPOINT_VERSION, **payload}, f)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a curvlab checkpoint, raising a one-line ``CurvlabError`` for a missing, corrupt or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise CurvlabError(f"{path}: no such checkpoint")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError) as e:
        raise CurvlabError(f"{path}: corrupt or unreadable checkpoint ({type(e).__name__})") from e
    return check_checkpoint(ckpt, path)


def check_checkpoint(ckpt: Any, path: str | Path) -> dict[str, Any]:
    """``ckpt`` if it is a curvlab checkpoint of a supported version, else a ``CurvlabError`` naming ``path``."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CurvlabError(f"{path}: not a curvlab checkpoint (a nanoGPT ckpt.pt is read by `curvlab nds` directly)")
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise CurvlabError(
            f"{path}: checkpoint version {ckpt.get('version')} is not supported (this curvlab reads "
            f"{CHECKPOINT_VERSION})"
        )
    return ckpt


def read_index(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's checkpoint index, sorted by step (``[]`` if there is none yet)."""
    path = Path(run_dir) / INDEX
    if not path.is_file():
        return []
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CurvlabError(f"{path}: corrupt index ({e})") from e
    return sorted(entries, key=lambda e: e["step"])


def add_to_index(run_dir: str | Path, step: int, val_loss: float, name: str) -> None:
    """Record a checkpoint in the run's index (rewritten atomically; an entry of the same step is replaced)."""
    entries = [e for e in read_index(run_dir) if e["step"] != step]
    entries.append({"step": step, "val_loss": None if math.isnan(val_loss) else val_loss, "path": name})
    atomic_write_text(Path(run_dir) / INDEX, json.dumps(sorted(entries, key=lambda e: e["step"]), indent=1))


def truncate_index(run_dir: str | Path, last_step: int) -> None:
    """Drop index entries after ``last_step`` (their checkpoints are about to be rewritten)."""
    entries = [e for e in read_index(run_dir) if e["step"] <= last_step]
    atomic_write_text(Path(run_dir) / INDEX, json.dumps(entries, indent=1))
