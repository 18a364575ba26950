"""torch's DCP files, read without running code.

A DCP checkpoint directory holds ``.metadata``, a plain pickle, and the ranks' ``__R_S.distcp`` files:
tensors (read with ``weights_only=True``) and *byte items*, the state dict's other values (curvlab's:
the optimizer's param groups), which torch's ``DefaultLoadPlanner`` unpickles with no restriction. Read as
torch reads them, a crafted ``.metadata`` or byte item runs whatever its pickle names. Here:

* :func:`read_metadata` unpickles ``.metadata`` with :class:`_MetadataUnpickler`, which resolves only
  torch's checkpoint-metadata classes and the few types they hold, and changes only the objects it
  builds; a file that names or does anything else, whose parts are not what torch's reader takes, or
  whose shard files lie outside its directory is refused in one line.
* :class:`VettedReader` is torch's ``FileSystemReader`` whose metadata is that one, read once.
* :class:`VettedLoadPlanner` reads byte items with ``torch.load(..., weights_only=True)``.
* :func:`load` is ``dcp.load`` with both; a refusal raised inside torch's collectives, or a shard torch's
  reader fails to read, comes back as one line.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
import traceback
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.default_planner as dcp_default_planner
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from curvlab.errors import CurvlabError
from curvlab.util.paths import inside
from curvlab.util.weights_only import refused_global, unpickling_error

METADATA = ".metadata"
# what a .metadata names besides torch.distributed.checkpoint.metadata's classes (found by unpickling real
# ones): storage locations, sizes, dtypes, layouts, the path (pathlib._local from Python 3.13)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((m, c) for m in ("pathlib", "pathlib._local") for c in ("PosixPath", "PurePosixPath", "PureWindowsPath")),
}
# the objects whose attributes a .metadata may set (pickle's BUILD): instances of torch's metadata
# dataclasses, which the unpickler creates itself (never a class, a module, a dtype or an enum member)
_BUILDABLE = frozenset(
    {dcp_filesystem._StorageInfo}
    | {
        obj for obj in vars(dcp_metadata).values()
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__ and dataclasses.is_dataclass(obj)
    }
)  # fmt: skip


class _Refused(pickle.UnpicklingError):
    """A global the restricted unpickler won't resolve."""


class _Changes(pickle.UnpicklingError):
    """An object the restricted unpickler won't change (its description)."""


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    if module == dcp_metadata.__name__:
        obj = getattr(dcp_metadata, name, None)
        return isinstance(obj, type) and obj.__module__ == module  # its classes, not what it imports
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    return False


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _vetted(load: Callable, depth: int, kinds: tuple[type, ...], marked: bool = False) -> Callable:
    """Pickle's opcode ``load``, once the object it changes is of one of ``kinds`` (``_MetadataUnpickler._target``)."""

    def op(self: _MetadataUnpickler) -> None:
        self._target(depth, kinds, marked)
        load(self)

    return op


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be vetted, the C one's can't), resolving only torch's
    checkpoint-metadata globals and changing only what it builds: BUILD only on a metadata dataclass
    instance (no dunder attributes), SETITEM(S), APPEND(S) and ADDITEMS only on a dict, a list or a set
    (BUILD on an allowed class would ``setattr`` on the class itself, for the whole process)."""

    dispatch: ClassVar[dict[int, Callable]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)

    def _target(self, depth: int, kinds: tuple[type, ...], marked: bool = False) -> None:
        """Refuse unless the object the next opcode changes, ``depth`` down its stack (the stack below
        the last mark, for an opcode that pops one), is of one of ``kinds``."""
        stack = (self.metastack[-1] if self.metastack else []) if marked else self.stack
        target = stack[-depth] if len(stack) >= depth else None
        if type(target) not in kinds:
            raise _Changes(_describe(target))

    def _build(self) -> None:
        self._target(2, tuple(_BUILDABLE))
        state = self.stack[-1]
        if not hasattr(self.stack[-2], "__setstate__"):  # (TensorProperties' takes a tuple of its fields)
            dicts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
            for d in dicts:
                if d is not None and (
                    type(d) is not dict or not all(type(k) is str and not k.startswith("__") for k in d)
                ):
                    raise _Changes(f"the attributes {list(d)[:3]!r} of {_describe(self.stack[-2])}")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build
    dispatch[pickle.SETITEM[0]] = _vetted(pickle._Unpickler.load_setitem, 3, (dict, OrderedDict))
    dispatch[pickle.SETITEMS[0]] = _vetted(pickle._Unpickler.load_setitems, 1, (dict, OrderedDict), marked=True)
    dispatch[pickle.APPEND[0]] = _vetted(pickle._Unpickler.load_append, 2, (list,))
    dispatch[pickle.APPENDS[0]] = _vetted(pickle._Unpickler.load_appends, 1, (list,), marked=True)
    dispatch[pickle.ADDITEMS[0]] = _vetted(pickle._Unpickler.load_additems, 1, (set,), marked=True)


def read_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """The ``Metadata`` in DCP directory ``path``'s ``.metadata``, unpickled by the restricted unpickler
    (see the module docstring for what it refuses)."""
    file = Path(path) / METADATA
    try:
        data = file.read_bytes()
        # first a parse that builds nothing: a length field or memo index beyond the file's end (a crafted
        # 1 TiB; a flipped byte's 32 GB memo) is refused before any object is built
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
    except _Changes as e:
        raise CurvlabError(
            f"{file}: would change {e} (it may fill in only the metadata objects it builds); refusing to "
            "unpickle it (it could change code for the whole process)"
        ) from None
    # (what unpickling other bytes raises: a random file reaches each of these)
    except (
        pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError, AttributeError, LookupError,
        ArithmeticError, MemoryError, RuntimeError,
    ) as e:  # fmt: skip
        raise CurvlabError(f"{file}: corrupt or unreadable DCP metadata ({type(e).__name__})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CurvlabError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata")
    _check_parts(metadata, file)
    for info in metadata.storage_data.values():  # the shard files it sends torch's reader to
        inside(path, info.relative_path, file)
    return metadata


_MISSING = object()


def _check_parts(metadata: dcp_metadata.Metadata, file: Path) -> None:
    """Raise ``CurvlabError`` (naming ``file``) unless ``metadata``'s parts are of the types torch's reader
    and curvlab take (a crafted file can build its allowed classes with any fields, or leave fields out)."""

    def need(value: Any, ok: Callable[[Any], bool], what: str, expected: str) -> Any:
        if not ok(value):
            if value is _MISSING:
                got = "missing"
            elif type(value) in (int, float, str) and len(repr(value)) < 40:
                got = repr(value)
            else:
                got = f"a {type(value).__name__}"
            raise CurvlabError(f"{file}: {what} is {got}, not {expected}: not DCP metadata torch writes")
        return value

    def part(obj: Any, name: str) -> Any:
        return getattr(obj, name, _MISSING)

    def of(*kinds: type) -> Callable[[Any], bool]:
        return lambda value: type(value) in kinds

    def count(value: Any) -> bool:
        return type(value) is int and value >= 0

    tensor, nbytes, size = dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata, of(torch.Size)
    storage = need(part(metadata, "storage_data"), of(dict), "its storage_data", "a dict of storage items")
    for key, info in storage.items():
        need(key, of(dcp_metadata.MetadataIndex), "a storage_data key", "a MetadataIndex")
        fqn = need(part(key, "fqn"), of(str), "a storage_data key's fqn", "a str")
        need(info, of(dcp_filesystem._StorageInfo), f"storage item {fqn!r}", "a _StorageInfo")
        need(part(info, "relative_path"), of(str), f"storage item {fqn!r}'s relative_path", "a str")
        need(part(info, "offset"), count, f"storage item {fqn!r}'s offset", "an int >= 0")
        need(part(info, "length"), count, f"storage item {fqn!r}'s length", "an int >= 0")
    entries = need(part(metadata, "state_dict_metadata"), of(dict), "its state_dict_metadata", "a dict of entries")
    for name, entry in entries.items():
        need(name, of(str), "a state_dict_metadata key", "a str")
        if type(need(entry, of(tensor, nbytes), f"entry {name!r}", "tensor or bytes metadata")) is nbytes:
            continue
        need(part(entry, "size"), size, f"entry {name!r}'s size", "a torch.Size")
        properties = part(entry, "properties")
        need(properties, of(dcp_metadata.TensorProperties), f"entry {name!r}'s properties", "TensorProperties")
        need(part(properties, "dtype"), of(torch.dtype), f"entry {name!r}'s dtype", "a dtype")
        for chunk in need(part(entry, "chunks"), of(list), f"entry {name!r}'s chunks", "a list"):
            need(chunk, of(dcp_metadata.ChunkStorageMetadata), f"a chunk of {name!r}", "ChunkStorageMetadata")
            need(part(chunk, "offsets"), size, f"a chunk of {name!r}'s offsets", "a torch.Size")
            need(part(chunk, "sizes"), size, f"a chunk of {name!r}'s sizes", "a torch.Size")
    meta = part(metadata, "storage_meta")
    need(meta, of(type(None), dcp_metadata.StorageMeta), "its storage_meta", "None or a StorageMeta")


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
            raise unpickling_error(e, self.path, f"byte item {fqn!r}") from None
        except (RuntimeError, EOFError, ValueError, KeyError, IndexError) as e:
            raise CurvlabError(f"{self.path}: corrupt byte item {fqn!r} ({type(e).__name__})") from None
        # placed as torch's planner places a byte item, without its own unpickling of the bytes
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load(state)`` from DCP directory ``path`` through :class:`VettedReader` and
    :class:`VettedLoadPlanner`, on every rank (a refused or corrupt part fails on all of them)."""
    try:
        dcp.load(state, storage_reader=VettedReader(path), planner=VettedLoadPlanner(path))
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, CurvlabError):
                raise CurvlabError(str(exc)) from None
        for exc, _ in e.failures.values():
            if refused_global(exc) is not None:
                raise unpickling_error(exc, path, "a tensor in a shard") from None
        for exc, stack in e.failures.values():
            if _failed_reading_a_shard(exc, stack):
                raise CurvlabError(
                    f"{path}: corrupt shard: torch failed reading a tensor item in it ({type(exc).__name__})"
                ) from None
        raise


# what torch raises on a tensor item's bytes that are no torch file (its zip reader, torch.load, the
# rebuild of the tensor, read_data's own size check)
_SHARD_FAILURES = (RuntimeError, EOFError, ValueError, AssertionError, pickle.UnpicklingError)
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _failed_reading_a_shard(exc: BaseException, stack: traceback.StackSummary) -> bool:
    """Whether ``exc``, raised where ``stack`` says, is torch failing to read a shard file's bytes: one of
    :data:`_SHARD_FAILURES` raised under ``FileSystemReader.read_data`` by torch's own code, not a planner's."""
    if not isinstance(exc, _SHARD_FAILURES):
        return False
    frames = list(stack)
    reading = [i for i, f in enumerate(frames) if f.name == "read_data" and f.filename == dcp_filesystem.__file__]
    return bool(reading) and all(
        f.filename.startswith(_TORCH) and f.filename != dcp_default_planner.__file__ for f in frames[reading[-1] :]
    )
