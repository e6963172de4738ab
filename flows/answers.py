"""A flow that ends Failed with an answer (a failed verdict, a refusal) is not a crash: one line, no traceback."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefect.states import Failed

if TYPE_CHECKING:
    from tasks.record.result import AuditResult


class AuditFailed(Exception):
    """A flow's answer that is not a pass (a failed verdict, a refusal), as the data of its Failed state;
    ``result`` is what ``audit`` found (its ``AuditResult``).

    Prefect 3 resolves a Failed state's data into the exception a run raises, so it must be one.
    """

    def __init__(self, reason: str, result: AuditResult | None = None):
        super().__init__(reason)
        self.result = result


class _VerdictIsNotACrash(logging.Filter):
    """Drops Prefect's traceback of an ``AuditFailed``; the run's log already ends with its one line.

    Under a deployment Prefect 3.8 re-raises a Failed state's exception after the run ends and logs
    it with its traceback ("Engine execution exited with unexpected exception"): a few KB per audit
    that is judged failed, which is an answer, not a crash.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], AuditFailed))


def failed(reason: str, result: AuditResult | None = None):
    """A flow's Failed state for an answer (a verdict, a refusal), logged as one line, not a crash. The filter
    goes on where the run's process logs (it passes every record but one carrying an ``AuditFailed``), once
    per process."""
    runs = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, _VerdictIsNotACrash) for f in runs.filters):
        runs.addFilter(_VerdictIsNotACrash())
    return Failed(message=reason, data=AuditFailed(reason, result))


def failure_line(state) -> str:
    """A failed task's message in one line: Prefect's holds the whole exception, and a store's SQL error goes on
    with its statement for a page."""
    lines = (state.message or "").strip().splitlines()
    return lines[0] if lines else state.name


def where_logged(logged, tracking, kept) -> dict:
    """What a flow that logs one run to MLflow answers about it: ``mlflow_run_id`` (when ``logged``, the logging
    task's state, completed) and ``record``, the line that says where it is (with its link), and the local copy
    ``kept``."""
    from tasks.core.places import tracking_uri
    from tasks.record.tracking import run_link

    if not logged.is_completed():
        return {"record": f"kept in {kept} (tracking failed: {failure_line(logged)})"}
    run = logged.result()
    link = run_link(tracking_uri(tracking.uri), run)
    return {"mlflow_run_id": run, "record": f"MLflow run {run} (experiment {tracking.experiment})"
            + (f": {link}" if link else "") + f"; also in {kept}"}
