"""A GGUF file's header read by ``tasks.models.gguf_file`` and its blocks dequantized by ``tasks.models.gguf_blocks``:
the same facts, tensors and config as gguf-py and transformers give, to the bit, without parsing the vocabulary."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.data.embedded import embedded_gguf
from tasks.models.gguf_blocks import DEQUANTIZE
from tasks.models.gguf_file import Strings, header_config, read_header, tensor_data

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from loading import HALVES, llama_gguf  # noqa: E402  (the benchmark's file maker: one source for both)

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_the_header_gives_gguf_py_s_tensors_and_skips_the_vocabulary():
    import gguf

    path = Path(embedded_gguf())
    header, reader = read_header(path), gguf.GGUFReader(path)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert (ours.tensor_type, ours.n_bytes, ours.n_elements) == (theirs.tensor_type, theirs.n_bytes, theirs.n_elements)
        data = tensor_data(header, ours)
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape and np.array_equal(data, theirs.data)
    tokens = header.field("tokenizer.ggml.tokens")
    assert isinstance(tokens, Strings) and tokens.count == len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    assert header.field("general.architecture") == "llama"


def test_the_config_from_the_header_is_transformers_own():
    from transformers import AutoConfig

    path = Path(embedded_gguf())
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    from tasks.models.resolve import load_config

    assert load_config(str(path)).to_dict() == theirs
    assert header_config(read_header(path)).values["vocab_size"] == theirs["vocab_size"] == 49152


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_the_tokenizer_of_a_gguf_file_is_autotokenizer_s_without_parsing_the_vocabulary_twice(tmp_path, monkeypatch,
                                                                                             architecture):
    """``load_tokenizer`` of a GGUF file: the class and the tokenizer ``AutoTokenizer`` gives (SmolLM2's file, and
    the same file calling itself qwen2, whose tokenizer class is Qwen2's own), without the pass of gguf-py's reader
    over every string that ``AutoTokenizer`` makes to build a config (2.7 s for this file)."""
    import gguf
    from helpers import rewrite_gguf
    from transformers import AutoTokenizer

    from tasks.models.resolve import load_tokenizer

    path = Path(embedded_gguf())
    if architecture != "llama":
        path = rewrite_gguf(path, tmp_path / "renamed.gguf", architecture=architecture)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with monkeypatch.context() as patched:
        patched.setattr(gguf, "GGUFReader", None)  # any use of it raises
        ours = load_tokenizer(str(path))
    assert type(ours) is type(theirs) and (type(ours).__name__ == "TokenizersBackend") == (architecture == "llama")
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.init_kwargs == theirs.init_kwargs and ours.special_tokens_map == theirs.special_tokens_map
    text = Path(__file__).read_text()
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]


@pytest.mark.parametrize("kind", sorted(DEQUANTIZE))
def test_each_block_format_dequantizes_as_gguf_py_does_to_the_bit(kind):
    import gguf

    rng = np.random.default_rng(7)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, (48, 6 * size), dtype=np.uint8)  # every bit pattern of the packed values
    blocks = rows.reshape(-1, size)
    for at in HALVES[kind]:  # finite scales of both signs
        at %= size
        blocks[:, at : at + 2] = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    want = gguf.dequantize(rows, qtype)
    got = DEQUANTIZE[kind](torch.from_numpy(blocks)).numpy().reshape(want.shape)
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K"])
def test_a_file_of_each_type_loads_as_transformers_loads_it(tmp_path, kind):
    """Q5_K goes through gguf-py's own block code in slices (no torch transcription of it): the same bits too."""
    from transformers import AutoModelForCausalLM

    from tasks.models.loading import load_model

    path = tmp_path / f"{kind}.gguf"
    llama_gguf(path, SMALL, kind)
    ours = load_model(str(path), torch.float32, torch.device("cpu")).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("damage, says", [
    (lambda head: head[:1000], "it is cut short or damaged"),
    (lambda head: head[:8] + (2**40).to_bytes(8, "little") + head[16:], "it is cut short or damaged (1099511627776 tensors"),
    (lambda head: head[:4] + (9).to_bytes(4, "little") + head[8:], "its GGUF version 9 is not 2 or 3"),
])
def test_a_damaged_header_is_refused_in_words_a_user_can_act_on(tmp_path, damage, says):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damage(Path(embedded_gguf()).read_bytes()[: 4 * 2**20]))
    with pytest.raises(ValueError, match=rf"^{re.escape(says)}.*: give "):
        read_header(path)
