"""What an audit's record says beyond the ``AuditResult`` it was written from, typed, for the report and the charts
(``tasks.record.report``, ``tasks.record.plots``): each model's entry (``ModelSaid``: where it came from, where in
the text it loses, its diagnosis, the baseline's reference) and the audit's settings, corpus and environment
(``RecordSaid``); and for the card, the same settings of a record of any schema (``Written``).

A record is plain data (``tasks.record.contents.audit_record``); this module alone reads the parts of it that
``tasks.record.serial.from_record`` does not (``RecordSaid.of_record``, ``ModelSaid.alone``, ``Written.of_record``),
so that a view reads attributes. It reads records of every schema: a key a record from before it was kept lacks reads
as None. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tasks.config import EvaluationConfig, Thresholds
from tasks.core.plain import read_fields
from tasks.record.diagnosis_said import VariantDiagnosis
from tasks.record.reference_said import ReferenceSaid
from tasks.record.result import AuditResult
from tasks.record.row import Interval, ModelRow
from tasks.record.serial import from_record
from tasks.record.domain_view_said import domain_view
from tasks.record.verdict_said import Verdict


@dataclass(frozen=True)
class CalibrationSaid:
    """The calibration a quantized model was made with (its manifest's): how many samples of how many tokens, the
    seed that drew them and their digest."""

    samples: int | None
    seq_len: int | None
    seed: int | None
    digest: str | None

    @classmethod
    def of_record(cls, said: dict) -> CalibrationSaid:
        return read_fields(cls, said)


@dataclass(frozen=True)
class GgufFormat:
    """A GGUF file's facts: its file type, how many tensors of each type, bits per weight."""

    file_type: str
    tensor_types: Mapping[str, int]
    bits_per_weight: float


@dataclass(frozen=True)
class CompressedFormat:
    """A compressed-tensors checkpoint's scheme, format, weights' types and whether its activations are quantized."""

    scheme: str
    format: str
    weights: tuple[str, ...]
    activation_quantization: str


@dataclass(frozen=True)
class HqqFormat:
    """An HQQ model's bits, group size and backend."""

    bits: int
    group_size: int
    backend: str


def _format(found: dict) -> GgufFormat | CompressedFormat | HqqFormat | None:
    """The format a model's facts found (``quantization``), where it is one the report describes."""
    if "file_type" in found:
        return read_fields(GgufFormat, found)
    if "scheme" in found:
        return read_fields(CompressedFormat, found, {"weights": tuple})
    if "packing" in found:
        return read_fields(HqqFormat, found)
    return None


@dataclass(frozen=True)
class SpecSaid:
    """A model's spec as its entry holds it (its config's, dumped): what it was asked to be, which ``Lineage`` reads
    where loading and its manifest do not say otherwise. A record of before ``runtime`` was kept ran transformers."""

    method: str
    path: str | None
    bits: int | None
    group_size: int | None
    sym: bool | None
    dtype: str
    device: str
    runtime: str = "transformers"


# what llama.cpp ran a model with: a format fact of its own, logged under its own prefix
LLAMA_CPP_FACTS = "llama_cpp"


@dataclass(frozen=True)
class Lineage:
    """Where a model came from and what it ran as: what the config asked for (its ``spec``), what was loaded (its
    ``facts``) and how it was made (its ``manifest``), each figure from the first that holds it. The report's lineage
    and MLflow's parameters read it.

    Attributes:
        path: the config's; ``loaded_from``: what was loaded (a Hub snapshot's folder, a made checkpoint's).
        formats: the format's own facts (a GGUF's file type, a compressed-tensors scheme, how method auto found the
            method), as loading found them; ``format`` those the report describes, typed.
        llama_cpp: the settings llama.cpp ran it with.
        figures: what loading it found and measured, whole (``load_seconds``, sizes, bits per weight).
    """

    method: str
    detected: str | None
    format: GgufFormat | CompressedFormat | HqqFormat | None
    path: str
    loaded_from: str | None
    bits: int | None
    group_size: int | None
    sym: bool | None
    dtype: str | None
    device: str | None
    backend: str | None
    worker: str | None
    kv_cache: str | None
    body: str | None
    runtime: str
    size_on_disk_bytes: int | None
    bits_per_weight: float | None  # of the quantized layers as shipped
    model_bits_per_weight: float | None  # of the whole model as loaded
    source_model_digest: str | None
    calibration: CalibrationSaid | None
    formats: Mapping[str, object]
    llama_cpp: Mapping[str, object]
    figures: Mapping[str, object]

    @classmethod
    def of_entry(cls, entry: dict) -> Lineage:
        """A model's entry's: its spec, the facts of its load and its manifest (None where it has none)."""
        return cls.of_record(read_fields(SpecSaid, entry["spec"]), entry.get("facts"), entry.get("manifest"))

    @classmethod
    def of_record(cls, spec: SpecSaid, facts: dict | None, manifest: dict | None) -> Lineage:
        facts, manifest = facts or {}, manifest or {}
        found = facts.get("quantization") or {}
        calibration = manifest.get("calibration")
        return cls(facts.get("method") or spec.method, found.get("detected"), _format(found), spec.path,
                   facts.get("source") or spec.path, spec.bits or manifest.get("bits"),
                   spec.group_size or manifest.get("group_size"),
                   spec.sym if spec.sym is not None else manifest.get("sym"),
                   facts.get("dtype", spec.dtype), facts.get("device", spec.device), facts.get("backend"),
                   facts.get("worker"), facts.get("kv_cache") or None, facts.get("body"),
                   spec.runtime, facts.get("size_on_disk_bytes"), facts.get("bits_per_weight"),
                   facts.get("model_bits_per_weight"), manifest.get("source_model_digest"),
                   CalibrationSaid.of_record(calibration) if calibration else None,
                   {key: value for key, value in found.items() if key != LLAMA_CPP_FACTS},
                   found.get(LLAMA_CPP_FACTS) or {}, facts)


@dataclass(frozen=True)
class WhereGroup:
    """A group of tokens of ``where`` (``tasks.record.where.where_figures``): a bin of positions or of the baseline's
    top-1 probability (``low``, ``high``), or the tokens the baseline got ``right`` or ``wrong`` (``baseline``); how
    many tokens it holds, and their mean ΔNLL and KL with 95% intervals (a value of None: no tokens, or no KL)."""

    tokens: int
    delta_nll: Interval
    kl: Interval
    low: float | None = None
    high: float | None = None
    baseline: str | None = None

    @classmethod
    def of_record(cls, said: dict) -> WhereGroup:
        return read_fields(cls, said, given={"delta_nll": _interval(said, "delta_nll"), "kl": _interval(said, "kl")})


def _interval(said: dict, name: str) -> Interval:
    return Interval(said.get(name), None, said.get(f"{name}_low"), said.get(f"{name}_high"))


@dataclass(frozen=True)
class TopToken:
    """One of the tokens of largest KL: its KL and ΔNLL, its window and position, the text before it, the token and
    the baseline's and the variant's top tokens."""

    kl: float
    delta_nll: float
    window: int
    position: int
    context: str
    target_text: str
    base_top_text: str
    top_text: str

    @classmethod
    def of_record(cls, said: dict) -> TopToken:
        return read_fields(cls, said)


@dataclass(frozen=True)
class WhereSaid:
    """Where in the text a variant loses: how its intervals are taken, every token's figures, by position in the
    window, and with KL by the baseline's confidence (None without KL), by whether it was right, and the tokens
    of largest KL."""

    interval: str
    all: WhereGroup
    by_position: tuple[WhereGroup, ...]
    by_confidence: tuple[WhereGroup, ...] | None
    by_baseline: tuple[WhereGroup, ...] = ()  # none without KL
    top_kl: tuple[TopToken, ...] = ()

    @classmethod
    def of_record(cls, said: dict) -> WhereSaid:
        return read_fields(cls, said, {"all": WhereGroup.of_record, "by_position": _groups, "by_confidence": _groups,
                                       "by_baseline": _groups,
                                       "top_kl": lambda rows: tuple(TopToken.of_record(row) for row in rows)})


def _groups(rows: list[dict]) -> tuple[WhereGroup, ...]:
    return tuple(WhereGroup.of_record(row) for row in rows)


@dataclass(frozen=True)
class ModelSaid:
    """One model's entry of a record.

    Attributes:
        name, role, status, reason: the model's name, ``baseline`` or ``variant``, ``ok`` or ``error`` and why.
        method: its method as its config names it.
        row: its comparison row; ``verdict``: a variant's (None for the baseline).
        domain: in an audit of several domains, its worst (the one its row is of).
        arrays: its per-token Parquet file in the record's folder, where it was scored.
        where: where in the text it loses, where it was found.
        diagnosis: its diagnosis, where one was made; ``problem``: why one asked for was not.
        lineage: where it came from.
        reference: the baseline's: its stored reference (None for a variant, or when it has none).
    """

    name: str
    role: str
    status: str
    reason: str
    method: str
    row: ModelRow
    verdict: Verdict | None
    domain: str | None
    arrays: str | None
    where: WhereSaid | None
    diagnosis: VariantDiagnosis | None
    problem: str | None
    lineage: Lineage
    reference: ReferenceSaid | None

    @classmethod
    def of_record(cls, entry: dict, row: ModelRow, verdict: Verdict | None) -> ModelSaid:
        """Entry ``entry``, whose ``row`` and ``verdict`` were read already (``from_record``)."""
        where, found, reference = entry.get("where"), entry.get("diagnosis") or {}, entry.get("reference")
        diagnosis = VariantDiagnosis.of_record(found) if found and "problem" not in found else None
        return read_fields(cls, entry, given={
            "method": entry["spec"]["method"], "row": row, "verdict": verdict,
            "where": WhereSaid.of_record(where) if where else None, "diagnosis": diagnosis,
            "problem": found.get("problem"), "lineage": Lineage.of_entry(entry),
            "reference": ReferenceSaid.of_record(reference) if reference else None})

    @classmethod
    def alone(cls, entry: dict) -> ModelSaid:
        """An entry read on its own, its row and verdict with it."""
        verdict = entry["verdict"]
        return cls.of_record(entry, ModelRow.of_record(entry["row"]),
                             Verdict.of_record(entry["name"], verdict) if verdict else None)


@dataclass(frozen=True)
class CorpusSaid:
    """The text an audit scored: where from (``source``: a path or ``hf:NAME``, on disk at ``location``), its digest,
    how many tokens and bytes were scored, how BOS was placed, which tokenizer cut it (``transformers`` in a record
    of before #54, which did not say), and a Hugging Face dataset's config and split. The report, the card and
    MLflow read it."""

    source: str
    location: str | None
    digest: str
    n_tokens: int
    n_bytes: int
    bos: str
    tokenizer: str
    hf_config: str | None
    hf_split: str | None

    @classmethod
    def of_record(cls, said: dict) -> CorpusSaid:
        return read_fields(cls, said, given={"tokenizer": said.get("tokenizer", "transformers")})


@dataclass(frozen=True)
class Environment:
    """What ran the audit: the hardware, Python, and the versions of the packages that score."""

    hardware: str
    python: str | None
    versions: Mapping[str, str]

    @classmethod
    def of_record(cls, said: dict) -> Environment:
        return read_fields(cls, said)


@dataclass(frozen=True)
class Floor:
    """A noise floor: its row and the dtype the baseline was scored in."""

    row: ModelRow
    dtype: str

    @classmethod
    def of_record(cls, said: dict) -> Floor:
        return read_fields(cls, said, {"row": ModelRow.of_record})


@dataclass(frozen=True)
class PopulationSaid:
    """Which tokens an audit scored, named (``tasks.audit.population``): its digest and the record's ``population``
    whole (``said``, what ``tasks.record.population.population_line`` reads). The record of an audit of several
    domains names each domain's population (``domains``: its digest, by name) and counts no tokens itself
    (``counted`` false)."""

    digest: str
    counted: bool
    domains: Mapping[str, str | None]
    said: dict

    @classmethod
    def of_record(cls, said: dict) -> PopulationSaid:
        return cls(said["digest"], "tokens" in said, said.get("domains") or {}, said)


def _population(said: dict | None) -> PopulationSaid | None:
    return PopulationSaid.of_record(said) if said else None


@dataclass(frozen=True)
class Written:
    """What the card (``tasks.record.card``) reads of a record that its ``AuditResult`` does not hold, read once: the
    audit's id and when it ended, the config as it recorded it (``config``) and as it was written (its file, its text),
    the baseline's path, the evaluation settings, the corpus, the machine it ran on and its token population.

    A record of any schema: a key kept later than the record reads as None."""

    audit_id: str
    created: str
    config: dict
    config_path: str | None
    config_text: str | None
    environment: dict
    baseline: str | None
    evaluation: EvaluationConfig
    corpus: CorpusSaid
    population: PopulationSaid | None

    @classmethod
    def of_record(cls, record: dict) -> Written:
        config = record["config"]
        return read_fields(cls, record, {"corpus": CorpusSaid.of_record}, {
            "environment": record.get("environment") or {}, "baseline": config["baseline"].get("path"),
            "evaluation": EvaluationConfig.of_record(config["evaluation"]),
            "population": _population(record.get("population"))})


@dataclass(frozen=True)
class RecordSaid:
    """An audit's record as the report and the charts read it.

    Attributes:
        result: what ``from_record`` reads of it: the audit's name, its verdict, each model's row and verdict.
        models: each model's entry, the baseline first.
        audit_id, started, created: the audit's id and when it started (None before it was kept) and ended.
        config_path, config_text: the config's file and its text as written.
        environment: what ran it.
        corpus, evaluation, thresholds, population: what it scored, how, what it demanded, which tokens.
        floor: the noise floors.
        domain: the domain a record is of, for one domain's of an audit of several (``domain_view``).
        domains: each domain's, for an audit of several (none for an audit of one corpus).
    """

    result: AuditResult
    models: tuple[ModelSaid, ...]
    audit_id: str
    started: str | None
    created: str
    config_path: str | None
    config_text: str | None
    environment: Environment
    corpus: CorpusSaid
    evaluation: EvaluationConfig
    thresholds: Thresholds
    population: dict | None
    floor: tuple[Floor, ...]
    domain: str | None
    domains: Mapping[str, RecordSaid]

    @property
    def variants(self) -> tuple[ModelSaid, ...]:
        return tuple(model for model in self.models if model.role == "variant")

    @property
    def population_said(self) -> PopulationSaid | None:
        """Its token population typed (``population``: the record's, whole)."""
        return _population(self.population)

    @classmethod
    def of_record(cls, record: dict) -> RecordSaid:
        result, config = from_record(record), record["config"]
        models = tuple(ModelSaid.of_record(entry, row, verdict) for entry, row, verdict
                       in zip(record["variants"], result.rows, (None, *result.verdicts)))
        return read_fields(cls, record, {"environment": Environment.of_record, "corpus": CorpusSaid.of_record}, {
            "result": result, "models": models, "evaluation": EvaluationConfig.of_record(config["evaluation"]),
            "thresholds": Thresholds.model_validate(config["thresholds"]),
            "floor": tuple(Floor.of_record(floor) for floor in record.get("floor", [])),
            "domains": {name: cls.of_record(domain_view(record, name)) for name in record.get("domains", {})}})
