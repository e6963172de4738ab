"""End to end on loopback: a Prefect server, `ppl-audit serve`, and an event from another process.

The server and the serving process are started by this test and stopped by it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, make_text, write_config
from tasks.quantize import draw_calibration, quantize
from tasks.corpus import tokenize


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except httpx.HTTPError:
            found = None
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def server(tmp_path):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PPL_AUDIT_CACHE": str(tmp_path / "cache")}
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                                "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    api = httpx.Client(base_url=env["PREFECT_API_URL"], timeout=10)
    try:
        wait_for(lambda: api.get("/health").status_code == 200, 120, "the Prefect server")
        yield env, api
    finally:
        api.close()
        stop(process)
        log.close()


@pytest.fixture
def gptq_checkpoint(tmp_path, trained_model_dir, tokenizer) -> Path:
    ids = tokenize(make_text(2000, seed=5), tokenizer, bos="none").ids
    out = tmp_path / "gptq-4bit"
    quantize(str(trained_model_dir), "gptq", 4, 32, True, draw_calibration(ids, 4, 64, 0, "other", "x"), out)
    return out


def test_quantization_event_triggers_an_audit_and_cron_schedules_runs(server, tmp_path, trained_model_dir,
                                                                    corpus_path, gptq_checkpoint):
    env, api = server
    config = write_config(tmp_path / "serve.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                          name="nightly", schedule={"cron": "0 3 * * *"}, thresholds={"max_ppl_increase_pct": 50})
    log = open(tmp_path / "serve.log", "w")
    serving = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config)], env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        deployments = wait_for(lambda: {d["name"]: d for d in api.post("/deployments/filter", json={}).json()
                                        if d["name"] in ("nightly", "nightly-quantize")}, 120, "the deployments")
        audit_id = wait_for(lambda: deployments.get("nightly", {}).get("id"), 1, "the audit deployment")

        emitter = f"""
from prefect.events import emit_event
emit_event(event="quantization.completed", resource={{"prefect.resource.id": "ppl-audit.model.test"}},
           payload={{"model_path": {str(gptq_checkpoint)!r}, "method": "gptq", "bits": 4,
                     "baseline": {str(trained_model_dir)!r}}})
"""
        subprocess.run([sys.executable, "-c", emitter], env=env, check=True, timeout=120)

        def triggered_run():
            runs = api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [audit_id]}}}).json()
            done = [r for r in runs if r["parameters"].get("model_path") == str(gptq_checkpoint)
                    and r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
            return done[0] if done else None

        run = wait_for(triggered_run, 300, "the triggered audit run to finish")
        assert run["state_type"] == "COMPLETED", (run["state"], (tmp_path / "serve.log").read_text()[-3000:])
        assert run["parameters"]["method"] == "gptq"
        assert str(run["parameters"]["bits"]) == "4"
        assert run["parameters"]["baseline"] == str(trained_model_dir)
        assert run["parameters"]["config"] == str(config.resolve())

        scheduled = api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [audit_id]}},
                                                         "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}).json()
        assert scheduled, "the cron schedule produced no scheduled run"
        assert all(r["expected_start_time"][11:16] == "03:00" for r in scheduled)
    finally:
        stop(serving)
        log.close()
