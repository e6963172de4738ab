"""A scoring run whose result nobody waits for any more stops after its current batch.

A cluster's worker cannot interrupt a task it runs: when the audit that submitted a shard stops (Ctrl-C, a crash, a
cancelled flow run), Dask lets the task go, yet its thread scores on to the shard's end, which for a large model is
an hour of a GPU that others wait for. So the engine asks between batches; who can tell (the Prefect step, which
knows the worker it runs on) says how, for the duration of one task (``asking``), never for the process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tasks.core.errors import Abandoned

_why: ContextVar[Callable[[], str | None] | None] = ContextVar("ppl_audit_abandoned", default=None)


@contextmanager
def asking(why: Callable[[], str | None]) -> Iterator[None]:
    """Within this block, ``check`` asks ``why()``: None while the result is still wanted, else the reason."""
    token = _why.set(why)
    try:
        yield
    finally:
        _why.reset(token)


def check() -> None:
    """Raise ``Abandoned`` if the run in progress is no longer wanted (never outside ``asking``)."""
    why = _why.get()
    reason = why() if why is not None else None
    if reason:
        raise Abandoned(reason)
