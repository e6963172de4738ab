"""``runtime: llama.cpp``: GGUF files scored by llama.cpp's own kernels and tokenizer, held to llama-perplexity built
from the same llama.cpp source and CMake build as the binding (``.ci/llama-cpp``)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import json_line

from llama_cpp_peers import CHUNKS, CONTEXT, ROOT, TYPES, audit, ladder, llama_perplexity, peer_texts

from tasks.models import llama_cpp

pytestmark = pytest.mark.slow  # the embedded model, in both runtimes


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    return peer_texts(tmp_path_factory.mktemp("texts"))


@pytest.fixture(scope="module")
def made() -> dict[str, Path]:
    return ladder()


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
    if text_name == "licence":  # an audit in mode llama.cpp of the GGUF file in transformers: llama.cpp's stream too
        said = audit(cli, tmp_path, text, [{"name": "q8-weights", "method": "gguf", "type": "Q8_0"}],
                     {"path": str(made["f32"])})
        assert said["models"][0]["ppl"] == pytest.approx(peer["ppl"], rel=1e-4)
        assert re.search(r"tokens: llama.cpp's tokenizer of the served file gives [\d,]+ tokens where transformers' ",
                         said["out"])


def test_llama_cpp_s_tokenizer_gives_llama_tokenize_s_ids(texts, made):
    text = texts["python"]
    done = subprocess.run([str(llama_cpp.tool("llama-tokenize")), "-m", str(made["f32"]), "-f", str(text), "--ids",
                           "--log-disable", "--no-bos", "--no-escape"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    tokenizer = llama_cpp.Tokenizer(made["f32"], "digest")
    ids, offsets = tokenizer.encode_with_offsets(text.read_text(encoding="utf-8"), add_special=False)
    assert ids == theirs
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text.read_text(encoding="utf-8"))


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


@pytest.mark.parametrize("asked", ["auto", "off"])
def test_a_llama_cpp_model_says_the_settings_it_ran_with(asked):
    """``flash_attn: auto`` lets llama.cpp choose (on this CPU it moves Q4_K_M's PPL by 1.1% against off): the record
    keeps the mode that ran, on or off, and what was asked beside it where that differs; and the context's sizes and
    threads as llama.cpp took them (the batch is cut to the context)."""
    from tasks.config import LlamaCppSettings
    from tasks.data.embedded import embedded_gguf
    from tasks.record.verdict import llama_cpp_text

    settings = LlamaCppSettings(threads=1, flash_attn=asked)
    model = llama_cpp.open_model(Path(embedded_gguf()), "v", settings, 65)
    try:
        ran = llama_cpp.described(settings, model.facts)
    finally:
        model.close()
    assert ran["flash_attn"] in ("on", "off")
    assert ran.get("flash_attn_asked") == ("auto" if asked == "auto" else None)
    if asked == "off":
        assert ran["flash_attn"] == "off"
    assert ran["threads"] == 1 and ran["n_ctx"] >= 65 and ran["n_batch"] == ran["n_ubatch"] == 65
    assert ran["batch_asked"] == 512 and (ran["type_k"], ran["type_v"]) == ("f16", "f16")
    said = llama_cpp_text(ran)
    assert f"flash attention {ran['flash_attn']}" in said and ("(asked: auto)" in said) == (asked == "auto")


def test_gpu_layers_on_a_build_without_a_gpu_are_said_and_recorded(tmp_path, texts, capsys):
    """A build that cannot offload (``llama_supports_gpu_offload``) ignored ``gpu_layers`` without a word: a warning
    line when the plan is made, and the record's settings say the layers that ran on a GPU (none) and those asked."""
    from tasks.audit.preflight import check_audit_settings
    from tasks.config import LlamaCppSettings, load_audit_config
    from tasks.data.embedded import embedded_gguf

    config = {"name": "gpu", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
              "variants": [{"name": "v", "method": "gguf", "path": str(embedded_gguf()), "runtime": "llama.cpp",
                            "llama_cpp": {"gpu_layers": 4}}]}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    check_audit_settings(load_audit_config(str(path), []))
    warned = [line for line in capsys.readouterr().err.splitlines() if "gpu_layers" in line]
    offload = llama_cpp.gpu_offload()
    assert warned == ([] if offload else [
        "ppl-audit: warning: variant 'v': llama_cpp.gpu_layers 4 is ignored: this llama.cpp build cannot offload to a "
        "GPU (llama_supports_gpu_offload() is false); it runs on the CPU"])
    settings = LlamaCppSettings(gpu_layers=4)
    model = llama_cpp.open_model(Path(embedded_gguf()), "v", settings, 65)
    try:
        ran = llama_cpp.described(settings, model.facts)
    finally:
        model.close()
    assert (ran["gpu_layers"], ran.get("gpu_layers_asked")) == ((4, None) if offload else (0, 4))


def test_an_audit_says_the_flash_attention_llama_cpp_chose_in_its_row_table_and_mlflow(cli, tmp_path, texts):
    """The packaged GGUF file run by llama.cpp with ``flash_attn: auto``: its row, the console's table and its MLflow
    run say the mode that ran (on or off), not ``auto``, with what was asked beside it."""
    from mlflow import MlflowClient

    from tasks.data.embedded import embedded_gguf

    said = audit(cli, tmp_path, texts["austen"], [{"name": "v", "method": "gguf", "path": str(embedded_gguf()),
                                                    "runtime": "llama.cpp"}])
    row = next(row for row in said["models"] if row["variant"] == "v")
    ran = re.search(r"flash attention (on|off) \(asked: auto\)", row["llama_cpp"])
    assert ran, row.get("llama_cpp")
    assert f"llama.cpp: {row['llama_cpp']}" in said["out"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("served").experiment_id], "tags.`ppl_audit.variant` = 'v'")
    params = run.data.params
    assert (params["llama_cpp.flash_attn"], params["llama_cpp.flash_attn_asked"]) == (ran.group(1), "auto")
    assert int(params["llama_cpp.n_ctx"]) >= CONTEXT
