"""Deployments: the audit on its cron schedule and on every ``quantization.completed`` event.

``ppl-audit serve CONFIG`` serves them from this process (needs a Prefect server, local or remote, for
schedules and events); ``prefect.yaml`` declares the same for work pools (``prefect deploy --all``).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path

from prefect.events import DeploymentEventTrigger
from prefect.runner import Runner
from prefect.schedules import Cron

from flows.audit import audit
from flows.notify import EVENT
from flows.quantize import quantize_flow
from tasks.config import AuditConfig

# the event's payload becomes the audit's ``event`` parameter (``tasks.audit.plan.Event``): that checkpoint against
# that baseline. Only model_path is required: a field a payload lacks renders as a value the server cannot send, and
# the run silently never starts, so the others default to "" (the audit reads it as "not given"). Prefect renders
# templates inside a nested mapping as at the top (its RunDeployment action upgrades them recursively).
EVENT_PARAMETERS = {
    "model_path": "{{ event.payload.model_path }}",
    "method": "{{ event.payload.method | default('') }}",
    "bits": "{{ event.payload.bits | default('') }}",
    "baseline": "{{ event.payload.baseline | default('') }}",
    "name": "{{ event.payload.name | default('') }}",
}


def deployments(config_path: str, config: AuditConfig) -> list:
    """The audit of ``config`` (read from ``config_path``: each run opens it again, as it is then) on its schedule and
    on every event, and the quantize flow on request."""
    path = str(Path(config_path).resolve())
    trigger = DeploymentEventTrigger(expect={EVENT}, parameters={"config": path, "event": EVENT_PARAMETERS})
    schedule = config.schedule
    schedules = [Cron(schedule.cron, timezone=schedule.timezone)] if schedule.cron else []
    return [
        audit.to_deployment(name=config.name, parameters={"config": path}, schedules=schedules,
                            triggers=[trigger], description=f"ppl-audit {config.name}: nightly and on {EVENT}"),
        quantize_flow.to_deployment(name=f"{config.name}-quantize", description="GPTQ/AWQ, then emits " + EVENT),
    ]


def serve_config(config_path: str, config: AuditConfig, say: Callable[[str], None]) -> None:
    """Serve the deployments of ``config`` (read from ``config_path``) until stopped; ``say`` gets what an operator
    reads: what is served, and a line when each of their runs starts and ends (the rest goes to the process's output,
    the serve's log)."""
    served = deployments(config_path, config)
    when = f"cron {config.schedule.cron} ({config.schedule.timezone}) and " if config.schedule.cron else ""
    say(f"serving {config.name}: the audit on {when}every {EVENT} event; {config.name}-quantize on request")
    threading.Thread(target=watch, args=([d.name for d in served], say), daemon=True).start()
    runner = _Runner(pause_on_shutdown=True)
    for deployment in served:
        runner.add_deployment(deployment)
    # Ctrl-C and SIGHUP reach here as exceptions, which the runner's teardown meets after it killed its runs' processes:
    # the runs are ended first, as on SIGTERM (``_Runner.handle_sigterm``)
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _ending_served_runs_first(signal.getsignal(signum)))
    # not prefect.serve, which returns as if nothing happened when stopped by Ctrl-C; a stop ends as every command's
    asyncio.run(runner.start())


def _ending_served_runs_first(previous):
    """A signal handler that ends the served runs (``end_served_runs``), then does what ``previous`` did: raise
    KeyboardInterrupt (Ctrl-C) or stop the command (flows.lifetime's SIGHUP)."""
    def handler(signum, frame) -> None:
        end_served_runs(signal.Signals(signum).name)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt

    return handler


def end_served_runs(how: str, grace: float = 1.5) -> list[str]:
    """End the flow runs this serve's runner is running, as serve stops: their processes (the runner's children whose
    environment names their flow run) are stopped, and each run that had not ended is recorded Crashed with the stop's
    line. Without it, the runner's shutdown killed those processes before they could tell the API, and each run stayed
    Running there for good. Returns the runs' ids."""
    import psutil
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    runs = {}
    for child in psutil.Process().children():
        with suppress(psutil.Error):
            if run_id := child.environ().get("PREFECT__FLOW_RUN_ID"):
                runs[run_id] = child
    if not runs:
        return []
    for process in runs.values():
        with suppress(psutil.Error):
            process.terminate()
    for process in psutil.wait_procs(list(runs.values()), timeout=grace)[1]:
        with suppress(psutil.Error):
            process.kill()
    line = f"crashed: ppl-audit serve was interrupted by {how} while this run ran; nothing it had half-written is kept"
    with suppress(Exception), get_client(sync_client=True) as client:  # noqa: BLE001 -- the API gone: nothing to tell
        for run_id in runs:
            state = client.read_flow_run(run_id).state
            # a verdict reached before the stop stands; Running, Cancelling (the runner's own shutdown) or Prefect's
            # crash without the why are replaced
            if state is None or state.type.value not in ("COMPLETED", "FAILED"):
                client.set_flow_run_state(run_id, Crashed(message=line), force=True)
    return list(runs)


class _Runner(Runner):
    """Prefect's runner, which on SIGTERM pauses the deployments and exits, with status 143 (a stopped command's,
    which the CLI reports in one line) instead of 0: a process manager is told it was stopped, not that it ended.
    The runs it is running are ended first (``end_served_runs``): Prefect's own stop of them is never awaited when
    called from this handler, and its teardown then kills their processes without a word to the API."""

    def handle_sigterm(self, *args) -> None:
        end_served_runs(signal.SIGTERM.name)
        try:
            super().handle_sigterm(*args)
        except SystemExit:
            raise SystemExit(128 + signal.SIGTERM) from None


def watch(names: list[str], say: Callable[[str], None], every: float = 2.0) -> None:
    """Say one line when a run of the deployments ``names`` starts, and one when it ends with its state's message
    (the verdict, or why it was refused). Polls the API this process serves through; a failed poll is tried again."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterStartTime,
    )

    since, said = datetime.now(timezone.utc), {}
    deployments = DeploymentFilter(name=DeploymentFilterName(any_=names))
    started = FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since))
    while True:
        time.sleep(every)
        try:
            with get_client(sync_client=True) as client:
                found = client.read_flow_runs(deployment_filter=deployments, flow_run_filter=started, limit=200)
                deployment = {d.id: d.name for d in client.read_deployments(deployment_filter=deployments)}
        except Exception:  # noqa: BLE001 -- the API restarting or busy: the next poll sees the same runs
            continue
        for run in found:
            ended = run.state is not None and run.state.is_final()
            if said.get(run.id) == "ended" or (said.get(run.id) == "started" and not ended):
                continue
            if run.start_time is None and not ended:  # scheduled or pending: the filter finds a cron's next runs by
                continue                              # their expected start, and none of them has started
            # whole: runs created together share their id's first characters (the time), as a cron's next three do
            what = f"{deployment.get(run.deployment_id, 'a')} run {run.id}"
            if run.id not in said:
                model = ((run.parameters.get("event") or {}).get("model_path")
                         or (run.parameters.get("request") or {}).get("model"))
                say(f"{what} started" + (f" for {model}" if model else ""))
            if ended:
                say(f"{what} ended {run.state.name}: {run.state.message or 'no message'}")
            said[run.id] = "ended" if ended else "started"
