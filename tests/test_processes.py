"""Every process ``ppl-audit`` starts ends with it: on SIGTERM, and on ``kill -9`` of the process the user
started (flows/lifetime.py). Real processes: Prefect's temporary server, MLflow's server tree.

The command runs as ``python -m flows.cli`` from this checkout, which goes through the same ``entry`` as the
console script (checked below), so that these tests exercise the code of the tree they are in.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from helpers import free_port, write_config
from helpers import wait_for as waiting

ROOT = Path(__file__).resolve().parents[1]
STOPPED_WITHIN_S = 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the supervisor and its prctl settings are Linux's")


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running. A zombie is not: it only waits for a parent (or an init that may never) to reap it."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def started_by(home: Path) -> list[psutil.Process]:
    """Every live process whose environment has this test's PPL_AUDIT_HOME: what the command started,
    its children's children, and orphans whose parent has died (then no process tree leads to them)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PPL_AUDIT_HOME") == str(home):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return alive(found)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_for(check, timeout: float, what: str):
    """``helpers.wait_for`` at process speed; a process may end while it is looked at."""
    return waiting(check, timeout, what, every=0.2, tolerate=(psutil.NoSuchProcess,))


def descendant(process: psutil.Process, *words: str) -> psutil.Process | None:
    return next((p for p in alive(process.children(recursive=True)) if all(w in p.cmdline() for w in words)), None)


def port_of(server: psutil.Process) -> int:
    arguments = server.cmdline()
    return int(arguments[arguments.index("--port") + 1])


class Command:
    """``ppl-audit ARGS`` in the background, in a home of its own that marks every process it starts."""

    def __init__(self, tmp_path: Path, *args: str):
        self.home = tmp_path / "home"
        env = {name: value for name, value in os.environ.items()
               if name not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}  # Prefect's local mode, the local store
        env.update(PREFECT_HOME=str(tmp_path / "prefect"), PPL_AUDIT_HOME=str(self.home),
                   PPL_AUDIT_CACHE=str(tmp_path / "cache"),
                   PREFECT_RUNNER_POLL_FREQUENCY="1")  # `serve` starts a new flow run within 1 s, not 10
        self.log = tmp_path / "command.log"
        with open(self.log, "w") as log:
            self.process = psutil.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
        self.recorded: list[psutil.Process] = []

    def signal(self, signum: int, to_child: bool = False) -> None:
        """Record every descendant, then signal the process the user started (or its first child)."""
        self.recorded = alive(self.process.children(recursive=True))
        (self.process.children()[0] if to_child else self.process).send_signal(signum)

    def assert_all_gone(self, port: int) -> int | None:
        """Within STOPPED_WITHIN_S: each recorded descendant and anything else started with this home has
        ended, and nothing listens on the port. The exit code of the process the user started."""
        def gone() -> bool:
            return not alive(self.recorded) and not started_by(self.home) and not listening(port)

        deadline = time.monotonic() + STOPPED_WITHIN_S
        while time.monotonic() < deadline and not gone():
            time.sleep(0.2)
        left = sorted({f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive(self.recorded + started_by(self.home))})
        assert not left, f"still running {STOPPED_WITHIN_S} s after the signal:\n" + "\n".join(left)
        assert not listening(port), f"port {port} still listens"
        return self.process.poll()

    def stop(self) -> None:
        """Whatever is left (the code before supervision left the servers running): SIGTERM, then SIGKILL."""
        left = alive([self.process, *self.recorded, *started_by(self.home)])
        left += [c for p in left for c in alive(p.children(recursive=True))]
        for process in left:
            process.terminate()
        for process in psutil.wait_procs(left, timeout=5)[1]:
            process.kill()
        self.process.wait()


@pytest.fixture
def command(tmp_path):
    commands: list[Command] = []

    def start(*args: str) -> Command:
        commands.append(Command(tmp_path, *args))
        return commands[-1]

    yield start
    for started in commands:
        started.stop()


@pytest.fixture
def config(tmp_path, tiny_model_dir, corpus_path) -> Path:
    return write_config(tmp_path / "audit.yaml", tiny_model_dir, corpus_path,
                        [{"name": "copy", "path": str(tiny_model_dir)}])


def prefect_server(started: Command) -> int:
    """The port of the command's temporary Prefect server (uvicorn, ~220 MB) once its process exists. It
    listens some 15 s later; a server the command leaves behind gets there all the same."""
    server = wait_for(lambda: descendant(started.process, "uvicorn", "prefect.server.api.server:create_app"), 120,
                      "Prefect's temporary server")
    return port_of(server)


def test_the_console_script_is_the_supervised_entry():
    assert 'ppl-audit = "flows.cli:entry"' in (ROOT / "pyproject.toml").read_text()
    script = Path(sys.executable).parent / "ppl-audit"
    assert "from flows.cli import entry" in script.read_text(), "reinstall: pip install -e . --no-deps"


@pytest.mark.parametrize("signum, to_child",
                         [(signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGKILL, True)],
                         ids=["kill-9", "sigterm", "kill-9-of-the-child"])
def test_run_leaves_no_prefect_server(command, config, signum, to_child):
    """The third: the command's process killed outright (as by the OOM killer); what it started remains
    for the process the user started to stop."""
    run = command("run", str(config))
    port = prefect_server(run)
    run.signal(signum, to_child)
    code = run.assert_all_gone(port)
    if signum == signal.SIGTERM or to_child:
        assert code == 128 + signum, run.log.read_text()[-3000:]


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_ui_leaves_no_mlflow_server(command, signum):
    port = free_port()
    ui = command("ui", "--port", str(port))
    wait_for(lambda: listening(port), 120, f"MLflow's server on port {port}")
    wait_for(lambda: descendant(ui.process, "uvicorn"), 30, "MLflow's uvicorn")
    ui.signal(signum)
    ui.assert_all_gone(port)


def test_serve_stops_promptly_with_its_flow_run_and_every_server(command, config):
    """SIGTERM while a served flow run is under way. Prefect's runner handles it (its handler replaces
    ours); without PREFECT_API_URL the flow run's process starts a temporary server of its own: that one
    was left running."""
    serve = command("serve", str(config))
    port = prefect_server(serve)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api", timeout=10)
    deployment = wait_for(lambda: next((d for d in api.post("/deployments/filter", json={}).json()
                                        if d["name"] == "tiny"), None), 120, "the audit deployment")
    # the busy temporary server can answer 503 at first
    wait_for(lambda: api.post(f"/deployments/{deployment['id']}/create_flow_run", json={}).is_success, 60, "a flow run")
    api.close()
    engine = wait_for(lambda: descendant(serve.process, "prefect.engine"), 60, "the flow run's process")
    wait_for(lambda: descendant(engine, "uvicorn"), 60, "the flow run's temporary server")
    serve.signal(signal.SIGTERM)
    assert serve.assert_all_gone(port) is not None
