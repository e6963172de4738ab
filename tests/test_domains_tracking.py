"""An audit of several domains as MLflow holds it: each model's run with every domain's figures, the parent's tags
(the contract ``ppl-audit compare`` reads), the ΔPPL-by-domain chart, the report's section per domain, and a spooled
record synced the same way. One real audit of two domains, logged to a SQLite store by the real MLflow."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import audit_two_domains
from mlflow import MlflowClient


pytestmark = pytest.mark.usefixtures("prefect_harness")

DOMAINS = ("prose", "other")


@pytest.fixture(scope="module")
def audited(tmp_path_factory, trained_model_dir, noisy_model_dir, corpus_path, prefect_harness):
    """One audit of two domains: int8 and noisy against the trained model, the domain ``other`` with a gate of its
    own. Returns (client, parent run, record, the record's folder)."""
    folder = tmp_path_factory.mktemp("domains")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    summary, record_folder = audit_two_domains(
        folder, trained_model_dir, corpus_path, "domains", prose_tokens=700, other_tokens=500,
        evaluation={"window": 64, "stride": 32, "batch_size": 4},
        variants=[{"name": "int8", "method": "torchao-int8"}, {"name": "noisy", "path": str(noisy_model_dir)}],
        thresholds={"max_ppl_increase_pct": 5, "per_corpus": {"other": {"max_ppl_increase_pct": 50}}})
    client = MlflowClient(uri)
    record = json.loads((record_folder / "record.json").read_text())
    assert list(record["domains"]) == list(DOMAINS)
    return client, client.get_run(summary.mlflow_run_id), record, record_folder


def children(client: MlflowClient, parent) -> dict:
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {r.data.tags["ppl_audit.variant"]: r for r in runs}


def on(record: dict, domain: str, model: str) -> dict:
    return next(e for e in record["domains"][domain]["variants"] if e["name"] == model)


def test_each_model_run_has_its_worst_domains_figures_and_each_domains_own(audited):
    client, parent, record, _ = audited
    runs = children(client, parent)
    assert set(runs) == {"baseline", "int8", "noisy"}
    for entry in record["variants"]:
        run = runs[entry["name"]]
        metrics = run.data.metrics
        assert run.data.tags["ppl_audit.domain"] == entry["domain"] in DOMAINS  # what the unsuffixed figures are of
        assert metrics["ppl"] == entry["row"]["ppl"] == on(record, entry["domain"], entry["name"])["row"]["ppl"]
        assert "weight_memory_bytes" in metrics and not any(k.startswith("weight_memory_bytes.") for k in metrics)
        nll = [a.path for a in client.list_artifacts(run.info.run_id, "nll")]
        assert nll == sorted(f"nll/{d}.{entry['name']}.parquet" for d in DOMAINS)
        for domain in DOMAINS:
            own = on(record, domain, entry["name"])
            assert metrics[f"ppl.{domain}"] == own["result"]["ppl"] and metrics[f"n_tokens.{domain}"] == own["result"]["n_tokens"]
            windows = client.get_metric_history(run.info.run_id, f"window_nll.{domain}")
            assert [m.step for m in windows] == list(range(len(windows))) and len(windows) > 5
            if entry["role"] == "variant":
                for key in ("delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "kld_mean", "top1_agreement",
                            "scored_fraction"):
                    assert metrics[f"{key}.{domain}"] == own["row"][key], (entry["name"], key, domain)
                assert run.data.params[f"reference.{domain}"] == own["row"]["reference"]
                assert run.data.tags[f"audit.verdict.{domain}"] == own["verdict"]["status"]  # compare's per domain
                artifacts = {a.path for a in client.list_artifacts(run.info.run_id, domain)}
                # the chart of where it loses for its worst domain only; the figures for every domain
                chart = {f"{domain}/where.png"} if domain == entry["domain"] else set()
                assert artifacts == {f"{domain}/where.json"} | chart
        if entry["role"] == "variant":
            assert metrics["delta_ppl_pct"] == on(record, entry["domain"], entry["name"])["row"]["delta_ppl_pct"]


def test_the_parent_names_each_domain_its_keys_and_each_rows_deciding_domain(audited):
    client, parent, record, _ = audited
    tags, metrics, params = parent.data.tags, parent.data.metrics, parent.data.params
    baselines = {d: on(record, d, "baseline")["reference"] for d in DOMAINS}
    # one token stream's tags would mislead a reader: each domain has its own baseline key and reference instead
    assert "ppl_audit.baseline_key" not in tags and "ppl_audit.reference" not in tags
    assert tags["ppl_audit.domains"] == "prose other"
    assert tags["ppl_audit.domain_keys"] == " ".join(f"{d}={baselines[d]['baseline_key']}" for d in DOMAINS)
    assert tags["ppl_audit.domain_references"] == " ".join(f"{d}={baselines[d]['key']}" for d in DOMAINS)
    for domain in DOMAINS:
        corpus = record["domains"][domain]["corpus"]
        assert params[f"corpus.digest.{domain}"] == corpus["digest"] and params[f"corpus.tokens.{domain}"] == str(corpus["n_tokens"])
        assert params[f"max_tokens.{domain}"] == {"prose": "700", "other": "500"}[domain]
        for name in ("int8", "noisy"):
            assert metrics[f"{name}.delta_ppl_pct.{domain}"] == on(record, domain, name)["row"]["delta_ppl_pct"]
    note = tags["mlflow.note.content"].splitlines()
    assert note[0] == "| model | verdict | domain | ΔPPL % [95% CI] | limit ΔPPL % | PPL | KLD | top-1 | bpw |"
    for entry in record["variants"]:
        line = next(line for line in note if line.startswith(f"| {entry['name']} |"))
        assert line.split(" | ")[2] == entry["domain"]
        if entry["role"] == "variant":  # the limit of the domain that decides it
            limit = {"prose": 5, "other": 50}[entry["domain"]]
            assert f"| ≤ {limit} |" in line
    failing = [d for d in DOMAINS if record["domains"][d]["verdict"]["status"] == "fail"]
    assert failing and all(d in tags["audit.reason"] for d in failing)


def test_the_by_domain_chart_and_a_report_section_per_domain(audited, tmp_path):
    import html
    import re

    client, parent, record, _ = audited
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"delta_ppl_by_domain.png", "report.html", *DOMAINS} <= artifacts
    for domain in DOMAINS:
        own = {a.path for a in client.list_artifacts(parent.info.run_id, domain)}
        assert {f"{domain}/delta_ppl_pct.png", f"{domain}/window_delta_nll.png", f"{domain}/comparison.txt"} <= own
    report = Path(client.download_artifacts(parent.info.run_id, "report.html", str(tmp_path))).read_text()
    assert re.findall(r'<img alt="([^"]+)"', report)[0] == "delta_ppl_by_domain.png"  # in the summary, first
    for domain in DOMAINS:
        start = report.index(f'<h2 id="domain-{domain}">Domain {domain} ')
        section = report[start:report.find("<h2", start + 1)]
        assert {f"<th>{name}</th>" for name in ("baseline", "int8", "noisy")} <= set(re.findall(r"<th>\w+</th>", section))
        assert '<img alt="delta_ppl_pct.png"' in section and "<h3>Settings</h3>" in section
        digest = record["domains"][domain]["corpus"]["digest"]
        assert digest in section and record["domains"][domain]["verdict"]["reason"] in html.unescape(section)


def test_sync_replays_a_spooled_record_of_several_domains(audited, tmp_path, monkeypatch):
    from flows.cli import main
    from tasks.record.spool import spooled_damage, sealed_record_json

    client, parent, record, folder = audited
    home = tmp_path / "home"
    spooled = home / "spool" / folder.name
    shutil.copytree(folder, spooled)
    uri = f"sqlite:///{tmp_path / 'synced.db'}"
    kept = json.loads((spooled / "record.json").read_text())
    kept["config"]["tracking"]["uri"] = uri  # sealed again, as written there: sync sends it where it now says
    (spooled / "record.json").write_text(sealed_record_json(kept))
    assert spooled_damage(spooled) is None
    broken = dict(kept, domains={**kept["domains"], "other": {k: v for k, v in kept["domains"]["other"].items()
                                                              if k != "corpus"}})
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "record.json").write_text(json.dumps(broken))
    assert spooled_damage(tmp_path / "broken") == "record.json lacks domains.other.corpus"
    monkeypatch.setenv("PPL_AUDIT_HOME", str(home))
    assert main(["sync"]) == 0
    synced = MlflowClient(uri)
    [again] = synced.search_runs([synced.get_experiment_by_name("tests").experiment_id],
                                 filter_string="tags.`ppl_audit.kind` = 'audit'")
    assert {k: v for k, v in again.data.tags.items() if k.startswith("ppl_audit.domain")} == \
        {k: v for k, v in parent.data.tags.items() if k.startswith("ppl_audit.domain")}
    assert again.data.metrics == parent.data.metrics
    first, second = children(client, parent), children(synced, again)
    assert {n: r.data.metrics for n, r in second.items()} == {n: r.data.metrics for n, r in first.items()}
