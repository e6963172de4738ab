"""The baseline reference: exact divergence without the baseline model, reuse only of a matching one,
whole-or-nothing writes, concurrent builds, drift, and the `ppl-audit reference` commands."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_llama, command_here, one_line_error, perturbed, rewrite_scores, stored_reference, write_config

from tasks.audit import reference, scoring
from tasks.audit.checkpoints import prepare
from tasks.audit.manifest import Draft, Head, Hidden, Identity, Manifest, Slice, Unreadable
from tasks.audit.pieces import Windows
from tasks.config import BaselineSpec, EvaluationConfig, Thresholds, VariantSpec, parse
from tasks.core.errors import InputError
from tasks.data.corpus import tokenize
from tasks.data.evaluation import evaluation
from tasks.engine.paired import divergence_summary
from tasks.engine.perplexity import hidden_states, perplexity
from tasks.engine.baseline import Baseline
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.models.loading import load_model
from tasks.record.verdict import comparison_row, format_stats, format_table, judge_row

CPU = torch.device("cpu")


def lockstep(base) -> Baseline:
    """The baseline model itself run on every batch beside the variant: what the reference replaces."""
    return Baseline(base.get_output_embeddings(), None, lambda slots, inputs: hidden_states(base, *inputs[:4]))


def relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-9)])
def test_kl_top1_and_dp_from_a_reference_equal_lockstep(tiny_model_dir, tokenizer, text, dtype, tolerance):
    base = load_model(str(tiny_model_dir), dtype, CPU)
    variant = perturbed(tiny_model_dir, dtype)
    stream = tokenize(text, tokenizer, max_tokens=400)
    stored, scored = stored_reference(base, stream, 64, 24, tiny_model_dir, f"equal-{dtype}", batch_size=3)
    from_reference = perplexity(variant, stream, Windowing(64, 24), 3,
                                ScoreOptions(reference=stored.baseline(str(tiny_model_dir), CPU)))
    in_lockstep = perplexity(variant, stream, Windowing(64, 24), 3, ScoreOptions(reference=lockstep(base)))
    for key in ("kl", "kl_reverse"):
        assert relative(from_reference.extra[key], in_lockstep.extra[key]) <= tolerance, key
    assert (from_reference.extra["top1"] == in_lockstep.extra["top1"]).all()
    assert float(np.mean(in_lockstep.extra["kl"])) > 1e-3  # there is a divergence to measure
    summary = {name: divergence_summary(r.extra, scored.token_nll, r.token_nll, r.window_tokens)
               for name, r in (("reference", from_reference), ("lockstep", in_lockstep))}
    for figure in ("dp_mean", "dp_rms", "kld_mean", "kld_reverse_mean", "top1_agreement", "kld_p99"):
        assert summary["reference"][figure] == pytest.approx(summary["lockstep"][figure], rel=tolerance, abs=1e-12)
    if dtype == torch.float64:  # another batch size pads differently: still the same numbers in float64
        other = perplexity(variant, stream, Windowing(64, 24), 5,
                           ScoreOptions(reference=stored.baseline(str(tiny_model_dir), CPU)))
        assert relative(other.extra["kl"], in_lockstep.extra["kl"]) <= tolerance


def audit_parts(model_dir: Path, text: str, rescore: str = "auto", **evaluation_settings):
    lineup = prepare(BaselineSpec(name="baseline", path=str(model_dir), rescore=rescore), [])
    settings = parse(EvaluationConfig, {"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 600,
                                        **evaluation_settings}, "test")
    return lineup, evaluation(text, lineup.tokenizer, settings)


def score_baseline(model_dir: Path, text: str, rescore: str = "auto", **evaluation_settings):
    lineup, scored = audit_parts(model_dir, text, rescore, **evaluation_settings)
    outcome = scoring.baseline_outcome(lineup.baseline, scored)
    assert outcome.ok, outcome.reason
    return outcome


@pytest.fixture
def references(tmp_path, monkeypatch) -> Path:
    """An empty references folder of this test's own."""
    monkeypatch.setenv("PPL_AUDIT_REFERENCES", str(tmp_path / "references"))
    return tmp_path / "references"


def test_a_reused_baseline_is_bit_identical_and_its_model_is_not_loaded(tiny_model_dir, text, references, monkeypatch):
    real, loads = scoring.load_variant, []

    def counted(spec, source, window=None):
        loads.append(spec.name)
        return real(spec, source, window)

    monkeypatch.setattr(scoring, "load_variant", counted)
    scored = score_baseline(tiny_model_dir, text)
    reused = score_baseline(tiny_model_dir, text)
    assert (scored.reference.baseline, reused.reference.baseline) == ("scored", "reused")
    assert len(loads) == 1 and scored.reference.key == reused.reference.key
    assert reused.result.ppl == scored.result.ppl and reused.result.nll_sum == scored.result.nll_sum
    assert np.array_equal(reused.result.token_nll, scored.result.token_nll)
    assert np.array_equal(reused.result.window_nll, scored.result.window_nll)
    assert reused.facts == scored.facts


def test_a_reference_of_another_model_tokenizer_stream_or_settings_is_never_used(tiny_model_dir, tokenizer, text,
                                                                                  references, tmp_path):
    first = score_baseline(tiny_model_dir, text)
    other_model = tmp_path / "other"
    build_llama(other_model, tokenizer, seed=1)
    changes = {"model": lambda: score_baseline(other_model, text),
               "stream": lambda: score_baseline(tiny_model_dir, text, max_tokens=500),
               "text": lambda: score_baseline(tiny_model_dir, text.replace("the", "a")),
               "window": lambda: score_baseline(tiny_model_dir, text, window=48),
               "stride": lambda: score_baseline(tiny_model_dir, text, stride=16),
               "mode": lambda: score_baseline(tiny_model_dir, text, mode="gptq"),
               "bos": lambda: score_baseline(tiny_model_dir, text, bos="none")}
    keys = {first.reference.key}
    for what, run in changes.items():
        outcome = run()
        assert outcome.reference.baseline == "scored", what
        assert outcome.reference.key not in keys, what
        keys.add(outcome.reference.key)
    # another tokenizer (the digest the audit computed of it) and another dtype: identities of their own
    lineup, scored = audit_parts(tiny_model_dir, text)
    base = lineup.baseline
    assert reference.identity(Path(base.source), "another tokenizer", scored.stream, scored.settings, torch.float32) \
        != reference.identity(Path(base.source), base.tokenizer, scored.stream, scored.settings, torch.float32)
    identity = reference.identity(Path(base.source), base.tokenizer, scored.stream, scored.settings, torch.float64)
    assert reference.find(identity, reference.environment(CPU), "never") == (None, None)
    # and a reference made with other library versions or another device is reused only under `never`
    identity = reference.identity(Path(base.source), base.tokenizer, scored.stream, scored.settings, torch.float32)
    elsewhere = {**reference.environment(CPU), "torch": "0.0.1"}
    assert reference.find(identity, elsewhere, "auto")[0] is None
    assert reference.find(identity, elsewhere, "auto")[1].key == first.reference.key  # compared with, for drift
    assert reference.find(identity, elsewhere, "never")[0].key == first.reference.key
    assert len(reference.stored()) == len(keys)


KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, "tests")
    from tasks.audit import reference
    from test_reference import score_baseline
    from pathlib import Path

    write = reference.Writer.__call__
    def write_then_die(self, slots, hidden):
        write(self, slots, hidden)
        os.kill(os.getpid(), signal.SIGKILL)  # mid-scoring, the reference half written
    reference.Writer.__call__ = write_then_die
    score_baseline(Path(sys.argv[1]), Path(sys.argv[2]).read_text())
""")


def test_a_run_killed_while_writing_leaves_nothing_a_later_run_picks_up(tiny_model_dir, text, references, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    done = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tiny_model_dir), str(corpus)],
                          capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    left = [staging for folder in (references / ".building").iterdir() for staging in folder.iterdir()]
    assert any((staging / reference.HIDDEN).is_file() for staging in left)  # half written, in its scratch folder
    assert reference.stored() == []
    later = score_baseline(tiny_model_dir, text)
    assert later.reference.baseline == "scored" and len(reference.stored()) == 1
    assert list((references / ".building").iterdir()) == []  # the dead build's folder is gone too


def test_two_builds_of_the_same_reference_keep_one(tiny_model_dir, tokenizer, text, references):
    """The race itself, made certain: the second build to finish finds the first's in place, keeps it and
    uses it; a rescore (replace) takes its place whole."""
    model = load_model(str(tiny_model_dir), torch.float32, CPU)
    stream = tokenize(text, tokenizer, max_tokens=300)
    first, _ = stored_reference(model, stream, 64, 32, tiny_model_dir, "same")
    second, _ = stored_reference(model, stream, 64, 32, tiny_model_dir, "same")
    assert second.folder == first.folder and second.manifest.created == first.manifest.created
    assert [r.key for r in reference.stored()] == ["same"] and list((references / ".building").iterdir()) == []


@pytest.mark.slow  # two audits at once
def test_two_concurrent_audits_building_the_same_reference_both_succeed(tiny_model_dir, text, references, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    config = write_config(tmp_path / "audit.yaml", tiny_model_dir, corpus, [{"name": "int8", "method": "torchao-int8"}])
    command = [sys.executable, "-m", "flows.cli", "reference", "build", str(config)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    [stored] = reference.stored()
    for out, _ in outputs:
        assert f"reference {stored.key} in {stored.folder}" in out
    assert list((references / ".building").iterdir()) == []


def test_drift_is_flagged_when_the_baseline_s_numbers_move_and_not_on_a_clean_rescore(tiny_model_dir, text,
                                                                                      references):
    built = score_baseline(tiny_model_dir, text)
    clean = score_baseline(tiny_model_dir, text, rescore="always", batch_size=1)  # other padding: float noise only
    drift = clean.reference.drift
    assert drift["reference"] == built.reference.key and not drift["drift"]
    assert 0 <= drift["max_abs_delta_nll"] < 1e-4 and drift["changed"] == {}
    # as if the stored numbers came from a torch that computed this model differently
    def moved_by_another_torch(token_nll):
        token_nll[::7] += 0.01
        return token_nll

    rewrite_scores(Path(clean.reference.path), moved_by_another_torch)
    moved = score_baseline(tiny_model_dir, text, rescore="always")
    assert moved.reference.drift["drift"] and moved.reference.drift["max_abs_delta_nll"] == pytest.approx(0.01, rel=1e-3)
    # the rescore took the drifted reference's place: the next audit reuses the numbers of this environment
    again = score_baseline(tiny_model_dir, text)
    assert again.reference.baseline == "reused" and again.result.ppl == moved.result.ppl


@pytest.mark.slow  # audits twice through the CLI: in this process, then as users do
def test_drift_reaches_the_audit_s_reason_and_its_mlflow_run(cli, capsys, tiny_model_dir, text, references, tmp_path):
    from mlflow import MlflowClient

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = write_config(tmp_path / "audit.yaml", tiny_model_dir, corpus, [{"name": "int8", "method": "torchao-int8"}],
                          tracking={"uri": store, "experiment": "drift"})
    code, out, err = command_here(capsys, "run", str(config))
    assert code == 0
    assert "baseline, scored (reference " in out
    [stored] = reference.stored()
    rewrite_scores(stored.folder, lambda token_nll: token_nll * np.float32(1.01))
    code, out, err = cli("run", str(config), "--set", "baseline.rescore=always", "--stats", "full")
    assert code == 0, err[-2000:]
    assert "ENVIRONMENT DRIFT from" in out and "verdict: NO GATE — environment drift: the baseline's NLL moved" in out
    assert "====== KL divergence statistics ======" in out and "Same top p:" in out
    client = MlflowClient(store)
    [latest, first] = client.search_runs([client.get_experiment_by_name("drift").experiment_id],
                                         "tags.`ppl_audit.kind` = 'audit'", order_by=["attributes.start_time DESC"])
    assert first.data.tags["ppl_audit.baseline"] == "scored" and "ppl_audit.drift" not in first.data.tags
    assert latest.data.tags["ppl_audit.drift"] == "environment drift"
    assert latest.data.tags["ppl_audit.reference"] == stored.key
    assert "environment drift" in latest.data.tags["audit.reason"]


@pytest.mark.slow  # three CLI processes
def test_reference_commands_list_and_remove(cli, capsys, tiny_model_dir, tokenizer, text, references):
    model = load_model(str(tiny_model_dir), torch.float32, CPU)
    stream = tokenize(text, tokenizer, max_tokens=300)
    for key in ("aaaa", "bbbb", "cccc"):
        stored_reference(model, stream, 64, 32, tiny_model_dir, key)
    code, out, _ = cli("reference", "ls")
    assert code == 0 and out.count(str(tiny_model_dir)) == 3 and "3 reference(s)" in out
    code, out, _ = cli("reference", "rm", "bbbb")
    assert code == 0 and "removed 1 reference(s)" in out
    assert sorted(r.key for r in reference.stored()) == ["aaaa", "cccc"]
    code, out, _ = command_here(capsys, "reference", "rm", "--older-than", "1h")
    assert code == 0 and "removed 0 reference(s)" in out and len(reference.stored()) == 2
    reference.Reference.open(references / "cccc").touch()  # reused since it was made: aaaa is the least recent
    code, out, _ = command_here(capsys, "reference", "rm", "--over",
                     f"{reference.Reference.open(references / 'aaaa').size_bytes + 10}")
    assert code == 0 and [r.key for r in reference.stored()] == ["cccc"]  # the least recently used went first
    code, out, err = cli("reference", "rm", "--older-than", "soon")  # a bad argument, as a user's command ends
    assert code == 2 and "is not an age" in err and "Traceback" not in err, err
    code, _, err = command_here(capsys, "reference", "rm", "--over", "big")  # argparse's refusal, in this process
    assert code == 2 and "is not a size" in err and "Traceback" not in err, err
    for bad, says in ((("rm",), "name the keys"), (("rm", "nope"), "no reference nope")):  # bad input past argparse
        assert says in one_line_error(capsys, "reference", *bad), bad


def test_retired_divergence_settings_and_a_variant_s_rescore_get_one_line(tmp_path):
    from tasks.config import load_audit_config

    for setting, says in (("evaluation.divergence=lockstep", "divergence lockstep is retired"),
                          ("evaluation.top_k=32", "top_k is retired"),
                          ("variants.0.rescore=always", "variants.0.rescore: unknown key")):
        config = write_config(tmp_path / "audit.yaml", tmp_path, tmp_path, [{"name": "q", "method": "torchao-int8"}])
        with pytest.raises(InputError, match=says):
            load_audit_config(str(config), [setting])
    assert EvaluationConfig.of_record({"window": 64, "divergence": "topk", "top_k": 8}).divergence is True
    for yaml_word, value in (("on", True), ("off", False)):
        config = write_config(tmp_path / "audit.yaml", tmp_path, tmp_path, [{"name": "q", "method": "torchao-int8"}])
        assert load_audit_config(str(config), [f"evaluation.divergence={yaml_word}"]).evaluation.divergence is value


def test_a_reference_that_cannot_be_written_loses_the_kl_not_the_scores(tiny_model_dir, text, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("PPL_AUDIT_REFERENCES", str(blocked / "references"))
    lineup = prepare(BaselineSpec(name="baseline", path=str(tiny_model_dir)),
                     [VariantSpec(name="int8", method="torchao-int8")])
    scored = evaluation(text, lineup.tokenizer, parse(EvaluationConfig, {"window": 64, "max_tokens": 600}, "test"))
    baseline = scoring.baseline_outcome(lineup.baseline, scored)
    assert baseline.ok and baseline.reference.key is None and "could not write the baseline reference" in \
        baseline.reference.problem
    variant = scoring.variant_outcome(lineup.variants[0], lineup, scored, against=baseline)
    assert variant.ok and "kl" not in variant.result.extra
    verdict = judge_row(comparison_row(variant, baseline, 64), Thresholds(max_kld_mean=0.1))
    assert verdict.status == "error" and "could not write the baseline reference" in verdict.reason
    rows = [comparison_row(baseline, baseline, 64), comparison_row(variant, baseline, 64)]
    ungated = judge_row(rows[1], Thresholds())
    assert rows[1].divergence_absent == baseline.reference.problem
    table = format_table(rows, {"int8": ungated}).splitlines()
    assert table[-1].endswith(f"; no KLD: {baseline.reference.problem}")  # the blank column says why
    assert format_stats(rows) == ("### int8 against baseline: no KL divergence statistics: "
                                  f"{baseline.reference.problem}")



def test_a_reference_joined_from_slices_is_the_one_written_whole_and_a_bad_slice_makes_none(tiny_model_dir, text,
                                                                                            references):
    """The baseline as a cluster scores it (``tasks.audit.scoring``: shards that each write a slice, then joined):
    the same per-token NLL and a reference of the same bytes as scored whole; a slice damaged or lost after it was
    written makes no reference (the figures stand, the record says why), and the slices are removed either way."""
    from tasks.engine.perplexity import shard_bounds
    from tasks.engine.windows import plan

    whole = score_baseline(tiny_model_dir, text)
    folder = Path(whole.reference.path)
    files = {f.name: f.read_bytes() for f in folder.iterdir() if f.name != reference.MANIFEST}
    lineup, scored = audit_parts(tiny_model_dir, text, rescore="always")
    bounds = shard_bounds(len(plan(scored.stream, 64, 32)), 3, 4)

    def in_slices(damage=None):
        lookup = scoring.look_up(lineup.baseline, scored)
        shards = [scoring.baseline_outcome(lineup.baseline, scored, scoring.BaselineSlice(Windows(*w), lookup)) for w in bounds]
        if damage is not None:
            damage([Path(shard.reference.slice) for shard in shards])
        merged = scoring.merge_shards(shards, scored)
        said = scoring.join_reference(lookup, merged, shards, scored)
        assert not scoring.slices_dir(lookup).exists()
        return merged, said

    merged, said = in_slices()
    assert len(bounds) == 3 and np.array_equal(merged.result.token_nll, whole.result.token_nll)
    assert said.path == str(folder) and said.drift["max_abs_delta_nll"] == 0
    assert {f.name: f.read_bytes() for f in folder.iterdir() if f.name != reference.MANIFEST} == files

    def flip_a_byte(pieces: list[Path]) -> None:
        with open(pieces[1] / reference.HIDDEN, "r+b") as file:
            file.seek(7)
            byte = file.read(1)
            file.seek(7)
            file.write(bytes([byte[0] ^ 1]))

    def forget_the_head(pieces: list[Path]) -> None:
        about = json.loads((pieces[0] / reference.SLICE).read_text())
        (pieces[0] / reference.SLICE).write_text(json.dumps(about | {"head": None}))

    for damage, says in ((flip_a_byte, "does not hold what was written"),
                         (lambda pieces: shutil.rmtree(pieces[1]), "is missing, damaged"),
                         (forget_the_head, "does not name its LM head")):
        if folder.exists():  # none to compare the slices' with, nor to keep in place of a bad join
            reference.remove(reference.Reference.open(folder))
        merged, said = in_slices(damage)
        assert merged.ok and np.array_equal(merged.result.token_nll, whole.result.token_nll)
        assert says in said.problem and said.path is None and not folder.exists(), said


def test_a_variant_shard_reads_the_baseline_s_slices_as_the_joined_reference_and_refuses_a_damaged_one(
        tiny_model_dir, text, references):
    """A variant's shard on a cluster starts before the baseline's slices are joined: against its own windows' slice
    (and the first's LM head) it measures every per-token divergence the joined reference gives, bit for bit; a
    slice whose bytes changed after it was written is refused, not read."""
    from tasks.core.errors import DamagedReference
    from tasks.engine.perplexity import score_part, shard_bounds
    from tasks.engine.windows import plan

    lineup, scored = audit_parts(tiny_model_dir, text, rescore="always")
    bounds = shard_bounds(len(plan(scored.stream, 64, 32)), 3, 4)
    lookup = scoring.look_up(lineup.baseline, scored)
    shards = [scoring.baseline_outcome(lineup.baseline, scored, scoring.BaselineSlice(Windows(*w), lookup)) for w in bounds]
    slices = [Path(shard.reference.slice) for shard in shards]
    variant = perturbed(tiny_model_dir, torch.float32)
    against = {n: reference.slice_baseline(list(dict.fromkeys([slices[0], slices[n]])),
                                           shards[n].part.scores.token_nll, str(tiny_model_dir), CPU)
               for n in range(len(bounds))}
    from_slices = [score_part(variant, scored.stream, Windowing(64, 32), 4, w, ScoreOptions(reference=against[n]))
                   for n, w in enumerate(bounds)]
    said = scoring.join_reference(lookup, scoring.merge_shards(shards, scored), shards, scored)
    joined = reference.Reference.open(Path(said.path)).baseline(str(tiny_model_dir), CPU)
    for w, part in zip(bounds, from_slices):
        whole = score_part(variant, scored.stream, Windowing(64, 32), 4, w, ScoreOptions(reference=joined))
        assert part.scores.extra.keys() == whole.scores.extra.keys() and "kl" in whole.scores.extra
        for key in whole.scores.extra:
            assert torch.equal(part.scores.extra[key], whole.scores.extra[key]), key
    shards = [scoring.baseline_outcome(lineup.baseline, scored, scoring.BaselineSlice(Windows(*w), lookup)) for w in bounds]
    damaged = Path(shards[1].reference.slice) / reference.HIDDEN
    damaged.write_bytes(damaged.read_bytes()[:-1] + bytes([damaged.read_bytes()[-1] ^ 1]))
    with pytest.raises(DamagedReference, match="does not hold what was written"):
        reference.slice_baseline([Path(shards[0].reference.slice), damaged.parent],
                                 shards[1].part.scores.token_nll, str(tiny_model_dir), CPU)


def test_the_record_says_the_baseline_s_reference_in_the_dict_it_always_held(tiny_model_dir, text, references):
    """``ReferenceSaid.as_record``: a spooled record is replayed long after (``ppl-audit sync``), so the typed value
    is written as the dict the audit wrote before it was typed: the same keys, in the same order, none added."""
    from tasks.record.reference_said import Drift, ReferenceSaid

    scored = score_baseline(tiny_model_dir, text).reference.as_record()
    reused = score_baseline(tiny_model_dir, text).reference.as_record()
    rescored = score_baseline(tiny_model_dir, text, rescore="always").reference.as_record()
    assert list(scored) == ["baseline_key", "baseline", "key", "path"] and scored["baseline"] == "scored"
    assert reused == scored | {"baseline": "reused"} and list(reused) == list(scored)
    assert list(rescored) == ["baseline_key", "baseline", "key", "drift", "path"] and not rescored["drift"]["drift"]
    # the drift read as ``Drift`` is written back key for key, each to its own field
    assert list(Drift.of_record(rescored["drift"]).as_record().items()) == list(rescored["drift"].items())
    assert json.loads(json.dumps(rescored)) == rescored  # plain data: what the spool writes is what it reads
    unkept = ReferenceSaid(baseline="scored", problem="not on this machine").as_record()
    assert list(unkept.items()) == [("baseline", "scored"), ("key", None), ("problem", "not on this machine")]
    removed = ReferenceSaid("scored", None, None, "b", ("k: damaged",), {"drift": False}, "full").as_record()
    assert list(removed) == ["baseline_key", "removed", "baseline", "key", "drift", "problem"]
    assert removed["removed"] == ["k: damaged"] and ReferenceSaid().as_record() == {}
    # each read back (``of_record``, by its fields' names) is the value it was written from, and writes the same dict
    for said in (scored, reused, rescored, unkept, removed):
        assert list(ReferenceSaid.of_record(said).as_record().items()) == list(said.items())
    assert ReferenceSaid.of_record(removed) == ReferenceSaid("scored", None, None, "b", ("k: damaged",),
                                                             {"drift": False}, "full")


# A manifest as the code before the typed ``Manifest`` wrote it (``json.dumps(manifest, indent=1)`` of this dict, key
# for key in this order; a real one, its digest as written): each reference on disk today is one like it.
WRITTEN_BEFORE = {
    "identity": {"format": 2, "model": "82f5a9dfebe34ac9edc15eb8865c8cb1aaff1170e7954c0214b146605627fb6f",
                 "tokenizer": "ad639025abda1898f9b554b588a69ab68bc8da20a651ae636d4ec626fa38d1bf",
                 "stream": "de114e2462c77e368094bd80a27ccc106b40bbca684703c7d7a33b0095983060", "mode": "sliding",
                 "window": 64, "stride": 32, "bos": "stream", "dtype": "float32"},
    "environment": {"torch": "2.13.0+cpu", "transformers": "5.23.0", "device": "cpu"},
    "source": "/tmp/helperF/before/tiny-llama0",
    "facts": {"method": "baseline", "source": "/tmp/helperF/before/tiny-llama0", "device": "cpu", "dtype": "float32",
              "load_seconds": 0.011577345001569483, "size_on_disk_bytes": 494944, "weight_memory_bytes": 492864,
              "quantized_layers": 0, "linear_layers": 15, "backend": "torch.nn.Linear",
              "versions": {"torch": "2.13.0+cpu", "transformers": "5.23.0"}, "quantization": {}, "kernels": {},
              "worker": "", "parity": {}, "bits_per_weight": 32.0, "model_bits_per_weight": 32.0, "kv_cache": "",
              "kv_bytes_per_token": 512.0, "body": "eager"},
    "hidden": {"shape": [599, 64], "dtype": "float32"},
    "head": {"name": "lm_head.weight", "digest": "934e726d45d0ee122597c0d00cf560d96c6e3137e34d129fe69c14b24b7bafeb",
             "stored": False, "softcap": None},
    "format": 2, "key": "780b9e22d13021e6", "created": 1795939456.6683145,
    "result": {"model": "baseline", "n_tokens": 599, "nll_sum": 5106.110706806183, "mean_nll": 8.524391831062076,
               "ppl": 5036.123060685055, "stderr": 0.09825394904738886, "ppl_stderr": 494.8189786009294,
               "n_bytes": 2012, "n_words": 416, "bits_per_byte": 3.6613124229320677, "byte_ppl": 12.652165459649671,
               "word_ppl": 214122.71916170258, "window": 64, "stride": 32, "batch_size": 4, "bos": "stream",
               "mode": "sliding", "n_windows": 18, "device": "cpu", "dtype": "float32",
               "corpus_digest": "b4bcd6101af882dac0513f9fd9cf8d70012bf97963f8b9cf6d7779e3979f30cd",
               "wall_seconds": 1.1345177839975804, "tokens_per_second": 527.9776204912073,
               "peak_memory_bytes": 556814336, "absent": {}, "scored_fraction": 1.0},
    "files": {"hidden.bin": {"bytes": 153344, "sha256": "003c3aa7074c1e3d310487b609d9c3c14d89777815b9f764c66934d75bf2678e"},
              "scores.npz": {"bytes": 6108, "sha256": "86f66ff20a9431e1f732cd73e256d5c747113423383b15ad2f3153677d69bb96"}},
    "size_bytes": 161662,
    "digest": "ab26a80c1f96d6df1969e866869a8764495c0cb42ed3e48638a38e9cda400105",
}


def test_a_manifest_written_before_reads_field_for_field_and_is_written_back_byte_for_byte(tmp_path):
    """The typed manifest reads one written before it (its key and digests unchanged, so its reference is found and
    reused) into the values it holds, and writes it back as the same bytes; one of another folder is refused."""
    folder = tmp_path / WRITTEN_BEFORE["key"]
    folder.mkdir()
    (folder / reference.MANIFEST).write_text(json.dumps(WRITTEN_BEFORE, indent=1))
    found = reference.Reference.read(folder)
    assert found.problem is None and found.created == 1795939456.6683145
    read = found.manifest
    assert read.identity == Identity(2, "82f5a9dfebe34ac9edc15eb8865c8cb1aaff1170e7954c0214b146605627fb6f",
                                     "ad639025abda1898f9b554b588a69ab68bc8da20a651ae636d4ec626fa38d1bf",
                                     "de114e2462c77e368094bd80a27ccc106b40bbca684703c7d7a33b0095983060", "sliding",
                                     64, 32, "stream", "float32")
    assert reference.key_of(read.identity.as_dict(), read.environment) == read.key == "780b9e22d13021e6"
    assert (read.source, read.hidden, read.head, read.softcap) == (
        "/tmp/helperF/before/tiny-llama0", Hidden(599, 64, "float32"),
        Head("lm_head.weight", "934e726d45d0ee122597c0d00cf560d96c6e3137e34d129fe69c14b24b7bafeb", False), None)
    assert (read.result.n_tokens, read.result.nll_sum, read.result.mean_nll, read.result.ppl) == (
        599, 5106.110706806183, 8.524391831062076, 5036.123060685055)
    assert (read.environment, read.facts, read.result.summary, read.files, read.size_bytes, read.digest) == tuple(
        WRITTEN_BEFORE[name] for name in ("environment", "facts", "result", "files", "size_bytes", "digest"))
    assert read.text() == (folder / reference.MANIFEST).read_text()
    assert Manifest.of_json(json.loads(read.text()), read.key) == read
    with pytest.raises(Unreadable, match="is reference 780b9e22d13021e6's, not other's"):
        Manifest.of_json(WRITTEN_BEFORE, "other")


def test_a_manifest_and_a_slice_written_are_read_back_equal(tmp_path):
    """What the writer makes of a reference (a runtime's logits head, a soft-cap) and of a slice is what reading its
    JSON gives back, and its seal is a manifest's: a field written or read wrong is told."""
    identity = Identity(2, "m", "t", "s", "sliding", 64, 32, "stream", "bfloat16", "llama.cpp b1", {"n_ctx": 64})
    head = Head("", "logits of 32", False, logits=32)
    files = {"hidden.bin": {"bytes": 10, "sha256": "h"}, "scores.npz": {"bytes": 20, "sha256": "s"}}
    made = Manifest.made(Draft(identity, {"torch": "2"}, "/model", {"method": "baseline"}, 30.0), "k", 1.5,
                         {"n_tokens": 3, "nll_sum": 6.0, "mean_nll": 2.0, "ppl": 7.389}, Hidden(3, 32, "bfloat16"),
                         head, files)
    written = json.loads(made.text())
    assert written["head"] == {"name": "", "logits": 32, "digest": "logits of 32", "stored": False, "softcap": 30.0}
    assert written["identity"] == identity.as_dict() and written["size_bytes"] == 30 + len(json.dumps(
        {k: v for k, v in written.items() if k not in ("size_bytes", "digest")}))
    assert written["digest"] == reference.manifest_digest(written)
    assert Manifest.of_json(written, "k") == made and made.softcap == 30.0 and made.head.logits == 32
    first = Slice(0, 3, Hidden(3, 32, "bfloat16"), "h", head, 30.0)
    assert Slice.of_json(json.loads(json.dumps(first.to_json()))) == first
    assert Slice.of_json(Slice(3, 5, Hidden(2, 32, "bfloat16"), "g").to_json()).head is None
