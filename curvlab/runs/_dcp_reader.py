"""torch's DCP files, read without running code.

A DCP checkpoint directory holds ``.metadata``, a plain pickle of torch's ``Metadata``, and the ranks'
``__R_S.distcp`` files: tensors, which torch reads with ``weights_only=True``, and *byte items*, the
state dict's other values ``torch.save``'d one by one (curvlab's are the optimizer's param groups:
learning rates, betas, flags, parameter names), which torch's ``DefaultLoadPlanner`` unpickles with
``weights_only=False``. Read as torch reads them, a crafted ``.metadata`` or byte item runs whatever
its pickle names. Here:

* :func:`read_metadata` unpickles ``.metadata`` with :class:`_MetadataUnpickler`, which resolves only
  torch's checkpoint-metadata classes and the few types they hold (``torch.Size``, dtypes, layouts,
  paths); a file that names anything else is refused in one line, before any of it is built, and so is
  one whose shard files lie outside its directory (``../`` or an absolute path: torch would read them).
* :class:`VettedReader` is torch's ``FileSystemReader`` whose metadata is that one, read once.
* :class:`VettedLoadPlanner` reads byte items with ``torch.load(..., weights_only=True)``.
* :func:`load` is ``dcp.load`` with both; a refusal raised inside torch's collectives (wrapped in its
  ``CheckpointException``, a traceback per rank) comes back as its one line.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from curvlab.errors import CurvlabError
from curvlab.util.paths import inside

METADATA = ".metadata"
# what a .metadata curvlab writes names besides torch.distributed.checkpoint.metadata's own classes
# (found by unpickling real ones): each storage item's location, tensor sizes, dtypes and layouts, and
# the checkpoint's path (pathlib's module is pathlib._local from Python 3.13)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "PurePosixPath", "PureWindowsPath")),
}
_WEIGHTS_ONLY = "Weights only load failed"  # how torch's weights_only unpickler starts a refusal


class _Refused(pickle.UnpicklingError):
    """A global the restricted unpickler won't resolve."""


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        return isinstance(obj, type) and obj.__module__ == module  # its classes, not what it imports
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    return False


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of torch's checkpoint metadata."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """The ``Metadata`` in DCP directory ``path``'s ``.metadata``, unpickled by the restricted unpickler.

    Raises:
        CurvlabError: no ``.metadata``; one that names a global other than torch's checkpoint-metadata
            classes (refused, never built); a corrupt one, or one that holds something else.
    """
    file = Path(path) / METADATA
    try:
        data = file.read_bytes()
        # first a parse that builds nothing (pickletools, pure Python): a length field beyond the file's
        # end, or a memo index beyond it, is refused here, where the C unpickler would first allocate
        # that much (a crafted 1 TiB; a flipped byte's 32 GB memo)
        for op, arg, _ in pickletools.genops(data):
            if op.name.endswith("PUT") and arg > len(data):
                raise ValueError(f"memo index {arg} in a file of {len(data)} bytes")
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except FileNotFoundError:
        raise CurvlabError(f"{path}: no {METADATA}: not a DCP checkpoint directory") from None
    except _Refused as e:
        raise CurvlabError(
            f"{file}: names {str(e)!r}, not only torch's checkpoint metadata; refusing to unpickle it (it could "
            "run code)"
        ) from None
    # (what unpickling other bytes raises: a random file reaches each of these)
    except (
        pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError, AttributeError, LookupError,
        ArithmeticError, MemoryError, RuntimeError,
    ) as e:  # fmt: skip
        raise CurvlabError(f"{file}: corrupt or unreadable DCP metadata ({type(e).__name__})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CurvlabError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():  # the shard files it sends torch's reader to
        inside(path, getattr(info, "relative_path", None), file)
    return metadata


class VettedReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader`` of ``path``, whose metadata is :func:`read_metadata`'s, read once
    here (a refusal is raised here, before ``dcp.load``, whose collectives would swallow it into a
    warning and a retry)."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self._metadata = read_metadata(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = self._metadata
        if metadata.storage_meta is None:  # (as torch's reader does)
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class VettedLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner``, whose byte items are unpickled with ``weights_only=True``."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            if _WEIGHTS_ONLY not in str(e):
                raise CurvlabError(f"{self.path}: corrupt byte item {fqn!r} (UnpicklingError)") from None
            raise CurvlabError(
                f"{self.path}: byte item {fqn!r} names objects beyond tensors and plain data; refusing to "
                "unpickle it (it could run code)"
            ) from None
        except (RuntimeError, EOFError, ValueError, KeyError, IndexError) as e:
            raise CurvlabError(f"{self.path}: corrupt byte item {fqn!r} ({type(e).__name__})") from None
        # torch's planner unpickles what it is given with weights_only=False: give it bytes written here
        # from the vetted value (tensors and plain data), never the file's own
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load(state)`` from DCP directory ``path`` through :class:`VettedReader` and
    :class:`VettedLoadPlanner`, on every rank.

    Raises:
        CurvlabError: a refused or corrupt ``.metadata``, byte item or tensor (on every rank: torch
            gathers each rank's failure to all).
    """
    try:
        dcp.load(state, storage_reader=VettedReader(path), planner=VettedLoadPlanner(path))
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CurvlabError):
                raise CurvlabError(str(exc)) from None
        for exc, _ in e.failures.values():
            if isinstance(exc, pickle.UnpicklingError) and _WEIGHTS_ONLY in str(exc):
                raise CurvlabError(
                    f"{path}: a tensor in a shard names objects beyond tensors; refusing to unpickle it (it "
                    "could run code)"
                ) from None
        raise
