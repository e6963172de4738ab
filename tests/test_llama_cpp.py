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


def kld_against_base(model: Path, base: Path) -> dict:
    """llama-perplexity's mean KLD and same-top, computed as it computes them (tools/perplexity/perplexity.cpp,
    ``log_softmax`` with a base), from this runtime's logits of the chunks stored in its ``--kl-divergence-base``
    file: the base's tokens, and per scored token a scale, an offset and the base's log-probs in 16 bits."""
    import numpy as np
    import torch

    from tasks.config import LlamaCppSettings

    data = base.read_bytes()
    assert data[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = np.frombuffer(data[8:20], dtype=np.int32)
    tokens = torch.from_numpy(np.frombuffer(data[20 : 20 + 4 * n_ctx * n_chunk], dtype=np.int32).astype(np.int64))
    first, nv = n_ctx // 2, 2 * ((n_vocab + 1) // 2) + 4
    stored = np.frombuffer(data[20 + 4 * n_ctx * n_chunk :], dtype=np.uint16).reshape(n_chunk, n_ctx - 1 - first, nv)
    served = llama_cpp.open_model(model, "peer", LlamaCppSettings(), int(n_ctx))
    kld, same, count = 0.0, 0, 0
    try:
        for chunk in range(n_chunk):
            ids = tokens[chunk * n_ctx : (chunk + 1) * n_ctx][None]
            columns = torch.arange(first, n_ctx - 1)
            logits = served.scored_logits(ids, None, torch.zeros(len(columns), dtype=torch.long), columns)
            head = stored[chunk, :, :4].copy().view(np.float32)  # scale, offset
            log_base = torch.from_numpy(head[:, :1] * stored[chunk, :, 4 : 4 + n_vocab] + head[:, 1:2])
            log_q = logits - logits.max(1, keepdim=True).values
            log_q = log_q - torch.log(torch.exp(log_q).double().sum(1, keepdim=True)).float()
            kept = log_base > -16
            kld += float((torch.exp(log_base) * (log_base - log_q)).where(kept, 0).double().sum())
            same += int((logits.argmax(1) == log_base.argmax(1)).sum())
            count += len(columns)
    finally:
        served.close()
    return {"kld": kld / count, "same_top": same / count}


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


def audit(cli, tmp_path: Path, text: Path, variants: list[dict]) -> dict:
    config = {"name": "served", "baseline": {"path": "embedded"}, "corpus": {"source": str(text)},
              "evaluation": {"window": CONTEXT, "mode": "llama.cpp", "chunks": CHUNKS, "batch_size": 2,
                             "divergence": True},
              "variants": variants}
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, out, err = cli("run", str(path), "--json")
    assert code in (0, 1), err[-3000:]
    return json_line(out, err) | {"out": out}


@pytest.mark.parametrize("text_name", ["austen", "licence"])
def test_the_llama_cpp_runtime_gives_llama_perplexity_s_figures(cli, tmp_path, texts, made, text_name):
    """PPL to 1e-4 and, against llama-perplexity's KL base made from the same model, mean KLD and same-top to 1e-3:
    on prose and on indented code, where transformers' tokenizer of the file parts from llama.cpp's."""
    text = texts[text_name]
    base = tmp_path / "base.kld"
    peers = {"f32": llama_perplexity(made["f32"], text, base, kl=False)}
    peers |= {name: llama_perplexity(made[name], text, base, kl=True) for name in ("q8", "q4km")}
    said = audit(cli, tmp_path, text, [{"name": name, "method": "gguf", "type": kind, "runtime": "llama.cpp"}
                                       for name, kind in TYPES.items()]
                 + [{"name": "q8-weights", "method": "gguf", "type": "Q8_0"}])
    rows = {row["variant"]: row for row in said["models"]}
    for name, peer in peers.items():
        assert rows[name]["method"] == f"gguf {TYPES[name]} @llama.cpp"
        assert rows[name]["ppl"] == pytest.approx(peer["ppl"], rel=1e-4), name
        if "kld" in peer:
            # against its own base: the runtime's logits give llama-perplexity's KLD and same-top (its estimator)
            ours = kld_against_base(made[name], base)
            assert ours["kld"] == pytest.approx(peer["kld"], rel=1e-3), name
            assert ours["same_top"] == pytest.approx(peer["same_top"], rel=1e-3), name
            # the audit's exact KL, against the transformers baseline's reference: llama-perplexity's estimator
            # leaves out base log-probs 16 below the top and keeps the rest in 16 bits (measured: 0.1-0.2% apart)
            assert rows[name]["kld_mean"] == pytest.approx(peer["kld"], rel=5e-3), name
            assert rows[name]["top1_agreement"] == pytest.approx(peer["same_top"], abs=3 / (CHUNKS * 255)), name
    # the same Q8_0 file dequantized in transformers: the weights' loss alone, and the runtime's cost beside it
    assert rows["q8-weights"]["method"] == "gguf Q8_0"
    assert rows["q8-weights"]["ppl"] < rows["q8"]["ppl"]
    assert re.search(r"runtime cost: q8 \(llama.cpp\) against q8-weights .*ΔPPL [+-][\d.]+% \[[+-][\d.]+, [+-][\d.]+\]",
                     said["out"])
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
    def refused(variant: dict) -> str:
        config = {"name": "bad", "baseline": {"path": "embedded"}, "corpus": {"source": str(texts["austen"])},
                  "variants": [variant]}
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        code, out, err = cli("run", str(path), timeout=120)
        assert code == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        return lines[0]

    assert "runtime llama.cpp runs a GGUF file" in refused({"name": "v", "method": "gptq", "runtime": "llama.cpp"})
    assert "type Q9_Z is not a type llama.cpp's quantizer makes" in refused(
        {"name": "v", "method": "gguf", "type": "Q9_Z", "runtime": "llama.cpp"})
    assert "type_k q3_x is not a llama.cpp cache type" in refused(
        {"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp", "llama_cpp": {"type_k": "q3_x"}})
    assert "the baseline runs in transformers" in refused_baseline(tmp_path, texts)
    assert "type_v q4_0 needs flash attention" in refused(
        {"name": "v", "method": "gguf", "type": "Q8_0", "runtime": "llama.cpp",
         "llama_cpp": {"type_v": "q4_0", "flash_attn": "off"}})


def refused_baseline(tmp_path: Path, texts) -> str:
    """The one line ``run`` refuses a baseline in llama.cpp with (not yet: its reference keeps hidden states)."""
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_ppl_stopped_while_llama_cpp_evaluates_ends_at_once_with_its_worker(tmp_path, prefect_database, made, signum):
    """The worker is the command's child: it must be gone as soon as the command is, however it stops."""
    import time

    from test_processes import STOP_S, Command, alive, the_line

    from tasks.data.corpus import corpus_text as text_of

    corpus = tmp_path / "long.txt"
    corpus.write_text(text_of(CorpusConfig(source="embedded"))[:1_500_000], encoding="utf-8")
    ppl = Command(tmp_path, "ppl", "--model", str(made["q8"]), "--corpus", str(corpus), "--window", "256",
                  "--runtime", "llama.cpp", database=prefect_database)
    try:
        def evaluating() -> bool:
            return any("llama_cpp_worker" in " ".join(p.cmdline()) and p.cpu_times().user > 2
                       for p in alive(ppl.process.children(recursive=True)))

        deadline = time.monotonic() + 300
        while not evaluating():
            assert time.monotonic() < deadline and ppl.process.poll() is None, ppl.log.read_text()[-2000:]
            time.sleep(0.5)
        ppl.signal(signum)
        assert ppl.ended_within(STOP_S) == 128 + signum
        the_line(ppl, signum)
        time.sleep(1)
        assert not alive(ppl.recorded), [" ".join(p.cmdline())[:100] for p in alive(ppl.recorded)]
    finally:
        ppl.stop()
