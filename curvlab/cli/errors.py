"""How a command fails: the library's :class:`~curvlab.errors.CurvlabError` (bad input: missing or corrupt
files, mismatched shapes, non-finite values, a failed write) becomes one line on stderr and exit status 2;
a SIGINT or SIGTERM that ``train``, ``reproduce`` or ``finetune`` honoured at a safe point
(:mod:`curvlab.util.safe_stop`) is one line too, with status 130 or 143."""

from __future__ import annotations

import functools
import os

import typer

from curvlab.errors import CurvlabError


def one_line_errors(fn):
    """Turn the library's :class:`CurvlabError` (and missing or unwritable files) into ``error: ...`` and
    exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (CurvlabError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
            # torchrun's environment, not the process group: that is torn down before we get here
            world = int(os.environ.get("WORLD_SIZE", "1"))
            where = f"rank {os.environ.get('RANK', '0')}/{world}: " if world > 1 else ""
            typer.echo(f"error: {where}{e}".splitlines()[0], err=True)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None  # (a stop by a signal: 128 + its number)

    return wrapper
