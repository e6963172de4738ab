"""A variant's diagnosis, typed (``VariantDiagnosis``): per decoder layer its own and accumulated error and what
restoring it alone wins back, the LM head's and the input embeddings' own error, the ranking and the greedy restore
curve. Every view of a diagnosis (``tasks.record.diagnosis``) reads its attributes.

A diagnosis is made typed (``tasks.audit.diagnose``: each restore a ``RestoreStep``, the whole a
``VariantDiagnosis``) and handed on as plain data (``tasks.audit.diagnose.diagnosis_report``, with what the flows
add: the seed, the audit, the domain, where it was logged), and kept so (the audit's record, ``<home>/diagnoses``,
``--json``, the MLflow run's ``diagnosis.json``). This module alone writes it (``VariantDiagnosis.as_record``) and
reads it back (``VariantDiagnosis.of_record``), key for key and in the order it was made, so that a diagnosis kept
before it was typed reads and prints as it did. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tasks.core.plain import read_fields, write_fields


@dataclass(frozen=True)
class WonBack:
    """What restoring layers wins back of the variant's loss (KL or ΔNLL), in % of it, and its 95% interval over
    windows (``tasks.engine.layers.recovered_share``: NaN ends on a sample of one window)."""

    pct: float
    low: float
    high: float

    def _flat(self, name: str) -> Iterator[tuple[str, float]]:
        yield from ((f"{name}_{end}", getattr(self, end)) for end in _ENDS)

    @classmethod
    def _read(cls, flat: dict, name: str) -> WonBack:
        return cls(*(flat[f"{name}_{end}"] for end in _ENDS))


_ENDS = ("pct", "low", "high")


@dataclass(frozen=True)
class LayerFinding:
    """One decoder layer: its SQNR (dB), relative error and mean cosine error, fed the baseline's input (``own_``)
    and the variant's (``accumulated_``, end to end); what restoring it alone wins back of the KL (``restore_kl``)
    and of the ΔNLL (``restore_nll``), and the MiB it costs."""

    layer: int
    own_sqnr_db: float
    accumulated_sqnr_db: float
    own_rel_error: float
    accumulated_rel_error: float
    own_cos_err: float
    accumulated_cos_err: float
    restore_kl: WonBack
    restore_nll: WonBack
    restore_mib: float

    def _flat(self) -> Iterator[tuple[str, Any]]:
        yield from ((key, getattr(self, key)) for key in _LAYER_FIGURES)
        yield from self.restore_kl._flat("restore_recovery")
        yield from self.restore_nll._flat("restore_nll_recovery")
        yield "restore_mib", self.restore_mib

    @classmethod
    def _read(cls, flat: dict) -> LayerFinding:
        return read_fields(cls, flat, given={"restore_kl": WonBack._read(flat, "restore_recovery"),
                                             "restore_nll": WonBack._read(flat, "restore_nll_recovery")})


# a layer's figures kept under their own names, in the order diagnosis_report writes them
_LAYER_FIGURES = ("layer", "own_sqnr_db", "accumulated_sqnr_db", "own_rel_error", "accumulated_rel_error",
                  "own_cos_err", "accumulated_cos_err")


@dataclass(frozen=True)
class RestoreStep:
    """A step of the greedy restore curve: the baseline's layers ``restored`` in the variant's place, the MiB they
    cost, the ΔNLL and mean KL left, and what they win back of the KL and of the ΔNLL."""

    restored: tuple[int, ...]
    mib: float
    delta_nll: float
    kl: float
    kl_recovery: WonBack
    nll_recovery: WonBack

    def _flat(self) -> Iterator[tuple[str, Any]]:
        yield from (("restored", list(self.restored)), ("mib", self.mib), ("delta_nll", self.delta_nll),
                    ("kl", self.kl))
        yield from self.kl_recovery._flat("kl_recovery")
        yield from self.nll_recovery._flat("nll_recovery")

    @classmethod
    def _read(cls, flat: dict) -> RestoreStep:
        return read_fields(cls, flat, {"restored": tuple}, {"kl_recovery": WonBack._read(flat, "kl_recovery"),
                                                            "nll_recovery": WonBack._read(flat, "nll_recovery")})


@dataclass(frozen=True)
class HeadError:
    """The variant's LM head on the baseline's final hidden states: its own mean KL, and how often it gives the
    baseline's top token."""

    kl: float
    top1: float


@dataclass(frozen=True)
class EmbeddingError:
    """The variant's input embeddings against the baseline's: SQNR (dB) and relative error."""

    sqnr_db: float
    rel_error: float


@dataclass(frozen=True)
class VariantDiagnosis:
    """Where a variant loses against its baseline, on a seeded sample of its audit's windows.

    Attributes:
        windows, window_indices, tokens: the sample: how many windows, which (in the plan's order), their tokens.
        delta_nll, delta_ppl_pct, kl: the variant's loss on the sample.
        layers: per decoder layer, by layer; ``ranking``: the layers, those that win back most alone first.
        restore_curve: the greedy curve, from none restored.
        where: where in the sample's text it loses (``tasks.audit.where.located``'s plain data).
        seconds: how long it took.
        seed: the seed that drew the sample (a diagnosis made by a flow).
        audit, domain: a ``ppl-audit diagnose``'s audit and, in an audit of several corpora, its domain.
        mlflow_run_id, record: where ``ppl-audit diagnose`` logged it (``flows.answers.where_logged``).
    """

    variant: str
    method: str
    windows: int
    window_indices: tuple[int, ...]
    tokens: int
    delta_nll: float
    delta_ppl_pct: float
    kl: float
    head: HeadError
    embeddings: EmbeddingError
    layers: tuple[LayerFinding, ...]
    ranking: tuple[int, ...]
    restore_curve: tuple[RestoreStep, ...]
    where: dict
    seconds: float
    seed: int | None = None
    audit: str | None = None
    domain: str | None = None
    mlflow_run_id: str | None = None
    record: str | None = None

    def as_record(self) -> dict:
        """The diagnosis as plain data, in the order it was made: the record's, the JSON file's, ``--json``'s."""
        return dict(self._flat())

    def _flat(self) -> Iterator[tuple[str, Any]]:
        yield from (("variant", self.variant), ("method", self.method), ("windows", self.windows),
                    ("window_indices", list(self.window_indices)), ("tokens", self.tokens),
                    ("delta_nll", self.delta_nll), ("delta_ppl_pct", self.delta_ppl_pct), ("kl", self.kl),
                    ("head", write_fields(self.head)), ("embeddings", write_fields(self.embeddings)),
                    ("layers", [dict(row._flat()) for row in self.layers]), ("ranking", list(self.ranking)),
                    ("restore_curve", [dict(step._flat()) for step in self.restore_curve]), ("where", self.where),
                    ("seconds", self.seconds))
        yield from ((key, getattr(self, key)) for key in _ADDED if getattr(self, key) is not None)

    @classmethod
    def of_record(cls, flat: dict) -> VariantDiagnosis:
        """A diagnosis kept as plain data (``as_record``'s, or ``diagnosis_report``'s with what the flows add)."""
        return read_fields(cls, flat, {"window_indices": tuple, "head": _reader(HeadError),
                                       "embeddings": _reader(EmbeddingError), "layers": _each(LayerFinding._read),
                                       "ranking": tuple, "restore_curve": _each(RestoreStep._read)})


def _reader(cls: type) -> Callable[[dict], Any]:
    """How a part of plain fields, each kept under its own name, is read."""
    return lambda flat: read_fields(cls, flat)


def _each(read: Callable[[dict], Any]) -> Callable[[list], tuple]:
    return lambda items: tuple(read(item) for item in items)


# what the flows add to a diagnosis, in the order they add it (flows/diagnose.py, flows/answers.py)
_ADDED = ("seed", "audit", "domain", "mlflow_run_id", "record")
