"""Signal handlers that raise, kept out of finalizers.

Python runs a signal's handler in the main thread at the next bytecode it executes, which may be inside a
``__del__`` that the garbage collector or a dropped reference started (an asyncio transport's, seen in the suite).
An exception raised there is only printed (``Exception ignored in``) and lost: the stop it carried never reaches
the code it was meant to end. So a handler wrapped here does not raise inside a finalizer: it sends the same signal
again a moment later, when the finalizer has returned.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from types import FrameType

AGAIN_S = 0.05  # a finalizer returns well within this; a signal sent again meanwhile lands in it once more, and waits

Handler = Callable[[int, FrameType | None], object]


def outside_finalizers(handler: Handler) -> Handler:
    """``handler``, but a signal that lands inside a ``__del__`` is sent again ``AGAIN_S`` later instead."""

    @functools.wraps(handler)
    def handle(signum: int, frame: FrameType | None) -> object:
        if finalizing(frame):
            threading.Timer(AGAIN_S, os.kill, (os.getpid(), signum)).start()
            return None
        return handler(signum, frame)

    handle.outside_finalizers = True  # type: ignore[attr-defined]  # wrapped once, however often it is asked
    return handle


def finalizing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a ``__del__`` (anywhere up its stack)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False
