"""Pictures of an audit, for MLflow: PPL per variant with error bars, ΔNLL per window."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and workers
import matplotlib.pyplot as plt  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

COLOURS = {"pass": "#2e7d32", "fail": "#c62828", "error": "#9e9e9e", None: "#1565c0"}


def ppl_bars(record: dict):
    """PPL ± standard error per model, coloured by verdict (baseline blue)."""
    scored = [v for v in record["variants"] if v["result"]]
    figure, axis = plt.subplots(figsize=(max(4, 1.4 * len(scored)), 3.6), layout="constrained")
    names = [v["name"] for v in scored]
    ppl = [v["result"]["ppl"] for v in scored]
    errors = [v["result"]["ppl_stderr"] for v in scored]
    colours = [COLOURS[(v["verdict"] or {}).get("status")] for v in scored]
    axis.bar(names, ppl, yerr=errors, capsize=4, color=colours)
    if scored and scored[0]["role"] == "baseline":
        axis.axhline(ppl[0], color=COLOURS[None], linestyle="--", linewidth=1)
    axis.set_ylabel("perplexity (± s.e.)")
    axis.set_title(f"{record['name']}: {record['verdict']['status']}")
    axis.set_ylim(bottom=min(ppl) * 0.9 if ppl else 0)
    return figure


def delta_nll_per_window(record: dict, folder: Path):
    """Mean NLL per window of each variant minus the baseline's, window by window."""
    figure, axis = plt.subplots(figsize=(8, 3.6), layout="constrained")
    base = next((v for v in record["variants"] if v["role"] == "baseline" and v["result"]), None)
    if base is not None:
        reference = pq.read_table(folder / base["arrays"]).to_pandas().groupby("window")["nll"].mean()
        for v in record["variants"]:
            if v["role"] == "variant" and v["result"]:
                mean = pq.read_table(folder / v["arrays"]).to_pandas().groupby("window")["nll"].mean()
                axis.plot(mean.index, mean - reference, label=v["name"], linewidth=1)
    axis.axhline(0, color="black", linewidth=0.8)
    return _labelled(figure, axis, "window", "ΔNLL vs baseline (nats/token)", "per-window change against the baseline")


def kld_histogram(record: dict, folder: Path):
    """Distribution of per-token KL(baseline‖variant), log-scaled, one outline per variant."""
    import numpy as np

    figure, axis = plt.subplots(figsize=(8, 3.6), layout="constrained")
    for v in record["variants"]:
        if v["role"] != "variant" or not v["result"]:
            continue
        table = pq.read_table(folder / v["arrays"])
        if "kl" not in table.column_names:
            continue
        kl = np.clip(table.column("kl").to_numpy(), 1e-8, None)
        axis.hist(kl, bins=np.logspace(-8, max(1, np.log10(kl.max()) + 0.1), 60), histtype="step", label=v["name"])
    axis.set_xscale("log")
    return _labelled(figure, axis, "KL(baseline ‖ variant) per token (nats)", "tokens", "per-token KL divergence")


def _labelled(figure, axis, xlabel: str, ylabel: str, title: str):
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    return figure


def close(figure) -> None:
    plt.close(figure)
