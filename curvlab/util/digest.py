"""Content digests (SHA-256, hex) that let a cache tell its own entries from edited or stale ones."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:  # (hashlib.file_digest is Python 3.11+; curvlab supports 3.10)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def path_digest(path: str | Path) -> str | None:
    """SHA-256 of ``path``'s content: a file's bytes, or a directory's files (relative path and bytes'
    digest of each, in path order); ``None`` where there is neither."""
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path).as_posix()}\0{_file_digest(f)}\n".encode())
    return h.hexdigest()


def json_digest(value: Any) -> str:
    """SHA-256 of ``value``'s canonical JSON text (sorted keys, no spaces, ``NaN`` as Python writes it): the
    same value read back from any indentation has the same digest."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()
