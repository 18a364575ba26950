"""One codec between records (dataclasses) and JSON: :func:`encode` and :func:`decode`, driven by a
record's fields and their type hints (``typing.get_type_hints``), so that no record writes or reads
itself by hand. A record class inherits :class:`Record` for its ``to_dict`` and ``from_dict``.

The mapping, by the field's type hint:

=====================  ==============================================  ======================================
Python                 JSON (:func:`encode`)                           read back (:func:`decode`)
=====================  ==============================================  ======================================
a record (dataclass)   an object, one key per field (Keys, below)      the record; a missing key takes the
                                                                       field's default (``KeyError``
                                                                       without one), an unknown key is
                                                                       refused
``tuple[...]``,        an array                                        a tuple, a list
``list[...]``
``dict[str, V]``       an object                                       a dict
``X | None``           ``X``'s JSON, or null                           ``None`` for null, else ``X``
``float``              the float, NaN and ±inf included (the file's    null reads as NaN (the field's
                       writer decides: :func:`curvlab.util.schema.     ``null`` option: e.g. +inf for a
                       save` writes strict JSON, non-finite as null;   diverged loss); ``NaN`` and
                       ``levels.json`` keeps ``NaN``)                  ``Infinity`` as themselves; an int
                                                                       stays an int (it was written so)
``int``, ``str``,      themselves                                      themselves, type-checked (an int is
``bool``                                                               no bool, a bool no int)
``np.ndarray``         nested lists (``tolist``)                       ``np.array`` (of the field's
                                                                       ``dtype``; null as NaN)
``torch.Tensor``       nested lists (``tolist``, from the host)        a float64 CPU tensor (null as NaN)
an ``Enum``            its value                                       the member of that value
``Any``                plain JSON: tuples as lists, records            the JSON value as it is
                       encoded, numpy scalars as Python's
=====================  ==============================================  ======================================

Keys. By default: the class's ``FIXED_KEYS`` and ``"schema_version"`` (``SCHEMA_VERSION``; a record
with a ``schema_version`` field writes it at the field), then each field, in field order, under its name.
Decoding a record with a ``SCHEMA_VERSION`` runs :func:`curvlab.util.schema.upgrade` (an older version
its ``MIGRATIONS`` bring up, a nested record's too) and :func:`curvlab.util.schema.check` first, and reads
past its seal (which :func:`~curvlab.util.schema.load` checks). The escape hatches, kept few and explicit:

* ``JSON_KEYS`` (a class attribute): the key order when it is not the fields', ``...`` standing for
  the fields not named, in order. A name that is no field's key is a derived value (a property),
  written for readers and not read back; ``(key, attribute)`` writes a property under another key.
* a field's ``metadata=meta(...)``: :class:`FieldOptions`.
* a nested record whose class defines its own ``to_dict`` and ``from_dict`` is written and read by them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any, TypeVar

import numpy as np
import torch

from curvlab.errors import CurvlabError
from curvlab.util import schema
from curvlab.util.atomic import strict_json

R = TypeVar("R")
_META = "curvlab.codec"  # the key of a field's options in its dataclass metadata
_NONE = type(None)


@dataclasses.dataclass(frozen=True)
class FieldOptions:
    """How one field deviates from the plain mapping (:func:`meta`)."""

    key: str | None = None  # its JSON key (None: the field's name)
    skip: bool = False  # not written (not JSON, a tensor say); read back as the field's default
    null: float = math.nan  # what a JSON null reads as in a float slot
    dtype: Any = None  # the dtype of an np.ndarray field (None: numpy's inference)
    strict: bool = False  # written as strict JSON (a non-finite float as null) in a file that keeps NaN


_PLAIN = FieldOptions()


def meta(
    *, key: str | None = None, skip: bool = False, null: float = math.nan, dtype: Any = None, strict: bool = False
) -> dict[str, Any]:
    """A field's ``metadata`` for the codec (module docstring): ``field(metadata=meta(key="pairs"))``."""
    return {_META: FieldOptions(key, skip, null, dtype, strict)}


class Record:
    """A dataclass written and read by the codec: ``to_dict`` is :func:`encode`, ``from_dict``
    :func:`decode` (a record whose JSON is not a plain mapping of its fields defines its own)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_dict(cls: type[R], d: Mapping[str, Any]) -> R:
        return decode(cls, d)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One key of a record's JSON: a field's (``field`` set), a constant's (fixed keys, the schema
    version) or a derived value's (an attribute, written only)."""

    key: str
    attribute: str | None  # None: a constant
    field: dataclasses.Field | None = None
    hint: Any = None
    options: FieldOptions = _PLAIN
    constant: Any = None


@dataclasses.dataclass(frozen=True)
class _Layout:
    written: tuple[_Slot, ...]  # in the JSON's order
    read: tuple[_Slot, ...]  # the fields a JSON object sets
    known: frozenset[str]  # every key a JSON object may hold


def _options(f: dataclasses.Field) -> FieldOptions:
    return f.metadata.get(_META, _PLAIN)


@cache
def _layout(cls: type) -> _Layout:
    """``cls``'s keys, in order (module docstring: Keys); a ``TypeError`` for a mistake in the class."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass: the codec reads and writes dataclasses")
    hints = typing.get_type_hints(cls)
    fields = {}
    for f in dataclasses.fields(cls):
        opt = _options(f)
        if not opt.skip:
            fields[opt.key or f.name] = _Slot(opt.key or f.name, f.name, f, hints[f.name], opt)
    constants = {k: _Slot(k, None, constant=v) for k, v in getattr(cls, "FIXED_KEYS", {}).items()}
    if hasattr(cls, "SCHEMA_VERSION") and "schema_version" not in fields:
        constants["schema_version"] = _Slot("schema_version", None, constant=cls.SCHEMA_VERSION)
    order = getattr(cls, "JSON_KEYS", (...,))
    named = {k if isinstance(k, str) else k[0] for k in order if k is not ...}
    written: list[_Slot] = [s for k, s in constants.items() if k not in named]
    for k in order:
        if k is ...:
            written += [s for key, s in fields.items() if key not in named]
        elif isinstance(k, str) and k in fields:
            written.append(fields[k])
        elif isinstance(k, str) and k in constants:
            written.append(constants[k])
        else:
            key, attribute = (k, k) if isinstance(k, str) else k
            if not hasattr(cls, attribute):
                raise TypeError(f"{cls.__name__}.JSON_KEYS names {key!r}, neither a field nor an attribute")
            written.append(_Slot(key, attribute))
    keys = [s.key for s in written]
    if len(set(keys)) != len(keys) or not set(fields) <= set(keys):
        raise TypeError(f"{cls.__name__}.JSON_KEYS must name each key once and every field: {keys}")
    read = tuple(s for s in fields.values() if s.field.init)
    return _Layout(tuple(written), read, frozenset(keys))


def encode(record: Any) -> dict[str, Any]:
    """``record`` (a dataclass) as a JSON object of plain Python values (module docstring); non-finite
    floats stay floats, for the writer to keep or write as null."""
    out = {}
    for slot in _layout(type(record)).written:
        value = slot.constant if slot.attribute is None else getattr(record, slot.attribute)
        out[slot.key] = strict_json(_plain(value, slot.key)) if slot.options.strict else _plain(value, slot.key)
    return out


def _plain(value: Any, where: str) -> Any:
    """``value`` as plain JSON values (by its own type: what a hint says is what the value is)."""
    if isinstance(value, enum.Enum):  # (before the scalars: an IntEnum is an int)
        return _plain(value.value, where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):  # a numpy scalar: the Python number it is
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_dict() if hasattr(value, "to_dict") else encode(value)
    if isinstance(value, Mapping):
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where}: a {type(value).__name__} has no JSON form")


def decode(cls: type[R], d: Any) -> R:
    """The ``cls`` record of the JSON object ``d`` (module docstring): another version, not one its
    ``MIGRATIONS`` upgrade, is an :class:`~curvlab.util.schema.OtherVersion`, a missing key without a
    default a ``KeyError``, a value of the wrong JSON type a ``TypeError`` (its place named), an unknown key
    a ``CurvlabError``."""
    return _record(cls, d, "")


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _record(cls: type[R], d: Any, where: str) -> R:
    if hasattr(cls, "SCHEMA_VERSION"):
        d = schema.upgrade(d, cls)
        schema.check(d, cls, where or None)
    if not isinstance(d, Mapping):
        raise TypeError(f"{where or schema.record_name(cls)}: expected an object, got {_json_type(d)}")
    layout = _layout(cls)
    sealed = {schema.SEAL} if hasattr(cls, "SCHEMA_VERSION") else set()
    unknown = sorted(k for k in d if k not in layout.known and k not in sealed)
    if unknown:
        place = f"{where}: " if where else ""
        raise CurvlabError(f"{place}unknown {schema.record_name(cls)} field(s): {', '.join(map(str, unknown))}")
    values = {}
    for slot in layout.read:
        if slot.key in d:
            values[slot.attribute] = _value(slot.hint, d[slot.key], slot.options, _at(where, slot.key))
        elif slot.field.default is dataclasses.MISSING and slot.field.default_factory is dataclasses.MISSING:
            raise KeyError(_at(where, slot.key))
    return cls(**values)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, numbers.Number):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, (list, tuple)) else "an object" if isinstance(value, Mapping) else "?"


def _wrong(where: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"{where}: expected {expected}, got {_json_type(value)}")


_BOOLS = (bool, np.bool_)
# a JSON scalar's type: what a message calls it, and the values it takes (an int is no bool, a bool no int)
_SCALARS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    _NONE: ("null", lambda v: v is None),
    float: ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, _BOOLS)),
    int: ("an integer", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, _BOOLS)),
    bool: ("a boolean", lambda v: isinstance(v, _BOOLS)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _value(hint: Any, value: Any, opt: FieldOptions, where: str) -> Any:
    """``value`` (JSON) as the ``hint`` type says."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if origin is typing.Union or origin is types.UnionType:
        if value is None and _NONE in args:
            return None
        alternatives = [a for a in args if a is not _NONE]
        for a in alternatives[:-1]:
            try:
                return _value(a, value, opt, where)
            except (TypeError, ValueError):
                continue
        return _value(alternatives[-1], value, opt, where)
    if hint is float and value is None:
        return opt.null
    if isinstance(hint, type) and hint in _SCALARS:
        expected, fits = _SCALARS[hint]
        if not fits(value):
            raise _wrong(where, expected, value)
        return bool(value) if hint is bool else value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is np.ndarray:
        if not isinstance(value, (list, tuple)):
            raise _wrong(where, "an array", value)
        array = np.array(value, dtype=opt.dtype)
        return np.array(value, dtype=float) if array.dtype == object else array  # (nulls: NaN)
    if hint is torch.Tensor:
        if not isinstance(value, (list, tuple)):
            raise _wrong(where, "an array", value)
        return torch.from_numpy(np.array(value, dtype=np.float64))  # (nulls: NaN)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        from_dict = getattr(hint, "from_dict", None)
        if from_dict is None or getattr(from_dict, "__func__", None) is Record.from_dict.__func__:
            return _record(hint, value, where)
        return from_dict(value)  # a record that reads itself by hand
    container = origin or hint
    if container in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise _wrong(where, "an array", value)
        if container is tuple and args and args[-1] is not ...:
            if len(value) != len(args):
                raise TypeError(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_value(a, v, opt, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_value(item, v, opt, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if container is tuple else items
    if container in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _wrong(where, "an object", value)
        item = args[1] if args else Any
        return {k: _value(item, v, opt, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"{where}: the codec has no JSON form for {hint!r}")
