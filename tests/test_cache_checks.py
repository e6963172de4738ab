"""Every cache is checked when read (issue 51): an entry damaged, or made from something else and copied into its place,
is never used; it gets one line naming it and is made again. Each cache's check is tried at the function that reads it,
on real files: a quantized checkpoint made by gptqmodel, token streams of a real tokenizer, a model's files."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import build_llama, make_text


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ppl-audit: warning:")]


# --- token streams ---------------------------------------------------------------------------------------------------

def _entry_of(cache: Path, before: set[Path]) -> Path:
    [entry] = set((cache / "tokens").iterdir()) - before
    return entry


def _altered_ids(entry: Path, other: Path) -> None:
    """One token id changed, the entry's own record of it left as written (bit rot in the ids)."""
    with np.load(entry) as saved:
        ids, meta = saved["ids"].copy(), saved["meta"]
    ids[len(ids) // 2] ^= 1
    np.savez(entry, ids=ids, meta=meta)


def _another_corpus(entry: Path, other: Path) -> None:
    """Another corpus's token file copied over this one's (issue 51: its tokens were scored as this corpus's)."""
    shutil.copyfile(other, entry)


@pytest.mark.parametrize("damage", [_another_corpus, _altered_ids], ids=["another-corpus-copied-over", "an-id-changed"])
def test_a_token_stream_not_made_from_this_text_is_made_again(tokenizer, tmp_path, monkeypatch, capsys, damage):
    from tasks.data.corpus import cached_tokenize, tokenize

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    text, other_text = make_text(600, seed=3), make_text(900, seed=4)
    cached_tokenize(other_text, tokenizer, bos="stream")
    other = _entry_of(tmp_path, set())
    cached_tokenize(text, tokenizer, bos="stream")
    entry = _entry_of(tmp_path, {other})
    damage(entry, other)
    capsys.readouterr()
    again = cached_tokenize(text, tokenizer, bos="stream")
    assert again.ids.tolist() == tokenize(text, tokenizer, bos="stream").ids.tolist()
    [line] = warnings_in(capsys.readouterr().err)
    assert line.startswith(f"ppl-audit: warning: token cache {entry} is damaged: ") and line.endswith("made again"), line
    assert cached_tokenize(text, tokenizer, bos="stream").ids.tolist() == again.ids.tolist()  # made again whole
    assert warnings_in(capsys.readouterr().err) == []


# --- remembered model digests ----------------------------------------------------------------------------------------

def test_a_remembered_digest_of_another_model_is_not_used(tmp_path, tokenizer, monkeypatch, capsys):
    """Issue 51: the digest cache overwritten with another model's digest made the audit take that model's
    reference."""
    from tasks.models.quantize import model_digest

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    build_llama(ours, tokenizer, seed=1)
    build_llama(theirs, tokenizer, seed=2)
    ours_digest = model_digest(str(ours))
    [entry] = (tmp_path / "cache" / "digests").iterdir()
    theirs_digest = model_digest(str(theirs))
    [other] = set((tmp_path / "cache" / "digests").iterdir()) - {entry}
    assert ours_digest != theirs_digest
    for wrong in (other.read_bytes(), other.read_bytes().replace(theirs_digest.encode(), ours_digest[::-1].encode()),
                  theirs_digest.encode()):  # their entry copied over; ours edited; a bare digest (an older ppl-audit's)
        entry.write_bytes(wrong)
        capsys.readouterr()
        assert model_digest(str(ours)) == ours_digest
        [line] = warnings_in(capsys.readouterr().err)
        assert line.startswith(f"ppl-audit: warning: remembered model digest {entry} is damaged: ") and \
            line.endswith(f"{ours} is read again"), line
        assert model_digest(str(ours)) == ours_digest and warnings_in(capsys.readouterr().err) == []  # remembered


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_model_file_changed_in_place_with_its_mtime_restored_is_read_again(tmp_path, tokenizer, monkeypatch, where):
    """Path, size and modification time once named the remembered digest: one byte of the weights changed in place
    and the time set back (os.utime) kept the old digest, and the audit the old model's reference."""
    from tasks.models.quantize import model_digest

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    build_llama(model, tokenizer, seed=1)
    before = model_digest(str(model))
    [weights] = model.glob("*.safetensors")
    stat = weights.stat()
    offset = {"start": 0, "middle": stat.st_size // 2, "end": stat.st_size - 1}[where]
    with open(weights, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_size == stat.st_size
    after = model_digest(str(model))
    assert after != before
    assert after == model_digest(str(model))  # and remembered as the new one


# --- quantized checkpoints -------------------------------------------------------------------------------------------

def _flip_scales(weights: Path) -> None:
    """One bit flipped in every value of every ``q_proj.scales`` (issue 51: reused silently, ΔPPL +0.67% → +2.89%)."""
    data = bytearray(weights.read_bytes())
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    flipped = [name for name in header if name.endswith("q_proj.scales")]
    assert flipped, "the checkpoint has no q_proj.scales"
    for name in flipped:
        start, stop = header[name]["data_offsets"]
        width = {"F16": 2, "BF16": 2, "F32": 4}[header[name]["dtype"]]
        for at in range(8 + length + start, 8 + length + stop, width):
            data[at] ^= 1  # the lowest bit of each value
    weights.write_bytes(bytes(data))


def _truncate(weights: Path) -> None:
    """Cut short (issue 51: failed every later run with SafetensorError and was never made again)."""
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


@pytest.mark.slow  # gptqmodel quantizes the model three times (~70 s on 2 cores)
def test_a_damaged_cached_checkpoint_is_quantized_again(trained_model_dir, tmp_path, monkeypatch, capsys):
    from tasks.audit.checkpoints import prepare, quantized_checkpoint
    from tasks.config import BaselineSpec, EvaluationConfig, VariantSpec
    from tasks.data.evaluation import evaluation
    from tasks.models.quantize import MANIFEST

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    spec = VariantSpec(name="gptq4", method="gptq", bits=4, group_size=32,
                       calibration={"samples": 4, "seq_len": 64})
    lineup = prepare(BaselineSpec(name="baseline", path=str(trained_model_dir)), [spec])
    scored = evaluation(make_text(3000), lineup.tokenizer, EvaluationConfig(window=64, stride=32, max_tokens=256))
    folder = Path(quantized_checkpoint(spec, lineup, scored, None))
    weights = folder / "model.safetensors"
    written = weights.read_bytes()
    assert quantized_checkpoint(spec, lineup, scored, None) == str(folder)  # intact: reused
    for damage in (_flip_scales, _truncate):
        damage(weights)
        capsys.readouterr()
        assert quantized_checkpoint(spec, lineup, scored, None) == str(folder)
        [line] = warnings_in(capsys.readouterr().err)
        assert line.startswith(f"ppl-audit: warning: quantized checkpoint {folder} is damaged: model.safetensors ") and \
            line.endswith("it is removed and made again"), line
        assert weights.stat().st_size == len(written) and json.loads((folder / MANIFEST).read_text())["files"][
            "model.safetensors"]["sha256"] == __import__("hashlib").sha256(weights.read_bytes()).hexdigest()


# --- batch sizes -----------------------------------------------------------------------------------------------------

def test_a_batch_size_not_as_written_is_searched_again(tiny_model64, tokenizer, tmp_path, monkeypatch, capsys):
    import re

    from tasks.data.corpus import tokenize
    from tasks.engine.batching import auto_batch_size

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path))
    stream = tokenize(make_text(800), tokenizer, bos="none")
    size = auto_batch_size(tiny_model64, stream, 64, 32)
    file = tmp_path / "batch_sizes.json"
    # an edited size (or bit rot in it): 4096 windows at once would run a GPU out of memory on every batch
    file.write_text(re.sub(rf'": {size}(\s)', r'": 4096\1', file.read_text()))
    capsys.readouterr()
    again = auto_batch_size(tiny_model64, stream, 64, 32)
    assert 1 <= again <= 64
    [line] = warnings_in(capsys.readouterr().err)
    assert line.startswith(f"ppl-audit: warning: batch size cache {file} is damaged: ") and \
        line.endswith("the sizes are searched again"), line
    assert auto_batch_size(tiny_model64, stream, 64, 32) == again and warnings_in(capsys.readouterr().err) == []


# --- the GGUF parse cache (in a process: a file's header and config, parsed once per state of the file) --------------

def test_a_file_rewritten_with_its_size_and_modification_time_kept_is_parsed_again(tmp_path):
    import time

    from tasks.core.files import once_per_file_state

    @once_per_file_state(maxsize=4)
    def parse(path: Path) -> bytes:
        return path.read_bytes()

    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF one")
    kept = file.stat()
    assert parse(file) == b"GGUF one"
    time.sleep(0.05)  # past the kernel's clock tick (a few ms), as any later rewrite is
    file.write_bytes(b"GGUF two")  # another file of the same size copied over it, its time kept (cp -p, touch -r)
    os.utime(file, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert (file.stat().st_size, file.stat().st_mtime_ns) == (kept.st_size, kept.st_mtime_ns)
    assert parse(file) == b"GGUF two"
