"""``ppl-audit card``: an audit's model card made from its MLflow record alone. One real audit of two domains with a
noise floor, logged to a SQLite store by the real MLflow; every card here is made from what that store holds, and its
figures are held to the audit's own console tables and to huggingface_hub's reader of model cards."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import stat
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from helpers import assert_reads_back, typed, audit_two_domains, free_port, one_line_error
from mlflow import MlflowClient

from flows.cli import main
from tasks.record.card import ARTIFACTS, floor_cell, model_index, render
from tasks.record.domain_view_said import domain_view
from tasks.record.spool import sealed_record_json
from tasks.record.tags import COMPLETE
from tasks.record.verdict_said import said

pytestmark = pytest.mark.usefixtures("prefect_harness")

DOMAINS = ("prose", "other")
# format_table's figure columns, right-aligned: each cell ends where its title does
CONSOLE_FIGURES = ("PPL", "± err", "ΔPPL % [95% CI]", "win", "KLD", "top-1", "bits/B", "tok/s", "bpw", "MiB")
NUMBER = re.compile(r"[-+]?\d+\.\d+")


@pytest.fixture(scope="module")
def audited(tmp_path_factory, tiny_model_dir, corpus_path, cache, prefect_harness):
    """One audit of two domains: int8 and the baseline itself in bfloat16 (``half``: the noise floor's own numerics,
    so within it) against the tiny model, the floor in bfloat16. Returns its store's URI, client, parent run, config and
    the record as the spool wrote it (text)."""
    folder = tmp_path_factory.mktemp("card")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    summary, record_folder = audit_two_domains(
        folder, tiny_model_dir, corpus_path, "carded", prose_tokens=500, other_tokens=400,
        evaluation={"window": 64, "stride": 32, "batch_size": 4, "floor": ["bfloat16"]},
        variants=[{"name": "int8", "method": "torchao-int8"},
                  {"name": "half", "path": str(tiny_model_dir), "dtype": "bfloat16"}],
        thresholds={"max_ppl_increase_pct": 50})
    client = MlflowClient(uri)
    return {"uri": uri, "client": client, "parent": client.get_run(summary.mlflow_run_id), "result": summary,
            "config": folder / "carded.yaml", "record_text": (record_folder / "record.json").read_text()}


def card_of(capsys, audited: dict, *argv: str) -> tuple[str, str]:
    """``ppl-audit card ARGV --tracking-uri`` the audit's store, in-process: (stdout, stderr)."""
    assert main(["card", *argv, "--tracking-uri", audited["uri"]]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def console_rows(table: str) -> dict[str, dict[str, str]]:
    """The figures of a console table (``format_table``) by model: each figure column's cell, cut where its title
    ends (PPL's, the first, is the last word before that)."""
    header, _, *lines = table.splitlines()
    ends = [header.index(title) + len(title) for title in CONSOLE_FIGURES]
    rows = {}
    for line in lines:
        if len(line) < ends[-1] or line.startswith(("token population", "prose:", "other:")):
            continue
        cells = {"PPL": line[: ends[0]].split()[-1]}
        cells |= {title: line[start:end].strip() for title, start, end in zip(CONSOLE_FIGURES[1:], ends, ends[1:])}
        rows[line.split()[0]] = cells
    return rows


def markdown_tables(card: str) -> list[tuple[str, list[dict[str, str]]]]:
    """Each Markdown table of a card with the ``###`` heading above it: its rows as {column: cell}."""
    tables, heading, lines = [], "", card.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("### "):
            heading = line
        if line.startswith("| ") and not lines[i - 1].startswith("|"):
            header = line[2:-2].split(" | ")
            body = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                body.append(dict(zip(header, row[2:-2].split(" | "))))
            tables.append((heading, body))
    return tables


def test_a_record_of_two_domains_and_a_floor_reads_back_as_the_result_every_view_read(audited):
    """``from_record`` gives back what the console printed, ``--by-domain`` and ``--stats full`` too, and the JSON
    line, from the record of an audit of two domains with a noise floor (#68)."""
    assert_reads_back(audited["result"], json.loads(audited["record_text"]))


def test_the_markdown_card_has_the_console_tables_figures(audited, cli):
    """The card of the audit's run, made as a user makes it (the console script), gives each domain's table with the
    very figures that domain's console table printed, each variant's floor, and how to run the audit again."""
    code, card, err = cli("card", audited["parent"].info.run_id, "--tracking-uri", audited["uri"])
    assert code == 0, err
    record = json.loads(audited["record_text"])
    tables = markdown_tables(card)
    assert [heading for heading, _ in tables] == [f"### Domain `{d}` ({record['domains'][d]['corpus']['source']}): PASS"
                                                  for d in DOMAINS for _ in range(3)]  # its table, its floor's, the
    # figures shown beside the gated ones (figures.SHOWN)
    assert card.startswith("## Perplexity audit: carded\n\n**Verdict: PASS.** all 2 variant(s) passed")
    for (_, rows), (_, floors), domain in zip(tables[::3], tables[1::3], DOMAINS):
        console = console_rows(record["domains"][domain]["table"])
        view = domain_view(record, domain)
        assert [row["variant"] for row in rows] == ["baseline", "int8", "half"]
        for row in rows:
            printed, entry = console[row["variant"]], next(e for e in view["variants"] if e["name"] == row["variant"])
            assert (row["bpw"], row["MiB"], row["PPL"]) == (printed["bpw"], printed["MiB"], printed["PPL"])
            assert NUMBER.findall(row["ΔPPL % [95% CI]"]) == NUMBER.findall(printed["ΔPPL % [95% CI]"])
            assert NUMBER.findall(row["KL [95% CI]"])[:1] == NUMBER.findall(printed["KLD"])
            assert NUMBER.findall(row["top-1 [95% CI]"])[:1] == NUMBER.findall(printed["top-1"])
            if entry["role"] == "variant":  # the intervals the console leaves out, in their figures' precision
                low, high = (entry["row"][f"kld_mean_{end}"] for end in ("low", "high"))
                assert row["KL [95% CI]"] == f"{printed['KLD']} [{low:.4f}, {high:.4f}]"
                assert row["verdict"] == said(entry["verdict"]["status"]).upper()
                assert row["floor"] == floor_cell(typed(entry["row"]).floor) != ""
            else:
                assert row["ΔPPL % [95% CI]"] == "—" and row["verdict"] == "baseline" and row["floor"] == ""
        # half is the baseline in bfloat16: the floor's own numerics, which it cannot be told from
        assert next(row for row in rows if row["variant"] == "half")["floor"] == "within bfloat16"
        [floor] = floors
        assert floor["floor"] == "floor-bf16" and floor["dtype"] == "bfloat16"
        assert NUMBER.findall(floor["ΔPPL % [95% CI]"]) == NUMBER.findall(console["floor-bf16"]["ΔPPL % [95% CI]"])
        assert NUMBER.findall(floor["KL [95% CI]"])[:1] == NUMBER.findall(console["floor-bf16"]["KLD"])
        population = record["domains"][domain]["population"]
        assert f"Token population `{population['digest']}`: {population['tokens']:,} tokens" in card
    # how to reproduce: the command, the config as written, the versions it ran with
    assert f"```bash\nppl-audit run carded.yaml\n```\n\n`carded.yaml`:\n\n```yaml\n{record['config_text']}```" in card
    assert f"torch {record['environment']['versions']['torch']}" in card
    assert "Traceback" not in err


def test_the_model_index_is_what_huggingface_hub_reads_and_writes_back(audited, capsys, tmp_path):
    """The model-index card and the Markdown one, as a model card's README.md: huggingface_hub reads its metadata
    (``metadata_load``, ``ModelCard.load``, offline), one result per domain with every model's figures as the console
    printed them, and writing its results back gives the same model index."""
    from huggingface_hub import ModelCard
    from huggingface_hub.repocard import metadata_load
    from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

    run_id = audited["parent"].info.run_id
    front, _ = card_of(capsys, audited, run_id, "--format", "model-index")
    body, _ = card_of(capsys, audited, run_id)
    readme = tmp_path / "README.md"
    readme.write_text(front + "\n" + body)
    index = metadata_load(readme)["model-index"]
    name, results = model_index_to_eval_results(index)
    assert eval_results_to_model_index(name, results) == index and name == "carded"
    card = ModelCard.load(readme)
    assert card.data.model_name == "carded" and len(card.data.eval_results) == len(results)
    assert card.text.lstrip().startswith("## Perplexity audit: carded")
    record = json.loads(audited["record_text"])
    assert [result["dataset"] for result in index[0]["results"]] == \
        [{"name": d, "type": record["domains"][d]["corpus"]["source"]} for d in DOMAINS]
    for result, domain in zip(index[0]["results"], DOMAINS):
        assert result["task"] == {"type": "text-generation", "name": "Text Generation"}
        assert result["source"] == {"name": "ppl-audit", "url": f"runs:/{run_id}"}  # a local store: no page to open
        printed = console_rows(record["domains"][domain]["table"])
        values = {metric["name"].split(" [")[0]: metric["value"] for metric in result["metrics"]}
        assert all(metric["verified"] is False for metric in result["metrics"])  # self-reported, not the Hub's
        for model in ("baseline", "int8", "half"):
            assert values[f"{model} perplexity"] == float(printed[model]["PPL"])
        for model in ("int8", "half"):
            assert values[f"{model} ΔPPL % against baseline"] == float(printed[model]["ΔPPL % [95% CI]"].split()[0])
            assert values[f"{model} mean KL divergence from baseline"] == float(printed[model]["KLD"])
            assert values[f"{model} top-1 agreement % with baseline"] == float(printed[model]["top-1"].rstrip("%"))


def test_the_json_card_holds_the_rows_as_data(audited, capsys):
    out, _ = card_of(capsys, audited, audited["parent"].info.run_id, "--format", "json")
    card = json.loads(out)  # strict JSON: an unmeasured figure is null, never NaN
    record = json.loads(audited["record_text"])
    assert card["verdict"] == record["verdict"] and card["audit_id"] == record["audit_id"]
    assert [section["domain"] for section in card["sections"]] == list(DOMAINS)
    for section in card["sections"]:
        entries = {e["name"]: e for e in record["domains"][section["domain"]]["variants"]}
        assert [row["variant"] for row in section["rows"]] == list(entries)
        for row in section["rows"]:
            figures = entries[row["variant"]]["row"]
            assert row["ppl"] == figures["ppl"] and row["bits_per_weight"] == figures["bits_per_weight"]
            if row["role"] == "variant":
                assert (row["delta_ppl_pct"], row["kld_mean_low"], row["top1_agreement_high"]) == \
                    (figures["delta_ppl_pct"], figures["kld_mean_low"], figures["top1_agreement_high"])
                assert row["floor"]["said"] == figures["floor"]["said"]
            else:
                assert row["delta_ppl_pct"] is None and row["floor"] is None
        assert [floor["name"] for floor in section["floor"]] == ["floor-bf16"]
        assert section["population"] == record["domains"][section["domain"]]["population"]
    assert card["population"] == record["population"]
    assert card["reproduce"]["command"] == "ppl-audit run carded.yaml"
    assert card["model-index"] == model_index(record, f"runs:/{audited['parent'].info.run_id}")


def test_every_tracked_audit_has_its_record_and_card_in_mlflow(audited, capsys, tmp_path):
    """The parent run holds the record as the spool wrote it and the card in every form, each what the command makes."""
    client, run_id = audited["client"], audited["parent"].info.run_id
    assert "record.json" in {a.path for a in client.list_artifacts(run_id)}
    assert {a.path for a in client.list_artifacts(run_id, "card")} == set(ARTIFACTS.values())
    assert Path(client.download_artifacts(run_id, "record.json", str(tmp_path))).read_text() == audited["record_text"]
    for form, name in ARTIFACTS.items():
        logged = Path(client.download_artifacts(run_id, name, str(tmp_path))).read_text()
        assert logged == card_of(capsys, audited, run_id, "--format", form)[0], form


def test_a_models_run_and_the_config_give_the_audits_card(audited, capsys, tmp_path):
    """A model's run id names its audit's card; the config names its newest complete audit; both say which run on
    stderr, and ``--out`` writes the card there instead of stdout."""
    client, parent = audited["client"], audited["parent"]
    expected, _ = card_of(capsys, audited, parent.info.run_id)
    [child] = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' "
                                                              "and tags.`ppl_audit.variant` = 'int8'")
    out, err = card_of(capsys, audited, child.info.run_id)
    assert out == expected
    assert f"card of audit run {parent.info.run_id}: the audit of variant run {child.info.run_id} (int8)\n" in err
    file = tmp_path / "README.md"
    assert main(["card", str(audited["config"]), "--out", str(file)]) == 0  # the config's own tracking store
    captured = capsys.readouterr()
    assert captured.out == "" and file.read_text() == expected
    assert f"card of run {parent.info.run_id}: the newest audit carded in experiment 'tests' (" in captured.err
    assert captured.err.endswith(f"card: {file}\n")


@pytest.fixture(scope="module")
def strangers(audited, tmp_path_factory) -> dict[str, str]:
    """Runs in the audit's store that have no card: a run ppl-audit did not make, and an audit tracked before records
    were logged (its tags, no artifacts); a config of an audit never run, and one whose experiment does not exist."""
    client = audited["client"]
    experiment = audited["parent"].info.experiment_id
    plain = client.create_run(experiment, run_name="someone else's").info.run_id
    old = client.create_run(experiment, tags={"ppl_audit.kind": "audit", "ppl_audit.audit": "older",
                                              COMPLETE: "true"}).info.run_id
    folder = tmp_path_factory.mktemp("strangers")
    config = yaml.safe_load(audited["config"].read_text())
    (folder / "never.yaml").write_text(yaml.safe_dump(config | {"name": "never"}))
    elsewhere = config | {"tracking": config["tracking"] | {"experiment": "elsewhere"}}
    (folder / "elsewhere.yaml").write_text(yaml.safe_dump(elsewhere))
    return {"plain": plain, "old": old, "never": str(folder / "never.yaml"), "elsewhere": str(folder / "elsewhere.yaml"),
            "folder": str(folder)}


@pytest.mark.parametrize("expected,argv", [
    pytest.param("no run 0123456789abcdef0123456789abcdef in sqlite:", ["0123456789abcdef0123456789abcdef"],
                 id="unknown-run-id"),
    pytest.param("run {plain} (someone else's) is not an audit of ppl-audit (it has no ppl_audit.kind tag)", ["{plain}"],
                 id="not-an-audit"),
    pytest.param("run {old} has no record.json: it was tracked before ppl-audit logged records and cards; re-run the "
                 "audit", ["{old}"], id="audit-tracked-before-records"),
    pytest.param("no complete audit never in experiment 'tests'", ["{never}"], id="config-never-audited"),
    pytest.param("no experiment 'elsewhere' in sqlite:", ["{elsewhere}"], id="config-experiment-missing"),
    pytest.param("no experiment 'nowhere' in sqlite:", ["{never}", "--experiment", "nowhere"], id="unknown-experiment"),
    pytest.param("'nonsense' is neither an audit config (no such file) nor an MLflow run id", ["nonsense"],
                 id="neither-config-nor-run"),
    pytest.param("config not found: {folder}/gone.yaml", ["{folder}/gone.yaml"], id="missing-config"),
    pytest.param("--experiment goes with a CONFIG", ["{plain}", "--experiment", "tests"], id="experiment-with-run-id"),
    pytest.param("the folder {folder}/gone does not exist", ["{plain}", "--out", "{folder}/gone/README.md"],
                 id="out-in-missing-folder"),
])
def test_bad_input_gets_one_line_and_exit_2(audited, strangers, capsys, expected, argv):
    argv = [arg.format(**strangers) for arg in argv]
    err = one_line_error(capsys, "card", *argv, "--tracking-uri", audited["uri"])
    assert expected.format(**strangers) in err


def logged_record(audited: dict, text: str) -> str:
    """A run of the audit's experiment, tagged as an audit, whose record.json artifact is ``text``; its id."""
    client = audited["client"]
    run = client.create_run(audited["parent"].info.experiment_id, run_name="logged",
                            tags={"ppl_audit.kind": "audit", "ppl_audit.audit": "carded"}).info.run_id
    client.log_text(run, text, "record.json")
    return run


def test_a_record_edited_in_the_artifact_store_is_one_line_not_a_card(audited, capsys, monkeypatch):
    """Issue 67.12: an edited PPL gave a card of it, its ΔPPL no longer following from it, without a word."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # in-process, the download's bar is on stderr
    run = logged_record(audited, audited["record_text"])
    stored = Path(local_file_uri_to_path(audited["client"].get_run(run).info.artifact_uri))  # the store's own folder
    record = json.loads((stored / "record.json").read_text())
    record["variants"][1]["row"]["ppl"] *= 0.5
    (stored / "record.json").write_text(json.dumps(record, indent=2))
    err = one_line_error(capsys, "card", run, "--tracking-uri", audited["uri"])
    assert err.startswith(f"ppl-audit: error: record.json of run {run} was changed after it was written: its figures "
                          "are not the audit's; re-run the audit"), err
    (stored / "record.json").write_text(audited["record_text"][:100])  # cut short: before, a JSON traceback
    err = one_line_error(capsys, "card", run, "--tracking-uri", audited["uri"])
    assert err.startswith(f"ppl-audit: error: record.json of run {run} is not a JSON record (cut short or "
                          "overwritten): its figures are not the audit's"), err


def test_a_record_from_before_records_were_sealed_is_read_with_a_warning(audited, capsys):
    record = json.loads(audited["record_text"])
    record.pop("digest", None)  # as an older ppl-audit wrote it
    run = logged_record(audited, json.dumps(record))
    out, err = card_of(capsys, audited, run)
    assert f"ppl-audit: warning: record.json of run {run} keeps no digest of its content (written by an older " \
           "ppl-audit): its figures are read unchecked" in err.splitlines()
    assert out == card_of(capsys, audited, audited["parent"].info.run_id)[0].replace(audited["parent"].info.run_id, run)


def test_a_tracking_server_that_is_down_is_one_line(capsys):
    err = one_line_error(capsys, "card", "0123456789abcdef0123456789abcdef", "--tracking-uri",
                         f"http://127.0.0.1:{free_port()}")
    assert err.startswith("ppl-audit: error: cannot reach the tracking server http://127.0.0.1:")


def test_the_card_reads_every_record_the_spool_has_written(audited):
    """A record of one corpus (a domain's, as its one-corpus audit's) has the same table as that domain's section; a
    record from before the floor and the token population gives a card without them, in every form; two domains of
    one source stay two results in the model index."""
    from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

    record = json.loads(audited["record_text"])
    whole = markdown_tables(render(record, "md", "runs:/x"))
    one = render(domain_view(record, "prose"), "md", "runs:/x")
    assert markdown_tables(one)[:2] == [(f"### Results on `{record['domains']['prose']['corpus']['source']}`", rows)
                                        for _, rows in whole[:2]]
    old = copy.deepcopy(domain_view(record, "prose"))
    for gone in ("population", "floor", "config_text", "environment"):
        old.pop(gone)
    for entry in old["variants"]:
        entry["row"].pop("floor", None)
    card = render(old, "md", "runs:/x")
    assert "Tokens (a record from before token population digests): 500 tokens" in card
    assert "| floor |" not in card and "Noise floor" not in card  # no floor: no column, no table
    assert "```yaml\nname: carded\n" in card and "Ran on an unrecorded machine" in card
    assert json.loads(render(old, "json", "runs:/x"))["sections"][0]["floor"] == []
    assert render(old, "model-index", "runs:/x").startswith("---\nmodel-index:\n- name: carded\n")
    same = copy.deepcopy(record)
    same["domains"]["other"]["corpus"] = same["domains"]["prose"]["corpus"]
    index = model_index(same, "runs:/x")
    assert [result["dataset"].get("config") for result in index[0]["results"]] == [None, "other"]
    assert eval_results_to_model_index(*model_index_to_eval_results(index)) == index


DOWN = "http://127.0.0.1:{port}"  # a tracking server that is not there: a closed port on this machine
RUN = "0123456789abcdef0123456789abcdef"  # a run id of MLflow's form


def tiny_kl(record: dict) -> dict:
    """``record``'s prose domain as a one-corpus record whose floor and ``half`` (the baseline in bfloat16) lost
    1.6e-5 nats a token: what the float16 floor of a small model measures."""
    view = copy.deepcopy(domain_view(record, "prose"))
    rows = [view["floor"][0]["row"], next(e for e in view["variants"] if e["name"] == "half")["row"]]
    for row in rows:
        row.update(kld_mean=1.6e-5, kld_mean_low=1.2e-5, kld_mean_high=2.1e-5)
    return view


def test_a_tiny_kl_keeps_its_digits_in_every_view(audited):
    """A mean KL of 1.6e-5 is never 0.0000: the card (Markdown, model index, .eval_results), report.html, the console
    table, the run's description and compare's table give it, and its interval, to two significant digits."""
    from huggingface_hub.repocard_data import model_index_to_eval_results

    from tasks.record.history import Audited, format_history
    from tasks.record.report import html_report
    from tasks.record.tracking import description
    from tasks.record.verdict import format_table

    view = tiny_kl(json.loads(audited["record_text"]))
    [(_, rows), (_, floors), (_, further)] = markdown_tables(render(view, "md", "runs:/x"))
    assert list(further[0]) == ["variant", "confident flips"]
    assert next(row for row in rows if row["variant"] == "half")["KL [95% CI]"] == "1.6e-05 [1.2e-05, 2.1e-05]"
    assert floors[0]["KL [95% CI]"] == "1.6e-05 [1.2e-05, 2.1e-05]"
    _, results = model_index_to_eval_results(model_index(view, "runs:/x"))
    kl = next(result for result in results if result.metric_name.startswith("half mean KL"))
    assert kl.metric_value == 1.6e-05 and kl.metric_name.endswith("[95% CI 1.2e-05, 2.1e-05]")
    assert '<td class="n">1.6e-05</td>' in html_report(view, {})
    floor = view["floor"][0]["row"]
    assert "1.6e-05" in format_table([typed(floor)], {}).splitlines()[-1]
    assert "| 1.6e-05 |" in description(view)
    audited_row = Audited("half", "bf16", "carded", "r", "p", datetime.now(timezone.utc), False, "pass", 0.01, -0.1,
                          0.1, 1.6e-5, 1.2e-5, 2.1e-5, 16.0, 1.0, math.nan, None)
    assert "1.6e-05" in format_history([audited_row])


WIKITEXT = {"source": "hf:Salesforce/wikitext", "hf_config": "wikitext-2-raw-v1", "hf_split": "test"}


@pytest.fixture(scope="module")
def on_the_hub(audited) -> str:
    """An audit's run whose record says its prose domain read a Hub dataset (its other domain a local file): logged
    to the audit's store as tracking logs a record, for the card of what only the Hub's datasets give."""
    record = json.loads(audited["record_text"])
    record["domains"]["prose"]["corpus"] |= WIKITEXT
    client = audited["client"]
    run = client.create_run(audited["parent"].info.experiment_id, run_name="on the hub",
                            tags={"ppl_audit.kind": "audit", "ppl_audit.audit": "carded"}).info.run_id
    client.log_text(run, sealed_record_json(record), "record.json")
    return run


def test_eval_results_are_the_hubs_files_one_per_hub_corpus(audited, on_the_hub, capsys, tmp_path):
    """``--format eval-results --out FOLDER`` writes the Hub's ``.eval_results/`` files: one per domain read from a Hub
    dataset (a local one left out, said on stderr), each what huggingface_hub parses and writes back unchanged, with
    the model index's figures of that domain (value and name); on stdout, the files one after another."""
    from huggingface_hub import eval_result_entries_to_yaml, parse_eval_result_entries

    folder = tmp_path / ".eval_results"
    out, err = card_of(capsys, audited, on_the_hub, "--format", "eval-results", "--out", str(folder), "--model-id",
                       "my-org/carded")
    assert out == "" and "other" in err and "left out" in err
    assert f"hf upload my-org/carded {folder} .eval_results" in err  # the files name no model: its repo does
    assert sorted(path.name for path in folder.iterdir()) == ["prose.yaml"]
    entries = yaml.safe_load((folder / "prose.yaml").read_text())
    assert eval_result_entries_to_yaml(parse_eval_result_entries(entries)) == entries
    record = json.loads(audited["record_text"])
    record["domains"]["prose"]["corpus"] |= WIKITEXT
    [prose] = [result for result in model_index(record, f"runs:/{on_the_hub}")[0]["results"]
               if result["dataset"]["name"] == "prose"]
    assert [(entry["value"], entry["notes"]) for entry in entries] == \
        [(metric["value"], metric["name"]) for metric in prose["metrics"]]
    assert all(entry["dataset"] == {"id": "Salesforce/wikitext", "task_id": "wikitext-2-raw-v1"} and
               entry["date"] == record["created"] and "source" not in entry for entry in entries)  # runs:/ is no page
    shown, _ = card_of(capsys, audited, on_the_hub, "--format", "eval-results")
    assert list(yaml.safe_load_all(shown)) == [entries] and shown.startswith("# .eval_results/prose.yaml\n")


def test_an_audit_without_a_hub_corpus_has_no_eval_results(audited, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the console script sends it to its log
    err = one_line_error(capsys, "card", audited["parent"].info.run_id, "--format", "eval-results", "--tracking-uri",
                         audited["uri"])
    assert "no corpus of audit carded is a Hugging Face dataset (hf:NAME)" in err


def test_model_id_names_the_model_the_results_are_of(audited, capsys):
    from huggingface_hub.repocard_data import model_index_to_eval_results

    front, _ = card_of(capsys, audited, audited["parent"].info.run_id, "--format", "model-index", "--model-id",
                       "my-org/carded-int8")
    name, _ = model_index_to_eval_results(yaml.safe_load(front.strip("-\n"))["model-index"])
    assert name == "my-org/carded-int8"
    data, _ = card_of(capsys, audited, audited["parent"].info.run_id, "--format", "json", "--model-id", "my-org/m")
    assert json.loads(data)["model-index"][0]["name"] == "my-org/m"


@pytest.mark.parametrize("model_id", ["carded", "a/b/c", "my-org/carded int8", "/name", "org/", "org/na--me" + "e" * 100])
def test_a_model_id_not_of_the_hubs_form_is_one_line(capsys, model_id):
    err = one_line_error(capsys, "card", RUN, "--model-id", model_id, "--tracking-uri", DOWN.format(port=free_port()))
    assert "--model-id" in err and "ORG/NAME" in err


@pytest.fixture
def places(tmp_path) -> dict[str, Path]:
    """What ``--out`` must not replace: a device, a symbolic link to a file, a FIFO, a folder, a file of /proc."""
    (tmp_path / "target.md").write_text("kept\n")
    (tmp_path / "link.md").symlink_to(tmp_path / "target.md")
    os.mkfifo(tmp_path / "fifo.md")
    (tmp_path / "folder").mkdir()
    return {"device": Path("/dev/full"), "symlink": tmp_path / "link.md", "fifo": tmp_path / "fifo.md",
            "folder": tmp_path / "folder", "proc": Path("/proc/version")}


SAID = {"device": "is a device", "symlink": "is a symbolic link", "fifo": "is a FIFO", "folder": "is a folder",
        "proc": "cannot write a file in /proc"}


@pytest.mark.parametrize("place", SAID)
def test_out_is_a_regular_file_or_a_new_one_else_one_line_before_mlflow_is_read(capsys, places, place):
    """Nothing but a regular file, or a new one in a folder, is replaced by the card; the rest is refused before the
    tracking server is asked (here one that is down: its line would come first otherwise), and left as it was."""
    path = places[place]
    before = os.lstat(path)
    err = one_line_error(capsys, "card", RUN, "--out", str(path), "--tracking-uri", DOWN.format(port=free_port()))
    assert f"--out {path}" in err and SAID[place] in err, err
    after = os.lstat(path)
    assert (stat.S_IFMT(after.st_mode), after.st_ino) == (stat.S_IFMT(before.st_mode), before.st_ino)
    if place == "symlink":
        assert os.readlink(path) == str(places["symlink"].parent / "target.md")
        assert (path.parent / "target.md").read_text() == "kept\n"
    assert sorted(p.name for p in places["symlink"].parent.iterdir()) == ["fifo.md", "folder", "link.md", "target.md"]


def test_out_replaces_a_regular_file_and_leaves_nothing_beside_it(audited, capsys, tmp_path):
    file = tmp_path / "README.md"
    file.write_text("an old card\n")
    expected, _ = card_of(capsys, audited, audited["parent"].info.run_id)
    card_of(capsys, audited, audited["parent"].info.run_id, "--out", str(file))
    assert file.read_text() == expected and [p.name for p in tmp_path.iterdir()] == ["README.md"]


LONG_ID = "f" * 1000


@pytest.mark.parametrize("argv,expected", [
    pytest.param(["card", LONG_ID], f"'{'f' * 40}…' (1000 characters) is neither an audit config", id="card-long"),
    pytest.param(["card", "/" + "d" * 300 + ".yaml"], "(306 characters) is neither an audit config", id="card-long-yaml"),
    pytest.param(["compare", "--audits", LONG_ID, RUN], f"--audits: '{'f' * 40}…' (1000 characters) is not an MLflow "
                 "run id", id="compare-long"),
    pytest.param(["compare", "--audits", "not-a-run", RUN], "'not-a-run' is not an MLflow run id (32 hex digits",
                 id="compare-not-a-run-id"),
])
def test_a_run_id_argument_is_checked_for_form_first(capsys, argv, expected):
    err = one_line_error(capsys, *argv, "--tracking-uri", DOWN.format(port=free_port()))
    assert expected in err and len(err) < 300, err


@pytest.mark.parametrize("argv", [
    pytest.param(["card", "{config}"], id="card-config"),
    pytest.param(["card", "{config}", "--tracking-uri", "{down}"], id="card-config-tracking-uri"),
    pytest.param(["card", RUN, "--tracking-uri", "{down}"], id="card-run-id"),
    pytest.param(["compare", "--audits", RUN, RUN[::-1], "--tracking-uri", "{down}"], id="compare-audits"),
    pytest.param(["compare", "--baseline", "k", "--tracking-uri", "{down}"], id="compare-baseline"),
])
def test_a_tracking_server_that_is_down_is_the_same_line_everywhere(audited, capsys, tmp_path, argv):
    down = DOWN.format(port=free_port())
    config = yaml.safe_load(audited["config"].read_text())
    (tmp_path / "down.yaml").write_text(yaml.safe_dump(config | {"tracking": config["tracking"] | {"uri": down}}))
    err = one_line_error(capsys, *[arg.format(config=tmp_path / "down.yaml", down=down) for arg in argv])
    assert err == f"ppl-audit: error: cannot reach the tracking server {down}; is it up, and is that its address?"
