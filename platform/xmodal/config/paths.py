"""Dotted config keys: the one walker of the config type tree, the dotted getter, setter, merge and key
list of raw config dicts (what YAML files, `--set` overrides and search spaces are before validation),
and the values of a validated config with their locations.

The config loader (xmodal.config.experiment) and the search-space checks (xmodal.sweep.space) both name keys as
`section.field.subfield`; both read the types and write the dicts through these functions, so a key
that one accepts the other accepts too.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, NamedTuple, Union

from pydantic import BaseModel


class Walk(NamedTuple):
    """How far a path goes down the type tree: the type reached (Annotated and `| None` unwrapped),
    its Annotated metadata, and how many parts of the path led there."""

    typ: Any
    meta: list[Any]
    depth: int


def section_fields(typ: Any) -> dict[str, tuple[Any, list[Any]]] | None:
    """A config section's fields (a pydantic model or a dataclass), name -> (annotation, the field's
    metadata: pydantic's bounds); None for any other type (a value, a list, a free-form mapping)."""
    if isinstance(typ, type) and issubclass(typ, BaseModel):
        return {k: (f.annotation, list(f.metadata)) for k, f in typ.model_fields.items()}
    if dataclasses.is_dataclass(typ):
        hints = typing.get_type_hints(typ, include_extras=True)
        return {f.name: (hints.get(f.name), []) for f in dataclasses.fields(typ)}
    return None


def field_names(typ: Any) -> list[str]:
    """The sorted field names of a config section; [] for any other type."""
    return sorted(section_fields(typ) or {})


def _unwrap(typ: Any, meta: list[Any]) -> tuple[Any, list[Any]]:
    """Annotated[T, ...] -> T (collecting the metadata); T | None -> T."""
    while True:
        if typing.get_origin(typ) is Annotated:
            meta = meta + list(typ.__metadata__)
            typ = typing.get_args(typ)[0]
            continue
        if typing.get_origin(typ) in (Union, types.UnionType):
            args = [a for a in typing.get_args(typ) if a is not type(None)]
            if len(args) == 1:
                typ = args[0]
                continue
        return typ, meta


def _step(typ: Any, part: str | int, sections_only: bool) -> tuple[Any, list[Any]] | None:
    """(the type one part further down, its metadata), or None where `part` leads nowhere."""
    fields = section_fields(typ)
    if fields is not None:
        return fields.get(part) if isinstance(part, str) else None
    if sections_only:
        return None
    args = typing.get_args(typ)
    if isinstance(part, int):  # a list or tuple item (a tuple's own type at its position)
        if typing.get_origin(typ) is tuple and args and args[-1] is not Ellipsis and part < len(args):
            return args[part], []
        return (args[0], []) if args else None
    return (args[1], []) if typing.get_origin(typ) is dict else None  # a mapping's value, under any key


def walk(model: type, path: Sequence[str | int], sections_only: bool = False) -> Walk:
    """Follow `path` (pydantic's error locations, or a dotted key split at its dots) from the config
    class `model` down through section fields, and unless `sections_only`, list and tuple items (int
    parts) and mapping values; it stops at the first part that leads nowhere."""
    typ: Any = model
    meta: list[Any] = []
    for depth, part in enumerate(path):
        nxt = _step(typ, part, sections_only)
        if nxt is None:
            return Walk(typ, meta, depth)
        typ, meta = _unwrap(*nxt)
    return Walk(typ, meta, len(path))


def type_at(model: type, loc: Sequence[str | int]) -> tuple[Any, list[Any]]:
    """The type (Annotated metadata unwrapped and returned) of the field at `loc`, or (None, [])."""
    w = walk(model, loc)
    return (w.typ, w.meta) if w.depth == len(loc) else (None, [])


def config_has(model: type, key: str) -> bool:
    """Whether the config class has the dotted field `key`, every part a section's field."""
    parts = key.split(".")
    return walk(model, parts, sections_only=True).depth == len(parts)


def unknown_key(model: type, key: str) -> list[str] | None:
    """None when the dotted `key` names a field of the config class (or lies inside a value or a
    free-form mapping field, which validation judges); else the valid field names where it goes wrong."""
    parts = key.split(".")
    w = walk(model, parts, sections_only=True)
    return None if w.depth == len(parts) or section_fields(w.typ) is None else field_names(w.typ)


def get_dotted(data: dict, key: str) -> tuple[bool, Any]:
    """(whether the nested dict has `a.b.c`, its value)."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def set_dotted(data: dict, key: str, value: Any, where: str = "", error: type[Exception] = ValueError) -> dict:
    """A copy of the nested dict with `a.b.c` set to a copy of `value` (sections created as needed);
    `error` names the key, after `where`, when a part on the way is a value."""
    data = dict(data)
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            raise error(f"{where}{key}: {part!r} is a value, not a section")
        node[part] = child = dict(child)
        node = child
    node[parts[-1]] = copy.deepcopy(value)
    return data


def deep_merge(base: dict, update: dict) -> dict:
    """`update` over `base`, section by section; the values taken from `update` are copies."""
    out = dict(base)
    for k, v in update.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def keys_beside(model: type, loc: Sequence[str | int]) -> list[str]:
    """The field names valid where the last part of `loc` is (for 'unknown key' errors): the fields
    of the section the rest of `loc` names, skipping list positions; [] where that is no section."""
    path = [p for p in loc[:-1] if not isinstance(p, int)]
    w = walk(model, path, sections_only=True)
    return field_names(w.typ) if w.depth == len(path) else []


def dotted_keys(data: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a raw config dict's values, sections followed down: {'a': {'b': 1}, 'c.d': 2}
    -> {'a.b', 'c.d'} (an empty section counts as given itself)."""
    out: set[str] = set()
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= dotted_keys(v, key + ".")
        else:
            out.add(key)
    return out


# The scalar types a config field is strict on: a value of another Python type is refused, never converted
# (`true` is not 1, "3" is not 3, 1.0 is not an integer); an integer is taken for a float field (1 for 1.0).
STRICT_SCALARS = (bool, int, float)


def fits(typ: type, value: Any) -> bool:
    """Whether `value`, as YAML or JSON gave it, is a `typ` (one of STRICT_SCALARS) without conversion."""
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def mistyped_values(model: type, data: Any, loc: tuple = ()) -> Iterator[tuple[tuple, Any, type, list[Any]]]:
    """(location, value, the field's type, its metadata) of each value in the raw config `data` that a
    bool, int or float field holds with another Python type (STRICT_SCALARS), down through sections,
    lists, tuples and mappings. None and unions of several types are left to validation."""
    fields = section_fields(model)
    if fields is None or not isinstance(data, dict):
        return
    for name, value in data.items():
        if name in fields:
            yield from _mistyped(*_unwrap(*fields[name]), value, (*loc, name))


def _mistyped(typ: Any, meta: list[Any], value: Any, loc: tuple) -> Iterator[tuple[tuple, Any, type, list[Any]]]:
    if value is None:
        return
    if typ in STRICT_SCALARS:
        if not fits(typ, value):
            yield loc, value, typ, meta
        return
    if section_fields(typ) is not None:
        yield from mistyped_values(typ, value, loc)
        return
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (list, tuple, set, frozenset) and isinstance(value, (list, tuple)) and args:
        fixed = origin is tuple and args[-1] is not Ellipsis
        for i, item in enumerate(value[:len(args)] if fixed else value):
            yield from _mistyped(*_unwrap(args[i] if fixed else args[0], []), item, (*loc, i))
    elif origin is dict and isinstance(value, dict) and len(args) == 2:
        for key, item in value.items():
            yield from _mistyped(*_unwrap(args[1], []), item, (*loc, key))


def config_values(node: Any, loc: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(location, value) of every value in a validated config, down through sections (pydantic models,
    dataclasses), lists, tuples and mappings; a location is what `walk` follows."""
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            yield from config_values(getattr(node, name), (*loc, name))
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from config_values(getattr(node, f.name), (*loc, f.name))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from config_values(item, (*loc, i))
    elif isinstance(node, dict):
        for k, item in node.items():
            yield from config_values(item, (*loc, k))
    else:
        yield loc, node
