"""Small models built locally from a config and a fixed seed, and a tokenizer trained on the spot."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

WORDS = ("the a of and to in was her it his she he that with had for not be as at by on but "
         "miss mr mrs lady sir elizabeth darcy emma anne letter house morning evening walk "
         "said thought felt could would must very much little great good dear").split()


def make_text(n_words: int, seed: int = 0) -> str:
    """Deterministic English-like text: sentences of common words, paragraphs between."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n_words // 8):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", ",", "!", "?"]))
    paragraphs = [" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5)]
    return "\n\n".join(paragraphs)


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([make_text(4000, seed=1)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def build_llama(folder: Path, tokenizer, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer Llama with random weights, saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).to(dtype).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_llama(folder, tokenizer)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from tasks.models import load_model

    return load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_model64(tmp_path_factory, tokenizer):
    return build_llama(tmp_path_factory.mktemp("tiny-llama64"), tokenizer, dtype=torch.float64)


@pytest.fixture(scope="session")
def text() -> str:
    return make_text(3000)


@pytest.fixture(scope="session")
def cli():
    """Run ``ppl-audit`` as users do, in a subprocess: returns (exit code, stdout, stderr)."""
    import subprocess

    def run(*args: str, timeout: float = 600):
        done = subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                              timeout=timeout)
        return done.returncode, done.stdout, done.stderr

    return run
