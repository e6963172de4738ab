"""MLflow records of an audit: a parent run, a nested run per model, made from a spooled record.

``replay`` is idempotent: an audit already complete in the server is left alone, a partial one (the
server died mid-audit) is deleted and logged again, so a synced audit has exactly the runs of a clean one.
Two processes never replay one record at once: they hold it first (``tasks.record.spool.claim``).
"""

from __future__ import annotations

import fcntl
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

from tasks.core.places import home, tracking_uri
from tasks.data.registry import is_registered, tag_version
from tasks.record.figures import SHOWN
from tasks.record.spool import read_record
from tasks.record.row import ModelRow
from tasks.record.entry_said import CorpusSaid
from tasks.record.tracked_said import Stream, StreamScored, TrackedAudit, TrackedModel
from tasks.record.tags import (AUDIT_ID, BASELINE_KEY, CHANGED, COMPLETE, DOMAIN, DOMAIN_KEYS, DOMAIN_POPULATIONS,
                               DOMAIN_REFERENCES, DOMAINS, DOMINATED_BY, FLOOR, POPULATION, REFERENCE, SCHEDULED)
from tasks.record.verdict_said import said as said_as

EXPERIMENT_KIND = "mlflow.experimentKind"  # read by MLflow 3's UI: which view an experiment opens in
METRICS = ("ppl", "mean_nll", "stderr", "ppl_stderr", "nll_sum", "n_tokens", "bits_per_byte", "byte_ppl", "word_ppl",
           "tokens_per_second", "wall_seconds", "peak_memory_bytes")
FACT_METRICS = ("load_seconds", "size_on_disk_bytes", "weight_memory_bytes", "bits_per_weight", "model_bits_per_weight",
                "quantized_layers", "kv_bytes_per_token")
COMPARISON_PREFIXES = ("delta_", "ppl_ratio", "kld_", "top1_", "dp_", "window_lnppl", "token_lnppl", "divergence_mib",
                       "kv_saving_pct", "kv_window_mib",
                       "windows", "scored_fraction",  # the windows the paired intervals rest on; how much was scored
                       *(figure.key for figure in SHOWN))  # and every per-model figure shown, with its interval


def _absent(scored: StreamScored) -> dict[str, str]:
    """Each figure a model's run lacks, and why: a tag, so that an empty column in the UI is explained."""
    why = scored.row.divergence_absent
    return {**scored.absent, **({"kld_mean": why} if why else {})}


def is_tracking_outage(error: BaseException) -> bool:
    """A failure of the tracking server or the way to it (retried), not of our code (not retried)."""
    from tasks.core.errors import is_network_error

    return is_network_error(error) or type(error).__name__ == "MlflowException"


@contextmanager
def reaching(uri: str) -> Iterator[None]:
    """Read the store at ``uri`` inside: a server that is down or a wrong address is one line (what every command
    that reads a store says), not MLflow's exception after its retries."""
    from tasks.core.errors import InputError, is_network_error

    try:
        yield
    except Exception as error:
        if isinstance(error, InputError) or not is_network_error(error):
            raise
        raise InputError(f"cannot reach the tracking server {uri}; is it up, and is that its address?") from None


def ui_link(server: str, experiment_id: str, run_id: str | None = None) -> str:
    """An experiment's runs, or one run, in the MLflow UI at ``server``, in its model-training view.

    MLflow 3.17's UI does not open an experiment by its ``mlflow.experimentKind``: it opens the view last
    picked in that browser (GenAI until a user picks "Model training"), unless the link names one.
    """
    page = f"runs/{run_id}" if run_id else "runs"
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/{page}?workflowType=machine_learning"


def run_link(uri: str, run_id: str) -> str | None:
    """A run's page in the UI of the tracking server at ``uri``; None for a local store (``ppl-audit ui``
    lists its experiments' links)."""
    if not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    return ui_link(uri, MlflowClient(tracking_uri=uri).get_run(run_id).info.experiment_id, run_id)


def client_of(uri: str):
    """An MlflowClient of the store at ``uri``. MLflow makes a local SQLite store's tables as the client is made, and
    two processes making a fresh one at once (two audits on a fresh home) fail on each other's tables with a page of
    SQL: one process at a time makes it, under a lock beside its file."""
    from mlflow import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    database = Path(uri.removeprefix("sqlite:///").partition("?")[0])  # four slashes: an absolute path
    with open(database.with_name(f"{database.name}.lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # let go as the file closes
        return MlflowClient(tracking_uri=uri)


def _experiment(client, name: str, uri: str) -> str:
    """The experiment's id, made if needed, declared a model-development one unless it says otherwise."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        location = None
        if uri.startswith("sqlite:"):  # a local store keeps its artifacts beside it, not in the current folder
            location = (home() / "mlartifacts" / name).as_uri()
        try:
            client.create_experiment(name, artifact_location=location)
        except MlflowException:
            if client.get_experiment_by_name(name) is None:  # else a concurrent sync or audit made it meanwhile
                raise
        found = client.get_experiment_by_name(name)
    if EXPERIMENT_KIND not in found.tags:  # else MLflow 3 opens the experiment in its GenAI (traces) view
        try:
            client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND, "custom_model_development")
        except MlflowException:
            if EXPERIMENT_KIND not in client.get_experiment(found.experiment_id).tags:  # else a concurrent one set it
                raise
    return found.experiment_id


def _datasets(audit: TrackedAudit) -> list:
    """The corpus a run was scored on as MLflow inputs: each domain's, in an audit of several (their sum, the
    record's ``corpus``, names no one source)."""
    return [_dataset_input(stream.corpus, stream.domain) for stream in audit.streams.values()]


def _dataset_input(corpus: CorpusSaid, domain: str | None):
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    source_name = corpus.source
    if source_name.startswith("hf:"):
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        source = HuggingFaceDatasetSource(path=source_name[3:], config_name=corpus.hf_config, split=corpus.hf_split)
    else:
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # MLflow warns that resolving by registry will change one day
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(corpus.location or source_name)
    name = Path(source_name).name or source_name
    name = f"{domain}: {name}" if domain else name  # two domains may share a file name
    dataset = MetaDataset(source=source, name=name, digest=corpus.digest[:16])
    return DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", "evaluation")])


def _log_dataset(client, run_id: str, datasets: list) -> None:
    """Log the corpus as the run's input. MLflow's store looks the dataset up and inserts it if absent, so a
    concurrent sync or audit of the same corpus can insert it in between and this insert then breaks the store's
    unique constraint; the second try finds the dataset and links it."""
    from mlflow.exceptions import MlflowException

    try:
        client.log_inputs(run_id, datasets=datasets)
    except MlflowException:
        client.log_inputs(run_id, datasets=datasets)


def _params(values: dict) -> list:
    from mlflow.entities import Param

    return [Param(k, str(v)[:6000]) for k, v in values.items() if v is not None]


def _audit_params(audit: TrackedAudit) -> dict:
    corpus = audit.corpus
    params = {"audit": audit.name, "window": audit.window, "stride": audit.stride, "batch_size": audit.batch_size,
              "bos": corpus.bos, "max_tokens": audit.max_tokens, "corpus.source": corpus.source,
              "corpus.digest": corpus.digest, "corpus.tokens": corpus.n_tokens, "hardware": audit.hardware,
              "corpus.tokenizer": corpus.tokenizer, "baseline": audit.baseline}
    params.update({f"version.{k}": v for k, v in audit.versions.items()})
    for name, stream in _named(audit.streams).items():  # the top's corpus is the domains' sum: each one's own
        params.update({f"corpus.source.{name}": stream.corpus.source, f"corpus.digest.{name}": stream.corpus.digest,
                       f"corpus.tokens.{name}": stream.corpus.n_tokens, f"max_tokens.{name}": stream.max_tokens})
    return params


def _named(by_stream: dict) -> dict:
    """What ``by_stream`` holds on each named domain, in an audit of several ({} for one corpus: its one stream has
    no name, and the run's own figures and params are its)."""
    return {name: value for name, value in by_stream.items() if name is not None}


def _variant_params(audit: TrackedAudit, model: TrackedModel) -> dict:
    setup, calibration = model.setup, model.setup.calibration
    params = {**_audit_params(audit), "variant": model.name, "method": setup.method,
              # the method as the audit's table says it (its format's label: "gptq 4-bit g32 tuned", "baseline kv:int8")
              "label": model.top.row.method, "path": setup.path, "bits": setup.bits, "group_size": setup.group_size,
              "sym": setup.sym, "dtype": setup.dtype, "device": setup.device, "backend": setup.backend,
              "worker": setup.worker, "kv_cache": setup.kv_cache, "body": setup.body, "shards": model.shards,
              "calibration.digest": calibration.digest if calibration else None, "mode": audit.mode,
              "reference": model.top.row.reference,
              "calibration.samples": calibration.samples if calibration else None,
              "source_model_digest": setup.source_model_digest}
    # the format's own facts: a GGUF's file type and bits per weight, a compressed-tensors scheme and whether
    # its activations were quantized, how method auto found the method
    params.update({f"format.{key}": value if isinstance(value, (str, int, float)) else str(value)
                   for key, value in setup.formats.items()})
    # what llama.cpp ran it with (runtime: llama.cpp): threads, batch, type_k, type_v, flash_attn, gpu_layers
    params.update({f"llama_cpp.{key}": value for key, value in setup.llama_cpp.items()})
    params["runtime"] = setup.runtime
    # a sequential run: the order's seed and whether it stopped (its bounds at the stop are the row's)
    params.update({f"sequential.{key}": value for key, value in model.sequential.items()})
    for name, own in _named(model.streams).items():  # each domain's KL came from its own reference
        params[f"reference.{name}"] = own.row.reference
    return params


def _metrics(record: dict, entry: dict, folder: Path, timestamp: int) -> list:
    """A model's run's metrics (``_model_metrics``) of a record's entry."""
    return _model_metrics(next(m for m in TrackedAudit.of_record(record).models if m.name == entry["name"]), folder,
                          timestamp)


def _model_metrics(model: TrackedModel, folder: Path, timestamp: int) -> list:
    """A model's run's metrics: its figures (of its worst domain, in an audit of several), the facts of the model
    and, in an audit of several, each domain's figures as ``<metric>.<DOMAIN>``."""
    from mlflow.entities import Metric

    from tasks.record.plots import measured

    figures = model.setup.figures
    metrics = [Metric(key, float(figures[key]), timestamp, 0) for key in FACT_METRICS if measured(figures.get(key))]
    # the worst domain's figures are also the run's own, unsuffixed: read once
    return metrics + [metric for scored in model.streams.values() for metric in _figures(scored, folder, timestamp)]


def _figures(scored: StreamScored, folder: Path, timestamp: int) -> list:
    """What scoring the model on one token stream gave: its result's figures, its comparison with the baseline, its
    mean NLL per window (``window_nll``, a step per window), under each name ending in each of its ``suffixes``."""
    import pyarrow.parquet as pq
    from mlflow.entities import Metric

    from tasks.record.plots import measured

    figures = []  # (name, value, step)
    figures += [(key, float(scored.result[key]), 0) for key in METRICS if scored.result.get(key) is not None]
    figures += [(key, float(value), 0) for key, value in scored.row.as_record().items()
                if key.startswith(COMPARISON_PREFIXES) and measured(value)]
    if scored.arrays:
        per_window = pq.read_table(folder / scored.arrays).to_pandas().groupby("window")["nll"].mean()
        figures += [("window_nll", float(v), int(k)) for k, v in per_window.items()]
    return [Metric(key + suffix, value, timestamp, step) for suffix in scored.suffixes for key, value, step in figures]


# what a reviewer compares across variants: on the parent as ``<variant>.<figure>``, columns of the runs table
AT_A_GLANCE = ("ppl", "delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "kld_mean", "top1_agreement")


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# where a model's row goes in the parent run's description: what needs a reviewer first, first
DESCRIPTION_ORDER = {"error": 0, "fail": 1, "ungated": 2, "pass": 2, "baseline": 3}


def description(record: dict) -> str:
    """The parent run's note (MLflow shows it as the run's description): a row per model and its verdict.

    MLflow 3.17 shows a run's description 100 pixels high until "Show more" is pressed, and fades its
    lower half when there is more: the header and four rows fit. So the table is all of it (the run's name
    says the audit's verdict, its ``audit.reason`` tag why), erring and failing variants on top, the
    baseline at the end.
    """
    return _note(TrackedAudit.of_record(record), record)


def _note(audit: TrackedAudit, record: dict) -> str:
    """``description`` of the audit read from ``record`` (whose config the gate's limits are read from)."""
    from tasks.record.plots import ppl_limit
    from tasks.record.report import delta_text, figure_text, kl_figure

    several = audit.result.named  # each row's figures are its worst domain's: a column names it
    lines = ["| model | verdict |" + " domain |" * several + " ΔPPL % [95% CI] | limit ΔPPL % | PPL | KLD | top-1 | bpw |",
             "|---|---|" + "---|" * several + "---|---|---|---|---|---|"]
    for model in sorted(audit.models, key=lambda model: DESCRIPTION_ORDER[model.top.shown]):
        row, flat = model.top.row, model.top.row.as_record()
        top1 = row.divergences.top1_agreement if row.divergences else None
        limit = ppl_limit(record, model.name) if model.role == "variant" else None
        scored = row.measured.scored_fraction if row.measured else 1.0
        # a sequential run's stop
        said = said_as(model.top.shown).upper() + (f" at {100 * scored:.0f}%" if scored < 1 else "")
        said += f", dominated by {row.dominated_by}" if row.dominated_by else ""
        domain = f" {model.domain or '—'} |" * several
        lines.append(f"| {model.name} | {said} |{domain} {delta_text(flat)} | "
                     f"{'—' if limit is None else f'≤ {limit:g}'} | {figure_text(flat, 'ppl', '.4f')} | "
                     f"{kl_figure(flat)} | {'—' if top1 is None else f'{100 * top1.value:.1f}%'} | "
                     f"{figure_text(flat, 'bits_per_weight', '.2f')} |")
    return "\n".join(lines)


def _glance_metrics(record: dict, timestamp: int) -> list:
    """What a reviewer compares across variants (``_glance``) of a record."""
    return _glance(TrackedAudit.of_record(record), timestamp)


def _glance(audit: TrackedAudit, timestamp: int) -> list:
    from mlflow.entities import Metric

    from tasks.record.plots import measured

    result = audit.result
    rows = [(row, "") for row in result.rows]
    rows += [(scored.row, f".{name}") for model in audit.models for name, scored in _named(model.streams).items()]
    # the noise floor's rows (each domain's, in an audit of several), beside the variants' figures
    rows += [(floor, stream.ending) for stream in audit.streams.values() for floor in stream.floor]
    return [Metric(f"{row.variant}.{key}{suffix}", float(value), timestamp, 0) for row, suffix in rows
            for key, value in zip(AT_A_GLANCE, _at_a_glance(row)) if measured(value)]


def _at_a_glance(row: ModelRow) -> tuple[float | None, ...]:
    """A row's figures of ``AT_A_GLANCE``, in its order (None where not measured)."""
    change, kld, top1 = row.figure("delta_ppl_pct"), row.figure("kld_mean"), row.figure("top1_agreement")
    delta = (change.value, change.low, change.high) if change else (None, None, None)
    return row.measured.ppl if row.measured else None, *delta, kld.value if kld else None, top1.value if top1 else None


def _baseline_tags(audit: TrackedAudit) -> dict[str, str]:
    """How the audit had its baseline: ``ppl_audit.baseline`` scored or reused, the reference's key, the baseline's
    key (``tasks.record.history``), whether Prefect's schedule started it, and for a rescore with a reference before it, ``ppl_audit.drift`` (``environment drift`` or ``none``)
    and the drift's line. An audit of several domains has a baseline key and a reference per domain (each its own
    token stream): ``_domain_tags`` instead."""
    return audit.result.naming.whole(audit.streams, partial(_domain_tags, audit), partial(_stream_tags, audit))


def _stream_tags(audit: TrackedAudit, stream: Stream) -> dict[str, str]:
    """``_baseline_tags`` of an audit of one corpus: its one token stream's."""
    said = stream.reference
    tags = {"ppl_audit.baseline": said.baseline, REFERENCE: said.key, POPULATION: stream.population,
            "ppl_audit.reference_problem": said.problem, BASELINE_KEY: said.baseline_key,
            SCHEDULED: "true" if audit.scheduled else None}
    if said.drift:
        from tasks.record.verdict import drift_text

        tags |= {"ppl_audit.drift": "environment drift" if said.drift["drift"] else "none",
                 "ppl_audit.drift_detail": drift_text(said.drift)}
    return {key: value for key, value in tags.items() if value}


def _domain_tags(audit: TrackedAudit, by_stream: Mapping[str | None, Stream]) -> dict[str, str]:
    """``_baseline_tags`` of an audit of several domains: ``ppl_audit.domains`` (their names in the config's order),
    ``ppl_audit.domain_keys`` and ``ppl_audit.domain_references`` (``NAME=KEY`` pairs, a domain without one left
    out), no ``ppl_audit.baseline_key`` nor ``ppl_audit.reference`` (each names one token stream); the baseline scored
    or reused (``NAME=HOW`` pairs where domains differ), the reference's problems and drift on each domain."""
    streams = _named(by_stream)
    said = {name: stream.reference for name, stream in streams.items()}
    how = {s.baseline for s in said.values()}
    tags = {DOMAINS: " ".join(said),
            DOMAIN_KEYS: " ".join(f"{name}={s.baseline_key}" for name, s in said.items() if s.baseline_key),
            DOMAIN_REFERENCES: " ".join(f"{name}={s.key}" for name, s in said.items() if s.key),
            DOMAIN_POPULATIONS: " ".join(f"{name}={stream.population}" for name, stream in streams.items()
                                         if stream.population),
            "ppl_audit.baseline": how.pop() if len(how) == 1 else " ".join(f"{n}={s.baseline}" for n, s in said.items()),
            "ppl_audit.reference_problem": "; ".join(f"{n}: {s.problem}" for n, s in said.items() if s.problem),
            SCHEDULED: "true" if audit.scheduled else None}
    drifts = {name: s.drift for name, s in said.items() if s.drift}
    if drifts:
        from tasks.record.verdict import drift_text

        tags |= {"ppl_audit.drift": "environment drift" if any(d["drift"] for d in drifts.values()) else "none",
                 "ppl_audit.drift_detail": "; ".join(f"{name}: {drift_text(d)}" for name, d in drifts.items())}
    return {key: value for key, value in tags.items() if value}


def _log_batches(client, run_id: str, metrics: list, params: list, tags: list) -> None:
    client.log_batch(run_id, params=params, tags=tags)
    for start in range(0, len(metrics), 1000):  # the server takes at most 1000 metrics a call
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def _delete_partial(client, experiment_id: str, audit_id: str) -> str | None:
    """The parent run id of a complete earlier sync, or None after deleting any partial one."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{AUDIT_ID}` = '{audit_id}'")
    complete = [r for r in runs if r.data.tags.get(COMPLETE) == "true"]
    if complete:
        return complete[0].info.run_id
    for run in runs:
        client.delete_run(run.info.run_id)
    return None


def replay(folder: Path, uri: str | None = None, experiment: str | None = None) -> str:
    """Log a spooled audit record to MLflow; returns the parent run id. Raises if the server fails, leaving the
    parent run it made FAILED."""
    from tasks.record import plots

    record = read_record(folder)
    audit = TrackedAudit.of_record(record)
    uri = tracking_uri(uri or audit.uri)
    client = client_of(uri)
    experiment_id = _experiment(client, experiment or audit.experiment, uri)
    done = _delete_partial(client, experiment_id, audit.audit_id)
    if done:
        return done
    started, timestamp = _span(audit)
    verdict = audit.result.verdict
    datasets = _datasets(audit)
    parent = client.create_run(experiment_id, start_time=started, run_name=f"{audit.name} · {verdict.said.upper()}",
                               tags={AUDIT_ID: audit.audit_id, "audit.verdict": verdict.status,
                                     "audit.reason": verdict.reason[:5000], "ppl_audit.kind": "audit",
                                     "ppl_audit.audit": audit.name, "mlflow.note.content": _note(audit, record),
                                     "mlflow.runColor": plots.COLOURS[verdict.status],
                                     **_baseline_tags(audit)}).info.run_id
    try:
        _log_children(client, experiment_id, parent, audit, record, folder, datasets)
    except BaseException:
        # else it stays RUNNING in the UI for good; the next replay deletes it (``_delete_partial``) and logs it whole
        with suppress(Exception):
            client.set_terminated(parent, "FAILED")
        raise
    client.set_tag(parent, COMPLETE, "true")
    client.set_terminated(parent, "FINISHED", end_time=timestamp)
    return parent


def _span(audit: TrackedAudit) -> tuple[int, int]:
    """When the audit started and ended, in ms: its own, not the replay's (records from before "started" keep the end
    only)."""
    import pandas as pd

    return _ms(pd.Timestamp(audit.started).timestamp()), _ms(pd.Timestamp(audit.created).timestamp())


def _log_children(client, experiment_id: str, parent: str, audit: TrackedAudit, record: dict, folder: Path,
                  datasets: list) -> None:
    """Everything of a replayed audit but its parent run: the parent's figures and artifacts, a run per model, history.
    ``record``: what ``audit`` was read from, which the card, the charts and the report read themselves."""
    import pandas as pd

    from tasks.record import plots
    from tasks.record.card import log_card
    from tasks.record.diagnosis import log_diagnosis_run
    from tasks.record.report import html_report

    started, timestamp = _span(audit)
    _log_batches(client, parent, _glance(audit, timestamp), _params(_audit_params(audit)), [])
    _log_dataset(client, parent, datasets)
    client.log_text(parent, audit.config_text or str(audit.config), "config.yaml")
    client.log_text(parent, audit.result.table, "comparison.txt")
    for name, stream in _named(audit.streams).items():  # each domain's full table, beside its charts
        client.log_text(parent, stream.table, f"{name}/comparison.txt")
    table = [model.top.row.as_record() | {"verdict": model.judged} for model in audit.models]
    client.log_table(parent, pd.DataFrame(table), "comparison.json")
    log_card(client, parent, record, run_link(client.tracking_uri, parent))  # record.json and card/: ppl-audit card
    pictures = plots.pictures(record, folder)
    with tempfile.TemporaryDirectory() as drawn:
        for name, picture in pictures.items():  # their names sort in reading order: the ΔPPL chart first
            (Path(drawn) / name).parent.mkdir(exist_ok=True)  # a domain's charts: DOMAIN/
            (Path(drawn) / name).write_bytes(picture)
        client.log_artifacts(parent, drawn)
    diagnosed = {model.name: log_diagnosis_run(client, experiment_id, model.diagnosis,
                                               {"mlflow.parentRunId": parent, AUDIT_ID: audit.audit_id})
                 for model in audit.models if model.diagnosis is not None}
    runs = {name: ui_link("", experiment_id, run) for name, run in diagnosed.items()}  # from the UI's own root
    client.log_text(parent, html_report(record, pictures, runs), "report.html")  # MLflow's artifact viewer shows it inline
    for model in audit.models:
        _log_model(client, experiment_id, (parent, started, timestamp), audit, model, folder, datasets)
    _log_history(client, experiment_id, parent, audit, record)


def _log_model(client, experiment_id: str, under: tuple[str, int, int], audit: TrackedAudit, model: TrackedModel,
               folder: Path, datasets: list) -> None:
    """A model's run, under the audit's run (``under``: its id, and when the audit started and ended, in ms)."""
    from mlflow.entities import RunTag

    from tasks.record import plots

    parent, started, timestamp = under
    status, row = model.top.shown, model.top.row
    child = client.create_run(experiment_id, start_time=_ms(model.started) if model.started else started,
                              run_name=f"{model.name} · {said_as(status).upper()}", tags={
        "mlflow.parentRunId": parent, AUDIT_ID: audit.audit_id, "ppl_audit.variant": model.name,
        "ppl_audit.kind": model.role, "audit.verdict": status,
        "mlflow.runColor": plots.COLOURS[status],  # the UI's dot and lines for the run: the charts' colours
        "audit.reason": model.reason[:5000],
        **{f"absent.{figure}": why for figure, why in _absent(model.top).items()}}).info.run_id
    own = [RunTag(DOMINATED_BY, row.dominated_by)] if row.dominated_by else []
    own += [RunTag(DOMAIN, model.domain)] if model.domain else []  # what its unsuffixed figures are of
    own += [RunTag(FLOOR, row.floor.said)] if row.floor else []
    for domain, on in _named(model.streams).items():  # each domain's verdict and dominator: compare's rows
        own.append(RunTag(f"audit.verdict.{domain}", on.shown))
        if on.row.dominated_by:
            own.append(RunTag(f"{DOMINATED_BY}.{domain}", on.row.dominated_by))
    _log_batches(client, child, _model_metrics(model, folder, timestamp), _params(_variant_params(audit, model)),
                 [RunTag("ppl_audit.status", model.status), *own])
    _log_dataset(client, child, datasets)
    _log_streams(client, child, folder, model)
    client.set_terminated(child, "FINISHED" if model.status == "ok" else "FAILED",
                          end_time=_ms(model.ended) if model.ended else timestamp)
    if is_registered(model.setup.path):
        tag_version(client, model.setup.path, status, model.reason, child, parent)


def _log_streams(client, child: str, folder: Path, model: TrackedModel) -> None:
    """A model's artifacts of each token stream it was scored on: its per-token table under ``nll/``, and where in
    the text it loses, its figures (a domain's under ``DOMAIN/``) and their chart, drawn for its worst domain only
    (in an audit of several: a chart is a second of a warm demo's three minutes; the report's tables show every
    domain's)."""
    from tasks.record import plots

    for domain, scored in model.streams.items():
        if scored.arrays:
            client.log_artifact(child, str(folder / scored.arrays), "nll")
        if scored.where:
            under = f"{domain}/" if domain else ""
            client.log_dict(child, scored.where, f"{under}where.json")
            if domain == model.domain:
                client.log_figure(child, plots.where_chart(scored.entry, domain), f"{under}where.png")


def _log_history(client, experiment_id: str, parent: str, audit: TrackedAudit, record: dict) -> None:
    """Set this audit beside the earlier audits of its baseline: the size-against-quality chart of all of them
    (``history.png``), and on each variant whose ΔPPL moved since the previous scheduled run, a ``changed`` tag
    (on the parent too, with a line under the description's table). Only an audit of one token stream has one
    baseline key (``TrackedAudit.history_key``): the history sets audits of one stream side by side."""
    from tasks.record.history import audited, history_chart
    from tasks.record.logged import Records

    key = audit.history_key
    if key is None:
        return
    rows = audited(Records(client), experiment_id, key, also=parent)
    if len({row.parent_run_id for row in rows}) > 1:
        client.log_figure(parent, history_chart(rows, key), "history.png")
    changed = [row for row in rows if row.parent_run_id == parent and row.changed]
    for row in changed:
        client.set_tag(row.run_id, CHANGED, row.changed)
    if changed:
        said = "; ".join(f"{row.name} {row.changed}" for row in changed)
        client.set_tag(parent, CHANGED, said[:5000])
        client.set_tag(parent, "mlflow.note.content", f"{_note(audit, record)}\n\n{said}")


def track_diagnosis(found: dict, uri: str | None, experiment: str) -> str:
    """Log a diagnosis made by ``ppl-audit diagnose`` to MLflow, a child of its audit's latest run when there is
    one (the MLflow UI shows it under that run); returns its run id."""
    from tasks.record.diagnosis import log_diagnosis_run

    uri = tracking_uri(uri)
    client = client_of(uri)
    experiment_id = _experiment(client, experiment, uri)
    latest = client.search_runs([experiment_id], filter_string=f"tags.`ppl_audit.audit` = '{found['audit']}' and "
                                                               "tags.`ppl_audit.kind` = 'audit'",
                                order_by=["attributes.start_time DESC"], max_results=1)
    tags = {}
    if latest:
        tags = {"mlflow.parentRunId": latest[0].info.run_id, AUDIT_ID: latest[0].data.tags.get(AUDIT_ID, "")}
    return log_diagnosis_run(client, experiment_id, found, tags)


def track_tune(found: dict, uri: str | None, experiment: str, parent: str | None) -> str:
    """Log a tune to MLflow, a child of the audit of its recipe (run ``parent``, when it was tracked); returns its
    run id."""
    from tasks.record.tuning import log_tune_run

    uri = tracking_uri(uri)
    client = client_of(uri)
    experiment_id = _experiment(client, experiment, uri)
    tags = {}
    if parent:
        tags = {"mlflow.parentRunId": parent, AUDIT_ID: client.get_run(parent).data.tags.get(AUDIT_ID, "")}
    return log_tune_run(client, experiment_id, found, tags)
