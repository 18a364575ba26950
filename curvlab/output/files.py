"""The files ``curvlab spectrum`` and ``curvlab quadratic`` write: each one's record (schema-versioned
JSON, written atomically) and its figures; and a design's results copied into the docs (:func:`copy_results`).
The other commands' studies write their own (:func:`curvlab.studies.compare.compare_runs`,
:meth:`curvlab.analysis.report.CurvatureReport.save`, ...).

Under torch.distributed only rank 0 writes; every function returns the paths written (none on the
other ranks).
"""

from __future__ import annotations

from pathlib import Path

from curvlab.analysis.spectrum import CheckpointSpectrum
from curvlab.output.plots import quadratic_phase, quadratic_trajectories, spectral_density_plot
from curvlab.theory.quadratic import QuadraticStudy
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_with
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


def write_quadratic(study: QuadraticStudy, out: str | Path, figures: bool = True) -> list[Path]:
    """``out/quadratic.json`` (:class:`~curvlab.theory.quadratic.QuadraticStudy`, ``QUADRATIC_SCHEMA_VERSION``;
    a non-finite value as null) and, with ``figures``, those of its trajectories and phase sweep."""
    if not is_main():
        return []
    out = Path(out)
    schema.save(out / "quadratic.json", study)
    written = [out / "quadratic.json"]
    if figures:
        written += quadratic_trajectories(study, out / "quadratic_trajectories")
        written += quadratic_phase(study, out / "quadratic_phase")
    return written


def read_quadratic(path: str | Path) -> QuadraticStudy | None:
    """The quadratic study at ``path``, or None when there is none of this schema (no file, a file
    written before ``schema_version`` existed, or by another version: a study to recompute).

    Raises:
        CurvlabError: a corrupt file.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return schema.load(path, QuadraticStudy)
    except schema.OtherVersion:
        return None


def copy_results(results: Path, docs: Path) -> Path:
    """Copy a design's ``summary.json`` and ``levels.json`` from ``results`` into ``docs`` (atomically, as they are:
    sealed), and return ``docs/figures``, made, where its page's figures go."""
    figures = docs / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "levels.json"):
        payload = (results / name).read_bytes()
        atomic_write_with(docs / name, lambda f, payload=payload: f.write(payload))
    return figures
