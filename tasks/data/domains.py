"""The embedded corpora beyond Austen: source code and text in non-Latin scripts, read out of Debian packages.

Each builder takes a ``.deb``'s bytes and returns the corpus as ``{file stem: text}``; the same package gives the
same bytes every time (files in sorted order, no dates, no randomness). ``tasks.data.embedded`` fetches the
packages, names the corpora (``EMBEDDED_CORPORA``) and publishes each into ``cache_dir()/corpora/NAME``.

- ``python``: a sorted subset of the standard library's own ``.py`` source (``libpython3.11-stdlib``, PSF licence),
  each file exactly as shipped: indentation and every run of whitespace kept.
- ``russian``: aphorisms in Russian from ``fortunes-ru`` (GPL-2; UTF-8 strfile files), one paragraph per entry.
- ``chinese``: classical poems, sayings and modern prose in Chinese from ``fortunes-zh`` (GPL-3+; UTF-8 strfile
  files coloured with ANSI escapes, which are removed), entries whose letters are mostly CJK.
"""

from __future__ import annotations

import io
import re
import tarfile
import unicodedata
from collections import Counter

PYTHON_PACKAGE = "libpython3.11-stdlib"
PYTHON_ROOT = "./usr/lib/python3.11/"
# a file of ordinary size (no 700 KB table of pydoc topics, no one-line stub), taken in sorted order up to the budget
PYTHON_FILE_BYTES = (1_000, 40_000)
PYTHON_BUDGET = 500_000
PYTHON_PER_PACKAGE = 4  # files from one package at most (asyncio alone would fill half the budget)
# the standard library's test support and pydoc's generated data are not code people write; the sysconfig data
# differs between architectures
PYTHON_SKIP = ("test/", "pydoc_data/", "_sysconfigdata")

RUSSIAN_PACKAGE = "fortunes-ru"
RUSSIAN_ROOT = "./usr/share/games/fortunes/ru/"
RUSSIAN_FILES = ("knowledge", "life", "time", "truth", "work")  # aphorisms by theme, 420 KB

CHINESE_PACKAGE = "fortunes-zh"
CHINESE_ROOT = "./usr/share/games/fortunes/"
CHINESE_FILES = ("tang300", "song100", "chinese")  # 300 Tang poems, 100 Song lyrics, sayings and prose

# the least share of an entry's letters written in the corpus's script (the rest: names, commands, English)
SCRIPT_SHARE = 0.8
# a line this long (in characters, 40 columns) that ends mid-phrase was wrapped by the editor, not the author
CJK_WRAP = 20
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\x1b")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f]")  # what is left of a broken escape, a bell, a backspace
_BOX_DRAWING = re.compile("[\u2500-\u257f]")  # the tables of the Debian reference quoted in fortunes-zh


def deb_data_tar(deb: bytes) -> tarfile.TarFile:
    """A Debian package's data archive (the ``data.tar.*`` member of the ``ar`` file), opened for reading."""
    if not deb.startswith(b"!<arch>\n"):
        raise ValueError("not a Debian package (ar archive)")
    pos = 8
    while pos + 60 <= len(deb):
        header = deb[pos : pos + 60]
        member, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        if member.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(deb[pos + 60 : pos + 60 + size]))
        pos += 60 + size + (size % 2)
    raise ValueError("the package has no data.tar member")


def deb_files(deb: bytes, root: str, names: tuple[str, ...] | None = None) -> dict[str, bytes]:
    """The regular files under ``root`` in a package (only those ``names``, relative to it, when given), by path
    relative to ``root``, in sorted order; links and folders are left out."""
    found = {}
    with deb_data_tar(deb) as archive:
        for member in archive.getmembers():
            relative = member.name.removeprefix(root)
            if member.isfile() and relative != member.name and (names is None or relative in names):
                found[relative] = archive.extractfile(member).read()
    return dict(sorted(found.items()))


def python_sources(deb: bytes) -> dict[str, str]:
    """Standard library modules of ordinary size, by dotted name (``asyncio.base_events``), in sorted order of
    their paths (``PYTHON_PER_PACKAGE`` of a package at most) until ``PYTHON_BUDGET`` bytes; the source is kept
    byte for byte."""
    sources, total, taken = {}, 0, Counter()
    low, high = PYTHON_FILE_BYTES
    for path, data in deb_files(deb, PYTHON_ROOT).items():
        if total >= PYTHON_BUDGET:
            break
        package = path.split("/")[0]
        if (not path.endswith(".py") or path.startswith(PYTHON_SKIP) or not low <= len(data) <= high
                or taken[package] >= PYTHON_PER_PACKAGE):
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        sources[path.removesuffix(".py").replace("/", ".")] = text
        total += len(data)
        taken[package] += 1
    return sources


def fortune_entries(text: str) -> list[str]:
    """The entries of a strfile fortune file (separated by lines holding ``%``), colour escapes removed, each line
    stripped of surrounding whitespace, NFC-normalised; empty entries dropped."""
    text = unicodedata.normalize("NFC", _CONTROL.sub("", _ANSI.sub("", text.replace("\r\n", "\n"))))
    entries = []
    for entry in re.split(r"^%[ \t]*$", text, flags=re.MULTILINE):
        lines = [line.strip() for line in entry.strip("\n").split("\n")]
        while lines and not lines[0]:
            lines.pop(0)
        while lines and not lines[-1]:
            lines.pop()
        if lines:
            entries.append("\n".join(lines))
    return entries


def script_share(text: str, low: str, high: str) -> float:
    """The share of the letters of ``text`` between ``low`` and ``high`` (0 when it has none)."""
    letters = [char for char in text if char.isalpha()]
    return sum(low <= char <= high for char in letters) / len(letters) if letters else 0.0


def reflow_entry(entry: str) -> str:
    """A fortune's hard-wrapped lines joined into paragraphs (blank lines kept between them); an attribution line
    (``-- Author``) stays a line of its own."""
    paragraphs, current = [], []
    for line in [line.strip() for line in entry.split("\n")] + [""]:
        if line and not line.startswith("--"):
            current.append(line)
            continue
        if current:
            paragraphs.append(" ".join(current))
            current = []
        if line:
            paragraphs.append(line)
    return "\n".join(paragraphs)


def unwrap_cjk(entry: str) -> str:
    """Chinese prose hard-wrapped mid-phrase joined again: a long line (``CJK_WRAP`` characters or more) that ends in
    an ideograph runs on into the next line, with no space; a poem's lines (short, ending in punctuation), titles and
    attributions stay lines of their own."""
    lines = entry.split("\n")
    joined = [lines[0]]
    for line in lines[1:]:
        previous = joined[-1]
        if line and not line.startswith("--") and len(previous) >= CJK_WRAP and "\u4e00" <= previous[-1] <= "\u9fff":
            joined[-1] = previous + line
        else:
            joined.append(line)
    return "\n".join(joined)


def russian_fortunes(deb: bytes) -> dict[str, str]:
    """The aphorisms of ``RUSSIAN_FILES``, one file each: entries mostly in Cyrillic, reflowed, a blank line apart."""
    corpus = {}
    for name, data in deb_files(deb, RUSSIAN_ROOT, RUSSIAN_FILES).items():
        entries = [reflow_entry(entry) for entry in fortune_entries(data.decode("utf-8"))
                   if script_share(entry, "\u0400", "\u04ff") >= SCRIPT_SHARE]
        corpus[name] = "\n\n".join(entries) + "\n"
    return corpus


def chinese_fortunes(deb: bytes) -> dict[str, str]:
    """The entries of ``CHINESE_FILES`` mostly in CJK ideographs (no tables), a blank line apart; a poem's lines
    are kept, hard-wrapped prose is joined again (``unwrap_cjk``)."""
    corpus = {}
    for name, data in deb_files(deb, CHINESE_ROOT, CHINESE_FILES).items():
        entries = [unwrap_cjk(entry) for entry in fortune_entries(data.decode("utf-8"))
                   if not _BOX_DRAWING.search(entry) and script_share(entry, "\u4e00", "\u9fff") >= SCRIPT_SHARE]
        corpus[name] = "\n\n".join(entries) + "\n"
    return corpus
