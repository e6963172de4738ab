"""A frozen dataclass read from plain data (a record's dict, a JSON object) by its fields' names, and written back:
where a key and a field have the same name the key is written once, as the field (``read_fields``,
``write_fields``). A reader keeps explicit only what differs: a key named otherwise, a value read conditionally or
from elsewhere (``given``), a field typed beyond plain data (``read``: a nested dataclass, a tuple). Pure Python.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields, is_dataclass
from functools import cache
from types import NoneType, UnionType
from typing import Any, TypeVar, Union, get_args, get_origin

_Read = TypeVar("_Read")  # the dataclass read


def _may_be_none(each: Field) -> bool:
    """Whether a field is typed ``X | None`` (or ``Optional[X]``). Its annotation is read as written where it is a
    string (``from __future__ import annotations``), so that a type imported only for checking needs no import."""
    if not isinstance(each.type, str):
        return get_origin(each.type) in (Union, UnionType) and NoneType in get_args(each.type)
    return _written_may_be_none(each.type)


@cache
def _written_may_be_none(annotation: str) -> bool:
    return _none_in(ast.parse(annotation, mode="eval").body)


def _none_in(node: ast.expr) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _none_in(node.left) or _none_in(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Optional":
        return True
    return isinstance(node, ast.Constant) and node.value is None


def _defaulted(each: Field) -> bool:
    return each.default is not MISSING or each.default_factory is not MISSING


def read_fields(cls: type[_Read], flat: Mapping[str, Any], read: Mapping[str, Callable[[Any], Any]] | None = None,
                given: Mapping[str, Any] | None = None) -> _Read:
    """The dataclass ``cls`` that ``flat`` holds, each field from the key of its name; other keys are left.

    Args:
        read: how a field typed beyond plain data is read from its key's value (a value of None stays None).
        given: the values of fields not read from a key of their name, as the reader found them.

    A key ``flat`` lacks (a record from before it was kept) leaves its field's default, or None where it is typed
    ``X | None``; a ``KeyError`` names any other."""
    read, given = read or {}, given or {}
    values = dict(given)
    for each in fields(cls):
        if not each.init or each.name in given:
            continue
        if each.name in flat:
            value = flat[each.name]
            values[each.name] = read[each.name](value) if each.name in read and value is not None else value
        elif not _defaulted(each):
            if not _may_be_none(each):
                raise KeyError(each.name)
            values[each.name] = None
    return cls(**values)


def write_fields(value: Any) -> dict[str, Any]:
    """A dataclass as plain data, each field under its name, as ``read_fields`` reads it back: a nested dataclass as
    its own fields, a tuple as a list."""
    return {each.name: _plain(getattr(value, each.name)) for each in fields(value)}


def _plain(item: Any) -> Any:
    if is_dataclass(item) and not isinstance(item, type):
        return write_fields(item)
    if isinstance(item, tuple):
        return [_plain(entry) for entry in item]
    return item
