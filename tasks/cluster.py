"""An existing Dask cluster as an audit uses it: reachable, its workers seeing the models' files, and which
worker scored each model. Checked before any model is loaded, each problem one line."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from tasks.errors import InputError

CONNECT_SECONDS = 5  # a scheduler that does not answer in this long is down or firewalled, not slow


def check_reachable(address: str) -> None:
    """Refuse a scheduler address nothing answers at (``auto`` is Ray's to resolve)."""
    if address == "auto":
        return
    parsed = urlparse(address)
    if parsed.hostname is None or parsed.port is None:
        raise InputError(f"runner.address '{address}' names no host and port (e.g. tcp://10.0.0.5:8786)")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=CONNECT_SECONDS).close()
    except OSError as error:
        raise InputError(f"runner.address {address}: nothing answers there ({error.strerror or error}); start "
                         "the scheduler or correct the address") from None


def _missing(paths: list[str]) -> list[str]:
    """On a worker: which of ``paths`` it cannot see."""
    return [path for path in paths if not Path(path).exists()]


def check_workers_see(address: str, paths: dict[str, str]) -> None:
    """Refuse local model paths (``{whose: path}``) that a worker of the Dask cluster at ``address`` cannot
    see: workers load the models themselves, from a path every worker sees or a Hub id / ``models:/`` URI."""
    from distributed import Client

    with Client(address, timeout=CONNECT_SECONDS * 6, set_as_default=False) as client:
        unseen = client.run(_missing, list(paths.values()))
    for worker, missing in sorted(unseen.items()):
        if missing:
            whose = next(name for name, path in paths.items() if path == missing[0])
            raise InputError(f"runner.address: worker {worker} cannot see {missing[0]} ({whose}); put the models "
                             "where every worker sees them at the same path, or give a Hub id or models:/ URI")


def worker() -> str:
    """Where this code runs: the Dask worker's address, else this host and process."""
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):  # ValueError: not inside a Dask worker
        return f"{socket.gethostname()} (pid {os.getpid()})"
