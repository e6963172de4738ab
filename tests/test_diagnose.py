"""Diagnosing a variant: per-layer errors, restore sensitivity, the command and its MLflow run."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import build_llama, make_text

from tasks.engine.layers import SQNR_CAP_DB, decoder_layers, layer_errors, recovered_share, restored, restored_scores
from tasks.engine.perplexity import score_windows
from tasks.engine.scoring_options import Feed, ScoreOptions
from tasks.engine.stream import TokenStream
from tasks.engine.windows import plan

LAYERS = 4


@pytest.fixture(scope="module")
def deep_base(tmp_path_factory, tokenizer):
    """A 4-layer float64 Llama: enough layers that a fault's place means something."""
    return build_llama(tmp_path_factory.mktemp("deep-llama"), tokenizer, dtype=torch.float64, num_hidden_layers=LAYERS)


def faulty(model, layers: list[int], scale: float = 0.05, seed: int = 5):
    """``model`` with noise on every weight of the decoder layers ``layers``, the rest identical."""
    broken = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i in layers:
            for weight in decoder_layers(broken)[i].parameters():
                if weight.ndim == 2:
                    weight.add_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * scale)
    return broken


@pytest.fixture(scope="module")
def stream(tokenizer):
    ids = torch.tensor(tokenizer(make_text(900, seed=4))["input_ids"][:700])
    return TokenStream(ids=ids, text_digest="t", n_bytes=0, n_words=0, bos="none", prefix=())


def windows(stream):
    return plan(stream, 64, 32)


@pytest.mark.parametrize("planted", [[2], [1, 3]])
def test_planted_fault_is_the_layer_with_own_error(deep_base, stream, planted):
    variant = faulty(deep_base, planted)
    errors = layer_errors(deep_base, variant, Feed(stream.ids, batch_size=3), windows(stream))
    own = errors.own.sqnr_db()
    for i in range(LAYERS):
        if i in planted:
            assert own[i] < 60, f"layer {i} was perturbed: {own}"
            assert errors.own.relative_error()[i] > 1e-3
        else:  # identical weights fed the baseline's input give the baseline's output, to the bit
            assert own[i] == SQNR_CAP_DB and errors.own.noise[i] == 0 and errors.own.mean_cos_error()[i] == 0
    accumulated = errors.accumulated.sqnr_db()
    first = min(planted)
    assert all(accumulated[i] == SQNR_CAP_DB for i in range(first))  # nothing before the fault departs
    assert all(accumulated[i] < SQNR_CAP_DB for i in range(first, LAYERS))  # everything after it carries it on
    assert errors.head_kl == 0 and errors.head_top1 == 1  # the head is the baseline's
    assert errors.embeddings.noise[0] == 0


def test_baseline_as_its_own_variant_has_no_error(deep_base, stream):
    errors = layer_errors(deep_base, copy.deepcopy(deep_base), Feed(stream.ids, batch_size=2), windows(stream))
    for sums in (errors.own, errors.accumulated):
        assert (sums.sqnr_db() == SQNR_CAP_DB).all() and (sums.relative_error() == 0).all()
        assert not np.isnan(sums.mean_cos_error()).any() and (sums.mean_cos_error() == 0).all()
    assert errors.head_kl == 0


def test_restoring_every_layer_gives_the_baseline_back(deep_base, stream):
    variant = faulty(deep_base, [0, 2])
    planned = windows(stream)
    base = score_windows(deep_base, Feed(stream.ids, batch_size=4), planned)
    hurt = score_windows(variant, Feed(stream.ids, batch_size=4), planned)
    assert float((hurt.token_nll - base.token_nll).abs().max()) > 1e-3
    with restored(variant, deep_base, range(LAYERS)):
        whole = score_windows(variant, Feed(stream.ids, batch_size=4), planned)
    assert float((whole.token_nll.double() - base.token_nll.double()).abs().max()) <= 1e-9
    again = score_windows(variant, Feed(stream.ids, batch_size=4), planned)  # put back on leaving
    assert torch.equal(again.token_nll, hurt.token_nll)


def test_restored_scores_run_from_the_first_restored_layer_with_the_bits_of_a_whole_pass(deep_base, stream):
    """Layers before the first restored one are replayed from the variant's own pass, not run again: the figures
    are those of the variant with the layers restored, run whole, to the bit."""
    from tasks.engine.perplexity import hidden_states
    from tasks.engine.baseline import Baseline

    variant = faulty(deep_base, [0, 2])
    planned = windows(stream)
    against = Baseline(deep_base.get_output_embeddings(), None,
                       lambda slots, inputs: hidden_states(deep_base, *inputs[:4]))
    sets = [(0,), (2,), (3,), (1, 3), (0, 1, 2, 3)]
    found = restored_scores(deep_base, variant, sets, Feed(stream.ids, batch_size=3), planned, against)
    for layers, each in zip(sets, found):
        with restored(variant, deep_base, layers):
            whole = score_windows(variant, Feed(stream.ids, batch_size=3), planned, ScoreOptions(reference=against))
        assert each.layers == layers
        assert torch.equal(each.nll, whole.token_nll.double()) and torch.equal(each.kl, whole.extra.kl)
    assert float(found[-1].kl.max()) == 0  # every layer restored: the baseline


def test_recovered_share_is_a_ratio_of_window_sums():
    rng = np.random.default_rng(0)
    tokens = np.array([5, 7, 3, 9])
    loss = rng.random(tokens.sum())
    kept = loss * rng.random(tokens.sum())
    share, low, high = recovered_share(loss, kept, tokens, 0.95)
    assert share == pytest.approx(100 * (loss.sum() - kept.sum()) / loss.sum())
    assert low < share < high
    assert recovered_share(loss, loss, tokens, 0.95)[0] == 0
    assert recovered_share(loss, np.zeros_like(loss), tokens, 0.95)[0] == pytest.approx(100)
    assert recovered_share(np.zeros(5), np.zeros(5), np.array([5]), 0.95) == (0.0, 0.0, 0.0)  # nothing lost


@pytest.fixture(scope="module")
def deep_dirs(tmp_path_factory, tokenizer):
    """A 4-layer float32 Llama, trained a little (a random one's KL is all noise), and copies of it with
    layer 2, and layers 1 and 3, perturbed: checkpoints as an audit loads them."""
    from helpers import train_briefly

    folders = {name: tmp_path_factory.mktemp(name) for name in ("deep", "fault-2", "fault-1-3")}
    base = build_llama(folders["deep"], tokenizer, num_hidden_layers=LAYERS, hidden_size=64, initializer_range=0.02)
    train_briefly(base, tokenizer, steps=60)
    base.save_pretrained(folders["deep"])
    for name, layers in (("fault-2", [2]), ("fault-1-3", [1, 3])):
        faulty(base, layers, scale=0.02).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def _diagnosis(cli_main, capsys, config, variant: str, *options: str) -> dict:
    import json

    code = cli_main(["diagnose", str(config), "--variant", variant, "--json", *options])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # two audits and three diagnoses end to end
@pytest.mark.usefixtures("prefect_harness")
def test_diagnose_names_the_planted_layers_and_logs_a_child_of_the_audit(tmp_path, cache, capsys, deep_dirs,
                                                                         corpus_path):
    import json
    from pathlib import Path

    from helpers import write_config
    from mlflow import MlflowClient

    from flows.audit import audit
    from flows.cli import main
    from tasks.core.places import tracking_uri

    config = write_config(tmp_path / "d.yaml", deep_dirs["deep"], corpus_path,
                          [{"name": "one", "path": str(deep_dirs["fault-2"])},
                           {"name": "two", "path": str(deep_dirs["fault-1-3"])},
                           {"name": "same", "path": str(deep_dirs["deep"])}],
                          tracking={"experiment": "diagnose-test"})
    audited = audit(config=str(config), return_state=True)
    one = _diagnosis(main, capsys, config, "one", "--windows", "6", "--restore", str(LAYERS))
    assert one["variant"] == "one" and one["windows"] == 6 and one["tokens"] > 0
    assert one["ranking"][0] == 2
    own = {row["layer"]: row for row in one["layers"]}
    assert min(range(LAYERS), key=lambda i: own[i]["own_sqnr_db"]) == 2
    assert all(own[i]["own_sqnr_db"] == SQNR_CAP_DB and own[i]["own_cos_err"] == 0 for i in (0, 1, 3))
    assert own[2]["restore_recovery_pct"] > 90  # restoring the one faulty layer wins back nearly all the KL
    whole = one["restore_curve"][-1]  # every layer restored: the baseline itself
    assert sorted(whole["restored"]) == list(range(LAYERS)) and whole["kl"] == 0 and whole["delta_nll"] == 0
    assert one["restore_curve"][0]["restored"] == [] and one["restore_curve"][0]["kl"] == pytest.approx(one["kl"])

    two = _diagnosis(main, capsys, config, "two", "--windows", "6", "--restore", "2")
    assert sorted(two["ranking"][:2]) == [1, 3]
    assert sorted(two["restore_curve"][-1]["restored"]) == [1, 3]
    assert two["restore_curve"][-1]["kl"] < 0.05 * two["kl"]

    same = _diagnosis(main, capsys, config, "same", "--windows", "4", "--restore", "1")
    assert same["kl"] == 0 and same["delta_nll"] == 0 and same["head"]["kl"] == 0
    for row in same["layers"]:
        assert row["own_sqnr_db"] == row["accumulated_sqnr_db"] == SQNR_CAP_DB
        assert row["restore_recovery_pct"] == 0 and row["restore_nll_recovery_pct"] == 0

    client = MlflowClient(tracking_uri=tracking_uri())
    parent = client.search_runs([client.get_experiment_by_name("diagnose-test").experiment_id],
                                filter_string="tags.`ppl_audit.kind` = 'audit'")[0]
    assert audited.is_completed()
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                                                "tags.`ppl_audit.kind` = 'diagnosis'")
    assert sorted(run.data.tags["ppl_audit.variant"] for run in children) == ["one", "same", "two"]
    run = next(run for run in children if run.data.tags["ppl_audit.variant"] == "one")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"diagnosis.json", "layers.png", "restore_curve.png"} <= artifacts
    history = client.get_metric_history(run.info.run_id, "layer_own_sqnr_db")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(LAYERS))

    # an audit that diagnoses the variants that fail its gate, after the verdict, and links them from its report
    gated = audit(config=str(config), overrides=["diagnose=failed", "diagnosis.windows=4", "diagnosis.restore=1",
                                                 "thresholds.max_kld_mean=0.000001"], return_state=True)
    assert gated.is_failed() and gated.message.startswith("fail: ")
    latest = client.search_runs([parent.info.experiment_id], filter_string="tags.`ppl_audit.kind` = 'audit'",
                                order_by=["attributes.start_time DESC"])[0]
    assert latest.info.run_id != parent.info.run_id
    diagnosed = client.search_runs([parent.info.experiment_id],
                                   filter_string=f"tags.`mlflow.parentRunId` = '{latest.info.run_id}' and "
                                                 "tags.`ppl_audit.kind` = 'diagnosis'")
    assert sorted(run.data.tags["ppl_audit.variant"] for run in diagnosed) == ["one", "two"]  # "same" passed
    report = (Path(client.download_artifacts(latest.info.run_id, "report.html"))).read_text()
    assert "Diagnoses: where in the model it loses" in report
    for run in diagnosed:
        assert f"runs/{run.info.run_id}" in report
    logged = json.loads(Path(client.download_artifacts(diagnosed[0].info.run_id, "diagnosis.json")).read_text())
    assert logged["ranking"][0] == (2 if logged["variant"] == "one" else logged["ranking"][0])
    assert logged["where"]["tokens"] == logged["tokens"] and len(logged["where"]["top_kl"]) == 20


def test_diagnose_refuses_an_unknown_variant_in_one_line(tmp_path, capsys, deep_dirs, corpus_path):
    from helpers import write_config

    from flows.cli import main

    config = write_config(tmp_path / "u.yaml", deep_dirs["deep"], corpus_path,
                          [{"name": "one", "path": str(deep_dirs["fault-2"])}])
    assert main(["diagnose", str(config), "--variant", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ppl-audit: error: audit tiny has no variant 'nope'; give one of one"


def _diagnose_here(baseline: str, spec, settings, text: str, restore_k: int = 1):
    """A diagnosis through the library, its evaluations one after another here (the flow's sequential runner)."""
    from tasks.audit.checkpoints import prepare
    from tasks.audit.diagnose import Bench, examine, diagnosis_report, restore, sample, search
    from tasks.config import BaselineSpec
    from tasks.data.evaluation import evaluation
    from tasks.models.resolve import load_tokenizer

    lineup = prepare(BaselineSpec(name="baseline", path=baseline), [spec])
    scored = evaluation(text, load_tokenizer(baseline), settings)
    [checkpoint] = lineup.variants
    windows = sample(scored, 3, 0)
    bench = Bench()
    try:
        seen = examine(bench, checkpoint, lineup, scored, windows)
        alone, curve = search(seen, lambda sets: restore(bench, checkpoint, lineup, scored, windows, sets), restore_k)
    finally:
        bench.forget()
    return diagnosis_report(seen, alone, curve, 0.0)


def _lined_up(deep_dirs, variant: str = "fault-2"):
    from tasks.audit.checkpoints import prepare
    from tasks.config import BaselineSpec, EvaluationConfig, VariantSpec
    from tasks.data.evaluation import evaluation
    from tasks.models.resolve import load_tokenizer

    lineup = prepare(BaselineSpec(name="baseline", path=str(deep_dirs["deep"])),
                     [VariantSpec(name="one", path=str(deep_dirs[variant]))])
    settings = EvaluationConfig(max_tokens=300, window=64, stride=32, batch_size=4)
    return lineup, evaluation(make_text(400, seed=2), load_tokenizer(str(deep_dirs["deep"])), settings)


def test_a_bench_holds_one_pair_until_another_diagnosis_s_takes_its_place(cache, deep_dirs):
    from tasks.audit.diagnose import Bench

    lineup, scored = _lined_up(deep_dirs)
    other, _ = _lined_up(deep_dirs, "fault-1-3")
    bench = Bench()
    held = bench.pair(lineup.variants[0], lineup, scored)
    assert bench.pair(lineup.variants[0], lineup, scored) is held  # loaded once for every task that asks
    assert bench.pair(other.variants[0], other, scored) is not held
    bench.forget()
    assert not bench.holds()


@pytest.mark.usefixtures("prefect_harness")
def test_the_tasks_run_here_load_the_pair_into_the_flow_s_bench_not_the_worker_s(cache, deep_dirs):
    """A Prefect task run here is given the flow's own bench, not a copy of it: what the first task loads, the next
    finds, and the flow lets it go; the process-wide bench of cluster workers stays empty."""
    from tasks.audit.diagnose import Bench, sample
    from tasks.steps import WORKER_BENCH, examine_variant, restore_layers

    lineup, scored = _lined_up(deep_dirs)
    [checkpoint] = lineup.variants
    windows = sample(scored, 2, 0)
    bench = Bench()
    try:
        seen = examine_variant(checkpoint, lineup, scored, windows, bench)
        assert bench.holds() and not WORKER_BENCH.holds()
        held = bench.pair(checkpoint, lineup, scored)
        [found] = restore_layers(checkpoint, lineup, scored, windows, [(2,)], bench)
        assert bench.pair(checkpoint, lineup, scored) is held and not WORKER_BENCH.holds()
        assert found.kl.mean() < seen.kl.mean()  # the faulty layer put back
    finally:
        bench.forget()


FORMATS = {  # the formats ppl-audit loads, on the trained test Llama; GGUF on the embedded model
    "bnb-int8": {"method": "bnb-int8"},
    "torchao-int8": {"method": "torchao-int8"},
    "hqq": {"method": "hqq", "bits": 4, "group_size": 32},
    "gptq": {"method": "gptq", "bits": 4, "group_size": 32, "calibration": {"samples": 8, "seq_len": 64}},
    "awq": {"method": "awq", "bits": 4, "group_size": 32, "calibration": {"samples": 8, "seq_len": 64}},
    "compressed-tensors": {"path": "W4A16"},
}


@pytest.mark.parametrize("fmt", [pytest.param(fmt, marks=pytest.mark.slow) if fmt in ("gptq", "awq") else fmt
                                 for fmt in FORMATS])  # gptq and awq quantize first
def test_every_format_is_diagnosed_with_finite_figures(fmt, cache, trained_model_dir, tmp_path, text):
    from helpers import make_compressed

    from tasks.config import EvaluationConfig, VariantSpec

    options = dict(FORMATS[fmt])
    if fmt == "compressed-tensors":
        options["path"] = str(make_compressed(trained_model_dir, tmp_path / "w4a16", "W4A16"))
    settings = EvaluationConfig(max_tokens=400, window=64, stride=32, batch_size=4)
    found = _diagnose_here(str(trained_model_dir), VariantSpec(name=fmt.replace("-", "_"), **options), settings, text,
                           restore_k=2)
    assert found["kl"] > 0 and sorted(found["ranking"]) == [0, 1]
    figures = [value for row in found["layers"] for value in row.values()]
    assert all(np.isfinite(figures)), found["layers"]
    assert any(row["own_sqnr_db"] < SQNR_CAP_DB for row in found["layers"])  # its layers are quantized
    assert all(row["restore_mib"] > 0 for row in found["layers"])  # the float layer takes more than the quantized
    whole = found["restore_curve"][-1]
    assert sorted(whole["restored"]) == [0, 1] and whole["kl"] < found["kl"]
    # the typed diagnosis the views read is the dict the record keeps, key for key and in order; its table is drawn
    from tasks.record.diagnosis import diagnosis_table
    from tasks.record.diagnosis_said import VariantDiagnosis

    assert repr(VariantDiagnosis.of_record(found).as_record()) == repr(found)
    assert diagnosis_table(found).startswith(f"{found['variant']} (") and "restore curve (greedy)" in diagnosis_table(found)
    if found["embeddings"]["sqnr_db"] == SQNR_CAP_DB and found["head"]["kl"] == 0:
        assert whole["kl"] < 1e-9  # nothing but the decoder layers was quantized
    else:  # gptqmodel saves the embeddings in float16: restoring every layer leaves their rounding
        assert found["embeddings"]["sqnr_db"] < SQNR_CAP_DB or found["head"]["kl"] > 0


@pytest.mark.slow  # the embedded model's GGUF file
def test_a_gguf_variant_is_diagnosed_and_costed_from_its_file(cache, tmp_path):
    from helpers import rewrite_gguf

    from tasks.config import EvaluationConfig, VariantSpec
    from tasks.data.embedded import embedded_gguf

    path = rewrite_gguf(embedded_gguf(), tmp_path / "smollm2.Q8_0.gguf", "Q8_0")
    settings = EvaluationConfig(max_tokens=200, window=64, stride=32, batch_size=4)
    found = _diagnose_here("embedded", VariantSpec(name="q8_0", path=str(path)), settings, make_text(400), restore_k=0)
    assert len(found["layers"]) == 30 and found["kl"] > 0
    assert all(row["own_sqnr_db"] < SQNR_CAP_DB for row in found["layers"])  # Q8_0 moved every layer
    # a SmolLM2-135M layer's matrices hold 3,538,944 weights: 4 bytes each in float32, 34 bytes a block of 32 in
    # Q8_0 (its norms are float32 in both)
    assert all(row["restore_mib"] == 3_538_944 * (4 - 34 / 32) / 2**20 for row in found["layers"])


@pytest.mark.slow  # a local Dask cluster
@pytest.mark.usefixtures("prefect_harness")
def test_a_diagnosis_on_dask_workers_gives_the_figures_of_one_made_here(tmp_path, cache, deep_dirs, corpus_path):
    """The restore evaluations go to the audit's runner, each worker with its share of the layer sets and the models
    loaded once; the figures are those the same diagnosis gives here."""
    from helpers import write_config

    from flows.diagnose import diagnose

    config = write_config(tmp_path / "k.yaml", deep_dirs["deep"], corpus_path,
                          [{"name": "one", "path": str(deep_dirs["fault-2"])}], tracking={"experiment": "diagnose-dask"})
    settings = ["diagnosis.windows=4", "diagnosis.restore=2"]
    here = diagnose(config=str(config), variant="one", overrides=settings)
    there = diagnose(config=str(config), variant="one", overrides=settings + ["runner.kind=dask", "runner.workers=2"])
    assert there["ranking"] == here["ranking"] and there["ranking"][0] == 2
    for mine, theirs in zip(here["layers"], there["layers"]):
        assert theirs == pytest.approx(mine, rel=1e-9, abs=1e-12)
    assert [step["restored"] for step in there["restore_curve"]] == [step["restored"] for step in here["restore_curve"]]
