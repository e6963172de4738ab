"""What the llama.cpp tests share: llama-perplexity's own figures (built from the same source as the binding), the
texts both tools read, the GGUF files llama.cpp's quantizer makes from the embedded model's, a cache of a test's own,
and an audit in llama-perplexity's convention (tests/test_llama_cpp.py, tests/test_llama_cpp_audits.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from helpers import json_line

from tasks.config import CorpusConfig
from tasks.core.places import cache_dir
from tasks.data.corpus import corpus_text
from tasks.data.embedded import embedded_gguf, embedded_model_dir
from tasks.models import llama_cpp
from tasks.models.resolve import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
# llama-perplexity's convention (-c 512) on 4 chunks: on 2 the figures held to its own agree as closely, but the
# licence audit's Q8_0 in llama.cpp then scored below the same weights in transformers (17.586 against 17.610, at
# 5c7760d): the runtime's cost is a difference 2 chunks do not resolve
CHUNKS, CONTEXT = 4, 512
TYPES = {"f32": "F32", "q8": "Q8_0", "q4km": "Q4_K_M"}


def llama_perplexity(model: Path, text: Path, base: Path, kl: bool) -> dict:
    """llama-perplexity's own figures: PPL, and with ``kl`` its mean KLD and same-top fraction against ``base``. With
    ``--no-escape``: by default llama.cpp's tools rewrite the backslash escapes of a -f text (``\\n`` in Python source
    becomes a newline) before they tokenize it, and would score another text than the file's."""
    args = [str(llama_cpp.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(CONTEXT), "--chunks",
            str(CHUNKS), "--kl-divergence-base", str(base), "-t", "2", "--no-escape"] + (["--kl-divergence"] if kl else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    if not kl:
        return {"ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", said).group(1))}
    return {"ppl": float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", said).group(1)),
            "kld": float(re.search(r"Mean\s+KLD:\s*([-\d.]+)", said).group(1)),
            "same_top": float(re.search(r"Same top p:\s*([\d.]+)", said).group(1)) / 100}


def peer_texts(folder: Path) -> dict[str, Path]:
    """Prose (Austen), indented code (the Python standard library) and a licence laid out with runs of spaces (the
    GPL-3 text every Debian system has: where the issue saw the tokenizers part), 60,000 characters each, as files
    both tools read."""
    found = {}
    for name, source in (("austen", "embedded"), ("python", "embedded:python")):
        found[name] = folder / f"{name}.txt"
        found[name].write_text(corpus_text(CorpusConfig(source=source))[:60_000], encoding="utf-8")
    found["licence"] = folder / "licence.txt"
    found["licence"].write_text(Path("/usr/share/common-licenses/GPL-3").read_text(encoding="utf-8")[:60_000])
    return found


def ladder() -> dict[str, Path]:
    """The GGUF files llama.cpp's quantizer makes from the embedded model's (what `type:` variants score), cached."""
    assert llama_cpp.version(), "the llama.cpp runtime is not installed: run bash .ci/llama-cpp"
    return {name: llama_cpp.made_file(embedded_gguf(), kind) for name, kind in TYPES.items()}


def own_cache(folder: Path, monkeypatch) -> Path:
    """``$PPL_AUDIT_CACHE`` at ``folder`` for one test, so that the GGUF files it finds there are the ones its audit
    made. The embedded model's transformers folder is linked in from the session's cache (made there once): each test
    would otherwise dequantize the packaged file into the same bytes again (~15 s)."""
    made_once = Path(resolve_model_path("embedded"))  # before the cache moves: the session's
    linked = folder / embedded_model_dir().relative_to(cache_dir())
    linked.parent.mkdir(parents=True)
    linked.symlink_to(made_once, target_is_directory=True)
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(folder))
    return folder


def audit(cli, tmp_path: Path, text: Path, variants: list[dict], baseline: dict | None = None) -> dict:
    """``run --json --stats full`` in llama-perplexity's convention (``-c CONTEXT --chunks CHUNKS``), tracked in its own
    MLflow store (``tmp_path / 'mlflow.db'``, experiment ``served``); its JSON line, and ``out``: all it printed."""
    config = {"name": "served", "baseline": baseline or {"path": "embedded"}, "corpus": {"source": str(text)},
              "evaluation": {"window": CONTEXT, "mode": "llama.cpp", "chunks": CHUNKS, "batch_size": 2,
                             "divergence": True},
              "variants": variants, "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "served"}}
    path = tmp_path / "served.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, out, err = cli("run", str(path), "--json", "--stats", "full")
    assert code in (0, 1), err[-3000:]
    return json_line(out, err) | {"out": out + err}
