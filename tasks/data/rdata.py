"""Read character vectors out of an R lazy-load database (``Rdata.rdx`` + ``Rdata.rdb``).

R packages such as janeaustenr ship their data this way. The index (``.rdx``) is a gzip-compressed
R-serialized list whose ``variables`` element maps each object name to an ``(offset, length)`` pair in
the ``.rdb`` file; each record there is a 4-byte big-endian length followed by a zlib stream holding
one R-serialized object. Only the subset of the XDR serialization format that plain data uses is
implemented; anything else raises ``ValueError`` naming the SEXP type.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from typing import Any

from tasks.data.lazyload_said import LazyLoadIndex

NILVALUE, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 254, 1, 2, 9, 10, 13, 14, 16, 19
REFSXP, GLOBALENV, EMPTYENV, BASEENV, MISSINGARG, BASENAMESPACE = 255, 253, 242, 241, 251, 247
_SINGLETONS = {NILVALUE: None, GLOBALENV: None, EMPTYENV: None, BASEENV: None, MISSINGARG: None, BASENAMESPACE: None}


class _Reader:
    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization stream")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer and minimal reader R versions
        if version == 3:
            encoding_length = self.int()
            self.pos += encoding_length  # skip the native encoding name

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind in _SINGLETONS:
            return _SINGLETONS[kind]
        if kind == REFSXP:
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            n = self.int()
            return None if n == -1 else self.take(n).decode("utf-8", errors="replace")
        if kind == LISTSXP:  # pairlist: (attributes), (tag), car, cdr
            out: dict[Any, Any] = {}
            while kind == LISTSXP:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
            if kind != NILVALUE:
                raise ValueError(f"unsupported pairlist tail SEXP type {kind}")
            return out
        if kind in (LGLSXP, INTSXP):
            n = self.int()
            value: Any = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == REALSXP:
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (STRSXP, VECSXP):
            value = [self.item() for _ in range(self.int())]
        else:
            raise ValueError(f"unsupported R SEXP type {kind}")
        if has_attr:
            attributes = self.item()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if kind == VECSXP and names is not None:
                value = dict(zip(names, value))
        return value


def unserialize(data: bytes) -> Any:
    """Decode one XDR-serialized R object into Python lists, dicts (named lists) and scalars."""
    return _Reader(data).item()


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """Return every object of a lazy-load database, by name.

    Args:
        rdx: raw bytes of the ``.rdx`` index file.
        rdb: raw bytes of the ``.rdb`` records file.
    """
    index = LazyLoadIndex.of_unserialized(unserialize(gzip.decompress(rdx)))
    objects = {}
    for name, (offset, length) in index.variables.items():
        record = rdb[offset : offset + length]
        objects[name] = unserialize(zlib.decompress(record[4:]))
    return objects
