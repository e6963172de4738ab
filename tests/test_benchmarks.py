"""The peer benchmark runs end to end on a small model and its methods agree where they should."""

from __future__ import annotations

import json
import subprocess
import sys


def test_peer_benchmark_runs_and_agrees(tiny_model_dir, text, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    done = subprocess.run([sys.executable, "benchmarks/peers.py", "--model", str(tiny_model_dir), "--corpus",
                           str(corpus), "--window", "64", "--stride", "32", "--windows", "10", "--batch-sizes",
                           "1", "3", "--peak-tflops", "0.5"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    methods = [row["method"] for row in figures["rows"]]
    assert methods == ["HF documentation loop", "ppl-audit engine", "ppl-audit engine", "bare forward passes",
                       "lm-eval rolling", "ppl-audit, lm-eval's windows"]
    assert figures["ppl_difference_vs_lm_eval"] < 1e-6
    assert figures["ppl_difference_vs_hf_loop"] < 1e-2  # the loop weighs each window's mean by scored - 1
    assert all(row["tokens_per_second"] > 0 and 0 < row["mfu"] < 1 for row in figures["rows"])
