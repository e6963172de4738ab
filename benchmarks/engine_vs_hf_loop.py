"""Our engine against the Hugging Face documentation's strided loop and against bare forward passes.

Same model, same text, same window and stride, one process. Prints a table and a JSON line.
  .venv/bin/python benchmarks/engine_vs_hf_loop.py [--windows 32] [--batch-sizes 1 2 4 8] [--device cpu]

- HF loop: the loop of https://huggingface.co/docs/transformers/perplexity, batch 1: full logits for
  every window position, loss from ``labels``. The stream is cut to L + kS tokens so that both
  methods see the same windows; the documented loop then differs from ours only by weighing each
  window's mean loss with (scored - 1), which moves PPL by well under 1e-4 here.
- bare forward: the same windows and batches as our engine at its best batch size, through
  ``model(input_ids, logits_to_keep=...)`` for the scored positions and nothing else: the floor.
Peak memory is the process's peak RSS while each method runs (CPU) or peak CUDA allocation (GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

from tasks.corpus import CorpusSpec, corpus_text, tokenize
from tasks.memory import PeakMemory
from tasks.models import load_model, load_tokenizer, resolve_device, resolve_dtype
from tasks.perplexity import _batch_inputs, perplexity, plan_windows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_documentation_loop(model, ids: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """The documented strided loop, as written there (batch 1)."""
    encodings = ids[None, :]
    seq_len = encodings.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + window, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc].to(model.device)
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        outputs = model(input_ids, labels=target_ids)
        neg_log_likelihood = outputs.loss
        num_valid_tokens = (target_ids != -100).sum().item()
        num_loss_tokens = num_valid_tokens - target_ids.size(0)
        nll_sum += neg_log_likelihood.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


@torch.inference_mode()
def bare_forwards(model, ids: torch.Tensor, window: int, stride: int, batch_size: int) -> int:
    windows = plan_windows(len(ids), window, stride)
    for b in range(0, len(windows), batch_size):
        batch = windows[b : b + batch_size]
        input_ids, mask, *_ = _batch_inputs(ids, batch, torch.tensor([], dtype=torch.long))
        model(input_ids=input_ids.to(model.device), attention_mask=None if mask is None else mask.to(model.device),
              use_cache=False, logits_to_keep=max(w.n_scored for w in batch))
    return sum(w.n_scored for w in windows)


def timed(device, work):
    with PeakMemory(device) as memory:
        sync(device)
        started = time.perf_counter()
        out = work()
        sync(device)
        seconds = time.perf_counter() - started
    return out, seconds, memory.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--corpus", default="embedded")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--windows", type=int, default=32, help="stream length is L + (windows - 1) * S")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.set_grad_enabled(False)
    tokenizer = load_tokenizer(args.model)
    n = args.window + (args.windows - 1) * args.stride
    stream = tokenize(corpus_text(CorpusSpec(args.corpus)), tokenizer, bos="none", max_tokens=n)
    model = load_model(args.model, dtype, device)
    bare_forwards(model, stream.ids[: args.window * 2], args.window, args.stride, 1)  # warm-up

    (hf_nll, hf_tokens), hf_seconds, hf_peak = timed(
        device, lambda: hf_documentation_loop(model, stream.ids, args.window, args.stride))
    rows = [("HF documentation loop", 1, math.exp(hf_nll / hf_tokens), hf_tokens / hf_seconds, hf_peak)]
    ours = {}
    for batch_size in args.batch_sizes:
        result = perplexity(model, stream, args.window, args.stride, batch_size)
        ours[batch_size] = result
        rows.append(("ppl-audit engine", batch_size, result.ppl, result.tokens_per_second, result.peak_memory_bytes))
    best = max(ours.values(), key=lambda r: r.tokens_per_second)
    scored, bare_seconds, bare_peak = timed(
        device, lambda: bare_forwards(model, stream.ids, args.window, args.stride, best.batch_size))
    rows.append(("bare forward passes", best.batch_size, float("nan"), scored / bare_seconds, bare_peak))

    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"\nmodel {args.model}, {stream.ids.numel()} tokens, L={args.window} S={args.stride}, "
          f"{str(dtype).removeprefix('torch.')} on {device} ({machine}), torch {torch.__version__}")
    print(f"{'method':<24}{'batch':>6}{'PPL':>12}{'scored tok/s':>14}{'peak MiB':>10}")
    for name, batch_size, ppl, speed, peak in rows:
        print(f"{name:<24}{batch_size:>6}{ppl:>12.5f}{speed:>14.1f}{peak / 2**20:>10.0f}")
    figures = {
        "device": str(device), "machine": machine, "dtype": str(dtype), "tokens": int(stream.ids.numel()),
        "window": args.window, "stride": args.stride, "best_batch_size": best.batch_size,
        "ppl_ours": best.ppl, "ppl_hf_loop": rows[0][2],
        "ppl_relative_difference": abs(best.ppl - rows[0][2]) / rows[0][2],
        "speedup_vs_hf_loop": best.tokens_per_second / rows[0][3],
        "overhead_vs_bare_forward": (scored / bare_seconds) / best.tokens_per_second - 1,
        "peak_bytes_ours": best.peak_memory_bytes, "peak_bytes_hf_loop": hf_peak,
    }
    print(f"speed-up vs HF loop {figures['speedup_vs_hf_loop']:.2f}x, overhead vs bare forwards "
          f"{100 * figures['overhead_vs_bare_forward']:+.1f}%, PPL relative difference "
          f"{figures['ppl_relative_difference']:.1e}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
