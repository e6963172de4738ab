"""The demo audit on one and two Dask workers, with and without sharding: wall time, and what a shard costs.

  .venv/bin/python benchmarks/scaling.py [--config configs/demo.yaml] [--max-tokens 8192] [--runs ...]

Each run is ``ppl-audit run CONFIG`` as a user starts it, with ``runner`` set by ``--set``, on a local Dask
cluster the audit starts (``runner.workers`` worker processes of one thread each: Dask gives each worker
process one BLAS/OpenMP thread), in its own ``$PPL_AUDIT_HOME``; the baseline's reference and the gptq/awq
checkpoints are shared (``$PPL_AUDIT_REFERENCES``, ``$PPL_AUDIT_CACHE`` as set), so every run scores the
same variants from the same files and only where they run changes. A first run (not timed) builds what is
shared. Runs (``--runs``, ``workers:shards``): ``sequential`` (in the audit's process, torch on every core),
``1:1``, ``2:1`` (two variants at once), ``2:2`` (each variant's windows split in two).

From each run's record: the wall time of the whole audit and of the variants' part, and per shard its load
time (making the model: reading, dequantizing, quantizing at load), its scoring time and the rest of its
task (Prefect's task start and end, shipping the stream and the results). The model printed at the end:
a variant of ``T`` tokens scored at ``r`` tokens/s on one worker, with load time ``L`` and per-task overhead
``o``, takes ``L + o + T/r`` whole and ``L + o + T/(n r)`` as ``n`` shards on ``n`` free workers: sharding
pays when the workers would otherwise sit idle (fewer variants than workers) and ``T/r`` is large against
``L + o``, i.e. from ``T > (L + o) r n / (n - 1)`` tokens on, where a shard's saving beats its extra load.

The last line is every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(config: str, runner: str, max_tokens: int, home: Path) -> dict:
    """One audit, as the CLI runs it; its figures from the record it wrote."""
    sets = ["--set", f"evaluation.max_tokens={max_tokens}"]
    if runner != "sequential":
        workers, shards = runner.split(":")
        sets += ["--set", "runner.kind=dask", "--set", f"runner.workers={workers}", "--set", f"runner.shards={shards}"]
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).with_name("ppl-audit")), "run", config, *sets, "--json"],
                          env={**os.environ, "PPL_AUDIT_HOME": str(home)}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode not in (0, 1):  # 1: a variant failed its gate, which is still a measured audit
        sys.exit(f"ppl-audit run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    [record_file] = sorted(home.glob("synced/*/record.json"))[-1:]
    record = json.loads(record_file.read_text())
    variants = [v for v in record["variants"] if v["role"] == "variant"]
    starts, ends = [v["started"] for v in variants], [v["ended"] for v in variants]
    shards = []
    for variant in variants:
        rows = variant.get("shards") or [{"seconds": variant["result"]["wall_seconds"]}]
        load = variant["facts"]["load_seconds"]
        for row in rows:
            task = (variant["ended"] - variant["started"]) if len(rows) == 1 else None
            shards.append({"variant": variant["name"], "windows": row.get("windows"), "tokens": row.get("tokens"),
                           "worker": row.get("worker"), "score_seconds": row["seconds"], "load_seconds": load,
                           "task_seconds": task})
    return {"runner": runner, "wall_seconds": wall, "variants_seconds": max(ends) - min(starts),
            "ppl": {v["name"]: v["result"]["ppl"] for v in variants}, "shards": shards,
            "tokens": variants[0]["result"]["n_tokens"]}


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--runs", nargs="+", default=["sequential", "1:1", "2:1", "2:2"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run(args.config, "sequential", args.max_tokens, Path(scratch) / "warm")  # builds the shared files
        results = [run(args.config, runner, args.max_tokens, Path(scratch) / runner.replace(":", "-"))
                   for runner in args.runs]
    print(f"{'runner':<12}{'audit s':>9}{'variants s':>12}   per variant: load s, score s (shards)")
    for r in results:
        per = {}
        for s in r["shards"]:
            per.setdefault(s["variant"], []).append(f"{s['score_seconds']:.1f}")
        loads = {s["variant"]: s["load_seconds"] for s in r["shards"]}
        detail = "; ".join(f"{v} {loads[v]:.1f}, {'+'.join(scores)}" for v, scores in per.items())
        print(f"{r['runner']:<12}{r['wall_seconds']:>9.1f}{r['variants_seconds']:>12.1f}   {detail}")
    on_dask = [r for r in results if r["runner"] != "sequential"]
    same = all(r["ppl"] == on_dask[0]["ppl"] for r in on_dask)
    print(f"PPL identical on every Dask run, sharded or not (1 torch thread per worker): {same}")
    here = next((r for r in results if r["runner"] == "sequential"), None)
    apart = None
    if here and on_dask:  # torch's thread count changes the order of float sums inside the kernels
        apart = max(abs(here["ppl"][v] / on_dask[0]["ppl"][v] - 1) for v in here["ppl"])
        print(f"sequential ({torch_threads()} torch threads) against 1 thread: PPL apart by at most {apart:.1e} relative")
    one = next((r for r in results if r["runner"] == "1:1"), None)
    model = {}
    if one:
        rates = [s["tokens"] / s["score_seconds"] for s in one["shards"]]
        overhead = [s["task_seconds"] - s["score_seconds"] - s["load_seconds"] for s in one["shards"]]
        load = statistics.median(s["load_seconds"] for s in one["shards"])
        rate, extra = statistics.median(rates), statistics.median(overhead)
        model = {"tokens_per_second_one_worker": rate, "load_seconds": load, "task_overhead_seconds": extra,
                 "sharding_pays_from_tokens_2_workers": (load + extra) * rate * 2}
        print(f"one worker: {rate:.0f} tok/s, load {load:.1f} s, task overhead {extra:.1f} s: two shards of one variant"
              f" on two idle workers pay from about {model['sharding_pays_from_tokens_2_workers']:,.0f} tokens")
    print(json.dumps({"runs": results, "ppl_identical_on_dask": same, "sequential_ppl_apart": apart, "model": model}))


if __name__ == "__main__":
    main()
