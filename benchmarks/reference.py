"""A variant audited against the baseline's stored reference, against lockstep (both models on every batch).

  .venv/bin/python benchmarks/reference.py [--max-tokens 4096] [--device cpu|cuda] [--dtype auto]
  .venv/bin/python benchmarks/reference.py --baseline FOLDER --variant-method torchao-int8 --corpus FILE

The baseline (default: the embedded SmolLM2-135M) and a variant of it (default: the same model quantized
at load with torchao int8 weight-only) score the same stream with a sliding window. Four runs:
1. the baseline alone (``perplexity`` with no reference): one model's scoring time;
2. the baseline writing its reference (``keep_hidden=tasks.audit.reference.Writer``, published in a temporary
   ``$PPL_AUDIT_REFERENCES``), as an audit's first run does: time and size on disk, against llama.cpp's
   ``--kl-divergence-base`` file (2 bytes x vocabulary per token: uint16 log-probabilities);
3. the variant with the stored reference (``Reference.baseline``: the baseline's head and its stored
   hidden states, no baseline model), as an audit scores a variant now;
4. the variant in lockstep, the way before the reference: the baseline model loaded beside the variant
   and run on every batch (a ``Baseline`` whose ``states`` is the baseline's forward pass).
Forward passes are counted by a hook on each loaded model's ``base_model``; (3) should run one per batch,
(4) two. KL, reverse KL and top-1 of (3) and (4) are compared token by token: the same baseline hidden
states through the same head should give the same numbers.

Targets (from the issue): (3) takes at most 1.15 x one model's scoring time, the variant's own (3': a
quantized kernel can be slower than the baseline's, so (1) is printed beside it; lockstep takes about 2 x); (3)'s peak
memory is at most one model + one LM head + one batch; (3)'s KL equals (4)'s within 1e-6 relative.

Time is ``perplexity``'s own wall time (loading not counted), the fastest of ``--repeats``: on a shared
machine other work slows single runs, never speeds them. (3') is the variant with no reference, timed in
(3)'s process after it.

Memory. (1) and (2) run first in this process, (3) and (4) each in a fresh one, so that memory one run
freed cannot hide the next one's; each after a warm-up on the first tokens (it pages in the weights
``from_pretrained`` maps from the checkpoint). ``PeakMemory`` is the peak CUDA allocation on a GPU and the
process's peak RSS on CPU, which also holds the Python and torch runtime (a few hundred MiB with any
model); each figure is therefore taken over what the process held before it loaded any model, after
giving back what nothing holds (``malloc_trim``). (3) is held against
- one model: what the variant holds once loaded and warmed, measured (its weight bytes are printed beside
  it: on CPU the RSS is larger, as loading a torchao variant leaves the float32 checkpoint mapped, with
  the pages quantizing read still resident);
- one LM head: the baseline head's bytes;
- one batch: what scoring one batch of this variant with its exact KL took over what was resident before,
  in lockstep (4): the activations and the KL's chunk-sized log-probability arrays, which any exact KL
  needs (the baseline alone, (1), grows by less: it keeps no log-probabilities).
So the check passes when the reference adds no more than its head and the stored rows it reads: no second
model, and no more working memory than lockstep's. On CPU it allows 5% of the budget more: the RSS of the
same work moves by some tens of MiB from process to process (malloc arenas); CUDA's is exact. Rows of
``hidden.bin`` (a memory map) count in RSS as they are read: a small part here (the file's size is
printed), but it grows with the corpus.

The last line is every figure as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import torch

from tasks.audit.reference import REFERENCE_FORMAT, Identity, Reference, Writer, building, stream_digest
from tasks.config import CorpusConfig, EvaluationConfig, VariantSpec
from tasks.data.corpus import corpus_text
from tasks.data.evaluation import evaluation
from tasks.engine.baseline import Baseline
from tasks.engine.perplexity import (
    PerplexityResult,
    divergence_kernel,
    hidden_states,
    perplexity,
    scored_targets,
)
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.engine.stream import TokenStream
from tasks.models.resolve import load_config, load_tokenizer, resolve_device, resolve_dtype, resolve_model_path
from tasks.models.variants import load_variant

STEPS = ("reference", "lockstep")  # run in processes of their own; the baseline's runs come first, in this one
TIME_TARGET, KL_TARGET = 1.15, 1e-6
RSS_SLACK = 0.05  # of the memory budget on CPU: RSS of the same work varies by tens of MiB (malloc arenas)
PER_TOKEN = ("token_nll", "kl", "kl_reverse", "top1")  # saved by (3) and (4) for the comparison
WARM_UP_TOKENS = 64


def settle(device: torch.device) -> None:
    """Free what nothing holds and, on glibc, give freed heap back to the system: RSS then shows what is
    in use, not what loading a model (torchao's float32 copy before quantizing, say) left behind."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def in_use(device: torch.device) -> int:
    """Memory in use now, as ``PeakMemory`` counts it: CUDA allocations, or the process's RSS on CPU."""
    settle(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def count_forwards(*models) -> list[int]:
    """A one-item list counting forward passes of the models' bodies (``base_model``), all together."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for model in models:
        model.base_model.register_forward_hook(hook)
    return calls


def lockstep(base_model) -> Baseline:
    """The baseline as audits met it before the reference: the whole model, run on each batch's inputs."""
    return Baseline(base_model.get_output_embeddings(), getattr(base_model.config, "final_logit_softcapping", None),
                    lambda slots, inputs: hidden_states(base_model, *inputs[:4]))


def spec(args: argparse.Namespace, name: str, method: str, path: str | None = None) -> VariantSpec:
    return VariantSpec(name=name, method=method, path=path, device=args.device, dtype=args.dtype)


def token_stream(args: argparse.Namespace, source: str) -> TokenStream:
    settings = EvaluationConfig(window=args.window, stride=args.stride, batch_size=args.batch_size,
                                max_tokens=args.max_tokens)
    return evaluation(corpus_text(CorpusConfig(source=args.corpus)), load_tokenizer(source), settings).stream


def first_tokens(stream: TokenStream, args: argparse.Namespace) -> TokenStream:
    """The stream's first tokens, for a warm-up: the same slots and rows as the full stream's first ones."""
    return dataclasses.replace(stream, ids=stream.ids[: min(WARM_UP_TOKENS, args.window - len(stream.prefix))])


def score(model, stream: TokenStream, args: argparse.Namespace, forwards: list[int],
          **options) -> tuple[PerplexityResult, dict]:
    """A measured run (the fastest of ``--repeats``, the highest peak), after a warm-up on the first tokens
    (kernels, and the weights that are mapped from the checkpoint paged in)."""
    perplexity(model, first_tokens(stream, args), Windowing(args.window, args.stride), options=ScoreOptions(**options))
    before = in_use(model.device)
    walls, peaks = [], []
    for _ in range(args.repeats):
        forwards[0] = 0
        result = perplexity(model, stream, Windowing(args.window, args.stride), args.batch_size,
                            ScoreOptions(**options))
        walls.append(result.wall_seconds)
        peaks.append(result.peak_memory_bytes)
    return result, {"wall_seconds": min(walls), "forward_passes": forwards[0], "peak_bytes": max(peaks),
                    "before_scoring_bytes": before, "scoring_growth_bytes": max(peaks) - before}


def warm_divergence(device: torch.device, source: str, stream: TokenStream) -> None:
    """The divergence's kernel made before anything is measured (compiled, for a long stream): compiled code is
    runtime, like torch's own, in neither model's figure."""
    divergence_kernel(device.type, len(stream.ids) * load_config(source).get_text_config().vocab_size)


def run_baseline(args: argparse.Namespace, source: str, stream: TokenStream) -> dict:
    """(1) the baseline alone, then (2) the baseline writing its reference."""
    device = resolve_device(args.device)
    warm_divergence(device, source, stream)
    runtime = in_use(device)
    model, facts = load_variant(spec(args, "baseline", "baseline"), source)
    forwards = count_forwards(model)
    _, alone = score(model, stream, args, forwards)
    with building() as scratch:
        writer = Writer(scratch / "benchmark", scored_targets(stream, args.window, args.stride))
        writer.staging.mkdir()
        result, build = score(model, stream, args, forwards, keep_hidden=writer)
        # the warm-up wrote the first rows too; the measured run wrote them again, as a batch of its own
        # a whole identity (a reference lacking one is damaged, never opened): the benchmark's own stream and settings
        identity = Identity(format=REFERENCE_FORMAT, model="benchmark", tokenizer="benchmark", stream=stream_digest(stream),
                            mode="sliding", window=args.window, stride=args.stride, bos=stream.bos,
                            dtype=str(model.dtype).removeprefix("torch."))
        manifest = {"identity": identity.as_dict(), "environment": {}, "facts": {},
                    "source": source, "softcap": getattr(model.config, "final_logit_softcapping", None)}
        stored = writer.publish("benchmark", manifest, result, model.get_output_embeddings(), replace=True)
    files = {file.name: file.stat().st_size for file in stored.folder.iterdir() if file.is_file()}
    return {"alone": alone, "build": build, "runtime_bytes": runtime, "weight_bytes": facts.weight_memory_bytes,
            "reference": str(stored.folder), "reference_bytes": stored.size_bytes, "reference_files": files,
            "n_scored": writer.n_scored, "n_windows": result.n_windows, "vocab": model.config.get_text_config().vocab_size,
            "hidden_size": model.config.get_text_config().hidden_size, "ppl": result.ppl,
            "dtype": result.dtype, "device": result.device}


def run_variant(args: argparse.Namespace, source: str, stream: TokenStream, step: str, work: Path) -> dict:
    """(3) the variant with the stored reference, or (4) the variant in lockstep with the baseline model."""
    device = resolve_device(args.device)
    warm_divergence(device, source, stream)
    runtime = in_use(device)
    model, facts = load_variant(spec(args, "variant", args.variant_method, args.variant), args.variant or source)
    # pages in the weights it will read
    perplexity(model, first_tokens(stream, args), Windowing(args.window, args.stride))
    loaded = in_use(device)
    models = [model]
    if step == "reference":
        against = Reference.open(Path(args.reference_folder)).baseline(source, device)
    else:
        base, _ = load_variant(spec(args, "baseline", "baseline"), source)
        models.append(base)
        against = lockstep(base)
    # and once more against the baseline: the divergence kernel is compiled on its first use, not timed
    perplexity(model, first_tokens(stream, args), Windowing(args.window, args.stride),
               options=ScoreOptions(reference=against))
    head_bytes = sum(t.nbytes for t in against.head.parameters())
    forwards = count_forwards(*models)
    result, figures = score(model, stream, args, forwards, reference=against)
    np.savez(work / f"{step}.npz", token_nll=result.token_nll, **{k: result.extra[k] for k in PER_TOKEN[1:]})
    if step == "reference":  # after (3): its memory figures stay its own
        figures["variant_alone_seconds"] = score(model, stream, args, forwards)[1]["wall_seconds"]
    return {**figures, "runtime_bytes": runtime, "model_resident_bytes": loaded - runtime,
            "added_resident_bytes": figures["before_scoring_bytes"] - loaded, "weight_bytes": facts.weight_memory_bytes,
            "head_bytes": head_bytes, "backend": facts.backend, "ppl": result.ppl,
            "mean_kl": float(result.extra["kl"].mean())}


def child(args: argparse.Namespace, step: str, work: Path, **extra: str) -> dict:
    """Run one step in a fresh process (its memory is its own) and return its figures."""
    command = [sys.executable, __file__, *sys.argv[1:], "--only", step, "--work", str(work)]
    for key, value in extra.items():
        command += [f"--{key.replace('_', '-')}", value]
    # large arrays from and back to the system as they come and go: glibc's adaptive threshold would keep
    # freed chunk-sized blocks in its heap, and the RSS then says more about the allocator than the run
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"})
    if done.returncode != 0:
        sys.exit(f"step {step} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_relative(a: np.ndarray, b: np.ndarray) -> float:
    """Largest ``|a - b| / max(|a|, |b|)`` (0 where both are 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.maximum(np.abs(a), np.abs(b))
    return float(np.max(np.divide(np.abs(a - b), scale, out=np.zeros_like(a), where=scale > 0), initial=0.0))


def agreement(work: Path) -> dict:
    """(3) against (4), token by token."""
    with np.load(work / "reference.npz") as stored, np.load(work / "lockstep.npz") as both:
        return {"kl_max_rel_diff": max_relative(stored["kl"], both["kl"]),
                "mean_kl_rel_diff": max_relative(stored["kl"].mean(), both["kl"].mean()),
                "kl_reverse_max_rel_diff": max_relative(stored["kl_reverse"], both["kl_reverse"]),
                "token_nll_max_abs_diff": float(np.abs(stored["token_nll"] - both["token_nll"]).max()),
                "top1_equal": bool(np.array_equal(stored["top1"], both["top1"])),
                "top1_agreement": float(stored["top1"].mean())}


def report(args: argparse.Namespace, base: dict, stored: dict, both: dict, agree: dict) -> dict:
    """Print the table and the targets; return every figure."""
    alone, build = base["alone"], base["build"]
    n, mib = base["n_scored"], 2**20
    batches = -(-base["n_windows"] // args.batch_size)
    llama_cpp = 2 * base["vocab"] * n
    batch_bytes = both["scoring_growth_bytes"]  # one batch of this variant with its exact KL, as lockstep took it
    budget = stored["model_resident_bytes"] + stored["head_bytes"] + batch_bytes
    slack = 0 if base["device"].startswith("cuda") else int(RSS_SLACK * budget)

    def held(run: dict) -> int:  # see the module's docstring
        return run["peak_bytes"] - run["runtime_bytes"]

    figures = {
        "device": base["device"], "dtype": base["dtype"], "n_scored": n, "n_windows": base["n_windows"],
        "n_batches": batches, "window": args.window, "stride": args.stride, "batch_size": args.batch_size,
        "repeats": args.repeats, "vocab": base["vocab"], "hidden_size": base["hidden_size"],
        "variant_method": args.variant_method, "variant_backend": stored["backend"], "baseline_ppl": base["ppl"],
        "variant_ppl": stored["ppl"], "mean_kl": stored["mean_kl"],
        "baseline_seconds": alone["wall_seconds"], "baseline_forward_passes": alone["forward_passes"],
        "baseline_peak_bytes": alone["peak_bytes"], "baseline_scoring_growth_bytes": alone["scoring_growth_bytes"],
        "build_seconds": build["wall_seconds"], "build_ratio": build["wall_seconds"] / alone["wall_seconds"],
        "reference_bytes": base["reference_bytes"], "reference_bytes_per_token": base["reference_bytes"] / n,
        "reference_files": base["reference_files"], "llama_cpp_logprob_bytes": llama_cpp,
        "llama_cpp_bytes_per_token": llama_cpp / n,
        **{f"{name}_{key}": run[key] for name, run in (("stored", stored), ("lockstep", both))
           for key in ("wall_seconds", "forward_passes", "peak_bytes", "before_scoring_bytes", "scoring_growth_bytes",
                       "runtime_bytes", "model_resident_bytes", "added_resident_bytes")},
        "stored_ratio": stored["wall_seconds"] / alone["wall_seconds"],
        "lockstep_ratio": both["wall_seconds"] / alone["wall_seconds"],
        "variant_alone_seconds": stored["variant_alone_seconds"],
        "stored_over_variant_alone": stored["wall_seconds"] / stored["variant_alone_seconds"],
        "lockstep_over_variant_alone": both["wall_seconds"] / stored["variant_alone_seconds"],
        "baseline_weight_bytes": base["weight_bytes"], "variant_weight_bytes": stored["weight_bytes"],
        "head_bytes": stored["head_bytes"], "batch_bytes": batch_bytes, "memory_budget_bytes": budget,
        "stored_memory_bytes": held(stored), "lockstep_memory_bytes": held(both), **agree,
    }
    figures["memory_slack_bytes"] = slack
    figures["pass"] = {"time": figures["stored_over_variant_alone"] <= TIME_TARGET, "memory": held(stored) <= budget + slack,
                       "kl": max(agree["kl_max_rel_diff"], agree["mean_kl_rel_diff"]) <= KL_TARGET,
                       "forward_passes": stored["forward_passes"] == batches and both["forward_passes"] == 2 * batches}

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print(f"\n{args.baseline} vs its {args.variant_method} variant ({stored['backend']}) on {base['device']}, "
          f"{base['dtype']}: {n} scored tokens, {base['n_windows']} windows of {args.window} (stride {args.stride}), "
          f"{batches} batches of {args.batch_size}; PPL {base['ppl']:.4f} -> {stored['ppl']:.4f}, "
          f"mean KL {stored['mean_kl']:.5f}")
    print(f"{'run':<34}{'seconds':>9}{'x (1)':>8}{'forwards':>10}{'peak MiB':>10}{'held MiB':>10}{'growth MiB':>12}")
    rows = [("(1) baseline alone", alone, base), ("(2) baseline writing its reference", build, base),
            ("(3) variant, stored reference", stored, stored), ("(4) variant, lockstep", both, both)]
    rows.insert(3, ("(3') variant alone", {**stored, "wall_seconds": stored["variant_alone_seconds"],
                                            "forward_passes": batches, "peak_bytes": 0, "scoring_growth_bytes": 0},
                    stored))
    for label, run, process in rows:
        memory = f"{'-':>10}{'-':>10}{'-':>12}"
        if run["peak_bytes"]:
            memory = (f"{run['peak_bytes'] / mib:>10.0f}{(run['peak_bytes'] - process['runtime_bytes']) / mib:>10.0f}"
                      f"{run['scoring_growth_bytes'] / mib:>12.1f}")
        print(f"{label:<34}{run['wall_seconds']:>9.2f}{run['wall_seconds'] / alone['wall_seconds']:>8.2f}"
              f"{run['forward_passes']:>10}{memory}")
    print(f"peak: {'CUDA allocation' if base['device'].startswith('cuda') else 'process RSS'}; held: peak over the "
          "memory in use before any model was loaded; growth: peak over that in use just before scoring")
    print(f"reference on disk {base['reference_bytes'] / mib:.2f} MiB = {base['reference_bytes'] / n:.0f} B/token "
          f"({', '.join(f'{k} {v / mib:.2f} MiB' for k, v in base['reference_files'].items())}); llama.cpp's uint16 "
          f"log-probs {llama_cpp / mib:.1f} MiB = {llama_cpp / n:.0f} B/token "
          f"({llama_cpp / base['reference_bytes']:.0f}x)")
    print(f"resident before scoring, over the runtime: (3) variant {stored['model_resident_bytes'] / mib:.1f} MiB "
          f"(weights {stored['weight_bytes'] / mib:.1f}) + reference head {stored['added_resident_bytes'] / mib:.1f} "
          f"MiB (head {stored['head_bytes'] / mib:.1f}); (4) variant {both['model_resident_bytes'] / mib:.1f} + "
          f"baseline model {both['added_resident_bytes'] / mib:.1f} MiB (weights {base['weight_bytes'] / mib:.1f})")
    print(f"[{mark(figures['pass']['time'])}] time: (3) {figures['stored_over_variant_alone']:.3f} x (3'), the "
          f"variant's own scoring, <= {TIME_TARGET} (lockstep {figures['lockstep_over_variant_alone']:.3f} x; against "
          f"the baseline's (1): {figures['stored_ratio']:.3f} x and {figures['lockstep_ratio']:.3f} x)")
    noise = f" (+{slack / mib:.0f} MiB RSS noise)" if slack else ""
    print(f"[{mark(figures['pass']['memory'])}] memory: (3) held {held(stored) / mib:.1f} MiB <= one model "
          f"{stored['model_resident_bytes'] / mib:.1f} + one head {stored['head_bytes'] / mib:.1f} + one batch "
          f"{batch_bytes / mib:.1f} = {budget / mib:.1f} MiB{noise} (lockstep held {held(both) / mib:.1f} MiB; "
          f"the baseline alone grew {alone['scoring_growth_bytes'] / mib:.1f} MiB scoring a batch without KL)")
    print(f"[{mark(figures['pass']['kl'])}] KL: per token max rel diff {agree['kl_max_rel_diff']:.2e}, mean "
          f"{agree['mean_kl_rel_diff']:.2e} <= {KL_TARGET:g}; reverse KL {agree['kl_reverse_max_rel_diff']:.2e}, "
          f"top-1 equal: {agree['top1_equal']}, NLL max abs diff {agree['token_nll_max_abs_diff']:.2e}")
    print(f"[{mark(figures['pass']['forward_passes'])}] forward passes: (3) {stored['forward_passes']}, "
          f"(4) {both['forward_passes']}, batches {batches}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="embedded", help="a model folder or embedded")
    parser.add_argument("--variant", help="a variant checkpoint folder (default: the baseline, quantized at load)")
    parser.add_argument("--variant-method", default="torchao-int8")
    parser.add_argument("--corpus", default="embedded")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, help="default window // 2")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=1, help="measured runs of each kind: the fastest counts")
    parser.add_argument("--only", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--reference-folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.stride = args.stride or args.window // 2
    device = resolve_device(args.device)
    args.dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    torch.set_grad_enabled(False)
    source = resolve_model_path(args.baseline)
    if args.only:
        stream = token_stream(args, source)
        print(json.dumps(run_variant(args, source, stream, args.only, Path(args.work))))
        return
    with tempfile.TemporaryDirectory(prefix="reference-benchmark-") as folder:
        work = Path(folder)
        os.environ["PPL_AUDIT_REFERENCES"] = str(work / "references")
        base = run_baseline(args, source, token_stream(args, source))  # here: the first thing this process holds
        stored = child(args, "reference", work, reference_folder=base["reference"])
        both = child(args, "lockstep", work)
        figures = report(args, base, stored, both, agreement(work))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
