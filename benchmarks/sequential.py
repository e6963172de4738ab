"""Sequential audits, simulated on an audit record's per-token arrays (no model is run): over many random window
orders, how often each variant's ΔPPL sequence holds the full-corpus value at every look, how often an early stop
contradicts the full run's decision for limits clear of and inside its interval, and the tokens it scores.

    .venv/bin/python benchmarks/sequential.py RECORD_FOLDER [--orders 1000] [--batch-size 4]

RECORD_FOLDER: a synced or spooled audit record (``<PPL_AUDIT_HOME>/synced/<audit>``), with its Parquet files.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tasks.audit.sequential import Watch
from tasks.config import Gate
from tasks.engine.paired import CONFIDENCE, cluster_mean
from tasks.engine.progress import Progress
from tasks.engine.sequential import minimum_windows, mixture_rho2, ratio_sequence, window_order


def window_sums(table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    grouped = table.groupby("window")["nll"]
    return grouped.sum().to_numpy(), grouped.size().to_numpy()


def run(base: np.ndarray, variant: np.ndarray, counts: np.ndarray, gate: Gate, seed: int, batch: int
        ) -> tuple[str | None, int, bool]:
    """A sequential run's ``(decision, tokens scored, whether every look held the full value)``: the audit's own
    ``Watch`` judging these per-window NLL sums after each batch of a random order."""
    delta = variant - base
    n, full = len(delta), delta.sum() / counts.sum()
    order, first = window_order(n, seed), minimum_windows(n, batch)
    rho2 = mixture_rho2(first, 1 - CONFIDENCE)
    watch = Watch(gate, base, seed)
    progress = Progress([], {"nll": torch.tensor(variant)}, torch.tensor(counts), batch)
    held = True
    for t in range(first, n + batch, batch):
        t = min(t, n)
        e = ratio_sequence(delta[order[:t]], counts[order[:t]], 1 - CONFIDENCE, rho2)  # the stream's value alone
        held &= bool(e.low <= full <= e.high)
        progress.order = order[:t].tolist()
        if t < n and watch(progress):
            return watch.decision, int(counts[order[:t]].sum()), held
    return None, int(counts.sum()), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--orders", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    record = json.loads((args.record / "record.json").read_text())
    base = next(e for e in record["variants"] if e["role"] == "baseline")
    base_sums, counts = window_sums(pd.read_parquet(args.record / base["arrays"]))
    base_tokens = pd.read_parquet(args.record / base["arrays"])["nll"].to_numpy(np.float64)
    print(f"{record['name']}: {len(counts)} windows, {counts.sum()} tokens, {args.orders} orders, "
          f"batch {args.batch_size}, stop allowed from window {minimum_windows(len(counts), args.batch_size)}")
    print(f"{'variant':<12} {'limit ΔPPL %':<24} {'full run':<9} {'held':>6} {'contradicted':>13} {'stopped':>8} "
          f"{'tokens':>8}")
    for entry in record["variants"]:
        if entry["role"] == "baseline" or not entry.get("arrays"):
            continue
        table = pd.read_parquet(args.record / entry["arrays"])
        sums, _ = window_sums(table)
        fixed = cluster_mean(table["nll"].to_numpy(np.float64) - base_tokens, counts).mapped(
            lambda x: 100 * math.expm1(x))
        width = fixed.high - fixed.low
        if not width > 1e-6:
            print(f"{entry['name']:<12} no spread (ΔPPL {fixed.value:+.2g}%): it scores as the baseline, nothing to test")
            continue
        limits = {"clear above": fixed.high + width, "top of interval": fixed.high - 1e-9 * max(1, abs(fixed.high)),
                  "inside": (fixed.value + fixed.high) / 2, "clear below": fixed.low - width}
        for what, limit in limits.items():
            if limit <= 0:
                continue  # a gate's limit is positive
            full = "pass" if fixed.high <= limit else "fail"
            runs = [run(base_sums, sums, counts, Gate(max_ppl_increase_pct=limit), seed, args.batch_size)
                    for seed in range(args.orders)]
            held = np.mean([h for _, _, h in runs])
            contradicted = np.mean([d is not None and d != full for d, _, _ in runs])
            stopped = np.mean([d is not None for d, _, _ in runs])
            tokens = np.mean([t for _, t, _ in runs]) / counts.sum()
            print(f"{entry['name']:<12} {f'{what} {limit:+.3f}':<24} {full:<9} {held:>6.3f} {contradicted:>13.3f} "
                  f"{stopped:>8.3f} {tokens:>8.3f}")


if __name__ == "__main__":
    main()
