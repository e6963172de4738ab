"""The embedded corpora (Austen, Python source, Russian, Chinese): built from the real Debian packages (fetched once
with apt-get into the cache's downloads folder, then reused), clean text in the script promised, enough tokens,
the same bytes every build, and their names checked before anything loads."""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.config import CorpusConfig, parse
from tasks.core.errors import InputError
from tasks.core.places import EMBEDDED_CORPUS_NAMES, cache_dir
from tasks.data.corpus import load_documents
from tasks.data.domains import PYTHON_ROOT, deb_files, reflow_entry, unwrap_cjk
from tasks.data.embedded import EMBEDDED_CORPORA, _download_deb, ensure_embedded_corpus
from tasks.record.contents import corpus_location

OTHERS = ("python", "russian", "chinese")
# what a corpus's letters are mostly written in: Cyrillic, CJK ideographs
SCRIPTS = {"russian": ("\u0400", "\u04ff", 0.95), "chinese": ("\u4e00", "\u9fff", 0.9)}
# the Austen corpus as main built it: token caches and stored references hold its digest, so its bytes must not move
AUSTEN_SHA256 = "5c43e1597a5f26229c35156f89e5a6488a80cbcbb897b90335373419793bffc5"
ROFF = re.compile(r"^\.[A-Za-z\\]|\\f[BIRP(]|\\-|\\\(|\\\*", re.MULTILINE)


def digest(folder: Path) -> str:
    sha = hashlib.sha256()
    for file in sorted(folder.glob("*.txt")):
        sha.update(file.name.encode() + b"\0" + file.read_bytes())
    return sha.hexdigest()


@pytest.fixture(scope="module")
def corpora() -> dict[str, dict[str, bytes]]:
    """Every embedded corpus in the real cache (built, and its package fetched, on first use): file name → bytes."""
    return {name: {file.name: file.read_bytes() for file in sorted(ensure_embedded_corpus(name).glob("*.txt"))}
            for name in EMBEDDED_CORPORA}


@pytest.fixture(scope="module")
def tokenizer():
    from tasks.data.embedded import ensure_embedded_model
    from tasks.models.resolve import load_tokenizer

    ensure_embedded_model()
    return load_tokenizer("embedded")


def test_the_corpora_are_named_alike_everywhere():
    assert tuple(EMBEDDED_CORPORA) == EMBEDDED_CORPUS_NAMES
    assert EMBEDDED_CORPUS_NAMES[0] == "austen"


def test_austen_keeps_its_bytes(corpora):
    assert digest(ensure_embedded_corpus("austen")) == AUSTEN_SHA256
    assert ensure_embedded_corpus() == ensure_embedded_corpus("austen") == cache_dir() / "corpora" / "austen"


@pytest.mark.parametrize("name", OTHERS)
def test_corpus_is_utf8_text_without_markup(corpora, name):
    files = corpora[name]
    assert files
    for file_name, data in files.items():
        text = data.decode("utf-8")  # raises on anything else
        assert "\x1b" not in text, f"{name}/{file_name} keeps a terminal escape"
        assert not re.search("[\x00-\x08\x0b\x0e-\x1f\x7f]", text), f"{name}/{file_name} keeps a control character"
        if name != "python":  # roff requests and escapes; Python source has its own backslashes
            found = ROFF.search(text)
            assert found is None, f"{name}/{file_name} keeps roff markup: {text[found.start():found.start() + 40]!r}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_corpus_is_written_in_its_script(corpora, name):
    low, high, share = SCRIPTS[name]
    letters = [char for data in corpora[name].values() for char in data.decode() if char.isalpha()]
    assert sum(low <= char <= high for char in letters) / len(letters) >= share


@pytest.mark.parametrize("name", OTHERS)
def test_corpus_gives_twenty_thousand_tokens_of_the_embedded_model(corpora, tokenizer, name):
    texts = load_documents(CorpusConfig(source=f"embedded:{name}"))
    assert texts == [data.decode() for data in corpora[name].values()]
    tokens = sum(len(tokenizer(text, add_special_tokens=False).input_ids) for text in texts)
    assert tokens >= 20_000


def test_python_corpus_is_the_standard_library_as_shipped(corpora):
    deb = sorted((cache_dir() / "downloads").glob(f"{EMBEDDED_CORPORA['python'].package}_*.deb"))[-1].read_bytes()
    shipped = deb_files(deb, PYTHON_ROOT)
    files = corpora["python"]
    assert len(files) >= 20 and 200_000 <= sum(map(len, files.values())) <= 2_000_000
    indented = 0
    for file_name, data in files.items():
        module = file_name.removesuffix(".txt")
        ast.parse(data, filename=module)  # Python, whole
        assert data == shipped[module.replace(".", "/") + ".py"], f"{module} differs from the packaged source"
        indented += len(re.findall(rb"^(?: {4})+\S", data, re.MULTILINE))
    assert indented > 5_000  # indentation kept, line by line


def test_russian_entries_are_reflowed_paragraphs(corpora):
    text = corpora["russian"]["life.txt"].decode()
    assert text.startswith("Жизнь для меня - не тающая свеча. Это что-то вроде чудесного факела, который попал мне в "
                           "руки на мгновение")
    assert "\n-- Бернард Шоу\n\n" in text
    assert reflow_entry("Одна строка \nи другая.\n-- Автор") == "Одна строка и другая.\n-- Автор"


def test_chinese_keeps_poem_lines_and_joins_wrapped_prose(corpora):
    tang = corpora["chinese"]["tang300.txt"].decode()
    assert tang.startswith("《感遇・其一》\n作者：张九龄\n兰叶春葳蕤，桂华秋皎洁。\n欣欣此生意，自尔为佳节。\n")
    assert "在 Debian 这种规模的项目中，很难避免遇到与你意见不和，或者难以合作的人。" in corpora["chinese"]["chinese.txt"].decode()
    assert unwrap_cjk("作者：王维\n下马饮君酒，问君何所之。") == "作者：王维\n下马饮君酒，问君何所之。"


def test_a_build_gives_the_same_bytes_every_time(corpora, tmp_path, monkeypatch):
    """Two fresh caches, given the packages the real one fetched, build every corpus to the same bytes as it."""
    downloads = cache_dir() / "downloads"
    for build in ("first", "second"):
        monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / build))
        (tmp_path / build / "downloads").mkdir(parents=True)
        for spec in EMBEDDED_CORPORA.values():
            deb = sorted(downloads.glob(f"{spec.package}_*.deb"))[-1]
            shutil.copy(deb, tmp_path / build / "downloads" / deb.name)
        for name in EMBEDDED_CORPORA:
            folder = ensure_embedded_corpus(name)
            assert folder == tmp_path / build / "corpora" / name
            assert {file.name: file.read_bytes() for file in sorted(folder.glob("*.txt"))} == corpora[name], name
        assert not list((tmp_path / build / "corpora").glob(".build-*"))  # nothing half built left behind


def test_a_damaged_corpus_is_built_again_not_read(corpora, tmp_path, monkeypatch, capsys):
    """Each corpus keeps the sizes and sha256 of its files, checked when it is read: a file changed or added is never
    scored; the corpus is built again from its package, with one line saying so."""
    deb = sorted((cache_dir() / "downloads").glob(f"{EMBEDDED_CORPORA['russian'].package}_*.deb"))[-1]
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    shutil.copy(deb, tmp_path / "downloads" / deb.name)
    folder = ensure_embedded_corpus("russian")
    for damage in (lambda: (folder / "life.txt").write_text("Жизнь — штука короткая.\n", encoding="utf-8"),
                   lambda: (folder / "extra.txt").write_text("не отсюда\n", encoding="utf-8")):
        damage()
        assert ensure_embedded_corpus("russian") == folder
        assert "embedded corpus" in capsys.readouterr().err  # the one warning line
        assert {f.name: f.read_bytes() for f in sorted(folder.glob("*.txt"))} == corpora["russian"]
    assert ensure_embedded_corpus("russian") == folder and capsys.readouterr().err == ""  # intact: read as it is


def test_embedded_name_reads_that_corpus_and_records_its_folder(corpora):
    for name in EMBEDDED_CORPORA:
        source = "embedded" if name == "austen" else f"embedded:{name}"
        assert corpus_location(source) == str(cache_dir() / "corpora" / name)
    spec = CorpusConfig(source="embedded:russian", encoding="latin-1")  # the embedded corpora are UTF-8 regardless
    assert load_documents(spec) == [data.decode() for data in corpora["russian"].values()]


def test_an_unknown_embedded_corpus_is_refused_in_one_line_naming_the_known():
    with pytest.raises(ValidationError):
        CorpusConfig(source="embedded:nosuch")
    with pytest.raises(InputError) as refused:
        parse(CorpusConfig, {"source": "embedded:nosuch"}, "corpus")
    message = str(refused.value)
    assert "\n" not in message and "nosuch" in message
    assert all(name in message for name in EMBEDDED_CORPUS_NAMES)
    with pytest.raises(InputError, match="austen, python, russian, chinese"):
        ensure_embedded_corpus("nosuch")


def test_without_apt_get_the_refusal_says_how_to_provide_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine with no apt-get
    with pytest.raises(InputError) as refused:
        _download_deb("fortunes-ru", tmp_path / "downloads")
    message = str(refused.value)
    assert "\n" not in message and "apt-get" in message and "fortunes-ru" in message
    assert str(tmp_path / "downloads") in message


@pytest.mark.slow  # apt-get asks the registry, then refreshes its package lists and asks again
def test_a_failed_download_names_the_package(tmp_path):
    if shutil.which("apt-get") is None:
        pytest.skip("no apt-get on this machine")
    with pytest.raises(InputError) as refused:
        _download_deb("ppl-audit-no-such-package", tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "apt-get download ppl-audit-no-such-package failed" in message
    assert "yourself" in message
