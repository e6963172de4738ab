"""Every audit of one baseline, read back from MLflow: the rows ``ppl-audit compare`` prints and charts, which of them
another beats, and which moved since the previous scheduled run of the same variant.

Audits are comparable when their baseline scored the same tokens the same way: the same model files, tokenizer,
token stream, window, stride, BOS and dtype (``tasks.audit.reference.baseline_key``; the reference's own key adds the
library versions, which change with every upgrade while the audits stay comparable). Each audit's parent run carries
that key as a tag. An audit of several corpora (domains) names each domain's key on its parent run
(``ppl_audit.domain_keys``, ``NAME=KEY`` pairs) and each domain's figures on its variants' runs (``METRIC.NAME``): a
domain of such an audit and a one-corpus audit of the same text are one history.

Dominance across audits: within one audit a variant's dominator is the audit's own, decided on the paired
per-token differences (``tasks.record.dominance``). Two variants of different audits were scored in different runs,
so their difference is judged on their own intervals: worse beyond noise when the two 95% intervals (ΔPPL, and mean
KL where both have it) do not overlap, a stricter test than the paired one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tasks.core import console
from tasks.core.errors import InputError
from tasks.record.dominance import no_larger
from tasks.record.logged import RECORD, Records
from tasks.record.tags import (BASELINE_KEY, COMPLETE, DOMAIN, DOMAIN_KEYS, DOMAIN_POPULATIONS, DOMAIN_REFERENCES,
                               DOMAINS, DOMINATED_BY, POPULATION, REFERENCE, SCHEDULED)
from tasks.record.plots import (COLOURS, ERROR_COLOUR, FRONT_HANDLES, PAST_COLOUR, SizePoint, measured,
                                size_quality_figure, titled)
from tasks.record.verdict_said import said as said_as

NAN = math.nan


@dataclass
class Audited:
    """One variant of one audit, as its MLflow runs hold it."""

    name: str
    method: str
    audit: str  # the audit's name (its config's)
    run_id: str
    parent_run_id: str
    started: datetime
    scheduled: bool
    verdict: str
    delta_ppl_pct: float
    delta_ppl_pct_low: float
    delta_ppl_pct_high: float
    kld_mean: float
    kld_mean_low: float
    kld_mean_high: float
    bpw: float
    mib: float
    kv_bytes_per_token: float
    own_dominator: str | None  # within its own audit (paired)
    domain: str | None = None  # the domain of an audit of several corpora whose figures these are; None: one corpus
    population: str | None = None  # the digest of the tokens scored (tasks.audit.population); None: not recorded
    dominated_by: str | None = None
    changed: str | None = None
    past: bool = False  # not of the newest audit
    link: str | None = field(default=None, repr=False)

    def json(self) -> dict:
        """The row as JSON values: NaN is null, the date ISO 8601."""
        values = asdict(self) | {"started": self.started.isoformat()}
        values.pop("own_dominator")
        return {key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in values.items()}


def _all_runs(client, experiment_id: str, where: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=where, max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _pairs(said: str) -> dict[str, str]:
    """A tag of ``NAME=KEY`` pairs, space-separated, as {NAME: KEY}."""
    return dict(pair.partition("=")[::2] for pair in said.split() if "=" in pair)


def _audits(client, experiment_id: str, key: str, also: str | None) -> list[tuple]:
    """The parent runs of the complete audits (and of the one ``also`` names) whose baseline has ``key``: a baseline
    key or a reference key, each with the domain whose key it is (None: an audit of one corpus). Each names the other
    on the runs that have both, so the search follows them: a baseline key finds the references made of it (one per
    environment), and through them the audits from before baseline keys were tagged; all of one baseline, as a
    reference's key digests the baseline key's facts and more."""
    found, keys, searched = {}, {key}, set()
    while keys - searched:
        named = (keys - searched).pop()
        searched.add(named)
        for tag in (BASELINE_KEY, REFERENCE):
            for run in _all_runs(client, experiment_id, f"tags.`ppl_audit.kind` = 'audit' and tags.`{tag}` = '{named}'"):
                if DOMAINS in run.data.tags:  # its unsuffixed figures are its worst domains', not this key's text's
                    continue
                found[(run.info.run_id, None)] = run
                keys |= {run.data.tags[tag] for tag in (BASELINE_KEY, REFERENCE) if tag in run.data.tags}
        for tag in (DOMAIN_KEYS, DOMAIN_REFERENCES):
            # LIKE narrows the search; the pairs, read exactly, decide (a key may begin another)
            for run in _all_runs(client, experiment_id, f"tags.`ppl_audit.kind` = 'audit' and "
                                                        f"tags.`{tag}` LIKE '%={named}%'"):
                own = [_pairs(run.data.tags.get(each, "")) for each in (DOMAIN_KEYS, DOMAIN_REFERENCES)]
                for domain in set(own[0]) | set(own[1]):
                    if named in (own[0].get(domain), own[1].get(domain)):
                        found[(run.info.run_id, domain)] = run
                        keys |= {mine[domain] for mine in own if domain in mine}
    return [(run, domain) for (run_id, domain), run in found.items()
            if run.data.tags.get(COMPLETE) == "true" or run_id == also]


def _figure(run, key: str, domain: str | None = None) -> float:
    return float(run.data.metrics.get(key if domain is None else f"{key}.{domain}", NAN))


def _domain_tag(tags: dict, tag: str, domain: str | None, unknown: str | None) -> str | None:
    """A variant's tag on ``domain``: its own (``TAG.DOMAIN``) when logged, else the run's when the domain is the
    variant's worst (its verdict and figures across domains are that domain's), else ``unknown``."""
    if domain is None:
        return tags.get(tag)
    if f"{tag}.{domain}" in tags:
        return tags[f"{tag}.{domain}"]
    return tags.get(tag) if tags.get(DOMAIN) == domain else unknown


def _method(params: dict) -> str:
    """A model's method as its audit's table said it (``label``: "gptq 4-bit g32 tuned"), or, of a run logged before
    the label was, its method."""
    return params.get("label") or params.get("method", "?")


def _row(child, parent, domain: str | None = None) -> Audited:
    """``child``'s row: its figures on ``domain`` in an audit of several corpora (its sizes are the model's own)."""
    tags = child.data.tags
    return Audited(
        name=tags.get("ppl_audit.variant", child.info.run_name), method=_method(child.data.params),
        audit=parent.data.tags.get("ppl_audit.audit", "?"), run_id=child.info.run_id, parent_run_id=parent.info.run_id,
        started=datetime.fromtimestamp(parent.info.start_time / 1000, timezone.utc),
        scheduled=parent.data.tags.get(SCHEDULED) == "true", verdict=_domain_tag(tags, "audit.verdict", domain, "?"),
        **{key: _figure(child, key, domain) for key in ("delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high",
                                                         "kld_mean", "kld_mean_low", "kld_mean_high")},
        bpw=_figure(child, "bits_per_weight"), kv_bytes_per_token=_figure(child, "kv_bytes_per_token"),
        mib=_figure(child, "weight_memory_bytes") / 2**20,
        own_dominator=_domain_tag(tags, DOMINATED_BY, domain, None), domain=domain,
        population=population_of(parent, domain))


def population_of(parent, domain: str | None = None) -> str | None:
    """The token population an audit's parent run names for its one corpus, or for ``domain`` of several."""
    tags = parent.data.tags
    return tags.get(POPULATION) if domain is None else _pairs(tags.get(DOMAIN_POPULATIONS, "")).get(domain)


def populations_of(parent) -> dict[str | None, str | None]:
    """Each token stream of an audit's parent run and its population: ``{None: digest}`` for one corpus, ``{DOMAIN:
    digest}`` for several (None where it was recorded before populations were named)."""
    domains = parent.data.tags.get(DOMAINS)
    return {None: population_of(parent)} if not domains else {d: population_of(parent, d) for d in domains.split()}


def scored_alike(parents: list) -> bool:
    """Whether the audits of ``parents`` (parent runs) all name the same token populations, none of them unnamed: then
    their figures are comparable side by side, ``--any-tokens`` or not."""
    named = [populations_of(parent) for parent in parents]
    return None not in {digest for found in named for digest in found.values()} and \
        len({frozenset(found.items()) for found in named}) == 1


def audits_side_by_side(records: Records, parents: list, any_tokens: bool) -> dict[str | None, list[Audited]]:
    """The variants of the audits ``parents`` (parent runs) set side by side, by token population: every population
    that all of them scored gets one table (by its digest; a stream only some of them scored is left out). Audits
    that scored no tokens in common are refused in one line naming what differs, unless ``any_tokens``: then all of
    their variants make one table (under None), each audit labelled with its population."""
    units = {parent.info.run_id: populations_of(parent) for parent in parents}
    shared = None if any_tokens else _same_tokens(parents, units)
    tables: dict[str | None, list[Audited]] = {}
    for parent in parents:
        children = _variant_runs(records.client, parent.info.experiment_id, parent.info.run_id)
        for domain, digest in units[parent.info.run_id].items():
            if shared is not None and digest not in shared:  # a stream only some of them scored
                continue
            rows = _checked(records, parent, [_row(child, parent, domain) for child in children], refuse=True)
            if any_tokens:
                for row in rows:
                    row.audit = f"{row.audit}@{(digest or 'unnamed')[:8]}"
            tables.setdefault(None if any_tokens else digest, []).extend(rows)
    for rows in tables.values():
        _newest_first(rows)
    return tables


def _same_tokens(parents: list, units: dict[str, dict]) -> set[str]:
    """The token populations every one of the audits scored; refused, in one line, where they share none (or one of
    them names none)."""
    first = parents[0]
    for parent in parents:
        unnamed = [domain or "its corpus" for domain, digest in units[parent.info.run_id].items() if digest is None]
        if unnamed:
            raise InputError(f"audit run {parent.info.run_id} was recorded before token populations were named, so "
                             "nothing shows it scored the same tokens as the others; run it again, or give --any-tokens "
                             "to set them side by side anyway")
    mine = set(units[first.info.run_id].values())
    for parent in parents[1:]:
        theirs = set(units[parent.info.run_id].values())
        if not theirs & mine:
            why = _differs(first, parent)
            raise InputError(f"audits {first.info.run_id[:8]} ({_named(first)}) and {parent.info.run_id[:8]} "
                             f"({_named(parent)}) scored different tokens (token populations "
                             f"{', '.join(sorted(d[:8] for d in mine))} against {', '.join(sorted(d[:8] for d in theirs))}"
                             f"{': ' + why if why else ''}): their figures are not comparable side by side; give "
                             "--any-tokens to set them side by side anyway")
        mine &= theirs
    return mine


# what decides the tokens an audit scored, among its parent run's params (tracking._audit_params)
TOKEN_PARAMS = ("corpus.source", "corpus.digest", "corpus.tokens", "corpus.tokenizer", "max_tokens", "window", "stride",
                "bos")


def _differs(a, b) -> str:
    """Which of the params that decide the tokens two audits' parent runs differ in: ``window 256 against 512``."""
    pa, pb = a.data.params, b.data.params
    keys = [k for k in sorted(set(pa) | set(pb)) if k.startswith(TOKEN_PARAMS) and pa.get(k) != pb.get(k)]
    return ", ".join(f"{k} {str(pa.get(k, '—'))[:16]} against {str(pb.get(k, '—'))[:16]}" for k in keys)


def _named(parent) -> str:
    tags = parent.data.tags
    return f"{tags.get('ppl_audit.audit', '?')}, {datetime.fromtimestamp(parent.info.start_time / 1000, timezone.utc):%Y-%m-%d %H:%M}"


def audited(records: Records, experiment_id: str, key: str, also: str | None = None) -> list[Audited]:
    """Every variant of every complete audit of the baseline ``key`` in the experiment, newest first, its
    dominator and any change since the previous scheduled run marked; ``[]`` when no audit has that key.

    Args:
        also: the parent run id of an audit being logged (not complete yet), to include.
    """
    rows = []
    for parent, domain in _audits(records.client, experiment_id, key, also):
        children = _variant_runs(records.client, experiment_id, parent.info.run_id)
        rows += _checked(records, parent, [_row(child, parent, domain) for child in children], refuse=False)
    _newest_first(rows)
    mark_changes(rows)
    return rows


def _checked(records: Records, parent, rows: list[Audited], refuse: bool) -> list[Audited]:
    """``rows``, of the audit whose parent run is ``parent``, when their figures are its sealed record's (or it keeps
    none, tracked before records were); else, as its figures are not the audit's, none of them with a warning line
    naming it (once), or (``refuse``: an audit the user named) one error line."""
    problem = records.untrusted(parent, rows)
    if problem is None:
        return rows
    said = f"audit {_named(parent)} (run {parent.info.run_id}): {problem}"
    mend = f"re-run the audit, or log to its run in place of {RECORD} the one the spool kept"
    if refuse:
        raise InputError(f"{said}: its figures are not the audit's; {mend}")
    if said not in records.told:
        records.told.add(said)
        print(f"ppl-audit: warning: left out {said}; {mend}", file=console.err())
    return []


def _newest_first(rows: list[Audited]) -> None:
    """``rows`` sorted newest first, the newest audit's marked as not ``past``, and their dominators marked."""
    rows.sort(key=lambda row: (row.started, row.name), reverse=True)
    newest = rows[0].parent_run_id if rows else None
    for row in rows:
        row.past = row.parent_run_id != newest
    mark_dominated(rows)


def _variant_runs(client, experiment_id: str, parent_id: str) -> list:
    """The runs of the models of the audit whose parent run is ``parent_id``."""
    return _all_runs(client, experiment_id, f"tags.`mlflow.parentRunId` = '{parent_id}' and "
                                            "tags.`ppl_audit.kind` = 'variant'")


def _worse_beyond_intervals(a: Audited, b: Audited) -> bool:
    """Whether ``a``'s intervals lie wholly above ``b``'s: ΔPPL, and mean KL where both have it."""
    pairs = [("delta_ppl_pct_low", "delta_ppl_pct_high")]
    if measured(a.kld_mean_low) and measured(b.kld_mean_high):
        pairs.append(("kld_mean_low", "kld_mean_high"))
    return all(getattr(a, low) > getattr(b, high) for low, high in pairs)  # False for a NaN bound


def mark_dominated(rows: list[Audited]) -> None:
    """Set each row's ``dominated_by``: its own audit's dominator, else the smallest of the variants of other audits
    that are no larger and better beyond both intervals (never the same name: that is a change, ``mark_changes``)."""
    costed = [row for row in rows if measured(row.bpw)]
    for a in costed:
        if a.own_dominator:
            a.dominated_by = a.own_dominator
            continue
        better = [b for b in costed if b.parent_run_id != a.parent_run_id and b.name != a.name
                  and no_larger(b.bpw, a.bpw, b.kv_bytes_per_token, a.kv_bytes_per_token) and _worse_beyond_intervals(a, b)]
        if better:
            best = min(better, key=lambda b: (b.bpw, -b.started.timestamp()))
            a.dominated_by = f"{best.name} ({best.started:%Y-%m-%d %H:%M})"


def mark_changes(rows: list[Audited]) -> None:
    """A scheduled run's variant whose ΔPPL now lies beyond its interval from the previous scheduled run's: its
    ``changed`` says ``changed since <date>: +0.24% → +0.61%`` (``rows`` newest first)."""
    for i, row in enumerate(rows):
        if not row.scheduled or not measured(row.delta_ppl_pct_low):
            continue
        before = next((old for old in rows[i + 1:] if old.scheduled and old.name == row.name
                       and old.started < row.started and measured(old.delta_ppl_pct)), None)
        if before is not None and not row.delta_ppl_pct_low <= before.delta_ppl_pct <= row.delta_ppl_pct_high:
            row.changed = (f"changed since {before.started:%Y-%m-%d}: {before.delta_ppl_pct:+.2f}% → "
                           f"{row.delta_ppl_pct:+.2f}%")


def experiment_of(client, name: str, uri: str) -> str:
    """The experiment's id; one line naming what to do when the store has no such experiment."""
    found = client.get_experiment_by_name(name)
    if found is None:
        names = sorted(e.name for e in client.search_experiments(max_results=50) if e.name != "Default")
        there = f"it has {', '.join(names)}" if names else "it has none yet: audit first"
        raise InputError(f"no experiment '{name}' in {uri} ({there}); name one with --experiment")
    return found.experiment_id


def format_history(rows: list[Audited]) -> str:
    """The console table: a row per variant of each audit, newest first; the last column says its verdict, what
    dominates it and what changed, and names its run (a link on a tracking server)."""
    from tasks.record.report import delta_text, figure_text, kl_figure
    from tasks.record.verdict import fixed_width

    columns = [("variant", "<16"), ("method", "<10"), ("audit", "<12"), ("date", "<17"), ("bpw", ">7"), ("MiB", ">7"),
               ("ΔPPL % [95% CI]", ">24"), ("KLD", ">9")]
    body = []
    for row in rows:
        said = said_as(row.verdict).upper() + "".join(f"; {note}" for note in (
            row.dominated_by and f"dominated by {row.dominated_by}", row.changed) if note)
        figures = vars(row)  # named as a comparison row's: the audit table's own formatting
        audit = f"{row.audit}/{row.domain}" if row.domain else row.audit  # which of its corpora, in an audit of several
        body.append(([row.name, row.method, audit, f"{row.started:%Y-%m-%d %H:%M}",
                      figure_text(figures, "bpw", ".2f"), figure_text(figures, "mib", ".0f"), delta_text(figures),
                      kl_figure(figures)],
                     f"{said}  {row.link or row.run_id}"))
    return fixed_width(columns, body, "verdict, run")


def history_chart(rows: list[Audited], key: str, domain: str | None = None) -> Figure:
    """Size against quality of every audited variant of the baseline: the newest audit's in their verdicts' colours,
    earlier audits' grey and labelled with their date (not drawn again where a newer point stands); dominated ones
    hollow, the front of all joined. ``domain``: the corpus of an audit of several whose history it is (its title
    names it)."""
    points = [SizePoint(f"{row.name} {row.started:%m-%d}" if row.past else row.name, row.bpw, row.mib,
                        (row.delta_ppl_pct, row.delta_ppl_pct_low, row.delta_ppl_pct_high),
                        (row.kld_mean, row.kld_mean_low, row.kld_mean_high), COLOURS.get(row.verdict, ERROR_COLOUR),
                        row.dominated_by is not None, row.past) for row in reversed(rows)]
    handles = [Patch(color=COLOURS[v], label=f"{said_as(v)} (newest audit)") for v in COLOURS
               if any(row.verdict == v and not row.past for row in rows)]
    handles += [Patch(color=PAST_COLOUR, label="earlier audits")] if any(row.past for row in rows) else []
    audits = len({row.parent_run_id for row in rows})
    named = f"domain {domain}, baseline {key}" if domain else f"baseline {key}"
    return titled(size_quality_figure(points), f"{named}: {len(rows)} variant runs in {audits} audit(s), "
                   f"newest {rows[0].started:%Y-%m-%d %H:%M} UTC", handles + FRONT_HANDLES)
