"""What tokenizing a corpus reads and writes, typed: a tokenizer call's encoding, a fast tokenizer's ``tokenizer.json``
(what decides its ids), and a token cache entry (``tasks.data.corpus.cached_tokenize``: what a stream was made from,
and its meta). Read once here, so that ``tasks.data.corpus`` reads attributes; an entry is written back key for key,
in the order it always had: a cache file written before reads the same."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.plain import read_fields, write_fields

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Encoding:
    """A tokenizer call's token ids and each token's ``(start, end)`` in characters (transformers' ``BatchEncoding``,
    or llama.cpp's, called with ``return_offsets_mapping=True``)."""

    ids: list[int]
    offsets: list[tuple[int, int]]

    @classmethod
    def of_call(cls, encoding) -> Encoding:
        return cls(ids=encoding["input_ids"], offsets=encoding["offset_mapping"])


@dataclass(frozen=True)
class AddedToken:
    """A token a tokenizer adds to its model's vocabulary: its id, text, and whether it is special."""

    id: int
    content: str
    special: bool


@dataclass(frozen=True)
class TokenizerJson:
    """What decides a fast tokenizer's ids, from its ``tokenizer.json``: its model's vocabulary and merges (as given;
    None where its model has none) and its added tokens."""

    vocab: object
    merges: object
    added: tuple[AddedToken, ...]

    @classmethod
    def of_json(cls, state: dict) -> TokenizerJson:
        model = state.get("model", {})
        return cls(vocab=model.get("vocab"), merges=model.get("merges"),
                   added=tuple(read_fields(AddedToken, token) for token in state.get("added_tokens", [])))


@dataclass(frozen=True)
class MadeFrom:
    """What a cached token stream was made from: its text's sha256, its tokenizer's digest, its BOS policy and its
    ``max_tokens``. Its record's values, in this order, are the cache key's; its keys are fields of the entry."""

    text: str
    tokenizer: str
    bos: str
    max_tokens: int | None

    def as_record(self) -> dict:
        return write_fields(self)


@dataclass(frozen=True)
class StreamEntry:
    """A token cache entry's own fields besides what it was made from: the sha256 of its int32 ids, the stream's
    prefix, the bytes and words of its scored text, and its tokenizer's BOS id."""

    ids_sha256: str
    prefix: tuple[int, ...]
    n_bytes: int
    n_words: int
    bos_id: int | None

    @classmethod
    def of_json(cls, meta: dict) -> StreamEntry:
        return read_fields(cls, meta, {"prefix": tuple})

    def as_record(self, made_from: MadeFrom) -> dict:
        """The entry as written (before its seal): what it was made from, then its own fields."""
        return made_from.as_record() | write_fields(self)


def save_tokens(file: Path, ids: np.ndarray, meta: dict) -> None:
    """A token cache file: its int32 ``ids`` and its sealed ``meta``, as JSON, in one ``.npz``."""
    import numpy as np

    np.savez(file, ids=ids, meta=json.dumps(meta))


def load_tokens(file: Path) -> tuple[object, np.ndarray]:
    """A token cache file's meta (the JSON as written, unchecked) and ids; raises what ``np.load`` and ``json`` raise
    on a file that is not one (OSError, ValueError, KeyError, EOFError, BadZipFile)."""
    import numpy as np

    with np.load(file) as saved:
        return json.loads(str(saved["meta"])), saved["ids"]
