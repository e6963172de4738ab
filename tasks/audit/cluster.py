"""An existing Dask or Ray cluster as an audit uses it: reachable, its workers reaching Prefect's API, seeing
the models' files and offering the GPUs asked for, and which worker scored each model. Checked before any
model is loaded, each problem one line."""

from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import urlparse

from tasks.audit.cluster_said import dask_workers, ray_nodes
from tasks.config import Runner
from tasks.core.errors import InputError, one_line

CONNECT_SECONDS = 5  # a scheduler that does not answer in this long is down or firewalled, not slow
RAY_INIT_TRIES = 3


def check_local_cluster(runner: Runner) -> None:
    """Refuse a local cluster this machine cannot give: more workers than cores (each holds a model), or
    GPUs per variant where it has fewer (the variants would run on CPU, unasked)."""
    import torch

    cores = os.cpu_count() or 1
    if runner.workers > cores:
        raise InputError(f"runner.workers is {runner.workers}, but this machine has {cores} cores and each local "
                         f"worker holds a model; use at most {cores}, or runner.address for a cluster")
    gpus = torch.cuda.device_count()
    if runner.gpus_per_variant > gpus:
        raise InputError(f"runner.gpus_per_variant is {runner.gpus_per_variant:g}, but this machine has {gpus} GPU(s) "
                         "for the local cluster; set it to 0, or give runner.address of a cluster with GPUs")


def check_reachable(address: str) -> None:
    """Refuse a scheduler address nothing answers at (``auto`` is Ray's to resolve)."""
    if address == "auto":
        return
    parsed = urlparse(address)
    if parsed.hostname is None or parsed.port is None:
        example = "ray://10.0.0.5:10001" if address.startswith("ray://") else "tcp://10.0.0.5:8786"
        raise InputError(f"runner.address '{address}' names no host and port (e.g. {example})")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=CONNECT_SECONDS).close()
    except OSError as error:
        raise InputError(f"runner.address {address}: nothing answers there ({error.strerror or error}); start "
                         "the scheduler or correct the address") from None


def _look(paths: list[str], api: tuple[str, int]) -> tuple[list[str], str | None]:
    """On a worker: which of ``paths`` it cannot see, and why it cannot connect to ``api`` (None: it can)."""
    try:
        socket.create_connection(api, timeout=CONNECT_SECONDS).close()
        unreachable = None
    except OSError as error:
        unreachable = error.strerror or str(error)
    return [path for path in paths if not Path(path).exists()], unreachable


def _dask_workers(address: str, paths: list[str], api: tuple[str, int]) -> dict[str, tuple]:
    """Each worker of the Dask cluster at ``address``: the ``paths`` it cannot see, why it cannot reach ``api``,
    and the GPUs it offers (its ``GPU`` resource)."""
    from distributed import Client

    with Client(address, timeout=CONNECT_SECONDS * 6, set_as_default=False) as client:
        looked = client.run(_look, paths, api)
        offered = {worker.address: worker.gpus for worker in dask_workers(client.scheduler_info())}
    return {worker: (*looked[worker], offered.get(worker, 0)) for worker in looked}


def connect_ray(address: str, **init_kwargs) -> None:
    """``ray.init`` at ``address``, tried again when Ray's client server answers but the server process it starts
    for this client dies as it starts (ConnectionAbortedError, seen under load; the next client is served). A
    cluster that is down (ConnectionError) or a client server that fails every time is one line."""
    import ray

    for attempt in range(RAY_INIT_TRIES):
        try:
            ray.init(address=address, **init_kwargs)
            return
        except ConnectionAbortedError:
            if attempt == RAY_INIT_TRIES - 1:
                raise InputError(f"runner.address {address}: the Ray client server failed to start a server for "
                                 f"this audit {RAY_INIT_TRIES} times; see ray_client_server*.err in the head "
                                 "node's Ray logs") from None
        except ConnectionError as error:
            raise InputError(f"runner.address {address}: no Ray cluster answers ({one_line(error)}); start one "
                             "with `ray start --head` or correct the address") from None


def _ray_workers(address: str, paths: list[str], api: tuple[str, int]) -> dict[str, tuple]:
    """Each live node of the Ray cluster at ``address`` (``auto``: the one on this machine): the ``paths`` a
    task placed on it cannot see, why it cannot reach ``api``, and the GPUs it offers."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connect_ray(address, logging_level="ERROR", log_to_driver=False)
    try:
        look = ray.remote(num_cpus=0)(_look)
        nodes = [node for node in ray_nodes(ray.nodes()) if node.alive]
        on = [NodeAffinitySchedulingStrategy(node.node_id, soft=False) for node in nodes]
        looked = ray.get([look.options(scheduling_strategy=strategy).remote(paths, api) for strategy in on])
        return {f"ray node {node.address}": (*seen, node.gpus) for node, seen in zip(nodes, looked)}
    finally:
        ray.shutdown()


@contextmanager
def _prefect_api():
    """Where workers report each task they run: ``((host, port), its name, why it is there)``: the Prefect API at
    ``PREFECT_API_URL``, or, with none set, this machine's loopback, where the audit starts its temporary
    server (a port held open here while the workers try it)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if url:
        parsed = urlparse(url)
        yield (parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)), f"the Prefect API {url}", ""
        return
    with socket.create_server(("127.0.0.1", 0)) as stand_in:
        yield (stand_in.getsockname(), "this machine's 127.0.0.1",
               "without PREFECT_API_URL the audit starts a temporary Prefect server there, and ")


def check_workers(runner: Runner, paths: dict[str, str]) -> None:
    """Refuse an existing cluster (``runner.address``) that cannot run the audit: a worker that cannot reach
    the Prefect API (each task reports its state there: a task on such a worker fails before it starts); a
    local model path (``{whose: path}``) that one of its workers cannot see (workers load the models themselves,
    from a path every worker sees or a Hub id / ``models:/`` URI); or no worker offering ``gpus_per_variant``
    GPUs (its tasks would wait for one forever)."""
    survey = _dask_workers if runner.kind == "dask" else _ray_workers
    with _prefect_api() as (api, what, why):
        workers = survey(runner.address, list(paths.values()), api)
    for worker, (_, unreachable, _) in sorted(workers.items()):
        if unreachable:
            raise InputError(f"runner.address: worker {worker} cannot reach {what} ({unreachable}): {why}workers "
                             "report each task to it; start a Prefect server the workers reach (prefect server start "
                             "--host 0.0.0.0) and set PREFECT_API_URL to its address")
    for worker, (missing, _, _) in sorted(workers.items()):
        if missing:
            whose = next(name for name, path in paths.items() if path == missing[0])
            raise InputError(f"runner.address: worker {worker} cannot see {missing[0]} ({whose}); put the models "
                             "where every worker sees them at the same path, or give a Hub id or models:/ URI")
    most = max((gpus for *_, gpus in workers.values()), default=0)
    if runner.gpus_per_variant > most:
        resource = "--resources GPU=N" if runner.kind == "dask" else "--num-gpus N"
        raise InputError(f"runner.gpus_per_variant is {runner.gpus_per_variant:g} but no worker of {runner.address} "
                         f"offers that many GPUs (the most is {most:g}); start workers with {resource} or lower it")


def let_go() -> str | None:
    """Why the task running here is no longer wanted: on a Dask worker, once the scheduler let it go (the audit that
    submitted it stopped waiting, or gave it to another worker); None while it is wanted, and off a Dask worker
    (Ray stops a task whose driver has gone by itself)."""
    if "distributed" not in sys.modules:
        return None
    from distributed import get_worker
    from distributed.worker import thread_state

    try:
        here, key = get_worker(), thread_state.key
    except (ValueError, AttributeError):  # not in a Dask worker's task thread
        return None
    task = here.state.tasks.get(key)
    if task is None or task.state == "cancelled":
        return f"stopped on {here.address}: the audit that asked for it no longer waits for it"
    return None


def worker() -> str:
    """Where this code runs: the Dask worker's address, the Ray node and process, else this host and process."""
    if "distributed" in sys.modules:  # only a Dask worker's process has imported it (0.4 s to import here)
        from distributed import get_worker

        with suppress(ValueError):  # not inside a Dask worker
            return get_worker().address
    if "ray" in sys.modules:  # only a Ray task's process has imported it
        import ray

        context = ray.get_runtime_context() if ray.is_initialized() else None
        if context is not None and context.get_task_id() is not None:
            node = next(n for n in ray_nodes(ray.nodes()) if n.node_id == context.get_node_id())
            return f"ray node {node.address} (pid {os.getpid()})"  # as the node was started
    return f"{socket.gethostname()} (pid {os.getpid()})"
