"""End to end on loopback: a Prefect server, `ppl-audit serve`, and an event from another process.

The server and the serving process are started by this test and stopped by it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import pytest
from helpers import free_port, make_text, place_prefect_database, wait_for, write_config

from tasks.data.corpus import tokenize
from tasks.models.quantize import Scheme, draw_calibration, quantize
from tasks.models.resolve import load_tokenizer, locate_model

pytestmark = pytest.mark.slow  # quick tier: pytest -m "not slow"


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefect_database):
    """A Prefect server the module's tests share (each started one: 10-17 s): each serves deployments of names of its
    own and reads only their runs. A test's serve runs with its own home and quantization cache."""
    folder = tmp_path_factory.mktemp("server")
    port = free_port()
    place_prefect_database(prefect_database, folder / "prefect")
    env = {**os.environ, "PREFECT_HOME": str(folder / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PPL_AUDIT_CACHE": str(folder / "cache")}
    log = open(folder / "server.log", "w")
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


@pytest.fixture(scope="module")
def gptq_checkpoint(tmp_path_factory, trained_model_dir, tokenizer) -> Path:
    """A GPTQ 4-bit g32 checkpoint in a folder whose name says nothing of it (as in a job's cache); made once, read
    only by the tests."""
    ids = tokenize(make_text(2000, seed=5), tokenizer, bos="none").ids
    out = tmp_path_factory.mktemp("checkpoint") / "quantized" / "job-14968c37b68748e0"
    quantize(locate_model(str(trained_model_dir)), Scheme("gptq", 4, 32, True),
             draw_calibration(ids, 4, 64, 0, "other", "x"), out, load_tokenizer(str(trained_model_dir)))
    return out


def own(tmp_path: Path, home: Path) -> dict[str, str]:
    """A serve's home and quantization cache of its test's own: a cache an earlier test's audit filled would end a
    quantization that a test stops midway before it is stopped."""
    return {"PPL_AUDIT_HOME": str(home), "PPL_AUDIT_CACHE": str(tmp_path / "cache")}


def serve_log(home: Path) -> str:
    """What `serve` and its runs wrote besides its console: its log file."""
    return "".join(log.read_text(errors="replace") for log in sorted(home.glob("logs/*-serve-*.log")))


def emit(env: dict, payload: dict) -> None:
    """``quantization.completed`` from another process, as any quantization job would send it."""
    code = ("from prefect.events import emit_event\n"
            "emit_event(event='quantization.completed', resource={'prefect.resource.id': 'ppl-audit.model.test'},"
            f" payload={payload!r})")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.mark.parametrize("api_url,expected", [
    (None, "no Prefect server is configured: set PREFECT_API_URL"),
    ("http://127.0.0.1:{port}/api", "the Prefect server http://127.0.0.1:{port}/api does not answer"),
])
def test_notify_refuses_when_no_server_would_hear_it(tmp_path, trained_model_dir, api_url, expected):
    """Without a server, emit_event says "emitted" into a temporary server of its own and no audit starts."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(tmp_path)}
    if api_url:
        env["PREFECT_API_URL"] = api_url.format(port=port)
    done = subprocess.run([sys.executable, "-m", "flows.cli", "notify", "--model", str(trained_model_dir)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and expected.format(port=port) in done.stderr


def test_events_trigger_audits_gated_by_name_and_cron_runs_in_the_schedule_s_zone(server, tmp_path, trained_model_dir,
                                                                                   corpus_path, gptq_checkpoint):
    """Two events for one checkpoint: named by the config's matching variant it passes that variant's
    gate; named ``gptq-strict`` by its event it meets the global gate, fails, and ends Failed with the
    verdict's one line (no traceback in the serving process). Cron 03:00 runs at 03:00 Berlin time. The audit is
    sequential: the clearly good one ends before scoring every window, the one judged against a limit inside its
    noise scores every window."""
    env, api = server
    # calibration the test corpus can supply: serve refuses a config whose own audit could not draw it (#51)
    variants = [{"name": "gptq-4bit", "method": "gptq", "bits": 4, "group_size": 32,
                 "calibration": {"samples": 4, "seq_len": 64}}]
    thresholds = {"max_ppl_increase_pct": 0.001, "per_variant": {"gptq-4bit": {"max_ppl_increase_pct": 50}}}
    config = write_config(tmp_path / "serve.yaml", trained_model_dir, corpus_path, variants, name="nightly",
                          schedule={"cron": "0 3 * * *", "timezone": "Europe/Berlin"}, thresholds=thresholds,
                          evaluation={"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 1500,
                                      "sequential": True})
    log = open(tmp_path / "serve.console", "w")
    home = tmp_path / "home"
    serving = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config), "--allow",
                                str(gptq_checkpoint.parent)], env=env | own(tmp_path, home), stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        deployments = wait_for(lambda: {d["name"]: d for d in api.post("/deployments/filter", json={}).json()
                                        if d["name"] in ("nightly", "nightly-quantize")}, 120, "the deployments")
        audit_id = wait_for(lambda: deployments.get("nightly", {}).get("id"), 1, "the audit deployment")
        assert [s["schedule"]["timezone"] for s in deployments["nightly"]["schedules"]] == ["Europe/Berlin"]

        payload = {"model_path": str(gptq_checkpoint), "method": "gptq", "bits": 4, "baseline": str(trained_model_dir)}

        def runs(name: str | None) -> list[dict]:
            found = api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [audit_id]}}}).json()
            return [r for r in found if (r["parameters"].get("event") or {}).get("model_path") == str(gptq_checkpoint)
                    and (r["parameters"]["event"].get("name") or None) == name
                    and r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]

        emit(env, payload)  # as a job that names nothing sends it
        matched = wait_for(lambda: next(iter(runs(None)), None), 400, "the audit of the checkpoint named by the config")
        assert matched["state_type"] == "COMPLETED", (matched["state"], serve_log(home)[-3000:])
        assert "1 stopped early, settled" in matched["state"]["message"], matched["state"]["message"]
        assert (matched["parameters"]["event"]["method"], str(matched["parameters"]["event"]["bits"])) == ("gptq", "4")
        assert matched["parameters"]["event"]["baseline"] == str(trained_model_dir)
        assert matched["parameters"]["config"] == str(config.resolve())

        # as a job that names its variant announces it with `ppl-audit notify`
        subprocess.run([sys.executable, "-m", "flows.cli", "notify", "--model", str(gptq_checkpoint), "--method", "gptq",
                        "--bits", "4", "--baseline", str(trained_model_dir), "--name", "gptq-strict"],
                       env=env, check=True, timeout=120)

        strict = wait_for(lambda: next(iter(runs("gptq-strict")), None), 400, "the audit of the checkpoint named by its event")
        assert strict["state_type"] == "FAILED", (strict["state"], serve_log(home)[-3000:])
        message = strict["state"]["message"]
        assert message.startswith("fail: gptq-strict: ΔPPL ") and "limit ≤ 0.001" in message and "\n" not in message
        # a limit inside the noise of a near-lossless checkpoint: it scores every window and is judged as ever
        assert message.endswith("; scored every window: not settled earlier (order seed 0)"), message
        # the run's process logs its end after the server has its state; read before SIGTERM, whose
        # shutdown Prefect itself logs with tracebacks
        wait_for(lambda: f"Finished in state Failed('{message}')" in serve_log(home), 30, "the run's last line")
        time.sleep(3)
        served = serve_log(home)
        assert "Traceback" not in served, served[-5000:]

        scheduled = api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [audit_id]}},
                                                         "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}}).json()
        assert scheduled, "the cron schedule produced no scheduled run"
        berlin = ZoneInfo("Europe/Berlin")
        assert {datetime.fromisoformat(r["expected_start_time"]).astimezone(berlin).strftime("%H:%M")
                for r in scheduled} == {"03:00"}

        # a cron run brought forward to now: its record says Prefect's schedule started it (compare reads that),
        # the event-triggered ones' say not
        nightly = scheduled[0]
        now = datetime.now(ZoneInfo("UTC")).isoformat()
        api.post(f"/flow_runs/{nightly['id']}/set_state", json={"state": {"type": "SCHEDULED", "state_details": {
            "scheduled_time": now}}, "force": True}).raise_for_status()
        ran = wait_for(lambda: (run := api.get(f"/flow_runs/{nightly['id']}").json())["state_type"] in (
            "COMPLETED", "FAILED", "CRASHED") and run, 400, "the cron run brought forward")
        assert ran["state_type"] == "COMPLETED" and ran["auto_scheduled"], (ran["state"], serve_log(home)[-3000:])
        records = [json.loads(path.read_text()) for path in home.glob("*/*/record.json")]
        assert sorted(record["scheduled"] for record in records) == [False, False, True]
    finally:
        stop(serving)
        log.close()


def test_notify_refuses_a_model_that_is_not_a_local_checkpoint(cli):
    """``missing/ckpt`` looks like a Hub id, and was sent as the folder of that name here."""
    code, out, err = cli("notify", "--model", "missing/ckpt")
    assert code == 2 and out == "" and err.strip() == (
        "ppl-audit: error: model folder not found: missing/ckpt; notify announces a local checkpoint (a folder or "
        ".gguf file the serving machine reads at the same path)")


def test_a_served_audit_does_only_what_its_config_allows(server, tmp_path, trained_model_dir, corpus_path,
                                                         gptq_checkpoint):
    """Whoever reaches the Prefect API (it has no authentication by default) asks the served deployments for
    another config, overrides that send the record elsewhere, a checkpoint or baseline outside the allowed
    folders, a baseline with no checkpoint (it was audited as the config's own), a quantization into another
    folder: each run ends Failed with one ``refused:`` line before anything loads. The console says nothing of the
    cron's scheduled runs, which have not started. Stopped (SIGTERM) while an audit runs, serve ends that run Crashed
    with the stop's line, not left Running in the API for good."""
    env, api = server
    config = write_config(tmp_path / "serve.yaml", trained_model_dir, corpus_path,
                          [{"name": "gptq-4bit", "method": "gptq", "bits": 4, "group_size": 32,
                            "calibration": {"samples": 4, "seq_len": 64}}], name="guarded",
                          schedule={"cron": "0 3 1 1 *"})  # once a year: its scheduled runs never start here
    other_config = write_config(tmp_path / "other.yaml", trained_model_dir, corpus_path, [{"name": "x", "method": "bnb-int8"}])
    console_path, home = tmp_path / "serve.console", tmp_path / "home"
    log = open(console_path, "w")
    serving = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config)],
                               env=env | own(tmp_path, home), stdout=log, stderr=subprocess.STDOUT)
    try:
        def served() -> dict[str, str] | None:
            found = {d["name"]: d["id"] for d in api.post("/deployments/filter", json={}).json()}
            return found if {"guarded", "guarded-quantize"} <= found.keys() else None

        deployments = wait_for(served, 120, "the deployments")

        def ended(run_id: str) -> dict:
            return wait_for(lambda: (lambda r: r if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED") else None)(
                api.get(f"/flow_runs/{run_id}").json()), 400, f"flow run {run_id} to end")

        def create(deployment: str, parameters: dict) -> str:  # the busy temporary server can answer 503 at first
            made = wait_for(lambda: (lambda answer: answer if answer.is_success else None)(api.post(
                f"/deployments/{deployments[deployment]}/create_flow_run", json={"parameters": parameters})), 60,
                f"a run of {deployment}")
            return made.json()["id"]

        def by_event(model_path: str) -> dict:
            return wait_for(lambda: next((r for r in api.post("/flow_runs/filter", json={
                "deployments": {"id": {"any_": [deployments["guarded"]]}}}).json()
                if (r["parameters"].get("event") or {}).get("model_path") == model_path
                and r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")), None), 400, f"the audit of {model_path}")

        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(gptq_checkpoint, elsewhere)
        asked = {
            "another config": create("guarded", {"config": str(other_config)}),
            "overrides": create("guarded", {"config": str(config.resolve()), "overrides": ["tracking.uri=http://elsewhere:5000"]}),
            "baseline alone": create("guarded", {"config": str(config.resolve()),
                                                 "event": {"baseline": str(tmp_path / "other")}}),
            "quantize elsewhere": create("guarded-quantize", {"request": {
                "model": str(trained_model_dir), "method": "gptq", "out": str(tmp_path / "written-here"),
                "calibration": {"corpus": {"source": str(corpus_path)}}}}),
        }
        expected = {
            "another config": f"refused: this serve runs {config.resolve()} only, not {other_config}",
            "overrides": "refused: a served audit takes no overrides (tracking.uri=http://elsewhere:5000); change "
                         f"{config.resolve()} and serve it again",
            "baseline alone": f"refused: baseline {tmp_path / 'other'} given without model_path: they describe the "
                              "checkpoint an event names",
            "quantize elsewhere": f"refused: out {tmp_path / 'written-here'} is outside this serve's allowed folders",
        }
        for what, run_id in asked.items():
            run = ended(run_id)
            assert run["state_type"] == "FAILED" and run["state"]["message"].startswith(expected[what]), (what, run["state"])
        assert not (tmp_path / "written-here").exists()

        emit(env, {"model_path": str(elsewhere), "method": "gptq"})
        outside = by_event(str(elsewhere))
        assert outside["state_type"] == "FAILED" and outside["state"]["message"] == (
            f"refused: model_path {elsewhere} is outside this serve's allowed folders; allow it with "
            "`ppl-audit serve --allow DIR`"), outside["state"]
        other_baseline = tmp_path / "other-baseline"
        shutil.copytree(trained_model_dir, other_baseline)
        emit(env, {"model_path": str(trained_model_dir), "method": "bnb-int8", "baseline": str(other_baseline)})
        swapped = by_event(str(trained_model_dir))
        assert swapped["state_type"] == "FAILED" and swapped["state"]["message"].startswith(
            f"refused: the event names baseline {other_baseline}, but this config's baseline is "), swapped["state"]
        # each run's process logs its end after the server has its state
        wait_for(lambda: serve_log(home).count("Finished in state Failed(") >= 6, 30, "the six runs' last lines")
        wait_for(lambda: console_path.read_text().count(" ended Failed: refused: ") == 6, 30, "the console's lines")
        assert "Traceback" not in serve_log(home), serve_log(home)[-5000:]
        # #30 item 5: the console says what an operator needs, a line as each run starts and ends; the rest is in
        # the log (gptqmodel's banner, library warnings, Prefect's lines)
        console = console_path.read_text().splitlines()
        assert console[0].endswith("serving guarded: the audit on cron 0 3 1 1 * (UTC) and every quantization.completed "
                                   "event; guarded-quantize on request"), console
        assert len(console) == 13 and all(" run " in line for line in console[1:]), console
        assert sum(" started" in line for line in console) == 6 and "GPT-QModel" in serve_log(home)
        assert api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [deployments["guarded"]]}}, "flow_runs": {
            "state": {"type": {"any_": ["SCHEDULED"]}}}}).json(), "the cron made no scheduled run to leave unsaid"

        # the config's own audit, stopped while it quantizes
        running = create("guarded", {"config": str(config.resolve())})
        wait_for(lambda: api.get(f"/flow_runs/{running}").json()["state_type"] == "RUNNING", 120, "the audit to run")
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=30) == 128 + signal.SIGTERM
        run = api.get(f"/flow_runs/{running}").json()
        assert run["state_type"] == "CRASHED" and run["state"]["message"] == (
            "crashed: ppl-audit serve was interrupted by SIGTERM while this run ran; nothing it had half-written is "
            "kept"), run["state"]
    finally:
        stop(serving)
        log.close()


def started_serve(env: dict, folder: Path, config: Path) -> subprocess.Popen:
    """``ppl-audit serve CONFIG`` with its home, cache and console in ``folder``."""
    folder.mkdir()
    with open(folder / "serve.console", "w") as log:  # the child has its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", str(config)],
                                env=env | own(folder, folder / "home"), stdout=log, stderr=subprocess.STDOUT)


def test_ctrl_c_or_sighup_to_serve_ends_its_running_audit_crashed(server, tmp_path, trained_model_dir, corpus_path):
    """As on SIGTERM (above), serve stopped by Ctrl-C or SIGHUP while an audit runs ends that run Crashed with the
    stop's line: the runner's teardown had killed the run's process without a word to the API, and the run stayed
    Running there for good (#51's sibling). Two serves at once, a deployment each, so that their start-ups overlap;
    each is stopped as soon as its audit runs."""
    env, api = server
    servings, runs = {}, {}
    try:
        for signum in (signal.SIGINT, signal.SIGHUP):
            config = write_config(tmp_path / f"serve-{signum.name}.yaml", trained_model_dir, corpus_path,
                                  [{"name": "gptq-4bit", "method": "gptq", "bits": 4, "group_size": 32,
                                    "calibration": {"samples": 4, "seq_len": 64}}], name=f"stopped-{signum.name.lower()}")
            servings[signum] = (config, started_serve(env, tmp_path / signum.name, config))
        for signum, (config, _) in servings.items():
            deployment = wait_for(lambda: next((d["id"] for d in api.post("/deployments/filter", json={}).json()
                                                if d["name"] == f"stopped-{signum.name.lower()}"), None), 120, "the deployment")
            runs[signum] = wait_for(lambda: (lambda answer: answer if answer.is_success else None)(api.post(
                f"/deployments/{deployment}/create_flow_run", json={"parameters": {"config": str(config.resolve())}})),
                60, "a run").json()["id"]
        waiting = dict(runs)
        while waiting:  # each serve stopped as soon as its audit runs, while it quantizes
            signum = wait_for(lambda: next((s for s, run in waiting.items()
                                            if api.get(f"/flow_runs/{run}").json()["state_type"] == "RUNNING"), None),
                              120, "an audit", every=0.25)
            servings[signum][1].send_signal(signum)
            del waiting[signum]
        for signum, (_, serving) in servings.items():
            assert serving.wait(timeout=30) == 128 + signum, signum.name
    finally:
        for _, serving in servings.values():
            stop(serving)
    for signum, running in runs.items():
        run = api.get(f"/flow_runs/{running}").json()
        assert run["state_type"] == "CRASHED" and run["state"]["message"] == (
            f"crashed: ppl-audit serve was interrupted by {signum.name} while this run ran; nothing it had half-written "
            "is kept"), (signum.name, run["state"])
