"""How a command fails: the library's :class:`~curvlab.errors.CurvlabError` (bad input: missing or corrupt
files, mismatched shapes, non-finite values, a failed write) becomes one line on stderr and exit status 2;
a SIGINT or SIGTERM that ``train``, ``reproduce`` or ``finetune`` honoured at a safe point
(:mod:`curvlab.util.safe_stop`) is one line too, with status 130 or 143. A path whose bytes are not
UTF-8 prints on every locale (:func:`print_any_path`)."""

from __future__ import annotations

import functools
import os
import sys

import typer

from curvlab.errors import CurvlabError


def print_any_path() -> None:
    """Let stdout and stderr print a path that is not UTF-8: Python holds its undecodable bytes as lone
    surrogates (``os.fsdecode``), which a strict stream refuses to encode (a traceback instead of the
    output or the one-line error). stdout writes them back as the bytes they were (as ``ls`` does),
    stderr escapes them (``backslashreplace``: Python's own choice for it)."""
    for stream, errors in ((sys.stdout, "surrogateescape"), (sys.stderr, "backslashreplace")):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=errors)


def one_line_errors(fn):
    """Turn the library's :class:`CurvlabError` (and missing or unwritable files) into ``error: ...`` and
    exit status 2; paths that are not UTF-8 print (:func:`print_any_path`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        print_any_path()
        try:
            return fn(*args, **kwargs)
        except (CurvlabError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
            # torchrun's environment, not the process group: that is torn down before we get here
            world = int(os.environ.get("WORLD_SIZE", "1"))
            where = f"rank {os.environ.get('RANK', '0')}/{world}: " if world > 1 else ""
            typer.echo(f"error: {where}{e}".splitlines()[0], err=True)
            raise typer.Exit(getattr(e, "exit_code", 2)) from None  # (a stop by a signal: 128 + its number)

    return wrapper
