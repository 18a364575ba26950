"""Versioned JSON records: one writer and one reader for every typed record a job keeps on disk.

A record class declares ``SCHEMA_VERSION``, written under ``schema_version`` (:mod:`curvlab.util.codec`
writes and reads records), and ``FIXED_KEYS``, the values of keys tested before the version
(``{"kind": "curvature"}``, a metrics row); ``WHAT`` names it in messages.

* :func:`save`: ``record.to_dict()`` as strict JSON, atomically, sealed (:func:`sealed`: it carries
  ``content_digest``, the SHA-256 of the rest).
* :func:`load`: the record in a file; a missing file, invalid JSON, a seal its content does not match, no
  seal (nothing unsealed is trusted, unless the class says ``SEALED = False``), another schema version
  or a malformed record is one :class:`~curvlab.errors.CurvlabError` naming the file.
* :func:`check` and :func:`matches`: the version test, raising or as a predicate.
* :func:`upgrade`: an older version brought up to the class's by its ``MIGRATIONS`` (``{version:
  function}``, each taking that version's JSON object, seal removed, to the next's); :func:`load` and the
  codec upgrade before the version test, a cache's :func:`matches` does not (an older entry is recomputed).

Another version (or none) is an :class:`OtherVersion`, so that a cache's reader can tell "recompute it"
from a corrupt file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from curvlab.errors import CurvlabError
from curvlab.util.atomic import atomic_write_json, strict_json
from curvlab.util.digest import json_digest

SEAL = "content_digest"  # a sealed record's key: the SHA-256 of the rest of its JSON (util.digest.json_digest)


class Record(Protocol):
    SCHEMA_VERSION: int

    def to_dict(self) -> dict[str, Any]: ...


R = TypeVar("R")
D = TypeVar("D")


class OtherVersion(CurvlabError):
    """A JSON value that is not a record of the expected class's ``SCHEMA_VERSION``."""


def record_name(cls: type) -> str:
    return getattr(cls, "WHAT", cls.__name__)


def _mismatch(d: Any, cls: type) -> str | None:
    """Why ``d`` is not a record of ``cls`` (its ``FIXED_KEYS``, then its version), or ``None``."""
    if not isinstance(d, Mapping):
        return f"{record_name(cls)} schema None is not {cls.SCHEMA_VERSION}"
    for key, value in getattr(cls, "FIXED_KEYS", {}).items():
        if d.get(key) != value:
            return f"not a {record_name(cls)} ({key} {d.get(key)!r} is not {value!r})"
    version = d.get("schema_version")
    return None if version == cls.SCHEMA_VERSION else f"{record_name(cls)} schema {version} is not {cls.SCHEMA_VERSION}"


def upgrade(d: Any, cls: type) -> Any:
    """``d`` brought up to ``cls.SCHEMA_VERSION`` by ``cls.MIGRATIONS`` (module docstring), one version at a
    time, when it is a JSON object of a version that the class can migrate; else ``d`` as it is (for the
    version test to take or refuse)."""
    migrations = getattr(cls, "MIGRATIONS", {})
    # (an int's: a list would be unhashable, a float or a bool no version written)
    while isinstance(d, Mapping) and type(version := d.get("schema_version")) is int and version in migrations:
        d = {**migrations[version](dict(d)), "schema_version": version + 1}
    return d


def matches(d: Any, cls: type) -> bool:
    """Whether :func:`check` accepts ``d``."""
    return _mismatch(d, cls) is None


def check(d: D, cls: type, where: str | Path | None = None) -> D:
    """``d`` if it is a JSON object of ``cls``'s ``FIXED_KEYS`` and ``SCHEMA_VERSION``, else :class:`OtherVersion`."""
    problem = _mismatch(d, cls)
    if problem is not None:
        raise OtherVersion(f"{where}: {problem}" if where is not None else problem)
    return d


def sealed(d: Mapping[str, Any], strict: bool = True) -> dict[str, Any]:
    """``d`` as it reads back from JSON (``strict``: non-finite floats as ``null``), with :data:`SEAL`,
    the digest of that content, so that a reader can tell an edited or damaged file from the one written."""
    d = json.loads(json.dumps(strict_json(d) if strict else d, allow_nan=not strict))
    return {**d, SEAL: json_digest(d)}


def unsealed(d: Any, where: str | Path, what: str, required: bool = True) -> Any:
    """``d`` without its :data:`SEAL`, once its content matches it (a JSON value that is no object, or,
    not ``required``, one without a seal, is returned as it is)."""
    if not isinstance(d, Mapping):
        return d
    if SEAL not in d:
        if required:
            raise CurvlabError(f"{where}: unsealed {what} (no {SEAL}: edited, or not written by curvlab): not trusted")
        return d
    rest = {k: v for k, v in d.items() if k != SEAL}
    if json_digest(rest) != d[SEAL]:
        raise CurvlabError(f"{where}: edited or corrupt {what} (its content does not match its digest): not trusted")
    return rest


def parse_json(text: str, where: str | Path, what: str) -> Any:
    """The JSON value of ``text`` (a file's, ``where``; ``what`` names its content in the message)."""
    try:
        return json.loads(text)
    except ValueError as e:  # (json.JSONDecodeError, and int()'s limit on digits)
        raise CurvlabError(f"{where}: corrupt JSON in {what} ({e})") from None
    except RecursionError:
        raise CurvlabError(f"{where}: corrupt JSON in {what} (nested too deeply)") from None


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in the file ``path`` (``what`` names its content in messages: "a grammar")."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise CurvlabError(f"{path}: no such file ({what})") from None
    except OSError as e:
        raise CurvlabError(f"{path}: can't read {what} ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:  # (binary bytes: a pickle, say, in a record's place)
        raise CurvlabError(f"{path}: corrupt JSON in {what} (not UTF-8 text)") from None
    return parse_json(text, path, what)


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object (a config, settings, stats)."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise CurvlabError(f"{path}: corrupt {what} (a JSON object expected, found {type(value).__name__})")
    return value


def save(path: str | Path, record: Record) -> None:
    """Write ``record.to_dict()`` to ``path`` as strict JSON, sealed (:func:`sealed`), atomically."""
    atomic_write_json(path, sealed(record.to_dict()))


def load(path: str | Path, cls: type[R]) -> R:
    """``cls.from_dict`` of the JSON in ``path``, after :func:`upgrade` and :func:`check` (see the module
    docstring)."""
    path = Path(path)
    d = read_json(path, f"a {record_name(cls)} record")
    if isinstance(d, Mapping) and SEAL not in d:
        # another version (not an older one the class upgrades) first (OtherVersion: a cache recomputes
        # it), then the missing seal
        check(upgrade(d, cls), cls, path)
    d = unsealed(d, path, f"{record_name(cls)} record", required=getattr(cls, "SEALED", True))
    d = upgrade(d, cls)  # (after the seal: what was written is what is checked; then what it means now)
    check(d, cls, path)
    try:
        return cls.from_dict(d)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CurvlabError):
            raise CurvlabError(f"{path}: {e}") from None
        raise CurvlabError(f"{path}: not a {record_name(cls)} record ({type(e).__name__}: {e})") from None
