"""Paths named by a file inside a directory stay inside that directory.

A run directory is copied and shared, so what its files name (an index entry, a report's file name)
is untrusted: ``../victim.txt`` or ``/home/me/.bashrc`` in an ``index.json`` must not become a file
that curvlab reads, overwrites or deletes. :func:`inside` is the one check every such read goes through.
"""

from __future__ import annotations

import os
from pathlib import Path

from curvlab.errors import CurvlabError


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
