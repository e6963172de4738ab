"""An audit's model card: what a model publisher pastes into a Hugging Face model card, made from the audit's record
alone (no model loaded, no corpus read).

One content in four forms: Markdown (``markdown``: the verdict, a table per corpus, the noise floor, the token
population and how to reproduce it), the model card's metadata (``model_index``: Hugging Face's ``model-index`` as the
YAML front matter of a README.md, in the shape ``huggingface_hub``'s ``EvalResult`` reads and writes back unchanged),
the Hub's ``.eval_results/`` files (``eval_results``: one per corpus read from a Hub dataset, in the shape
``huggingface_hub``'s ``EvalResultEntry`` reads and writes back unchanged) and plain data (``card_json``). Tracking logs the record and the three forms on every audit's parent run
(``log_card``), so that ``ppl-audit card`` needs nothing but the tracking server.

The record is read once, at the boundary (``Audit.of``): as the ``AuditResult`` it was written from
(``tasks.record.serial.from_record``: always keyed by domain, each model's row the typed ``ModelRow`` and each
variant's ``Verdict``), so that every figure the card gives comes from the value every other view reads; what the
card needs beside it (the config as written, each stream's corpus, ...) by ``Written``.

The figures are the console table's (``tasks.record.verdict.format_table``), to the digit: a card that said +1.2%
where the audit's own table said +1.19% would be a second, unchecked account of one measurement. The intervals of KL
and top-1, which the console leaves out for width, are given in their figures' precision; a KL, and each end of its
interval, as every view gives it (``tasks.record.floor.kl_text``: two significant digits where four decimals would
print 0.0000).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path

import yaml

from tasks.config import ONE_CORPUS
from tasks.record.domain_view_said import domain_view
from tasks.record.entry_said import CorpusSaid, PopulationSaid, Written
from tasks.record.figures import GATED, SHOWN, Text, fixed, kl_text
from tasks.record.floor_said import FloorJudgement
from tasks.record.logged import RECORD
from tasks.record.result import AuditResult, DomainResult
from tasks.record.row import Interval, ModelRow
from tasks.record.serial import from_record
from tasks.record.spool import record_json
from tasks.record.verdict_said import Verdict, said as said_as

FORMATS = ("md", "model-index", "json", "eval-results")
EVAL_RESULTS = ".eval_results"  # the folder of a model's repo the Hub reads these files from
ARTIFACTS = {"md": "card/card.md", "model-index": "card/model-index.yaml", "json": "card/card.json"}
SOURCE = "ppl-audit"  # the model index's source.name: who measured (the Hub shows it beside each result)
TASK = {"type": "text-generation", "name": "Text Generation"}
# a row's own figures the card carries bare (no interval), each as the console table writes it
OWN = {"bits_per_weight": fixed(".2f"), "weight_mib": fixed(".0f"), "ppl": fixed(".4f")}
ENDS = ("", "_low", "_high")  # a gated figure's keys in the card's data: its value and its interval's ends
# a row's figures as the card carries them: the console table's, and the intervals of KL and top-1 it leaves out
CARD_FIGURES = (*OWN, *(figure.key + end for figure in GATED for end in ENDS))
COLUMNS = ("variant", "method", "bpw", "MiB", "PPL", *(figure.header for figure in GATED), "verdict", "floor")
PPL = fixed(".4f")  # perplexity, as the console and the model index give it


def _number(value) -> float | None:
    """A figure as the card gives it: a finite number, else None (not measured, or NaN, which JSON cannot hold)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _form(value: float | None, text: Text) -> str | None:
    return None if value is None else text(value)


@dataclass(frozen=True)
class CardFigure:
    """A figure as the card gives it: its value and the ends of its 95% interval, each None where not measured."""

    value: float | None
    low: float | None = None
    high: float | None = None

    @classmethod
    def of(cls, figure: Interval | None) -> CardFigure:
        if figure is None:
            return cls(None)
        return cls(_number(figure.value), _number(figure.low), _number(figure.high))

    def ends(self, text: Text) -> tuple[str, str] | None:
        """Its interval's ends as ``text`` writes them; None without both."""
        low, high = _form(self.low, text), _form(self.high, text)
        return (low, high) if low is not None and high is not None else None

    def text(self, text: Text, unit: str = "") -> str:
        """The figure and its 95% interval, each as ``text`` writes it, or a dash where it was not measured."""
        if self.value is None:
            return "—"
        ends = self.ends(text)
        return f"{text(self.value)}{unit}" + (" [{}, {}]".format(*ends) if ends else "")


def own(row: ModelRow, key: str) -> float | None:
    """One of the row's own figures (``OWN``): None where it was not measured."""
    return _number(getattr(row.measured, key)) if row.measured else None


def gated(row: ModelRow, key: str) -> CardFigure:
    """A gated figure of the row (``GATED``'s ``key``) with its interval."""
    return CardFigure.of(row.figure(key))


def figure_data(row: ModelRow) -> dict[str, float | None]:
    """The row's figures as plain data, under ``CARD_FIGURES``' keys: None where not measured."""
    return {key: own(row, key) for key in OWN} | {
        figure.key + end: value for figure in GATED for end, value in zip(ENDS, astuple(gated(row, figure.key)))}


@dataclass(frozen=True)
class Model:
    """A model of a token stream as the card reads it: its row, and a variant's verdict (None for the baseline, which
    is not judged)."""

    row: ModelRow
    judged: Verdict | None = None

    @property
    def name(self) -> str:
        return self.row.variant

    @property
    def role(self) -> str:
        return "baseline" if self.judged is None else "variant"

    @property
    def status(self) -> str:
        return self.row.status

    @property
    def verdict(self) -> str:
        """As its colour and label say it (``tasks.record.plots.verdict_of``): ``baseline``, ``pass``, ``fail``,
        ``ungated`` or ``error`` (a baseline that was not scored is an error)."""
        if self.judged is None:
            return "baseline" if self.row.ok else "error"
        return self.judged.status or "error"

    @property
    def reason(self) -> str | None:
        """Why its verdict (a variant's), else why it was not scored; None where nothing says."""
        return (self.judged and self.judged.reason) or self.row.reason or None

    @property
    def method(self) -> str | None:
        return self.row.method

    @property
    def domain(self) -> str | None:
        """In an audit of several domains, the domain its figures are of (its worst)."""
        return self.row.domain

    @property
    def floor_said(self) -> str | None:
        """What the noise floor says of it; None in an audit without a floor."""
        return self.row.floor.said if self.row.floor else None

    @property
    def llama_cpp(self) -> str | None:
        """Run by llama.cpp: the settings that ran, which move figures."""
        return self.row.measured.llama_cpp if self.row.measured else None


def models(rows: tuple[ModelRow, ...], verdicts: tuple[Verdict, ...]) -> tuple[Model, ...]:
    """The models of ``rows`` (the baseline first), each variant with its verdict (``verdicts``: in ``rows[1:]``'
    order)."""
    return tuple(Model(row, judged) for row, judged in zip(rows, (None, *verdicts)))


def floor_status(floor: ModelRow) -> str:
    """A noise floor's row's status: ``ok`` for a row that says none (it was scored)."""
    return floor.status or "ok"


def stream_records(record: dict) -> dict[str, dict]:
    """Each token stream's record as its one-corpus audit's, by the name ``AuditResult.domains`` gives it: each domain
    of an audit of several (``domain_view``), or the record of an audit of one corpus itself (``ONE_CORPUS``)."""
    return {name: domain_view(record, name) for name in record.get("domains", {})} or {ONE_CORPUS: record}


@dataclass(frozen=True)
class Section:
    """One token stream of the audit: its domain's result, named in an audit of several domains (``domain``; None
    for an audit of one corpus, whose corpus names it), with what the card reads of its record (``written``)."""

    domain: str | None
    result: DomainResult
    written: Written

    @property
    def corpus(self) -> CorpusSaid:
        return self.written.corpus

    @property
    def source(self) -> str:
        return self.corpus.source

    @property
    def verdict(self) -> Verdict:
        return self.result.verdict

    @property
    def models(self) -> tuple[Model, ...]:
        return models(self.result.rows, self.result.verdicts)

    @property
    def floors(self) -> tuple[ModelRow, ...]:
        """Its noise floors' rows: the baseline in a 16-bit dtype (``floor_of``) against its float32 self."""
        return self.result.floor


@dataclass(frozen=True)
class Recipe:
    """How to run the audit again: the command, the config file's name and text, and the versions and machine it ran
    with."""

    command: str
    config_file: str
    config: str
    environment: dict


def reproduce(record: dict) -> dict:
    """How to run the audit again (``Recipe``) as plain data."""
    return asdict(_recipe(from_record(record).name, Written.of_record(record)))


def _recipe(name: str, written: Written) -> Recipe:
    """The config as it was written (the config as the audit read it, for a record without its text)."""
    config = written.config_text or yaml.safe_dump(written.config, sort_keys=False, allow_unicode=True)
    file = Path(written.config_path or f"{name}.yaml").name
    return Recipe(f"ppl-audit run {file}", file, config, written.environment)


@dataclass(frozen=True)
class Audit:
    """An audit's record as the card reads it, once: its result (``tasks.record.serial.from_record``), what the
    record holds beside it (``written``), and its token streams (in an audit of one corpus, its one)."""

    result: AuditResult
    written: Written
    sections: tuple[Section, ...]

    @classmethod
    def of(cls, record: dict) -> Audit:
        result, streams = from_record(record), stream_records(record)
        several = result.named
        return cls(result, Written.of_record(record),
                   tuple(Section(name if several else None, domain, Written.of_record(streams[name]))
                         for name, domain in result.domains.items()))

    @property
    def name(self) -> str:
        return self.result.name

    @property
    def several(self) -> bool:
        """Whether the audit names its domains (``corpora:``): each is shown by name."""
        return self.result.named

    @property
    def population(self) -> PopulationSaid | None:
        """In an audit of several domains, their token populations, named (one corpus's is its section's)."""
        return self.written.population if self.several else None

    @property
    def models(self) -> tuple[Model, ...]:
        """Each model's figures on the whole audit (in an audit of several domains: its worst domain's)."""
        return models(self.result.rows, self.result.verdicts)

    @property
    def variants(self) -> list[Model]:
        return [model for model in self.models if model.role == "variant"]

    @property
    def baseline_name(self) -> str:
        return next((model.name for model in self.models if model.role == "baseline"), "baseline")

    @property
    def recipe(self) -> Recipe:
        return _recipe(self.name, self.written)


def card_row(model: Model) -> dict:
    """A model's row of one token stream as plain data: its figures (None where not measured), its verdict and why,
    and what the noise floor says of it (its row's ``floor``, None in an audit without a floor)."""
    floor, further = model.row.floor, model.row.shown()
    return {"variant": model.name, "role": model.role, "method": model.method, "status": model.status,
            **figure_data(model.row), "verdict": model.verdict, "reason": model.reason,
            "floor": {key: getattr(floor, key) for key in ("dtype", "kld", "above", "said")} if floor else None} | (
        {"further": {figure.key: asdict(CardFigure.of(found)) for figure, found in further}} if further else {})


# the noise floor's figures with an interval as the console writes them: ΔPPL to two decimals, KL as every view does
DELTA, KL = fixed("+z.2f"), kl_text


def floor_cell(floor: FloorJudgement | None) -> str:
    """The table's floor column: ``above`` (lost more than the floor's numerics, beyond noise), ``within DTYPE``,
    ``not judged`` (one window), blank in an audit without a floor."""
    if not floor:
        return ""
    return {True: "above", False: f"within {floor.dtype}"}.get(floor.above, "not judged")


def cells(model: Model) -> list[str]:
    """A model's Markdown cells, in ``COLUMNS``' order; the figures as ``format_table`` prints them."""
    verdict = "baseline" if model.verdict == "baseline" else said_as(model.verdict).upper()
    return [model.name, model.method or "—", *(_form(own(model.row, key), text) or "—" for key, text in OWN.items()),
            *(gated(model.row, figure.key).text(figure.shown, figure.shown_unit) for figure in GATED), verdict,
            floor_cell(model.row.floor)]


def floor_cells(floor: ModelRow) -> list[str]:
    """A noise floor's Markdown cells: its ΔPPL and KL with their intervals, or why it was not measured."""
    if floor_status(floor) != "ok":
        return [floor.variant, floor.floor_of or "—", f"not measured: {floor.reason or None}", "—"]
    return [floor.variant, floor.floor_of or "—", gated(floor, "delta_ppl_pct").text(DELTA),
            gated(floor, "kld_mean").text(KL)]


def _cell(text: str) -> str:
    """Text that stays in its Markdown table cell: a pipe would end it, a line break the row."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: tuple[str, ...] | list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in body]


def floor_data(floor: ModelRow) -> dict:
    """A noise floor's row as plain data: its figures (None where not measured), or why it was not measured."""
    return {"name": floor.variant, "dtype": floor.floor_of, "status": floor_status(floor), "reason": floor.reason or None,
            **figure_data(floor)}


def population_in(section: Section) -> dict:
    """Which tokens were scored: the record's token population (its digest names them), or for a record from before
    the population was digested, the same facts from its corpus and settings (``digest`` None)."""
    if section.result.population:
        return dict(section.result.population)
    corpus, settings = section.corpus, section.written.evaluation
    return {"digest": None, "tokens": corpus.n_tokens, "tokenizer": corpus.tokenizer, "text": corpus.digest,
            "window": settings.window, "stride": settings.stride, "mode": settings.mode, "bos": corpus.bos,
            "max_tokens": settings.max_tokens}


def population_text(found: dict) -> str:
    """The token population in one sentence of Markdown."""
    digest, tokens = found.get("digest"), found.get("tokens")
    named = f"Token population `{digest}`" if digest else "Tokens (a record from before token population digests)"
    tokens = f"{tokens:,}" if isinstance(tokens, int) else "?"
    how = f", stride {found.get('stride')}" if found.get("mode", "sliding") == "sliding" else ""
    return (f"{named}: {tokens} tokens of the text `{found.get('text')}`, tokenizer `{found.get('tokenizer')}`, "
            f"window {found.get('window')}{how}, mode {found.get('mode')}, BOS {found.get('bos')}, "
            f"max_tokens {found.get('max_tokens') or 'all'}.")


def _plain(value):
    """``value`` as strict JSON holds it: a number that is not finite becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def card_data(record: dict, source_url: str, model_id: str | None = None) -> dict:
    """The card as plain data: the verdict, each token stream's rows, floor and population, each variant's verdict
    across the audit, how to reproduce it, and the model index. ``source_url``: where the record is
    (``source_url``)."""
    audit = Audit.of(record)
    written = audit.written
    return _plain({
        "name": audit.name, "audit_id": written.audit_id, "created": written.created, "baseline": written.baseline,
        "source_url": source_url, "verdict": audit.result.verdict.as_record(),
        "population": audit.population.said if audit.population else None,  # the domains' populations, named
        "sections": [{"domain": section.domain, "source": section.source, "verdict": section.verdict.as_record(),
                      "rows": [card_row(model) for model in section.models],
                      "floor": [floor_data(floor) for floor in section.floors], "population": population_in(section)}
                     for section in audit.sections],
        "variants": [card_verdict(model) for model in audit.variants],
        "reproduce": asdict(audit.recipe),
        "model-index": _model_index(audit, source_url, model_id),
    })


def card_verdict(model: Model) -> dict:
    """A variant's verdict on the whole audit and why, what the noise floor says of it (in an audit of several
    domains: on its worst domain, named), and the settings llama.cpp ran it with (which move figures)."""
    return {"variant": model.name, "verdict": model.verdict, "domain": model.domain, "reason": model.reason,
            "floor": model.floor_said, "llama_cpp": model.llama_cpp}


def source_url(page: str | None, run_id: str) -> str:
    """Where the card's figures come from, for the model index's ``source.url`` (the Hub wants one with a source's
    name): the audit's run page on a tracking server, else the run as MLflow names it (a local store has no page a
    reader could open)."""
    return page or f"runs:/{run_id}"


@dataclass(frozen=True)
class Dataset:
    """The model index's dataset of a token stream: its name, its type (a Hub dataset's id), a Hub dataset's config
    and split."""

    name: str
    type: str
    config: str | None = None
    split: str | None = None

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        """What the Hub keys a result by (with its task)."""
        return self.type, self.config, self.split

    def data(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


def _dataset(section: Section) -> Dataset:
    """A token stream's dataset: its domain's name (a one-corpus audit: the corpus's), its source as the type (a Hub
    dataset's id), a Hub dataset's config and split."""
    source = section.source
    if source.startswith("hf:"):
        return Dataset(section.domain or source[3:], source[3:], section.corpus.hf_config,
                       section.corpus.hf_split)
    return Dataset(section.domain or Path(source).name or source, source)


@dataclass(frozen=True)
class Metric:
    """A figure of the model index: its type, its value as the console prints it, and its name (which model, which
    figure, its interval); self-reported, so not verified by the Hub."""

    type: str
    value: float
    name: str

    def data(self) -> dict:
        return {"type": self.type, "value": self.value, "name": self.name, "verified": False}


def _metrics(section: Section, baseline: str) -> list[Metric]:
    """Each model's perplexity, and each variant's ΔPPL %, mean KL and top-1 agreement against the baseline, rounded
    as the console prints them (the intervals in the names)."""
    metrics = []
    for model in section.models:
        figures = [("perplexity", CardFigure(own(model.row, "ppl")), PPL, f"{model.name} perplexity")]
        if model.role == "variant":
            figures += [(figure.card[0], gated(model.row, figure.key), figure.shown,
                         f"{model.name} {figure.card[1]} {baseline}") for figure in GATED]
        for kind, shown, text, said in figures:
            if shown.value is None:
                continue
            ends = shown.ends(text)
            said += " [95% CI {}, {}]".format(*ends) if ends else ""
            metrics.append(Metric(kind, float(text(shown.value)), said))
    return metrics


def model_index(record: dict, source_url: str, model_id: str | None = None) -> list[dict]:
    """Hugging Face's ``model-index`` of the audit: one result per token stream (task text-generation, the stream's
    dataset, every model's figures), as ``huggingface_hub.repocard_data.eval_results_to_model_index`` writes it, so
    that reading it into ``EvalResult``s and writing them back gives it unchanged. The Hub keys results by task,
    dataset type, config and split, not by name: where two domains read one source, each has its name as config.
    ``model_id``: the Hub model the results are of, its name (default: the audit's)."""
    return _model_index(Audit.of(record), source_url, model_id)


def _model_index(audit: Audit, source_url: str, model_id: str | None) -> list[dict]:
    baseline = audit.baseline_name
    results, seen = [], set()
    for section in audit.sections:
        metrics = _metrics(section, baseline)
        if not metrics:  # nothing scored on it: the Hub's reader would drop it
            continue
        dataset = _dataset(section)
        data = dataset.data()
        if dataset.key in seen:
            dataset = replace(dataset, config=section.domain)
            data |= {"config": section.domain}  # in place where it has a config, else after the others
        seen.add(dataset.key)
        results.append({"task": dict(TASK), "dataset": data, "metrics": [metric.data() for metric in metrics],
                        "source": {"name": SOURCE, "url": source_url}})
    return [{"name": model_id or audit.name, "results": results}] if results else []


def model_index_yaml(record: dict, source_url: str, model_id: str | None = None) -> str:
    """The model index as a README.md's YAML front matter (``---`` above and below): what
    ``huggingface_hub.repocard.metadata_load`` and ``ModelCard.load`` read."""
    text = _yaml({"model-index": model_index(record, source_url, model_id)})
    return f"---\n{text}---\n"


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def card_json(record: dict, source_url: str, model_id: str | None = None) -> str:
    return json.dumps(card_data(record, source_url, model_id), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


@dataclass(frozen=True)
class EvalResults:
    """The Hub's ``.eval_results/`` files of an audit (``audit``: its name): each file's entries by its name
    (``prose.yaml``), and the token streams left out, by name, with their source (a local file or an embedded text:
    the Hub keys a result by the Hub dataset it is on)."""

    audit: str
    files: dict[str, list[dict]]
    left_out: dict[str, str]


def eval_results(record: dict, source_url: str) -> EvalResults:
    """The audit's ``.eval_results/`` files (huggingface/community-evals; the Hub's ``eval_results.yaml``
    specification), as ``huggingface_hub``'s ``eval_result_entries_to_yaml`` writes them: one per token stream read
    from a Hub dataset, named for its domain (a one-corpus audit: for the dataset), holding an entry per figure of the
    model index's result on it. Each entry: ``dataset.id`` the dataset, ``dataset.task_id`` its config (``default``
    without one), ``value`` the figure as the model index has it, ``date`` when the audit ended, ``notes`` the model
    index's metric name (which model, which figure, its interval), and ``source`` the run's page where there is one
    (``runs:/ID`` of a local store is no link)."""
    audit = Audit.of(record)
    source = {"source": {"url": source_url, "name": SOURCE}} if source_url.startswith(("http://", "https://")) else {}
    files, left_out = {}, {}
    for section in audit.sections:
        dataset = section.source.removeprefix("hf:")
        name = section.domain or dataset.rsplit("/", 1)[-1]
        if not section.source.startswith("hf:"):
            left_out[name] = section.source
            continue
        entries = [{"dataset": {"id": dataset, "task_id": section.corpus.hf_config or "default"},
                    "value": metric.value, "date": audit.written.created, **source, "notes": metric.name}
                   for metric in _metrics(section, audit.baseline_name)]
        if entries:
            files[f"{name}.yaml"] = entries
    return EvalResults(audit.name, files, left_out)


def eval_results_file(entries: list[dict]) -> str:
    """One ``.eval_results/`` file's text: its entries as a YAML list."""
    return _yaml(entries)


def eval_results_text(found: EvalResults) -> str:
    """The ``.eval_results/`` files one after another as YAML documents, each headed by its name as a comment."""
    return "---\n".join(f"# {EVAL_RESULTS}/{name}\n{eval_results_file(entries)}" for name, entries in found.files.items())


def _section_lines(section: Section, several: bool) -> list[str]:
    """One token stream's part of the Markdown card: its table, its noise floor and its token population."""
    said = section.verdict.said.upper()
    lines = [f"### Domain `{section.domain}` ({section.source}): {said}" if several
             else f"### Results on `{section.source}`", ""]
    # an audit without a noise floor has nothing to say in its column: left out rather than blank in every row
    floored = section.floors or any(model.row.floor for model in section.models)
    shown = len(COLUMNS) if floored else len(COLUMNS) - 1
    lines += _table(COLUMNS[:shown], [cells(model)[:shown] for model in section.models])
    if section.floors:
        lines += ["", "Noise floor: the baseline in each dtype against its float32 self, on the same tokens (a variant "
                      "*within* a floor lost no more than those numerics do):", ""]
        lines += _table(("floor", "dtype", "ΔPPL % [95% CI]", "KL [95% CI]"),
                        [floor_cells(floor) for floor in section.floors])
    return lines + _further_lines(section) + ["", population_text(population_in(section)), ""]


def _further_lines(section: Section) -> list[str]:
    """The per-model figures shown beside the gated ones (``tasks.record.figures.SHOWN``) that this stream's variants
    measured: a table of them with their intervals, and what each is."""
    measured = [figure for figure in SHOWN if any(model.row.figure(figure.key) for model in section.models)]
    if not measured:
        return []
    body = [[model.name, *(CardFigure.of(model.row.figure(figure.key)).text(figure.shown, figure.unit)
                           for figure in measured)] for model in section.models if model.role == "variant"]
    return ["", "Further figures, each with its 95% interval over windows:", "",
            *_table(("variant", *(figure.name for figure in measured)), body), "",
            *(f"- {figure.name}: {figure.about}" for figure in measured)]


def _why(model: Model) -> str:
    """A variant's line under "Why each verdict"."""
    return (f"- **{model.name}**: {said_as(model.verdict).upper()}" + (f": {model.reason}" if model.reason else "")
            + (f"; {model.floor_said}" if model.floor_said else "")
            + (f"; llama.cpp: {model.llama_cpp}" if model.llama_cpp else ""))


def markdown(record: dict, source_url: str) -> str:
    """The card in Markdown, under a second-level heading (the model card has its own title)."""
    audit = Audit.of(record)
    streams, written, verdict = audit.sections, audit.written, audit.result.verdict
    on = (f"{len(streams)} domains ({', '.join(s.domain for s in streams)}), each its own token stream, a variant's "
          "verdict its worst domain's" if audit.several else f"`{streams[0].source}`")
    lines = [f"## Perplexity audit: {audit.name}", "",
             f"**Verdict: {verdict.said.upper()}.** {verdict.reason}", "",
             f"Audited {written.created[:19].replace('T', ' ')} UTC with ppl-audit: the baseline "
             f"`{written.baseline}` and {len(audit.variants)} variant(s) scored on the same tokens of "
             f"{on}. ΔPPL, KL and top-1 agreement are taken against the baseline, with paired 95% intervals over "
             f"windows; a variant passes when the pessimistic end of each interval is within its limit. "
             f"Record: `{source_url}` (audit `{written.audit_id}`).", ""]
    population = audit.population
    if population and population.digest:
        named = ", ".join(f"{name} `{digest}`" for name, digest in population.domains.items())
        lines += [f"Token populations `{population.digest}`: {named}.", ""]
    for section in streams:
        lines += _section_lines(section, audit.several)
    lines += ["### Why each verdict", ""]
    lines += [_why(model) for model in audit.variants]
    again = audit.recipe
    environment = again.environment
    versions = ", ".join(f"{name} {version}" for name, version in (environment.get("versions") or {}).items())
    lines += ["", "### How to reproduce", "", "With ppl-audit installed and the models and corpora at the config's "
              "paths:", "", "```bash", again.command, "```", "", f"`{again.config_file}`:", "", "```yaml",
              again.config.rstrip("\n"), "```", "",
              f"Ran on {environment.get('hardware', 'an unrecorded machine')}, Python "
              f"{environment.get('python', '?')}" + (f"; {versions}." if versions else "."), ""]
    return "\n".join(lines)


def render(record: dict, form: str, source_url: str, model_id: str | None = None) -> str:
    """The card in ``form`` (one of ``FORMATS``); ``model_id``: the Hub model the results are of, the model index's
    name (default: the audit's)."""
    if form == "md":
        return markdown(record, source_url)
    if form == "eval-results":
        return eval_results_text(eval_results(record, source_url))
    return {"model-index": model_index_yaml, "json": card_json}[form](record, source_url, model_id)


def log_card(client, run_id: str, record: dict, page: str | None) -> None:
    """Log the audit's record (``record.json``, as the spool writes it) and its card in every form (``card/``) to its
    parent run ``run_id``; ``page``: the run's page in the tracking server's UI, None for a local store."""
    client.log_text(run_id, record_json(record), RECORD)
    for form, name in ARTIFACTS.items():
        client.log_text(run_id, render(record, form, source_url(page, run_id)), name)
