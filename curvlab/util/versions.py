"""What a result was made with: the installed versions of the packages that decide its numbers.

Floats, kernels and defaults move between releases, so every ``summary.json``, ``finetune.json`` and
curvature report records :class:`SoftwareVersions` beside its numbers (``None`` in an older record).
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from importlib import metadata

from curvlab.util.codec import Record

PACKAGES = ("curvlab", "torch", "numpy", "scipy", "transformers")


def installed(package: str) -> str | None:
    """The installed distribution version of ``package`` (``None`` if it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class SoftwareVersions(Record):
    """The Python and package versions a record was made with (``None``: that package not installed)."""

    python: str
    # (a package a record lacks reads as not recorded)
    curvlab: str | None = None
    torch: str | None = None
    numpy: str | None = None
    scipy: str | None = None
    transformers: str | None = None

    @classmethod
    def current(cls) -> SoftwareVersions:
        return cls(platform.python_version(), *(installed(p) for p in PACKAGES))

    def text(self) -> str:
        """One line for a report: ``Python 3.11.7, torch 2.13.0+cpu, ...`` (absent packages left out)."""
        named = [f"{k} {v}" for k, v in asdict(self).items() if k != "python" and v is not None]
        return ", ".join([f"Python {self.python}", *named])
