"""``runtime: llama.cpp`` in whole audits: a native crash, every way of stopping, the lineups an audit makes in
llama.cpp (an importance matrix, a transformers baseline converted, shards on Dask, a sequential stop). Apart from
tests/test_llama_cpp.py (the peer checks) so that the two run on two cores."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import json_line
from llama_cpp_peers import ROOT, audit, ladder, llama_perplexity, own_cache, peer_texts

from tasks.config import CorpusConfig
from tasks.data.corpus import corpus_text
from tasks.models import llama_cpp

pytestmark = pytest.mark.slow  # the embedded model, in both runtimes


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    return peer_texts(tmp_path_factory.mktemp("texts"))


@pytest.fixture(scope="module")
def made() -> dict[str, Path]:
    return ladder()



def test_a_crash_inside_llama_cpp_fails_that_variant_alone(cli, tmp_path, texts, made):
    """A native crash kills the worker process, not the audit: the variant fails with one line, the others score.
    1,024 tokens (7 windows): the worker scores them for several CPU-seconds, time enough to be killed in the middle
    (past 1 CPU-s it is scoring, as the line checked says), and the variant that scores needs no more."""
    import time

    import psutil
    from prefect.settings import PREFECT_API_URL

    config = {"name": "crash", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "evaluation": {"window": 256, "max_tokens": 1024, "batch_size": 4},
              "variants": [{"name": "served", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"},
                           {"name": "weights", "method": "gguf", "type": "Q8_0"}]}
    path = tmp_path / "crash.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # the session's Prefect server, as `cli`'s commands report to: without it the audit starts its own (~15 s)
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value()}
    audit_run = subprocess.Popen([str(ROOT / ".venv/bin/python"), "-m", "flows.cli", "run", str(path), "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    killed = None
    while audit_run.poll() is None and killed is None:
        for child in psutil.Process(audit_run.pid).children(recursive=True):
            try:
                if any("llama_cpp_worker" in part for part in child.cmdline()) and child.cpu_times().user > 1.0:
                    child.send_signal(signal.SIGSEGV)
                    killed = child.pid
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)  # a loop without a pause took one of the 2 cores the audit it watches runs on
    out, err = audit_run.communicate(timeout=600)
    assert killed is not None, err[-2000:]
    rows = {row["variant"]: row for row in json_line(out, err)["models"]}
    assert rows["served"]["verdict"] == "error"
    assert "llama.cpp was killed by SIGSEGV during score of variant 'served'" in rows["served"]["verdict_reason"]
    assert rows["weights"]["ppl"] > 1


def long_text(tmp_path: Path) -> Path:
    """1.5 MB of Austen: longer than any stop takes to come."""
    corpus = tmp_path / "long.txt"
    corpus.write_text(corpus_text(CorpusConfig(source="embedded"))[:1_500_000], encoding="utf-8")
    return corpus


def stopped_while_llama_cpp_evaluates(tmp_path: Path, database: Path, signum: int, *args: str) -> None:
    """``ppl-audit ARGS`` sent ``signum`` once its llama.cpp worker evaluates: it ends within the seconds every stop
    has, with its one line, and every process it started (the worker's included) is gone."""
    import time

    from test_processes import STOP_S, Command, alive, the_line

    command = Command(tmp_path, *args, database=database)
    try:
        def evaluating() -> bool:
            return any("llama_cpp_worker" in " ".join(p.cmdline()) and p.cpu_times().user > 2
                       for p in alive(command.process.children(recursive=True)))

        deadline = time.monotonic() + 300
        while not evaluating():
            assert time.monotonic() < deadline and command.process.poll() is None, command.log.read_text()[-2000:]
            time.sleep(0.5)
        command.signal(signum)
        assert command.ended_within(STOP_S) == 128 + signum
        the_line(command, signum)
        # gone within a second of the command's end: looked at as it goes, not after a second's sleep
        deadline = time.monotonic() + 1
        while alive(command.recorded) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(command.recorded), [" ".join(p.cmdline())[:100] for p in alive(command.recorded)]
    finally:
        command.stop()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_ppl_stopped_while_llama_cpp_evaluates_ends_at_once_with_its_worker(tmp_path, prefect_database, made, signum):
    """The worker is the command's child: it must be gone as soon as the command is, however it stops."""
    stopped_while_llama_cpp_evaluates(tmp_path, prefect_database, signum, "ppl", "--model", str(made["q8"]),
                                      "--corpus", str(long_text(tmp_path)), "--window", "256", "--runtime", "llama.cpp")


def test_an_audit_stopped_while_llama_cpp_scores_its_baseline_ends_at_once_with_every_process(tmp_path, prefect_database,
                                                                                             made):
    """``run`` with the baseline in llama.cpp, stopped by SIGTERM while llama.cpp evaluates: the audit, its Prefect
    server and the llama.cpp worker and tokenizer processes are all gone within the seconds every stop has."""
    config = tmp_path / "long.yaml"
    config.write_text(yaml.safe_dump({
        "name": "long", "baseline": {"name": "f32", "path": str(made["f32"]), "runtime": "llama.cpp"},
        "corpus": {"source": str(long_text(tmp_path))}, "evaluation": {"window": 256},
        "variants": [{"name": "q8", "method": "gguf", "path": str(made["q8"]), "runtime": "llama.cpp"}]}))
    stopped_while_llama_cpp_evaluates(tmp_path, prefect_database, signal.SIGTERM, "run", str(config))


def test_a_gguf_type_made_with_an_importance_matrix_of_the_calibration_text(cli, tmp_path, texts, monkeypatch):
    """``imatrix: true``: llama-imatrix over the variant's calibration samples (drawn outside the evaluated tokens),
    then llama.cpp's quantizer with it. The file says so (llama-quantize writes the matrix's chunks into it), the row
    is labelled, and on this text it loses less than the same type made without one (measured: KL 0.12 against 0.08
    at Q3_K_M). 1,024 tokens (7 windows of 256) show it as 2,048 did, and each of the three models scores half as
    much."""
    from tasks.models.gguf import gguf_facts

    samples = 8
    own_cache(tmp_path / "cache", monkeypatch)  # the files it makes, and only those
    config = {"name": "imatrix", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "evaluation": {"window": 256, "max_tokens": 1024, "batch_size": 4},
              "variants": [{"name": "plain", "method": "gguf", "type": "Q3_K_M"},
                           {"name": "imatrix", "method": "gguf", "type": "Q3_K_M", "imatrix": True,
                            "calibration": {"samples": samples, "seq_len": 256}}]}
    path = tmp_path / "imatrix.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, out, err = cli("run", str(path), "--json")
    assert code in (0, 1), err[-3000:]
    said = json_line(out, err)
    rows = {row["variant"]: row for row in said["models"]}
    assert rows["plain"]["method"] == "gguf Q3_K_M"
    assert rows["imatrix"]["method"] == "gguf Q3_K_M imatrix"
    kept = sorted(file.name for file in (tmp_path / "cache" / "gguf").glob("*.gguf"))
    assert len([name for name in kept if ".imatrix." in name]) == 1, kept  # the matrix, kept for the next type
    made = [gguf_facts(tmp_path / "cache" / "gguf" / name).get("imatrix_chunks", 0) for name in kept if "Q3_K_M" in name]
    assert sorted(made) == [0, samples], kept
    assert rows["imatrix"]["kld_mean"] < 0.8 * rows["plain"]["kld_mean"]
    assert rows["imatrix"]["delta_ppl_pct"] < rows["plain"]["delta_ppl_pct"]


def test_a_lineup_in_llama_cpp_scores_the_same_in_shards_on_dask_and_stops_early_sequential(cli, tmp_path, texts, made):
    """The baseline (the F32 file) and a variant in llama.cpp, each as 2 shards on a local Dask cluster: every figure
    equals the one-process audit's exactly (the baseline's reference joined from slices of llama.cpp's logits). Then a
    sequential audit stops once its verdict is settled.

    Windows of 128 (stride 64): what is checked is counted in windows, not tokens, and each costs half a window of 256.
    512 tokens (7 windows) make pieces of 4 and 3 windows, each more than one batch. The sequential audit scores at
    least 8 windows (4 batches of 2) before it may stop, so it runs on 1,536 tokens (23 windows): stopped within 10 of
    them, it has scored less than half the stream."""
    def run(name: str, **sections) -> dict:
        config = {"name": name, "baseline": {"name": "f32", "path": str(made["f32"]), "runtime": "llama.cpp",
                                             "rescore": "always"},
                  "corpus": {"source": str(texts["austen"])},
                  "evaluation": {"window": 128, "max_tokens": 512, "batch_size": 2},
                  "variants": [{"name": "q8", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"}]} | sections
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        code, out, err = cli("run", str(path), "--json", timeout=900)
        assert code in (0, 1), err[-3000:]
        return json_line(out, err)

    # how long, how made (the second rescores the first's reference: its drift from it), not what
    timing = {"tokens_per_second", "load_seconds", "reference", "reason", "verdict_reason", "baseline", "drift",
              "drift_from"}
    whole = run("whole")
    sharded = run("sharded", runner={"kind": "dask", "workers": 2, "shards": 2})
    assert [{k: v for k, v in row.items() if k not in timing} for row in sharded["models"]] == \
        [{k: v for k, v in row.items() if k not in timing} for row in whole["models"]]
    assert sharded["models"][1]["kld_mean"] > 0
    code, out, err = cli("reference", "ls")  # the joined reference says what scored it
    assert code == 0 and f"{made['f32']} (scored in llama.cpp {llama_cpp.version()})" in out + err, out + err
    stopped = run("sequential", baseline={"name": "f32", "path": str(made["f32"]), "runtime": "llama.cpp"},
                  evaluation={"window": 128, "max_tokens": 1536, "batch_size": 2, "sequential": True},
                  thresholds={"max_ppl_increase_pct": 5})
    row = stopped["models"][1]
    assert row["verdict"] == "pass" and row["scored_fraction"] < 0.5, row["verdict_reason"]


def test_type_variants_of_a_transformers_baseline_are_made_from_its_conversion(cli, tmp_path, texts, made, monkeypatch):
    """A baseline that is a transformers folder (the embedded model's, by its path): llama.cpp's convert_hf_to_gguf.py
    from the binding's source makes its GGUF file (float32 weights kept as F32), and the Q8_0 made from that scores
    as llama-perplexity scores the Q8_0 made from the packaged file those weights were dequantized from."""
    from tasks.models.resolve import resolve_model_path

    own_cache(tmp_path / "cache", monkeypatch)  # converted here, not found from another test
    text = texts["austen"]
    peer = llama_perplexity(made["q8"], text, tmp_path / "base.kld", kl=False)
    said = audit(cli, tmp_path, text, [{"name": "q8", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"}],
                 {"path": resolve_model_path("embedded")})
    row = {row["variant"]: row for row in said["models"]}["q8"]
    assert row["method"] == "gguf Q8_0 @llama.cpp", row.get("verdict_reason")
    assert row["ppl"] == pytest.approx(peer["ppl"], rel=1e-4)
    converted = sorted(path.name for path in (tmp_path / "cache" / "gguf").glob("*.gguf"))
    assert len(converted) == 2 and any(".F32." in name for name in converted), converted
