"""The scheduler of ``runner: sequential`` (``flows.scheduler.LocalScheduler``): one worker, this process, whose
tasks run as they are submitted, one after another, each a Prefect task run of its own."""

from __future__ import annotations

import threading

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.scheduler import LocalScheduler, Scheduler
from tasks.config import Runner


SEEN: list[tuple[int, int]] = []  # each step's number and thread, as it ran


@task(cache_policy=NO_CACHE, task_run_name="step-{n}")
def _step(n: int) -> int:
    SEEN.append((n, threading.get_ident()))
    if n < 0:
        raise ValueError(f"step {n} refused")
    return n * 10


@flow
def _in_turn() -> tuple[list, list, int, str]:
    """Three tasks on the sequential runner's scheduler: what ran when each was submitted, what each future says,
    the flow's thread and its run's id."""
    from prefect.context import FlowRunContext

    with Scheduler.started(Runner()) as scheduler:
        assert isinstance(scheduler, LocalScheduler) and scheduler.workers == 1
        ran, futures = [], []
        for n in (2, -1, 3):
            futures.append(scheduler.submit(_step, n=n))
            ran.append((len(SEEN), futures[-1].wrapped_future.done()))
        first = scheduler.first_done(futures)
        settled = [Scheduler.settled(future) for future in futures]
    assert first in futures
    return ran, settled, threading.get_ident(), str(FlowRunContext.get().flow_run.id)


@pytest.mark.usefixtures("prefect_harness")
def test_its_tasks_run_here_at_submit_in_turn_each_a_task_run_of_its_own():
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    SEEN.clear()
    ran, settled, here, run_id = _in_turn()
    assert ran == [(1, True), (2, True), (3, True)]  # each ran, and was settled, before the next was submitted
    assert SEEN == [(2, here), (-1, here), (3, here)]  # in the order submitted, in the flow's own thread
    assert settled[0] == 20 and settled[2] == 30
    assert isinstance(settled[1], ValueError) and str(settled[1]) == "step -1 refused"  # what it raised, not raised
    with get_client(sync_client=True) as api:
        runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    states = {run.name: run.state.type.value for run in runs}
    assert states == {"step-2": "COMPLETED", "step--1": "FAILED", "step-3": "COMPLETED"}  # one task run each


def test_it_has_no_elsewhere_no_placement_and_nothing_to_cancel():
    """One worker in this process: a failed task has no other worker to go to, a task asks for no devices (the process
    has what it has, ``gpus_per_variant`` or not), and cancelling a settled future does nothing."""
    from concurrent.futures import Future

    from prefect.futures import PrefectConcurrentFuture

    with Scheduler.started(Runner(gpus_per_variant=1)) as scheduler:
        assert scheduler.elsewhere("here") == []
        with scheduler.placed(), scheduler.held_to(scheduler.elsewhere("here")):
            import dask

            assert dask.get_annotations() == {}
        done = Future()
        done.set_result(7)
        future = PrefectConcurrentFuture(None, done)
        scheduler.cancel(future)
        assert not future.wrapped_future.cancelled() and future.result() == 7
        assert scheduler.settled_on(future, []) == (True, 7)
