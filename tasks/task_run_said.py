"""What Prefect says of the task run in progress (``prefect.runtime.task_run.parameters``: the arguments the task was
called with), read once into a typed value for the run's name (``tasks.steps``). This module alone reads its keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.audit.pieces import Piece


@dataclass(frozen=True)
class TaskRun:
    """The arguments a task run's name is made of: the ``model`` its checkpoint names, the ``piece`` of it scored
    (None: the whole model, or a task that scores none) and the ``sets`` of decoder layers restored (None: none)."""

    model: str
    piece: Piece | None
    sets: list[tuple[int, ...]] | None


def task_run() -> TaskRun:
    """The task run in progress, as its parameters say."""
    from prefect.runtime import task_run as running

    parameters = running.parameters
    return TaskRun(parameters["checkpoint"].name, parameters.get("piece"), parameters.get("sets"))
