"""A Hub model as a user's machine keeps it: by its Hub id, in the Hugging Face cache under the home folder, read
offline. Quantized on the spot, and audited on local Dask workers, which start after gptqmodel is imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import json_line, write_config

from tasks.models.formats import HF_CACHES

HUB_ID = "local/trained"


def user_environment(home: Path) -> dict[str, str]:
    """A user's environment with ``home`` as their home folder, whose Hugging Face caches are the default ones."""
    return {name: value for name, value in os.environ.items() if name not in HF_CACHES} | {"HOME": str(home)}


def test_importing_a_quantizer_leaves_logging_and_the_hub_cache_as_they_were(tmp_path):
    """tokenicer, which gptqmodel imports, set up the root logger at INFO (a line per HTTP request on a worker's
    console) and pointed HF_HOME at /tmp/tokenicer_hf_home for every process started afterwards. A fresh process,
    as a Dask worker is, without the command line's set-up."""
    probe = ("import json, logging, os\n"
             "from tasks.models.formats import require\n"
             "require('gptq', 'cpu')\n"
             "print(json.dumps([logging.root.handlers != [], logging.root.level, "
             f"{{name: os.environ[name] for name in {HF_CACHES!r} if name in os.environ}}]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          env=user_environment(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    handlers, level, caches = json.loads(done.stdout.splitlines()[-1])
    assert (handlers, level, caches) == (False, 30, {})  # Python's own: no handler, WARNING


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory, trained_model_dir) -> Path:
    """A home folder whose Hugging Face cache holds the trained model as ``local/trained``, as a download left it."""
    home = tmp_path_factory.mktemp("user-home")
    repository = home / ".cache" / "huggingface" / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(trained_model_dir, repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    return home


@pytest.mark.slow  # quantizes, and starts a Dask worker
@pytest.mark.usefixtures("prefect_harness")
def test_a_hub_model_is_quantized_on_the_spot_and_audited_on_local_dask_workers(tmp_path, hub_home, corpus_path):
    """Before 2026-11-26 both failed: quantizing read the Hub id as a folder (FileNotFoundError: 'local/trained'),
    and the workers, started after gptqmodel moved HF_HOME, found no such model in the cache."""
    from prefect.settings import PREFECT_API_URL

    variants = [{"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32,
                 "calibration": {"samples": 4, "seq_len": 64, "seed": 0}}]
    config = write_config(tmp_path / "hub.yaml", Path(HUB_ID), corpus_path, variants,
                          thresholds={"max_ppl_increase_pct": 50}, runner={"kind": "dask", "workers": 1})
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config), "--json"], capture_output=True,
                          text=True, timeout=900, env=user_environment(hub_home) | {
                              "HF_HUB_OFFLINE": "1", "PPL_AUDIT_CACHE": str(cache), "PPL_AUDIT_HOME": str(tmp_path),
                              "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert done.returncode in (0, 1), done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    models = {model["variant"]: model for model in result["models"]}
    assert [model["status"] for model in models.values()] == ["ok", "ok"], models
    assert models["gptq"]["verdict"] in ("pass", "fail"), models
    [checkpoint] = (cache / "quantized").iterdir()
    assert json.loads((checkpoint / "ppl-audit.json").read_text())["source_model"] == HUB_ID


@pytest.mark.slow  # a CLI process
def test_ppl_of_a_hub_model_read_offline_is_its_folder_s_with_the_size_of_its_files(capsys, tmp_path, hub_home,
                                                                                   trained_model_dir, corpus_path):
    """The same figures as the folder it was copied from, to the last digit; the size on disk was 0 before
    2026-11-26 (a Hub id is no folder: its files are the cache's snapshot)."""
    from flows.cli import main

    args = ["--corpus", str(corpus_path), "--window", "64", "--max-tokens", "400", "--json"]
    assert main(["ppl", "--model", str(trained_model_dir), *args]) == 0
    folder = json_line(capsys.readouterr().out)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "ppl", "--model", HUB_ID, *args], capture_output=True,
                          text=True, timeout=600, env=user_environment(hub_home) | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    hub = json_line(done.stdout, done.stderr)
    assert (hub["nll_sum"], hub["n_tokens"], hub["model"]) == (folder["nll_sum"], folder["n_tokens"], HUB_ID)
    assert hub["variant"]["size_on_disk_bytes"] == folder["variant"]["size_on_disk_bytes"] > 0
