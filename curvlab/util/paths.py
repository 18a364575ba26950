"""Paths named by a file inside a directory stay inside that directory, and a path is the place it
names, however it was spelled.

A run directory is copied and shared, so what its files name (an index entry, a report's file name)
is untrusted: ``../victim.txt`` or ``/home/me/.bashrc`` in an ``index.json`` must not become a file
that curvlab reads, overwrites or deletes. :func:`inside` is the one check every such read goes through.

:func:`same_path` is how a saved path (a run's data, a fine-tuning's base) is compared with a new one:
``results``, ``./results`` and ``/home/me/results`` are one directory.
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
    inside ``directory`` (resolved the same way); ``source`` is the file that named it.

    Raises:
        CurvlabError: ``name`` is not a string or path, or it leads outside ``directory`` (``..``
            parts, an absolute path elsewhere, a link out) or to ``directory`` itself; the one line
            names ``source`` and ``name``.
    """
    if not isinstance(name, (str, Path)) or not str(name):
        raise CurvlabError(f"{source}: names {name!r} where a file name belongs: refused")
    # on strings, with os.path: what decides containment is no method of a class that other code (a
    # crafted pickle, say) could have replaced
    root = os.path.realpath(os.fspath(directory))
    resolved = os.path.realpath(os.path.join(root, os.fspath(name)))
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        raise CurvlabError(f"{source}: names {str(name)!r}, which lies outside {directory}: refused")
    return Path(directory) / name
