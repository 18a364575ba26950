"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A crash or a full disk mid-write leaves the previous file (or none) in place, never half of one:

* a write that fails (no space, a file-size limit, no permission, a read-only file system) removes its
  temporary and raises one :class:`~curvlab.errors.CurvlabError` naming the file and the cause
  (:func:`atomic_open`; torch's writer, which reports a failed write as a ``RuntimeError``, included);
* a write whose process was killed (kill -9) leaves its temporary, ``.<name>.<8 random>.tmp``, beside
  the file; :func:`remove_stale_temporaries` removes such leftovers when a command next opens the
  folder for writing. A writer holds an exclusive ``flock`` on its temporary until the rename, so a
  live one's is never taken for a leftover (the kernel drops a killed process's lock).
"""

from __future__ import annotations

import contextlib
import csv
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

# what tempfile.mkstemp(prefix=".<name>.", suffix=".tmp") makes: 8 characters of [a-z0-9_] in between
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")


def write_failure(error: BaseException, *names: str | Path) -> OSError | None:
    """The ``OSError`` behind ``error`` when it is the failure of a write (to an open file, or on one of
    ``names``), else ``None``: ``error`` itself, or the ``OSError`` a ``RuntimeError`` of torch's
    writer was raised in handling (``torch.save`` into a full file: "[enforce fail at
    inline_container.cc] unexpected pos", whose context is the write's ``OSError``)."""
    names = {str(n) for n in names}
    for e in (error, error.__context__ if isinstance(error, RuntimeError) else None):
        if isinstance(e, OSError) and (e.filename is None or str(e.filename) in names):
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


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``, on error it vanishes.

    Raises:
        CurvlabError: a write failed (no space, a file-size limit, permissions, a read-only file
            system): one line naming ``path`` and the cause; ``path`` is as it was before.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # (no folder can be made there, or no file in it)
        raise CurvlabError(f"{path}: write failed ({_cause(e)}); the previous file, if any, is unchanged") from e
    f = os.fdopen(fd, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until the rename: remove_stale_temporaries leaves this one
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
    f.close()


def remove_stale_temporaries(*directories: str | Path, recursive: bool = False) -> list[Path]:
    """Remove the temporaries that :func:`atomic_open` left in ``directories`` (and, with ``recursive``,
    in the folders below them) when its process was killed mid-write: the files named like its own
    (:data:`TEMPORARY`) that no live writer holds locked. Call it once the folder's owner lock is held
    (:mod:`curvlab.util.lock`). Returns the paths removed."""
    found = set()
    for directory in map(Path, directories):
        if directory.is_dir():
            found.update(directory.rglob(".*.tmp") if recursive else directory.glob(".*.tmp"))
    removed = []
    for p in sorted(found):
        if not TEMPORARY.match(p.name) or p.is_symlink() or not p.is_file():
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # gone already, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(p)
            removed.append(p)
        except (BlockingIOError, FileNotFoundError):  # a live writer's, or renamed into place meanwhile
            pass
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
    """Raise ``CurvlabError`` unless ``path`` can be written: a file (``directory=False``) that is not an
    existing directory, or a directory that is not an existing file, under a folder this process can
    really create files in (tried, not guessed from permission bits, which don't bind root). Commands
    call it before computing, so that a bad ``--out`` costs nothing."""
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
    """``obj`` with every non-finite float replaced by None, so that ``json.dumps(..., allow_nan=False)``
    writes JSON every parser reads (``NaN`` is not JSON)."""
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
