"""What an audit found, as one typed value built once (``tasks.audit.judge.judge``) that every view reads: the
console's table, ``--by-domain``, ``--stats full`` and ``--json`` (``tasks.record.answer``), the record
(``tasks.record.contents``), tune's claims.

Always keyed by domain: an audit of one corpus is an audit of one domain. Pure Python, no Prefect.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from tasks.record.row import ModelRow
from tasks.record.verdict_said import Verdict

if TYPE_CHECKING:
    from tasks.record.results import VariantResult

_Part = TypeVar("_Part")
_Whole = TypeVar("_Whole")


def _itself(part: _Part) -> _Part:
    return part


@dataclass(frozen=True)
class Naming:
    """How an audit names its domains: each by name (``named``: ``corpora:``), or none, its one corpus's figures
    being the audit's own (``corpus:``). The one place where one corpus and several part: the result, the record,
    the console, MLflow's tags and a plan's parameters ask it (``whole``) rather than which of the two they hold."""

    named: bool

    def whole(self, each: Mapping[str, _Part], several: Callable[[Mapping[str, _Part]], _Whole],
              one: Callable[[_Part], _Whole] = _itself) -> _Whole:
        """What the audit makes of ``each`` domain's part (by name, in the config's order): ``several`` of them all
        where it names its domains; ``one`` of its one domain's part (that part itself, by default) where it names
        none."""
        if self.named:
            return several(each)
        return one(next(iter(each.values())))


@dataclass(frozen=True)
class Findings:
    """What an audit found beyond its figures, by variant: where in the text it loses (``where``,
    ``tasks.audit.where.where_of``), for the variants it was found for, and the diagnosis the audit asked for
    (``diagnoses``, ``diagnose``), or its ``problem``."""

    where: dict[str, dict] = field(default_factory=dict)
    diagnoses: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class DomainResult:
    """One domain scored and judged as its one-corpus audit would be.

    Attributes:
        name: the domain's (``corpora:``'s key; the corpus's for an audit of one).
        results: the models as scored, the baseline first.
        rows: each model's comparison row (``tasks.record.verdict.comparison_row``), the baseline first.
        verdicts: each variant's, in the order of ``rows[1:]``.
        verdict: the domain's.
        table: the domain's table as printed, with the lines under it.
        floor: the noise floor's rows (shown under the baseline, never judged).
        runtime_costs: what llama.cpp's runtime costs a file against its weights in transformers.
        population: which tokens were scored, named (``tasks.audit.population``).
        tokens_differ: where llama.cpp's tokenizer of the served file parts from transformers'.
        findings: where each variant loses in the text, and the diagnoses asked for.
    """

    name: str
    results: tuple[VariantResult, ...]
    rows: tuple[ModelRow, ...]
    verdicts: tuple[Verdict, ...]
    verdict: Verdict
    table: str
    floor: tuple[ModelRow, ...] = ()
    runtime_costs: tuple[dict, ...] = ()
    population: dict | None = None
    tokens_differ: dict | None = None
    findings: Findings = field(default_factory=Findings)


@dataclass(frozen=True)
class AuditResult:
    """An audit's answer: each domain's result, and over them each model's worst domain and the audit's verdict.

    Attributes:
        name: the audit's.
        domains: each domain's result, in the config's order.
        named: whether the audit names its domains (``corpora:``): each is shown and recorded by name; what
            every view asks of it is ``naming``.
        rows: each model's row on its worst domain (its verdict's), the baseline first; in an audit that names its
            domains each holds ``domain``.
        verdicts: each variant's across its domains.
        verdict: the audit's.
        table: one line per model (its worst domain's, in an audit of several), with the lines under it.
        worst: each variant's worst domain, by name.
        record: where the audit's record went (MLflow's run and link, or the spool's folder); "" until recorded.
        mlflow_run_id: the parent run's, when tracked.
    """

    name: str
    domains: Mapping[str, DomainResult]
    named: bool
    rows: tuple[ModelRow, ...]
    verdicts: tuple[Verdict, ...]
    verdict: Verdict
    table: str
    worst: Mapping[str, str]
    record: str = ""
    mlflow_run_id: str | None = None

    @classmethod
    def of_one(cls, name: str, domain: DomainResult) -> AuditResult:
        """The audit ``name`` of one corpus: its one domain's figures and verdicts are the audit's."""
        return cls(name, {domain.name: domain}, False, domain.rows, domain.verdicts, domain.verdict, domain.table,
                   {v.name: domain.name for v in domain.verdicts})

    @property
    def naming(self) -> Naming:
        return Naming(self.named)

    @property
    def shown(self) -> Mapping[str, DomainResult]:
        """The domains shown by name (a title, a table of their own, `` on NAME``): every domain of an audit that names
        them; none of an audit of one corpus, whose one domain's figures are the audit's own, shown without a name."""
        return self.naming.whole(self.domains, dict, _nothing)

    def labelled(self, form: str) -> list[tuple[str, DomainResult]]:
        """Each domain with its name put in ``form`` (``" on {}"``) where domains are shown by name; an audit of one
        corpus, its one domain with "" (its name is never shown)."""
        return [(form.format(name), domain) for name, domain in self.shown.items()] or [
            ("", domain) for domain in self.domains.values()]

    def by_domain_table(self) -> str:
        """Every domain's full table, each under a line naming it and its verdict (``run --by-domain``, the report):
        "" for an audit of one corpus, whose table is its one domain's."""
        return "\n\n".join(f"domain {name}: {domain.verdict.said.upper()} — {domain.verdict.reason}\n{domain.table}"
                           for name, domain in self.shown.items())

    @property
    def passed(self) -> bool:
        """Whether nothing failed: passed, or judged against no limit (which is never said to pass)."""
        return self.verdict.status in ("pass", "ungated")


def _nothing(_: DomainResult) -> Mapping[str, DomainResult]:
    """No domain shown by name: an audit of one corpus's."""
    return {}
