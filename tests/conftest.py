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


def train_briefly(model, tokenizer, steps: int = 150, seed: int = 2) -> None:
    """A few hundred steps of next-token training, so that the model predicts better than chance."""
    ids = torch.tensor(tokenizer(make_text(20000, seed=seed), add_special_tokens=False).input_ids)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=generator)
        batch = torch.stack([ids[s : s + 65] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A 128-wide, 2-layer Llama trained briefly: widths that GPTQ/AWQ group sizes 32/64 divide."""
    folder = tmp_path_factory.mktemp("trained-llama")
    model = build_llama(folder, tokenizer, hidden_size=128, intermediate_size=256, initializer_range=0.02)
    train_briefly(model, tokenizer)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def prefect_harness():
    """A real, temporary Prefect server and database for the whole session (it takes 10-17 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def wait_for(check, timeout: float, what: str, every: float = 1.0, tolerate: tuple[type[BaseException], ...] = ()):
    """``check()``'s first truthy answer, asked every ``every`` seconds; an error in ``tolerate`` (or an HTTP
    error: a server still starting) counts as no answer."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except (httpx.HTTPError, *tolerate):
            found = None
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def dead_pid() -> int:
    """The pid of a process that has ended (as a killed writer's is)."""
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_config(path: Path, baseline: Path, corpus: Path, variants: list[dict], **sections) -> Path:
    """An audit YAML for a tiny model: small windows, a short stream."""
    import yaml

    config = {"name": sections.pop("name", "tiny"), "baseline": {"path": str(baseline)},
              "corpus": {"source": str(corpus)},
              "evaluation": {"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 1500},
              "variants": variants, **sections}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audit-corpus") / "corpus.txt"
    path.write_text(make_text(3000))
    return path


@pytest.fixture(scope="session")
def noisy_model_dir(tmp_path_factory, trained_model_dir, tokenizer) -> Path:
    """The trained model with noise added to its weights: clearly worse, same tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_model_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.ndim == 2:  # the briefly trained model leans on its embeddings and head: noise them too
                weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 0.5)
    folder = tmp_path_factory.mktemp("noisy-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pytest_configure(config):
    """The tests call flows and tasks as the command line does, after the same process set-up."""
    from flows.cli import process_defaults

    process_defaults()


@pytest.fixture(autouse=True, scope="session")
def audit_home(tmp_path_factory):
    """Spooled records and the local MLflow store of every test (and of the processes tests start) stay
    in a temporary folder, never in the user's ~/.ppl-audit. Modules that inspect it set their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(tmp_path_factory.mktemp("ppl-audit-home")))
        yield
