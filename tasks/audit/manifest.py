"""A baseline reference's own files as typed values (``tasks.audit.reference``): its ``manifest.json`` (``Manifest``:
its ``Identity``, ``Hidden`` states, LM ``Head``, ``StoredResult``), a slice's ``slice.json`` (``Slice``) and its
``scores.npz`` (``Scores``). This module alone reads and writes their keys: each is read once, checked as it is read
(a manifest that cannot be matched to a baseline raises ``Unreadable``, saying why), and written back key for key in
the order ppl-audit has always written them, so that a reference made before is found, and re-written byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from tasks.core import sealed
from tasks.core.plain import read_fields
from tasks.engine.settings import BOS_POLICIES, MODES, BosPolicy, Mode

REFERENCE_FORMAT = 2  # of the files below; a reference in another format is never matched (1: no digests)
MANIFEST_JSON = "manifest.json"
# Beyond float noise, per dtype: (largest |ΔNLL| of one token, |Δ mean NLL|) between two scorings of the
# same model on the same tokens. A batch size or kernel choice moves float32 tokens by ~1e-6 and 16-bit
# ones by up to ~0.1 (the mean far less); a changed model computation moves the mean.
DRIFT_TOLERANCE = {"float64": (1e-9, 1e-12), "float32": (1e-3, 1e-6), "bfloat16": (0.5, 1e-3), "float16": (0.25, 5e-4)}


def drift_tolerance(dtype: str) -> tuple[float, float]:
    """``DRIFT_TOLERANCE`` of ``dtype``; a dtype the table does not name takes float32's."""
    return DRIFT_TOLERANCE.get(dtype, DRIFT_TOLERANCE["float32"])


def _valid(check, default=MISSING):
    """A field of ``Identity`` that carries the check ``parse`` makes of what a manifest holds for it."""
    return field(default=default, metadata={"valid": check})


def _digest(value: object) -> bool:
    return isinstance(value, str) and len(value) > 0


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Identity:
    """What a baseline's numbers are a function of, but for the environment: a manifest's ``identity``, written
    (``tasks.audit.reference.identity``) and read back (``parse``) by this one type, so that a manifest holding anything
    less than a whole, valid one is told as damaged where it is read (``Manifest.of_json``), and never fails a variant
    later.

    Attributes:
        model: ``model_digest`` of its files; tokenizer: ``tasks.data.corpus.tokenizer_digest`` of its tokenizer;
        stream: ``stream_digest`` of the tokens scored; mode, window, stride, bos: how they were scored;
        dtype: what the model computed in (a key of ``DRIFT_TOLERANCE``);
        runtime, llama_cpp: a baseline llama.cpp scored (``tasks.audit.scoring.baseline_identity``): its version and
        the settings that move its logits.
    """

    format: int = _valid(lambda value: value == REFERENCE_FORMAT)
    model: str = _valid(_digest)
    tokenizer: str = _valid(_digest)
    stream: str = _valid(_digest)
    mode: Mode = _valid(lambda value: value in MODES)
    window: int = _valid(_count)
    stride: int = _valid(_count)
    bos: BosPolicy = _valid(lambda value: value in BOS_POLICIES)
    dtype: str = _valid(lambda value: isinstance(value, str) and value in DRIFT_TOLERANCE)
    runtime: str | None = _valid(_digest, None)
    llama_cpp: dict | None = _valid(lambda value: isinstance(value, dict), None)

    @classmethod
    def parse(cls, raw: object) -> Identity:
        """The identity ``raw`` holds; ``ValueError`` saying which field is missing, wrong or unknown when it does not
        hold exactly one (a field no ppl-audit writes was put there by hand)."""
        if not isinstance(raw, dict):
            raise ValueError("is not a mapping")
        for about in fields(cls):
            value = raw.get(about.name)
            if value is None and about.default is MISSING:
                raise ValueError(f"lacks its {about.name!r}")
            if value is not None and not about.metadata["valid"](value):
                raise ValueError(f"has {about.name} {value!r}, which no baseline has")
        unknown = sorted(set(raw) - {about.name for about in fields(cls)})
        if unknown:
            raise ValueError(f"holds {unknown[0]!r}, which no identity has")
        return cls(**raw)

    def as_dict(self) -> dict:
        """As the manifest and the reference's key hold it: a field a baseline does not have (``runtime``) left out."""
        return {name: value for name, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Hidden:
    """The hidden states' ``hidden.bin``: ``rows`` (one per scored token) of ``width`` numbers in ``dtype``."""

    rows: int
    width: int
    dtype: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.width

    def to_json(self) -> dict:
        return {"shape": [self.rows, self.width], "dtype": self.dtype}

    @classmethod
    def of_json(cls, raw: dict) -> Hidden:
        rows, width = raw["shape"]
        return cls(rows, width, raw["dtype"])


@dataclass(frozen=True)
class Head:
    """The LM head a reference's states go through (``tasks.audit.reference.lm_head``): its tensor's ``name`` in the
    checkpoint (read back from there by it) unless ``stored`` beside the states, and the ``digest`` of its tensors; a
    runtime's (llama.cpp's) head is its ``logits``, of that many tokens, the states being those logits."""

    name: str
    digest: str
    stored: bool
    logits: int | None = None

    def to_json(self) -> dict:
        logits = {} if self.logits is None else {"logits": self.logits}
        return {"name": self.name} | logits | {"digest": self.digest, "stored": self.stored}

    @classmethod
    def of_json(cls, raw: dict) -> Head:
        return read_fields(cls, raw)  # only a runtime's head has logits


def _head_with_softcap(head: Head | None, softcap: float | None) -> dict | None:
    """A head's entry as the manifest and a slice keep it: with the soft-cap its logits pass through."""
    return None if head is None else head.to_json() | {"softcap": softcap}


def head_and_softcap(raw: dict | None) -> tuple[Head | None, float | None]:
    """A head's entry with its soft-cap (``_head_with_softcap``), read; ``(None, None)`` for none."""
    return (None, None) if not raw else (Head.of_json(raw), raw["softcap"])


@dataclass(frozen=True)
class StoredResult:
    """The baseline's result as it was scored (``PerplexityResult.summary``): every scalar, given back whole
    (``summary``), and those a reference's checks read, named."""

    summary: dict
    n_tokens: int
    nll_sum: float
    mean_nll: float
    ppl: float

    @classmethod
    def of_json(cls, raw: dict) -> StoredResult:
        return read_fields(cls, raw, given={"summary": raw})


@dataclass(frozen=True)
class Draft:
    """What a reference is made from, as the audit gives it (``tasks.audit.scoring.Lookup.manifest``, with the load
    ``facts`` and the ``softcap`` of the model scored; a reference joined from slices takes its soft-cap from the
    first slice's head)."""

    identity: Identity
    environment: dict
    source: str
    facts: dict
    softcap: float | None = None

    @classmethod
    def of_json(cls, raw: dict) -> Draft:
        return read_fields(cls, raw, given={"identity": Identity.parse(raw["identity"])})


# what every manifest of this format holds, and as what: one that lacks any was edited or copied badly, and is as
# unreadable as one that is not JSON (a missing ``created`` once failed every audit of every baseline)
FIELDS = {"format": int, "key": str, "created": (int, float), "source": str, "identity": dict, "environment": dict,
          "facts": dict, "result": dict, "hidden": dict, "head": dict, "files": dict, "size_bytes": int, "digest": str}


class Unreadable(ValueError):
    """Why a manifest cannot even be matched to a baseline (``Manifest.of_json``), in the words a user reads."""


@dataclass(frozen=True)
class Manifest:
    """A reference's ``manifest.json``: its ``key`` (its folder's name), when it was ``created``, the baseline's
    ``source`` (folder or Hub id), ``identity`` and ``environment`` (``tasks.audit.reference.key_of`` digests the two),
    its load ``facts`` (``VariantFacts.summary``) and ``result``, its ``hidden`` states, LM ``head`` and the ``softcap``
    of its logits, its ``files`` (``sealed.files_entry``), ``size_bytes`` and its own ``digest`` (``sealed.seal``)."""

    key: str
    created: float
    source: str
    identity: Identity
    environment: dict
    facts: dict
    result: StoredResult
    hidden: Hidden
    head: Head
    softcap: float | None
    files: dict
    size_bytes: int
    digest: str
    format: int = REFERENCE_FORMAT

    def to_json(self) -> dict:
        """The manifest as written, key for key in the order it has always been (``made``)."""
        return self._unsized() | {"size_bytes": self.size_bytes, "digest": self.digest}

    def _unsized(self) -> dict:
        return {"identity": self.identity.as_dict(), "environment": self.environment, "source": self.source,
                "facts": self.facts, "hidden": self.hidden.to_json(), "head": _head_with_softcap(self.head, self.softcap),
                "format": self.format, "key": self.key, "created": self.created, "result": self.result.summary,
                "files": self.files}

    def text(self) -> str:
        """``manifest.json``'s text."""
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def made(cls, draft: Draft, key: str, created: float, result: dict, hidden: Hidden, head: Head, files: dict
             ) -> Manifest:
        """The manifest of a reference just written from ``draft``, sealed (its ``size_bytes`` and ``digest``).

        Args:
            result: the baseline's ``PerplexityResult.summary``; files: ``sealed.files_entry`` of the folder.
        """
        unsized = cls(key, created, draft.source, draft.identity, draft.environment, draft.facts,
                      StoredResult.of_json(result), hidden, head, draft.softcap, files, 0, "")
        body = unsized._unsized()
        sized = body | {"size_bytes": sum(about["bytes"] for about in files.values()) + len(json.dumps(body))}
        return cls.of_json(sealed.seal(sized), key)

    @classmethod
    def of_json(cls, raw: dict | None, key: str) -> Manifest:
        """The manifest ``raw`` holds (``load``) for the reference of ``key`` (its folder's name).

        Raises:
            Unreadable: it is missing, not JSON or of another format, lacks a field, has no whole, valid ``Identity``,
                names another reference (a manifest swapped or copied from another folder), or lacks what a field
                holds (edited and sealed again).
        """
        if raw is None:
            raise Unreadable(f"{MANIFEST_JSON} is missing, not JSON or not a format-{REFERENCE_FORMAT} manifest (an older "
                             "ppl-audit's: never used)")
        wrong = next((name for name, kind in FIELDS.items() if not isinstance(raw.get(name), kind)), None)
        if wrong is not None:
            raise Unreadable(f"{MANIFEST_JSON} lacks its {wrong!r}" if raw.get(wrong) is None else
                             f"{MANIFEST_JSON}'s {wrong!r} is damaged")
        try:
            identity = Identity.parse(raw["identity"])
        except ValueError as wrong_identity:
            raise Unreadable(f"{MANIFEST_JSON}'s identity {wrong_identity}") from None
        named = raw["key"]
        if named != key:
            raise Unreadable(f"{MANIFEST_JSON} is reference {named}'s, not {key}'s (swapped or copied)")
        try:
            head = raw["head"]
            return read_fields(cls, raw, {"result": StoredResult.of_json, "hidden": Hidden.of_json},
                               {"identity": identity, "head": Head.of_json(head), "softcap": head["softcap"]})
        except (KeyError, TypeError, IndexError, ValueError) as error:  # a field within lacking: edited, sealed again
            raise Unreadable(f"{MANIFEST_JSON} lacks what a reference holds ({type(error).__name__}: {error})") from None


def load(folder: Path) -> dict | None:
    """The folder's manifest as JSON when it is one of this format, read without a warning (``Manifest.of_json``)."""
    try:
        raw = json.loads((folder / MANIFEST_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == REFERENCE_FORMAT else None


def created(raw: dict | None) -> float | None:
    """When a manifest says its reference was made, even one that cannot be read (``Manifest.of_json``)."""
    made = None if raw is None else raw.get("created")
    return made if isinstance(made, (int, float)) else None


@dataclass(frozen=True)
class Slice:
    """A slice of a reference, as a baseline's shard wrote it (``tasks.audit.reference.Writer.seal``): the stream's
    scored tokens ``first … stop`` it holds, its ``hidden`` states and their ``sha256``; the first slice also names the
    LM ``head`` and the ``softcap`` of its logits."""

    first: int
    stop: int
    hidden: Hidden
    sha256: str
    head: Head | None = None
    softcap: float | None = None

    def to_json(self) -> dict:
        return {"rows": [self.first, self.stop], "hidden": self.hidden.to_json(), "sha256": self.sha256,
                "head": _head_with_softcap(self.head, self.softcap)}

    @classmethod
    def of_json(cls, raw: dict | None) -> Slice | None:
        """The slice ``raw`` holds; None for none, or one lacking what a slice holds (damaged)."""
        try:
            first, stop = raw["rows"]
            return cls(first, stop, Hidden.of_json(raw["hidden"]), raw["sha256"], *head_and_softcap(raw["head"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Scores:
    """A reference's ``scores.npz`` (``tasks.audit.reference.save_scores``): the NLL of each scored token (float32),
    of each window (float64) and the tokens it scored, and the ids of the scored tokens (``targets``)."""

    token_nll: np.ndarray
    window_nll: np.ndarray
    window_tokens: np.ndarray
    targets: np.ndarray

    @classmethod
    def read(cls, path: Path) -> Scores:
        with np.load(path) as scores:
            return read_fields(cls, scores)
