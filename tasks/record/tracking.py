"""MLflow records of an audit: a parent run, a nested run per model, made from a spooled record.

``replay`` is idempotent: an audit already complete in the server is left alone, a partial one (the
server died mid-audit) is deleted and logged again, so a synced audit has exactly the runs of a clean one.
Two processes never replay one record at once: they hold it first (``tasks.record.spool.claim``).
"""

from __future__ import annotations

import fcntl
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tasks.config import EvaluationConfig
from tasks.core.places import home, tracking_uri
from tasks.data.registry import is_registered, tag_version
from tasks.record.figures import SHOWN
from tasks.record.spool import read_record
from tasks.record.tags import (AUDIT_ID, BASELINE_KEY, CHANGED, COMPLETE, DOMAIN, DOMAIN_KEYS, DOMAIN_POPULATIONS,
                               DOMAIN_REFERENCES, DOMAINS, DOMINATED_BY, FLOOR, POPULATION, REFERENCE, SCHEDULED)
from tasks.record.verdict import said as said_as

EXPERIMENT_KIND = "mlflow.experimentKind"  # read by MLflow 3's UI: which view an experiment opens in
METRICS = ("ppl", "mean_nll", "stderr", "ppl_stderr", "nll_sum", "n_tokens", "bits_per_byte", "byte_ppl", "word_ppl",
           "tokens_per_second", "wall_seconds", "peak_memory_bytes")
FACT_METRICS = ("load_seconds", "size_on_disk_bytes", "weight_memory_bytes", "bits_per_weight", "model_bits_per_weight",
                "quantized_layers", "kv_bytes_per_token")
COMPARISON_PREFIXES = ("delta_", "ppl_ratio", "kld_", "top1_", "dp_", "window_lnppl", "token_lnppl", "divergence_mib",
                       "kv_saving_pct", "kv_window_mib",
                       "windows", "scored_fraction",  # the windows the paired intervals rest on; how much was scored
                       *(figure.key for figure in SHOWN))  # and every per-model figure shown, with its interval


def _absent(entry: dict) -> dict[str, str]:
    """Each figure a model's run lacks, and why: a tag, so that an empty column in the UI is explained."""
    absent = dict((entry["result"] or {}).get("absent", {}))
    if entry["row"].get("divergence_absent"):
        absent["kld_mean"] = entry["row"]["divergence_absent"]
    return absent


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


def _datasets(record: dict) -> list:
    """The corpus a run was scored on as MLflow inputs: each domain's, in an audit of several (their sum, the
    record's ``corpus``, names no one source)."""
    from tasks.record.domains import domain_view

    if "domains" not in record:
        return [_dataset_input(record)]
    return [_dataset_input(domain_view(record, name)) for name in record["domains"]]


def _dataset_input(record: dict):
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    corpus = record["corpus"]
    source_name = corpus["source"]
    if source_name.startswith("hf:"):
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        source = HuggingFaceDatasetSource(path=source_name[3:], config_name=corpus["hf_config"], split=corpus["hf_split"])
    else:
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # MLflow warns that resolving by registry will change one day
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(corpus.get("location") or source_name)
    name = Path(source_name).name or source_name
    name = f"{record['domain']}: {name}" if record.get("domain") else name  # two domains may share a file name
    dataset = MetaDataset(source=source, name=name, digest=corpus["digest"][:16])
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


def _audit_params(record: dict) -> dict:
    config, corpus, env = record["config"], record["corpus"], record["environment"]
    evaluation = config["evaluation"]
    params = {"audit": record["name"], "window": evaluation["window"],
              "stride": EvaluationConfig.of_record(evaluation).stride, "batch_size": evaluation["batch_size"],
              "bos": corpus["bos"], "max_tokens": evaluation["max_tokens"], "corpus.source": corpus["source"],
              "corpus.digest": corpus["digest"], "corpus.tokens": corpus["n_tokens"], "hardware": env["hardware"],
              "corpus.tokenizer": corpus.get("tokenizer", "transformers"),  # a record of before #54 had none
              "baseline": config["baseline"]["path"]}
    params.update({f"version.{k}": v for k, v in env["versions"].items()})
    for name, domain in record.get("domains", {}).items():  # the top's corpus is the domains' sum: each one's own
        params.update({f"corpus.source.{name}": domain["corpus"]["source"], f"corpus.digest.{name}": domain["corpus"]["digest"],
                       f"corpus.tokens.{name}": domain["corpus"]["n_tokens"],
                       f"max_tokens.{name}": domain["config"]["evaluation"]["max_tokens"]})
    return params


def _variant_params(record: dict, entry: dict) -> dict:
    spec, facts, manifest = entry["spec"], entry["facts"] or {}, entry["manifest"] or {}
    params = {**_audit_params(record), "variant": entry["name"], "method": facts.get("method") or spec["method"],
              # the method as the audit's table says it (its format's label: "gptq 4-bit g32 tuned", "baseline kv:int8")
              "label": entry["row"].get("method"), "path": spec["path"],
              "bits": spec["bits"] or manifest.get("bits"), "group_size": spec["group_size"] or manifest.get("group_size"),
              "sym": spec["sym"] if spec["sym"] is not None else manifest.get("sym"), "dtype": facts.get("dtype", spec["dtype"]),
              "device": facts.get("device", spec["device"]), "backend": facts.get("backend"),
              "worker": facts.get("worker"), "kv_cache": facts.get("kv_cache") or None, "body": facts.get("body"),
              "shards": sum("failed" not in row for row in entry.get("shards", [])) or None,
              "calibration.digest": (manifest.get("calibration") or {}).get("digest"),
              "mode": record["config"]["evaluation"]["mode"], "reference": entry["row"].get("reference"),
              "calibration.samples": (manifest.get("calibration") or {}).get("samples"),
              "source_model_digest": manifest.get("source_model_digest")}
    # the format's own facts: a GGUF's file type and bits per weight, a compressed-tensors scheme and whether
    # its activations were quantized, how method auto found the method
    params.update({f"format.{key}": value if isinstance(value, (str, int, float)) else str(value)
                   for key, value in (facts.get("quantization") or {}).items() if key != "llama_cpp"})
    # what llama.cpp ran it with (runtime: llama.cpp): threads, batch, type_k, type_v, flash_attn, gpu_layers
    params.update({f"llama_cpp.{key}": value for key, value in
                   ((facts.get("quantization") or {}).get("llama_cpp") or {}).items()})
    params["runtime"] = spec.get("runtime", "transformers")
    # a sequential run: the order's seed and whether it stopped (its bounds at the stop are the row's)
    params.update({f"sequential.{key}": entry["sequential"][key] for key in ("seed", "stopped", "decision")
                   if key in entry.get("sequential", {})})
    for name, own in _on_domains(record, entry).items():  # each domain's KL came from its own reference
        params[f"reference.{name}"] = own["row"].get("reference")
    return params


def _on_domains(record: dict, entry: dict) -> dict[str, dict]:
    """The model's entry on each domain of an audit of several, by domain; {} for a one-corpus audit."""
    from tasks.record.domains import entry_on

    return {name: entry_on(record, name, entry["name"]) for name in record.get("domains", {})}


def _metrics(record: dict, entry: dict, folder: Path, timestamp: int) -> list:
    """A model's run's metrics: its figures (of its worst domain, in an audit of several), the facts of the model
    and, in an audit of several, each domain's figures as ``<metric>.<DOMAIN>``."""
    from mlflow.entities import Metric

    from tasks.record.plots import measured

    facts = entry["facts"] or {}
    metrics = [Metric(key, float(facts[key]), timestamp, 0) for key in FACT_METRICS if measured(facts.get(key))]
    domains = _on_domains(record, entry)
    if not domains:
        return _figures(entry, folder, timestamp) + metrics
    for name, own in domains.items():  # the worst domain's figures are also the run's own, unsuffixed: read once
        metrics += _figures(own, folder, timestamp, (f".{name}", "") if name == entry.get("domain") else (f".{name}",))
    return metrics


def _figures(entry: dict, folder: Path, timestamp: int, suffixes: tuple[str, ...] = ("",)) -> list:
    """What scoring the model on one token stream gave: its result's figures, its comparison with the baseline, its
    mean NLL per window (``window_nll``, a step per window), under each name ending in each of ``suffixes``."""
    import pyarrow.parquet as pq
    from mlflow.entities import Metric

    from tasks.record.plots import measured

    figures = []  # (name, value, step)
    result, row = entry["result"] or {}, entry["row"]
    figures += [(key, float(result[key]), 0) for key in METRICS if result.get(key) is not None]
    figures += [(key, float(value), 0) for key, value in row.items()
                if key.startswith(COMPARISON_PREFIXES) and measured(value)]
    if entry.get("arrays"):
        per_window = pq.read_table(folder / entry["arrays"]).to_pandas().groupby("window")["nll"].mean()
        figures += [("window_nll", float(v), int(k)) for k, v in per_window.items()]
    return [Metric(key + suffix, value, timestamp, step) for suffix in suffixes for key, value, step in figures]


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
    from tasks.record.plots import ppl_limit, verdict_of
    from tasks.record.report import delta_text, figure_text, kl_figure

    several = "domains" in record  # each row's figures are its worst domain's: a column names it
    lines = ["| model | verdict |" + " domain |" * several + " ΔPPL % [95% CI] | limit ΔPPL % | PPL | KLD | top-1 | bpw |",
             "|---|---|" + "---|" * several + "---|---|---|---|---|---|"]
    for entry in sorted(record["variants"], key=lambda entry: DESCRIPTION_ORDER[verdict_of(entry)]):
        row, status = entry["row"], verdict_of(entry)
        top1 = f"{100 * row['top1_agreement']:.1f}%" if "top1_agreement" in row else "—"
        limit = ppl_limit(record, entry["name"]) if entry["role"] == "variant" else None
        scored = row.get("scored_fraction", 1.0)
        said = said_as(status).upper() + (f" at {100 * scored:.0f}%" if scored < 1 else "")  # a sequential run's stop
        said += f", dominated by {row['dominated_by']}" if row.get("dominated_by") else ""
        domain = f" {entry.get('domain') or '—'} |" if several else ""
        lines.append(f"| {entry['name']} | {said} |{domain} {delta_text(row)} | "
                     f"{'—' if limit is None else f'≤ {limit:g}'} | {figure_text(row, 'ppl', '.4f')} | "
                     f"{kl_figure(row)} | {top1} | {figure_text(row, 'bits_per_weight', '.2f')} |")
    return "\n".join(lines)


def _glance_metrics(record: dict, timestamp: int) -> list:
    from mlflow.entities import Metric

    from tasks.record.plots import measured

    entries = [(entry, "") for entry in record["variants"]]
    entries += [(own, f".{name}") for entry in record["variants"] for name, own in _on_domains(record, entry).items()]
    # the noise floor's rows (each domain's, in an audit of several), beside the variants' figures
    entries += [(floor, "") for floor in record.get("floor", [])]
    entries += [(floor, f".{name}") for name, domain in record.get("domains", {}).items()
                for floor in domain.get("floor", [])]
    return [Metric(f"{entry['name']}.{key}{suffix}", float(entry["row"][key]), timestamp, 0)
            for entry, suffix in entries for key in AT_A_GLANCE if measured(entry["row"].get(key))]


def _baseline_tags(record: dict) -> dict[str, str]:
    """How the audit had its baseline: ``ppl_audit.baseline`` scored or reused, the reference's key, the baseline's
    key (``tasks.record.history``), whether Prefect's schedule started it, and for a rescore with a reference before it, ``ppl_audit.drift`` (``environment drift`` or ``none``)
    and the drift's line. An audit of several domains has a baseline key and a reference per domain (each its own
    token stream): ``_domain_tags`` instead."""
    if "domains" in record:
        return _domain_tags(record)
    said = _baseline_said(record)
    tags = {"ppl_audit.baseline": said.get("baseline"), REFERENCE: said.get("key"),
            POPULATION: (record.get("population") or {}).get("digest"),
            "ppl_audit.reference_problem": said.get("problem"), BASELINE_KEY: said.get("baseline_key"),
            SCHEDULED: "true" if record.get("scheduled") else None}
    if said.get("drift"):
        from tasks.record.verdict import drift_text

        drift = said["drift"]
        tags |= {"ppl_audit.drift": "environment drift" if drift["drift"] else "none",
                 "ppl_audit.drift_detail": drift_text(drift)}
    return {key: value for key, value in tags.items() if value}


def _baseline_said(record: dict) -> dict:
    """How the baseline was had on the record's token stream (its entry's ``reference``)."""
    return next((entry.get("reference") or {} for entry in record["variants"] if entry["role"] == "baseline"), {})


def _domain_tags(record: dict) -> dict[str, str]:
    """``_baseline_tags`` of an audit of several domains: ``ppl_audit.domains`` (their names in the config's order),
    ``ppl_audit.domain_keys`` and ``ppl_audit.domain_references`` (``NAME=KEY`` pairs, a domain without one left
    out), no ``ppl_audit.baseline_key`` nor ``ppl_audit.reference`` (each names one token stream); the baseline scored
    or reused (``NAME=HOW`` pairs where domains differ), the reference's problems and drift on each domain."""
    said = {name: _baseline_said(domain) for name, domain in record["domains"].items()}
    how = {s.get("baseline") for s in said.values()}
    tags = {DOMAINS: " ".join(said),
            DOMAIN_KEYS: " ".join(f"{name}={s['baseline_key']}" for name, s in said.items() if s.get("baseline_key")),
            DOMAIN_REFERENCES: " ".join(f"{name}={s['key']}" for name, s in said.items() if s.get("key")),
            DOMAIN_POPULATIONS: " ".join(f"{name}={digest}" for name, digest in
                                         (record.get("population") or {}).get("domains", {}).items() if digest),
            "ppl_audit.baseline": how.pop() if len(how) == 1 else " ".join(f"{n}={s.get('baseline')}" for n, s in said.items()),
            "ppl_audit.reference_problem": "; ".join(f"{n}: {s['problem']}" for n, s in said.items() if s.get("problem")),
            SCHEDULED: "true" if record.get("scheduled") else None}
    drifts = {name: s["drift"] for name, s in said.items() if s.get("drift")}
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
    uri = tracking_uri(uri or record["config"]["tracking"]["uri"])
    client = client_of(uri)
    experiment_id = _experiment(client, experiment or record["config"]["tracking"]["experiment"], uri)
    done = _delete_partial(client, experiment_id, record["audit_id"])
    if done:
        return done
    started, timestamp = _span(record)
    verdict = record["verdict"]
    datasets = _datasets(record)
    parent = client.create_run(experiment_id, start_time=started, run_name=f"{record['name']} · {said_as(verdict['status']).upper()}",
                               tags={AUDIT_ID: record["audit_id"], "audit.verdict": verdict["status"],
                                     "audit.reason": verdict["reason"][:5000], "ppl_audit.kind": "audit",
                                     "ppl_audit.audit": record["name"], "mlflow.note.content": description(record),
                                     "mlflow.runColor": plots.COLOURS[verdict["status"]],
                                     **_baseline_tags(record)}).info.run_id
    try:
        _log_children(client, experiment_id, parent, record, folder, datasets)
    except BaseException:
        # else it stays RUNNING in the UI for good; the next replay deletes it (``_delete_partial``) and logs it whole
        with suppress(Exception):
            client.set_terminated(parent, "FAILED")
        raise
    client.set_tag(parent, COMPLETE, "true")
    client.set_terminated(parent, "FINISHED", end_time=timestamp)
    return parent


def _span(record: dict) -> tuple[int, int]:
    """When the audit started and ended, in ms: its own, not the replay's (records from before "started" keep the end
    only)."""
    import pandas as pd

    return (_ms(pd.Timestamp(record.get("started", record["created"])).timestamp()),
            _ms(pd.Timestamp(record["created"]).timestamp()))


def _log_children(client, experiment_id: str, parent: str, record: dict, folder: Path, datasets: list) -> None:
    """Everything of a replayed audit but its parent run: the parent's figures and artifacts, a run per model, history."""
    import pandas as pd
    from mlflow.entities import RunTag

    from tasks.record import plots
    from tasks.record.card import log_card
    from tasks.record.diagnosis import log_diagnosis_run
    from tasks.record.report import html_report

    started, timestamp = _span(record)
    _log_batches(client, parent, _glance_metrics(record, timestamp), _params(_audit_params(record)), [])
    _log_dataset(client, parent, datasets)
    client.log_text(parent, record["config_text"] or str(record["config"]), "config.yaml")
    client.log_text(parent, record["table"], "comparison.txt")
    for name, domain in record.get("domains", {}).items():  # each domain's full table, beside its charts
        client.log_text(parent, domain["table"], f"{name}/comparison.txt")
    table = [{k: v for k, v in entry["row"].items()} | {"verdict": (entry["verdict"] or {}).get("status", "baseline")}
             for entry in record["variants"]]
    client.log_table(parent, pd.DataFrame(table), "comparison.json")
    log_card(client, parent, record, run_link(client.tracking_uri, parent))  # record.json and card/: ppl-audit card
    pictures = plots.pictures(record, folder)
    with tempfile.TemporaryDirectory() as drawn:
        for name, picture in pictures.items():  # their names sort in reading order: the ΔPPL chart first
            (Path(drawn) / name).parent.mkdir(exist_ok=True)  # a domain's charts: DOMAIN/
            (Path(drawn) / name).write_bytes(picture)
        client.log_artifacts(parent, drawn)
    diagnosed = {entry["name"]: log_diagnosis_run(client, experiment_id, entry["diagnosis"],
                                        {"mlflow.parentRunId": parent, AUDIT_ID: record["audit_id"]})
                 for entry in record["variants"] if "problem" not in entry.get("diagnosis", {"problem": None})}
    runs = {name: ui_link("", experiment_id, run) for name, run in diagnosed.items()}  # from the UI's own root
    client.log_text(parent, html_report(record, pictures, runs), "report.html")  # MLflow's artifact viewer shows it inline
    for entry in record["variants"]:
        status = plots.verdict_of(entry)
        child = client.create_run(experiment_id, start_time=_ms(entry["started"]) if entry.get("started") else started,
                                  run_name=f"{entry['name']} · {said_as(status).upper()}", tags={
            "mlflow.parentRunId": parent, AUDIT_ID: record["audit_id"], "ppl_audit.variant": entry["name"],
            "ppl_audit.kind": entry["role"], "audit.verdict": status,
            "mlflow.runColor": plots.COLOURS[status],  # the UI's dot and lines for the run: the charts' colours
            "audit.reason": ((entry["verdict"] or {}).get("reason") or entry["reason"])[:5000],
            **{f"absent.{figure}": why for figure, why in _absent(entry).items()}}).info.run_id
        own = [RunTag(DOMINATED_BY, entry["row"]["dominated_by"])] if entry["row"].get("dominated_by") else []
        own += [RunTag(DOMAIN, entry["domain"])] if entry.get("domain") else []  # what its unsuffixed figures are of
        own += [RunTag(FLOOR, entry["row"]["floor"]["said"])] if entry["row"].get("floor") else []
        for domain, on in _on_domains(record, entry).items():  # each domain's verdict and dominator: compare's rows
            own.append(RunTag(f"audit.verdict.{domain}", plots.verdict_of(on)))
            if on["row"].get("dominated_by"):
                own.append(RunTag(f"{DOMINATED_BY}.{domain}", on["row"]["dominated_by"]))
        _log_batches(client, child, _metrics(record, entry, folder, timestamp), _params(_variant_params(record, entry)),
                     [RunTag("ppl_audit.status", entry["status"]), *own])
        _log_dataset(client, child, datasets)
        _log_streams(client, child, folder, _on_domains(record, entry) or {None: entry}, entry.get("domain"))
        client.set_terminated(child, "FINISHED" if entry["status"] == "ok" else "FAILED",
                              end_time=_ms(entry["ended"]) if entry.get("ended") else timestamp)
        if is_registered(entry["spec"]["path"]):
            tag_version(client, entry["spec"]["path"], status, ((entry["verdict"] or {}).get("reason") or entry["reason"]),
                        child, parent)
    _log_history(client, experiment_id, parent, record)


def _log_streams(client, child: str, folder: Path, entries: dict, worst: str | None = None) -> None:
    """A model's artifacts of each token stream it was scored on (``entries``, by domain; None for a one-corpus
    audit's): its per-token table under ``nll/``, and where in the text it loses, its figures (a domain's under
    ``DOMAIN/``) and their chart, drawn for its ``worst`` domain only (in an audit of several: a chart is a second
    of a warm demo's three minutes; the report's tables show every domain's)."""
    from tasks.record import plots

    for domain, entry in entries.items():
        if entry.get("arrays"):
            client.log_artifact(child, str(folder / entry["arrays"]), "nll")
        if entry.get("where"):
            under = f"{domain}/" if domain else ""
            client.log_dict(child, entry["where"], f"{under}where.json")
            if domain == worst:
                client.log_figure(child, plots.where_chart(entry, domain), f"{under}where.png")


def _baseline_key(record: dict) -> str | None:
    """The key of the audit's baseline on its token stream; None for an audit of several domains: the history of
    audits (``tasks.record.history``) sets audits of one stream side by side, and one of several has no one key."""
    if "domains" in record:
        return None
    return next((entry.get("reference") or {} for entry in record["variants"] if entry["role"] == "baseline"),
                {}).get("baseline_key")


def _log_history(client, experiment_id: str, parent: str, record: dict) -> None:
    """Set this audit beside the earlier audits of its baseline: the size-against-quality chart of all of them
    (``history.png``), and on each variant whose ΔPPL moved since the previous scheduled run, a ``changed`` tag
    (on the parent too, with a line under the description's table)."""
    from tasks.record.history import audited, history_chart
    from tasks.record.logged import Records

    key = _baseline_key(record)
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
        client.set_tag(parent, "mlflow.note.content", f"{description(record)}\n\n{said}")


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
