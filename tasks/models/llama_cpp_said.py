"""What ``tasks.models.llama_cpp`` and its worker process (``tasks.models.llama_cpp_worker``) say to each other, typed.

A message travels as a frame on a pipe: a JSON header and a binary payload (token ids, logits). Each side writes a
message with ``send`` and reads the other's header once into its dataclass here (``request_of`` in the worker,
``reply_of`` in the parent), so that both read attributes; a message's keys are its fields' names, written and read by
the same two functions (``tasks.core.plain``). The worker imports this module as a script does: it imports nothing but
the standard library and ``tasks.core.plain`` (pure Python).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from tasks.core.plain import read_fields, write_fields

HEADER = struct.Struct("<IQ")  # header length, payload length


def send(stream, message: Request | Reply, payload: bytes = b"") -> None:
    data = json.dumps(message.to_json()).encode()
    stream.write(HEADER.pack(len(data), len(payload)))
    stream.write(data)
    stream.write(payload)
    stream.flush()


def _exactly(stream, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            raise EOFError("the other end closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(stream) -> tuple[dict, bytes]:
    """The next frame: its header as JSON gives it (read by ``request_of`` or ``reply_of``) and its payload."""
    size, payload = HEADER.unpack(_exactly(stream, HEADER.size))
    header = json.loads(_exactly(stream, size))
    return header, _exactly(stream, payload)


class _Said:
    """A message (or a part of one) read from its header by its fields' names; ``_read`` says how a field that is a
    dataclass or a tuple is read from its JSON."""

    _read: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    @classmethod
    def of_json(cls, said: dict) -> Self:
        return read_fields(cls, said, cls._read)


class _Request(_Said):
    """A request: its ``op``, then its fields."""

    op: ClassVar[str]

    def to_json(self) -> dict:
        return {"op": self.op} | write_fields(self)


class _Reply(_Said):
    """A reply: whether it is an answer (``ok``) or ``Failed``, then its fields."""

    ok: ClassVar[bool] = True

    def to_json(self) -> dict:
        return {"ok": self.ok} | write_fields(self)


# requests, parent to worker: each names itself by its ``op``

@dataclass(frozen=True)
class Open(_Request):
    """Load ``path``: its vocabulary only, or the model with a context of these settings (``LlamaCppSettings``);
    answered by ``Opened``."""

    op: ClassVar[str] = "open"
    path: str
    vocab_only: bool = False
    n_ctx: int = 0
    n_batch: int = 0
    threads: int | None = None  # None: the cores the worker may use
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"
    gpu_layers: int = 0


@dataclass(frozen=True)
class Tokenize(_Request):
    """llama.cpp's ids of the payload's text (UTF-8), with its special tokens (BOS) where ``add_special``; answered
    by ``Tokenized``."""

    op: ClassVar[str] = "tokenize"
    add_special: bool


@dataclass(frozen=True)
class Detokenize(_Request):
    """The bytes of the payload's tokens (int32 ids); answered by ``Done``."""

    op: ClassVar[str] = "detokenize"


@dataclass(frozen=True)
class Score(_Request):
    """The logits of windows of the payload's tokens (int32, rows one after another): each row ``(length, first
    scored position, positions scored)`` a fresh sequence, evaluated ``n_batch`` tokens at a time; answered by
    ``Done``, the logits (float32) its payload."""

    op: ClassVar[str] = "score"
    rows: tuple[tuple[int, int, int], ...]
    n_batch: int

    _read = {"rows": lambda rows: tuple(tuple(row) for row in rows)}


@dataclass(frozen=True)
class Close(_Request):
    """End the worker; not answered."""

    op: ClassVar[str] = "close"


Request = Open | Tokenize | Detokenize | Score | Close
REQUESTS = {kind.op: kind for kind in (Open, Tokenize, Detokenize, Score, Close)}


def request_of(header: dict) -> Request:
    """The request a header says (a ``ValueError`` for one this worker does not know)."""
    op = header["op"]
    if op not in REQUESTS:
        raise ValueError(f"unknown request {op}")
    return REQUESTS[op].of_json(header)


# replies, worker to parent

@dataclass(frozen=True)
class Ran(_Said):
    """What a context ran with, as llama.cpp took the settings asked (llama.h: "the requested values ... may
    differ"): the flash attention it chose (``on``, ``off``; None where its log said neither), its sizes, threads and
    the layers on a GPU (0 on a build that cannot offload)."""

    flash_attn: str | None
    n_ctx: int
    n_batch: int
    n_ubatch: int
    threads: int
    threads_batch: int
    gpu_layers: int


@dataclass(frozen=True)
class Loaded(_Said):
    """What llama.cpp says of a model it loaded with a context: its description (``llama 256M Q4_1``), the bytes of
    its weights, and what the context ran with."""

    desc: str
    size: int
    ran: Ran

    _read = {"ran": Ran.of_json}


@dataclass(frozen=True)
class Opened(_Reply):
    """The answer to ``Open``: the file's vocabulary (its size, BOS and whether it adds one), the build's
    ``system_info``, and, unless only the vocabulary was loaded, the model (``Loaded``)."""

    n_vocab: int
    add_bos: bool
    bos: int
    system_info: str
    loaded: Loaded | None = None

    _read = {"loaded": Loaded.of_json}


@dataclass(frozen=True)
class Tokenized(_Reply):
    """The answer to ``Tokenize``: how many tokens; the payload holds their ids, then each one's length in bytes
    (int32 both)."""

    count: int


@dataclass(frozen=True)
class Done(_Reply):
    """The answer to ``Detokenize`` and ``Score``: all of it is in the payload."""


@dataclass(frozen=True)
class Failed(_Reply):
    """The answer to a request that failed in Python (a native crash ends the worker instead): what was raised."""

    ok: ClassVar[bool] = False
    error: str


Reply = Opened | Tokenized | Done | Failed
Answer = TypeVar("Answer", Opened, Tokenized, Done)


def reply_of(header: dict, kind: type[Answer]) -> Answer | Failed:
    """The reply a header says: of ``kind``, the one its request is answered by, or ``Failed``."""
    return kind.of_json(header) if header["ok"] else Failed.of_json(header)
