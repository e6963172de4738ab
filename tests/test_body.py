"""The engine's faster bodies (tasks.engine.body) on CPU: a compiled body scores what the eager one scores, and
a body the machine cannot run is refused in one line before anything loads. Their speed is a GPU's matter
(benchmarks/body.py; tests/gpu holds the bf16 agreement there)."""

from __future__ import annotations

import pytest
import torch
from helpers import flat, write_config

from flows.cli import main
from tasks.engine.body import speed_up
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.models.loading import load_model


@pytest.mark.slow
def test_compiled_layers_score_as_the_eager_ones_to_float32_rounding(tiny_model_dir, tokenizer, text):
    from tasks.data.corpus import tokenize

    stream = tokenize(text, tokenizer, bos="stream", max_tokens=1200)
    eager = perplexity(load_model(str(tiny_model_dir), torch.float32, torch.device("cpu")), stream, Windowing(64, 32),
                       4)
    model = load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"))
    speed_up(model, "compile")
    try:
        compiled = perplexity(model, stream, Windowing(64, 32), 4)
    finally:
        torch._dynamo.reset()
    assert all(type(layer).__name__ == "LlamaDecoderLayer" and layer._compiled_call_impl is not None
               for layer in model.model.layers)
    assert compiled.n_tokens == eager.n_tokens
    # each token to float32 rounding (a few ulps of NLLs near 14), the corpus figure to 1e-6
    assert (abs(compiled.token_nll.astype("float64") - eager.token_nll) / abs(eager.token_nll).clip(1)).max() < 1e-5
    assert compiled.mean_nll == pytest.approx(eager.mean_nll, rel=1e-6, abs=0)


@pytest.mark.slow  # a whole audit, its layers compiled (before the CLI tests: their consoles close with capsys)
def test_an_audit_with_compiled_layers_gives_the_eager_audit_s_figures_and_records_its_body(tmp_path, monkeypatch,
                                                                                            trained_model_dir, corpus_path):
    from mlflow import MlflowClient

    from flows.audit import audit, result_of

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    rows = {}
    for body in ("eager", "compile"):
        config = write_config(tmp_path / f"{body}.yaml", trained_model_dir, corpus_path,
                              [{"name": "int8", "method": "torchao-int8"}], name=body,
                              tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": body})
        config.write_text(config.read_text().replace("evaluation:\n", f"evaluation:\n  body: {body}\n  divergence: off\n", 1))
        rows[body] = {row["variant"]: row for row in flat(result_of(audit(config=str(config), return_state=True)).rows)}
        torch._dynamo.reset()
    # float32 on CPU: the compiled variant's figure is the eager one's to float32 rounding
    assert rows["compile"]["int8"]["ppl"] == pytest.approx(rows["eager"]["int8"]["ppl"], rel=1e-6, abs=0)
    assert rows["compile"]["int8"]["ppl"] != rows["eager"]["int8"]["ppl"]  # it did run another way
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("compile").experiment_id],
                              "tags.`ppl_audit.kind` = 'variant'")
    assert [run.data.params["body"] for run in runs] == ["compile"]
    # the baseline's reference, stored by the eager audit, is reused: its figures are the body's to rounding
    assert rows["compile"]["baseline"]["baseline"] == "reused"


@pytest.mark.slow  # compiles
@pytest.mark.parametrize("residual", [0, 16])
def test_a_quantized_cache_rounds_in_a_compiled_body_as_in_the_eager_one(tiny_model_dir, tokenizer, text, residual):
    """The cache's round trip stays eager inside compiled layers: llama.cpp's rounding, not inductor's."""
    from tasks.config import VariantSpec
    from tasks.data.corpus import tokenize
    from tasks.models.variants import cache_format, load_variant

    stream = tokenize(text, tokenizer, bos="stream", max_tokens=1200)
    spec = VariantSpec(name="kv", device="cpu", kv_cache={"dtype": "int8", "group_size": 16, "residual": residual})
    options = ScoreOptions(kv_cache=cache_format(spec))
    eager = perplexity(load_variant(spec, str(tiny_model_dir), 64)[0], stream, Windowing(64, 32), 4, options)
    model, _ = load_variant(spec, str(tiny_model_dir), 64)
    speed_up(model, "compile")
    try:
        compiled = perplexity(model, stream, Windowing(64, 32), 4, options)
    finally:
        torch._dynamo.reset()
    assert compiled.mean_nll == pytest.approx(eager.mean_nll, rel=1e-6, abs=0)


def test_an_unknown_body_is_refused():
    with pytest.raises(ValueError, match="body 'fused' is not one of eager, compile, liger, liger"):
        speed_up(torch.nn.Module(), "fused")


@pytest.mark.parametrize("body, says", [
    ("liger", "evaluation.body liger: liger-kernel's fused ops run on CUDA, and baseline runs on cpu; use compile"),
    ("fused", "evaluation.body: Input should be 'eager', 'compile', 'liger' or 'liger+compile'"),
])
def test_a_body_this_machine_cannot_run_is_one_line_and_exit_2(capsys, tmp_path, tiny_model_dir, corpus_path, body, says):
    config = write_config(tmp_path / "body.yaml", tiny_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                          name="tiny")
    config.write_text(config.read_text().replace("evaluation:\n", f"evaluation:\n  body: {body}\n", 1))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err
