"""``runtime: llama.cpp``: GGUF files scored by llama.cpp's own kernels and tokenizer, held to llama-perplexity built
from the same llama.cpp source and CMake build as the binding (``.ci/llama-cpp``)."""

from __future__ import annotations

import io
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from helpers import command_here, json_line, one_line_error

from llama_cpp_peers import CHUNKS, CONTEXT, ROOT, TYPES, audit, ladder, llama_perplexity, peer_texts

from tasks.models import llama_cpp

pytestmark = pytest.mark.slow  # the embedded model, in both runtimes


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, Path]:
    return peer_texts(tmp_path_factory.mktemp("texts"))


@pytest.fixture(scope="module")
def made() -> dict[str, Path]:
    return ladder()


@pytest.fixture(scope="module")
def peers(tmp_path_factory, texts, made) -> Callable[[str, str], dict]:
    """llama-perplexity's figures of a file of the ladder on a text, each run once for the module (the audit's peer
    check and `ppl`'s read the same runs): the F32 file's first, which writes the KL base the others are held to."""
    folder = tmp_path_factory.mktemp("peers")
    found: dict[tuple[str, str], dict] = {}

    def figures(text_name: str, name: str) -> dict:
        base = folder / f"{text_name}.kld"
        if (text_name, "f32") not in found:
            found[text_name, "f32"] = llama_perplexity(made["f32"], texts[text_name], base, kl=False)
        if (text_name, name) not in found:
            found[text_name, name] = llama_perplexity(made[name], texts[text_name], base, kl=True)
        return found[text_name, name]

    return figures


# the baseline each text's audit runs in: prose against the F32 file in llama.cpp, the licence against the embedded
# model in transformers
BASELINE_RUNTIMES = {"austen": "llama.cpp", "licence": "transformers"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, cli, texts, made) -> Callable[[str], tuple[dict, Path]]:
    """Each text's audit of the ladder in llama.cpp and the Q8_0 file dequantized in transformers, run once for the
    module (its JSON line and all it printed, and its folder, whose ``mlflow.db`` holds its record). The licence's,
    against the embedded baseline in transformers, also serves the packaged GGUF file in llama.cpp with the default
    ``flash_attn: auto`` (``packaged``): the settings it ran with are checked on that audit rather than on one more."""
    from tasks.data.embedded import embedded_gguf

    done: dict[str, tuple[dict, Path]] = {}

    def audited(text_name: str) -> tuple[dict, Path]:
        if text_name not in done:
            in_llama_cpp = BASELINE_RUNTIMES[text_name] == "llama.cpp"
            baseline = ({"name": "f32", "path": str(made["f32"]), "runtime": "llama.cpp"} if in_llama_cpp
                        else {"path": "embedded"})
            variants = [{"name": name, "method": "gguf", "type": TYPES[name], "runtime": "llama.cpp"}
                        for name in TYPES if not (in_llama_cpp and name == "f32")]
            variants.append({"name": "q8-weights", "method": "gguf", "type": "Q8_0"})
            if not in_llama_cpp:
                variants.append({"name": "packaged", "method": "gguf", "path": str(embedded_gguf()),
                                 "runtime": "llama.cpp"})
            folder = tmp_path_factory.mktemp(f"served-{text_name}")
            done[text_name] = audit(cli, folder, texts[text_name], variants, baseline), folder
        return done[text_name]

    return audited


@pytest.mark.parametrize("text_name, baseline_runtime", BASELINE_RUNTIMES.items())
def test_the_llama_cpp_runtime_gives_llama_perplexity_s_figures(served, peers, made, text_name, baseline_runtime):
    """PPL to 1e-4 and, against llama-perplexity's KL base made from the same model, mean KLD and same-top to 1e-3: on
    prose with the F32 file as the baseline in llama.cpp (its reference llama.cpp's logits, as llama-perplexity's base
    file), and on a licence laid out with runs of spaces, where transformers' tokenizer of the file parts from
    llama.cpp's, against the embedded baseline in transformers (the same weights)."""
    said, folder = served(text_name)
    figures = {name: peers(text_name, name) for name in TYPES}
    rows = {row["variant"]: row for row in said["models"]}
    for name, peer in figures.items():
        assert rows[name]["method"] == f"gguf {TYPES[name]} @llama.cpp"
        assert rows[name]["ppl"] == pytest.approx(peer["ppl"], rel=1e-4), name
        if "kld" in peer:
            # the audit's KLD as llama-perplexity estimates it (16-bit base log-probs, those not above -16 left out),
            # and beside it the audit's exact KL, which that estimator misses by 0.1-0.4% (measured)
            assert rows[name]["kld_llama_mean"] == pytest.approx(peer["kld"], rel=1e-3), name
            # against llama.cpp's own F32 logits the same top token is llama-perplexity's; against transformers' of
            # the same weights a near tie may fall the other way (a token or two in 1,020, measured on 4 chunks)
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

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("served").experiment_id], "tags.`ppl_audit.kind` = 'variant'")
    params = {run.data.params["variant"]: run.data.params for run in runs}
    assert {p["corpus.tokenizer"] for p in params.values()} == {f"llama.cpp {llama_cpp.version()} ({made['f32'].name})"}
    assert params["q8"]["runtime"] == "llama.cpp" and params["q8-weights"]["runtime"] == "transformers"
    if text_name == "licence":  # runs of whitespace: the two tokenizers part, and the audit says where
        assert re.search(r"tokens: llama.cpp's tokenizer of the served file gives [\d,]+ tokens where transformers' "
                         r"gives [\d,]+, first different at token [\d,]+", said["out"])


@pytest.mark.parametrize("text_name", ["licence", "python"])
def test_ppl_in_llama_cpp_mode_on_a_gguf_file_gives_llama_perplexity_s_number(cli, tmp_path, texts, made, peers,
                                                                              text_name, capsys):
    """Before, transformers' tokenizer of the file made the stream: 1.6% from llama-perplexity's on the licence.
    ``ppl`` runs in this process (llama.cpp's workers are processes of their own either way): a command's start
    is not what is checked."""
    text = texts[text_name]
    peer = peers(text_name, "f32")
    for runtime in ("transformers", "llama.cpp"):
        code, out, err = command_here(capsys, "ppl", "--model", str(made["f32"]), "--corpus", str(text), "--mode",
                                      "llama.cpp", "--window", str(CONTEXT), "--chunks", str(CHUNKS), "--runtime",
                                      runtime, "--json")
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


def test_bad_llama_cpp_settings_are_one_line_before_anything_loads(tmp_path, texts, capsys):
    """Each refused in this process (``one_line_error``: exit 2, one line on stderr): a command's process start
    (~5 s each, seven of them) is not what is checked."""
    def refused(variant: dict, *command: str) -> str:
        config = {"name": "bad", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
                  "variants": [variant]}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return one_line_error(capsys, *(command or ("run",)), str(path), *(("--variant", "v") if command else ()))

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


def test_an_audit_says_the_flash_attention_llama_cpp_chose_in_its_row_table_and_mlflow(served):
    """The packaged GGUF file run by llama.cpp with ``flash_attn: auto``, beside the embedded baseline in transformers
    (the licence's peer audit): its row, the console's table and its MLflow run say the mode that ran (on or off), not
    ``auto``, with what was asked beside it."""
    from mlflow import MlflowClient

    said, folder = served("licence")
    row = next(row for row in said["models"] if row["variant"] == "packaged")
    ran = re.search(r"flash attention (on|off) \(asked: auto\)", row["llama_cpp"])
    assert ran, row.get("llama_cpp")
    assert f"llama.cpp: {row['llama_cpp']}" in said["out"]
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("served").experiment_id],
                               "tags.`ppl_audit.variant` = 'packaged'")
    params = run.data.params
    assert (params["llama_cpp.flash_attn"], params["llama_cpp.flash_attn_asked"]) == (ran.group(1), "auto")
    assert int(params["llama_cpp.n_ctx"]) >= CONTEXT


def test_the_worker_protocol_reads_back_every_message_as_written_in_the_bytes_it_always_had():
    """Each request and reply ``send`` writes is read back equal by the other side (``request_of``, ``reply_of``: one
    dataclass, written and read by its fields' names), with its payload; its header is the JSON the worker and its
    parent have always exchanged (the op or ok first, then the fields in order, a nested one as an object)."""
    from tasks.models import llama_cpp_said as said

    loaded = said.Loaded("llama 256M Q4_1", 123456, said.Ran("on", 512, 256, 256, 4, 4, 0))
    requests = [said.Open("/m.gguf", False, 512, 256, 3, "q8_0", "f16", "on", 99), said.Open("/v.gguf", vocab_only=True),
                said.Tokenize(True), said.Detokenize(), said.Score(((10, 1, 9), (5, 0, 5)), 256), said.Close()]
    replies = [said.Opened(32000, True, 1, "AVX=1", loaded), said.Opened(32000, False, 2, "AVX=1"), said.Tokenized(7),
               said.Done(), said.Failed("ValueError: no")]
    frames = {}
    for message in requests + replies:
        stream = io.BytesIO()
        said.send(stream, message, b"\x01\x02")
        frames[message] = stream.getvalue()
        stream.seek(0)
        header, payload = said.receive(stream)
        answer = said.Done if isinstance(message, said.Failed) else type(message)
        back = said.request_of(header) if message in requests else said.reply_of(header, answer)
        assert (back, payload) == (message, b"\x01\x02")
    assert frames[requests[0]] == (
        b'\xab\x00\x00\x00\x02\x00\x00\x00\x00\x00\x00\x00{"op": "open", "path": "/m.gguf", "vocab_only": false, '
        b'"n_ctx": 512, "n_batch": 256, "threads": 3, "type_k": "q8_0", "type_v": "f16", "flash_attn": "on", '
        b'"gpu_layers": 99}\x01\x02')
    assert frames[requests[4]].endswith(b'{"op": "score", "rows": [[10, 1, 9], [5, 0, 5]], "n_batch": 256}\x01\x02')
    assert frames[replies[0]].endswith(
        b'{"ok": true, "n_vocab": 32000, "add_bos": true, "bos": 1, "system_info": "AVX=1", "loaded": {"desc": '
        b'"llama 256M Q4_1", "size": 123456, "ran": {"flash_attn": "on", "n_ctx": 512, "n_batch": 256, "n_ubatch": 256, '
        b'"threads": 4, "threads_batch": 4, "gpu_layers": 0}}}\x01\x02')
    assert [frames[message][12:] for message in replies[1:]] == [
        b'{"ok": true, "n_vocab": 32000, "add_bos": false, "bos": 2, "system_info": "AVX=1", "loaded": null}\x01\x02',
        b'{"ok": true, "count": 7}\x01\x02', b'{"ok": true}\x01\x02', b'{"ok": false, "error": "ValueError: no"}\x01\x02']
    with pytest.raises(ValueError, match="unknown request load"):
        said.request_of({"op": "load"})
