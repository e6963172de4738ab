"""Our engine against its peers, same model, same text, one process: scored tokens/s, peak memory, PPL.

  .venv/bin/python benchmarks/peers.py                     # CPU: the embedded model, L=512, S=256
  .venv/bin/python benchmarks/peers.py --model llama-1b --window 2048 --stride 1024 --windows 48 \
      --batch-sizes 4 8 16                                 # GPU: a 1B-class Llama, bf16, with MFU
  ... --model llama-8b --batch-sizes 2 4 8 --profile $OUT/profile.txt   # an 8B-class Llama, profiled

Two comparisons, each method on the same windows, at each batch size (the HF loop at 1), compared each
at its best; ``--repeats`` rounds over all methods keep each one's fastest time:
- sliding window (L, S): the strided loop of https://huggingface.co/docs/transformers/perplexity
  (batch 1: full logits for every position, loss from ``labels``), our engine, and bare forward passes
  of our windows (``model(..., logits_to_keep=scored)``: the floor). The stream is cut to L + kS tokens
  so that the loop sees our windows; it then differs from us only by weighing each window's mean loss
  with (scored - 1).
- disjoint windows: lm-evaluation-harness ``loglikelihood_rolling`` on the text as one document with
  ``max_length`` L (each window predicts L tokens, the first from BOS), against our engine in the same
  convention (``bos: stream``, window L + 1, stride L): the same tokens and contexts.
``--model llama-1b`` / ``llama-8b`` build a Llama-3.2-1B- / Llama-3-8B-shaped model from a config (random
weights: speed only) with the embedded tokenizer. MFU is the model FLOPs the windows need (2 x body parameters per input token,
causal attention 2 x layers x width x T^2 per window of T tokens, the head on scored tokens only) per
second over the device's dense bf16/fp16 peak (known GPUs, or ``--peak-tflops``). Peak memory is the
peak CUDA allocation on a GPU and the process's peak RSS on CPU; the engine's is held against its target,
1.2 x weights + one batch's activations (the body's forward pass alone at that batch size, measured).
``--profile FILE`` writes torch.profiler's table of the engine's costliest operators at its best batch size.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch

from tasks.config import CorpusConfig
from tasks.data.corpus import corpus_text, tokenize
from tasks.engine.memory import PeakMemory
from tasks.engine.perplexity import batch_inputs, perplexity
from tasks.engine.scoring_options import Windowing
from tasks.engine.windows import Window, plan
from tasks.models.loading import load_model
from tasks.models.resolve import load_tokenizer, resolve_device, resolve_dtype

METHODS = ("HF documentation loop", "ppl-audit engine", "bare forward passes", "lm-eval rolling",
           "ppl-audit, lm-eval's windows")
PEAK_TFLOPS_16BIT = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


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


def lm_eval_rolling(model, tokenizer, text: str, max_length: int, batch_size: int) -> tuple[float, int]:
    """lm-evaluation-harness's rolling log-likelihood of ``text`` as one document: (NLL sum, tokens)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
              device=str(model.device), add_bos_token=False)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (log_likelihood,) = lm.loglikelihood_rolling([request], disable_tqdm=True)
    return -log_likelihood, len(tokenizer(text, add_special_tokens=False).input_ids)


@torch.inference_mode()
def bare_forwards(model, ids: torch.Tensor, windows: list[Window], batch_size: int) -> None:
    """The forward passes our engine makes, logits for the scored positions only, and nothing else."""
    for b in range(0, len(windows), batch_size):
        batch = windows[b : b + batch_size]
        input_ids, mask, *_ = batch_inputs(ids, batch, torch.tensor([], dtype=torch.long))
        model(input_ids=input_ids.to(model.device), attention_mask=None if mask is None else mask.to(model.device),
              use_cache=False, logits_to_keep=max(w.n_scored for w in batch))


def model_flops(model, windows: list[Window]) -> float:
    """FLOPs the forward passes over ``windows`` need: matmuls of the body, causal attention, the head."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in model.base_model.parameters()) - embedding
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    head = model.get_output_embeddings().weight.numel()
    flops = 0.0
    for w in windows:
        t = w.end - w.start
        flops += 2 * body * t + 2 * config.num_hidden_layers * width * t * (t + 1) + 2 * head * w.n_scored
    return flops


def peak_tflops(device: torch.device, dtype: torch.dtype, given: float | None) -> float | None:
    if given or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return given
    name = torch.cuda.get_device_name(device)
    return next((tflops for key, tflops in PEAK_TFLOPS_16BIT.items() if key in name), None)


def random_llama(dtype: torch.dtype, device: torch.device, **shape):
    """A Llama of the given shape (``LlamaConfig`` fields) with seeded random weights, built on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


LLAMA_SHAPES = {  # the published configs' shapes; vocabulary 128,256 and rope theta 500k in both
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=131_072, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False),
}


def llama_shaped(name: str, dtype: torch.dtype, device: torch.device):
    """Llama-3.2-1B (1.24B parameters, tied head) or Llama-3-8B (8.03B) by shape, random weights."""
    model = random_llama(dtype, device, vocab_size=128_256, rope_theta=500_000.0, **LLAMA_SHAPES[name])
    model.name_or_path = f"{name} (from config, random weights)"
    return model


def activation_bytes(model, ids: torch.Tensor, windows: list[Window]) -> int:
    """Peak memory of the body's forward pass over one batch of ``windows``, above what was in use before."""
    device = model.device
    input_ids, mask, *_ = batch_inputs(ids, windows, torch.tensor([], dtype=torch.long))
    with PeakMemory(device) as before:
        pass
    with PeakMemory(device) as during, torch.inference_mode():
        model.base_model(input_ids=input_ids.to(device), attention_mask=None if mask is None else mask.to(device),
                         use_cache=False)
    return during.peak_bytes - before.peak_bytes


def profile_engine(model, stream, window: int, stride: int, batch_size: int, path: str) -> None:
    """One engine pass under torch.profiler: the 25 costliest operators by device (or CPU) time, to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        perplexity(model, stream, Windowing(window, stride), batch_size)
    key = "cuda_time_total" if model.device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    with open(path, "w") as out:
        out.write(table)
    print(table)


def run_once(device: torch.device, work):
    """``work()``'s result, its seconds, and the peak memory while it ran."""
    with PeakMemory(device) as memory:
        sync(device)
        started = time.perf_counter()
        out = work()
        sync(device)
        seconds = time.perf_counter() - started
    return out, seconds, memory.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded",
                        help=f"embedded, a model folder, a Hub id, or {' or '.join(LLAMA_SHAPES)}")
    parser.add_argument("--corpus", default="embedded")
    parser.add_argument("--tokenizer", help="for a model built from a shape (default: the embedded model's); a GPU "
                                            "machine has no embedded model: the kit's tokenizer and corpus serve")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--windows", type=int, default=32, help="stream length is L + (windows - 1) * S")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over all methods, interleaved; each keeps its fastest time")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU (known GPUs need none)")
    parser.add_argument("--profile", metavar="FILE", help="write a torch.profiler table of the engine here")
    args = parser.parse_args()

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    torch.set_grad_enabled(False)
    shaped = args.model in LLAMA_SHAPES
    tokenizer = load_tokenizer(args.tokenizer or ("embedded" if shaped else args.model))
    model = llama_shaped(args.model, dtype, device) if shaped else load_model(args.model, dtype, device)
    L, S = args.window, args.stride
    stream = tokenize(corpus_text(CorpusConfig(source=args.corpus)), tokenizer, bos="none",
                      max_tokens=L + (args.windows - 1) * S)
    text = tokenizer.decode(stream.ids)
    disjoint_stream = tokenize(text, tokenizer, bos="stream")
    sliding, disjoint = plan(stream, L, S), plan(disjoint_stream, L + 1, L)

    def engine(on, window: int, stride: int, batch_size: int) -> tuple[float, int]:
        result = perplexity(model, on, Windowing(window, stride), batch_size)
        return result.nll_sum, result.n_tokens

    methods = {("HF documentation loop", 1): (lambda: hf_documentation_loop(model, stream.ids, L, S), sliding)}
    for b in args.batch_sizes:
        methods |= {
            ("ppl-audit engine", b): (lambda b=b: engine(stream, L, S, b), sliding),
            ("bare forward passes", b): (lambda b=b: bare_forwards(model, stream.ids, sliding, b), sliding),
            ("lm-eval rolling", b): (lambda b=b: lm_eval_rolling(model, tokenizer, text, L, b), disjoint),
            ("ppl-audit, lm-eval's windows", b): (lambda b=b: engine(disjoint_stream, L + 1, L, b), disjoint),
        }
    bare_forwards(model, stream.ids, sliding[:2], 1)  # warm-up
    measured: dict[tuple[str, int], tuple] = {}
    for _ in range(args.repeats):  # rounds, so that a slow spell of the machine hits every method alike
        for key, (work, _) in methods.items():
            out, seconds, peak_bytes = run_once(device, work)
            if key in measured:
                seconds, peak_bytes = min(seconds, measured[key][1]), max(peak_bytes, measured[key][2])
            measured[key] = (out, seconds, peak_bytes)

    peak = peak_tflops(device, dtype, args.peak_tflops)
    rows = []
    for (method, batch_size), (nll_tokens, seconds, peak_bytes) in sorted(
            measured.items(), key=lambda item: (METHODS.index(item[0][0]), item[0][1])):
        windows = methods[method, batch_size][1]
        nll_sum, n_tokens = nll_tokens or (float("nan"), sum(w.n_scored for w in windows))
        rows.append({"method": method, "batch_size": batch_size, "ppl": math.exp(nll_sum / n_tokens),
                     "tokens_per_second": n_tokens / seconds, "peak_bytes": peak_bytes,
                     "mfu": model_flops(model, windows) / seconds / (peak * 1e12) if peak else None})
    best = {}
    for r in rows:
        if r["method"] not in best or r["tokens_per_second"] > best[r["method"]]["tokens_per_second"]:
            best[r["method"]] = r
    hf, ours, bare = best["HF documentation loop"], best["ppl-audit engine"], best["bare forward passes"]
    lm_eval, ours_disjoint = best["lm-eval rolling"], best["ppl-audit, lm-eval's windows"]

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    activations = activation_bytes(model, stream.ids, sliding[: ours["batch_size"]])
    peak_target = 1.2 * weights + activations
    if args.profile:
        profile_engine(model, stream, L, S, ours["batch_size"], args.profile)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"\nmodel {model.name_or_path}, {stream.ids.numel()} tokens, L={L} S={S}, "
          f"{str(dtype).removeprefix('torch.')} on {device} ({machine}), torch {torch.__version__}, "
          f"weights {weights / 2**20:.0f} MiB, best of {args.repeats}")
    print(f"{'method':<30}{'batch':>6}{'PPL':>14}{'scored tok/s':>14}{'peak MiB':>10}{'MFU':>8}")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{r['method']:<30}{r['batch_size']:>6}{r['ppl']:>14.5f}{r['tokens_per_second']:>14.1f}"
              f"{r['peak_bytes'] / 2**20:>10.0f}{mfu:>8}")
    figures = {
        "device": str(device), "machine": machine, "dtype": str(dtype), "tokens": int(stream.ids.numel()),
        "window": L, "stride": S, "best_batch_size": ours["batch_size"], "weights_bytes": weights,
        "speedup_vs_hf_loop": ours["tokens_per_second"] / hf["tokens_per_second"],
        "speedup_vs_lm_eval": ours_disjoint["tokens_per_second"] / lm_eval["tokens_per_second"],
        "overhead_vs_bare_forward": bare["tokens_per_second"] / ours["tokens_per_second"] - 1,
        "ppl_difference_vs_hf_loop": abs(ours["ppl"] - hf["ppl"]) / hf["ppl"],
        "ppl_difference_vs_lm_eval": abs(ours_disjoint["ppl"] - lm_eval["ppl"]) / lm_eval["ppl"],
        "mfu": ours["mfu"], "engine_peak_bytes": ours["peak_bytes"], "activation_bytes": activations,
        "peak_target_bytes": peak_target, "rows": rows,
    }
    print(f"each at its best batch size: {figures['speedup_vs_hf_loop']:.2f}x the HF loop, "
          f"{figures['speedup_vs_lm_eval']:.2f}x lm-eval; overhead over bare forwards "
          f"{100 * figures['overhead_vs_bare_forward']:+.1f}%; PPL relative difference "
          f"{figures['ppl_difference_vs_hf_loop']:.1e} (HF loop), {figures['ppl_difference_vs_lm_eval']:.1e} (lm-eval)")
    print(f"engine peak {ours['peak_bytes'] / 2**20:.0f} MiB against its target {peak_target / 2**20:.0f} MiB "
          f"(1.2 x weights {weights / 2**20:.0f} + one batch's activations {activations / 2**20:.0f})")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
