"""The ``ppl-audit`` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from contextlib import suppress
from pathlib import Path
from typing import NoReturn

from flows import lifetime
from flows.commands import (audit, card, compare, diagnose, notify, ppl, quantize, reference, serve, setup, sync, tune,
                            ui)
from flows.commands.arguments import VERBOSE
from tasks.core import console
from tasks.core.errors import InputError, NumericalError, one_line
from tasks.core.places import check_places


def process_defaults() -> None:
    """The process's set-up, done once by the command line (and by the tests, which call flows directly):
    environment defaults the libraries read, and the loggers that are noise. A user's own setting wins."""
    import logging

    # Telemetry calls hang or fail without internet; users can still turn them back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's local mode starts a temporary server; on 2 busy cores it can take longer than the 20 s default
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # A dead tracking server must not hang an audit for minutes (MLflow's default retries take ~4 min).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # Offline (the Hugging Face Hub's switch), gptqmodel's Machete kernel must not try to download CUTLASS: its fetch
    # has no timeout; with GPTQMODEL_OFFLINE it fails at once, and the variant says which kernel: to give instead
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        os.environ.setdefault("GPTQMODEL_OFFLINE", "1")
    # bitsandbytes warns on every int8 forward that it casts inputs; once is news, every call is noise
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


# which commands' library output goes to a log file: each says (LOGGED), and `reference` of its actions
# (LOGGED_ACTIONS: build, verify). `serve`'s console is then what an operator reads (what is served, a line as each
# run starts and ends)
COMMANDS = (ppl, quantize, audit, diagnose, tune, compare, card, serve, ui, sync, setup, notify, reference)
LOG_BYTES = 256 * 2**20  # the oldest logs go beyond this


def _log_file(args: argparse.Namespace) -> Path:
    """``<home>/logs/<time>-<command>[-<config>]-<pid>.log``: one per command run, the oldest pruned."""
    from datetime import datetime

    from tasks.core.files import prune
    from tasks.core.places import log_dir

    folder = log_dir()
    if folder.is_dir():
        prune(folder, LOG_BYTES)
    # the config's name shortened: a name the file system takes whole may be too long beside the rest, and a
    # "cannot write the log" would blame the home for it
    about = f"-{Path(args.config).stem[:60]}" if getattr(args, "config", None) else ""
    return folder / f"{datetime.now():%Y%m%dT%H%M%S}-{args.command}{about}-{os.getpid()}.log"


class _Parser(argparse.ArgumentParser):
    """A wrong argument is one line, as any other bad input (argparse prints its usage block before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ppl-audit", description="Audit quantized LLMs by perplexity.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(commands)
        if command.LOGGED:
            commands.choices[command.NAME].add_argument("--verbose", action="store_true", help=VERBOSE)
    return parser


def main(argv: list[str] | None = None, capture: bool = False) -> int:
    """Run one command; returns its exit code.

    Args:
        capture: send library output to a log file under ``<home>/logs`` (named on stderr at the end),
            keeping the terminal for answers and progress bars. The console script does; tests calling
            ``main`` in-process do not, as it changes the process's stdout and stderr for good.
    """
    process_defaults()
    args = _parser().parse_args(argv)
    command = next(command for command in COMMANDS if command.NAME == args.command)
    logged = command.LOGGED or getattr(args, "action", None) in getattr(command, "LOGGED_ACTIONS", ())
    log = _log_file(args) if capture and logged else None
    if log is not None and not _captured(log, args.verbose):
        return 2
    code, started = 1, time.time()
    try:
        check_places()
        code = command.run(args)
    except KeyboardInterrupt:  # the one signal Python turns into an exception
        code = 128 + signal.SIGINT
        _say_interrupted(signal.SIGINT, started)
    except SystemExit as stop:  # flows.lifetime stops a command so on SIGTERM and SIGHUP
        if isinstance(stop.code, int) and stop.code - 128 in (signal.SIGTERM, signal.SIGHUP):
            code = stop.code
            _say_interrupted(signal.Signals(stop.code - 128), started)
        raise
    except InputError as error:
        print(f"ppl-audit: error: {error}", file=console.err())
        code = 2
    except NumericalError as error:
        print(f"ppl-audit: failed: {error}", file=console.err())
    except Exception as error:
        if log is None:
            raise
        traceback.print_exc()  # into the log
        print(f"ppl-audit: crashed: {type(error).__name__}: {one_line(error)}", file=console.err())
    finally:
        _settled(log, code)
    return code


def _settled(log, code: int) -> None:
    """The console flushed, and the log named on stderr; bad input's log (exit 2) removed: its one line says it all."""
    console.settle()
    if log is not None and code == 2:
        log.unlink(missing_ok=True)
    elif log is not None:
        print(f"log: {log}", file=console.err())


def _captured(log, live: bool) -> bool:
    """Library output sent to ``log`` (and to the terminal too when ``live``); False, said in one line, when the log
    cannot be written."""
    try:
        console.capture(log, live=live)
    except OSError as error:
        print(f"ppl-audit: error: cannot write the log {log} ({error.strerror}); set PPL_AUDIT_HOME to a "
              "folder you can write", file=sys.stderr)
        return False
    return True


def _say_interrupted(signum: signal.Signals, started: float) -> None:
    """Print the interrupted line, then tell the supervisor it was said (it adds none of its own)."""
    print(interrupted(signum, started), file=console.err(), flush=True)
    lifetime.said_interrupted()


def interrupted(signum: signal.Signals, started: float, how: str = "") -> str:
    """The one line an interrupted command ends with: which signal, and what it kept that later commands use
    (what was half-written is never picked up: references and records are renamed into place whole)."""
    from tasks.core.places import references_dir, spool_dir, synced_dir  # the standard library's only: said at once

    def since(root: Path, file: str) -> list[str]:  # folders put in place whole (not hidden), their file made since
        return sorted(found.parent.name for found in root.glob(f"[!.]*/{file}") if found.stat().st_mtime >= started)

    kept = [f"baseline reference {key}" for key in since(references_dir(), "manifest.json")]
    kept += [f"record {name} (in MLflow)" for name in since(synced_dir(), "record.json")]
    kept += [f"record {name} (spooled: ppl-audit sync sends it)" for name in since(spool_dir(), "record.json")]
    return f"ppl-audit: interrupted by {signum.name}{how}; kept: {', '.join(kept) if kept else 'nothing'}"


def entry() -> NoReturn:
    """The ``ppl-audit`` console script: ``main`` in a child that takes every process it started down with it,
    even when the process the user started is killed (flows/lifetime.py). Tests call ``main`` in-process."""
    from tasks.core.places import home

    # Prefect's local mode keeps its temporary server's database (every flow run, its parameters and logs) in
    # ~/.prefect; ours goes beside the audits' records, which PPL_AUDIT_HOME moves
    if "PREFECT_SERVER_DATABASE_CONNECTION_URL" not in os.environ:
        with suppress(OSError):  # an unwritable home is main's one line to say
            (home() / "prefect").mkdir(parents=True, exist_ok=True)
            os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{home() / 'prefect' / 'prefect.db'}"
    started = time.time()
    lifetime.run(lambda: main(capture=True), lambda signum, killed: interrupted(
        signum, started, f" (killed: it had not stopped {lifetime.STOP_S:g} s later)" if killed else ""))


if __name__ == "__main__":
    entry()
