"""Corpus sources, joining, and the token stream: exactly the tokenizer's ids, plus the BOS policy."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.config import CorpusConfig
from tasks.core.errors import InputError
from tasks.data.corpus import corpus_text, encode, load_documents, tokenize


def test_stream_equals_one_tokenizer_call_when_tokenized_in_pieces(tokenizer, text):
    expected = tokenizer(text, add_special_tokens=False).input_ids
    ids, offsets = encode(tokenizer, text, chunk_chars=700)
    assert ids == expected
    assert offsets == tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def test_embedded_corpus_stream_equals_one_tokenizer_call():
    """The real corpus and the real tokenizer, cut in 256 KiB pieces."""
    from tasks.models.resolve import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    text = corpus_text(CorpusConfig(source="embedded"))[:1_500_000]
    assert encode(tokenizer, text)[0] == tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("bos,first", [("none", None), ("stream", "<s>"), ("window", None)])
def test_bos_policies(tokenizer, text, bos, first):
    plain = tokenizer(text, add_special_tokens=False).input_ids
    stream = tokenize(text, tokenizer, bos=bos)
    lead = [tokenizer.bos_token_id] if first else []
    assert stream.ids.tolist() == lead + plain
    assert stream.prefix == ((tokenizer.bos_token_id,) if bos == "window" else ())
    assert stream.n_bytes == len(text.encode()) - (len(tokenizer.decode(plain[:1]).encode()) if bos == "none" else 0)


def test_default_bos_is_stream_when_the_tokenizer_has_one(tokenizer, text):
    assert tokenize(text, tokenizer).bos == "stream"


def test_max_tokens_truncates_the_stream(tokenizer, text):
    stream = tokenize(text, tokenizer, bos="stream", max_tokens=50)
    assert len(stream.ids) == 50
    assert stream.n_words < len(text.split())


def test_too_short_corpus_is_refused(tokenizer):
    with pytest.raises(InputError, match="at least 2"):
        tokenize("a", tokenizer, bos="none")


@pytest.fixture
def documents():
    return ["First document.", "Second one, with more words.", "Third."]


def test_text_file_is_one_document(tmp_path, documents):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(documents))
    assert load_documents(CorpusConfig(source=str(path))) == ["\n\n".join(documents)]


def test_folder_is_read_in_name_order_and_joined(tmp_path, documents):
    for name, doc in zip(["b.txt", "a.txt", "c.txt"], documents):
        (tmp_path / name).write_text(doc)
    (tmp_path / "ignored.md").write_text("not text")
    spec = CorpusConfig(source=str(tmp_path), joiner=" || ")
    assert corpus_text(spec) == " || ".join([documents[1], documents[0], documents[2]])


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_jsonl_and_parquet_columns(tmp_path, documents, suffix):
    path = tmp_path / f"corpus.{suffix}"
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(documents)))
    else:
        pq.write_table(pa.table({"id": [0, 1, 2], "body": documents}), path)
    assert load_documents(CorpusConfig(source=str(path), column="body")) == documents
    with pytest.raises(InputError, match="column 'text' not in .*columns: id, body"):
        load_documents(CorpusConfig(source=str(path)))


def test_hugging_face_dataset_source_on_local_data(tmp_path, documents):
    """The hub path (datasets.load_dataset) run on a local dataset folder."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    pq.write_table(pa.table({"text": documents}), folder / "test.parquet")
    spec = CorpusConfig(source=f"hf:{folder}")  # split "test", from the file name, as wikitext has
    assert load_documents(spec) == documents
    with pytest.raises(InputError, match="column 'body' not in dataset"):
        load_documents(CorpusConfig(source=f"hf:{folder}", column="body"))


def test_missing_and_empty_corpora_are_refused(tmp_path):
    with pytest.raises(InputError, match="corpus not found"):
        corpus_text(CorpusConfig(source=str(tmp_path / "nope.txt")))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(InputError, match="is empty or only whitespace"):
        corpus_text(CorpusConfig(source=str(tmp_path / "empty.txt")))


# each: the file's name and bytes, and the one line that refuses it
UNREADABLE = {
    "binary": ("model.txt", bytes(range(256)) * 64, "is a binary file, not text (it starts with bytes 00 01 02 03)"),
    "latin-1": ("french.txt", "Déjà vu à l'été".encode("latin-1"), "is not utf-8 text (byte 0xe9 at offset 1); give its "
                "encoding with corpus.encoding or --encoding"),
    "bad json line": ("rows.jsonl", b'{"text": "fine"}\n{"text": oops}\n', "rows.jsonl:2 is not valid JSON"),
    "json array line": ("rows.jsonl", b'{"text": "fine"}\n["text"]\n', "rows.jsonl:2 is not a JSON object ([\"text\"])"),
    "row without the column": ("rows.jsonl", b'{"text": "fine"}\n{"body": "x"}\n',
                               "column 'text' not in {path}:2 (columns: body)"),
    "number as text": ("rows.jsonl", b'{"text": 7}\n', "rows.jsonl:1: column 'text' holds 7, not text"),
    "broken parquet": ("rows.parquet", b"PAR1 not really", "is not a Parquet file pyarrow can read"),
}


@pytest.mark.parametrize("case", UNREADABLE, ids=list(UNREADABLE))
def test_unreadable_corpora_are_one_line(tmp_path, case):
    name, data, expected = UNREADABLE[case]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(InputError) as refused:
        corpus_text(CorpusConfig(source=str(path)))
    assert expected.format(path=path) in str(refused.value) and "\n" not in str(refused.value)


def test_another_encoding_can_be_given(tmp_path):
    path = tmp_path / "french.txt"
    path.write_bytes("Déjà vu à l'été".encode("latin-1"))
    assert corpus_text(CorpusConfig(source=str(path), encoding="latin-1")) == "Déjà vu à l'été"
    with pytest.raises(InputError, match="unknown text encoding 'klingon'"):
        corpus_text(CorpusConfig(source=str(path), encoding="klingon"))


def test_a_folder_without_text_files_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("words")
    with pytest.raises(InputError, match="holds no .txt files"):
        corpus_text(CorpusConfig(source=str(tmp_path)))


def test_an_unreachable_hub_dataset_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError) as refused:
        corpus_text(CorpusConfig(source="hf:no-such-org/no-such-dataset"))
    assert str(refused.value).startswith("cannot load dataset 'no-such-org/no-such-dataset'")
    assert "\n" not in str(refused.value)


def test_the_token_cache_keeps_the_recently_used_streams_within_its_size(tmp_path, monkeypatch, tokenizer):
    import os
    import time

    from helpers import make_text

    from tasks.data import corpus

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    texts = [make_text(400, seed) for seed in range(3)]
    entries = []
    for age, text in zip((300, 200), texts):
        before = set((tmp_path / "tokens").glob("*")) if (tmp_path / "tokens").is_dir() else set()
        corpus.cached_tokenize(text, tokenizer)
        (entry,) = set((tmp_path / "tokens").glob("*")) - before
        os.utime(entry, (time.time() - age, time.time() - age))
        entries.append(entry)
    monkeypatch.setattr(corpus, "TOKEN_CACHE_BYTES", 2.5 * max(e.stat().st_size for e in entries))
    corpus.cached_tokenize(texts[0], tokenizer)  # the oldest entry, read again: recently used now
    corpus.cached_tokenize(texts[2], tokenizer)  # a third entry: the cache is over its size
    kept = set((tmp_path / "tokens").glob("*"))
    assert entries[0] in kept and entries[1] not in kept and len(kept) == 2


@pytest.mark.parametrize("bos, max_tokens", [("window", None), ("stream", 50), ("none", None)])
def test_a_cached_stream_reads_back_as_the_stream_it_was_made_from(tmp_path, monkeypatch, tokenizer, text, bos,
                                                                 max_tokens):
    """Each field of a token cache entry is read back into its own place (a prefix, bytes, words or BOS id read from
    another field, or what it was made from, would change the figures of every audit that reads the cache)."""
    from tasks.data.corpus import cached_tokenize

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    made = cached_tokenize(text, tokenizer, bos, max_tokens)
    read = cached_tokenize(text, tokenizer, bos, max_tokens)
    assert len(list((tmp_path / "tokens").glob("*.npz"))) == 1  # the second was read from the cache
    assert read.ids.tolist() == made.ids.tolist() == tokenize(text, tokenizer, bos, max_tokens).ids.tolist()
    assert (read.prefix, read.bos, read.n_bytes, read.n_words, read.text_digest, read.bos_id) == \
        (made.prefix, made.bos, made.n_bytes, made.n_words, made.text_digest, made.bos_id)
    assert read.n_bytes != read.n_words and read.prefix == ((tokenizer.bos_token_id,) if bos == "window" else ())
