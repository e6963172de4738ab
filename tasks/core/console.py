"""The user's terminal: answers and progress bars go there, library output goes to a log file.

``ppl-audit`` sends its process's stdout and stderr (file descriptors 1 and 2, so that C extensions,
``warnings``, Prefect's and gptqmodel's logs and child processes follow) to a log file and keeps the
terminal here (``capture``). Used as a library, nothing is captured and both are the process's own.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from contextlib import suppress
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

_terminal: tuple[TextIO, TextIO] | None = None
_live: tuple[threading.Thread, int] | None = None  # with --verbose: the thread copying the log to the terminal, the log


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


class _Forgiving(io.TextIOBase):
    """A text stream on a file descriptor that drops what cannot be written.

    Library output goes to the log file: a full disk (ENOSPC) or a size limit (EFBIG) there must cost the
    log only, not raise from a ``print`` or a logger in the middle of an audit before its record is kept.
    Unbuffered, so a failed write leaves nothing behind to fail again.
    """

    def __init__(self, fd: int, encoding: str) -> None:
        super().__init__()
        self._fd, self._encoding = fd, encoding

    @property
    def encoding(self) -> str:
        return self._encoding

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        _write(self._fd, text.encode(self._encoding, "replace"))
        return len(text)


def _write(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, or as much as fits before it fails."""
    with suppress(OSError):
        while data:
            data = data[os.write(fd, data):]


def _copy(source: int, *targets: int) -> None:
    while chunk := os.read(source, 1 << 16):
        for target in targets:
            _write(target, chunk)


def capture(log: Path, live: bool = False) -> None:
    """Send everything this process and its children write on stdout and stderr to ``log``.

    The terminal stays reachable through ``out`` and ``err``. Call once, at the start of a command,
    from the command line's entry point only: it changes the process's file descriptors for good.

    Args:
        log: the log file (appended to; its folder is made).
        live: also copy the log to the terminal's stderr as it is written (``--verbose``).
    """
    global _terminal, _live
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = (os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding, errors="replace"),
                os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="replace"))
    log.parent.mkdir(parents=True, exist_ok=True)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if live:
        reader, writer = os.pipe()
        # daemon: children may hold the write end after ``settle``
        copier = threading.Thread(target=_copy, args=(reader, target, terminal[1].fileno()), daemon=True)
        copier.start()
        _live = (copier, os.dup(target))
        target = writer
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    sys.stdout, sys.stderr = _Forgiving(1, sys.stdout.encoding), _Forgiving(2, sys.stderr.encoding)
    _terminal = terminal


def settle(timeout: float = 5) -> None:
    """With ``live``: show the rest of what was written, then send fds 1 and 2 straight to the log, so that
    what the process writes while it exits is kept (in the log only) rather than cut off with the process.
    Call once the command's work is done, before its last line."""
    global _live
    if _live is None:
        return
    copier, log = _live
    os.dup2(log, 1)  # closes this process's write ends of the pipe: the copier reads to its end
    os.dup2(log, 2)
    os.close(log)
    copier.join(timeout)
    _live = None
