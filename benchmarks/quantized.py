"""Quantized variants through ppl-audit's own loading and engine: perplexity, scored tokens/s, weight memory.

  .venv/bin/python benchmarks/quantized.py --model MODEL [--methods baseline bnb-int8 bnb-nf4] [--device cuda]

Each method loads the way an audit loads it (``tasks.models.variants.load_variant``: bitsandbytes quantizes the
baseline at load; ``gptq``/``awq`` need ``--path`` to a checkpoint made by gptqmodel) and scores the same
stream with a sliding window. Run it on CPU and on a GPU with the same model: the two PPLs of a method
should differ by no more than the baseline's own CPU/GPU difference (float32 against bf16 rounding).
``--model llama-1b`` saves a Llama-3.2-1B-shaped model with random weights to a temporary folder first
(speed only: its perplexity means nothing). The last line is the rows as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

import torch

from tasks.config import CorpusConfig, VariantSpec
from tasks.data.corpus import corpus_text, tokenize
from tasks.engine.perplexity import perplexity
from tasks.models.resolve import load_tokenizer, resolve_device, resolve_dtype
from tasks.models.variants import load_variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="a model folder, embedded, or llama-1b")
    parser.add_argument("--corpus", default="embedded")
    parser.add_argument("--methods", nargs="+", default=["baseline", "bnb-int8", "bnb-nf4"])
    parser.add_argument("--path", action="append", default=[], metavar="METHOD=FOLDER",
                        help="a pre-quantized checkpoint for a method (gptq=..., awq=...)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    paths = dict(item.split("=", 1) for item in args.path)
    torch.set_grad_enabled(False)

    model_dir = args.model
    if args.model == "llama-1b":
        from peers import llama_shaped  # the sibling script: its folder is on sys.path when this runs as a script

        model_dir = tempfile.mkdtemp(prefix="llama-1b-")
        llama_shaped("llama-1b", torch.bfloat16, torch.device("cpu")).save_pretrained(model_dir)
        load_tokenizer("embedded").save_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    stream = tokenize(corpus_text(CorpusConfig(source=args.corpus)), tokenizer, bos="none", max_tokens=args.max_tokens)

    rows = []
    for method in args.methods:
        spec = VariantSpec(name=method, method=method, path=paths.get(method), device=str(device),
                           dtype=str(dtype).removeprefix("torch."))
        model, facts = load_variant(spec, spec.path or model_dir)
        perplexity(model, stream, args.window, args.stride, args.batch_size)  # warm-up: kernels, autotuning
        result = perplexity(model, stream, args.window, args.stride, args.batch_size)
        rows.append({"method": method, "ppl": result.ppl, "tokens_per_second": result.tokens_per_second,
                     "weight_bytes": facts.weight_memory_bytes, "peak_bytes": result.peak_memory_bytes,
                     "backend": facts.backend, "device": result.device, "dtype": result.dtype,
                     "versions": facts.versions})
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{model_dir} on {device} ({machine}), {str(dtype).removeprefix('torch.')}, {result.n_tokens} scored "
          f"tokens, L={args.window} S={args.stride}, batch {args.batch_size}")
    print(f"{'method':<12}{'PPL':>12}{'vs baseline':>13}{'tok/s':>10}{'weights MiB':>13}  kernel")
    base = rows[0]["ppl"]
    for r in rows:
        print(f"{r['method']:<12}{r['ppl']:>12.5f}{100 * (r['ppl'] / base - 1):>12.2f}%{r['tokens_per_second']:>10.0f}"
              f"{r['weight_bytes'] / 2**20:>13.1f}  {r['backend']}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
