"""``ppl-audit compare``: every variant audited against one baseline, across the audits of an experiment."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import console
from tasks.core.errors import InputError

if TYPE_CHECKING:
    from tasks.record.logged import Records

NAME, LOGGED = "compare", True  # working out a config's baseline key tokenizes its corpus: the libraries talk


def add(commands) -> None:
    from flows.commands.arguments import config_field
    from tasks.config import Tracking

    compare = commands.add_parser(NAME, help="every variant audited against a baseline, across audits: size "
                                             "against quality, what dominates what, what changed")
    compare.add_argument("config", nargs="?", help="an audit YAML: its baseline, corpus and evaluation settings say "
                                                   "which audits compare, its tracking where they are; with corpora, "
                                                   "one history per domain (each with its own baseline key)")
    compare.add_argument("--baseline", metavar="KEY", help="instead of a config: a baseline key (this command prints "
                                                           "it; the ppl_audit.baseline_key tag of an audit's run) or a "
                                                           "reference key (ppl-audit reference ls)")
    compare.add_argument("--experiment", help="the MLflow experiment (default: the config's tracking.experiment, "
                                              f"else {config_field(Tracking, 'experiment')[0]})")
    compare.add_argument("--tracking-uri", help="default: the config's, MLFLOW_TRACKING_URI, or the local store")
    compare.add_argument("--chart", type=Path, metavar="PNG", help="where to write the chart of them all "
                                                                 "(default: <home>/compare/<key>.png; a config with "
                                                                 "corpora: PNG's name with .<domain> before .png)")
    compare.add_argument("--audits", nargs="+", metavar="RUN_ID",
                         help="instead of a config or key: these audits' parent runs side by side, on the token streams "
                              "they all scored (refused where they scored different tokens)")
    compare.add_argument("--any-tokens", action="store_true", help="with --audits: set them side by side even where "
                                                                  "they scored different tokens (each audit labelled "
                                                                  "with its token population)")
    compare.add_argument("--json", action="store_true", help="end stdout with one JSON line of the variants (a config "
                                                            "with corpora: {\"domains\": {NAME: ...}})")


def run(args: argparse.Namespace) -> int:
    from tasks.config import Tracking, check_tracking
    from tasks.core.places import default_uri, home
    from tasks.record.history import experiment_of

    if sum(given is not None for given in (args.config, args.baseline, args.audits)) != 1:
        raise InputError("give an audit config, --baseline KEY or --audits RUN_ID RUN_ID, one of them")
    if args.any_tokens and args.audits is None:
        raise InputError("--any-tokens sets the audits --audits names side by side: give --audits too")
    if args.audits is not None:
        from flows.commands.arguments import check_run_id

        for given in args.audits:  # each checked for form before any store is asked
            check_run_id(given, "--audits")
        return _side_by_side(args)
    given = args.tracking_uri is not None
    plan = None
    if args.config is not None:  # its baseline, found and digested with its token stream: what names its audits
        from tasks.audit.plan import baseline_alone, open_audit

        plan = open_audit(args.config, [], narrow=baseline_alone, strict=False)
    tracking = plan.config.tracking if plan else Tracking()
    uri = check_tracking(args.tracking_uri if given else tracking.uri, "--tracking-uri" if given else "tracking.uri")
    chart = _chart(args.chart)
    keys = _keys(plan) if plan else {None: args.baseline}
    for name in keys if chart and None not in keys else ():  # each domain's chart: as the one named, checked first
        _chart(_domain_chart(chart, name))
    if uri == default_uri() and not (home() / "mlflow.db").exists():  # reading it would make an empty one
        raise InputError(f"no audits yet: the local MLflow store {uri} does not exist; run an audit first, or give "
                         "--tracking-uri")
    from mlflow import MlflowClient

    from tasks.record.logged import Records
    from tasks.record.tracking import reaching

    client = MlflowClient(tracking_uri=uri)
    experiment = args.experiment or tracking.experiment
    with reaching(uri):
        return _histories(args, plan, keys, Where(Records(client), experiment_of(client, experiment, uri), experiment, uri),
                          chart)


def _histories(args: argparse.Namespace, plan, keys: dict[str | None, str], where: Where, chart: Path | None) -> int:
    """Print the history of each baseline key (one, or each domain's), write its chart; ``--json``: their JSON."""
    experiment, uri = where.experiment, where.uri
    if None in keys:  # one corpus: one history, as before corpora
        said = _history(where, keys[None], chart, None)
        if said is None:
            raise InputError(f"no audit of baseline {keys[None]} in experiment '{experiment}' ({uri}); check the key "
                             "(ppl-audit reference ls, or a parent run's ppl_audit.baseline_key tag) or the experiment")
    else:
        found = {name: _history(where, key, chart and _domain_chart(chart, name), name) for name, key in keys.items()}
        if not any(found.values()):
            raise InputError(f"no audit of any domain of {plan.name} ({', '.join(f'{n} baseline {k}' for n, k in keys.items())}) "
                             f"in experiment '{experiment}' ({uri}); check the experiment")
        said = {"domains": {name: history or {"baseline_key": keys[name], "experiment": experiment, "chart": None,
                                              "variants": []} for name, history in found.items()}}
    if args.json:
        print(json.dumps(said), file=console.out())
    return 0


def _side_by_side(args: argparse.Namespace) -> int:
    """``compare --audits``: the named audits' variants in one table per token population they all scored."""
    from mlflow import MlflowClient

    from tasks.config import check_tracking
    from tasks.record.history import audits_side_by_side, format_history, scored_alike
    from tasks.record.logged import Records
    from tasks.record.tracking import reaching

    if len(set(args.audits)) < 2:
        raise InputError("--audits: name at least two audits' runs to set side by side (for one audit's history, give "
                         "its config)")
    uri = check_tracking(args.tracking_uri, "--tracking-uri")
    client = MlflowClient(tracking_uri=uri)
    with reaching(uri):
        parents = _parents(client, uri, args.audits)
        any_tokens = args.any_tokens and not scored_alike(parents)  # of the same tokens: as without --any-tokens
        tables = audits_side_by_side(Records(client), parents, any_tokens)
    say = console.out()
    if any_tokens:
        print("side by side on the tokens each scored (--any-tokens): figures on different tokens are not comparable "
              "as they stand", file=say)
    for population, rows in tables.items():
        named = f"token population {population}" if population else "every token population"
        print(f"{named}: {len(rows)} variant run(s) of {len({r.parent_run_id for r in rows})} audit(s)", file=say)
        print(format_history(rows) + "\n", file=say)
    if args.json:
        print(json.dumps({"populations": {str(p): [row.json() for row in rows] for p, rows in tables.items()}}),
              file=say)
    return 0


def _parents(client, uri: str, run_ids: list[str]) -> list:
    """The audits' parent runs of ``run_ids`` (each an audit's, or a model's run of one), once each; one line for a
    run the store has not, or one not of an audit."""
    from mlflow.exceptions import MlflowException

    from tasks.core.errors import is_network_error
    from tasks.record.tags import AUDIT_ID

    parents = []
    for run_id in dict.fromkeys(run_ids):
        try:
            run = client.get_run(run_id)
        except MlflowException as error:
            if is_network_error(error):  # a server that is down: ``reaching``'s line
                raise
            raise InputError(f"--audits: no run {run_id} in {uri}; give an audit's run id (its parent run: the "
                             "ppl_audit.audit_id tag's)") from None
        parent_id = run.data.tags.get("mlflow.parentRunId") if run.data.tags.get("ppl_audit.kind") != "audit" else None
        run = client.get_run(parent_id) if parent_id else run
        if run.data.tags.get("ppl_audit.kind") != "audit" or AUDIT_ID not in run.data.tags:
            raise InputError(f"--audits: run {run_id} is not a ppl-audit audit's run; give an audit's parent run id")
        parents.append(run)
    return parents


def _keys(plan) -> dict[str | None, str]:
    """The baseline key of each domain of the audit ``plan`` (by name), or of its one corpus (under None, the name
    its lines give it): each domain's from its own token stream, as its one-corpus audit's."""
    from tasks.audit.plan import baseline_key_of

    return {domain.corpus.shown: baseline_key_of(plan.alone(domain.name)) for domain in plan.domains}


@dataclass(frozen=True)
class Where:
    """The store and experiment the histories are read from (``records``: its audits' records, each checked once)."""

    records: Records
    experiment_id: str
    experiment: str
    uri: str


def _history(where: Where, key: str, chart: Path | None, domain: str | None) -> dict | None:
    """Print the history of the baseline ``key`` (of the domain ``domain`` in an audit of several corpora) and write
    its chart (``chart``, else ``<home>/compare/<key>.png``); its JSON, or None when no audit has that key."""
    from tasks.core.places import home
    from tasks.record.history import audited, format_history, history_chart
    from tasks.record.tracking import ui_link

    say = console.out()
    rows = audited(where.records, where.experiment_id, key)
    if not rows:
        if domain is not None:  # the others' histories are still shown
            print(f"domain {domain}, baseline {key}: no audit in experiment '{where.experiment}'\n", file=say)
        return None
    if where.uri.startswith(("http://", "https://")):
        for row in rows:
            row.link = ui_link(where.uri, where.experiment_id, row.run_id)
    chart = chart or home() / "compare" / f"{key}.png"
    chart.parent.mkdir(parents=True, exist_ok=True)
    try:
        history_chart(rows, key, domain).savefig(chart)
    except OSError as error:  # a full or read-only disk, a device such as /dev/full.png
        raise InputError(f"cannot write the chart {chart} ({error.strerror or error}); give --chart a file in a folder you "
                         "can write") from None
    audits = len({row.parent_run_id for row in rows})
    named = f"domain {domain}, baseline {key}" if domain else f"baseline {key}"
    populations = sorted({row.population for row in rows if row.population})
    print(f"{named}: {len(rows)} variant run(s) in {audits} audit(s) of experiment '{where.experiment}', newest first"
          + (f"; token population {', '.join(populations)}" if populations else ""), file=say)
    print(format_history(rows), file=say)
    print(f"chart: {chart}" + ("\n" if domain else ""), file=say)
    return {"baseline_key": key, "experiment": where.experiment, "chart": str(chart),
            "variants": [row.json() for row in rows]}


def _domain_chart(chart: Path, domain: str) -> Path:
    """Where the chart of ``domain`` goes in an audit of several corpora: ``--chart``'s name with the domain's."""
    return chart.with_name(f"{chart.stem}.{domain}.png")


def _chart(path: Path | None) -> Path | None:
    """``--chart`` as matplotlib will write it, or one line: it adds ``.png`` to a name without a suffix and writes
    ``FOLDER.png`` for a folder, so that the path printed would not be the chart's; and, as any output, a regular
    file or a new one (``output_file``)."""
    from tasks.core.files import output_file

    if path is None:
        return None
    if path.suffix.lower() != ".png":
        raise InputError(f"--chart {path}: name a .png file (e.g. {path.with_name(path.name + '.png')}); the chart is "
                         "a PNG image")
    return output_file(path, "--chart", "compare.png")
