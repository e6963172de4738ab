"""The audit and quantize flows on a real (temporary) Prefect server; the CLI's exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import flat, write_config, only

from flows.audit import audit, result_of
from flows.cli import main
from tasks.core.errors import TransientError
from tasks.record.verdict import FRONT

pytestmark = pytest.mark.usefixtures("prefect_harness")


def flaky_int8_loads(monkeypatch) -> list[str]:
    """The variants' loads, each name as it is asked for; the remote store drops int8's first connection."""
    import tasks.audit.scoring
    import tasks.steps
    real = tasks.audit.scoring.load_variant
    calls = []

    def flaky(spec, source, window=None):
        calls.append(spec.name)
        if spec.name == "int8" and calls.count("int8") == 1:
            raise TransientError("connection reset by the model store")
        return real(spec, source, window)

    monkeypatch.setattr(tasks.audit.scoring, "load_variant", flaky)
    # Prefect retries the real task as configured, but at once: its 10 s wait for a store to come back was all but
    # ~8 s of the retry's time, and is no part of what it shows (that the transient failure is retried, once)
    monkeypatch.setattr(tasks.steps.score_variant, "retry_delay_seconds", 0)
    return calls


def test_audit_passes_when_every_variant_is_within_its_gate_and_a_transient_failure_is_retried(
        tmp_path, cache, trained_model_dir, corpus_path, monkeypatch):
    """One audit for both (each took one of its own): int8's first load fails as a dropped connection does, and the
    audit retries it once and passes with every figure."""
    calls = flaky_int8_loads(monkeypatch)
    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"},
                           {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32,
                            "calibration": {"samples": 8, "seq_len": 128}}],
                          thresholds={"max_ppl_increase_pct": 5})
    state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    assert calls.count("int8") == 2
    summary = state.result()
    assert [row["variant"] for row in flat(summary.rows)] == ["baseline", "int8", "gptq"]
    assert all(v.status == "pass" for v in summary.verdicts)
    assert flat(summary.rows)[1]["ppl"] == pytest.approx(flat(summary.rows)[0]["ppl"], rel=0.01)


def test_audit_fails_with_one_line_reason_and_keeps_the_other_results(tmp_path, cache, trained_model_dir,
                                                                       noisy_model_dir, corpus_path):
    config = write_config(tmp_path / "f.yaml", trained_model_dir, corpus_path,
                          [{"name": "noisy", "path": str(noisy_model_dir)},
                           {"name": "int8", "method": "bnb-int8"}],
                          thresholds={"max_ppl_increase_pct": 5, "per_variant": {"noisy": {"max_ppl_increase_pct": 1}}})
    state = audit(config=str(config), return_state=True)
    assert state.is_failed()
    assert state.message.startswith("fail: noisy: ΔPPL +") and "breaks the limit ≤ 1" in state.message
    assert "\n" not in state.message
    summary = result_of(state)
    statuses = {v.name: v.status for v in summary.verdicts}
    assert statuses == {"noisy": "fail", "int8": "pass"}
    # the noisy float model is 32 bits a weight and clearly worse than 8-bit LLM.int8: dominated
    rows = {row["variant"]: row for row in flat(summary.rows)}
    assert rows["noisy"]["bits_per_weight"] == 32 and 8 < rows["int8"]["bits_per_weight"] < 8.5
    assert rows["noisy"]["dominated_by"] == "int8" and rows["int8"]["dominated_by"] is None
    assert state.message.endswith(f"{FRONT}: int8") and "dominated by int8" in summary.table


def test_a_failing_variant_is_isolated(tmp_path, cache, trained_model_dir, noisy_model_dir, corpus_path):
    config = write_config(tmp_path / "i.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"}, {"name": "noisy", "path": str(noisy_model_dir)}],
                          thresholds={"max_ppl_increase_pct": 1000})
    # a checkpoint that disappears after the config was checked: its variant fails, the rest is kept
    state = audit(config=str(config), overrides=[f"variants.1.path={tmp_path / 'gone'}"], return_state=True)
    assert state.is_failed()
    assert state.message.startswith("error: noisy: model folder not found")
    rows = {row["variant"]: row for row in flat(result_of(state).rows)}
    assert rows["noisy"]["status"] == "failed" and "ppl" not in rows["noisy"]
    assert rows["baseline"]["ppl"] > 1 and rows["int8"]["ppl"] > 1 and "delta_ppl_pct" in rows["int8"]


@pytest.mark.slow
def test_dask_runner_scores_variants_on_two_local_workers(tmp_path, cache, trained_model_dir, corpus_path):
    variants = [{"name": "int8", "method": "torchao-int8"}, {"name": "nf4", "method": "bnb-nf4"}]
    sequential = audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                       return_state=True).result()
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                          runner={"kind": "dask", "workers": 2})
    on_dask = audit(config=str(config), return_state=True).result()
    assert [r["ppl"] for r in flat(on_dask.rows)] == pytest.approx([r["ppl"] for r in flat(sequential.rows)], rel=1e-6)
    assert (cache / "dask-scratch").is_dir(), "the workers' scratch space is ours, not the working directory's"


def quantize_request(model: Path, corpus: Path, out: Path, **fields):
    from tasks.config import CalibrationConfig, CorpusConfig
    from tasks.models.quantize_request import QuantizeRequest

    calibration = CalibrationConfig(corpus=CorpusConfig(source=str(corpus)), samples=4, seq_len=64)
    return QuantizeRequest(model=str(model), method="gptq", out=str(out), group_size=32, calibration=calibration,
                           **fields)


@pytest.mark.slow
def test_quantize_flow_emits_quantization_completed(tmp_path, cache, trained_model_dir, corpus_path):
    import anyio
    from prefect.client.orchestration import get_client

    from flows.quantize import quantize_flow
    from tasks.models.quantize_request import open_quantize

    out = tmp_path / "gptq"
    # with a recipe's per-module overrides (`ppl-audit quantize --dynamic`): one layer's down_proj left unquantized
    dynamic = {r"-:model\.layers\.0\.mlp\.down_proj": {}}
    request = open_quantize(quantize_request(trained_model_dir, corpus_path, out, holdout_tokens=1500, name="gptq-4bit",
                                             dynamic=dynamic))
    state = quantize_flow(request, return_state=True)
    manifest = state.result()
    assert all(start >= 1500 for start, _ in manifest["calibration"]["token_ranges"])
    assert manifest["name"] == "gptq-4bit" and manifest["dynamic"] == dynamic
    assert json.loads((out / "config.json").read_text())["quantization_config"]["dynamic"] == dynamic

    async def run_name():
        async with get_client() as client:
            return (await client.read_flow_run(state.state_details.flow_run_id)).name

    assert anyio.run(run_name) == "quantize-gptq-4bit"

    async def events():
        async with get_client() as client:
            for _ in range(60):
                response = await client._client.post("/events/filter", json={
                    "filter": {"event": {"name": ["quantization.completed"]}, "order": "DESC"}, "limit": 20})
                found = [e for e in response.json()["events"] if e["payload"].get("model_path") == str(out.resolve())]
                if found:
                    return found[0]
                await anyio.sleep(0.5)

    event = anyio.run(events)
    assert event is not None, "the event never reached the server"
    assert event["payload"] == {**event["payload"], "method": "gptq", "bits": 4, "baseline": str(trained_model_dir),
                                "name": "gptq-4bit"}
    assert event["resource"]["prefect.resource.id"] == f"ppl-audit.model.{out.resolve()}"


def test_quantize_flow_opens_a_request_it_was_handed_unopened(tmp_path, trained_model_dir, corpus_path):
    """A run of the deployment gets the request's fields through the API, unchecked: the flow checks them (here an
    output folder that is a file) before anything loads, as the command does before Prefect starts."""
    from flows.quantize import quantize_flow
    from tasks.core.errors import InputError

    taken = tmp_path / "taken"
    taken.write_text("a file")
    with pytest.raises(InputError, match=f"output folder {taken} is a file; give a new folder"):
        quantize_flow(quantize_request(trained_model_dir, corpus_path, taken))


def test_cli_run_exit_codes(tmp_path, cache, trained_model_dir, noisy_model_dir, corpus_path, capsys):
    passing = write_config(tmp_path / "p.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                           thresholds={"max_ppl_increase_pct": 5})
    assert main(["run", str(passing)]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "int8" in out and "ΔPPL %" in out
    failing = write_config(tmp_path / "q.yaml", trained_model_dir, corpus_path, [{"name": "noisy", "path": str(noisy_model_dir)}],
                           thresholds={"max_ppl_increase_pct": 1})
    assert main(["run", str(failing)]) == 1
    assert "verdict: FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("change,expected", [
    ({"evaluation": {"windw": 64}}, "evaluation.windw: unknown key"),
    ({"evaluation": {"window": "long"}}, "evaluation.window: Input should be a valid integer"),
    ({"baseline": None}, "baseline: Input should be"),
    ({"thresholds": {"max_ppl_increase_pct": 5000}}, "thresholds.max_ppl_increase_pct: Input should be less than or equal to 1000"),
    ({"thresholds": {"per_variant": {"nope": {"max_ppl_increase_pct": 1}}}}, "per_variant names no variant: nope"),
    ({"evaluation": {"window": 4096}}, "evaluation.window 4096 is longer than the baseline's 256 positions"),
    ({"variants": [{"name": "x", "method": "gptq", "path": "/no/such/checkpoint"}]}, "model folder not found"),
    ({"schedule": {"cron": "0 3 * * *", "timezone": "Mars/Olympus"}},
     "schedule.timezone: 'Mars/Olympus' is not an IANA time zone; use a name such as UTC or Europe/Berlin"),
    ({"variants": []}, "variants is empty: an audit compares variants with the baseline"),
    ({"tracking": {"uri": "ftp://x"}}, "tracking.uri: 'ftp://x' is not an MLflow tracking URI"),
    ({"tracking": {"uri": "not a uri at all"}}, "tracking.uri: 'not a uri at all' is not an MLflow tracking URI"),
    ({"tracking": {"experiment": ""}}, "tracking.experiment: String should have at least 1 character"),
    ({"tracking": {"experiment": "../../escaped"}}, "tracking.experiment: experiment '../../escaped' cannot name a folder"),
    ({"tracking": {"experiment": "/etc/x"}}, "tracking.experiment: experiment '/etc/x' cannot name a folder"),
    ({"baseline": {"device": "tpu"}}, "baseline: unknown device 'tpu'; use cpu, cuda, cuda:N or auto"),
    # #30: each was refused only after Prefect and MLflow had started, or accepted and never trackable
    ({"variants": [{"name": "..", "method": "torchao-int8"}]}, "variants.0.name: '..' is not a name"),
    ({"variants": [{"name": "g", "method": "gguf", "path": "/tmp"}]},
     "variants.0: method gguf loads a .gguf file, and /tmp is not one"),
    ({"variants": [{"name": "s", "method": "bnb-int8", "device_map": {"": "tpu:0"}}]},
     "variants.0: device_map puts '' on 'tpu:0': use a GPU index (0), cuda:N, cpu or disk"),
    ({"runner": {"kind": "dask", "workers": 1000}}, "runner.workers is 1000, but this machine has"),
    pytest.param({"runner": {"kind": "dask", "gpus_per_variant": 1}},
                 "runner.gpus_per_variant is 1, but this machine has 0 GPU(s) for the local cluster",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without a GPU")),
    ({"runner": {"kind": "ray", "address": "ray://nowhere"}},
     "runner.address 'ray://nowhere' names no host and port (e.g. ray://10.0.0.5:10001)"),
    pytest.param({"variants": [{"name": "q", "method": "torchao-int8", "device": "cuda"}]},
                 "q: device 'cuda' asked for, but no CUDA GPU is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="refused only without a GPU")),
])
def test_bad_config_is_one_line_naming_the_key_before_any_model_loads(tmp_path, trained_model_dir, corpus_path,
                                                                      capsys, change, expected):
    import yaml

    path = write_config(tmp_path / "bad.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}])
    data = yaml.safe_load(path.read_text())
    for key, value in change.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


@pytest.mark.parametrize("corpus,expected", [
    ("missing.txt", "corpus not found"),
    ("empty.txt", "is empty"),
    ("blank.txt", "is empty or only whitespace"),
    ("rows.jsonl", "column 'text' not in"),
    ("broken.jsonl", "broken.jsonl:2 is not valid JSON"),
    ("binary.txt", "is a binary file, not text"),
    ("latin1.txt", "is not utf-8 text (byte 0xe9 at offset 1); give its encoding with corpus.encoding"),
    ("no-text", "holds no .txt files"),
    ("hf:no-such-org/no-such-dataset", "cannot load dataset 'no-such-org/no-such-dataset'"),
    ("calibration", "gptq: column 'text' not in"),
])
def test_a_bad_corpus_is_refused_before_prefect_starts(tmp_path, trained_model_dir, corpus_path, capsys, monkeypatch,
                                                       corpus, expected):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    (tmp_path / "rows.jsonl").write_text('{"body": "some words here"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "some words"}\n{"text": \n')
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 16)
    (tmp_path / "latin1.txt").write_bytes("Déjà vu".encode("latin-1"))
    (tmp_path / "no-text").mkdir()
    variants = [{"name": "int8", "method": "torchao-int8"}]
    if corpus == "calibration":  # a gptq variant's own calibration corpus is read before anything starts too
        variants = [{"name": "gptq", "method": "gptq", "calibration": {"corpus": {"source": str(tmp_path / "rows.jsonl")},
                                                                       "seq_len": 64}}]
    source = corpus if corpus.startswith("hf:") else corpus_path if corpus == "calibration" else tmp_path / corpus
    path = write_config(tmp_path / "bad.yaml", trained_model_dir, source, variants)
    assert main(["run", str(path)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and expected in captured.err, captured.err
    assert "Starting temporary server" not in captured.out + captured.err


def test_a_chinese_corpus_is_audited_end_to_end(tmp_path, cache, trained_model_dir):
    """Text without spaces: word PPL is absent with its reason (console, record, MLflow), the rest is there."""
    from mlflow import MlflowClient

    corpus = tmp_path / "zh.txt"
    corpus.write_text("我们今天去公园散步，天气很好。她说这封信是昨天写的。" * 200)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = write_config(tmp_path / "zh.yaml", trained_model_dir, corpus, [{"name": "int8", "method": "torchao-int8"}],
                          name="zh", thresholds={"max_ppl_increase_pct": 1000}, tracking={"uri": uri})
    state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    for outcome in only(summary).results:
        result = outcome.result
        assert result.word_ppl is None and result.ppl > 1 and result.bits_per_byte > 0
        assert result.absent == {"word_ppl": f"e^{result.nll_sum / result.n_words:.0f} is past a float: the scored "
                                             f"text has too few words ({result.n_words})"}
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ppl-audit").experiment_id],
                              filter_string=f"tags.`mlflow.parentRunId` = '{summary.mlflow_run_id}'")
    assert len(runs) == 2
    for run in runs:
        assert "word_ppl" not in run.data.metrics and run.data.metrics["ppl"] > 1
        assert run.data.tags["absent.word_ppl"].startswith("e^")


def broken_checkpoint(tmp_path: Path, trained_model_dir: Path, kind: str) -> str:
    """A copy of the trained model with a part missing: its weights, its tokenizer, or a shard its index names."""
    import shutil

    folder = tmp_path / kind
    leave_out = {"no-weights": ("*.safetensors",), "no-tokenizer": ("tokenizer*",), "sharded": ()}[kind]
    shutil.copytree(trained_model_dir, folder, ignore=shutil.ignore_patterns(*leave_out))
    if kind == "sharded":
        (folder / "model.safetensors.index.json").write_text(
            '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    return str(folder)


@pytest.mark.parametrize("expected,variant,checkpoint", [
    pytest.param("no weights (*.safetensors or *.bin)", {"name": "q", "method": "gptq"}, "no-weights",
                 id="checkpoint-without-weights"),
    pytest.param("has no tokenizer (tokenizer.json", {"name": "q", "method": "gptq"}, "no-tokenizer",
                 id="checkpoint-without-tokenizer"),
    pytest.param("lacks weight shard(s) its index names: model-00001-of-00002.safetensors", {"name": "q"}, "sharded",
                 id="checkpoint-missing-a-shard"),
    pytest.param("variants.0: group_size 100 is not one gptq kernels support; use one of -1, 16, 32",
                 {"name": "q", "method": "gptq", "group_size": 100}, None, id="gptq-group-size-100"),
    pytest.param("variants.0: group_size 256 is not one awq kernels support",
                 {"name": "q", "method": "awq", "group_size": 256}, None, id="awq-group-size-256"),
    pytest.param("q: calibration seq_len 4096 is longer than the 256 positions",
                 {"name": "q", "method": "gptq", "calibration": {"seq_len": 4096}}, None,
                 id="calibration-block-longer-than-the-model-positions"),
])
def test_checkpoints_and_quantization_that_cannot_work_are_refused_before_any_model_loads(
        tmp_path, trained_model_dir, corpus_path, capsys, expected, variant, checkpoint):
    if checkpoint:
        variant = {**variant, "path": broken_checkpoint(tmp_path, trained_model_dir, checkpoint)}
    path = write_config(tmp_path / "bad.yaml", trained_model_dir, corpus_path, [variant])
    assert main(["run", str(path)]) == 2, expected
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and expected in captured.err, captured.err
    assert "Starting temporary server" not in captured.out + captured.err


def test_quantize_refuses_a_group_size_its_kernels_do_not_support(tmp_path, trained_model_dir, corpus_path, capsys):
    assert main(["quantize", "--model", str(trained_model_dir), "--method", "awq", "--group-size", "256",
                 "--calibration", str(corpus_path), "--out", str(tmp_path / "out")]) == 2
    assert "group_size 256 is not one awq kernels support" in capsys.readouterr().err


def test_quantize_refuses_an_output_folder_nothing_can_be_made_beside(tmp_path, trained_model_dir, corpus_path,
                                                                       capsys):
    """Under a file (as on a read-only or special file system): one line before the model loads, no traceback.
    Before, quantize crashed on the folder it makes the checkpoint in (exit 1, `FileNotFoundError`)."""
    (tmp_path / "a-file").write_text("")
    assert main(["quantize", "--model", str(trained_model_dir), "--method", "gptq", "--calibration",
                 str(corpus_path), "--out", str(tmp_path / "a-file" / "gptq")]) == 2
    err = capsys.readouterr().err
    assert err == (f"ppl-audit: error: output folder {tmp_path}/a-file/gptq: nothing can be written in "
                   f"{tmp_path}/a-file (Not a directory); give a folder you can write\n"), err


def test_quantize_takes_a_recipe_s_dynamic_as_tune_logs_it_or_inline(tmp_path, trained_model_dir, corpus_path, capsys):
    """``ppl-audit quantize --dynamic``: the file ``tune`` logs (its scheme must be the command's) or a mapping, each
    checked as a variant's ``dynamic`` is, before the model loads. Before, quantize took no ``dynamic``."""
    import argparse

    from flows.commands.quantize import _dynamic

    recipe = tmp_path / "gptqmodel-dynamic.json"
    recipe.write_text(json.dumps({"bits": 8, "group_size": 32, "dynamic": {"-:.*down_proj": {}}}))
    command = ["quantize", "--model", str(trained_model_dir), "--method", "gptq", "--group-size", "32",
               "--calibration", str(corpus_path), "--out", str(tmp_path / "q"), "--dynamic"]
    for given, expected in [
            (str(recipe), "--dynamic: the recipe is for bits 8 and the command's --bits is 4; give --bits 8"),
            ("recipe.json", "--dynamic recipe.json: no such file, nor a mapping"),
            ('{"+:(": {"bits": 8}}', "+:(: not a regular expression"),
            ('{"+:.*": {"bits": 5}}', "bits 5 is not one gptq takes; use one of 2, 3, 4, 8"),
            ('{"+:.*": {"group_size": 24}}', "group_size 24 is not one gptq kernels support"),
            ('{"-:.*": {"bits": 8}}', "a -: pattern leaves its modules unquantized and takes no settings"),
            ('{"x": {}}', "String should match pattern"),
            ("{a: [", "--dynamic: not YAML or JSON (line 1, column")]:
        assert main([*command, given]) == 2, given
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert main([*command[:4], "awq", *command[5:], '{"-:.*": {}}']) == 2
    assert "make gptq checkpoints, not awq ones" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    # the file tune logs (tasks.record.tuning.gptqmodel_dynamic's form), read as the command reads it: its overrides
    exported = {"bits": 4, "group_size": 32, "dynamic": {"+:.*q_proj": {"bits": 8, "group_size": 32}}}
    recipe.write_text(json.dumps(exported))
    assert _dynamic(argparse.Namespace(dynamic=str(recipe), bits=4, group_size=32)) == exported["dynamic"]


def test_kernel_group_sizes_are_those_gptqmodel_supports():
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear

    from tasks.config import KERNEL_GROUP_SIZES

    assert KERNEL_GROUP_SIZES == {"gptq": tuple(TorchLinear.SUPPORTS_GROUP_SIZE),
                                  "awq": tuple(AwqTorchLinear.SUPPORTS_GROUP_SIZE)}


def test_set_overrides_and_missing_config(capsys, tmp_path):
    assert main(["run", str(tmp_path / "none.yaml")]) == 2
    assert "config not found" in capsys.readouterr().err
    assert main(["run", "configs/demo.yaml", "--set", "evaluation.stride=9999"]) == 2
    assert "stride 9999 must be at least 1 and below 256" in capsys.readouterr().err  # the demo's window
    assert main(["run", "configs/demo.yaml", "--set", "variants.9.bits=4"]) == 2
    assert "variants.9.bits=4: 9 is not an index of that list (it has 4 items: 0 to 3)" in capsys.readouterr().err
    assert main(["run", "configs/demo.yaml", "--set", "variants.x.name=x"]) == 2
    assert "variants.x.name=x: x is not an index of that list" in capsys.readouterr().err


def test_dask_cluster_listens_on_loopback_only():
    import psutil
    from distributed import LocalCluster

    from flows.scheduler import dask_cluster

    with LocalCluster(**dask_cluster(1, {})) as cluster:  # the scheduler here, a worker process beside it
        assert cluster.dashboard_link.startswith("http://127.0.0.1:")
        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        listening = {c.laddr.ip for p in processes for c in p.net_connections() if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}, listening


@pytest.mark.slow  # quantizes
def test_quantizing_that_nobody_waits_for_stops_at_the_next_layer_and_leaves_nothing(trained_model_dir, tmp_path,
                                                                                     monkeypatch):
    """A cluster's `make` task whose audit stopped (tasks.audit.cluster.let_go): gptqmodel's layer loop asks on
    every layer's forward pass, stops at the first answer, and neither a checkpoint nor its parts are left."""
    import torch

    from tasks.core.errors import Abandoned
    from tasks.engine.abandon import asking
    from tasks.models.quantize import Scheme, draw_calibration, quantize
    from tasks.models.resolve import load_tokenizer, locate_model

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    asked = []

    def why() -> str | None:
        asked.append(True)
        return "nobody waits" if len(asked) == 2 else None

    with asking(why), pytest.raises(Abandoned, match="nobody waits"):
        quantize(locate_model(str(trained_model_dir)), Scheme("gptq", 4, 32, True),
                 draw_calibration(torch.randint(0, 300, (64 * 64,)), 8, 64, 0, "random", "none"), tmp_path / "out",
                 load_tokenizer(str(trained_model_dir)))
    assert len(asked) == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    assert not any((tmp_path / "cache" / "scratch").iterdir())
