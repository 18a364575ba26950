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
shadow     (runs with ``shadow`` on) the other arm's shadow state: :mod:`curvlab.steps.shadow`
controls   (runs with ``controls`` on) ``{twin, hp_twin}``: shadow states of the run's own arm
========== =====================================================================

Writes are atomic: a crash mid-write leaves the previous checkpoint valid. A run directory also keeps
``index.json``, ``{step, val_loss, path}`` of every checkpoint (so matching by loss opens none), sealed
(:func:`curvlab.util.schema.sealed`): a flipped digit of a loss is refused, never read.

:func:`read_checkpoint` reads checkpoints of every format with one set of errors: curvlab's, nanoGPT's
``ckpt.pt``, a Hugging Face ``Trainer`` directory (:mod:`curvlab.runs.hf`), a Lightning ``.ckpt`` and a
``torch.save``'d state dict (:mod:`curvlab.runs.foreign`). A missing path, an unreadable, truncated or
corrupt file (random bytes, text, a Git LFS pointer), a file of no known format, and a device this torch
can't use each raise one :class:`~curvlab.errors.CurvlabError`.
"""

from __future__ import annotations

import json
import math
import pickle
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from curvlab.errors import CurvlabError
from curvlab.models.nanogpt import is_nanogpt_checkpoint
from curvlab.runs import hf
from curvlab.runs.foreign import FOREIGN_FORMATS, configured_optimizers, foreign_checkpoint
from curvlab.util import schema
from curvlab.util.atomic import atomic_open, atomic_write_json
from curvlab.util.paths import inside
from curvlab.util.weights_only import entry_naming, refused_global, unpickling_error

FORMAT = "curvlab-checkpoint"
CHECKPOINT_VERSION = 1
INDEX = "index.json"


def checkpoint_name(step: int) -> str:
    return f"ckpt_{step:06d}.pt"


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is one :func:`checkpoint_name` gives (what a pruning may delete)."""
    return re.fullmatch(r"ckpt_\d{6,}\.pt", name) is not None


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus format and version) to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        torch.save({"format": FORMAT, "version": CHECKPOINT_VERSION, **payload}, f)


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a Git LFS file is before `git lfs pull`
# torch.save's legacy (pre-zip) format opens with the pickled magic number 0x1950a86a20f9469cfc6c
_LEGACY_TORCH = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
# what torch.load raises on bytes that are no torch file (random bytes reach IndexError, KeyError, ...)
_CORRUPT = (
    RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, IndexError, KeyError, ValueError,
    struct.error, OverflowError,
)  # fmt: skip


def check_not_lfs_pointer(path: str | Path, what: str) -> None:
    """Raise ``CurvlabError`` if ``path`` is a Git LFS pointer file (the real content was never fetched)."""
    with open(path, "rb") as f:
        if f.read(len(LFS_POINTER)) == LFS_POINTER:
            raise CurvlabError(f"{path}: a Git LFS pointer, not the {what} itself (fetch it: git lfs pull)")


def read_file(path: str | Path, what: str = "checkpoint", map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` of one file (``weights_only=True``), with curvlab's errors: a missing file, a Git LFS
    pointer, bytes ``torch.save`` didn't write, a corrupt one, and one whose pickle names a global beyond
    tensors and plain data (refused, with the entry that holds it), each one line naming ``path``."""
    path = Path(path)
    if not path.is_file():
        raise CurvlabError(f"{path}: no such {what}")
    check_not_lfs_pointer(path, what)
    with open(path, "rb") as f:
        head = f.read(len(_LEGACY_TORCH))
    if not zipfile.is_zipfile(path) and head != _LEGACY_TORCH:
        raise CurvlabError(
            f"{path}: corrupt or unreadable {what}: not a whole file torch.save wrote (cut short, or other bytes)"
        )
    if head != _LEGACY_TORCH:
        _check_crcs(path, what)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = refused_global(e)
        entry = None if refused is None else entry_naming(path, refused)
        raise unpickling_error(e, path, f"the {what}", entry) from None
    except _CORRUPT as e:
        raise CurvlabError(f"{path}: corrupt or unreadable {what} ({type(e).__name__})") from e


def _check_crcs(path: Path, what: str) -> None:
    """Raise ``CurvlabError`` if a record of the zip archive fails its CRC-32 (torch's reader doesn't check
    them: a flipped byte in a tensor would load as another value)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise CurvlabError(f"{path}: corrupt or unreadable {what} ({type(e).__name__})") from e
    if bad is not None:
        raise CurvlabError(f"{path}: corrupt {what}: its record {bad} fails its checksum")


SAFETENSORS_HEADER_LIMIT = 100_000_000  # bytes: the safetensors format's own limit on a header


def check_safetensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Raise ``CurvlabError`` unless ``path`` is a whole, well-formed safetensors file; returns each
    tensor's dtype (``"F32"``) and shape by its key, for :func:`curvlab.runs.hf.load_model`'s checks.

    The header's length is checked against the format's limit before the header is read (a sparse file
    claiming a 10 GB header is refused unread), then each tensor's end against the file's size (a truncated
    download is told apart), then ``safe_open`` validates the rest (dtypes, offsets, sizes).
    """
    import safetensors  # (transformers' dependency, the hf extra: only a Trainer directory's weights are read here)

    path = Path(path)
    check_not_lfs_pointer(path, "weights file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        n = int.from_bytes(start, "little") if len(start) == 8 else -1
        if n < 2 or 8 + n > size:
            raise CurvlabError(f"{path}: not a safetensors file, or cut short ({size} bytes)")
        if n > SAFETENSORS_HEADER_LIMIT:
            raise CurvlabError(
                f"{path}: not a safetensors file (a header of {n} bytes, above the format's limit of "
                f"{SAFETENSORS_HEADER_LIMIT})"
            )
        try:
            header = json.loads(f.read(n))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise CurvlabError(f"{path}: not a safetensors file (its header is unreadable)") from e
    if not all(type(end) is int for end in ends):  # (JSON allows 1e3, 1.5 and Infinity)
        raise CurvlabError(f"{path}: not a safetensors file (a tensor's offsets aren't integers)")
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise CurvlabError(f"{path}: truncated: {size} bytes where its header needs {need}")
    try:
        with safetensors.safe_open(path, "pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
            return {key: (t.get_dtype(), tuple(t.get_shape())) for key, t in slices.items()}
    except safetensors.SafetensorError as e:
        raise CurvlabError(f"{path}: a malformed safetensors file ({' '.join(str(e).split())})") from e


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a curvlab checkpoint, raising a one-line ``CurvlabError`` for a missing, corrupt or foreign file."""
    return check_checkpoint(read_file(path, map_location=map_location), path)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, if this torch can use it (else a ``CurvlabError``, not a traceback
    from the first tensor moved there)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise CurvlabError(f"unknown device {device!r}") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CurvlabError(f"device {device!r}: this torch ({torch.__version__}) can't use CUDA here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CurvlabError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return dev


FORMATS = ("curvlab", "nanogpt", "hf-trainer", *FOREIGN_FORMATS)


@dataclass
class ReadCheckpoint:
    """A checkpoint as read from ``path``, before any model is built: its ``format`` (:data:`FORMATS`) and
    ``payload``, the loaded dict (curvlab, nanoGPT), a :class:`curvlab.runs.hf.TrainerCheckpoint`, or a
    :class:`curvlab.runs.foreign.ForeignCheckpoint`."""

    format: str
    path: Path
    payload: Any


def read_checkpoint(path: str | Path) -> ReadCheckpoint:
    """Read a checkpoint of any format curvlab knows (see :data:`FORMATS`), telling them apart by content:
    a directory is a Trainer checkpoint, a file with ``model_args`` nanoGPT's, with a ``format`` field
    curvlab's, else Lightning's or a state dict (:func:`curvlab.runs.foreign.foreign_checkpoint`)."""
    path = Path(path)
    if path.is_dir():
        return ReadCheckpoint("hf-trainer", path, _read_trainer_directory(path))
    if path.is_file() and hf.is_safetensors(path):  # (a directory's weights, not "corrupt": say what to pass)
        raise hf.weights_file_error(path)
    raw = read_file(path)
    if is_nanogpt_checkpoint(raw):
        return ReadCheckpoint("nanogpt", path, raw)
    foreign = None if isinstance(raw, dict) and "format" in raw else foreign_checkpoint(raw, path)
    if foreign is not None:
        return ReadCheckpoint(foreign.format, path, foreign)
    return ReadCheckpoint("curvlab", path, check_checkpoint(raw, path))


def restore_lightning(module: torch.nn.Module, path: str | Path) -> list[torch.optim.Optimizer]:
    """Load a Lightning ``.ckpt`` into a LightningModule (or any module with ``configure_optimizers``): its
    weights into ``module``, strictly, and each optimizer state into the optimizers ``configure_optimizers``
    builds, in order, as Lightning restores them (for :func:`~curvlab.steps.update.next_update`).

    Args:
        module: the LightningModule (or any module with ``configure_optimizers``), in the dtype the
            checkpoint was saved in; its weights are replaced in place.
        path: the Lightning ``.ckpt`` file.

    Returns:
        The optimizers ``configure_optimizers`` builds, in its order, each holding its saved state.

    Raises:
        CurvlabError: not a Lightning checkpoint, weights that don't fit the module or have another dtype
            (``precision="64-true"`` restores into ``module.double()``), or other optimizers than the saved.
    """
    path = Path(path)
    raw = read_file(path)
    if not (isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict) and "optimizer_states" in raw):
        raise CurvlabError(f"{path}: not a Lightning checkpoint with optimizer state (state_dict, optimizer_states)")
    own = module.state_dict()
    cast = [k for k, v in raw["state_dict"].items() if torch.is_tensor(v) and k in own and v.dtype != own[k].dtype]
    if cast:  # (load_state_dict would round or widen them silently: other weights than the saved ones)
        saved, theirs = raw["state_dict"][cast[0]].dtype, own[cast[0]].dtype
        raise CurvlabError(
            f"{path}: its weights are {saved} ({cast[0]}), the module's {theirs}: convert the module first "
            f"(module.to({saved})) so that they load as saved"
        )
    try:
        module.load_state_dict(raw["state_dict"], strict=True)
    except RuntimeError as e:  # (missing, unexpected and mis-shaped keys alike)
        raise CurvlabError(f"{path}: its weights don't fit the module ({' '.join(str(e).split())[:300]})") from e
    optimizers = configured_optimizers(module.configure_optimizers())
    states = raw["optimizer_states"]
    if len(states) != len(optimizers):
        raise CurvlabError(f"{path}: {len(states)} optimizer states saved, {len(optimizers)} configured")
    for optimizer, state in zip(optimizers, states):
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as e:
            raise CurvlabError(f"{path}: a saved optimizer state doesn't fit configure_optimizers' ({e})") from e
    return optimizers


def _read_trainer_directory(path: Path):
    """A Hugging Face Trainer checkpoint directory as a :class:`curvlab.runs.hf.TrainerCheckpoint`."""
    hf.check_trainer_directory(path)
    saved: dict[str, tuple[str, tuple[int, ...]]] = {}  # (the tensors' dtypes and shapes, for the model's checks)
    for weights in hf.weight_files(path):
        if weights.suffix == ".safetensors":
            saved.update(check_safetensors(weights))
        else:
            check_not_lfs_pointer(weights, "weights file")
    args_file, scheduler = path / "training_args.bin", path / "scheduler.pt"
    with torch.serialization.safe_globals(hf.training_args_classes(args_file)):
        args = hf.check_training_args(read_file(args_file, "training arguments"), args_file)
    # (the cheap reads before the model, whose loading prints progress)
    optimizer_state = read_file(path / "optimizer.pt", "optimizer state")
    scheduler_state = read_file(scheduler, "scheduler state") if scheduler.is_file() else None
    return hf.TrainerCheckpoint(
        model=hf.load_model(path, saved),
        optimizer_state=optimizer_state,
        scheduler_state=scheduler_state,
        step=hf.global_step(path),
        args=args,
    )


def check_checkpoint(ckpt: Any, path: str | Path) -> dict[str, Any]:
    """``ckpt`` if it is a curvlab checkpoint of a supported version, else a ``CurvlabError`` naming ``path``."""
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CurvlabError(
            f"{path}: not a checkpoint curvlab knows (curvlab's, nanoGPT's ckpt.pt, a Hugging Face Trainer dir, "
            "a Lightning .ckpt or a torch.save'd state dict)"
        )
    if ckpt.get("version") != CHECKPOINT_VERSION:
        raise CurvlabError(
            f"{path}: checkpoint version {ckpt.get('version')} is not supported (this curvlab reads "
            f"{CHECKPOINT_VERSION})"
        )
    return ckpt


INDEX_FORMAT = "curvlab-index"
# 2: a sealed {format, version, entries, legacy_rows_upto}; 1 (curvlab 0.2.0 and before, still read): a bare
# list of entries, unsealed
INDEX_VERSION = 2
LEGACY_ROWS_UPTO = "legacy_rows_upto"  # rows done at this step or before may lack digests (an upgraded run's)


@dataclass(frozen=True)
class RunIndex:
    """A run's ``index.json``: its ``entries`` by step; ``legacy_rows_upto``: the step up to which its metrics
    rows may lack digests (``None``: all, a version-1 index; -1: none)."""

    entries: list[dict[str, Any]]
    legacy_rows_upto: int | None


def read_run_index(run_dir: str | Path) -> RunIndex | None:
    """The run's checkpoint index (``None`` if there is none yet), entries sorted by step.

    Every entry's ``path`` must lie inside the run (:func:`curvlab.util.paths.inside`), so that nothing
    that reads, resumes from or prunes a run's checkpoints touches a file outside it. An index that is not
    JSON, not its seal's content (version 2), of another version, or with a malformed entry is refused.
    """
    path = Path(run_dir) / INDEX
    if not path.is_file():
        return None
    d = schema.read_json(path, "a checkpoint index")
    legacy: int | None = None
    if isinstance(d, dict):
        if schema.SEAL not in d:  # (a version-2 index is sealed: one without it was edited, or is no index)
            raise CurvlabError(f"{path}: corrupt index (no {schema.SEAL}: edited, or not written by curvlab)")
        d = schema.unsealed(d, path, "checkpoint index")
        if d.get("format") != INDEX_FORMAT or d.get("version") != INDEX_VERSION:
            raise CurvlabError(f"{path}: corrupt index (not a {INDEX_FORMAT} of version {INDEX_VERSION})")
        d, legacy = d.get("entries"), d.get(LEGACY_ROWS_UPTO)
        if type(legacy) is not int:
            raise CurvlabError(f"{path}: corrupt index ({LEGACY_ROWS_UPTO} {legacy!r} is not an integer)")
    elif d == []:  # (no version of curvlab writes an empty index: a damaged one)
        raise CurvlabError(f"{path}: corrupt index (no entries)")
    return RunIndex(_checked_entries(d, run_dir, path), legacy)


def _checked_entries(entries: Any, run_dir: str | Path, path: Path) -> list[dict[str, Any]]:
    """``entries`` sorted by step, once each is ``{step, val_loss, path}`` with a path inside the run."""
    if not isinstance(entries, list):
        raise CurvlabError(f"{path}: corrupt index (a list of entries expected, found {type(entries).__name__})")
    for k, entry in enumerate(entries):
        if not (isinstance(entry, dict) and type(entry.get("step")) is int and "path" in entry):
            raise CurvlabError(f"{path}: corrupt index (entry {k} is not {{step, val_loss, path}})")
        loss = entry.get("val_loss")
        if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float))):
            raise CurvlabError(f"{path}: corrupt index (entry {k}'s val_loss {loss!r} is not a number or null)")
        inside(run_dir, entry["path"], path)
    return sorted(entries, key=lambda e: e["step"])


def read_index(run_dir: str | Path) -> list[dict[str, Any]]:
    """The entries of :func:`read_run_index`, sorted by step (``[]`` if there is none yet)."""
    index = read_run_index(run_dir)
    return [] if index is None else index.entries


def add_to_index(run_dir: str | Path, step: int, val_loss: float, name: str) -> None:
    """Record a checkpoint in the run's index (rewritten atomically and sealed; an entry of the same step is
    replaced). A version-1 index becomes version 2, whose ``legacy_rows_upto`` is its last step (the rows
    after it, written since the resume, have digests)."""
    inside(run_dir, name, Path(run_dir) / INDEX)
    index = read_run_index(run_dir)
    if index is None:
        index = RunIndex([], -1)
    elif index.legacy_rows_upto is None:
        index = RunIndex(index.entries, index.entries[-1]["step"])
    entries = [e for e in index.entries if e["step"] != step]
    entries.append({"step": step, "val_loss": None if math.isnan(val_loss) else val_loss, "path": name})
    record = {"format": INDEX_FORMAT, "version": INDEX_VERSION, LEGACY_ROWS_UPTO: index.legacy_rows_upto}
    atomic_write_json(
        Path(run_dir) / INDEX, schema.sealed({**record, "entries": sorted(entries, key=lambda e: e["step"])})
    )
