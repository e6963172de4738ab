"""The GPU kit builds here from the repository alone, and its one command's dry run does on CPU all that runs there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # downloads and builds wheels, trains and quantizes a model
def test_the_kit_builds_and_its_dry_run_scores_every_method_and_says_what_it_skipped(tmp_path):
    kit = tmp_path / "kit"
    built = subprocess.run(["bash", ".ci/gpu-kit"], cwd=ROOT, env={**os.environ, "KIT": str(kit)}, capture_output=True,
                           text=True, timeout=1200)
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = {path.name.split("-")[0].lower() for path in (kit / "wheels").glob("*.whl")}
    assert {"pydantic", "pydantic_core", "gguf", "compressed_tensors", "gptqmodel", "hqq", "pypcre", "liger_kernel"} <= wheels
    assert all("cp312" in path.name or "py3-none" in path.name for path in (kit / "wheels").glob("*.whl"))
    size = sum(path.stat().st_size for path in kit.rglob("*") if path.is_file())
    assert size < 60 * 2**20  # a device run carries at most 64 MiB with the working tree

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "run", "--kit", str(kit), "--out", str(out), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "peers: needs a CUDA GPU" in done.stdout and "kit models on cuda: needs a CUDA GPU" in done.stdout
    found = json.loads((out / "gpu.json").read_text())
    assert found["cuda_tests"]["exit"] == 0 and "skipped" in found["cuda_tests"]["summary"]
    rows = {row["method"]: row for row in found["quantized"]["cpu"]["rows"]}
    assert list(rows) == ["baseline", "gptq", "awq", "compressed-tensors", "hqq", "bnb-int8", "bnb-nf4"]
    for method, row in rows.items():  # 4-bit weights of a trained model: near the baseline, each through its kernel
        assert abs(row["ppl"] / rows["baseline"]["ppl"] - 1) < 0.05, (method, row["ppl"])
    assert rows["gptq"]["backend"] != rows["baseline"]["backend"] == "torch.nn.Linear"
    assert "## Kit models on cpu" in (out / "gpu.md").read_text()
