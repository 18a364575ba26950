"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A crash or a full disk mid-write leaves the previous file (or none) in place, never half of one. A write
that fails (:data:`WRITE_ERRNOS`, torch's writer's ``RuntimeError`` included) removes its temporary and
raises one :class:`~curvlab.errors.CurvlabError` naming the file and the cause; any other error keeps its
traceback. A killed writer leaves its temporary (:data:`TEMPORARY`) for :func:`remove_stale_temporaries`;
a live writer holds an ``flock`` on its own until the rename, so it is never taken for a leftover.

A write never goes through a link: a destination that is a symbolic link is refused, and inside
:func:`writes_confined_to` so is one whose folder resolves outside that folder.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from curvlab.errors import CurvlabError

# curvlab's temporaries, files (atomic_open) and directories (a data folder being generated): what
# tempfile.mkstemp/mkdtemp(**temporary_options(path)) makes, 8 characters of [a-z0-9_] in the middle
TEMPORARY_SUFFIX = ".curvlab-tmp"
TEMPORARY = re.compile(rf"^\.(?P<name>.+)\.[a-z0-9_]{{8}}{re.escape(TEMPORARY_SUFFIX)}$")

# the errors of a write that the user can act on (ELOOP: a link where a file opened with O_NOFOLLOW
# belongs); anything else (a timeout, no memory) is unexpected and keeps its traceback
WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ENOTDIR,
     errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP}
)  # fmt: skip
# what the RuntimeError of torch's zip writer says when the write under it failed
TORCH_WRITER = ("inline_container", "unexpected pos", "PytorchStreamWriter")
# flock(2) on a file system without it (some network and FUSE file systems)
NO_FLOCK = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK})


def temporary_options(path: str | Path) -> dict[str, Any]:
    """The ``tempfile.mkstemp``/``mkdtemp`` arguments of a temporary for ``path``, beside it and named
    ``.<name>.<8 random>.curvlab-tmp`` (:data:`TEMPORARY`)."""
    path = Path(path)
    return {"prefix": f".{path.name}.", "suffix": TEMPORARY_SUFFIX, "dir": path.parent}


def temporary_of(path: str | Path) -> str | None:
    """The name of the file or directory that ``path`` is a curvlab temporary of, or ``None``."""
    match = TEMPORARY.match(Path(path).name)
    return match["name"] if match else None


def write_failure(error: BaseException, *names: str | Path) -> OSError | None:
    """The ``OSError`` behind ``error`` when it is the failure of a write (one of :data:`WRITE_ERRNOS`, to an
    open file or on one of ``names``), else ``None``: ``error`` itself, or the context of a ``RuntimeError``
    of torch's writer (``torch.save`` into a full disk: "[enforce fail at inline_container.cc] unexpected pos")."""
    names = {str(n) for n in names}
    torch_writer = isinstance(error, RuntimeError) and any(t in str(error) for t in TORCH_WRITER)
    for e in (error, error.__context__ if torch_writer else None):
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS and (e.filename is None or str(e.filename) in names):
            return e
    return None


def _cause(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


@contextlib.contextmanager
def write_errors(path: str | Path, *names: str | Path) -> Iterator[None]:
    """Inside, a failed write (:func:`write_failure`: to an open file, or on ``path`` or ``names``) is
    one ``CurvlabError`` naming ``path`` and its cause; anything else keeps its traceback."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        failure = write_failure(e, path, *names)
        if failure is None:
            raise
        raise CurvlabError(f"{path}: can't write ({_cause(failure)})") from e


# the folders whose writes stay inside them (writes_confined_to), as given, made absolute
_confined: list[str] = []


@contextlib.contextmanager
def writes_confined_to(directory: str | Path) -> Iterator[None]:
    """Inside, an :func:`atomic_open` of a path below ``directory`` by name whose folder resolves elsewhere,
    through a symbolic link on the way, is refused."""
    root = os.path.abspath(directory)
    _confined.append(root)
    try:
        yield
    finally:
        _confined.remove(root)


def _check_destination(path: Path) -> None:
    """Refuse a destination that is a symbolic link, or whose folder leads out of a confined folder."""
    if path.is_symlink():
        raise CurvlabError(f"{path}: is a symbolic link: refused (curvlab replaces files, never a link; remove it)")
    for root in _confined:
        if _below(os.path.abspath(path), root) and not _below(os.path.realpath(path.parent), os.path.realpath(root)):
            raise CurvlabError(f"{path}: its folder leads out of {root} (a symbolic link on the way): refused")


def _below(path: str, folder: str) -> bool:
    """Whether the absolute ``path`` is ``folder`` or lies below it, by name."""
    return os.path.commonpath([folder, path]) == folder


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``, on error it vanishes (see the
    module docstring for what is refused, and how a failed write is reported)."""
    path = Path(path)
    _check_destination(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _locked_temporary(path)
    except OSError as e:  # (no folder can be made there, or no file in it)
        raise CurvlabError(f"{path}: write failed ({_cause(e)}); the previous file, if any, is unchanged") from e
    f = os.fdopen(fd, mode)
    try:
        yield f
        f.flush()
        os.fsync(fd)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError, ValueError):  # (closing flushes what is buffered: it may fail again)
            f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        failure = write_failure(e, tmp, path)
        if failure is None:
            raise
        raise CurvlabError(f"{path}: write failed ({_cause(failure)}); the previous file, if any, is unchanged") from e
    f.close()  # (releases the lock, after the rename)


def _locked_temporary(path: Path, attempts: int = 100) -> tuple[int, str]:
    """A new temporary for ``path``, open and locked by this process until it is closed: its descriptor and
    name. Between ``mkstemp`` and the lock a remover may unlink it, and then another is made."""
    for _ in range(attempts):
        fd, tmp = tempfile.mkstemp(**temporary_options(path))
        try:
            if not _lock(fd, wait=True):
                # no flock on this file system: the write goes on unlocked; a remover can't lock there
                # either, and leaves every temporary
                return fd, tmp
            if _same_file(fd, tmp):
                return fd, tmp
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.close(fd)  # (removed by a remover: its name is gone, or another file's)
    raise OSError(errno.EAGAIN, f"each of {attempts} temporaries was removed before it could be locked")


def _lock(fd: int, wait: bool) -> bool:
    """Take an exclusive ``flock`` on ``fd`` (waiting for it with ``wait``); ``False`` when the file
    system has no ``flock`` (:data:`NO_FLOCK`) or, without ``wait``, another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError as e:
        if e.errno in NO_FLOCK or (not wait and isinstance(e, BlockingIOError)):
            return False
        raise
    return True


def _same_file(fd: int, name: str | Path) -> bool:
    """Whether the file open as ``fd`` is the one at ``name`` (not a symbolic link followed)."""
    try:
        there = os.lstat(name)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def remove_stale_temporaries(*directories: str | Path, recursive: bool = False) -> list[Path]:
    """Remove the temporaries that :func:`atomic_open` left in ``directories`` (with ``recursive``, below
    them too) when its process was killed mid-write: the files named :data:`TEMPORARY` that no live writer
    holds locked. Call it once the folder's owner lock is held. Returns the paths removed."""
    found = set()
    for directory in map(Path, directories):
        if directory.is_dir():
            pattern = f".*{TEMPORARY_SUFFIX}"
            found.update(directory.rglob(pattern) if recursive else directory.glob(pattern))
    removed = []
    for p in sorted(found):
        if temporary_of(p) is None or p.is_symlink() or not p.is_file():
            continue
        try:  # (open for writing: on NFS an exclusive flock needs it)
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone already, or not ours to write
            continue
        try:
            with contextlib.suppress(OSError):  # no lock, no flock here, or gone meanwhile: left alone
                # unlocked (a dead writer's) and still the file at that name (not renamed into place,
                # nor replaced by a new temporary of that name)
                if _lock(fd, wait=False) and _same_file(fd, p):
                    os.unlink(p)
                    removed.append(p)
        finally:
            os.close(fd)
    return removed


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """``rows`` as a CSV with a header of every key in order of appearance (a key a row lacks is blank)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())


def atomic_write_with(path: str | Path, write: Callable[[IO], None]) -> None:
    """``write(file)`` into a temporary file, then rename it to ``path``."""
    with atomic_open(path, "wb") as f:
        write(f)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_public(directory: str | Path) -> None:
    """Give a directory made by ``tempfile.mkdtemp`` (0700) the usual permissions."""
    os.chmod(directory, 0o777 & ~_umask())


def check_output(path: str | Path, directory: bool = False) -> None:
    """Raise ``CurvlabError`` unless ``path`` can be written, as a file or a ``directory``, under a folder
    this process can really create files in (tried: permission bits don't bind root). Commands call it
    before computing, so that a bad ``--out`` costs nothing."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise CurvlabError(f"{path}: exists and is not a directory")
    if not directory and path.is_dir():
        raise CurvlabError(f"{path}: is an existing directory; give a file name")
    folder = path if directory else path.parent
    while not folder.exists():  # the nearest folder that exists is where the new ones are made
        folder = folder.parent
    if not folder.is_dir():
        raise CurvlabError(f"{path}: {folder} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".curvlab-write-test.", dir=folder)
    except OSError as e:
        raise CurvlabError(f"{path}: can't write in {folder} ({e.strerror or type(e).__name__})") from e
    os.close(fd)
    os.unlink(probe)


def strict_json(obj):
    """``obj`` with every non-finite float replaced by None (``NaN`` is not JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj, indent: int = 1) -> None:
    """Write ``obj`` as strict JSON (non-finite floats as null), atomically."""
    atomic_write_text(path, json.dumps(strict_json(obj), indent=indent, allow_nan=False) + "\n")
