"""Peak memory of scoring with a 128k vocabulary at batch 8 x window 2048: no full logits tensor.

  .venv/bin/python benchmarks/vocab_memory.py [--device cpu|cuda] [--dtype auto]

A small Llama with Llama-3's vocabulary (128,256, untied head) built from a config, random weights and
random token ids; one batch of 8 windows of 2048 tokens (stride 1024). Full float32 logits for that
batch would take 8 x 2048 x 128,256 x 4 B = 7.8 GiB. Printed, each as the growth of peak memory over
the loaded model (peak CUDA allocation on a GPU, peak process RSS on CPU):
- the body's forward pass alone (``model.base_model``: the activations any method needs);
- our engine scoring the batch (that, plus one chunk of logits at a time: 64 MiB, 256 MiB on CUDA);
- for contrast, one window (batch 1) through ``model(input_ids, labels=...)`` as the usual loops do.
Each is measured in a fresh process, so that memory freed by one cannot hide the next one's growth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from peers import random_llama  # the sibling script: its folder is on sys.path when this runs as a script

from tasks.engine.memory import PeakMemory
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import Windowing
from tasks.engine.stream import TokenStream
from tasks.models.resolve import resolve_device, resolve_dtype

VOCAB, WINDOW, STRIDE, BATCH = 128_256, 2048, 1024, 8


def small_llama_128k(dtype: torch.dtype, device: torch.device):
    return random_llama(dtype, device, vocab_size=VOCAB, hidden_size=512, intermediate_size=1408,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                        max_position_embeddings=WINDOW, tie_word_embeddings=False)


def growth(device: torch.device, work) -> int:
    """Peak memory during ``work`` above what was in use before it."""
    with PeakMemory(device) as before:
        pass
    with PeakMemory(device) as during:
        work()
    return during.peak_bytes - before.peak_bytes


def measure(what: str, device: torch.device, dtype: torch.dtype) -> dict:
    torch.set_grad_enabled(False)
    model = small_llama_128k(dtype, device)
    ids = torch.randint(0, VOCAB, (WINDOW + (BATCH - 1) * STRIDE,), generator=torch.Generator().manual_seed(0))
    batch = torch.stack([ids[k * STRIDE : k * STRIDE + WINDOW] for k in range(BATCH)]).to(device)
    stream = TokenStream(ids, (), "none", 0, 0, "random")
    work = {
        "body": lambda: model.base_model(input_ids=batch, use_cache=False),
        "engine": lambda: perplexity(model, stream, Windowing(WINDOW, STRIDE), batch_size=BATCH),
        "hf_batch1": lambda: model(input_ids=batch[:1], labels=batch[:1], use_cache=False),
    }[what]
    return {"growth_bytes": growth(device, work),
            "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "scored_tokens": len(ids) - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--only", choices=["body", "engine", "hf_batch1"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.only:
        print(json.dumps(measure(args.only, device, dtype)))
        return
    runs = {}
    for what in ("body", "engine", "hf_batch1"):
        done = subprocess.run([sys.executable, __file__, "--only", what, "--device", str(device),
                               "--dtype", str(dtype).removeprefix("torch.")],
                              capture_output=True, text=True, check=True)
        runs[what] = json.loads(done.stdout.strip().splitlines()[-1])
    weights, scored = runs["engine"]["weights_bytes"], runs["engine"]["scored_tokens"]
    full_logits = BATCH * WINDOW * VOCAB * 4
    figures = {"device": str(device), "dtype": str(dtype), "vocab": VOCAB, "batch": BATCH, "window": WINDOW,
               "scored_tokens": scored, "weights_bytes": weights, "full_logits_bytes": full_logits,
               **{f"{what}_growth_bytes": run["growth_bytes"] for what, run in runs.items()}}
    mib = 2**20
    print(f"{str(dtype).removeprefix('torch.')} on {device}, vocab {VOCAB}, batch {BATCH} x window {WINDOW} "
          f"({scored} scored tokens), weights {weights / mib:.0f} MiB")
    print(f"full float32 logits of the batch would be          {full_logits / mib:>8.0f} MiB")
    print(f"peak growth, body forward alone (batch {BATCH})          {runs['body']['growth_bytes'] / mib:>8.0f} MiB")
    print(f"peak growth, ppl-audit engine scoring the batch      {runs['engine']['growth_bytes'] / mib:>8.0f} MiB")
    print(f"peak growth, model(..., labels=...) on ONE window    {runs['hf_batch1']['growth_bytes'] / mib:>8.0f} MiB")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
