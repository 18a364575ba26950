"""Versioned JSON records: one writer and one reader for every typed record a job keeps on disk.

A record class declares its version once, as ``SCHEMA_VERSION`` (a class attribute), writes it under
the key ``schema_version`` in ``to_dict`` and builds itself from such a dict in ``from_dict``.

* :func:`save`: ``record.to_dict()`` as strict JSON (a non-finite float is written as ``null``; ``NaN``
  is not JSON), atomically (:mod:`curvlab.util.atomic`): a crash leaves the previous file or none.
* :func:`load`: the record in a file; a missing file, invalid JSON, a schema version other than the
  class's or a malformed record is a one-line :class:`~curvlab.errors.CurvlabError` naming the file.
* :func:`check`: the version test itself, for a ``from_dict`` that is also fed dicts not read here.

Another version (or no version: not a record at all) is an :class:`OtherVersion`, a ``CurvlabError``, so
that a reader of a cache can tell "recompute it" from a corrupt file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, TypeVar

from curvlab.errors import CurvlabError
from curvlab.util.atomic import atomic_write_json


class Record(Protocol):
    SCHEMA_VERSION: int

    def to_dict(self) -> dict[str, Any]: ...


R = TypeVar("R")


class OtherVersion(CurvlabError):
    """A JSON value that is not a record of the expected class's ``SCHEMA_VERSION``."""


def _name(cls: type) -> str:
    return getattr(cls, "WHAT", cls.__name__)


def check(d: Any, cls: type, where: str | Path | None = None) -> dict[str, Any]:
    """``d`` itself when it is a dict whose ``schema_version`` is ``cls.SCHEMA_VERSION``.

    Raises:
        OtherVersion: ``d`` is not a JSON object, or holds another schema version.
    """
    prefix = f"{where}: " if where is not None else ""
    version = d.get("schema_version") if isinstance(d, dict) else None
    if not isinstance(d, dict) or version != cls.SCHEMA_VERSION:
        raise OtherVersion(f"{prefix}{_name(cls)} schema {version} is not {cls.SCHEMA_VERSION}")
    return d


def save(path: str | Path, record: Record) -> None:
    """Write ``record.to_dict()`` to ``path`` as strict JSON, atomically."""
    atomic_write_json(path, record.to_dict())


def load(path: str | Path, cls: type[R]) -> R:
    """``cls.from_dict`` of the JSON in ``path``, after :func:`check`.

    Raises:
        CurvlabError: a missing or unreadable file, invalid JSON, another schema version
            (:class:`OtherVersion`), or a record ``from_dict`` can't parse (a missing key, a wrong type).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CurvlabError(f"{path}: no such file (a {_name(cls)} record)") from None
    except OSError as e:
        raise CurvlabError(f"{path}: unreadable {_name(cls)} record ({e.strerror or type(e).__name__})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CurvlabError(f"{path}: corrupt JSON in a {_name(cls)} record ({e})") from None
    check(d, cls, path)
    try:
        return cls.from_dict(d)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CurvlabError):
            raise CurvlabError(f"{path}: {e}") from None
        raise CurvlabError(f"{path}: not a {_name(cls)} record ({type(e).__name__}: {e})") from None
