"""What a result was made with: the installed versions of the packages that decide its numbers.

Floats, kernels and defaults move between releases (a new torch can reorder a reduction, a new scipy
can change a quantile), so every ``summary.json``, ``finetune.json`` and curvature report records
:class:`SoftwareVersions` beside its numbers. A record written before this field existed reads back
as ``None``: not recorded.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

PACKAGES = ("curvlab", "torch", "numpy", "scipy", "transformers")


def installed(package: str) -> str | None:
    """The installed distribution version of ``package`` (``None`` if it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class SoftwareVersions:
    """The Python and package versions a record was made with (``None``: that package not installed)."""

    python: str
    curvlab: str | None
    torch: str | None
    numpy: str | None
    scipy: str | None
    transformers: str | None

    @classmethod
    def current(cls) -> SoftwareVersions:
        return cls(platform.python_version(), *(installed(p) for p in PACKAGES))

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SoftwareVersions | None:
        """The versions of :meth:`to_dict`'s dict; ``None`` for a record that predates them.

        Raises:
            TypeError: ``d`` is neither a mapping nor ``None`` (a record readers report as malformed).
        """
        if d is None:
            return None
        if not isinstance(d, Mapping):
            raise TypeError(f"versions must be an object, not {type(d).__name__}")
        return cls(**{k: d.get(k) for k in ("python", *PACKAGES)})

    def text(self) -> str:
        """One line for a report: ``Python 3.11.7, torch 2.13.0+cpu, ...`` (absent packages left out)."""
        named = [f"{k} {v}" for k, v in asdict(self).items() if k != "python" and v is not None]
        return ", ".join([f"Python {self.python}", *named])
