"""``ppl-audit card``: an audit's model card (Markdown, Hugging Face's model-index or .eval_results/, JSON), from its
MLflow record alone."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from flows.commands.arguments import is_run_id, quoted
from tasks.core import console
from tasks.core.errors import InputError

if TYPE_CHECKING:
    from tasks.record.card import EvalResults

NAME, LOGGED = "card", True  # MLflow draws a progress bar as it downloads the record: into the log, not the card


def add(commands) -> None:
    from tasks.record.card import FORMATS

    card = commands.add_parser(NAME, help="an audit's model card for Hugging Face, from its MLflow record: Markdown, "
                                          "model-index metadata or JSON")
    card.add_argument("audit", metavar="RUN_ID|CONFIG",
                      help="an audit's MLflow run id (a model's run: its audit's), or an audit YAML: the newest complete "
                           "audit of it in its tracking store")
    card.add_argument("--format", choices=FORMATS, default="md",
                      help="md: the card's text; model-index: the model card's YAML front matter (results the Hub "
                           "shows); eval-results: the Hub's .eval_results/ files, one per corpus read from a Hub "
                           "dataset; json: the same content as data (default: md)")
    card.add_argument("--out", type=Path, metavar="FILE",
                      help="write the card here, a regular file or a new one (default: stdout); with --format "
                           "eval-results, the folder of its files (e.g. MODEL_REPO/.eval_results)")
    card.add_argument("--model-id", metavar="ORG/NAME",
                      help="the Hub model the results are of: the model index's name (default: the audit's name)")
    card.add_argument("--tracking-uri", help="default: the config's, MLFLOW_TRACKING_URI, or the local store")
    card.add_argument("--experiment", help="with a CONFIG: the MLflow experiment (default: its tracking.experiment)")


def _model_id(value: str | None) -> str | None:
    """``--model-id``: a Hub model's id, ORG/NAME, as the Hub checks one (``huggingface_hub``'s own check); else one
    line."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value is None:
        return None
    try:
        validate_repo_id(value)
        valid = value.count("/") == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise InputError(f"--model-id {quoted(value)} is not a Hub model id; give ORG/NAME (letters, digits, -, _ and ., "
                         "at most 96 characters), e.g. my-org/my-model-GPTQ")
    return value


def run(args: argparse.Namespace) -> int:
    from tasks.core.files import output_file
    from tasks.record.card import eval_results, render, source_url
    from tasks.record.tracking import reaching

    # refused before the store is read, as any bad input
    model_id = _model_id(args.model_id)
    several = args.format == "eval-results"
    out = args.out and (_out_folder(args.out) if several else output_file(args.out, "--out", "README.md"))
    client, uri, run_id = _audit_run(args)
    with reaching(uri):
        record = _record(client, run_id)
        url = source_url(_page(client, run_id), run_id)
    if several:
        return _eval_results(eval_results(record, url), out, model_id)
    card = render(record, args.format, url, model_id)
    if out is None:
        print(card, end="", file=console.out())
        return 0
    _write(out, card)
    print(f"card: {out}", file=console.err())
    return 0


def _write(path: Path, text: str) -> None:
    from tasks.core.files import write_atomically

    try:
        write_atomically(path, text)
    except OSError as error:
        raise InputError(f"cannot write the card {path} ({error.strerror or error}); give --out a file in a folder you "
                         "can write") from None


def _out_folder(path: Path) -> Path:
    """``--out`` of ``--format eval-results``: a folder there (made if new, in a folder that is), or one line."""
    from tasks.core.files import output_file
    from tasks.record.card import EVAL_RESULTS

    if path.is_symlink() or not path.is_dir():
        output_file(path, "--out", EVAL_RESULTS)  # a new name, or one line on what is there instead
        if path.exists():
            raise InputError(f"--out {path} is a file; --format eval-results writes a folder of files: name a folder, "
                             f"e.g. {path.parent / EVAL_RESULTS}")
    return path


def _eval_results(found: EvalResults, out: Path | None, model_id: str | None) -> int:
    """Write (``out``) or print the audit's ``.eval_results/`` files; the token streams left out said on stderr, and
    with ``model_id``, how the files reach its repo."""
    from tasks.core.files import output_file
    from tasks.record.card import EVAL_RESULTS, eval_results_file, eval_results_text

    if not found.files:
        raise InputError(f"no corpus of audit {found.audit} is a Hugging Face dataset (hf:NAME), and each result in "
                         f"{EVAL_RESULTS}/ names the Hub dataset it is on; give --format model-index")
    for name, source in found.left_out.items():
        print(f"{name} ({source}) left out of {EVAL_RESULTS}/: it is not a Hugging Face dataset, which each result "
              "names", file=console.err())
    if out is None:
        print(eval_results_text(found), end="", file=console.out())
        return 0
    out.mkdir(exist_ok=True)
    files = [output_file(out / name, "--out", name) for name in found.files]  # all checked before any is written
    for file, entries in zip(files, found.files.values()):
        _write(file, eval_results_file(entries))
        print(f"card: {file}", file=console.err())
    if model_id:  # the files name no model: the repo they are in does
        print(f"to publish them: hf upload {model_id} {out} {EVAL_RESULTS} (with --create-pr on a model that is not "
              "yours)", file=console.err())
    return 0


def _is_config(given: str) -> bool:
    """A config file, as the argument names one: a file, or a YAML file's name (one that is missing: the config
    loader's line); one line for a name no file can have."""
    try:
        a_file = Path(given).is_file()  # False where nothing is there; raises for a name no file can have
    except OSError as error:  # a name longer than the file system takes: neither, said as such
        raise InputError(f"{quoted(given)} is neither an audit config ({error.strerror}) nor an MLflow run id (32 hex "
                         "digits)") from None
    return a_file or given.endswith((".yaml", ".yml"))


def _audit_run(args: argparse.Namespace) -> tuple:
    """The store, its URI and the parent run id of the audit the arguments name; one line when there is none."""
    from tasks.audit.plan import audit_settings
    from tasks.config import check_tracking
    from tasks.record.tracking import reaching

    given = args.tracking_uri is not None
    if not is_run_id(args.audit) and _is_config(args.audit):
        config = audit_settings(args.audit)
        uri = check_tracking(args.tracking_uri if given else config.tracking.uri,
                             "--tracking-uri" if given else "tracking.uri")
        client = _client(uri)
        with reaching(uri):
            return client, uri, _newest(client, uri, config.name, args.experiment or config.tracking.experiment,
                                        args.audit)
    if not is_run_id(args.audit):
        raise InputError(f"{quoted(args.audit)} is neither an audit config (no such file) nor an MLflow run id (32 hex "
                         "digits)")
    if args.experiment is not None:
        raise InputError("--experiment goes with a CONFIG: a run id names its own experiment")
    uri = check_tracking(args.tracking_uri, "--tracking-uri")
    client = _client(uri)
    with reaching(uri):
        return client, uri, _parent(client, uri, args.audit)


def _client(uri: str):
    from mlflow import MlflowClient

    from tasks.core.places import default_uri, home

    if uri == default_uri() and not (home() / "mlflow.db").exists():  # reading it would make an empty one
        raise InputError(f"no audits yet: the local MLflow store {uri} does not exist; run an audit first, or give "
                         "--tracking-uri")
    return MlflowClient(tracking_uri=uri)


def _get_run(client, uri: str, run_id: str):
    """The run ``run_id``, or one line: there is none in the store (a store that cannot be read: ``reaching``)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as error:
        if error.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise InputError(f"no run {run_id} in {uri}; give an audit's run id (its parent run's, or a model's) "
                             "and the --tracking-uri it was logged to") from None
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
    """The audit's record as its run keeps it (``record.json``), checked against its seal, or one line."""
    from tasks.core.places import synced_dir
    from tasks.record.logged import RECORD, Untrusted, logged_record

    try:
        record = logged_record(client, run_id)
    except Untrusted as error:  # its figures may not follow from each other: no card made from them
        raise InputError(f"{error}: its figures are not the audit's; re-run the audit (ppl-audit run CONFIG), or "
                         f"log to the run in its place the record.json the spool kept (under {synced_dir()})") from None
    if record is None:
        raise InputError(f"run {run_id} has no {RECORD}: it was tracked before ppl-audit logged records and cards; "
                         "re-run the audit (ppl-audit run CONFIG), or ppl-audit sync an audit still spooled, then make "
                         "the card of its new run")
    return record


def _page(client, run_id: str) -> str | None:
    from tasks.record.tracking import run_link

    return run_link(client.tracking_uri, run_id)
