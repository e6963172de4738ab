"""Every process ``ppl-audit`` starts ends with it: on SIGTERM, and on ``kill -9`` of the process the user
started (flows/lifetime.py). Real processes: Prefect's temporary server, MLflow's server tree.

The command runs as ``python -m flows.cli`` from this checkout, which goes through the same ``entry`` as the
console script (checked below), so that these tests exercise the code of the tree they are in.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from contextlib import suppress
from pathlib import Path

import httpx
import psutil
import pytest
from helpers import build_llama, free_port, make_text, place_prefect_database, write_config
from helpers import wait_for as waiting

ROOT = Path(__file__).resolve().parents[1]
STOPPED_WITHIN_S = 20

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="the supervisor and its prctl settings are Linux's"),
              pytest.mark.slow]


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
    """``ppl-audit ARGS`` in the background, in a home of its own that marks every process it starts.

    Args:
        database: a Prefect database to start from (``prefect_database``), copied into the home.
        prefix: what it runs under (``timeout 30``).
        terminal: in a session of its own whose controlling terminal is a pty (``ctrl_c`` types on it), as in a
            shell; else in a process group of its own (a process manager's way), so a signal to the group does
            not reach the tests.
    """

    def __init__(self, tmp_path: Path, *args: str, database: Path, prefix: tuple[str, ...] = (), terminal: bool = False,
                 api: str | None = None):
        self.home = tmp_path / "home"
        place_prefect_database(database, self.home / "prefect")  # as a user's earlier command left it
        env = {name: value for name, value in os.environ.items()
               if name not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}  # Prefect's local mode, the local store
        env.update(PREFECT_HOME=str(tmp_path / "prefect"), PPL_AUDIT_HOME=str(self.home),
                   PPL_AUDIT_CACHE=str(tmp_path / "cache"), PPL_AUDIT_REFERENCES=str(tmp_path / "cache" / "references"),
                   PREFECT_RUNNER_POLL_FREQUENCY="1")  # `serve` starts a new flow run within 1 s, not 10
        if api is not None:  # a Prefect server of the user's: PREFECT_API_URL set
            env["PREFECT_API_URL"] = api
        self.log = tmp_path / "command.log"
        self.terminal = None
        with open(self.log, "w") as log:
            if terminal:
                self.terminal, tty = os.openpty()
                threading.Thread(target=self._copy_terminal, daemon=True).start()
                streams = {"stdin": tty, "stdout": tty, "stderr": tty,
                           "preexec_fn": lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0)}  # after setsid: its terminal
            else:
                streams = {"stdout": log, "stderr": subprocess.STDOUT}
            self.process = psutil.Popen([*prefix, sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env,
                                        start_new_session=True, **streams)
            if terminal:
                os.close(tty)
        self.recorded: list[psutil.Process] = []
        self.signalled_at = 0.0

    def _copy_terminal(self) -> None:
        with open(self.log, "ab") as log:
            with suppress(OSError):  # EIO once the terminal's last process has closed it
                while chunk := os.read(self.terminal, 4096):
                    log.write(chunk)
                    log.flush()

    def ctrl_c(self) -> None:
        """Type Ctrl-C on its terminal: the kernel sends SIGINT to the terminal's foreground process group."""
        self.recorded = alive(self.process.children(recursive=True))
        self.signalled_at = time.monotonic()
        os.write(self.terminal, b"\x03")

    def signal_group(self, signum: int) -> None:
        """``kill -SIG -PGID``: what systemd's default stop and many supervisors send."""
        self.recorded = alive(self.process.children(recursive=True))
        self.signalled_at = time.monotonic()
        os.killpg(self.process.pid, signum)

    def ended_within(self, seconds: float) -> int:
        """The exit code of the process the user started, which must end within ``seconds`` of the signal."""
        try:
            return self.process.wait(timeout=max(0.0, self.signalled_at + seconds - time.monotonic()))
        except psutil.TimeoutExpired:
            raise AssertionError(f"still running {seconds} s after the signal:\n{self.log.read_text()[-2000:]}") from None

    def signal(self, signum: int, to_child: bool = False) -> None:
        """Record every descendant, then signal the process the user started (or its first child)."""
        self.recorded = alive(self.process.children(recursive=True))
        self.signalled_at = time.monotonic()
        (self.process.children()[0] if to_child else self.process).send_signal(signum)

    def assert_all_gone(self, port: int | None) -> int | None:
        """Within STOPPED_WITHIN_S: each recorded descendant and anything else started with this home has
        ended, and nothing listens on the port (of a server it started). The exit code of the process the user
        started."""
        def gone() -> bool:
            return not alive(self.recorded) and not started_by(self.home) and not (port and listening(port))

        deadline = time.monotonic() + STOPPED_WITHIN_S
        while time.monotonic() < deadline and not gone():
            time.sleep(0.2)
        left = sorted({f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in alive(self.recorded + started_by(self.home))})
        assert not left, f"still running {STOPPED_WITHIN_S} s after the signal:\n" + "\n".join(left)
        assert not (port and listening(port)), f"port {port} still listens"
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
        if self.terminal is not None:
            with suppress(OSError):
                os.close(self.terminal)


@pytest.fixture
def command(tmp_path, prefect_database):
    commands: list[Command] = []

    def start(*args: str, **how) -> Command:
        commands.append(Command(tmp_path, *args, database=prefect_database, **how))
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


def served_api(started: Command) -> int:
    """The port on which the command's temporary Prefect server listens. Not ``prefect_server``'s first answer:
    a server whose random port was taken meanwhile exits with 3, and Prefect starts another on another port."""
    def answering() -> int | None:
        server = descendant(started.process, "uvicorn", "prefect.server.api.server:create_app")
        return port_of(server) if server and listening(port_of(server)) else None

    return wait_for(answering, 120, "the served API")


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
    port = served_api(serve)
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


# --- every way of stopping a command, at each stage (#30): within STOP_S, exit 128+signal, one line, nothing left

STOP_S = 10


@pytest.fixture
def long_config(tmp_path, tiny_model_dir) -> Path:
    """An audit whose variants score for seconds after its baseline's reference is written (60,000 tokens each,
    some 5 s on an idle core): long enough to be stopped in the middle, which the tests do as soon as that reference
    is seen. 150,000 before: the baseline, scored whole before any test signals, took 2.5 times as long. 30,000 was
    too short: on a slower machine (2026-11-29) the variants had finished and their record was spooled before
    SIGTERM's stop ended the audit."""
    corpus = tmp_path / "long.txt"
    corpus.write_text(make_text(60000))
    return write_config(tmp_path / "long.yaml", tiny_model_dir, corpus,
                        [{"name": "copy", "path": str(tiny_model_dir)}, {"name": "int8", "method": "torchao-int8"}],
                        evaluation={"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 60000})


def references(started: Command) -> list[Path]:
    root = started.home.parent / "cache" / "references"
    return [folder for folder in root.iterdir() if not folder.name.startswith(".")] if root.is_dir() else []


def the_line(started: Command, signum: int) -> str:
    """The one line an interrupted command ends with: its own, or the supervisor's for a command that had not
    said its own 6 s after the signal (the exception a signal handler raises is lost when it lands in a
    ``__del__``, as it can at any moment: then the command is killed, by design). Never both: a command whose
    cleanup outlasts those 6 s after its line is killed silently."""
    lines = [line.removeprefix("^C") for line in started.log.read_text(errors="replace").splitlines()  # the terminal echoes Ctrl-C
             if "interrupted" in line]
    pattern = rf"ppl-audit: interrupted by {signal.Signals(signum).name}( \(killed: .*\))?; kept: "
    assert len(lines) == 1 and re.match(pattern, lines[0]), started.log.read_text()[-3000:]
    return lines[0]


WAYS = {"sigterm": (signal.SIGTERM, "process"), "sigint": (signal.SIGINT, "process"),
        "sigterm-to-the-group": (signal.SIGTERM, "group"), "sigint-to-the-group": (signal.SIGINT, "group"),
        "sighup-to-the-group": (signal.SIGHUP, "group"), "ctrl-c": (signal.SIGINT, "terminal")}


@pytest.mark.parametrize("way", WAYS)
def test_an_audit_stopped_while_scoring_ends_at_once_and_says_what_it_kept(command, long_config, way):
    """Before the fix a signal to the group reached Prefect's temporary server too: it died first, and the
    audit waited minutes on it to record the flow run as crashed."""
    signum, to = WAYS[way]
    run = command("run", str(long_config), terminal=to == "terminal")
    port = prefect_server(run)
    wait_for(lambda: references(run), 240, "the baseline's reference (the variants are scoring)")
    if to == "terminal":
        run.ctrl_c()
    elif to == "group":
        run.signal_group(signum)
    else:
        run.signal(signum)
    assert run.ended_within(STOP_S) == 128 + signum
    assert the_line(run, signum).endswith(f"kept: baseline reference {references(run)[0].name}")
    run.assert_all_gone(port)
    assert not list((run.home / "spool").glob("*")), "no record of an audit that did not end"
    # Prefect's flow runs are kept in the audit's home, not in Prefect's (#30: ~/.prefect/prefect.db grew)
    with sqlite3.connect(run.home / "prefect" / "prefect.db") as db:
        assert db.execute("select count(*) from flow_run").fetchone() == (1,)
    assert not list(run.home.parent.glob("prefect/*.db"))


def test_an_audit_under_timeout_ends_when_it_fires(command, long_config):
    """``timeout`` signals the command, then its own process group: the audit's, as a process manager's does.
    It is made to fire while the variants score by a SIGTERM of its own, which it handles as its timer's (one
    ``cleanup`` in coreutils): a fixed duration fired before scoring on a slow machine, after it on a fast one."""
    run = command("run", str(long_config), prefix=("timeout", "--preserve-status", "600"))
    port = prefect_server(run)
    wait_for(lambda: references(run), 240, "the baseline's reference (the variants are scoring)")
    run.signal(signal.SIGTERM)
    assert run.ended_within(STOP_S) == 128 + signal.SIGTERM
    the_line(run, signal.SIGTERM)
    run.assert_all_gone(port)


def test_an_audit_stopped_while_its_server_starts_ends_at_once(command, long_config):
    run = command("run", str(long_config))
    port = port_of(wait_for(lambda: descendant(run.process, "uvicorn"), 120, "Prefect's temporary server's process"))
    run.signal_group(signal.SIGTERM)
    assert run.ended_within(STOP_S) == 128 + signal.SIGTERM
    assert the_line(run, signal.SIGTERM).endswith("kept: nothing")
    run.assert_all_gone(port)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_ppl_stopped_while_scoring_ends_at_once(command, tiny_model_dir, tmp_path, signum):
    """On a terminal, whose scoring bar (the variant's name) says when scoring has begun: the signal follows it at
    once. Before, a fixed 8 s after the command started (its log file is made at once), which a busy machine could
    still spend tokenizing, and an idle one spent scoring for nothing."""
    corpus = tmp_path / "long.txt"
    corpus.write_text(make_text(150000))  # ~210k tokens: scoring lasts well past the signal (25k tok/s when idle)
    ppl = command("ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--window", "64",
                  "--method", "torchao-int8", terminal=True)
    # a terminal has a size: a new pty's is none, at which tqdm draws every bar zero columns wide, naming nothing
    fcntl.ioctl(ppl.terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    wait_for(lambda: "int8" in ppl.log.read_text(errors="replace"), 120, "scoring")
    ppl.signal_group(signum)
    assert ppl.ended_within(STOP_S) == 128 + signum
    the_line(ppl, signum)
    assert not alive(ppl.recorded)


def test_reference_build_stopped_while_scoring_keeps_nothing_half_written(command, long_config):
    build = command("reference", "build", str(long_config))
    port = prefect_server(build)
    building = build.home.parent / "cache" / "references" / ".building"
    wait_for(lambda: building.is_dir() and any(building.iterdir()), 240, "the reference being written")
    build.signal_group(signal.SIGINT)
    assert build.ended_within(STOP_S) == 128 + signal.SIGINT
    assert the_line(build, signal.SIGINT).endswith("kept: nothing")
    build.assert_all_gone(port)
    assert not references(build)


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A 24-layer Llama, 128 wide: GPTQ takes ~12 s over its layers here (the 2-layer one ~1 s, so it could
    finish between the test seeing it start and the signal)."""
    folder = tmp_path_factory.mktemp("deep-llama")
    build_llama(folder, tokenizer, hidden_size=128, intermediate_size=256, num_hidden_layers=24,
                initializer_range=0.02)
    return folder


def test_quantize_stopped_while_quantizing_ends_at_once(command, deep_model_dir, corpus_path, tmp_path):
    out = tmp_path / "gptq"
    quantize = command("quantize", "--model", str(deep_model_dir), "--method", "gptq", "--bits", "4",
                       "--group-size", "32", "--calibration", str(corpus_path), "--samples", "8", "--seq-len", "64",
                       "--out", str(out))
    port = prefect_server(quantize)
    scratch = quantize.home.parent / "cache" / "scratch"
    wait_for(lambda: scratch.is_dir() and any(scratch.iterdir()), 240, "quantizing under way")
    quantize.signal_group(signal.SIGTERM)
    assert quantize.ended_within(STOP_S) == 128 + signal.SIGTERM
    the_line(quantize, signal.SIGTERM)
    quantize.assert_all_gone(port)
    assert not out.exists(), "no half-made checkpoint"
    assert not (tmp_path / ".gptq.partial").exists(), "nor its parts beside it"


def test_serve_and_ui_stopped_by_their_group_end_at_once(command, config, tmp_path):
    serve = command("serve", str(config))
    port = served_api(serve)
    serve.signal_group(signal.SIGTERM)
    assert serve.ended_within(STOP_S) == 128 + signal.SIGTERM
    the_line(serve, signal.SIGTERM)
    serve.assert_all_gone(port)
    ui_port = free_port()
    ui = command("ui", "--port", str(ui_port))
    wait_for(lambda: listening(ui_port), 120, f"MLflow's server on port {ui_port}")
    ui.signal_group(signal.SIGINT)
    assert ui.ended_within(STOP_S) == 128 + signal.SIGINT
    the_line(ui, signal.SIGINT)
    ui.assert_all_gone(ui_port)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_serve_on_the_user_s_prefect_server_stopped_says_so_and_exits_128_plus_the_signal(
        command, tmp_path, tiny_model_dir, corpus_path, prefect_harness, signum):
    """``serve`` as the README runs it, PREFECT_API_URL set: stopped, it pauses its deployments (Prefect's runner)
    and ends like every command, 128+signal and one line. Before, Prefect's runner turned SIGTERM into exit 0 and
    swallowed Ctrl-C: a stopped serve looked to its process manager as if it had ended by itself, and said
    nothing. (Under a temporary server the supervisor's line came only because that server's shutdown was slow.)"""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    name = f"stopped-{signum.name.lower()}"
    config = write_config(tmp_path / "audit.yaml", tiny_model_dir, corpus_path,
                          [{"name": "copy", "path": str(tiny_model_dir)}], name=name)
    serve = command("serve", str(config), api=PREFECT_API_URL.value())
    with get_client(sync_client=True) as api:  # its runner has registered the deployment, then starts serving
        waiting(lambda: api.read_deployment_by_name(f"ppl-audit/{name}"), 120, "the served deployment", every=0.2,
                tolerate=(ObjectNotFound,))
    time.sleep(1)
    serve.signal_group(signum)
    assert serve.ended_within(STOP_S) == 128 + signum, serve.log.read_text()[-3000:]
    the_line(serve, signum)
    serve.assert_all_gone(None)


def supervised_then_stopped(tmp_path, main: str, within: float, signum: signal.Signals = signal.SIGTERM
                            ) -> tuple[int, int, list, str, float]:
    """Run ``main`` (the source of a function ``main`` that starts a process, prints ``started``, then sleeps)
    under ``lifetime.run``, and send ``signum`` to its group: ``(exit code, processes it started, those still
    alive, its stderr, seconds it took to end)``; whatever is left is killed."""
    program = tmp_path / "program.py"
    program.write_text("import atexit, signal, subprocess, sys, time\nfrom flows import lifetime\n\n"
                       + textwrap.dedent(main) + "\nlifetime.run(main, lambda signum, killed: "
                       "f'{\"killed\" if killed else \"ended\"} after {signum.name}')\n")
    process = psutil.Popen([sys.executable, str(program)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    assert process.stdout.readline() == "started\n"
    started = alive(process.children(recursive=True))
    signalled = time.monotonic()
    os.killpg(process.pid, signum)
    try:
        code = process.wait(timeout=within)
    finally:
        left = alive(started)
        for each in left + alive([process]):
            each.kill()
    return code, len(started), left, process.stderr.read(), time.monotonic() - signalled


def test_a_child_that_does_not_stop_is_killed_with_everything_it_started(tmp_path):
    """A signal handler's exception can be swallowed (raised inside a ``__del__`` it is only printed: it
    happened to an audit stopped while scoring). Here the command ignores SIGTERM outright, and has started
    a process of its own: both must be gone within STOP_S, with the supervisor's line and 143."""
    code, started, left, stderr, took = supervised_then_stopped(tmp_path, """
        def main():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
            print("started", flush=True)
            time.sleep(300)
            return 0
    """, STOP_S)
    assert started == 2 and code == 128 + signal.SIGTERM and not left, (started, code, left)
    assert stderr == "killed after SIGTERM\n"
    assert took < STOP_S


def test_a_ctrl_c_that_lands_inside_a_del_still_stops_the_command_at_once(tmp_path):
    """Python only prints an exception raised inside a ``__del__``: a Ctrl-C that landed there was lost, and the
    command went on (a ``ppl`` finished and said 0; a reference build published its reference) until the
    supervisor killed it. It is raised again a moment later, outside the ``__del__``."""
    code, _, _, stderr, took = supervised_then_stopped(tmp_path, """
        class Slow:
            def __del__(self):
                print("started", flush=True)  # the test signals now: the signal lands inside this __del__
                time.sleep(1)

        def main():
            try:
                Slow()
                while True:
                    time.sleep(0.1)
            except KeyboardInterrupt:
                print("interrupted", file=sys.stderr, flush=True)
                lifetime.said_interrupted()
                return 128 + signal.SIGINT
    """, STOP_S, signal.SIGINT)
    assert code == 128 + signal.SIGINT and stderr == "interrupted\n", stderr
    assert took < 2


def test_a_stop_that_a_library_swallows_still_ends_the_command_with_128_plus_the_signal_and_its_line(tmp_path):
    """A SIGHUP to the group while an audit scored once ended it with 1 and no line (CI, 2026-11-29): the exception
    the signal raised went through Prefect's engine, which can record it as the flow run's crash and return that
    state, and the command then said the audit failed. However the child ends after a signal, the command ends with
    128 + the signal and the interrupted line (the supervisor's, when the child said none)."""
    code, _, _, stderr, took = supervised_then_stopped(tmp_path, """
        def main():
            print("started", flush=True)
            try:
                time.sleep(300)
            except BaseException:  # recorded as a crash, and returned as a state
                return 1
    """, STOP_S, signal.SIGHUP)
    assert code == 128 + signal.SIGHUP and stderr == "ended after SIGHUP\n", (code, stderr)
    assert took < 2


def test_a_child_whose_cleanup_outlasts_the_grace_is_killed_without_a_second_line(tmp_path):
    """A command that said how it was interrupted, then cleans up for longer than STOP_S (Prefect stopping
    its server on a busy machine): it is killed with what it started, and its line stays the only one.
    Before, the supervisor added its own."""
    code, started, left, stderr, took = supervised_then_stopped(tmp_path, """
        def main():
            atexit.register(time.sleep, 300)
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            print("started", flush=True)
            try:
                time.sleep(300)
            except SystemExit:
                print("interrupted, said", file=sys.stderr, flush=True)
                lifetime.said_interrupted()
                raise
            return 0
    """, STOP_S + 5)
    assert started == 2 and code == 128 + signal.SIGTERM and not left, (started, code, left)
    assert stderr == "interrupted, said\n"
    assert took < STOP_S + 5


def test_ctrl_z_stops_the_command_with_its_servers_and_fg_continues_them(command, long_config):
    """Job control as a shell does it: Ctrl-Z (SIGTSTP to the terminal's foreground group: the supervisor),
    then SIGCONT to that group (``fg``). Before, the command went on running in the background."""
    run = command("run", str(long_config), terminal=True)
    prefect_server(run)
    wait_for(lambda: references(run), 240, "the baseline's reference (the variants are scoring)")
    os.write(run.terminal, b"\x1a")
    everything = [run.process, *alive(run.process.children(recursive=True))]
    wait_for(lambda: all(p.status() == psutil.STATUS_STOPPED for p in everything), 10, "every process stopped")
    os.killpg(run.process.pid, signal.SIGCONT)
    wait_for(lambda: not any(p.status() == psutil.STATUS_STOPPED for p in everything), 10, "every process running")
    run.ctrl_c()
    assert run.ended_within(STOP_S) == 128 + signal.SIGINT


def test_an_audit_stopped_while_tracking_ends_at_once_and_keeps_its_record(command, tmp_path, tiny_model_dir,
                                                                           corpus_path):
    """The tracking server accepts the connection and never answers (MLflow waits 30 s a try): the record is
    already spooled, and the line says so."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        config = write_config(tmp_path / "t.yaml", tiny_model_dir, corpus_path, [{"name": "copy", "path": str(tiny_model_dir)}],
                              tracking={"uri": f"http://127.0.0.1:{silent.getsockname()[1]}"})
        run = command("run", str(config))
        port = prefect_server(run)
        spooled = wait_for(lambda: [f for f in (run.home / "spool").glob("[!.]*") if (f / "record.json").is_file()], 240,
                           "the audit's record in the spool (tracking under way)")
        silent.settimeout(240)  # tracking under way: MLflow has connected, and waits for an answer (2 s of sleep before)
        held, _ = silent.accept()
        run.signal_group(signal.SIGTERM)
        assert run.ended_within(STOP_S) == 128 + signal.SIGTERM
        held.close()
    kept = rf"baseline reference \w+, record {spooled[0].name} \(spooled: ppl-audit sync sends it\)"
    assert re.fullmatch(rf"ppl-audit: interrupted by SIGTERM( \(killed: .*\))?; kept: {kept}", the_line(run, signal.SIGTERM))
    run.assert_all_gone(port)
