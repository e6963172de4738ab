"""MLflow records, read back through MlflowClient: the SQLite store, a real server, and a server that dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import MlflowServer, free_port, wait_for, write_config
from mlflow import MlflowClient

from flows.audit import audit, result_of
from flows.cli import main
from tasks.record.plots import COLOURS

pytestmark = pytest.mark.usefixtures("prefect_harness")

VARIANTS = [{"name": "int8", "method": "torchao-int8"}, {"name": "nf4", "method": "bnb-nf4"},
            {"name": "missing", "path": "MISSING"}]


@pytest.fixture(scope="module", autouse=True)
def isolated(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(tmp_path_factory.mktemp("home")))
        patch.setenv("PPL_AUDIT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def config_for(tmp_path: Path, baseline, corpus, uri: str, name: str = "tracked") -> str:
    variants = [dict(v, path=str(tmp_path / "gone")) if v.get("path") == "MISSING" else v for v in VARIANTS]
    return str(write_config(tmp_path / f"{name}.yaml", baseline, corpus, variants, name=name,
                            thresholds={"max_ppl_increase_pct": 5}, tracking={"uri": uri, "experiment": "tests"}))


def run_audit(config: str, tmp_path: Path):
    """Run the flow after the config was checked, then remove the 'missing' checkpoint's stand-in."""
    state = audit(config=config, return_state=True)
    return result_of(state)


def audits(client: MlflowClient, name: str) -> list:
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`ppl_audit.kind` = 'audit'")
    return [r for r in runs if r.data.tags["ppl_audit.audit"] == name]


def children(client: MlflowClient, parent) -> dict:
    """The parent's nested runs by model name."""
    runs = client.search_runs([parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {r.data.tags["ppl_audit.variant"]: r for r in runs}


def check_record(client: MlflowClient, parent) -> dict:
    """Everything an audit promises to leave in MLflow, for one parent run."""
    assert parent.data.tags["audit.verdict"] == "error" and "missing" in parent.data.tags["audit.reason"]
    assert parent.data.params["window"] == "64" and parent.data.params["corpus.tokens"] == "1500"
    assert len(parent.data.params["corpus.digest"]) == 64 and "version.torch" in parent.data.params
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"config.yaml", "comparison.json", "comparison.txt", "delta_ppl_pct.png", "ppl_by_model.png",
            "window_delta_nll.png", "token_kld_histogram.png", "report.html"} <= artifacts
    assert parent.inputs.dataset_inputs and parent.inputs.dataset_inputs[0].dataset.digest
    runs = children(client, parent)
    # a child's verdict in its name (the runs table's first column) and in a tag (to filter on)
    assert {n: r.info.run_name for n, r in runs.items()} == \
        {"baseline": "baseline · BASELINE", "int8": "int8 · PASS", "nf4": "nf4 · PASS", "missing": "missing · ERROR"}
    assert {n: r.data.tags["audit.verdict"] for n, r in runs.items()} == \
        {"baseline": "baseline", "int8": "pass", "nf4": "pass", "missing": "error"}
    assert {n: r.data.tags["mlflow.runColor"] for n, r in runs.items()} == \
        {n: COLOURS[r.data.tags["audit.verdict"]] for n, r in runs.items()}  # the UI's dot: the charts' colour
    for name in ("baseline", "int8", "nf4"):
        run = runs[name]
        assert {"ppl", "mean_nll", "stderr", "bits_per_byte", "word_ppl", "byte_ppl", "tokens_per_second",
                "load_seconds", "peak_memory_bytes", "size_on_disk_bytes"} <= set(run.data.metrics)
        history = client.get_metric_history(run.info.run_id, "window_nll")
        assert [m.step for m in history] == list(range(len(history))) and len(history) > 10
        assert run.inputs.dataset_inputs
        assert [a.path for a in client.list_artifacts(run.info.run_id, "nll")] == [f"nll/{name}.parquet"]
        assert run.data.params["method"] == {"baseline": "baseline", "int8": "torchao-int8", "nf4": "bnb-nf4"}[name]
    for name in ("int8", "nf4"):
        assert {"delta_ppl", "ppl_ratio", "delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "delta_nll_stderr",
                "window_lnppl_correlation", "kld_mean", "kld_mean_stderr", "kld_p50", "kld_p0.1", "kld_max", "kld_min",
                "kld_reverse_mean", "token_lnppl_correlation", "top1_agreement", "top1_agreement_low", "dp_mean",
                "dp_mean_stderr", "dp_rms", "dp_rms_stderr", "dp_p99.9"} <= set(runs[name].data.metrics)
        # KL was measured against the baseline's stored reference, named on the parent
        assert runs[name].data.params["reference"] == parent.data.tags["ppl_audit.reference"]
        # where in the text it loses: the figures and their chart
        assert {"where.json", "where.png"} <= {a.path for a in client.list_artifacts(runs[name].info.run_id)}
    assert parent.data.tags["ppl_audit.baseline"] in ("scored", "reused")
    assert runs["missing"].info.status == "FAILED"
    # at a glance: the verdict in the parent's name, a row per model in its description, figures as columns
    assert client.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert parent.info.run_name == "tracked · ERROR"
    assert parent.data.tags["mlflow.runColor"] == COLOURS["error"]
    note = parent.data.tags["mlflow.note.content"].splitlines()
    # the table first (MLflow shows the header and four rows before "Show more"), what needs a reviewer on top
    assert note[0] == "| model | verdict | ΔPPL % [95% CI] | limit ΔPPL % | PPL | KLD | top-1 | bpw |"
    assert [line.split(" | ")[0] for line in note[2:6]] == ["| missing", "| int8", "| nf4", "| baseline"]
    assert note[2] == "| missing | ERROR | — | ≤ 5 | — | — | — | — |"
    assert note[5].startswith("| baseline | BASELINE | — | — |")
    assert note[5].endswith("| 32.00 |")  # the float baseline: its dtype's bits
    for name in ("int8", "nf4"):
        row = next(line for line in note if line.startswith(f"| {name} |"))
        assert row.startswith(f"| {name} | PASS | {runs[name].data.metrics['delta_ppl_pct']:+z.2f} [") and "| ≤ 5 |" in row
        assert row.endswith(f"| {runs[name].data.metrics['bits_per_weight']:.2f} |")
        assert parent.data.metrics[f"{name}.delta_ppl_pct"] == runs[name].data.metrics["delta_ppl_pct"]
        assert parent.data.metrics[f"{name}.kld_mean"] == runs[name].data.metrics["kld_mean"]
    assert len(note) == 6 and parent.data.tags["audit.reason"].startswith("missing: ")  # MLflow shows six lines unfolded
    # the audit's own times, not the replay's: every model ran inside the parent's span, one after another
    spans = sorted((r.info.start_time, r.info.end_time) for r in runs.values())
    assert parent.info.start_time <= spans[0][0] and spans[-1][1] <= parent.info.end_time
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    return {n: {k: v for k, v in r.data.metrics.items() if k not in ("tokens_per_second", "wall_seconds",
                                                                        "load_seconds", "peak_memory_bytes")}
            for n, r in runs.items()}


@pytest.mark.slow  # two whole audits
def test_sqlite_store_holds_the_whole_audit_and_repeats_exactly(tmp_path, trained_model_dir, corpus_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = config_for(tmp_path, trained_model_dir, corpus_path, uri)
    first, second = run_audit(config, tmp_path), run_audit(config, tmp_path)
    assert first.mlflow_run_id != second.mlflow_run_id
    client = MlflowClient(uri)
    parents = audits(client, "tracked")
    assert len(parents) == 2
    assert check_record(client, parents[0]) == check_record(client, parents[1])


@pytest.fixture
def server(tmp_path):
    running = MlflowServer(tmp_path)
    running.start()
    yield running
    running.stop()


@pytest.mark.slow  # a real mlflow server, killed mid-audit
def test_real_server_then_server_dies_mid_audit_then_sync(tmp_path, server, trained_model_dir, corpus_path, monkeypatch):
    import tasks.record.plots
    config = config_for(tmp_path, trained_model_dir, corpus_path, server.uri)
    clean = run_audit(config, tmp_path)
    experiment_id = MlflowClient(server.uri).get_experiment_by_name("tests").experiment_id
    # the record's line links the run's page in the model-training view (what MLflow's UI reads: see below)
    assert clean.record.endswith(f": {server.uri}/#/experiments/{experiment_id}/runs/{clean.mlflow_run_id}"
                                    "?workflowType=machine_learning")

    real_chart = tasks.record.plots.delta_ppl_chart

    def dies_while_logging(record):  # the server goes down after the parent run was made
        server.stop()
        return real_chart(record)

    monkeypatch.setattr(tasks.record.plots, "delta_ppl_chart", dies_while_logging)
    interrupted = run_audit(config, tmp_path)
    monkeypatch.setattr(tasks.record.plots, "delta_ppl_chart", real_chart)
    assert interrupted.mlflow_run_id is None and interrupted.verdict.status == "error"
    spooled = sorted((Path(os.environ["PPL_AUDIT_HOME"]) / "spool").iterdir())
    assert len(spooled) == 1
    assert {p.name for p in spooled[0].iterdir()} == {"record.json", "files.json", "baseline.parquet", "int8.parquet",
                                                      "nf4.parquet"}

    server.start()
    client = MlflowClient(server.uri)
    assert len(client.search_runs([client.get_experiment_by_name("tests").experiment_id],
                                  filter_string="tags.`ppl_audit.kind` = 'audit'")) == 2  # clean + partial
    assert main(["sync"]) == 0
    assert main(["sync"]) == 0  # idempotent: nothing left, nothing duplicated
    parents = audits(client, "tracked")
    assert len(parents) == 2  # the partial run is gone, the synced one replaces it
    assert all(p.data.tags.get("ppl_audit.complete") == "true" for p in parents)
    assert check_record(client, parents[0]) == check_record(client, parents[1])


def test_registered_model_version_is_audited_and_tagged(tmp_path, trained_model_dir, noisy_model_dir, corpus_path):
    uri = f"sqlite:///{tmp_path / 'registry.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("models", artifact_location=(tmp_path / "artifacts").as_uri())
    versions = {}
    for name, folder in (("good", trained_model_dir), ("bad", noisy_model_dir)):
        run = client.create_run(experiment).info.run_id
        client.log_artifacts(run, str(folder), "model")
        client.create_registered_model(f"tiny-{name}")
        versions[name] = client.create_model_version(f"tiny-{name}", f"runs:/{run}/model", run_id=run).version
    config = write_config(tmp_path / "registry.yaml", trained_model_dir, corpus_path,
                          [{"name": "good", "path": f"models:/tiny-good/{versions['good']}"},
                           {"name": "bad", "path": f"models:/tiny-bad/{versions['bad']}"}],
                          name="registry", thresholds={"max_ppl_increase_pct": 2}, tracking={"uri": uri, "experiment": "tests"})
    summary = result_of(audit(config=str(config), return_state=True))
    assert {v.name: v.status for v in summary.verdicts} == {"good": "pass", "bad": "fail"}
    good = client.get_model_version("tiny-good", versions["good"])
    assert good.tags["ppl_audit.verdict"] == "pass" and good.tags["ppl_audit.audit_run_id"] == summary.mlflow_run_id
    assert client.get_model_version_by_alias("tiny-good", "ppl-audit-passed").version == versions["good"]
    bad = client.get_model_version("tiny-bad", versions["bad"])
    assert bad.tags["ppl_audit.verdict"] == "fail" and "breaks the limit" in bad.tags["ppl_audit.reason"]
    assert not client.get_registered_model("tiny-bad").aliases


def test_the_ui_opens_the_model_training_view_only_where_a_link_says_so():
    """MLflow 3.17's UI picks its view from the link's ``workflowType`` or the browser's last choice (GenAI
    at first), not from the experiment's ``mlflow.experimentKind``: the links we print rely on that."""
    import mlflow

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    main_js = next(bundle.glob("main.*.js")).read_text()
    assert 'e.get("workflowType")' in main_js and 'MACHINE_LEARNING="machine_learning"' in main_js
    assert 'key:"mlflow.workflowType",version:1,initialValue:c' in main_js and "const c=l.GENAI" in main_js


@pytest.mark.slow  # starts `ppl-audit ui` and its server
def test_ui_lists_each_experiment_with_its_model_training_link(tmp_path, monkeypatch):
    home = tmp_path / "ui-home"
    monkeypatch.setenv("PPL_AUDIT_HOME", str(home))
    home.mkdir()
    experiment_id = MlflowClient(f"sqlite:///{home / 'mlflow.db'}").create_experiment("audits")
    port = free_port()
    ui = subprocess.Popen([str(Path(sys.executable).parent / "ppl-audit"), "ui", "--port", str(port)],
                          stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health").is_success, 120, "the MLflow UI")
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
    lines = ui.communicate(timeout=60)[0].splitlines(keepends=True)
    assert lines[0].startswith(f"MLflow UI on http://127.0.0.1:{port} ")
    assert lines[1] == f"  audits: http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs?workflowType=machine_learning\n"



def test_a_tracking_failure_is_said_in_one_line():
    """Issue 67: a tracking task that failed on a store's SQL said so with the statement, a page of it, in the line
    that says where the record is kept."""
    from prefect import flow, task

    from flows.answers import failure_line, where_logged
    from tasks.config import Tracking

    @task
    def log_it() -> str:
        raise RuntimeError("(sqlite3.OperationalError) table experiments already exists\n[SQL: CREATE TABLE "
                           "experiments (\n\texperiment_id INTEGER NOT NULL\n)]")

    @flow
    def tracked() -> tuple[str, str, str]:  # what the audit flow says of its tracking task's state
        state = log_it(return_state=True)
        return state.message, failure_line(state), where_logged(state, Tracking(), "/spool/x")["record"]

    message, said, record = tracked()
    assert "\n" in message  # Prefect's message holds the whole error
    assert said.endswith("RuntimeError: (sqlite3.OperationalError) table experiments already exists"), said
    assert record == f"kept in /spool/x (tracking failed: {said})"


def test_the_tracked_record_reads_each_field_where_the_record_keeps_it():
    """#68: what MLflow logs is read once into typed values (``TrackedAudit``), of an audit of several domains and of
    one corpus (the demo's stored record, and its domain austen as a one-corpus record): each field is the record's."""
    import json
    import lzma

    from tasks.record.domain_view_said import domain_view
    from tasks.record.tracked_said import TrackedAudit

    record = json.loads(lzma.open(Path(__file__).parent / "records" / "demo-2026-11-29.record.json.xz").read())
    several = TrackedAudit.of_record(record)
    evaluation = record["config"]["evaluation"]
    assert (several.audit_id, several.name, several.started, several.created, several.experiment) == \
        (record["audit_id"], record["name"], record["started"], record["created"], record["config"]["tracking"]["experiment"])
    assert (several.window, several.batch_size, several.max_tokens, several.mode, several.baseline) == \
        (evaluation["window"], evaluation["batch_size"], evaluation["max_tokens"], evaluation["mode"],
         record["config"]["baseline"]["path"])
    assert (several.corpus.digest, several.hardware, several.history_key) == \
        (record["corpus"]["digest"], record["environment"]["hardware"], None)
    assert list(several.streams) == list(record["domains"])
    for name, stream in several.streams.items():
        domain = record["domains"][name]
        assert (stream.domain, stream.corpus.source, stream.corpus.n_tokens, stream.max_tokens, stream.table) == \
            (name, domain["corpus"]["source"], domain["corpus"]["n_tokens"],
             domain["config"]["evaluation"]["max_tokens"], domain["table"])
        assert (stream.reference.baseline_key, stream.population) == \
            (domain["variants"][0]["reference"]["baseline_key"], domain["population"]["digest"])
        assert [row.variant for row in stream.floor] == [floor["name"] for floor in domain["floor"]]
    entry, model = record["variants"][1], several.models[1]
    assert (model.name, model.role, model.status, model.judged, model.reason, model.started, model.domain) == \
        (entry["name"], entry["role"], entry["status"], entry["verdict"]["status"], entry["verdict"]["reason"],
         entry["started"], entry["domain"])
    assert (model.setup.method, model.setup.path, model.setup.dtype, model.setup.backend, model.setup.runtime) == \
        (entry["facts"]["method"], entry["spec"]["path"], entry["facts"]["dtype"], entry["facts"]["backend"],
         entry["spec"]["runtime"])
    assert (model.top.row.as_record(), model.top.arrays, model.top.where) == (entry["row"], entry["arrays"], entry["where"])
    assert {name: scored.suffixes for name, scored in model.streams.items()} == \
        {name: (f".{name}", "") if name == entry["domain"] else (f".{name}",) for name in record["domains"]}
    austen = next(own for own in record["domains"]["austen"]["variants"] if own["name"] == entry["name"])
    assert model.streams["austen"].row.as_record() == austen["row"]
    assert model.streams["austen"].result["ppl"] == austen["result"]["ppl"]

    one = TrackedAudit.of_record({key: value for key, value in domain_view(record, "austen").items() if key != "domain"})
    assert list(one.streams) == [None] and one.streams[None].corpus.digest == record["domains"]["austen"]["corpus"]["digest"]
    assert one.history_key == record["domains"]["austen"]["variants"][0]["reference"]["baseline_key"]
    assert [(m.name, m.domain, tuple(m.streams), m.streams[None].suffixes) for m in one.models] == \
        [(own["name"], None, (None,), ("",)) for own in record["domains"]["austen"]["variants"]]
