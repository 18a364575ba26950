"""Versioned JSON records: one writer and one reader for every typed record a job keeps on disk.

A record class declares its version once, as ``SCHEMA_VERSION`` (a class attribute); its ``to_dict``
writes it under the key ``schema_version`` and its ``from_dict`` builds the record from such a dict (the
codec, :mod:`curvlab.util.codec`, does both for every record whose JSON is a mapping of its fields). A
record that shares its file with others, or names its format, declares those keys' values once as
``FIXED_KEYS`` (``{"kind": "curvature"}``, a metrics row; ``{"format": ...}``, a checkpoint); they are
tested before the version. ``WHAT`` (default: the class name) names the record in messages.

* :func:`save`: ``record.to_dict()`` as strict JSON (a non-finite float is written as ``null``; ``NaN``
  is not JSON), atomically (:mod:`curvlab.util.atomic`): a crash leaves the previous file or none. The
  file is sealed (:func:`sealed`): it carries ``content_digest``, the SHA-256 of the rest.
* :func:`load`: the record in a file; a missing file, invalid JSON, a seal its content does not match
  (an edited file), no seal (one deleted with the edit, or a record written by hand: nothing unsealed
  is trusted), a schema version other than the class's or a malformed record is a one-line
  :class:`~curvlab.errors.CurvlabError` naming the file. A class whose files its writer does not seal
  says so (``SEALED = False``: a sharded checkpoint's metadata) and is read without one.
* :func:`check`: the version test itself, for a ``from_dict`` that is also fed dicts not read here.
* :func:`matches`: the same test as a predicate, where another version is no error (a stale cache
  entry, recomputed).

Another version (or no version: not a record at all) is an :class:`OtherVersion`, a ``CurvlabError``, so
that a reader of a cache can tell "recompute it" from a corrupt file.
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


def _name(cls: type) -> str:
    return getattr(cls, "WHAT", cls.__name__)


def _mismatch(d: Any, cls: type) -> str | None:
    """Why ``d`` is not a record of ``cls`` (its ``FIXED_KEYS``, then its version), or ``None``."""
    if not isinstance(d, Mapping):
        return f"{_name(cls)} schema None is not {cls.SCHEMA_VERSION}"
    for key, value in getattr(cls, "FIXED_KEYS", {}).items():
        if d.get(key) != value:
            return f"not a {_name(cls)} ({key} {d.get(key)!r} is not {value!r})"
    version = d.get("schema_version")
    return None if version == cls.SCHEMA_VERSION else f"{_name(cls)} schema {version} is not {cls.SCHEMA_VERSION}"


def matches(d: Any, cls: type) -> bool:
    """Whether ``d`` is a JSON object of ``cls``'s ``FIXED_KEYS`` and ``SCHEMA_VERSION`` (what :func:`check`
    accepts)."""
    return _mismatch(d, cls) is None


def check(d: D, cls: type, where: str | Path | None = None) -> D:
    """``d`` itself when it is a JSON object (a mapping) with ``cls``'s ``FIXED_KEYS`` whose
    ``schema_version`` is ``cls.SCHEMA_VERSION``.

    Raises:
        OtherVersion: ``d`` is not a JSON object, lacks a fixed key's value, or holds another schema version.
    """
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
    """``d`` without its :data:`SEAL`, once its content matches it. A JSON value that is no object is
    returned as it is (no record: the version check refuses it).

    Args:
        required: whether a JSON object without a seal is refused (``False``: returned as it is).

    Raises:
        CurvlabError: the content does not match the seal (the file was edited or damaged after it was
            written), or, ``required``, there is none (deleted, say, with an edit): nothing in it is trusted.
    """
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
    """The JSON value of ``text`` (a file's, ``where``; ``what`` names its content in the message).

    Raises:
        CurvlabError: invalid JSON, an integer too long for Python to read, or nesting too deep to parse.
    """
    try:
        return json.loads(text)
    except ValueError as e:  # (json.JSONDecodeError, and int()'s limit on digits)
        raise CurvlabError(f"{where}: corrupt JSON in {what} ({e})") from None
    except RecursionError:
        raise CurvlabError(f"{where}: corrupt JSON in {what} (nested too deeply)") from None


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in the file ``path`` (``what`` names its content in messages: "a grammar").

    Raises:
        CurvlabError: a missing or unreadable file, bytes that are no UTF-8 text, or what :func:`parse_json`
            refuses.
    """
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
    """:func:`read_json` of a file that must hold a JSON object (a config, settings, stats).

    Raises:
        CurvlabError: what :func:`read_json` refuses, or a JSON value that is no object.
    """
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise CurvlabError(f"{path}: corrupt {what} (a JSON object expected, found {type(value).__name__})")
    return value


def save(path: str | Path, record: Record) -> None:
    """Write ``record.to_dict()`` to ``path`` as strict JSON, sealed (:func:`sealed`), atomically."""
    atomic_write_json(path, sealed(record.to_dict()))


def load(path: str | Path, cls: type[R]) -> R:
    """``cls.from_dict`` of the JSON in ``path``, after :func:`check`.

    Raises:
        CurvlabError: a missing or unreadable file, invalid JSON, a seal that its content does not match
            or no seal (unless ``cls.SEALED`` is false), another schema version (:class:`OtherVersion`),
            or a record ``from_dict`` can't parse (a missing key, a wrong type).
    """
    path = Path(path)
    d = read_json(path, f"a {_name(cls)} record")
    if isinstance(d, Mapping) and SEAL not in d:
        check(d, cls, path)  # another version first (OtherVersion: a cache recomputes it), then the missing seal
    d = unsealed(d, path, f"{_name(cls)} record", required=getattr(cls, "SEALED", True))
    check(d, cls, path)
    try:
        return cls.from_dict(d)  # type: ignore[attr-defined]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, CurvlabError):
            raise CurvlabError(f"{path}: {e}") from None
        raise CurvlabError(f"{path}: not a {_name(cls)} record ({type(e).__name__}: {e})") from None
