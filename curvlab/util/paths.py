"""Paths named by a file inside a directory stay inside that directory, and a path is the place it
names, however it was spelled.

A run directory is copied and shared, so what its files name is untrusted: ``../victim.txt`` in an
``index.json`` must not become a file curvlab reads, overwrites or deletes (:func:`inside`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from curvlab.errors import CurvlabError


def same_path(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` name one place, each resolved (relative to the working directory, ``..``
    and symbolic links followed); values that are no paths (``None``, a number) are compared as they are."""
    if isinstance(a, (str, Path)) and isinstance(b, (str, Path)):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def inside(directory: str | Path, name: str | Path, source: str | Path) -> Path:
    """``directory / name``, if that path, with every symbolic link and ``..`` resolved, lies strictly
    inside ``directory`` (resolved the same way), else a ``CurvlabError`` naming ``source``, the file that
    named it."""
    if not isinstance(name, (str, Path)) or not str(name):
        raise CurvlabError(f"{source}: names {name!r} where a file name belongs: refused")
    # on strings, with os.path: what decides containment is no method of a class that other code (a
    # crafted pickle, say) could have replaced
    root = os.path.realpath(os.fspath(directory))
    resolved = os.path.realpath(os.path.join(root, os.fspath(name)))
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        raise CurvlabError(f"{source}: names {str(name)!r}, which lies outside {directory}: refused")
    return Path(directory) / name
