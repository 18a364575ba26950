"""Options that check their values where they are parsed, with their ranges in ``--help``: counts and seeds
(typer's ``min``/``max``), finite numbers (a callback for infinities; NaN already fails the bounds), token
counts; the group class that prints a bad value as one ``error: ...`` line; and the refusals of a size the
machine can't hold, or of a command whose optional packages are missing, before any work starts."""

from __future__ import annotations

import math
import os
import shutil
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
import typer
from typer.core import TyperGroup

from curvlab.data.dataset import parse_count
from curvlab.errors import CurvlabError
from curvlab.runs.config import MAX_COUNT, SEED_MAX


class OneLineUsageErrors(TyperGroup):
    """The command group whose bad option values (typer's ``BadParameter``: out of range, not a number, a
    callback's refusal, a missing option) print as one ``error: ...`` line with exit status 2, as the
    library's own errors do (:mod:`curvlab.cli.errors`), instead of typer's usage box."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except typer.BadParameter as e:
            typer.echo(f"error: {e.format_message()}".splitlines()[0], err=True)
            raise typer.Exit(e.exit_code) from None


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _positive(value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a finite number > 0")
    return value


def count(default: int | None, *decls: str, low: int = 1, high: int = MAX_COUNT, **kwargs: Any) -> Any:
    """An int option in [low, high] (``--help`` shows the range)."""
    return typer.Option(default, *decls, min=low, max=high, **kwargs)


def seed_option(default: int | None, **kwargs: Any) -> Any:
    """A seed, in [0, 2**32 - 1]: what numpy and torch both take."""
    return count(default, low=0, high=SEED_MAX, **kwargs)


def number(default: float | None, *decls: str, low: float | None = None, high: float | None = None, **kwargs) -> Any:
    """A finite float option in [low, high] (``--help`` shows the range; NaN fails it, infinities the callback)."""
    return typer.Option(default, *decls, min=low, max=high, callback=_finite, **kwargs)


def positive(default: float | None, *decls: str, help: str, **kwargs: Any) -> Any:
    """A finite float option > 0 (typer has no open bound, so the help says it: rich reads [x>0] as markup)."""
    return typer.Option(default, *decls, help=f"{help} (x>0)", callback=_positive, **kwargs)


def token_count(text: str) -> int:
    """Callback of a count option written like 20M or 500k: the count, an int > 0."""
    try:
        return parse_count(text)
    except (ValueError, OverflowError):  # a CurvlabError (a ValueError); nan and inf parse, then fail round()
        raise typer.BadParameter(f"{text!r} is not a positive count (e.g. 20M, 500k or 1000)") from None


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def machine_memory(device: str = "cpu") -> int:
    """The bytes of memory ``device`` has in all: a CUDA device's own, else the machine's RAM. All, not
    what is free now: a size is refused only when no moment of this machine could hold it."""
    if device == "auto" or device.startswith("cuda"):
        index = (torch.device(device).index if device != "auto" else None) or 0
        if index < torch.cuda.device_count():  # (none without CUDA: the run then refuses a cuda device itself)
            return torch.cuda.get_device_properties(index).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refuse_beyond_memory(needed: int, what: str, device: str = "cpu") -> None:
    """Raise CurvlabError when ``what`` needs more memory than ``device`` has (the estimate named)."""
    have = machine_memory(device)
    if needed > have:
        raise CurvlabError(f"{what} needs about {gigabytes(needed)} of memory, more than the {gigabytes(have)} here")


def refuse_beyond_disk(needed: int, what: str, out: Path) -> None:
    """Raise CurvlabError when ``what`` needs more disk than is free where ``out`` would be written."""
    folder = Path(out).absolute()
    while not folder.exists():  # the nearest folder that exists holds what is made below it
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise CurvlabError(
            f"{what} needs about {gigabytes(needed)} of disk, more than the {gigabytes(free)} free in {folder}"
        )


def require_extras(extras: dict[str, str], what: str) -> None:
    """Raise CurvlabError naming the missing optional packages of ``extras`` (module -> the curvlab extra
    that installs it) that ``what`` needs, before it starts."""
    missing = [module for module in extras if find_spec(module) is None]
    if missing:
        install = ",".join(sorted({extras[m] for m in missing}))
        raise CurvlabError(
            f"{what} needs {', '.join(missing)}, which is not installed: pip install 'curvlab[{install}]'"
        )
