"""What MLflow logs of an audit's record that ``AuditResult`` does not hold, typed: how the audit was set up
(``AuditSetup``: its evaluation settings, corpora, environment, where it is tracked), each model as it was loaded
(``Lineage``: its spec, facts and manifest) and what it scored on each token stream (``StreamScored``).

Read once, by ``TrackedAudit.of_record``, at ``tasks.record.tracking``'s entry; records of every schema, of one
corpus or of several domains, read the same: always by token stream (one corpus is one stream). Light: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tasks.config import EvaluationConfig
from tasks.core.plain import read_fields
from tasks.record.entry_said import CorpusSaid, Environment, Lineage
from tasks.record.reference_said import ReferenceSaid
from tasks.record.result import AuditResult
from tasks.record.row import ModelRow
from tasks.record.serial import from_record



@dataclass(frozen=True)
class StreamScored:
    """A model on one token stream: its comparison row, its verdict as its colour says it (``shown``:
    ``tasks.record.plots.verdict_of``), what scoring it gave (``result``: ``ppl``, ``stderr``, ...; ``absent``: why
    a figure is missing), its per-token table's file (``arrays``) and where in the text it loses (``where``).
    ``domain``: the stream's name in an audit of several domains, None for one corpus; ``suffixes``: the endings of
    the MLflow metrics its figures go under (``.DOMAIN``, and none too for the model's worst domain, whose figures
    are its run's own). ``entry``: the record's entry, for the charts, which read it themselves."""

    row: ModelRow
    shown: str
    result: Mapping[str, object]
    absent: Mapping[str, str]
    arrays: str | None
    where: dict | None
    domain: str | None
    suffixes: tuple[str, ...]
    entry: dict

    @classmethod
    def of_entry(cls, entry: dict, domain: str | None, suffixes: tuple[str, ...]) -> StreamScored:
        from tasks.record.plots import verdict_of

        result = entry["result"] or {}
        return cls(ModelRow.of_record(entry["row"]), verdict_of(entry), result, result.get("absent", {}),
                   entry.get("arrays"), entry.get("where"), domain, suffixes, entry)


@dataclass(frozen=True)
class TrackedModel:
    """A model of the audit as its MLflow run says it: its role (``baseline``, ``variant``), whether it was scored
    (``status``), its verdict's status as the comparison table has it (``judged``: ``baseline`` where it has none)
    and its reason, when it ran (epoch seconds; None in a record of before they were kept), how it was set up, the
    shards that scored it, its sequential run's seed, stop and decision, the diagnosis to log for it (None without
    one, or where it was not made), its worst ``domain`` (None for one corpus), its figures on that stream
    (``top``) and on every stream (``streams``, by domain name in an audit of several)."""

    name: str
    role: str
    status: str
    judged: str
    reason: str
    started: float | None
    ended: float | None
    setup: Lineage
    shards: int | None
    sequential: Mapping[str, object]
    diagnosis: dict | None
    domain: str | None
    top: StreamScored
    streams: Mapping[str | None, StreamScored]


def _model(entry: dict, streams: Mapping[str | None, StreamScored] | None = None) -> TrackedModel:
    """A model's entry; ``streams``: its figures on each domain, in an audit of several (one corpus: its own)."""
    top = StreamScored.of_entry(entry, None, ("",))
    verdict = entry["verdict"] or {}
    diagnosis = entry.get("diagnosis")
    return read_fields(TrackedModel, entry, given={
        "judged": verdict.get("status", "baseline"), "reason": verdict.get("reason") or entry["reason"],
        "setup": Lineage.of_entry(entry),
        "shards": sum("failed" not in shard for shard in entry.get("shards", [])) or None,
        "sequential": {key: value for key, value in entry.get("sequential", {}).items()
                       if key in ("seed", "stopped", "decision")},
        "diagnosis": diagnosis if diagnosis is not None and "problem" not in diagnosis else None,
        "top": top, "streams": streams or {None: top}})


def _on_domains(entry: dict, views: dict[str, dict]) -> dict[str, StreamScored]:
    """A model's figures on each domain of an audit of several (``views``: each domain's own record, by name; none
    for one corpus), by domain: its worst domain's (``entry``'s ``domain``) are also its run's own, unsuffixed."""
    worst = entry.get("domain")
    return {name: StreamScored.of_entry(next(own for own in view["variants"] if own["name"] == entry["name"]), name,
                                  (f".{name}", "") if name == worst else (f".{name}",)) for name, view in views.items()}


@dataclass(frozen=True)
class Stream:
    """A token stream of the audit: its corpus and ``max_tokens``, the baseline's reference on it, the digest of
    the tokens scored on it (``population``), its table and noise floor's rows, its ``domain`` (its name in an audit
    of several, else None)."""

    corpus: CorpusSaid
    max_tokens: int | None
    reference: ReferenceSaid
    population: str | None
    table: str
    floor: tuple[ModelRow, ...]
    domain: str | None

    @property
    def ending(self) -> str:
        """How the MLflow metrics of its figures end: ``.DOMAIN`` in an audit of several, nothing for one corpus."""
        return "" if self.domain is None else f".{self.domain}"


def _stream(view: dict, domain: str | None) -> Stream:
    """The stream of a one-corpus record (or of a domain's own record, under ``domains``)."""
    baseline = next((entry.get("reference") or {} for entry in view["variants"] if entry["role"] == "baseline"), {})
    return Stream(CorpusSaid.of_record(view["corpus"]), view["config"]["evaluation"]["max_tokens"],
                  ReferenceSaid.of_record(baseline), (view.get("population") or {}).get("digest"), view["table"],
                  tuple(ModelRow.of_record(floor["row"]) for floor in view.get("floor", [])), domain)


@dataclass(frozen=True)
class TrackedAudit:
    """An audit's record as MLflow logs it: the ``AuditResult`` it was written from (``result``), its own setup and
    each model's, by token stream.

    Attributes:
        audit_id, name: the audit's; ``started``, ``created`` when it began and ended (ISO; a record of before
            ``started`` was kept has ``created`` for both); ``scheduled`` whether Prefect's schedule started it.
        config: the audit's config as the record holds it; ``config_text`` as it was written (None: not kept).
        uri, experiment: where the config tracks it.
        window, stride, batch_size, max_tokens, mode, baseline: its evaluation settings and baseline's path.
        corpus: its corpus (the domains' sum in an audit of several); ``hardware``, ``versions`` where it ran.
        streams: each token stream, by domain name (None for one corpus).
        models: each model, the baseline first.
        history_key: the baseline's key on the audit's one token stream (``tasks.record.history``), None in an
            audit of several domains (none names them all).
    """

    result: AuditResult
    audit_id: str
    name: str
    started: str
    created: str
    scheduled: bool
    config: dict
    config_text: str | None
    uri: str | None
    experiment: str
    window: int
    stride: int
    batch_size: int
    max_tokens: int | None
    mode: str
    baseline: str
    corpus: CorpusSaid
    hardware: str
    versions: Mapping[str, str]
    streams: Mapping[str | None, Stream]
    models: tuple[TrackedModel, ...]
    history_key: str | None

    @classmethod
    def of_record(cls, record: dict) -> TrackedAudit:
        result = from_record(record)
        config = record["config"]
        evaluation, tracking = EvaluationConfig.of_record(config["evaluation"]), config["tracking"]
        environment = Environment.of_record(record["environment"])
        # each domain shown by name is a token stream of its own (its record under ``domains``), and each model has
        # its figures on it; one corpus is the record's one stream, unnamed, and the only one the history keys
        views = {name: record["domains"][name] for name in result.shown}
        streams = {name: _stream(view, name) for name, view in views.items()} or {None: _stream(record, None)}
        models = tuple(_model(entry, _on_domains(entry, views)) for entry in record["variants"])
        history_key = None if views else streams[None].reference.baseline_key
        return read_fields(cls, record, {"corpus": CorpusSaid.of_record}, {
            "result": result, "started": record.get("started", record["created"]),
            "scheduled": bool(record.get("scheduled")), "uri": tracking["uri"], "experiment": tracking["experiment"],
            "window": evaluation.window, "stride": evaluation.stride, "batch_size": evaluation.batch_size,
            "max_tokens": evaluation.max_tokens, "mode": evaluation.mode, "baseline": config["baseline"]["path"],
            "hardware": environment.hardware, "versions": environment.versions, "streams": streams, "models": models,
            "history_key": history_key})
