"""What ``tasks.models.llama_cpp`` and its worker process (``tasks.models.llama_cpp_worker``) say to each other, typed.

A message travels as a frame on a pipe: a JSON header and a binary payload (token ids, logits). Each side writes a
message with ``send`` and reads the other's header once into its dataclass here (``request_of`` in the worker,
``reply_of`` in the parent), so that both read attributes. The worker imports this module as a script does: it
imports nothing but the standard library.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from typing import ClassVar, TypeVar

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


# requests, parent to worker: each names itself by its ``op``

@dataclass(frozen=True)
class Open:
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

    def to_json(self) -> dict:
        return {"op": self.op} | asdict(self)

    @classmethod
    def of_json(cls, said: dict) -> Open:
        return cls(path=said["path"], vocab_only=said["vocab_only"], n_ctx=said["n_ctx"], n_batch=said["n_batch"],
                   threads=said["threads"], type_k=said["type_k"], type_v=said["type_v"],
                   flash_attn=said["flash_attn"], gpu_layers=said["gpu_layers"])


@dataclass(frozen=True)
class Tokenize:
    """llama.cpp's ids of the payload's text (UTF-8), with its special tokens (BOS) where ``add_special``; answered
    by ``Tokenized``."""

    op: ClassVar[str] = "tokenize"
    add_special: bool

    def to_json(self) -> dict:
        return {"op": self.op, "add_special": self.add_special}

    @classmethod
    def of_json(cls, said: dict) -> Tokenize:
        return cls(add_special=said["add_special"])


@dataclass(frozen=True)
class Detokenize:
    """The bytes of the payload's tokens (int32 ids); answered by ``Done``."""

    op: ClassVar[str] = "detokenize"

    def to_json(self) -> dict:
        return {"op": self.op}

    @classmethod
    def of_json(cls, said: dict) -> Detokenize:
        return cls()


@dataclass(frozen=True)
class Score:
    """The logits of windows of the payload's tokens (int32, rows one after another): each row ``(length, first
    scored position, positions scored)`` a fresh sequence, evaluated ``n_batch`` tokens at a time; answered by
    ``Done``, the logits (float32) its payload."""

    op: ClassVar[str] = "score"
    rows: tuple[tuple[int, int, int], ...]
    n_batch: int

    def to_json(self) -> dict:
        return {"op": self.op, "rows": [list(row) for row in self.rows], "n_batch": self.n_batch}

    @classmethod
    def of_json(cls, said: dict) -> Score:
        return cls(rows=tuple(tuple(row) for row in said["rows"]), n_batch=said["n_batch"])


@dataclass(frozen=True)
class Close:
    """End the worker; not answered."""

    op: ClassVar[str] = "close"

    def to_json(self) -> dict:
        return {"op": self.op}

    @classmethod
    def of_json(cls, said: dict) -> Close:
        return cls()


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
class Ran:
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

    @classmethod
    def of_json(cls, said: dict) -> Ran:
        return cls(flash_attn=said["flash_attn"], n_ctx=said["n_ctx"], n_batch=said["n_batch"],
                   n_ubatch=said["n_ubatch"], threads=said["threads"], threads_batch=said["threads_batch"],
                   gpu_layers=said["gpu_layers"])


@dataclass(frozen=True)
class Loaded:
    """What llama.cpp says of a model it loaded with a context: its description (``llama 256M Q4_1``), the bytes of
    its weights, and what the context ran with."""

    desc: str
    size: int
    ran: Ran

    @classmethod
    def of_json(cls, said: dict) -> Loaded:
        return cls(desc=said["desc"], size=said["size"], ran=Ran.of_json(said["ran"]))


@dataclass(frozen=True)
class Opened:
    """The answer to ``Open``: the file's vocabulary (its size, BOS and whether it adds one), the build's
    ``system_info``, and, unless only the vocabulary was loaded, the model (``Loaded``)."""

    ok: ClassVar[bool] = True
    n_vocab: int
    add_bos: bool
    bos: int
    system_info: str
    loaded: Loaded | None = None

    def to_json(self) -> dict:
        return {"ok": self.ok} | asdict(self)

    @classmethod
    def of_json(cls, said: dict) -> Opened:
        loaded = said["loaded"]
        return cls(n_vocab=said["n_vocab"], add_bos=said["add_bos"], bos=said["bos"],
                   system_info=said["system_info"], loaded=None if loaded is None else Loaded.of_json(loaded))


@dataclass(frozen=True)
class Tokenized:
    """The answer to ``Tokenize``: how many tokens; the payload holds their ids, then each one's length in bytes
    (int32 both)."""

    ok: ClassVar[bool] = True
    count: int

    def to_json(self) -> dict:
        return {"ok": self.ok, "count": self.count}

    @classmethod
    def of_json(cls, said: dict) -> Tokenized:
        return cls(count=said["count"])


@dataclass(frozen=True)
class Done:
    """The answer to ``Detokenize`` and ``Score``: all of it is in the payload."""

    ok: ClassVar[bool] = True

    def to_json(self) -> dict:
        return {"ok": self.ok}

    @classmethod
    def of_json(cls, said: dict) -> Done:
        return cls()


@dataclass(frozen=True)
class Failed:
    """The answer to a request that failed in Python (a native crash ends the worker instead): what was raised."""

    ok: ClassVar[bool] = False
    error: str

    def to_json(self) -> dict:
        return {"ok": self.ok, "error": self.error}

    @classmethod
    def of_json(cls, said: dict) -> Failed:
        return cls(error=said["error"])


Reply = Opened | Tokenized | Done | Failed
Answer = TypeVar("Answer", Opened, Tokenized, Done)


def reply_of(header: dict, kind: type[Answer]) -> Answer | Failed:
    """The reply a header says: of ``kind``, the one its request is answered by, or ``Failed``."""
    return kind.of_json(header) if header["ok"] else Failed.of_json(header)
