"""The noise floor (``evaluation.floor``), the token population's name, and ``compare --audits``: a real audit of the
trained tiny llama with its floor, against an independent computation of what the floor measures; the floor kept with
the baseline's reference, reused, and scored again when damaged; MLflow's record of both; audits of other tokens
refused side by side."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import flat, json_line, one_line_error, scored_log_probs, write_config, only
from mlflow import MlflowClient

from flows.audit import audit, result_of
from flows.cli import main

pytestmark = pytest.mark.usefixtures("prefect_harness")
EXPERIMENT = "floor"


@pytest.fixture(scope="module")
def audits(tmp_path_factory, trained_model_dir, noisy_model_dir, corpus_path):
    """Three audits of the trained baseline with its floor (cold, warm, and warm after its bf16 floor was damaged)
    and one on other tokens (a shorter stream), in one SQLite store; their summaries and the references' folder."""
    folder = tmp_path_factory.mktemp("floor")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_CACHE", str(folder / "cache"))
        patch.setenv("PPL_AUDIT_REFERENCES", str(folder / "references"))
        tracking = {"uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": EXPERIMENT}
        variants = [{"name": "noisy", "path": str(noisy_model_dir)},
                    # the baseline's own weights in bfloat16: what the bf16 floor is, so within it by construction
                    {"name": "bf16", "path": str(trained_model_dir), "dtype": "bfloat16"}]
        config = write_config(folder / "floor.yaml", trained_model_dir, corpus_path, variants, name="floored",
                              tracking=tracking, evaluation={"window": 64, "stride": 32, "batch_size": 4,
                                                             "max_tokens": 1500, "floor": True})
        summaries = {"cold": result_of(audit(config=str(config), return_state=True))}
        summaries["warm"] = result_of(audit(config=str(config), return_state=True))
        floors = list((folder / "references").glob("*/floors/floor-bf16"))
        scores = floors[0] / "scores.npz"
        scores.write_bytes(scores.read_bytes()[:-8] + b"\0" * 8)
        summaries["damaged"] = result_of(audit(config=str(config), overrides=[], return_state=True))
        other = write_config(folder / "other.yaml", trained_model_dir, corpus_path, variants[:1], name="shorter",
                             tracking=tracking, evaluation={"window": 64, "stride": 32, "batch_size": 4,
                                                            "max_tokens": 1000})
        summaries["other"] = result_of(audit(config=str(other), return_state=True))
        yield {"summaries": summaries, "floors": floors, "config": config, "uri": tracking["uri"], "folder": folder}


def _floor(summary: dict, name: str) -> dict:
    return next(row for row in flat(only(summary).floor) if row["variant"] == name)


def _row(summary: dict, name: str) -> dict:
    return next(row for row in flat(summary.rows) if row["variant"] == name)


@pytest.mark.slow  # four audits of the tiny model, two floors each
def test_the_floor_is_the_baseline_in_16_bits_against_its_float32_self(audits, trained_model_dir):
    from transformers import AutoModelForCausalLM

    from tasks.audit.plan import open_audit
    from tasks.engine.windows import plan as windows_of

    cold = audits["summaries"]["cold"]
    assert [row["variant"] for row in flat(only(cold).floor)] == ["floor-bf16", "floor-fp16"]
    assert all(row["floor_kept"] == "scored" and row["status"] == "ok" for row in flat(only(cold).floor))
    evaluation = open_audit(str(audits["config"])).evaluation
    windows = windows_of(evaluation.stream, 64, 32, "sliding")
    base = AutoModelForCausalLM.from_pretrained(trained_model_dir, torch_dtype=torch.float32).eval()
    for name, dtype in (("floor-bf16", torch.bfloat16), ("floor-fp16", torch.float16)):
        low = AutoModelForCausalLM.from_pretrained(trained_model_dir, torch_dtype=dtype).eval()
        kl = [float((lb.exp() * (lb - lv)).sum()) for _, lb, lv in scored_log_probs(base, low, evaluation.stream, windows)]
        row = _floor(cold, name)
        # each window alone in float64 against the engine's batches: the same KL but for 16-bit rounding's order
        assert row["kld_mean"] == pytest.approx(np.mean(kl), rel=0.05), name
        assert row["kld_mean"] > 0 and row["n_tokens"] == len(kl)
    bf16 = _row(cold, "bf16")["floor"]
    assert bf16["above"] is False and bf16["dtype"] == "bfloat16"  # the floor itself: within it, not a loss
    # ~1e-5: 2 digits; the same numerics as the floor, token for token: within it in ΔPPL too
    assert bf16["said"] == f"KL {bf16['kld']:.2g}: within the bf16 floor {bf16['kld']:.2g}, ΔPPL within it"
    noisy = _row(cold, "noisy")["floor"]
    assert noisy["above"] is True and "above the" in noisy["said"] and noisy["said"].endswith(", ΔPPL above it")
    assert all(found["kl"]["low"] > 0 for found in noisy["floors"])
    assert "noise floor: the baseline in bfloat16" in cold.table and bf16["said"] in cold.table


@pytest.mark.slow
def test_a_warm_audit_reuses_its_floor_and_a_damaged_one_is_scored_again(audits, capsys):
    summaries = audits["summaries"]
    warm, damaged = summaries["warm"], summaries["damaged"]
    assert all(row["floor_kept"] == "reused" for row in flat(only(warm).floor))
    for name in ("floor-bf16", "floor-fp16"):
        assert _floor(warm, name)["kld_mean"] == _floor(summaries["cold"], name)["kld_mean"]
    assert _floor(damaged, "floor-bf16")["floor_kept"] == "scored"  # its scores no longer what was written
    assert _floor(damaged, "floor-fp16")["floor_kept"] == "reused"
    assert _floor(damaged, "floor-bf16")["kld_mean"] == pytest.approx(_floor(warm, "floor-bf16")["kld_mean"], rel=1e-6)
    assert (audits["floors"][0] / "floor.json").is_file()  # kept again


@pytest.mark.slow
def test_mlflow_holds_the_floor_and_the_token_population(audits):
    client = MlflowClient(audits["uri"])
    cold = audits["summaries"]["cold"]
    parent = client.get_run(cold.mlflow_run_id)
    assert parent.data.tags["ppl_audit.population"] == only(cold).population["digest"]
    assert parent.data.metrics["floor-bf16.kld_mean"] == pytest.approx(_floor(cold, "floor-bf16")["kld_mean"])
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    said = {run.data.tags["ppl_audit.variant"]: run.data.tags.get("ppl_audit.floor") for run in children}
    assert said["bf16"] == _row(cold, "bf16")["floor"]["said"] and said["baseline"] is None
    assert f"token population {only(cold).population['digest']}" in cold.table
    other = audits["summaries"]["other"]
    assert only(other).population["digest"] != only(cold).population["digest"]
    assert only(audits["summaries"]["warm"]).population == only(cold).population


@pytest.mark.slow
def test_compare_refuses_audits_of_other_tokens_side_by_side_unless_asked(audits, capsys):
    summaries, uri = audits["summaries"], audits["uri"]
    cold, warm, other = (summaries[k].mlflow_run_id for k in ("cold", "warm", "other"))
    err = one_line_error(capsys, "compare", "--audits", cold, other, "--tracking-uri", uri)
    assert "scored different tokens" in err and "max_tokens 1500 against 1000" in err and "--any-tokens" in err
    assert main(["compare", "--audits", cold, warm, "--tracking-uri", uri, "--json"]) == 0
    same = json_line(capsys.readouterr().out)["populations"]
    assert list(same) == [only(summaries["cold"]).population["digest"]]
    assert {row["name"] for row in same[only(summaries["cold"]).population["digest"]]} == {"noisy", "bf16"}
    assert main(["compare", "--audits", cold, other, "--tracking-uri", uri, "--any-tokens", "--json"]) == 0
    out = capsys.readouterr().out
    assert "not comparable as they stand" in out
    rows = json_line(out)["populations"]["None"]
    assert {row["audit"].split("@")[1] for row in rows} == {only(summaries[k]).population["digest"][:8]
                                                            for k in ("cold", "other")}


def test_a_floor_that_cannot_be_measured_is_refused_in_one_line(tmp_path, trained_model_dir, corpus_path, capsys):
    floor = {"window": 64, "stride": 32, "floor": True}
    sixteen = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                           evaluation=floor)
    text = sixteen.read_text().replace(f"path: {trained_model_dir}", f"path: {trained_model_dir}\n  dtype: bfloat16")
    sixteen.write_text(text)
    assert "baseline.dtype is bfloat16" in one_line_error(capsys, "run", str(sixteen))
    taken = write_config(tmp_path / "b.yaml", trained_model_dir, corpus_path, [{"name": "floor-bf16", "method": "torchao-int8"}],
                         evaluation=floor)
    assert "floor-bf16 names the noise floor's row" in one_line_error(capsys, "run", str(taken))
    listed = write_config(tmp_path / "c.yaml", trained_model_dir, corpus_path, [{"name": "floor-bf16", "method": "torchao-int8"}],
                          evaluation=floor | {"floor": ["float16"]})  # only floor-fp16 is taken
    from tasks.config import load_audit_config

    assert load_audit_config(str(listed)).evaluation.floors == ("float16",)


def test_a_stored_record_s_floor_judgements_read_back_as_written():
    """Each row's judgement against the floors in the stored records (tests/records) reads into ``FloorJudgement``
    (by its fields' names, a floor's KL where both measured it) and is written back key for key, in order."""
    import json
    import lzma
    from pathlib import Path

    from tasks.record.floor_said import FloorJudgement

    judged = []
    for stored in sorted((Path(__file__).parent / "records").glob("*.record.json.xz")):
        record = json.loads(lzma.open(stored).read())
        entries = record["variants"] + [entry for domain in record.get("domains", {}).values()
                                        for entry in domain["variants"]]
        judged += [entry["row"]["floor"] for entry in entries if entry["row"].get("floor") is not None]
    read = [FloorJudgement.of_record(said) for said in judged]
    assert len(read) >= 40 and all(floor.kl is not None for judgement in read for floor in judgement.floors)
    assert [json.dumps(judgement.as_record()) for judgement in read] == [json.dumps(said) for said in judged]


@pytest.mark.slow  # two commands in a subprocess each
def test_reference_build_keeps_the_floor_with_the_reference(tmp_path, trained_model_dir, corpus_path, cli, cache,
                                                            monkeypatch):
    monkeypatch.setenv("PPL_AUDIT_REFERENCES", str(tmp_path / "references"))
    config = write_config(tmp_path / "r.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                          evaluation={"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 600,
                                      "floor": ["bfloat16"]})
    code, out, err = cli("reference", "build", str(config))
    assert code == 0, err
    assert "noise floor floor-bf16: scored, PPL " in out and "floor-fp16" not in out
    assert len(list((tmp_path / "references").glob("*/floors/floor-bf16/floor.json"))) == 1
    code, again, err = cli("reference", "build", str(config))
    assert code == 0, err
    line = next(line for line in again.splitlines() if line.startswith("noise floor"))
    assert line == next(line for line in out.splitlines() if line.startswith("noise floor")).replace("scored", "reused")
