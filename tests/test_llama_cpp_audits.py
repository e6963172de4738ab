"""``runtime: llama.cpp`` in whole audits: a native crash, every way of stopping, the lineups an audit makes in
llama.cpp (an importance matrix, a transformers baseline converted, shards on Dask, a sequential stop). Apart from
tests/test_llama_cpp.py (the peer checks) so that the two run on two cores."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import json_line
from llama_cpp_peers import ROOT, audit, ladder, llama_perplexity, own_cache, peer_texts

from tasks.config import CorpusConfig
from tasks.data.corpus import corpus_text
from tasks.models import llama_cpp

pytestmark = pytest.mark.slow  # the embedded model, in both runtimes
SAMPLES = 8  # the importance matrix's calibration samples: its chunks, as the file made with it says


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    return peer_texts(tmp_path_factory.mktemp("texts"))


@pytest.fixture(scope="module")
def made() -> dict[str, Path]:
    return ladder()


@dataclass(frozen=True)
class Crashed:
    """The module's audit in which llama.cpp crashed (``crashed``): its rows by variant, all it said, the cache it made
    its files in, and the worker killed (None if none was seen scoring)."""

    rows: dict[str, dict]
    err: str
    cache: Path
    killed: int | None


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, cli, texts, made) -> Crashed:
    """One audit, run once for the module, that two tests read: the embedded baseline and two Q3_K_M types made from
    its file in transformers, one with an importance matrix of its calibration text, and the Q8_0 file in llama.cpp
    (``served``), whose worker is sent SIGSEGV in the middle of its scoring. Each test's own audit scored the baseline
    again (and the crash's a Q8_0 in transformers beside it, to see the others score): two Q3_K_M rows show that.

    1,024 tokens (7 windows of 256): the llama.cpp worker scores them for several CPU-seconds, time enough to be killed
    in the middle (past 1 CPU-s it is scoring, as the line checked says); the importance matrix shows its gain on them
    as on 2,048, and each model scores half as much. Its cache its own: the GGUF files it finds there are the ones
    it made."""
    import time

    import psutil
    from prefect.settings import PREFECT_API_URL

    folder = tmp_path_factory.mktemp("crashed")
    config = {"name": "crash", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "evaluation": {"window": 256, "max_tokens": 1024, "batch_size": 4},
              "variants": [{"name": "served", "method": "gguf", "path": str(made["q8"]), "runtime": "llama.cpp"},
                           {"name": "plain", "method": "gguf", "type": "Q3_K_M"},
                           {"name": "imatrix", "method": "gguf", "type": "Q3_K_M", "imatrix": True,
                            "calibration": {"samples": SAMPLES, "seq_len": 256}}]}
    path = folder / "crash.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.MonkeyPatch.context() as patch:
        cache = own_cache(folder / "cache", patch)  # the files it makes, and only those
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
    out, err = audit_run.communicate(timeout=900)
    assert audit_run.returncode in (0, 1), err[-3000:]
    return Crashed({row["variant"]: row for row in json_line(out, err)["models"]}, err, cache, killed)


def test_a_crash_inside_llama_cpp_fails_that_variant_alone(crashed):
    """A native crash kills the worker process, not the audit: the variant fails with one line, the others score."""
    assert crashed.killed is not None, crashed.err[-2000:]
    assert crashed.rows["served"]["verdict"] == "error"
    assert "llama.cpp was killed by SIGSEGV during score of variant 'served'" in crashed.rows["served"]["verdict_reason"]
    assert crashed.rows["plain"]["ppl"] > 1 and crashed.rows["imatrix"]["ppl"] > 1


def long_text(tmp_path: Path) -> Path:
    """300 kB of Austen (~70,000 tokens, some 550 windows of 256): longer than any stop takes to come. 1.5 MB before:
    its tokenization alone took llama.cpp's tokenizer worker 2.2 CPU-s (measured), past the 2 that say a worker
    evaluates, and the command's own offsets and transformers' tokens of it several more."""
    corpus = tmp_path / "long.txt"
    corpus.write_text(corpus_text(CorpusConfig(source="embedded"))[:300_000], encoding="utf-8")
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


def test_a_gguf_type_made_with_an_importance_matrix_of_the_calibration_text(crashed):
    """``imatrix: true``: llama-imatrix over the variant's calibration samples (drawn outside the evaluated tokens),
    then llama.cpp's quantizer with it. The file says so (llama-quantize writes the matrix's chunks into it), the row
    is labelled, and on this text it loses less than the same type made without one (measured: KL 0.12 against 0.08
    at Q3_K_M). Read from the module's audit (``crashed``), whose other variant crashed."""
    from tasks.models.gguf import gguf_facts

    rows = crashed.rows
    assert rows["plain"]["method"] == "gguf Q3_K_M"
    assert rows["imatrix"]["method"] == "gguf Q3_K_M imatrix"
    kept = sorted(file.name for file in (crashed.cache / "gguf").glob("*.gguf"))
    assert len([name for name in kept if ".imatrix." in name]) == 1, kept  # the matrix, kept for the next type
    made = [gguf_facts(crashed.cache / "gguf" / name).get("imatrix_chunks", 0) for name in kept if "Q3_K_M" in name]
    assert sorted(made) == [0, SAMPLES], kept
    assert rows["imatrix"]["kld_mean"] < 0.8 * rows["plain"]["kld_mean"]
    assert rows["imatrix"]["delta_ppl_pct"] < rows["plain"]["delta_ppl_pct"]


def test_a_lineup_in_llama_cpp_scores_the_same_in_shards_on_dask_and_stops_early_sequential(cli, tmp_path, texts, made,
                                                                                           capsys):
    """The baseline (the F32 file) and a variant in llama.cpp, each as 2 shards on a local Dask cluster: every figure
    equals the one-process audit's exactly (the baseline's reference joined from slices of llama.cpp's logits). Then a
    sequential audit stops once its verdict is settled.

    Windows of 128 (stride 64): what is checked is counted in windows, not tokens, and each costs half a window of 256.
    512 tokens (7 windows) make pieces of 4 and 3 windows, each more than one batch. The sequential audit scores at
    least 8 windows (4 batches of 2) before it may stop, so it runs on 1,536 tokens (23 windows): stopped within 10 of
    them, it has scored less than half the stream."""
    from flows.cli import main

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
    assert main(["reference", "ls"]) == 0  # the joined reference says what scored it (read in this process)
    out, err = capsys.readouterr()
    assert f"{made['f32']} (scored in llama.cpp {llama_cpp.version()})" in out + err, out + err
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
