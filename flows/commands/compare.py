"""``ppl-audit compare``: every variant audited against one baseline, across the audits of an experiment."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tasks.core import console
from tasks.core.errors import InputError

NAME, LOGGED = "compare", True  # working out a config's baseline key tokenizes its corpus: the libraries talk


def add(commands) -> None:
    from flows.commands.arguments import config_field
    from tasks.config import Tracking

    compare = commands.add_parser(NAME, help="every variant audited against a baseline, across audits: size "
                                             "against quality, what dominates what, what changed")
    compare.add_argument("config", nargs="?", help="an audit YAML: its baseline, corpus and evaluation settings say "
                                                   "which audits compare, its tracking where they are")
    compare.add_argument("--baseline", metavar="KEY", help="instead of a config: a baseline key (this command prints "
                                                           "it; the ppl_audit.baseline_key tag of an audit's run) or a "
                                                           "reference key (ppl-audit reference ls)")
    compare.add_argument("--experiment", help="the MLflow experiment (default: the config's tracking.experiment, "
                                              f"else {config_field(Tracking, 'experiment')[0]})")
    compare.add_argument("--tracking-uri", help="default: the config's, MLFLOW_TRACKING_URI, or the local store")
    compare.add_argument("--chart", type=Path, metavar="PNG", help="where to write the chart of them all "
                                                                 "(default: <home>/compare/<key>.png)")
    compare.add_argument("--json", action="store_true", help="end stdout with one JSON line of the variants")


def run(args: argparse.Namespace) -> int:
    from tasks.config import Tracking, check_tracking
    from tasks.core.places import default_uri, home
    from tasks.record.history import audited, experiment_of, format_history, history_chart
    from tasks.record.tracking import ui_link

    if (args.config is None) == (args.baseline is None):
        raise InputError("give an audit config or --baseline KEY, one of them")
    given = args.tracking_uri is not None
    plan = None
    if args.config is not None:  # its baseline, found and digested with its token stream: what names its audits
        from tasks.audit.plan import baseline_alone, baseline_key_of, open_audit

        plan = open_audit(args.config, [], narrow=baseline_alone, strict=False)
    tracking = plan.config.tracking if plan else Tracking()
    uri = check_tracking(args.tracking_uri if given else tracking.uri, "--tracking-uri" if given else "tracking.uri")
    chart = _chart(args.chart)
    key = baseline_key_of(plan) if plan else args.baseline
    if uri == default_uri() and not (home() / "mlflow.db").exists():  # reading it would make an empty one
        raise InputError(f"no audits yet: the local MLflow store {uri} does not exist; run an audit first, or give "
                         "--tracking-uri")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = args.experiment or tracking.experiment
    experiment_id = experiment_of(client, experiment, uri)
    rows = audited(client, experiment_id, key)
    if not rows:
        raise InputError(f"no audit of baseline {key} in experiment '{experiment}' ({uri}); check the key (ppl-audit "
                         "reference ls, or a parent run's ppl_audit.baseline_key tag) or the experiment")
    if uri.startswith(("http://", "https://")):
        for row in rows:
            row.link = ui_link(uri, experiment_id, row.run_id)
    chart = chart or home() / "compare" / f"{key}.png"
    chart.parent.mkdir(parents=True, exist_ok=True)
    try:
        history_chart(rows, key).savefig(chart)
    except OSError as error:  # a full or read-only disk, a device such as /dev/full.png
        raise InputError(f"cannot write the chart {chart} ({error.strerror or error}); give --chart a file in a folder you "
                         "can write") from None
    say = console.out()
    audits = len({row.parent_run_id for row in rows})
    print(f"baseline {key}: {len(rows)} variant run(s) in {audits} audit(s) of experiment '{experiment}', newest first",
          file=say)
    print(format_history(rows), file=say)
    print(f"chart: {chart}", file=say)
    if args.json:
        print(json.dumps({"baseline_key": key, "experiment": experiment, "chart": str(chart),
                          "variants": [row.json() for row in rows]}), file=say)
    return 0


def _chart(path: Path | None) -> Path | None:
    """``--chart`` as matplotlib will write it, or one line: it adds ``.png`` to a name without a suffix and writes
    ``FOLDER.png`` for a folder, so that the path printed would not be the chart's."""
    if path is None:
        return None
    if path.suffix.lower() != ".png":
        raise InputError(f"--chart {path}: name a .png file (e.g. {path.with_name(path.name + '.png')}); the chart is "
                         "a PNG image")
    if path.is_dir():
        raise InputError(f"--chart {path} is a folder; name a .png file in it, e.g. {path / 'compare.png'}")
    if not path.parent.is_dir():
        raise InputError(f"--chart {path}: the folder {path.parent} does not exist; create it or name another file")
    return path
