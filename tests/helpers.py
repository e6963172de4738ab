"""Plain helpers the tests share: deterministic text, a tokenizer trained on the spot, small Llamas built
from a config and a seed, an audit YAML, and process-level waiting. A module of its own, imported as
``from helpers import ...``; the fixtures built on them stay in ``conftest.py``."""

from __future__ import annotations

import random
from pathlib import Path

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


def json_line(out: str, err: str = "", **loads) -> dict:
    """The last line of a ``--json`` command's stdout, parsed (``loads``: ``json.loads`` options); a clear
    failure, not an IndexError, where stdout is empty."""
    import json

    lines = out.strip().splitlines()
    assert lines, f"no JSON line on stdout; stderr ends: {err[-2000:]!r}"
    return json.loads(lines[-1], **loads)


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


def stored_reference(model, stream, window: int, stride: int, source: Path, key: str, batch_size: int = 3):
    """Score ``model`` as an audit scores its baseline, writing its reference under ``key``; returns
    ``(Reference, PerplexityResult)``. The manifest holds what reading it back needs, not a real identity."""
    from tasks.perplexity import perplexity
    from tasks.reference import Writer, building, environment
    from tasks.windows import plan

    with building() as scratch:
        writer = Writer(scratch / key, sum(w.n_scored for w in plan(stream, window, stride)))
        writer.staging.mkdir()
        result = perplexity(model, stream, window, stride, batch_size, keep_hidden=writer)
        manifest = {"identity": {"dtype": str(model.dtype).removeprefix("torch.")},
                    "environment": environment(model.device), "facts": {},
                    "source": str(source), "softcap": None}
        return writer.publish(key, manifest, result, model.get_output_embeddings(), replace=False), result


def perturbed(model_dir: Path, dtype: torch.dtype = torch.float64, scale: float = 0.05, seed: int = 3):
    """The model in ``model_dir`` with Gaussian noise of ``scale`` on every weight: a variant that really differs."""
    from tasks.models import load_model

    model = load_model(str(model_dir), dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator, dtype=torch.float64).to(dtype) * scale)
    return model
