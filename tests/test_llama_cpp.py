"""``runtime: llama.cpp``: GGUF files scored by llama.cpp's own kernels and tokenizer, held to llama-perplexity built
from the same llama.cpp source and CMake build as the binding (``.ci/llama-cpp``)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import json_line

from tasks.config import CorpusConfig
from tasks.data.corpus import corpus_text
from tasks.data.embedded import embedded_gguf
from tasks.models import llama_cpp

pytestmark = pytest.mark.slow  # the embedded model, in both runtimes

ROOT = Path(__file__).resolve().parents[1]
CHUNKS, CONTEXT = 4, 512
TYPES = {"f32": "F32", "q8": "Q8_0", "q4km": "Q4_K_M"}


def tool(name: str) -> Path:
    """A peer tool built beside the binding: ``.ci/llama-cpp`` writes where (the test command runs it first)."""
    where = ROOT / ".venv" / "llama-cpp-tools"
    assert where.is_file() and llama_cpp.version(), "the llama.cpp runtime is not installed: run bash .ci/llama-cpp"
    return Path(where.read_text().strip()) / name


def llama_perplexity(model: Path, text: Path, base: Path, kl: bool) -> dict:
    """llama-perplexity's own figures: PPL, and with ``kl`` its mean KLD and same-top fraction against ``base``. With
    ``--no-escape``: by default llama.cpp's tools rewrite the backslash escapes of a -f text (``\\n`` in Python source
    becomes a newline) before they tokenize it, and would score another text than the file's."""
    args = [str(tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(CONTEXT), "--chunks",
            str(CHUNKS), "--kl-divergence-base", str(base), "-t", "2", "--no-escape"] + (["--kl-divergence"] if kl else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    if not kl:
        return {"ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", said).group(1))}
    return {"ppl": float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", said).group(1)),
            "kld": float(re.search(r"Mean\s+KLD:\s*([-\d.]+)", said).group(1)),
            "same_top": float(re.search(r"Same top p:\s*([\d.]+)", said).group(1)) / 100}


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    """Prose (Austen), indented code (the Python standard library) and a licence laid out with runs of spaces (the
    GPL-3 text every Debian system has: where the issue saw the tokenizers part), 60,000 characters each, as files
    both tools read."""
    folder = tmp_path_factory.mktemp("texts")
    found = {}
    for name, source in (("austen", "embedded"), ("python", "embedded:python")):
        found[name] = folder / f"{name}.txt"
        found[name].write_text(corpus_text(CorpusConfig(source=source))[:60_000], encoding="utf-8")
    found["licence"] = folder / "licence.txt"
    found["licence"].write_text(Path("/usr/share/common-licenses/GPL-3").read_text(encoding="utf-8")[:60_000])
    return found


@pytest.fixture(scope="module")
def made(texts) -> dict[str, Path]:
    """The GGUF files llama.cpp's quantizer makes from the embedded model's (what `type:` variants score)."""
    return {name: llama_cpp.made_file(embedded_gguf(), kind) for name, kind in TYPES.items()}


def audit(cli, tmp_path: Path, text: Path, variants: list[dict], baseline: dict | None = None) -> dict:
    config = {"name": "served", "baseline": baseline or {"path": "embedded"}, "corpus": {"source": str(text)},
              "evaluation": {"window": CONTEXT, "mode": "llama.cpp", "chunks": CHUNKS, "batch_size": 2,
                             "divergence": True},
              "variants": variants, "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "served"}}
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, out, err = cli("run", str(path), "--json", "--stats", "full")
    assert code in (0, 1), err[-3000:]
    return json_line(out, err) | {"out": out + err}


@pytest.mark.parametrize("text_name, baseline_runtime", [("austen", "llama.cpp"), ("licence", "transformers")])
def test_the_llama_cpp_runtime_gives_llama_perplexity_s_figures(cli, tmp_path, texts, made, text_name,
                                                                baseline_runtime):
    """PPL to 1e-4 and, against llama-perplexity's KL base made from the same model, mean KLD and same-top to 1e-3: on
    prose with the F32 file as the baseline in llama.cpp (its reference llama.cpp's logits, as llama-perplexity's base
    file), and on a licence laid out with runs of spaces, where transformers' tokenizer of the file parts from
    llama.cpp's, against the embedded baseline in transformers (the same weights)."""
    text = texts[text_name]
    base = tmp_path / "base.kld"
    peers = {"f32": llama_perplexity(made["f32"], text, base, kl=False)}
    peers |= {name: llama_perplexity(made[name], text, base, kl=True) for name in ("q8", "q4km")}
    baseline = ({"name": "f32", "path": str(made["f32"]), "runtime": "llama.cpp"} if baseline_runtime == "llama.cpp"
                else {"path": "embedded"})
    variants = [{"name": name, "method": "gguf", "type": TYPES[name], "runtime": "llama.cpp"}
                for name in TYPES if name != baseline.get("name")]
    said = audit(cli, tmp_path, text, variants + [{"name": "q8-weights", "method": "gguf", "type": "Q8_0"}], baseline)
    rows = {row["variant"]: row for row in said["models"]}
    for name, peer in peers.items():
        assert rows[name]["method"] == f"gguf {TYPES[name]} @llama.cpp"
        assert rows[name]["ppl"] == pytest.approx(peer["ppl"], rel=1e-4), name
        if "kld" in peer:
            # the audit's KLD as llama-perplexity estimates it (16-bit base log-probs, those not above -16 left out),
            # and beside it the audit's exact KL, which that estimator misses by 0.1-0.4% (measured)
            assert rows[name]["kld_llama_mean"] == pytest.approx(peer["kld"], rel=1e-3), name
            # against llama.cpp's own F32 logits the same top token is llama-perplexity's; against transformers' of
            # the same weights a near tie may fall the other way (a token or two in 1,020)
            assert rows[name]["top1_agreement"] == pytest.approx(
                peer["same_top"], **{"rel": 1e-3} if baseline_runtime == "llama.cpp" else {"abs": 3 / (CHUNKS * 255)}), name
            assert rows[name]["kld_mean"] == pytest.approx(peer["kld"], rel=5e-3), name
            assert rows[name]["kld_mean"] != pytest.approx(rows[name]["kld_llama_mean"], rel=2e-4), name
    assert "Mean    KLD as llama-perplexity estimates it:" in said["out"]
    # the same Q8_0 file dequantized in transformers: the weights' loss alone, and the runtime's cost beside it
    assert rows["q8-weights"]["method"] == "gguf Q8_0"
    assert rows["q8-weights"]["ppl"] < rows["q8"]["ppl"]
    assert re.search(r"runtime cost: q8 \(llama.cpp\) against q8-weights .*ΔPPL [+-][\d.]+% \[[+-][\d.]+, [+-][\d.]+\]",
                     said["out"])
    # MLflow says what made the stream and what scored each model
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("served").experiment_id], "tags.`ppl_audit.kind` = 'variant'")
    params = {run.data.params["variant"]: run.data.params for run in runs}
    assert {p["corpus.tokenizer"] for p in params.values()} == {f"llama.cpp {llama_cpp.version()} ({made['f32'].name})"}
    assert params["q8"]["runtime"] == "llama.cpp" and params["q8-weights"]["runtime"] == "transformers"
    if text_name == "licence":  # runs of whitespace: the two tokenizers part, and the audit says where
        assert re.search(r"tokens: llama.cpp's tokenizer of the served file gives [\d,]+ tokens where transformers' "
                         r"gives [\d,]+, first different at token [\d,]+", said["out"])


@pytest.mark.parametrize("text_name", ["licence", "python"])
def test_ppl_in_llama_cpp_mode_on_a_gguf_file_gives_llama_perplexity_s_number(cli, tmp_path, texts, made, text_name):
    """Before, transformers' tokenizer of the file made the stream: 1.6% from llama-perplexity's on the licence."""
    text = texts[text_name]
    peer = llama_perplexity(made["f32"], text, tmp_path / "base.kld", kl=False)
    for runtime in ("transformers", "llama.cpp"):
        code, out, err = cli("ppl", "--model", str(made["f32"]), "--corpus", str(text), "--mode", "llama.cpp",
                             "--window", str(CONTEXT), "--chunks", str(CHUNKS), "--runtime", runtime, "--json")
        assert code == 0, err[-2000:]
        assert json_line(out, err)["ppl"] == pytest.approx(peer["ppl"], rel=1e-4), runtime


def test_llama_cpp_s_tokenizer_gives_llama_tokenize_s_ids(texts, made):
    text = texts["python"]
    done = subprocess.run([str(tool("llama-tokenize")), "-m", str(made["f32"]), "-f", str(text), "--ids",
                           "--log-disable", "--no-bos", "--no-escape"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    tokenizer = llama_cpp.Tokenizer(made["f32"], "digest")
    ids, offsets = tokenizer.encode_with_offsets(text.read_text(encoding="utf-8"), add_special=False)
    assert ids == theirs
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text.read_text(encoding="utf-8"))


def test_a_crash_inside_llama_cpp_fails_that_variant_alone(cli, tmp_path, texts, made):
    """A native crash kills the worker process, not the audit: the variant fails with one line, the others score."""
    import psutil

    config = {"name": "crash", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "evaluation": {"window": 256, "max_tokens": 8192, "batch_size": 4},
              "variants": [{"name": "served", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"},
                           {"name": "weights", "method": "gguf", "type": "Q8_0"}]}
    path = tmp_path / "crash.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    audit_run = subprocess.Popen([str(ROOT / ".venv/bin/python"), "-m", "flows.cli", "run", str(path), "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    killed = None
    while audit_run.poll() is None and killed is None:
        for child in psutil.Process(audit_run.pid).children(recursive=True):
            try:
                if any("llama_cpp_worker" in part for part in child.cmdline()) and child.cpu_times().user > 1.0:
                    child.send_signal(signal.SIGSEGV)
                    killed = child.pid
            except psutil.NoSuchProcess:
                pass
    out, err = audit_run.communicate(timeout=600)
    assert killed is not None, err[-2000:]
    rows = {row["variant"]: row for row in json_line(out, err)["models"]}
    assert rows["served"]["verdict"] == "error"
    assert "llama.cpp was killed by SIGSEGV during score of variant 'served'" in rows["served"]["verdict_reason"]
    assert rows["weights"]["ppl"] > 1


def test_bad_llama_cpp_settings_are_one_line_before_anything_loads(cli, tmp_path, texts):
    def refused(variant: dict, *command: str) -> str:
        config = {"name": "bad", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
                  "variants": [variant]}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        code, out, err = cli(*(command or ("run",)), str(path), *(("--variant", "v") if command else ()), timeout=120)
        assert code == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        return lines[0]

    assert "runtime llama.cpp runs a GGUF file" in refused({"name": "v", "method": "gptq", "runtime": "llama.cpp"})
    assert "diagnose swaps a variant's layers in transformers" in refused(
        {"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp", "diagnose": True})
    assert "variant 'v' runs in llama.cpp, whose layers a diagnosis cannot reach" in refused(
        {"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"}, "diagnose")
    assert "imatrix quantizes a GGUF file llama.cpp's quantizer makes" in refused(
        {"name": "v", "method": "gptq", "bits": 4, "imatrix": True})
    assert "type Q9_Z is not a type llama.cpp's quantizer makes" in refused(
        {"name": "v", "method": "gguf", "type": "Q9_Z", "runtime": "llama.cpp"})
    assert "type_k q3_x is not a llama.cpp cache type" in refused(
        {"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp", "llama_cpp": {"type_k": "q3_x"}})
    assert "runtime llama.cpp runs a GGUF file, and this baseline is embedded: use method gguf with a .gguf path" \
        in refused_baseline(tmp_path, texts)
    assert "type_v q4_0 needs flash attention" in refused(
        {"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp",
         "llama_cpp": {"type_v": "q4_0", "flash_attn": "off"}})


def refused_baseline(tmp_path: Path, texts) -> str:
    """The one line ``run`` refuses a baseline in llama.cpp with where it is not a GGUF file (the embedded model is the
    transformers folder; ``method: gguf`` names its packaged GGUF file)."""
    from tasks.config import load_audit_config
    from tasks.core.errors import InputError

    config = {"name": "bad", "baseline": {"path": "embedded", "runtime": "llama.cpp"},
              "corpus": {"source": str(texts["austen"])}, "variants": []}
    path = tmp_path / "baseline.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(InputError) as refused:
        load_audit_config(str(path), [])
    return str(refused.value)


def test_a_runtime_not_installed_is_one_line(tmp_path, texts):
    """As on a machine where `.ci/llama-cpp` never ran: the package cannot be imported."""
    config = {"name": "bad", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "variants": [{"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"}]}
    path = tmp_path / "absent.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    hide = ("import sys, importlib.abc\n"
            "class Absent(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'llama_cpp': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Absent())\n"
            "from flows.cli import main\n"
            f"sys.exit(main(['run', {str(path)!r}]))\n")
    done = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", hide], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the llama.cpp runtime is not installed; run `bash .ci/llama-cpp`" in lines[0], done.stderr


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
        time.sleep(1)
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
    at Q3_K_M)."""
    from tasks.models.gguf import gguf_facts

    samples = 8
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))  # the files it makes, and only those
    config = {"name": "imatrix", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "evaluation": {"window": 256, "max_tokens": 2048, "batch_size": 4},
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
    sequential audit against that reference stops once its verdict is settled."""
    def run(name: str, **sections) -> dict:
        config = {"name": name, "baseline": {"name": "f32", "path": str(made["f32"]), "runtime": "llama.cpp",
                                             "rescore": "always"},
                  "corpus": {"source": str(texts["austen"])},
                  "evaluation": {"window": 256, "max_tokens": 2048, "batch_size": 2},
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
                  evaluation={"window": 256, "max_tokens": 8192, "batch_size": 2, "sequential": True},
                  thresholds={"max_ppl_increase_pct": 5})
    row = stopped["models"][1]
    assert row["verdict"] == "pass" and row["scored_fraction"] < 0.5, row["verdict_reason"]


def test_type_variants_of_a_transformers_baseline_are_made_from_its_conversion(cli, tmp_path, texts, made, monkeypatch):
    """A baseline that is a transformers folder (the embedded model's, by its path): llama.cpp's convert_hf_to_gguf.py
    from the binding's source makes its GGUF file (float32 weights kept as F32), and the Q8_0 made from that scores
    as llama-perplexity scores the Q8_0 made from the packaged file those weights were dequantized from."""
    from tasks.models.resolve import resolve_model_path

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))  # converted here, not found from another test
    text = texts["austen"]
    peer = llama_perplexity(made["q8"], text, tmp_path / "base.kld", kl=False)
    said = audit(cli, tmp_path, text, [{"name": "q8", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp"}],
                 {"path": resolve_model_path("embedded")})
    row = {row["variant"]: row for row in said["models"]}["q8"]
    assert row["method"] == "gguf Q8_0 @llama.cpp", row.get("verdict_reason")
    assert row["ppl"] == pytest.approx(peer["ppl"], rel=1e-4)
    converted = sorted(path.name for path in (tmp_path / "cache" / "gguf").glob("*.gguf"))
    assert len(converted) == 2 and any(".F32." in name for name in converted), converted
