"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A crash or a full disk mid-write leaves the previous file (or none) in place, never half of one.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from curvlab.errors import CurvlabError


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success it replaces ``path``, on error it vanishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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
