"""The audit's workers behind one interface: ``Scheduler`` submits Prefect tasks to the Dask or Ray task runner an
audit's ``runner:`` names, and does for either what the audit needs of a worker pool; ``LocalScheduler`` is the same
interface over one worker, this process (``runner: sequential``), so that scoring has one path wherever it runs.

Why this and not the flow's own task runner (``@flow(task_runner=...)`` with ``task.submit`` and ``wait_for``): the
runner is chosen by the audit's config, which a run Prefect starts reads only once it has begun (``open_plan``), after
its task runner is fixed; and the audit asks what Prefect's futures do not say: which workers are left, how to hold a
retry to the others, how to cancel a piece no longer wanted. Each of those is one method here, written once for Dask
and once for Ray; ``flows/runners.py`` (the audit's scoring) and ``flows/diagnose.py`` (a diagnosis's restore tasks)
ask for them by name and never touch a runner, a Dask client or Ray themselves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext

from tasks.audit.cluster_said import dask_workers
from tasks.config import Runner
from tasks.core.places import cache_dir

RETRY_POLL_SECONDS = 2  # how often a task held to some workers checks that one of them is still there


def dask_cluster(workers: int, resources: dict) -> dict:
    """A local Dask cluster reachable from this machine only (its dashboard binds every interface by default)."""
    return {"n_workers": workers, "threads_per_worker": 1, "resources": resources, "host": "127.0.0.1",
            "dashboard_address": "127.0.0.1:8787",
            "local_directory": str(cache_dir() / "dask-scratch")}  # not the working directory's default


def task_runner(runner: Runner):
    """The Prefect task runner ``runner`` names: Dask's or Ray's, on a local cluster started for the audit or on an
    existing one (``address``); None for ``sequential``."""
    if runner.kind == "dask":
        from prefect_dask import DaskTaskRunner

        if runner.address:  # the user's cluster: its workers declare their own resources
            return DaskTaskRunner(address=runner.address)
        resources = {"GPU": runner.gpus_per_variant} if runner.gpus_per_variant else {}
        return DaskTaskRunner(cluster_kwargs=dask_cluster(runner.workers, resources))
    if runner.kind == "ray":
        from prefect_ray import RayTaskRunner

        from flows.ray_runner import ConnectedRayTaskRunner

        quiet = {"logging_level": "WARNING"}
        if runner.address:  # `auto`: the cluster `ray start` runs on this machine, never a new one
            return ConnectedRayTaskRunner(address=runner.address, init_kwargs=quiet)
        # a local instance of `workers` CPUs (it finds the GPUs itself), no dashboard listening on every interface
        return RayTaskRunner(init_kwargs=quiet | {"num_cpus": runner.workers, "include_dashboard": False})
    return None


def _workers_report_here():
    """Settings naming the API this flow reports to, which every task carries to its worker (Prefect serializes
    the settings with each task). Without PREFECT_API_URL the flow's API is a temporary server whose address is
    in no setting: each worker then found no API and started a temporary server of its own, which nobody read
    and which outlived the worker. Now a worker reports to the flow's API, or, where it cannot reach it, fails."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        return nullcontext()
    return temporary_settings(updates={PREFECT_API_URL: str(get_client(sync_client=True).api_url)})


class Scheduler:
    """A started Dask or Ray task runner, as the audit uses it (``started``)."""

    # whether its models are scored whole, one after another (``flows.runners.score_in_turn``): a cluster's are not,
    # they go concurrently, in shards or in pieces; the scheduler says so, and the scoring asks it, not its type
    scores_in_turn = False

    def __init__(self, runner, settings: Runner):
        self._runner, self.settings = runner, settings

    @classmethod
    @contextmanager
    def started(cls, settings: Runner) -> Iterator[Scheduler]:
        """The scheduler of ``settings`` while its cluster runs; for ``sequential``, this process (``LocalScheduler``)."""
        runner = task_runner(settings)
        if runner is None:
            yield LocalScheduler(settings)
            return
        with runner, _workers_report_here():
            yield cls(runner, settings)

    @property
    def workers(self) -> int:
        """How many workers its tasks may be spread over (``runner.workers``)."""
        return self.settings.workers

    def submit(self, task, **parameters):
        """``task`` with ``parameters`` on a worker: its Prefect future."""
        return self._runner.submit(task, parameters)

    @staticmethod
    def settled(future):
        """A future's result, or what its task raised: also an error raised before Prefect recorded any state (a
        worker that cannot reach the Prefect API), which ``result`` raises whatever ``raise_on_failure`` says."""
        try:
            return future.result(raise_on_failure=False)
        except Exception as error:  # noqa: BLE001 -- one variant's failure, whatever it is, must not lose the others
            return error

    @staticmethod
    def first_done(futures: Iterable):
        """The first of ``futures`` to finish."""
        from prefect.futures import as_completed

        return next(as_completed(list(futures)))

    @staticmethod
    def cancel(future) -> None:
        """Stop a task that is no longer needed: Dask drops it (or its result), Ray interrupts it."""
        wrapped = future.wrapped_future
        if hasattr(wrapped, "cancel"):
            wrapped.cancel()
        else:
            import ray

            ray.cancel(wrapped)

    def placed(self):
        """Tasks submitted in this context ask their worker for ``gpus_per_variant`` GPUs, where configured."""
        gpus = self.settings.gpus_per_variant
        if not gpus:
            return nullcontext()
        if self.settings.kind == "dask":
            import dask

            return dask.annotate(resources={"GPU": gpus})
        from prefect_ray.context import remote_options

        return remote_options(num_gpus=gpus)

    def _workers(self) -> set[str]:
        """The workers in the cluster now, asked of its scheduler. Not ``Client.scheduler_info()``: it refreshes the
        client's cached identity and returns the cache, which the client's own periodic refresh (``n_workers=0``:
        no workers listed) may replace in between; under load it said a cluster of two had none (measured: 79 of 300
        calls with the refresh every 1 ms), and a retry was then given up as having no other worker."""
        client = self._runner.client
        return {worker.address for worker in dask_workers(client.sync(client.scheduler.identity, n_workers=-1))}

    def elsewhere(self, worker: str) -> list[str] | None:
        """The workers a task that failed on ``worker`` may run again on: on Dask, any other; None: anywhere (Ray
        places tasks itself)."""
        if self.settings.kind != "dask":
            return None
        return sorted(self._workers() - {worker})

    @staticmethod
    def held_to(workers: list[str] | None):
        """Tasks submitted in this context run on ``workers`` only (None: anywhere). Strictly: Dask's work stealing
        moves a task with a loose restriction (``allow_other_workers``) to any idle worker, the one it failed on
        included."""
        if workers is None:
            return nullcontext()
        import dask

        return dask.annotate(workers=workers, allow_other_workers=False)

    def settled_on(self, future, workers: list[str] | None) -> tuple[bool, object]:
        """``(ran, settled)`` of a task held to ``workers``: should every one of them leave the cluster, Dask would
        keep it waiting for one forever; it is cancelled instead, and ``ran`` is False."""
        while workers is not None and not future.wrapped_future.done():
            if not set(workers) & self._workers():
                future.wrapped_future.cancel()
                return False, None
            time.sleep(RETRY_POLL_SECONDS)
        return True, self.settled(future)


class LocalScheduler(Scheduler):
    """The scheduler of ``runner: sequential``: one worker, this process. A task runs as it is submitted, in the
    flow's own thread, so tasks run one after another in the order submitted and each future is settled when
    ``submit`` returns (Prefect's task run, as a direct call makes it, wrapped as a done future).

    Why not Prefect's ``ThreadPoolTaskRunner`` with one worker: its task would run in a thread of its own while the
    flow's thread only waits for it, and Ctrl-C, raised in the flow's thread, would leave the model scoring there.
    """

    scores_in_turn = True  # one worker: nothing to split into shards or start beside another

    def __init__(self, settings: Runner):
        super().__init__(None, settings)

    def submit(self, task, **parameters):
        from prefect.futures import PrefectConcurrentFuture

        state = task(**parameters, return_state=True)
        done = Future()
        done.set_result(state)
        return PrefectConcurrentFuture(state.state_details.task_run_id, done)

    @property
    def workers(self) -> int:
        return 1

    @staticmethod
    def cancel(future) -> None:
        """Nothing to stop: a task here has run by the time its future exists."""

    def placed(self):
        """No placement: the one worker has whatever devices this process has."""
        return nullcontext()

    def elsewhere(self, worker: str) -> list[str]:
        """No other worker: a task that failed here is not run again (there is no elsewhere)."""
        return []

    @staticmethod
    def held_to(workers: list[str] | None):
        return nullcontext()
