"""Too little evidence never passes a gate: a stream of one window is refused before anything starts, and where
it is scored anyway (a served audit, a library call) its gates say they cannot be judged."""

from __future__ import annotations

from helpers import write_config

from tasks.audit import scoring
from tasks.audit.checkpoints import prepare
from tasks.config import BaselineSpec, EvaluationConfig, Thresholds, VariantSpec, parse
from tasks.data.evaluation import evaluation
from tasks.record.verdict import comparison_row, format_table, judge_row

ONE_CHUNK = {"mode": "llama.cpp", "window": 64, "chunks": 1, "batch_size": 1}
GATE = {"max_ppl_increase_pct": 5, "max_kld_mean": 0.5, "min_top1_agreement": 0.5}


def test_a_gated_audit_of_one_window_is_refused_before_anything_starts(cli, tiny_model_dir, noisy_model_dir, corpus_path,
                                                                      tmp_path):
    config = write_config(tmp_path / "audit.yaml", tiny_model_dir, corpus_path,
                          [{"name": "noisy", "path": str(noisy_model_dir)}], evaluation=ONE_CHUNK, thresholds=GATE,
                          tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"})
    code, out, err = cli("run", str(config))
    assert code == 2 and out == "", err[-2000:]
    assert err.strip().splitlines() == [
        "ppl-audit: error: evaluation: the token stream (64 tokens) makes 1 window(s) of 64; a gate's paired interval "
        "needs at least 2: use a longer corpus, more max_tokens or chunks, or a shorter window"]
    assert not (tmp_path / "mlflow.db").exists()


def test_one_window_scored_anyway_is_judged_an_error_not_a_pass(tiny_model_dir, noisy_model_dir, corpus_path,
                                                                monkeypatch, tmp_path):
    monkeypatch.setenv("PPL_AUDIT_REFERENCES", str(tmp_path / "references"))
    lineup = prepare(BaselineSpec(name="baseline", path=str(tiny_model_dir)),
                     [VariantSpec(name="noisy", path=str(noisy_model_dir))])
    scored = evaluation(corpus_path.read_text(), lineup.tokenizer, parse(EvaluationConfig, ONE_CHUNK, "test"))
    base = scoring.baseline_outcome(lineup.baseline, scored)
    variant = scoring.variant_outcome(lineup.variants[0], lineup, scored, against=base)
    rows = [comparison_row(base, base, 64), comparison_row(variant, base, 64)]
    verdict = judge_row(rows[1], Thresholds(**GATE))
    assert rows[1].windows == 1 and verdict.status == "error"
    assert verdict.reason.count("cannot be judged") == 3 and "rests on 1 window(s)" in verdict.reason
    table = format_table(rows, {"noisy": verdict}).splitlines()
    assert table[3].split()[6] == "1"  # the windows it rests on
