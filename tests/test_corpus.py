"""Corpus sources, joining, and the token stream: exactly the tokenizer's ids, plus the BOS policy."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.corpus import CorpusSpec, corpus_text, encode, load_documents, tokenize
from tasks.errors import InputError


def test_stream_equals_one_tokenizer_call_when_tokenized_in_pieces(tokenizer, text):
    expected = tokenizer(text, add_special_tokens=False).input_ids
    ids, offsets = encode(tokenizer, text, chunk_chars=700)
    assert ids == expected
    assert offsets == tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def test_embedded_corpus_stream_equals_one_tokenizer_call():
    """The real corpus and the real tokenizer, cut in 256 KiB pieces."""
    from tasks.models import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    text = corpus_text(CorpusSpec("embedded"))[:1_500_000]
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
    assert load_documents(CorpusSpec(str(path))) == ["\n\n".join(documents)]


def test_folder_is_read_in_name_order_and_joined(tmp_path, documents):
    for name, doc in zip(["b.txt", "a.txt", "c.txt"], documents):
        (tmp_path / name).write_text(doc)
    (tmp_path / "ignored.md").write_text("not text")
    spec = CorpusSpec(str(tmp_path), joiner=" || ")
    assert corpus_text(spec) == " || ".join([documents[1], documents[0], documents[2]])


def test_jsonl_and_parquet_columns(tmp_path, documents):
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(documents)))
    parquet = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": [0, 1, 2], "body": documents}), parquet)
    for path in (jsonl, parquet):
        assert load_documents(CorpusSpec(str(path), column="body")) == documents
        with pytest.raises(InputError, match="column 'text' not in .*columns: id, body"):
            load_documents(CorpusSpec(str(path)))


def test_hugging_face_dataset_source_on_local_data(tmp_path, documents):
    """The hub path (datasets.load_dataset) run on a local dataset folder."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    pq.write_table(pa.table({"text": documents}), folder / "test.parquet")
    spec = CorpusSpec(f"hf:{folder}")  # split "test", from the file name, as wikitext has
    assert load_documents(spec) == documents
    with pytest.raises(InputError, match="column 'body' not in dataset"):
        load_documents(CorpusSpec(f"hf:{folder}", column="body"))


def test_missing_and_empty_corpora_are_refused(tmp_path):
    with pytest.raises(InputError, match="corpus not found"):
        corpus_text(CorpusSpec(str(tmp_path / "nope.txt")))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(InputError, match="is empty"):
        corpus_text(CorpusSpec(str(tmp_path / "empty.txt")))
