"""Where the eager engine's time goes against bare transformers forwards at one shape, and what closes the gap.

  python3 benchmarks/profile_body.py --model llama-1b --window 2048 --windows 32 --batch-size 8
  .venv/bin/python benchmarks/profile_body.py --model tiny --device cpu --window 256 --windows 8 --batch-size 4

Issue #57: on an H200 the eager engine ran at 0.85x bare forwards at the 1B shape (within 0.6% on an H100).
Three looks, on the same random model and tokens:
- ``profile``: one engine pass and the same windows' bare forwards under torch.profiler: wall seconds, the
  device's busy time (the union of its kernels' intervals) and so the host gaps, the time in copies, and the
  costliest kernels of each;
- ``split``: the engine's parts timed alone: the body (``base_model`` and the gather of scored rows), the head
  (``token_stats`` on those rows, by head chunk size), and the whole;
- ``variants``: whole engine passes with a larger head chunk and with the decoder layers compiled in other modes
  (``max-autotune-no-cudagraphs``; ``reduce-overhead``, CUDA graphs), each against the eager body's NLL.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from body import build, timed
from peers import bare_forwards, model_flops, peak_tflops, sync
from tasks.engine import perplexity as engine
from tasks.engine.layers import decoder_layers
from tasks.engine.perplexity import batch_inputs, hidden_states, perplexity, token_stats
from tasks.engine.scoring_options import Windowing
from tasks.engine.stream import TokenStream
from tasks.engine.windows import plan
from tasks.models.resolve import resolve_device, resolve_dtype


def busy_seconds(events) -> float:
    """The union of the device kernels' and copies' intervals, in seconds: how long the device was working."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy / 1e6


def profiled(device: torch.device, work, top: int) -> dict:
    """``work()`` under torch.profiler: wall and device-busy seconds, copy time, the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sync(device)
        started = time.perf_counter()
        work()
        sync(device)
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    costly = sorted(averages, key=lambda a: getattr(a, key), reverse=True)[:top]
    found = {"wall_seconds": wall, "kernels": [{"name": a.key[:90], "calls": a.count,
                                                 "ms": getattr(a, key) / 1e3} for a in costly]}
    if cuda:
        events = prof.events()
        busy = busy_seconds(events)
        copies = sum(a.self_device_time_total for a in averages if "memcpy" in a.key.lower()) / 1e6
        found |= {"device_busy_seconds": busy, "host_gap_seconds": wall - busy, "copy_seconds": copies}
    return found


def compiled(model, mode: str | None) -> None:
    for layer in decoder_layers(model):
        layer.compile(dynamic=False, mode=mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b", choices=["llama-1b", "llama-8b", "tiny"])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chunks-mib", type=int, nargs="*", default=[64, 256, 1024, 4096],
                        help="head chunk sizes to time (float32-equivalent MiB of logits)")
    parser.add_argument("--modes", nargs="*", default=["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
                        help="torch.compile modes for the decoder layers, each timed whole ('default': no mode)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    torch.set_grad_enabled(False)
    L, S, b = args.window, args.window // 2, args.batch_size
    model = build(args.model, dtype, device)
    ids = torch.randint(0, model.config.vocab_size, (L + (args.windows - 1) * S,),
                        generator=torch.Generator().manual_seed(0))
    stream = TokenStream(ids, (), "none", 0, 0, "random tokens")
    windows = plan(stream, L, S)
    scored = sum(w.n_scored for w in windows)
    flops, peak = model_flops(model, windows), peak_tflops(device, dtype, None)
    two = TokenStream(ids[: L + (2 * b - 1) * S], (), "none", 0, 0, "two batches")
    figures = {"model": args.model, "device": str(device), "window": L, "stride": S, "batch_size": b,
               "scored_tokens": scored, "peak_tflops": peak}

    def rate(seconds: float) -> dict:
        return {"tokens_per_second": scored / seconds, "mfu": flops / seconds / (peak * 1e12) if peak else None}

    # warm-up: kernels, cuBLAS handles, the compiled NLL
    bare_forwards(model, ids, windows[:b], b)
    perplexity(model, two, Windowing(L, S), b)
    figures["profile"] = {"bare_forwards": profiled(device, lambda: bare_forwards(model, ids, windows[: 2 * b], b), 12),
                          "engine": profiled(device, lambda: perplexity(model, two, Windowing(L, S), b), 12)}
    for name, part in figures["profile"].items():
        print(f"profile {name}: {json.dumps({k: v for k, v in part.items() if k != 'kernels'})}", flush=True)
        for k in part["kernels"]:
            print(f"  {k['ms']:9.2f} ms {k['calls']:5d}x {k['name']}", flush=True)

    _, seconds, _ = timed(device, lambda: bare_forwards(model, ids, windows, b), args.repeats)
    figures["bare_forwards"] = rate(seconds)
    eager, seconds, _ = timed(device, lambda: perplexity(model, stream, Windowing(L, S), b), args.repeats)
    figures["engine_eager"] = rate(seconds)

    # the parts alone: the body with its gather, then the head on one batch's scored rows
    batch = windows[:b]
    input_ids, mask, row_index, columns, targets = batch_inputs(ids, batch, torch.tensor([], dtype=torch.long))
    batches = len(windows) // b
    _, seconds, _ = timed(device, lambda: [hidden_states(model, input_ids, mask, row_index, columns)
                                          for _ in range(batches)], args.repeats)
    figures["body_only"] = rate(seconds)
    hidden = hidden_states(model, input_ids, mask, row_index, columns)
    target = targets.to(device)
    head = model.get_output_embeddings()
    figures["head_only"] = {}
    for mib in args.chunks_mib:
        _, seconds, _ = timed(device, lambda m=mib: [token_stats(head, hidden, target, chunk_bytes=m << 20)
                                                    for _ in range(batches)], args.repeats)
        figures["head_only"][mib] = rate(seconds) | {"seconds": seconds}
    print(f"bare {figures['bare_forwards']['tokens_per_second']:.0f} tok/s, engine "
          f"{figures['engine_eager']['tokens_per_second']:.0f}, body only {figures['body_only']['tokens_per_second']:.0f}"
          f", head only by chunk MiB {({m: round(r['seconds'], 4) for m, r in figures['head_only'].items()})} s",
          flush=True)

    figures["variants"] = {}
    default_chunk = engine.HEAD_CHUNK_BYTES[device.type] if device.type in engine.HEAD_CHUNK_BYTES else None
    for mib in args.chunks_mib:  # the whole engine with another head chunk (a process-wide knob: a benchmark)
        engine.HEAD_CHUNK_BYTES[device.type] = mib << 20
        result, seconds, peak_bytes = timed(device, lambda: perplexity(model, stream, Windowing(L, S), b), args.repeats)
        figures["variants"][f"eager, head chunk {mib} MiB"] = rate(seconds) | {
            "peak_bytes": peak_bytes, "mean_nll_rel_diff": abs(result.mean_nll - eager.mean_nll) / eager.mean_nll}
    if default_chunk is not None:
        engine.HEAD_CHUNK_BYTES[device.type] = default_chunk
    for mode in args.modes:
        model = None
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model = build(args.model, dtype, device)
        name = f"compile {mode}"
        try:
            compiled(model, None if mode == "default" else mode)
            started = time.perf_counter()
            perplexity(model, two, Windowing(L, S), b)
            perplexity(model, two, Windowing(L, S), b)  # CUDA graphs record on a later call than the first
            sync(device)
            warm = time.perf_counter() - started
            result, seconds, peak_bytes = timed(device, lambda m=model: perplexity(m, stream, Windowing(L, S), b),
                                                args.repeats)
        except Exception as error:  # one mode's failure is a finding; the others go on
            figures["variants"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        else:
            figures["variants"][name] = rate(seconds) | {
                "peak_bytes": peak_bytes, "first_batches_seconds": warm,
                "mean_nll_rel_diff": abs(result.mean_nll - eager.mean_nll) / eager.mean_nll}
        print(f"{name}: {figures['variants'][name]}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
