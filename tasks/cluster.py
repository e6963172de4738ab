"""An existing Dask or Ray cluster as an audit uses it: reachable, its workers seeing the models' files and
offering the GPUs asked for, and which worker scored each model. Checked before any model is loaded, each
problem one line."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from tasks.config import Runner
from tasks.errors import InputError, one_line

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


def _dask_workers(address: str, paths: list[str]) -> dict[str, tuple[list[str], float]]:
    """Each worker of the Dask cluster at ``address``: the ``paths`` it cannot see, and the GPUs it offers
    (its ``GPU`` resource)."""
    from distributed import Client

    with Client(address, timeout=CONNECT_SECONDS * 6, set_as_default=False) as client:
        unseen = client.run(_missing, paths)
        offered = {worker: info.get("resources", {}).get("GPU", 0)
                   for worker, info in client.scheduler_info()["workers"].items()}
    return {worker: (unseen[worker], offered.get(worker, 0)) for worker in unseen}


def _ray_workers(address: str, paths: list[str]) -> dict[str, tuple[list[str], float]]:
    """Each live node of the Ray cluster at ``address`` (``auto``: the one on this machine): the ``paths`` a
    task placed on it cannot see, and the GPUs it offers."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as error:
        raise InputError(f"runner.address {address}: no Ray cluster answers ({one_line(error)}); start one with "
                         "`ray start --head` or correct the address") from None
    try:
        missing = ray.remote(num_cpus=0)(_missing)
        nodes = [node for node in ray.nodes() if node["Alive"]]
        on = [NodeAffinitySchedulingStrategy(node["NodeID"], soft=False) for node in nodes]
        unseen = ray.get([missing.options(scheduling_strategy=strategy).remote(paths) for strategy in on])
        return {f"ray node {node['NodeManagerAddress']}": (gone, node["Resources"].get("GPU", 0))
                for node, gone in zip(nodes, unseen)}
    finally:
        ray.shutdown()


def check_workers(runner: Runner, paths: dict[str, str]) -> None:
    """Refuse an existing cluster (``runner.address``) that cannot run the audit: a local model path
    (``{whose: path}``) that one of its workers cannot see (workers load the models themselves, from a path
    every worker sees or a Hub id / ``models:/`` URI), or no worker offering ``gpus_per_variant`` GPUs (its
    tasks would wait for one forever)."""
    survey = _dask_workers if runner.kind == "dask" else _ray_workers
    workers = survey(runner.address, list(paths.values()))
    for worker, (missing, _) in sorted(workers.items()):
        if missing:
            whose = next(name for name, path in paths.items() if path == missing[0])
            raise InputError(f"runner.address: worker {worker} cannot see {missing[0]} ({whose}); put the models "
                             "where every worker sees them at the same path, or give a Hub id or models:/ URI")
    most = max((gpus for _, gpus in workers.values()), default=0)
    if runner.gpus_per_variant > most:
        resource = "--resources GPU=N" if runner.kind == "dask" else "--num-gpus N"
        raise InputError(f"runner.gpus_per_variant is {runner.gpus_per_variant:g} but no worker of {runner.address} "
                         f"offers that many GPUs (the most is {most:g}); start workers with {resource} or lower it")


def worker() -> str:
    """Where this code runs: the Dask worker's address, the Ray node and process, else this host and process."""
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):  # ValueError: not inside a Dask worker
        pass
    if "ray" in sys.modules:  # only a Ray task's process has imported it
        import ray

        context = ray.get_runtime_context() if ray.is_initialized() else None
        if context is not None and context.get_task_id() is not None:
            node = next(n for n in ray.nodes() if n["NodeID"] == context.get_node_id())
            return f"ray node {node['NodeManagerAddress']} (pid {os.getpid()})"  # as the node was started
    return f"{socket.gethostname()} (pid {os.getpid()})"
