"""The engine's faster bodies (``tasks.engine.body``): scored tokens/s, MFU and peak memory of each, and its
NLL against the eager body's on the same weights and tokens; the HF loop and bare forwards for scale.

  python3 benchmarks/body.py --model llama-1b --window 2048 --stride 1024 --windows 48 --batch-size 8 \
      --bodies eager compile liger liger+compile --peers
  python3 benchmarks/body.py --model llama-1b --window 32768 --stride 16384 --windows 3 --batch-size 1 \
      --bodies eager compile                                  # long context: bounded memory
  python3 benchmarks/body.py --model llama-1b --bodies eager --formats gptq=.kit/models/gptq awq=.kit/models/awq
      # quantized kernels at that shape: a checkpoint in each kit checkpoint's format, random packed weights
  .venv/bin/python benchmarks/body.py --model tiny --device cpu --bodies eager compile --window 256 --stride 128

Random weights and a random token stream: speed, and agreement between bodies (the NLL means nothing). Every
window has length L (the stream is L + (windows - 1) S tokens) and ``--windows`` is a multiple of the batch, so
a compiled body sees one shape. Each body runs on a freshly built model with the same seed, in the order given;
liger replaces transformers' RoPE function for the whole process, so it comes after eager and compile. The
compile time (the first batch) is reported apart from the timed passes. The last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from peers import (bare_forwards, hf_documentation_loop, llama_shaped, model_flops, peak_tflops, random_llama, run_once,
                   sync)
from tasks.engine.body import BODIES, speed_up
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import Windowing
from tasks.engine.stream import TokenStream
from tasks.engine.windows import plan
from tasks.models.resolve import resolve_device, resolve_dtype

TINY = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)  # the CPU dry run's model


def build(name: str, dtype: torch.dtype, device: torch.device):
    if name == "tiny":
        return random_llama(dtype, device, **TINY)
    return llama_shaped(name, dtype, device)


def synthesize(like: Path, config, out: Path) -> None:
    """A checkpoint of ``config``'s shape in the format of the small checkpoint ``like`` (GPTQ, AWQ,
    compressed-tensors), with random packed weights: speed only. Each tensor of a decoder layer's Linear
    is (in K, out N) divided by 1, 8 or the group size along each axis, as in ``like``; ``g_idx`` and
    ``weight_shape`` hold what they describe, scales are small and positive, the rest random."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    small = json.loads((like / "config.json").read_text())
    quantization = {k: v for k, v in small["quantization_config"].items() if k != "meta"}
    group = quantization.get("group_size") or (quantization.get("weight_block_size") or [0])[0] or next(iter(quantization.get("config_groups", {}).values()),
                                                   {}).get("weights", {}).get("group_size") or 1

    def linear(config_dict: dict, name: str) -> tuple[int, int]:
        h, i = config_dict["hidden_size"], config_dict["intermediate_size"]
        kv = config_dict["num_key_value_heads"] * (config_dict.get("head_dim") or h // config_dict["num_attention_heads"])
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}[name]

    big = config.to_dict()
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    with safe_open(like / "model.safetensors", "pt") as f:
        for key in f.keys():
            parts = key.split(".")
            if not key.startswith("model.layers.0."):  # the embeddings, final norm and head are made below
                continue
            field, module = parts[-1], parts[-2]
            example = f.get_tensor(key)
            for layer in range(config.num_hidden_layers):
                name = ".".join(["model", "layers", str(layer), *parts[3:]])
                if not module.endswith("_proj"):
                    tensors[name] = torch.ones(config.hidden_size, dtype=example.dtype)  # a norm's weight
                    continue
                (k_small, n_small), (k, n) = linear(small, module), linear(big, module)
                if field == "g_idx":
                    tensors[name] = (torch.arange(k) // group).to(example.dtype)
                    continue
                if field == "weight_shape":
                    tensors[name] = torch.tensor([n, k], dtype=example.dtype)
                    continue
                shape = []
                for size in example.shape:
                    ratio = next((a for a in (1, 8, group) if size in (k_small // a, n_small // a)), None)
                    if ratio is None:  # 1: a per-channel or per-tensor scale's other axis
                        shape.append(size)
                        continue
                    shape.append(k // ratio if size == k_small // ratio else n // ratio)
                if example.dtype.is_floating_point:
                    tensors[name] = (torch.rand(shape, generator=generator) * 0.01 + 0.001).to(example.dtype)
                else:
                    bound = torch.iinfo(example.dtype)
                    tensors[name] = torch.randint(bound.min, bound.max, shape, generator=generator, dtype=example.dtype)
    tensors["model.embed_tokens.weight"] = torch.randn(config.vocab_size, config.hidden_size, generator=generator,
                                                       dtype=torch.float32).mul(0.02).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(config.hidden_size, dtype=torch.bfloat16)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(big | {"quantization_config": quantization, "dtype": "bfloat16"}))


def quantized_row(shape: str, like: Path, kernel: str | None, stream: TokenStream, flops: float, peak: float | None,
                  device: torch.device, dtype: torch.dtype, L: int, S: int, b: int, repeats: int) -> dict:
    """Load a synthesized checkpoint of ``shape`` in ``like``'s format as an audit loads a variant, and time it."""
    from tasks.config import VariantSpec
    from tasks.models.formats import detect
    from tasks.models.resolve import locate_model
    from tasks.models.variants import load_variant

    with tempfile.TemporaryDirectory(prefix="synthetic-") as folder:
        try:
            config = build(shape, dtype, torch.device("meta")).config
            synthesize(like, config, Path(folder))
            found = locate_model(folder)  # as an audit's lineup finds it, once
            spec = VariantSpec(name="synthetic", method=detect(found)[0], path=folder, device=str(device),
                               dtype=str(dtype).removeprefix("torch."), kernel=kernel)
            model, facts = load_variant(spec, found)
            first = TokenStream(stream.ids[: L + (b - 1) * S], (), "none", 0, 0, "random tokens")
            perplexity(model, first, Windowing(L, S), b)  # warm-up: kernels, autotuning
            result, seconds, peak_bytes = timed(device, lambda m=model: perplexity(m, stream, Windowing(L, S), b),
                                                repeats)
        except Exception as error:  # a kernel that fails here is a finding; the other formats go on
            return {"error": f"{type(error).__name__}: {str(error)[:400]}"}
    row = {"tokens_per_second": result.n_tokens / seconds, "peak_bytes": peak_bytes, "kernel": facts.backend,
           "weight_bytes": facts.weight_memory_bytes, "mfu": flops / seconds / (peak * 1e12) if peak else None}
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def timed(device: torch.device, work, repeats: int):
    """The result of ``work()``, its best seconds over ``repeats`` runs and the highest peak memory of them."""
    runs = [run_once(device, work) for _ in range(repeats)]
    return runs[-1][0], min(seconds for _, seconds, _ in runs), max(peak for _, _, peak in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", choices=["llama-1b", "llama-8b", "tiny"])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--stride", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--bodies", nargs="*", default=list(BODIES), choices=BODIES)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peers", action="store_true", help="also the HF loop (batch 1) and bare forwards")
    parser.add_argument("--formats", nargs="*", default=[], metavar="NAME=KIT_CHECKPOINT[:KERNEL]",
                        help="also score a checkpoint of this shape in each one's format (random weights)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.windows % args.batch_size:
        parser.error("--windows must be a multiple of --batch-size (one shape for a compiled body)")
    device = resolve_device(args.device)
    torch_dtype = resolve_dtype(args.dtype, device)
    torch.set_grad_enabled(False)
    L, S, b = args.window, args.stride, args.batch_size
    model = build(args.model, torch_dtype, device)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (L + (args.windows - 1) * S,), generator=torch.Generator().manual_seed(0))
    stream = TokenStream(ids, (), "none", 0, 0, "random tokens")
    first = TokenStream(ids[: L + (b - 1) * S], (), "none", 0, 0, "random tokens")  # one batch: compiles
    windows = plan(stream, L, S)
    flops, peak = model_flops(model, windows), peak_tflops(device, torch_dtype, None)
    figures = {"model": args.model, "device": str(device), "dtype": str(torch_dtype), "window": L, "stride": S,
               "windows": len(windows), "batch_size": b, "scored_tokens": sum(w.n_scored for w in windows),
               "peak_tflops": peak, "bodies": {}}
    scored = figures["scored_tokens"]
    if args.peers:
        bare_forwards(model, ids, windows[:b], b)  # warm-up: kernels, handles
        hf_documentation_loop(model, ids[: L + S], L, S)
        _, seconds, peak_bytes = timed(device, lambda: hf_documentation_loop(model, ids, L, S), 1)
        figures["hf_loop"] = {"tokens_per_second": scored / seconds, "peak_bytes": peak_bytes}
        _, seconds, peak_bytes = timed(device, lambda: bare_forwards(model, ids, windows, b), args.repeats)
        figures["bare_forwards"] = {"tokens_per_second": scored / seconds, "peak_bytes": peak_bytes,
                                    "mfu": flops / seconds / (peak * 1e12) if peak else None}
        print(f"peers: HF loop {figures['hf_loop']['tokens_per_second']:.0f} tok/s, bare forwards "
              f"{figures['bare_forwards']['tokens_per_second']:.0f} tok/s", flush=True)
    eager = None
    for body in args.bodies:
        if model is None:
            model = build(args.model, torch_dtype, device)
        try:
            speed_up(model, body)
            started = time.perf_counter()
            perplexity(model, first, Windowing(L, S), b)
            sync(device)
            warm = time.perf_counter() - started
            result, seconds, peak_bytes = timed(device, lambda m=model: perplexity(m, stream, Windowing(L, S), b),
                                                args.repeats)
        except Exception as error:  # one body's failure is a finding; the others go on
            figures["bodies"][body] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            print(f"{body}: {figures['bodies'][body]['error']}", flush=True)
        else:
            row = {"tokens_per_second": result.n_tokens / seconds, "first_batch_seconds": warm,
                   "peak_bytes": peak_bytes, "mean_nll": result.mean_nll,
                   "mfu": flops / seconds / (peak * 1e12) if peak else None}
            if eager is None:
                eager = result
            row["mean_nll_rel_diff"] = abs(result.mean_nll - eager.mean_nll) / eager.mean_nll
            row["token_nll_mean_abs_diff"] = float(abs(torch.from_numpy(result.token_nll)
                                                       - torch.from_numpy(eager.token_nll)).mean())
            figures["bodies"][body] = row
            mfu = f", MFU {100 * row['mfu']:.1f}%" if row["mfu"] else ""
            print(f"{body}: {row['tokens_per_second']:.0f} tok/s{mfu}, peak {peak_bytes / 2**20:.0f} MiB, first "
                  f"batch {warm:.1f} s, mean NLL vs eager {row['mean_nll_rel_diff']:.1e}", flush=True)
        model = None
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    figures["formats"] = {}
    for entry in args.formats:
        name, _, where = entry.partition("=")
        like, _, kernel = where.partition(":")
        figures["formats"][name] = row = quantized_row(args.model, Path(like), kernel or None, stream, flops, peak,
                                                      device, torch_dtype, L, S, b, args.repeats)
        said = row.get("error") or f"{row['tokens_per_second']:.0f} tok/s, {row['kernel']}"
        print(f"{name}: {said}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
