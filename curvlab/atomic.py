"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A crash or a full disk mid-write leaves the previous file (or none) in place, never half of one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


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
