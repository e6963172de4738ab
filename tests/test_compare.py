"""``ppl-audit compare``: every variant audited against one baseline across the audits of an experiment, read back from
a real MLflow store (the local SQLite one and a real ``mlflow server``); dominance across audits and what changed
between scheduled runs."""

from __future__ import annotations

import json
import math
import shutil
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from helpers import MlflowServer, json_line, write_config
from mlflow import MlflowClient

from flows.audit import audit, result_of
from flows.cli import main
from tasks.record.history import Audited, mark_changes, mark_dominated
from tasks.record.spool import sealed_record_json
from tasks.record.tracking import replay

pytestmark = pytest.mark.usefixtures("prefect_harness")
EXPERIMENT = "history"


def audited_row(name: str, bpw: float, delta: tuple[float, float, float], kld: tuple[float, float, float] = (math.nan,) * 3,
                audit_run: str = "a", days_ago: int = 0, scheduled: bool = False) -> Audited:
    return Audited(name=name, method="gptq", audit="nightly", run_id=uuid.uuid4().hex, parent_run_id=audit_run,
                   started=datetime(2026, 11, 25, tzinfo=timezone.utc) - timedelta(days=days_ago), scheduled=scheduled,
                   verdict="pass", delta_ppl_pct=delta[0], delta_ppl_pct_low=delta[1], delta_ppl_pct_high=delta[2],
                   kld_mean=kld[0], kld_mean_low=kld[1], kld_mean_high=kld[2], bpw=bpw, mib=100 * bpw, kv_bytes_per_token=math.nan,
                   own_dominator=None)


def test_across_audits_a_variant_is_dominated_only_beyond_both_intervals():
    small = audited_row("q4", 4.5, (1.0, 0.8, 1.2), (0.02, 0.018, 0.022), audit_run="old", days_ago=3)
    overlapping = audited_row("q5", 5.5, (1.1, 0.9, 1.3), (0.03, 0.028, 0.032))
    clearly_worse = audited_row("q6", 6.5, (2.0, 1.7, 2.3), (0.05, 0.045, 0.055))
    kl_overlaps = audited_row("q8", 8.5, (2.0, 1.7, 2.3), (0.021, 0.019, 0.023))
    same_name = audited_row("q4", 4.5, (3.0, 2.8, 3.2), (0.09, 0.08, 0.1))  # a change, not dominance
    rows = [overlapping, clearly_worse, kl_overlaps, same_name, small]
    mark_dominated(rows)
    assert small.dominated_by is None and same_name.dominated_by is None
    assert overlapping.dominated_by is None  # worse by its point estimate, within noise
    assert clearly_worse.dominated_by == "q4 (2026-11-22 00:00)"
    assert kl_overlaps.dominated_by is None  # worse in ΔPPL, not beyond noise in KL
    # within one audit the audit's own (paired) decision stands
    own = audited_row("q5b", 5.5, (1.1, 0.9, 1.3), audit_run="old")
    own.own_dominator = "q4"
    mark_dominated([own, small])
    assert own.dominated_by == "q4"


def test_a_scheduled_run_says_what_moved_beyond_its_interval_since_the_previous_scheduled_one():
    rows = [audited_row("q4", 4.5, (0.61, 0.5, 0.72), audit_run="now", scheduled=True),
            audited_row("q4", 4.5, (0.70, 0.2, 0.9), audit_run="manual", days_ago=1),  # not scheduled: skipped
            audited_row("q4", 4.5, (0.24, 0.1, 0.38), audit_run="before", days_ago=2, scheduled=True),
            audited_row("q4", 4.5, (0.25, 0.1, 0.4), audit_run="first", days_ago=3, scheduled=True),
            audited_row("q8", 8.5, (0.1, 0.0, 0.2), audit_run="now", scheduled=True)]
    mark_changes(rows)
    assert rows[0].changed == "changed since 2026-11-23: +0.24% → +0.61%"
    assert rows[2].changed is None  # +0.25 lies inside [+0.10, +0.38]
    assert rows[1].changed is None and rows[3].changed is None and rows[4].changed is None


@pytest.fixture(scope="module")
def store(tmp_path_factory, trained_model_dir, noisy_model_dir, corpus_path):
    """A local SQLite store holding three audits of the trained baseline (one run here; two made from its record as
    earlier scheduled runs leave them, the later one with its noisy variant worse) and one of the noisy baseline."""
    folder = tmp_path_factory.mktemp("compare")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(folder / "home"))
        patch.setenv("PPL_AUDIT_CACHE", str(folder / "cache"))
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        tracking = {"uri": uri, "experiment": EXPERIMENT}
        trained = write_config(folder / "trained.yaml", trained_model_dir, corpus_path,
                               [{"name": "noisy", "path": str(noisy_model_dir)}, {"name": "int8", "method": "torchao-int8"}],
                               name="trained", tracking=tracking)
        other = write_config(folder / "other.yaml", noisy_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                             name="other", tracking=tracking)
        runs = {name: result_of(audit(config=str(config), return_state=True)).mlflow_run_id
                for name, config in (("trained", trained), ("other", other))}
        synced = folder / "home" / "synced"
        record_folder = next(f for f in synced.iterdir() if "-trained-" in f.name)
        for days, worse in ((2, 0.0), (1, 40.0)):  # replayed oldest first, as they would have been logged
            runs[f"{days}d"] = replay(earlier_run(record_folder, folder / f"{days}d", days, worse))
        yield {"uri": uri, "runs": runs, "trained": trained, "other": other, "folder": folder,
               "client": MlflowClient(uri)}


def earlier_run(source: Path, target: Path, days: int, worse: float) -> Path:
    """The record of ``source`` as a scheduled run ``days`` earlier would have left it, its noisy variant's ΔPPL
    ``worse`` points higher."""
    shutil.copytree(source, target)
    record = json.loads((target / "record.json").read_text())
    record["audit_id"], record["scheduled"] = uuid.uuid4().hex, True
    for key in ("started", "created"):
        record[key] = (datetime.fromisoformat(record[key]) - timedelta(days=days)).isoformat()
    for entry in record["variants"]:
        entry.pop("diagnosis", None)
        for key in ("started", "ended"):
            if entry.get(key):
                entry[key] -= days * 86400
        if entry["name"] == "noisy":
            for key in ("delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high"):
                entry["row"][key] += worse
        if entry["name"] == "int8" and worse:  # its table's method as a variant with an int8 cache is said
            entry["row"]["method"] += " kv:int8"
    (target / "record.json").write_text(sealed_record_json(record))  # as that run's spool would have sealed it
    return target


def children_of(client: MlflowClient, parents: list[str]) -> set[str]:
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    return {run.info.run_id for parent in parents for run in client.search_runs(
        [experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent}' and tags.`ppl_audit.kind` = 'variant'")}


def compare(capsys, *args: str) -> dict:
    assert main(["compare", *args, "--json"]) == 0
    return json_line(capsys.readouterr().out)


@pytest.mark.slow  # two whole audits
def test_compare_lists_exactly_the_audits_of_one_baseline_newest_first(store, capsys):
    client, runs, uri = store["client"], store["runs"], store["uri"]
    parent = client.get_run(runs["trained"])
    key = parent.data.tags["ppl_audit.baseline_key"]
    assert key != client.get_run(runs["other"]).data.tags["ppl_audit.baseline_key"]
    expected = children_of(client, [runs["trained"], runs["2d"], runs["1d"]])
    assert len(expected) == 6
    by_key = compare(capsys, "--baseline", key, "--tracking-uri", uri, "--experiment", EXPERIMENT, "--chart",
                     str(store["folder"] / "chart.png"))
    assert {row["run_id"] for row in by_key["variants"]} == expected  # not the other baseline's int8
    dates = [row["started"] for row in by_key["variants"]]
    assert dates == sorted(dates, reverse=True)
    assert [row["past"] for row in by_key["variants"]] == [False, False, True, True, True, True]
    assert (store["folder"] / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in by_key["variants"]:
        assert {"name", "method", "run_id", "delta_ppl_pct", "kld_mean", "bpw", "mib", "dominated_by"} <= set(row)
        figures = client.get_run(row["run_id"]).data.metrics
        assert row["delta_ppl_pct"] == figures["delta_ppl_pct"] and row["kld_mean"] == figures["kld_mean"]
        assert row["bpw"] == figures["bits_per_weight"] and row["mib"] == figures["weight_memory_bytes"] / 2**20
    # each method as its audit's table said it (its format's label, its cache), not the bare method: gptq for "gptq
    # 4-bit g32 tuned", torchao-int8 for "torchao-int8 kv:int8" (the 1d audit's)
    said = {(row["name"], row["method"], row["run_id"] in children_of(client, [runs["1d"]])) for row in by_key["variants"]}
    assert said == {("int8", "torchao-int8", False), ("noisy", "baseline", False), ("int8", "torchao-int8 kv:int8", True),
                    ("noisy", "baseline", True)}
    # the config names the same audits: its baseline's key is worked out from its files and token stream
    by_config = compare(capsys, str(store["trained"]))
    assert by_config["baseline_key"] == key
    assert [r["run_id"] for r in by_config["variants"]] == [r["run_id"] for r in by_key["variants"]]
    # so does the key of the reference the audit stored
    by_reference = compare(capsys, "--baseline", parent.data.tags["ppl_audit.reference"], "--tracking-uri", uri,
                           "--experiment", EXPERIMENT)
    assert [r["run_id"] for r in by_reference["variants"]] == [r["run_id"] for r in by_key["variants"]]


@pytest.mark.slow  # two whole audits
def test_a_scheduled_audit_whose_variant_moved_says_so_and_every_later_audit_has_the_history_chart(store, capsys):
    client, runs = store["client"], store["runs"]
    moved = client.get_run(runs["1d"])
    noisy = next(client.get_run(run) for run in children_of(client, [runs["1d"]])
                 if client.get_run(run).data.tags["ppl_audit.variant"] == "noisy")
    before = next(client.get_run(run) for run in children_of(client, [runs["2d"]])
                  if client.get_run(run).data.tags["ppl_audit.variant"] == "noisy")
    day = datetime.fromtimestamp(before.info.start_time / 1000, timezone.utc)
    said = (f"changed since {day:%Y-%m-%d}: {before.data.metrics['delta_ppl_pct']:+.2f}% → "
            f"{noisy.data.metrics['delta_ppl_pct']:+.2f}%")
    assert noisy.data.tags["ppl_audit.changed"] == said
    assert moved.data.tags["ppl_audit.changed"] == f"noisy {said}" and moved.data.tags["ppl_audit.scheduled"] == "true"
    assert moved.data.tags["mlflow.note.content"].endswith(f"\n\nnoisy {said}")
    assert "ppl_audit.changed" not in client.get_run(runs["2d"]).data.tags  # nothing scheduled before it
    assert "ppl_audit.scheduled" not in client.get_run(runs["trained"]).data.tags  # run by hand
    # the chart of all audits of the baseline, on each audit logged after another
    assert "history.png" in {a.path for a in client.list_artifacts(runs["1d"])}
    assert "history.png" not in {a.path for a in client.list_artifacts(runs["other"])}  # the first of its baseline
    out = compare(capsys, str(store["trained"]))
    assert [row["changed"] for row in out["variants"] if row["run_id"] == noisy.info.run_id] == [said]


@pytest.mark.slow  # two whole audits
def test_unknown_baselines_and_experiments_are_one_line_and_exit_2(store, capsys):
    uri = store["uri"]
    for argv, says in ((["--baseline", "0123456789abcdef", "--tracking-uri", uri, "--experiment", EXPERIMENT],
                        f"no audit of baseline 0123456789abcdef in experiment '{EXPERIMENT}'"),
                       (["--baseline", "0123456789abcdef", "--tracking-uri", uri, "--experiment", "nope"],
                        f"no experiment 'nope' in {uri} (it has {EXPERIMENT}); name one with --experiment"),
                       ([], "give an audit config, --baseline KEY or --audits RUN_ID RUN_ID, one of them"),
                       ([str(store["trained"]), "--baseline", "0123456789abcdef"],
                        "give an audit config, --baseline KEY or --audits RUN_ID RUN_ID, one of them")):
        assert main(["compare", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err


@pytest.mark.slow  # a real mlflow server and two whole audits
def test_compare_reads_a_real_tracking_server_and_links_each_run(store, tmp_path, cli):
    server = MlflowServer(tmp_path)
    server.start()
    try:
        synced = store["folder"] / "home" / "synced"
        for folder in sorted(synced.iterdir()) + [store["folder"] / "2d", store["folder"] / "1d"]:
            replay(folder, server.uri)
        key = store["client"].get_run(store["runs"]["trained"]).data.tags["ppl_audit.baseline_key"]
        code, out, err = cli("compare", "--baseline", key, "--tracking-uri", server.uri, "--experiment", EXPERIMENT,
                             "--json", "--chart", str(tmp_path / "chart.png"))
        assert code == 0, err
        found = json_line(out, err)
        client = MlflowClient(server.uri)
        experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
        assert len(found["variants"]) == 6 and {row["name"] for row in found["variants"]} == {"noisy", "int8"}
        for row in found["variants"]:
            assert row["link"] == (f"{server.uri}/#/experiments/{experiment}/runs/{row['run_id']}"
                                   "?workflowType=machine_learning")
            assert row["link"] in out  # the table's last column
        assert [row["changed"] is not None for row in found["variants"]].count(True) == 1
    finally:
        server.stop()


@pytest.mark.slow  # two whole audits
def test_any_tokens_on_audits_of_the_same_tokens_sets_them_side_by_side_without_a_warning(store, capsys):
    """Issue 67: ``--any-tokens`` said that figures on different tokens are not comparable of audits that scored the
    same tokens: it is said only where their populations differ."""
    runs, uri = store["runs"], store["uri"]
    assert main(["compare", "--audits", runs["trained"], runs["2d"], "--tracking-uri", uri, "--any-tokens",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert "not comparable" not in out
    population = store["client"].get_run(runs["trained"]).data.tags["ppl_audit.population"]
    assert list(json_line(out)["populations"]) == [population]  # as without --any-tokens: one population, named
    # audits of different tokens still get the line: tests/test_floor.py (…_side_by_side_unless_asked)


@pytest.mark.slow  # two whole audits
def test_an_audit_whose_record_or_figures_were_changed_is_named_not_printed(store, capsys, tmp_path, monkeypatch):
    """Issue 67.12: compare printed whatever the store held: an audit whose record.json was edited, or whose model's
    ΔPPL was logged again with another value, was shown as if the audit had found it. Each is held to the audit's
    sealed record: named in one line and left out, or, named with --audits, refused."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # in-process, a download's bar is on stderr
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    source = next(f for f in (store["folder"] / "home" / "synced").iterdir() if "-trained-" in f.name)
    runs = {days: replay(earlier_run(source, tmp_path / f"{days}d", days, 0.0), uri) for days in (3, 2, 1)}
    client = MlflowClient(uri)
    key = client.get_run(runs[1]).data.tags["ppl_audit.baseline_key"]
    argv = ("--baseline", key, "--tracking-uri", uri, "--experiment", EXPERIMENT)
    intact = compare(capsys, *argv)
    assert len(intact["variants"]) == 6  # three audits held to their records: nothing said
    record_path = Path(local_file_uri_to_path(client.get_run(runs[2]).info.artifact_uri)) / "record.json"
    record = json.loads(record_path.read_text())
    record["variants"][1]["row"]["ppl"] *= 0.5
    record_path.write_text(json.dumps(record, indent=2))
    noisy = next(run for run in children_of(client, [runs[1]])
                 if client.get_run(run).data.tags["ppl_audit.variant"] == "noisy")
    logged = client.get_run(noisy).data.metrics["delta_ppl_pct"]
    # logged now: later than the replayed audit's own figures, whatever their times, so what its run shows
    client.log_metric(noisy, "delta_ppl_pct", -5.0, timestamp=int(time.time() * 1000), step=0)
    assert client.get_run(noisy).data.metrics["delta_ppl_pct"] == -5.0
    assert main(["compare", *argv, "--json"]) == 0
    out, err = capsys.readouterr()
    shown = json_line(out)["variants"]
    assert {row["parent_run_id"] for row in shown} == {runs[3]} and len(shown) == 2
    warnings = [line for line in err.splitlines() if line.startswith("ppl-audit: warning: left out audit")]
    assert len(warnings) == 2, err
    assert f"(run {runs[2]}): record.json of run {runs[2]} was changed after it was written" in warnings[0] + warnings[1]
    assert (f"(run {runs[1]}): its runs' figures are not its sealed record.json's (delta_ppl_pct of noisy: logged -5, "
            f"recorded {logged})") in warnings[0] + warnings[1]
    for named in (runs[2], runs[1]):  # named by the user: refused
        assert main(["compare", "--audits", runs[3], named, "--tracking-uri", uri]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"(run {named}): " in err and "its figures are not the audit's" in err
