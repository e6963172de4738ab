"""Quantized variants through ppl-audit's own loading and engine: perplexity, scored tokens/s, weight memory.

  .venv/bin/python benchmarks/quantized.py --model MODEL [--methods baseline bnb-int8 bnb-nf4] [--device cuda]
  ... --methods baseline gptq gptq-triton=gptq:triton --path gptq=Q --path gptq-triton=Q
  ... --methods baseline kv-int8=baseline+kv:int8 kv-fp8=baseline+kv:fp8_e4m3   # the key/value cache's types

Each method loads the way an audit loads it (``tasks.models.variants.load_variant``: bitsandbytes quantizes the
baseline at load; ``gptq``/``awq`` need ``--path`` to a checkpoint made by gptqmodel) and scores the same
stream with a sliding window. ``NAME=METHOD[:KERNEL][+kv:DTYPE]`` names a variant of a method (with gptqmodel's
kernel for a gptq/awq checkpoint, and a quantized key/value cache, ``kv_cache.dtype``); ``--path`` is given by name. A method that fails to load or score gets its error in its
row, and the others go on. Run it on CPU and on a GPU with the same model: the two PPLs of a method
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

from tasks.config import CorpusConfig, KVCache, VariantSpec
from tasks.data.corpus import corpus_text, tokenize
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.models.resolve import load_tokenizer, resolve_device, resolve_dtype
from tasks.models.variants import cache_format, load_variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="a model folder, embedded, or llama-1b")
    parser.add_argument("--corpus", default="embedded")
    parser.add_argument("--methods", nargs="+", default=["baseline", "bnb-int8", "bnb-nf4"],
                        metavar="METHOD | NAME=METHOD[:KERNEL][+kv:DTYPE]")
    parser.add_argument("--path", action="append", default=[], metavar="NAME=FOLDER",
                        help="a pre-quantized checkpoint for a method or named variant (gptq=..., awq=...)")
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
    for entry in args.methods:
        name, _, how = entry.partition("=")
        how, _, cache = (how or name).partition("+kv:")
        method, _, kernel = how.partition(":")
        spec = VariantSpec(name=name, method=method, path=paths.get(name), device=str(device),
                           dtype=str(dtype).removeprefix("torch."), kernel=kernel or None,
                           kv_cache=KVCache(dtype=cache) if cache else None)
        try:
            model, facts = load_variant(spec, spec.path or model_dir)
            options = ScoreOptions(kv_cache=cache_format(spec))
            perplexity(model, stream, Windowing(args.window, args.stride), args.batch_size, options)  # warm-up: kernels
            result = perplexity(model, stream, Windowing(args.window, args.stride), args.batch_size, options)
        except Exception as error:  # one method's failure is a finding, not the end of the others
            rows.append({"method": name, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            print(f"{name}: {rows[-1]['error']}", flush=True)
            continue
        rows.append({"method": name, "ppl": result.ppl, "tokens_per_second": result.tokens_per_second,
                     "weight_bytes": facts.weight_memory_bytes, "peak_bytes": result.peak_memory_bytes,
                     "backend": facts.backend, "device": result.device, "dtype": result.dtype,
                     "bits_per_weight": facts.bits_per_weight, "versions": facts.versions})
        print(f"{name}: PPL {result.ppl:.5f}, {result.tokens_per_second:.0f} tok/s, {facts.backend}", flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{model_dir} on {device} ({machine}), {str(dtype).removeprefix('torch.')}, {stream.ids.numel()} tokens, "
          f"L={args.window} S={args.stride}, batch {args.batch_size}")
    print(f"{'method':<16}{'PPL':>12}{'vs baseline':>13}{'tok/s':>10}{'weights MiB':>13}  kernel")
    base = rows[0].get("ppl", float("nan"))
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<16}  failed: {r['error']}")
            continue
        print(f"{r['method']:<16}{r['ppl']:>12.5f}{100 * (r['ppl'] / base - 1):>12.2f}%{r['tokens_per_second']:>10.0f}"
              f"{r['weight_bytes'] / 2**20:>13.1f}  {r['backend']}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
