"""Whatever ``ppl-audit`` starts ends with it, however it is stopped (Linux; elsewhere ``run`` calls ``main``).

Prefect's local mode starts a temporary API server (uvicorn, ~220 MB) and stops it from an ``atexit``
handler; ``ppl-audit ui`` starts ``mlflow server``, which starts a uvicorn worker and a job runner. A
SIGTERM (whose default action skips ``atexit``) or a ``kill -9`` left all of them running and listening.

So the command runs in a forked child, and the process the user started becomes a thin supervisor:

- the child runs in a process group of its own, so a signal to the user's group (a terminal's Ctrl-C,
  ``timeout``, ``kill -TERM -PGID``, systemd's stop) reaches the supervisor alone, never the servers the
  child started (they must outlive the child's unwinding, which reports to them);
- Ctrl-Z stops the child's group with the supervisor, and ``fg``/``bg`` (SIGCONT) continues it;
- it forwards SIGTERM, SIGHUP and SIGINT to the child and exits with the child's status, or with 128 + the
  signal once it forwarded one, however the child ended; a child still running ``STOP_S`` after the first
  signal is killed, with its descendants. The supervisor says the interrupted line only when the child had not
  said its own (``said_interrupted``): an exception raised by a signal handler can be swallowed (inside a
  ``__del__``, it is only printed; by a library that records it as a crash and returns, as Prefect's engine can),
  or the child's cleanup can be slow, on a busy machine, after its line;
- the child gets SIGTERM when the supervisor dies, ``kill -9`` included (``PR_SET_PDEATHSIG``);
- on SIGTERM or SIGHUP the child exits as on an exception, not at once: ``finally`` and ``with`` blocks
  run, and ``atexit`` handlers such as Prefect's, which stops its server (a signal that lands in a
  ``__del__`` is sent again a moment later, outside it: ``tasks.core.signals``). (During a flow run Prefect's
  own handler comes first, kept out of finalizers the same way (``tasks.models.patches``): it records the run as
  crashed, then hands the signal on; ``serve``'s runner
  replaces the handler with its own, which shuts the runner down and exits);
- when the child ends, every descendant still there is stopped: by the child as its last ``atexit``
  handler, by the supervisor if the child was killed outright (the OOM killer picks the biggest
  process). Both are subreapers, so a process whose own parent died first is still found.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from types import FrameType
from typing import NoReturn

from tasks.core.signals import outside_finalizers

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

GRACE_S = 5.0  # between SIGTERM and SIGKILL of a descendant (uvicorn lets its requests finish)
# A signalled child that has not ended by then is killed, and its descendants given KILL_GRACE_S: a command
# ends within ~8 s of the first signal, however its unwinding went
STOP_S = 6.0
KILL_GRACE_S = 1.5

STOPPING = (signal.SIGTERM, signal.SIGHUP)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
JOB_CONTROL = (signal.SIGTSTP, signal.SIGCONT)  # Ctrl-Z and fg/bg: the child's group follows the supervisor

_said: int | None = None  # in the child: the pipe ``said_interrupted`` writes to the supervisor
_signalled = False  # in the child: it was interrupted, so its descendants get KILL_GRACE_S, not GRACE_S


def run(main: Callable[[], int], unsaid: Callable[[signal.Signals, bool], str]) -> NoReturn:
    """Exit with ``main()``'s code; on Linux, run it in a supervised child (see the module's docstring).

    Args:
        unsaid: the line to print for a signalled child that ended without saying its own (``said_interrupted``):
            killed (True) because it had not stopped within ``STOP_S``, or ended by itself (False) because the
            exception the signal raised was swallowed on its way out.
    """
    global _said
    if not sys.platform.startswith("linux"):
        sys.exit(main())
    watched = {*FORWARDED, *JOB_CONTROL, signal.SIGCHLD}
    # blocked before the fork: none is lost (or acts by default) before the supervisor waits for it
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    supervisor = os.getpid()
    heard, _said = os.pipe()  # close-on-exec: the processes the child starts do not hold it
    child = os.fork()
    if child:
        os.close(_said)
        os.set_blocking(heard, False)
        _supervise(child, watched, lambda signum, killed: "" if _read(heard) else unsaid(signum, killed))
    os.close(heard)
    # a group of its own: a signal to the user's group (systemd's stop, `timeout`, `kill -TERM -PGID`, a
    # terminal's Ctrl-C) reaches the supervisor alone, which hands it on once. Before this, the same signal
    # also reached Prefect's temporary server, which died first, and the child then waited minutes on it
    # to record its flow run as crashed
    os.setpgid(0, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for signum in STOPPING:
        signal.signal(signum, _stop)
    signal.signal(signal.SIGINT, _interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)  # processes it starts inherit its mask
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # the supervisor died before the line above: no signal will come
        sys.exit(128 + signal.SIGTERM)
    atexit.register(lambda: stop_descendants(KILL_GRACE_S if _signalled else GRACE_S))  # registered first, so
    sys.exit(main())  # it runs last: after Prefect stops its server


def said_interrupted() -> None:
    """Tell the supervisor the command has said how it was interrupted: if its cleanup then outlasts
    ``STOP_S``, it is killed without a second line; and what it started gets a short grace. Nothing outside
    ``run``'s child."""
    global _signalled
    _signalled = True
    if _said is not None:
        with suppress(OSError):
            os.write(_said, b"!")


def _read(heard: int) -> bool:
    with suppress(BlockingIOError):
        return bool(os.read(heard, 1))
    return False


SWEEPS = 3  # a process that a descendant starts while it is being stopped is found by the next sweep


def stop_descendants(grace: float = GRACE_S) -> None:
    """SIGTERM every descendant, then SIGKILL those still running ``grace`` seconds later; again while any is left:
    one started meanwhile (a server's worker, spawned as the server went down) was not among those found, and
    outlived the command (seen once in the suite: ``ui`` killed with ``kill -9``, a multiprocessing child left)."""
    import psutil

    for _ in range(SWEEPS):
        found = psutil.Process().children(recursive=True)
        if not found:
            return
        for process in found:
            with suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(found, timeout=grace)
        for process in alive:
            with suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=grace)


def _supervise(child: int, watched: set[signal.Signals], unsaid: Callable[[signal.Signals, bool], str]) -> NoReturn:
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stopping: signal.Signals | None = None
    deadline = float("inf")
    while True:
        info = signal.sigtimedwait(watched, max(0.0, deadline - time.monotonic())) if stopping else \
            signal.sigwaitinfo(watched)
        if info is None:  # the child is stuck: a handler's exception was swallowed (in a __del__, say)
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            stop_descendants(KILL_GRACE_S)
            _stopped(stopping, unsaid(stopping, True))
        if info.si_signo == signal.SIGTSTP:
            os.killpg(child, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
            continue
        if info.si_signo == signal.SIGCONT:
            os.killpg(child, signal.SIGCONT)
            continue
        if info.si_signo != signal.SIGCHLD:
            os.kill(child, info.si_signo)
            if stopping is None:
                stopping, deadline = signal.Signals(info.si_signo), time.monotonic() + STOP_S
            continue
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            break
    stop_descendants()
    if stopping is not None:  # it was asked to stop, whatever it returned (seen once in CI: 1, on SIGHUP)
        _stopped(stopping, unsaid(stopping, False))
    code = os.waitstatus_to_exitcode(status)
    # _exit: this is a copy of the process the child already is; its buffers and atexit handlers are the child's
    os._exit(128 - code if code < 0 else code)


def _stopped(signum: signal.Signals, line: str) -> NoReturn:
    """End the supervisor of a child stopped by ``signum``, with ``line`` (none when the child said its own)."""
    if line:
        print(line, file=sys.stderr, flush=True)
    os._exit(128 + signum)


@outside_finalizers  # an exception raised inside a __del__ is only printed: raised a moment later instead
def _stop(signum: int, frame: FrameType | None) -> None:
    for stopping in STOPPING:
        signal.signal(stopping, _again)
    raise SystemExit(128 + signum)


@outside_finalizers
def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Python's own SIGINT handling (``KeyboardInterrupt``), but not lost inside a ``__del__``, where it would only
    be printed and the command would go on until the supervisor kills it."""
    raise KeyboardInterrupt


def _again(signum: int, frame: FrameType | None) -> None:
    """A second SIGTERM or SIGHUP must not interrupt the unwinding the first began. Not SIG_IGN: processes
    started while unwinding would inherit it and ignore SIGTERM themselves."""


def _prctl(option: int, value: int) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")
