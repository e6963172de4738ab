"""The index of an R lazy-load database (its ``.rdx``, unserialized by ``tasks.data.rdata``), read once into a typed
value: where each object's record lies in the ``.rdb``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LazyLoadIndex:
    """Each object's ``(offset, length)`` in the records file, by name (the index's ``variables``)."""

    variables: dict[str, tuple[int, int]]

    @classmethod
    def of_unserialized(cls, index: dict) -> LazyLoadIndex:
        return cls({name: (offset, length) for name, (offset, length) in index["variables"].items()})
