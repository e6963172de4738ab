"""The commands on an audit of several corpora (domains): ``compare`` shows one history per domain, each joined with
the one-corpus audits of the same text; ``diagnose --corpus`` picks the domain; a served, event-triggered audit keeps
every domain. The MLflow runs are logged by hand into a real SQLite store, as tracking logs an audit of several
corpora (``tasks.record.tags``: the parent names each domain's keys, a variant's run each domain's figures)."""

from __future__ import annotations

import math

import pytest
from helpers import json_line, make_text, write_config
from mlflow import MlflowClient

from flows.cli import main
from tasks.audit.plan import Event, baseline_alone, baseline_key_of, open_audit
from tasks.record.tags import BASELINE_KEY, COMPLETE, DOMAIN, DOMAIN_KEYS, DOMAIN_REFERENCES, DOMAINS, REFERENCE

EXPERIMENT = "domains"
FIGURES = ("delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "kld_mean", "kld_mean_low", "kld_mean_high")


def two_domains(folder, baseline, prose, code, variant: dict | None = None, code_tokens: int | None = None, **sections):
    """A config auditing ``baseline`` (and ``variant``, else int8) on the texts ``prose`` and ``code`` (domains of those
    names; ``code_tokens``: code's own max_tokens)."""
    import yaml

    path = write_config(folder / "two.yaml", baseline, prose, [variant or {"name": "int8", "method": "torchao-int8"}],
                        name="two", **sections)
    data = yaml.safe_load(path.read_text())
    del data["corpus"]
    data["corpora"] = [{"name": "prose", "source": str(prose)},
                       {"name": "code", "source": str(code)} | ({"max_tokens": code_tokens} if code_tokens else {})]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def texts(tmp_path, corpus_path):
    code = tmp_path / "code.txt"
    code.write_text(make_text(3000, seed=9))
    return corpus_path, code


def figures(delta: float, kld: float) -> dict[str, float]:
    return dict(zip(FIGURES, (delta, delta - 0.5, delta + 0.5, kld, kld * 0.9, kld * 1.1)))


def log_audit(client: MlflowClient, experiment: str, tags: dict, variants: dict[str, tuple[dict, dict]]) -> str:
    """A complete audit's parent run with ``tags`` and a variant run per ``variants`` entry (its tags, metrics)."""
    parent = client.create_run(experiment, tags={"ppl_audit.kind": "audit", COMPLETE: "true", **tags}).info.run_id
    for name, (own, metrics) in variants.items():
        child = client.create_run(experiment, run_name=name, tags={
            "mlflow.parentRunId": parent, "ppl_audit.kind": "variant", "ppl_audit.variant": name, **own}).info.run_id
        client.log_param(child, "method", "torchao-int8")
        for key, value in metrics.items():
            client.log_metric(child, key, value)
        client.set_terminated(child)
    client.set_terminated(parent)
    return parent


def by_run(rows: list[dict]) -> dict[str, dict]:
    return {row["run_id"]: row for row in rows}


def test_compare_shows_each_domain_s_history_joined_with_one_corpus_audits_of_its_text(tmp_path, texts,
                                                                                    tiny_model_dir, capsys):
    prose, code = texts
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = {"uri": uri, "experiment": EXPERIMENT}
    config = two_domains(tmp_path, tiny_model_dir, prose, code, tracking=tracking)
    plan = open_audit(str(config), narrow=baseline_alone, strict=False)
    keys = {d.name: baseline_key_of(plan.alone(d.name)) for d in plan.domains}
    # a domain's key is its one-corpus audit's: the same baseline, text and settings
    alone = write_config(tmp_path / "code.yaml", tiny_model_dir, code, [{"name": "int8", "method": "torchao-int8"}],
                         name="code-only", tracking=tracking)
    assert baseline_key_of(open_audit(str(alone), narrow=baseline_alone, strict=False)) == keys["code"] != keys["prose"]

    client = MlflowClient(uri)
    experiment = client.create_experiment(EXPERIMENT)
    facts = {"bits_per_weight": 8.5, "weight_memory_bytes": 3 * 2**20}
    # int8 is worst on code (its unsuffixed figures and verdict are code's); prose is the other domain's
    per_domain = {f"{k}.prose": v for k, v in figures(0.4, 0.01).items()} | {
        f"{k}.code": v for k, v in figures(3.0, 0.05).items()}
    several = log_audit(client, experiment, {
        "ppl_audit.audit": "two", DOMAINS: "prose code", DOMAIN_KEYS: f"prose={keys['prose']} code={keys['code']}",
        DOMAIN_REFERENCES: "prose=refprose0000001 code=refcode00000001"},
        {"int8": ({"audit.verdict": "fail", DOMAIN: "code"}, figures(3.0, 0.05) | per_domain | facts)})
    one = log_audit(client, experiment, {"ppl_audit.audit": "code-only", BASELINE_KEY: keys["code"],
                                         REFERENCE: "refcode00000002"},
                    {"int8": ({"audit.verdict": "pass"}, figures(1.0, 0.02) | facts)})
    log_audit(client, experiment, {"ppl_audit.audit": "other", BASELINE_KEY: "0123456789abcdef"},
              {"int8": ({"audit.verdict": "pass"}, figures(9.0, 0.2) | facts)})
    children = {parent: client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent}'")[0].info.run_id
                for parent in (several, one)}

    assert main(["compare", str(config), "--json"]) == 0
    out = capsys.readouterr().out
    said = json_line(out)
    assert set(said) == {"domains"} and list(said["domains"]) == ["prose", "code"]
    prose_rows = by_run(said["domains"]["prose"]["variants"])
    code_rows = by_run(said["domains"]["code"]["variants"])
    assert set(prose_rows) == {children[several]}  # the one-corpus audit of code is not prose's
    assert set(code_rows) == {children[several], children[one]}  # one history: the domain and the one-corpus audit
    row = prose_rows[children[several]]
    assert (row["delta_ppl_pct"], row["delta_ppl_pct_high"], row["kld_mean"], row["domain"]) == (0.4, 0.9, 0.01, "prose")
    assert row["verdict"] == "?"  # its verdict across domains is code's: prose's own is not logged
    row = code_rows[children[several]]
    assert (row["delta_ppl_pct"], row["delta_ppl_pct_low"], row["verdict"], row["domain"]) == (3.0, 2.5, "fail", "code")
    row = code_rows[children[one]]
    assert (row["delta_ppl_pct"], row["verdict"], row["domain"], row["audit"]) == (1.0, "pass", None, "code-only")
    assert all(r["bpw"] == 8.5 and r["mib"] == 3 for r in [*prose_rows.values(), *code_rows.values()])
    for name in ("prose", "code"):
        assert said["domains"][name]["baseline_key"] == keys[name]
        assert said["domains"][name]["chart"].endswith(f"{keys[name]}.png")
        assert f"domain {name}, baseline {keys[name]}: " in out
    assert "two/code" in out and "two/prose" in out  # the audit column names the domain

    # a key finds the same history: the baseline key or a domain's reference key
    for key in (keys["code"], "refcode00000001"):
        assert main(["compare", "--baseline", key, "--tracking-uri", uri, "--experiment", EXPERIMENT, "--json"]) == 0
        found = json_line(capsys.readouterr().out)
        assert found["baseline_key"] == key and set(by_run(found["variants"])) == set(code_rows)
    # the one-corpus config's compare is as before: one history, no domains
    assert main(["compare", str(alone), "--json"]) == 0
    found = json_line(capsys.readouterr().out)
    assert "domains" not in found and found["baseline_key"] == keys["code"]
    assert by_run(found["variants"])[children[several]]["delta_ppl_pct"] == 3.0
    assert math.isclose(by_run(found["variants"])[children[one]]["kld_mean_high"], 0.022)


def test_diagnose_corpus_is_checked_before_any_model_loads(tmp_path, texts, tiny_model_dir, capsys):
    prose, code = texts
    config = two_domains(tmp_path, tiny_model_dir, prose, code)
    assert main(["diagnose", str(config), "--variant", "int8", "--corpus", "russian"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("ppl-audit: error: --corpus russian: the audit two has no corpus of that name; its corpora are "
                   "prose, code")
    alone = write_config(tmp_path / "one.yaml", tiny_model_dir, prose, [{"name": "int8", "method": "torchao-int8"}])
    assert main(["diagnose", str(alone), "--variant", "int8", "--corpus", "corpus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("ppl-audit: error: --corpus corpus: the audit tiny has one corpus (corpus:), not several named ones "
                   "(corpora:); leave --corpus out")


def test_an_event_s_audit_of_several_corpora_is_judged_on_every_domain_under_serve(tmp_path, texts, tiny_model_dir,
                                                                                     monkeypatch):
    from tasks.audit.served import Policy

    prose, code = texts
    config = two_domains(tmp_path, tiny_model_dir, prose, code,
                         thresholds={"max_ppl_increase_pct": 2, "per_corpus": {"code": {"max_ppl_increase_pct": 5}}})
    plan = open_audit(str(config))
    policy = Policy.of(str(config), plan.config, [])
    for corpus in (prose, code):  # every domain's text may be read (a served quantize's calibration too)
        policy.check_path("calibration", str(corpus))
    monkeypatch.setenv(*next(iter(policy.environment().items())))
    served = open_audit(str(config), event=Event(model_path=str(tiny_model_dir), name="shipped"))
    assert [v.name for v in served.config.variants] == ["shipped"] and served.by_domain
    assert [d.name for d in served.domains] == ["prose", "code"]
    assert [d.evaluation.text for d in served.domains] == [prose.read_text(), code.read_text()]
    assert [d.config.thresholds.max_ppl_increase_pct for d in served.domains] == [2, 5]  # each domain's own gate


@pytest.mark.usefixtures("prefect_harness")
def test_diagnose_reads_the_domain_it_is_given_and_says_which(tmp_path, texts, tiny_model_dir, capsys):
    prose, code = texts
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # code is shorter (200 tokens: 6 windows of 64 at stride 32), so which stream was read shows in the windows diagnosed
    config = two_domains(tmp_path, tiny_model_dir, prose, code, {"name": "same", "path": str(tiny_model_dir)}, 200,
                         tracking={"uri": uri, "experiment": EXPERIMENT})
    found = {}
    for given in ([], ["--corpus", "code"]):
        assert main(["diagnose", str(config), "--variant", "same", "--restore", "1", "--json", *given]) == 0
        out = capsys.readouterr().out
        said = json_line(out)
        found[said["domain"]] = said
        assert f"windows of the domain {said['domain']} (" in out  # the table's first line names it
    assert (found["prose"]["windows"], found["code"]["windows"]) == (8, 6)  # the first domain without --corpus
    assert found["code"]["kl"] == 0  # the baseline diagnosed against itself
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                              "tags.`ppl_audit.kind` = 'diagnosis'")
    assert sorted(run.data.tags[DOMAIN] for run in runs) == ["code", "prose"]
    assert {run.info.run_name for run in runs} == {"diagnose same on the domain prose", "diagnose same on the domain code"}
