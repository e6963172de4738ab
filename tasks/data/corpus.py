"""Corpus sources, joined into one text and tokenized once into one token stream.

A source is a text file (one document), a folder of ``.txt`` files (sorted by name), a JSONL or
Parquet file with a text column, a Hugging Face dataset (``hf:NAME`` with config, split and column),
``embedded`` (the Austen novels) or ``embedded:NAME`` (another embedded corpus: python, russian, chinese; see
``tasks.data.embedded``). Documents are joined with ``joiner``.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.core import console, sealed
from tasks.core.errors import InputError, one_line
from tasks.core.files import prune
from tasks.core.places import embedded_corpus_name
from tasks.data.stream_said import Encoding, MadeFrom, StreamEntry, TokenizerJson, load_tokens, save_tokens
from tasks.engine.settings import BOS_POLICIES, BosPolicy
from tasks.engine.stream import TokenStream

if TYPE_CHECKING:
    from tasks.config import CorpusConfig

# the token cache keeps the most recently used streams within this size (4 bytes a token: 512M tokens)
TOKEN_CACHE_BYTES = 2 << 30
# the largest corpus file read (it is held in memory, and its tokens too): wikitext-103 is 0.5 GiB
CORPUS_MAX_BYTES = 4 << 30


def _check_file(path: Path) -> None:
    """Refuse what is not a regular file of a bounded size: ``/dev/zero`` reads until memory runs out, a FIFO
    blocks forever."""
    if not path.is_file():
        raise InputError(f"corpus {path} is not a regular file (a device, FIFO or socket); give a text, JSONL or "
                         "Parquet file")
    if path.stat().st_size > CORPUS_MAX_BYTES:
        raise InputError(f"corpus {path} holds {path.stat().st_size / 2**30:.1f} GiB, more than the "
                         f"{CORPUS_MAX_BYTES / 2**30:.0f} GiB read at once; give a part of it (an audit scores "
                         "evaluation.max_tokens of it at most)")


def _read_text(path: Path, encoding: str) -> str:
    """A text file's contents; a binary file or text in another encoding is one line saying so."""
    _check_file(path)
    data = path.read_bytes()
    try:
        return data.decode(encoding)
    except LookupError:
        raise InputError(f"unknown text encoding '{encoding}'; use a Python codec name such as utf-8 or latin-1") from None
    except UnicodeDecodeError as error:
        head = data[:8192]
        # text in any single-byte or UTF-8 encoding has no NUL bytes and few control bytes
        controls = sum(byte < 32 and byte not in b"\t\n\r\f" for byte in head)
        if b"\0" in head and controls > len(head) // 10:
            raise InputError(f"corpus {path} is a binary file, not text (it starts with bytes {head[:4].hex(' ')}); "
                             "give a text, JSONL or Parquet file") from None
        raise InputError(f"corpus {path} is not {encoding} text (byte 0x{data[error.start]:02x} at offset "
                         f"{error.start}); give its encoding with corpus.encoding or --encoding "
                         "(e.g. latin-1, cp1252, utf-16)") from None


def _read_jsonl(path: Path, column: str, encoding: str) -> list[str]:
    """The ``column`` of every JSONL row; a line that is not a JSON object with a text there is named."""
    texts = []
    for number, line in enumerate(_read_text(path, encoding).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{path}:{number} is not valid JSON ({error.msg}); fix the line") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number} is not a JSON object ({line.strip()[:40]}); "
                             f"each line must be an object with a '{column}' field")
        if column not in row:
            raise InputError(f"column '{column}' not in {path}:{number} (columns: {', '.join(row) or 'none'}); "
                             "set the text column")
        if not isinstance(row[column], (str, type(None))):
            raise InputError(f"{path}:{number}: column '{column}' holds {json.dumps(row[column])[:40]}, not text")
        texts.append(row[column] or "")
    return texts


def _read_parquet(path: Path, column: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except pa.ArrowException as error:
        raise InputError(f"corpus {path} is not a Parquet file pyarrow can read ({one_line(error)})") from None
    if column not in names:
        raise InputError(f"column '{column}' not in {path} (columns: {', '.join(names)}); set the text column")
    return [text or "" for text in pq.read_table(path, columns=[column]).column(column).to_pylist()]


def _read_hf(spec: CorpusConfig) -> list[str]:
    import datasets

    name = spec.source.removeprefix("hf:")
    try:
        data = datasets.load_dataset(name, spec.hf_config, split=spec.hf_split)
    except Exception as error:  # the datasets library raises many types; the user needs the first line
        raise InputError(f"cannot load dataset '{name}' (config {spec.hf_config}, split {spec.hf_split}): "
                         f"{one_line(error)}") from None
    if spec.column not in data.column_names:
        raise InputError(f"column '{spec.column}' not in dataset '{name}' (columns: {', '.join(data.column_names)}); set the text column")
    return [text or "" for text in data[spec.column]]


def load_documents(spec: CorpusConfig) -> list[str]:
    """Read the documents of a corpus source, in order."""
    embedded = embedded_corpus_name(spec.source)
    if embedded is not None:
        from tasks.data.embedded import ensure_embedded_corpus

        # built as UTF-8, whatever encoding the audit gives its own files
        folder = str(ensure_embedded_corpus(embedded))
        return load_documents(spec.model_copy(update={"source": folder, "encoding": "utf-8"}))
    if spec.source.startswith("hf:"):
        return _read_hf(spec)
    path = Path(spec.source)
    if not path.exists():
        raise InputError(f"corpus not found: {path} (give a .txt/.jsonl/.parquet file, a folder of .txt, hf:NAME, embedded or embedded:NAME)")
    try:
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise InputError(f"corpus folder {path} holds no .txt files; put the text in .txt files")
            return [_read_text(file, spec.encoding) for file in files]
        if path.suffix == ".jsonl":
            return _read_jsonl(path, spec.column, spec.encoding)
        if path.suffix == ".parquet":
            _check_file(path)
            return _read_parquet(path, spec.column)
        return [_read_text(path, spec.encoding)]
    except OSError as error:
        raise InputError(f"cannot read corpus {path}: {error.strerror or error}") from None


def corpus_text(spec: CorpusConfig) -> str:
    """The whole corpus as one string: the documents joined with ``spec.joiner``."""
    text = spec.joiner.join(load_documents(spec))
    if not text.strip():
        raise InputError(f"corpus {spec.source} is empty or only whitespace; give a source with text")
    return text


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoding = Encoding.of_call(tokenizer(text, add_special_tokens=False, return_offsets_mapping=True))
    return encoding.ids, encoding.offsets


def _encode_chunked(tokenizer, text: str, chunk_chars: int, lookahead: int, advance=None):
    """Tokenize piece by piece, keeping only tokens that end well before each piece's cut.

    Each piece reaches ``lookahead`` characters past the part whose tokens are kept, so that what a
    tokenizer decides at a token depends on text the piece still holds; the next piece starts at the
    first token not kept. ``encode`` checks the result against a single call before trusting it.
    ``advance`` is called with the characters each piece moved on (a progress bar's ``update``).
    """
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    pos = 0
    while pos < len(text):
        piece_ids, piece_offsets = _encode(tokenizer, text[pos : pos + chunk_chars + lookahead])
        keep = len(piece_ids)
        if pos + chunk_chars + lookahead < len(text):
            keep = sum(1 for _, end in piece_offsets if end <= chunk_chars)
            keep = max(1, min(keep, len(piece_ids) - 1))
        ids.extend(piece_ids[:keep])
        offsets.extend((start + pos, end + pos) for start, end in piece_offsets[:keep])
        step = piece_offsets[keep][0] if keep < len(piece_ids) else len(text) - pos
        if advance:
            advance(step)
        pos += step
    return ids, offsets


def encode(tokenizer, text: str, chunk_chars: int = 1 << 18, progress: str | None = None):
    """Token ids and character offsets equal to ``tokenizer(text, add_special_tokens=False)``.

    Long texts are tokenized in pieces. ``progress`` names a progress bar (none when None). Whether this tokenizer gives the same
    ids in pieces is checked first on a sample cut into small pieces; where it does not (a tokenizer
    that treats the start of a text specially, say), the text is tokenized in one call.
    """
    with console.bar(len(text), progress or "tokenize", "char", enabled=progress is not None) as bar:
        sample = text[: 4 * 4096]
        if len(text) > chunk_chars and _encode_chunked(tokenizer, sample, 4096, 1024)[0] == _encode(tokenizer, sample)[0]:
            return _encode_chunked(tokenizer, text, chunk_chars, max(4096, chunk_chars // 16), bar.update)
        whole = _encode(tokenizer, text)
        bar.update(len(text))
        return whole


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what decides token ids: vocabulary, merges and added/special tokens. A tokenizer that names itself
    (llama.cpp's, ``tasks.models.llama_cpp.Tokenizer``) gives its own ``digest``."""
    if isinstance(getattr(tokenizer, "digest", None), str):
        return tokenizer.digest
    if getattr(tokenizer, "is_fast", False):
        state = TokenizerJson.of_json(json.loads(tokenizer.backend_tokenizer.to_str()))
        canonical = {"vocab": state.vocab, "merges": state.merges,
                     "added": [(t.id, t.content, t.special) for t in state.added]}
    else:
        canonical = {"vocab": sorted(tokenizer.get_vocab().items()), "special": tokenizer.all_special_tokens}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts BOS before a text by itself (transformers' ``add_bos_token``, GGUF's
    ``tokenizer.ggml.add_bos_token``): read off an encoding, which every tokenizer class answers alike."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def default_bos(tokenizer, mode: str = "sliding") -> BosPolicy:
    """Each mode's own convention: ``sliding`` (ours) starts the stream with BOS when the tokenizer has
    one; ``gptq`` (the GPTQ/AWQ papers) scores the plain stream; ``llama.cpp`` puts BOS over each chunk's
    first token only when the model's vocabulary says to add BOS, as ``llama-perplexity`` does."""
    if mode == "gptq":
        return "none"
    if mode == "llama.cpp":
        return "stream" if adds_bos(tokenizer) else "none"
    return "stream" if tokenizer.bos_token_id is not None else "none"


def tokenize(
    text: str, tokenizer, bos: BosPolicy | None = None, max_tokens: int | None = None, progress: str | None = None
) -> TokenStream:
    """Tokenize a corpus text once into a ``TokenStream``.

    Args:
        text: the whole corpus.
        tokenizer: a Hugging Face tokenizer (fast tokenizers give offsets for byte counts).
        bos: ``none``, ``stream`` (one BOS first) or ``window`` (BOS first in every window);
            default ``stream`` when the tokenizer has a BOS token.
        max_tokens: keep only the first ``max_tokens`` tokens of the stream (BOS included).
        progress: the progress bar's name (none when None).
    """
    bos = bos or default_bos(tokenizer)
    if bos not in BOS_POLICIES:
        raise InputError(f"unknown BOS policy '{bos}'; use one of {', '.join(BOS_POLICIES)}")
    if bos != "none" and tokenizer.bos_token_id is None:
        raise InputError(f"BOS policy '{bos}' needs a tokenizer with a BOS token; this one has none, use --bos none")
    if max_tokens is not None and max_tokens < 2:
        raise InputError(f"max tokens is {max_tokens}; give at least 2")
    ids, offsets = encode(tokenizer, text, progress=progress)
    lead = [tokenizer.bos_token_id] if bos == "stream" else []
    if max_tokens is not None:
        ids, offsets = ids[: max_tokens - len(lead)], offsets[: max_tokens - len(lead)]
    stream = lead + ids
    scored_from = 0 if bos != "none" else 1
    if len(stream) < 2 and not (bos == "window" and stream):
        raise InputError(f"corpus has {len(stream)} token(s); perplexity needs at least 2")
    scored_text = text[offsets[scored_from][0] : offsets[-1][1]] if len(ids) > scored_from else ""
    return TokenStream(
        ids=torch.tensor(stream, dtype=torch.long),
        prefix=(tokenizer.bos_token_id,) if bos == "window" else (),
        bos=bos,
        n_bytes=len(scored_text.encode("utf-8")),
        n_words=len(scored_text.split()),
        text_digest=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        bos_id=tokenizer.bos_token_id,
    )


def cached_tokenize(text: str, tokenizer, bos: BosPolicy | None = None, max_tokens: int | None = None,
                    progress: str | None = None) -> TokenStream:
    """``tokenize``, with the stream kept on disk by corpus digest, tokenizer digest and settings.

    A second audit of the same corpus with the same tokenizer reads ``N`` int32 ids instead of
    tokenizing again (``$PPL_AUDIT_CACHE/tokens``). An entry keeps what it was made from (those digests and
    settings) and the sha256 of its ids, checked when read: another corpus's file copied over this one's, or
    damaged ids, are never scored (one line; it is made again).
    """
    import numpy as np

    from tasks.core.places import cache_dir

    bos = bos or default_bos(tokenizer)
    made_from = MadeFrom(text=hashlib.sha256(text.encode("utf-8")).hexdigest(), tokenizer=tokenizer_digest(tokenizer),
                         bos=bos, max_tokens=max_tokens)
    key = hashlib.sha256(json.dumps(list(made_from.as_record().values())).encode()).hexdigest()
    file = cache_dir() / "tokens" / f"{key}.npz"
    if file.is_file():
        found, problem = _read_tokens(file, made_from)
        if found is not None:
            os.utime(file)  # recently used: kept when the cache is pruned
            return found
        sealed.warn_remade("token cache", file, problem, "it is ignored and made again")
    stream = tokenize(text, tokenizer, bos, max_tokens, progress)
    file.parent.mkdir(parents=True, exist_ok=True)
    ids = stream.ids.numpy().astype(np.int32)
    entry = StreamEntry(ids_sha256=hashlib.sha256(ids.tobytes()).hexdigest(), prefix=stream.prefix,
                        n_bytes=stream.n_bytes, n_words=stream.n_words, bos_id=stream.bos_id)
    partial = file.with_suffix(f".{os.getpid()}.tmp.npz")
    save_tokens(partial, ids, sealed.seal(entry.as_record(made_from)))
    partial.rename(file)
    prune(file.parent, TOKEN_CACHE_BYTES)
    return stream


def _read_tokens(file: Path, made_from: MadeFrom) -> tuple[TokenStream | None, str]:
    """The stream a token cache file holds, when it was made from ``made_from`` and its ids are those written; else
    None and what is wrong. Costs a sha256 of its ids (4 bytes a token)."""
    import numpy as np

    try:
        meta, ids = load_tokens(file)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        return None, f"it cannot be read ({type(error).__name__})"
    problem = sealed.damage(meta, "its entry", made_from.as_record())
    if problem:
        return None, problem
    entry = StreamEntry.of_json(meta)  # sealed as written, from what this stream is made from
    if hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest() != entry.ids_sha256:
        return None, "its token ids are not those written (their sha256 differs)"
    return TokenStream(ids=torch.from_numpy(ids.astype(np.int64)), prefix=entry.prefix, bos=made_from.bos,
                       n_bytes=entry.n_bytes, n_words=entry.n_words, text_digest=made_from.text,
                       bos_id=entry.bos_id), ""
