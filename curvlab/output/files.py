"""The files ``curvlab spectrum`` and ``curvlab quadratic`` write: each one's record (schema-versioned
JSON, written atomically) and its figures. The other commands' studies write their own
(:func:`curvlab.studies.compare.compare_runs`, :meth:`curvlab.analysis.report.CurvatureReport.save`, ...).

Under torch.distributed only rank 0 writes; every function returns the paths written (none on the
other ranks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from curvlab.analysis.spectrum import CheckpointSpectrum
from curvlab.errors import CurvlabError
from curvlab.output.plots import quadratic_phase, quadratic_trajectories, spectral_density_plot
from curvlab.studies.quadratic import QUADRATIC_SCHEMA_VERSION
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.distributed import is_main


def write_spectrum(result: CheckpointSpectrum, out: str | Path) -> list[Path]:
    """``out/spectrum.json`` (``SPECTRUM_SCHEMA_VERSION``; a non-finite value as null) and, when the
    result holds a density, ``out/spectral_density.{png,pdf}``."""
    if not is_main():
        return []
    out = Path(out)
    schema.save(out / "spectrum.json", result)
    written = [out / "spectrum.json"]
    if result.density is not None:
        written += spectral_density_plot(result.density.to_dict(), out / "spectral_density", f"step {result.step}")
    return written


def write_quadratic(result: dict[str, Any], out: str | Path, figures: bool = True) -> list[Path]:
    """``out/quadratic.json`` (the :func:`curvlab.studies.quadratic.quadratic_study` record,
    ``QUADRATIC_SCHEMA_VERSION``) and, with ``figures``, those of its trajectories and phase sweep."""
    if not is_main():
        return []
    if result.get("schema_version") != QUADRATIC_SCHEMA_VERSION:
        raise CurvlabError(f"quadratic study schema {result.get('schema_version')} is not {QUADRATIC_SCHEMA_VERSION}")
    out = Path(out)
    atomic_write_text(out / "quadratic.json", json.dumps(result))
    if not figures:
        return [out / "quadratic.json"]
    return [
        out / "quadratic.json",
        *quadratic_trajectories(result, out / "quadratic_trajectories"),
        *quadratic_phase(result, out / "quadratic_phase"),
    ]


def read_quadratic(path: str | Path) -> dict[str, Any] | None:
    """The quadratic study record at ``path``, or None when there is none of this schema (a file
    written before ``schema_version`` existed, or by another version: a study to recompute).

    Raises:
        CurvlabError: a corrupt file.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CurvlabError(f"{path}: corrupt JSON ({e})") from e
    return result if isinstance(result, dict) and result.get("schema_version") == QUADRATIC_SCHEMA_VERSION else None
