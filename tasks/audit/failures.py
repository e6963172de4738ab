"""One model's failure as a value (``Failure``), so that the other models of an audit carry on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from tasks.core.errors import Abandoned, InputError, NumericalError, TransientError, WorkerError, one_line

T = TypeVar("T")

OUT_OF_MEMORY = "out of memory at batch size 1; use a smaller window or a larger device"


@dataclass(frozen=True)
class Failure:
    """Why one model failed (one line), and whether another worker may not fail so (``retry_elsewhere``: out of
    memory, a crash, an unexpected error)."""

    reason: str
    retry_elsewhere: bool = False


def attempt(call: Callable[[], T]) -> T | Failure:
    """``call()``, or its failure as a ``Failure``; only a ``TransientError`` (network, remote storage) escapes, for
    the caller to retry."""
    try:
        return call()
    except torch.OutOfMemoryError:
        return Failure(OUT_OF_MEMORY, True)
    except TransientError:
        raise
    except (InputError, NumericalError, Abandoned) as error:
        return Failure(one_line(error))
    except WorkerError as error:
        return Failure(one_line(error), True)
    except Exception as error:  # any other failure of one model must not lose the others
        return Failure(f"{type(error).__name__}: {one_line(error)}", True)
