"""One model's comparison row, typed: what it scored, how it moved against the baseline over the same tokens, and
how far its logits moved (``ModelRow``). Built by ``tasks.record.verdict.comparison_row``; every view reads its
attributes.

A row is written flat (the record's ``row``, ``--json``'s models, MLflow's metrics) and read back by this module
alone (``ModelRow.as_record``, ``ModelRow.of_record``), key for key and in the order records have always had, so
that a record written before the row was typed reads and prints as it did. Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from tasks.record.figures import SHOWN, Shown
from tasks.record.floor_said import FloorJudgement


@dataclass(frozen=True)
class Interval:
    """A figure with, where measured, its standard error and 95% interval (over windows: ``tasks.engine.paired``);
    a sequential run's stop gives its bounds without an error."""

    value: float
    stderr: float | None = None
    low: float | None = None
    high: float | None = None

    @property
    def bounded(self) -> bool:
        """Whether it has an interval (a paired figure; a point estimate has none)."""
        return self.low is not None and self.high is not None

    def _flat(self, name: str) -> Iterator[tuple[str, float]]:
        yield from ((f"{name}{'' if end == 'value' else '_' + end}", number)
                    for end, number in zip(_ENDS, (self.value, self.stderr, self.low, self.high)) if number is not None)

    @classmethod
    def of_flat(cls, flat: dict, name: str) -> Interval | None:
        """The figure ``name`` of a flat row (``name``, ``name_stderr``, ``name_low``, ``name_high``); None where the row
        does not hold it."""
        if name not in flat:
            return None
        return cls(*(flat.get(name if end == "value" else f"{name}_{end}") for end in _ENDS))


_ENDS = ("value", "stderr", "low", "high")


@dataclass(frozen=True)
class Spread:
    """The spread of a per-token figure: its maximum, percentiles (``(p, value)``, in the order given) and minimum."""

    max: float
    percentiles: tuple[tuple[float, float], ...]
    min: float

    def _flat(self, name: str) -> Iterator[tuple[str, float]]:
        yield f"{name}_max", self.max
        yield from ((f"{name}_p{p:g}", value) for p, value in self.percentiles)
        yield f"{name}_min", self.min

    @classmethod
    def _read(cls, flat: dict, name: str) -> Spread | None:
        if f"{name}_max" not in flat:
            return None
        start = f"{name}_p"
        percentiles = tuple((float(key[len(start):]), value) for key, value in flat.items()
                            if key.startswith(start) and _number(key[len(start):]))
        return cls(flat[f"{name}_max"], percentiles, flat[f"{name}_min"])


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class OwnFigures:
    """What a scored model measured on its own: its perplexity, speed, size and its key/value cache's cost.

    ``bits_per_byte`` is None where the corpus's bytes were not counted; ``kv_saving_pct`` is a variant's against the
    baseline's cache; ``kv_cache`` the emulated cache it was scored with; ``llama_cpp`` the settings llama.cpp ran it
    with (``tasks.record.verdict.llama_cpp_text``); ``scored_fraction`` the share of windows a sequential run scored.
    """

    ppl: float
    ppl_stderr: float
    mean_nll: float
    bits_per_byte: float | None
    n_tokens: int
    tokens_per_second: float
    weight_mib: float
    bits_per_weight: float
    model_bits_per_weight: float
    load_seconds: float
    backend: str
    kv_bytes_per_token: float
    kv_window_mib: float
    kv_saving_pct: float | None = None
    kv_cache: str | None = None
    llama_cpp: str | None = None
    scored_fraction: float = 1.0


@dataclass(frozen=True)
class BaselineSaid:
    """How the baseline's scores came: ``baseline`` (scored, reused, verified, ...), the references removed as
    damaged, and whether its rescoring drifted from its stored reference (``drift``: ``environment drift`` or
    ``none``, against reference ``drift_from``)."""

    baseline: str
    removed_references: tuple[str, ...] = ()
    drift: str | None = None
    drift_from: str | None = None


@dataclass(frozen=True)
class Change:
    """A variant's change against the baseline: ΔPPL, the PPL ratio and ΔPPL in %; over the same tokens, paired
    (``delta_nll``, each with its interval over ``windows`` windows, and the correlation of their per-window ln PPL)."""

    delta_ppl: float
    ppl_ratio: Interval
    delta_ppl_pct: Interval
    delta_nll: Interval | None = None
    window_lnppl_correlation: float | None = None
    windows: int | None = None

    @property
    def paired(self) -> bool:
        return self.delta_nll is not None

    @classmethod
    def of_flat(cls, flat: dict) -> Change | None:
        """The change a flat row holds (``paired_difference``'s figures over its points); None without one."""
        if "delta_ppl_pct" not in flat:
            return None
        return cls(flat.get("delta_ppl", math.nan), Interval.of_flat(flat, "ppl_ratio") or Interval(math.nan),
                   Interval.of_flat(flat, "delta_ppl_pct"),
                   Interval.of_flat(flat, "delta_nll"), flat.get("window_lnppl_correlation"), flat.get("windows"))


@dataclass(frozen=True)
class Divergences:
    """How far a variant's next-token distributions moved from the baseline's: llama-perplexity's statistics, errors
    over windows (``tasks.engine.paired.divergence_summary``). ``kld``: KL(base‖variant); ``kld_reverse`` the other
    way; ``dp``: the variant's probability of the right token less the baseline's; ``kld_llama_mean``: the mean KLD as
    llama-perplexity estimates it (mode llama.cpp); ``divergence_mib``: the baseline logits' memory it took."""

    kld_mean: Interval
    kld: Spread
    kld_reverse_mean: Interval
    kld_reverse: Spread
    top1_agreement: Interval
    dp_mean: Interval
    dp: Spread
    dp_rms: Interval
    token_lnppl_correlation: float
    kld_llama_mean: Interval | None = None
    divergence_mib: float | None = None
    confident_flip_rate: Interval | None = None

    @classmethod
    def of_flat(cls, flat: dict) -> Divergences | None:
        """The statistics a flat row holds (``divergence_summary``'s, and ``divergence_mib``); None without KL."""
        if "kld_mean" not in flat:
            return None
        interval, spread = partial(Interval.of_flat, flat), partial(Spread._read, flat)
        return cls(interval("kld_mean"), spread("kld"), interval("kld_reverse_mean"), spread("kld_reverse"),
                   interval("top1_agreement"), interval("dp_mean"), spread("dp"), interval("dp_rms"),
                   flat.get("token_lnppl_correlation", math.nan), interval("kld_llama_mean"), flat.get("divergence_mib"),
                   interval("confident_flip_rate"))


@dataclass(frozen=True)
class Dominance:
    """Whether another variant beats this one on size and quality (``tasks.record.dominance``): ``by`` names the one
    that does, None for a variant on the front."""

    by: str | None


# the figures with intervals a gate, a chart or a sequential stop names by key (tasks.record.figures.GATED), and
# where each lives in a row
_CHANGE_FIGURES = ("delta_nll", "ppl_ratio", "delta_ppl_pct")
_DIVERGENCE_FIGURES = ("kld_mean", "kld_reverse_mean", "top1_agreement", "dp_mean", "dp_rms", "kld_llama_mean",
                       "confident_flip_rate")


@dataclass(frozen=True)
class ModelRow:
    """One model's row of the comparison: the baseline's, a variant's or a noise floor's.

    Attributes:
        variant: the model's name; ``method`` as the table says it ("gguf Q4_K_M", "baseline kv:int8").
        status: ``ok`` when it was scored, else ``error`` with ``reason``.
        measured: what it measured on its own (None when it was not scored).
        said: the baseline's: how its scores came.
        reference: the stored reference the baseline's scores are, or a variant's KL was measured against.
        change: a variant's against the baseline (None without a baseline to compare with).
        divergence_absent: why KL was not measured, where it was asked for.
        divergences: its KL and token-probability statistics.
        sequential: how a sequential run ended.
        floor: a variant against the noise floor (``tasks.record.floor.judged``).
        dominance: whether another variant dominates it (None: not judged).
        floor_of, floor_kept: a noise floor's row: its dtype, and scored or reused.
        domain: in an audit of several domains, the domain the row is of.
    """

    variant: str
    method: str
    status: str
    reason: str
    measured: OwnFigures | None = None
    said: BaselineSaid | None = None
    reference: str | None = None
    change: Change | None = None
    divergence_absent: str | None = None
    divergences: Divergences | None = None
    sequential: str | None = None
    floor: FloorJudgement | None = None
    dominance: Dominance | None = None
    floor_of: str | None = None
    floor_kept: str | None = None
    domain: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def dominated_by(self) -> str | None:
        return self.dominance.by if self.dominance else None

    @property
    def windows(self) -> int | None:
        """How many windows its paired intervals rest on."""
        return self.change.windows if self.change else None

    @property
    def delta_ppl_pct(self) -> float | None:
        """Its ΔPPL in % against the baseline, where there is one."""
        return self.change.delta_ppl_pct.value if self.change else None

    def figure(self, key: str) -> Interval | None:
        """The figure a gate or a chart names by key (``delta_ppl_pct``, ``kld_mean``, ``top1_agreement``, ...);
        None where it was not measured."""
        if key in _CHANGE_FIGURES:
            return getattr(self.change, key) if self.change else None
        if key in _DIVERGENCE_FIGURES:
            return getattr(self.divergences, key) if self.divergences else None
        raise KeyError(f"no figure {key} with an interval in a comparison row")

    def shown(self) -> list[tuple[Shown, Interval]]:
        """The per-model figures every view shows (``tasks.record.figures.SHOWN``) that this row measured, in order."""
        return [(figure, found) for figure in SHOWN if (found := self.figure(figure.key)) is not None]

    def with_figure(self, key: str, figure: Interval) -> ModelRow:
        """The row with figure ``key`` replaced (a sequential stop's bounds)."""
        if key in _CHANGE_FIGURES:
            return replace(self, change=replace(self.change, **{key: figure}))
        return replace(self, divergences=replace(self.divergences, **{key: figure}))

    def as_record(self) -> dict:
        """The row as a record, ``--json`` and MLflow hold it: flat, in the order records have always had."""
        return dict(_flat(self))

    @classmethod
    def of_record(cls, flat: dict) -> ModelRow:
        """A row a record holds (any schema)."""
        return _read(flat)


# a scored model's own figures, in the order a record's row holds them (its cache's come before them)
_OWN_FIGURES = ("ppl", "ppl_stderr", "mean_nll", "bits_per_byte", "n_tokens", "tokens_per_second", "weight_mib",
                "bits_per_weight", "model_bits_per_weight", "load_seconds", "backend")


def _flat(row: ModelRow) -> Iterator[tuple[str, Any]]:
    yield from (("variant", row.variant), ("method", row.method), ("status", row.status), ("reason", row.reason))
    m = row.measured
    if m is not None:
        yield from ((key, value) for key, value in (("kv_cache", m.kv_cache), ("llama_cpp", m.llama_cpp)) if value)
        yield from (("kv_bytes_per_token", m.kv_bytes_per_token), ("kv_window_mib", m.kv_window_mib))
        if m.kv_saving_pct is not None:
            yield "kv_saving_pct", m.kv_saving_pct
        yield from ((key, getattr(m, key)) for key in _OWN_FIGURES)
    if row.said is not None:
        yield from (("baseline", row.said.baseline), ("reference", row.reference))
        if row.said.removed_references:
            yield "removed_references", list(row.said.removed_references)
        if row.said.drift is not None:
            yield from (("drift", row.said.drift), ("drift_from", row.said.drift_from))
    if m is not None:
        yield "scored_fraction", m.scored_fraction
    yield from _change(row.change)
    if row.divergence_absent is not None:
        yield "divergence_absent", row.divergence_absent
    d = row.divergences
    if d is not None:
        for name in ("kld", "kld_reverse"):
            yield from getattr(d, f"{name}_mean")._flat(f"{name}_mean")
            yield from getattr(d, name)._flat(name)
        yield from d.top1_agreement._flat("top1_agreement")
        if d.kld_llama_mean is not None:
            yield from d.kld_llama_mean._flat("kld_llama_mean")
        yield from d.dp_mean._flat("dp_mean")
        yield from d.dp._flat("dp")
        yield from d.dp_rms._flat("dp_rms")
        yield "token_lnppl_correlation", d.token_lnppl_correlation
        if d.confident_flip_rate is not None:
            yield from d.confident_flip_rate._flat("confident_flip_rate")
        if row.said is None:
            yield "reference", row.reference
        if d.divergence_mib is not None:
            yield "divergence_mib", d.divergence_mib
    if row.sequential is not None:
        yield "sequential", row.sequential
    if row.floor is not None:
        yield "floor", row.floor.as_record()
    if row.dominance is not None:
        yield "dominated_by", row.dominance.by
    yield from ((key, getattr(row, key)) for key in ("floor_of", "floor_kept", "domain") if getattr(row, key) is not None)


def _change(change: Change | None) -> Iterator[tuple[str, Any]]:
    """A change's keys: its point estimates first, then (paired) ΔNLL and the other intervals' ends, as
    ``paired_difference``'s figures always followed the points they refine."""
    if change is None:
        return
    yield from (("delta_ppl", change.delta_ppl), ("ppl_ratio", change.ppl_ratio.value),
                ("delta_ppl_pct", change.delta_ppl_pct.value))
    if change.delta_nll is not None:
        yield from change.delta_nll._flat("delta_nll")
    for name in ("ppl_ratio", "delta_ppl_pct"):
        yield from ((key, value) for key, value in getattr(change, name)._flat(name) if key != name)
    if change.window_lnppl_correlation is not None:
        yield "window_lnppl_correlation", change.window_lnppl_correlation
    if change.windows is not None:
        yield "windows", change.windows


def _read(flat: dict) -> ModelRow:
    get = flat.get
    measured = OwnFigures(**{f.name: get(f.name, math.nan) for f in fields(OwnFigures)
                           if f.name in flat or f.default is MISSING}) if "ppl" in flat else None
    said = BaselineSaid(get("baseline"), tuple(get("removed_references", ())), get("drift"),
                        get("drift_from")) if "baseline" in flat else None
    return ModelRow(get("variant"), get("method"), get("status"), get("reason", ""), measured, said, get("reference"),
                    Change.of_flat(flat), get("divergence_absent"), Divergences.of_flat(flat), get("sequential"),
                    FloorJudgement.of_record(get("floor")) if get("floor") is not None else None, Dominance(get("dominated_by")) if "dominated_by" in flat else None, get("floor_of"),
                    get("floor_kept"), get("domain"))
