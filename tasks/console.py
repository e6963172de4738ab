"""The user's terminal: answers and progress bars go there, library output goes to a log file.

``ppl-audit`` sends its process's stdout and stderr (file descriptors 1 and 2, so that C extensions,
``warnings``, Prefect's and gptqmodel's logs and child processes follow) to a log file and keeps the
terminal here (``capture``). Used as a library, nothing is captured and both are the process's own.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

_terminal: tuple[TextIO, TextIO] | None = None


def out() -> TextIO:
    """Where answers go: the terminal's stdout."""
    return _terminal[0] if _terminal else sys.stdout


def err() -> TextIO:
    """Where progress bars and error lines go: the terminal's stderr."""
    return _terminal[1] if _terminal else sys.stderr


def bar(total: int, desc: str, unit: str = "it", enabled: bool = True) -> tqdm:
    """One stage's progress bar (rate and ETA included) on the terminal's stderr, when that is a terminal:
    redrawn bars would litter a CI log or a file with carriage returns."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit != "it", file=err(), dynamic_ncols=True,
                disable=not (enabled and err().isatty()))


def _copy(source: int, *targets: int) -> None:
    while chunk := os.read(source, 1 << 16):
        for target in targets:
            os.write(target, chunk)


def capture(log: Path, live: bool = False) -> None:
    """Send everything this process and its children write on stdout and stderr to ``log``.

    The terminal stays reachable through ``out`` and ``err``. Call once, at the start of a command,
    from the command line's entry point only: it changes the process's file descriptors for good.

    Args:
        log: the log file (appended to; its folder is made).
        live: also copy the log to the terminal's stderr as it is written (``--verbose``).
    """
    global _terminal
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = (os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding, errors="replace"),
                os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="replace"))
    log.parent.mkdir(parents=True, exist_ok=True)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if live:
        reader, writer = os.pipe()
        # daemon: the write end stays open in fds 1 and 2 until the process ends
        threading.Thread(target=_copy, args=(reader, target, terminal[1].fileno()), daemon=True).start()
        target = writer
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    _terminal = terminal
