"""``ppl-audit card``: an audit's model card (Markdown, Hugging Face's model-index, JSON), from its MLflow record alone."""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

from tasks.core import console
from tasks.core.errors import InputError

NAME, LOGGED = "card", True  # MLflow draws a progress bar as it downloads the record: into the log, not the card

RUN_ID = re.compile(r"^[0-9a-f]{32}$")  # how MLflow names a run


def add(commands) -> None:
    from tasks.record.card import FORMATS

    card = commands.add_parser(NAME, help="an audit's model card for Hugging Face, from its MLflow record: Markdown, "
                                          "model-index metadata or JSON")
    card.add_argument("audit", metavar="RUN_ID|CONFIG",
                      help="an audit's MLflow run id (a model's run: its audit's), or an audit YAML: the newest complete "
                           "audit of it in its tracking store")
    card.add_argument("--format", choices=FORMATS, default="md",
                      help="md: the card's text; model-index: the model card's YAML front matter (results the Hub "
                           "shows); json: the same content as data (default: md)")
    card.add_argument("--out", type=Path, metavar="FILE", help="write the card here (default: stdout)")
    card.add_argument("--tracking-uri", help="default: the config's, MLFLOW_TRACKING_URI, or the local store")
    card.add_argument("--experiment", help="with a CONFIG: the MLflow experiment (default: its tracking.experiment)")


def run(args: argparse.Namespace) -> int:
    from tasks.core.files import write_atomically
    from tasks.record.card import render, source_url

    out = _out(args.out)  # refused before the store is read, as any bad input
    client, run_id = _audit_run(args)
    record = _record(client, run_id)
    card = render(record, args.format, source_url(_page(client, run_id), run_id))
    if out is None:
        print(card, end="", file=console.out())
        return 0
    try:
        write_atomically(out, card)
    except OSError as error:
        raise InputError(f"cannot write the card {out} ({error.strerror or error}); give --out a file in a folder you "
                         "can write") from None
    print(f"card: {out}", file=console.err())
    return 0


def _out(path: Path | None) -> Path | None:
    """``--out`` as a file that can be written, or one line."""
    if path is None:
        return None
    if path.is_dir():
        raise InputError(f"--out {path} is a folder; name a file in it, e.g. {path / 'README.md'}")
    if not path.parent.is_dir():
        raise InputError(f"--out {path}: the folder {path.parent} does not exist; create it or name another file")
    return path


def _is_config(given: str) -> bool:
    """A config file, as the argument names one: a file, or a YAML file's name (one that is missing: the config
    loader's line)."""
    return Path(given).is_file() or given.endswith((".yaml", ".yml"))


def _audit_run(args: argparse.Namespace) -> tuple:
    """The store and the parent run id of the audit the arguments name; one line when there is none."""
    from tasks.audit.plan import audit_settings
    from tasks.config import check_tracking

    given = args.tracking_uri is not None
    if _is_config(args.audit):
        config = audit_settings(args.audit)
        uri = check_tracking(args.tracking_uri if given else config.tracking.uri,
                             "--tracking-uri" if given else "tracking.uri")
        client = _client(uri)
        return client, _newest(client, uri, config.name, args.experiment or config.tracking.experiment, args.audit)
    if not RUN_ID.match(args.audit):
        raise InputError(f"{args.audit} is neither an audit config (no such file) nor an MLflow run id (32 hex digits)")
    if args.experiment is not None:
        raise InputError("--experiment goes with a CONFIG: a run id names its own experiment")
    uri = check_tracking(args.tracking_uri, "--tracking-uri")
    client = _client(uri)
    return client, _parent(client, uri, args.audit)


def _client(uri: str):
    from mlflow import MlflowClient

    from tasks.core.places import default_uri, home

    if uri == default_uri() and not (home() / "mlflow.db").exists():  # reading it would make an empty one
        raise InputError(f"no audits yet: the local MLflow store {uri} does not exist; run an audit first, or give "
                         "--tracking-uri")
    return MlflowClient(tracking_uri=uri)


def _get_run(client, uri: str, run_id: str):
    """The run ``run_id``, or one line: there is none in the store, or the store cannot be read."""
    from mlflow.exceptions import MlflowException

    from tasks.core.errors import is_network_error

    try:
        return client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise InputError(f"no run {run_id} in {uri}; give an audit's run id (its parent run's, or a model's) "
                             "and the --tracking-uri it was logged to") from None
        if is_network_error(error):  # the first request: a server that is down or a wrong address, said as such
            raise InputError(f"cannot reach the tracking server {uri}; is it up, and is that its address?") from None
        raise


def _parent(client, uri: str, run_id: str) -> str:
    """The audit's parent run of ``run_id``: itself, or for a model's run, its audit's (said on stderr)."""
    run = _get_run(client, uri, run_id)
    tags = run.data.tags
    parent = tags.get("mlflow.parentRunId")
    if tags.get("ppl_audit.kind") != "audit" and parent:
        above = _get_run(client, uri, parent)
        if above.data.tags.get("ppl_audit.kind") == "audit":
            print(f"card of audit run {parent}: the audit of {tags.get('ppl_audit.kind', 'a')} run {run_id} "
                  f"({tags.get('ppl_audit.variant') or run.info.run_name})", file=console.err())
            return parent
    if tags.get("ppl_audit.kind") != "audit":
        kind = tags.get("ppl_audit.kind")
        raise InputError(f"run {run_id} ({run.info.run_name}) is not an audit of ppl-audit "
                         f"({f'a {kind} run' if kind else 'it has no ppl_audit.kind tag'}); give an audit's run id")
    return run_id


def _newest(client, uri: str, name: str, experiment: str, config: str) -> str:
    """The newest complete audit named ``name`` in ``experiment`` (said on stderr), or one line."""
    from datetime import datetime, timezone

    from tasks.record.history import experiment_of
    from tasks.record.tags import COMPLETE

    found = client.search_runs([experiment_of(client, experiment, uri)],
                               filter_string=f"tags.`ppl_audit.kind` = 'audit' and tags.`ppl_audit.audit` = '{name}' "
                                             f"and tags.`{COMPLETE}` = 'true'",
                               order_by=["attributes.start_time DESC"], max_results=1)
    if not found:
        raise InputError(f"no complete audit {name} in experiment '{experiment}' ({uri}); run it first "
                         f"(ppl-audit run {config}), or name its experiment with --experiment")
    run = found[0]
    when = datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc)
    print(f"card of run {run.info.run_id}: the newest audit {name} in experiment '{experiment}' "
          f"({when:%Y-%m-%d %H:%M} UTC, {run.data.tags.get('audit.verdict', '?').upper()})", file=console.err())
    return run.info.run_id


def _record(client, run_id: str) -> dict:
    """The audit's record as its run keeps it (``record.json``), or one line for a run tracked before it did."""
    import json

    from mlflow.exceptions import MlflowException

    from tasks.record.card import RECORD

    if RECORD not in {artifact.path for artifact in client.list_artifacts(run_id)}:
        raise InputError(f"run {run_id} has no {RECORD}: it was tracked before ppl-audit logged records and cards; "
                         "re-run the audit (ppl-audit run CONFIG), or ppl-audit sync an audit still spooled, then make "
                         "the card of its new run")
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, RECORD, folder)
        except MlflowException as error:
            raise InputError(f"cannot read {RECORD} of run {run_id}: {str(error).splitlines()[0][:200]}") from None
        return json.loads(Path(path).read_text())


def _page(client, run_id: str) -> str | None:
    from tasks.record.tracking import run_link

    return run_link(client.tracking_uri, run_id)
