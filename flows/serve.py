"""Deployments: the audit on its cron schedule and on every ``quantization.completed`` event.

``ppl-audit serve CONFIG`` serves them from this process (needs a Prefect server, local or remote, for
schedules and events); ``prefect.yaml`` declares the same for work pools (``prefect deploy --all``).
"""

from __future__ import annotations

from pathlib import Path

from prefect import serve
from prefect.events import DeploymentEventTrigger
from prefect.schedules import Cron

from flows.audit import audit
from flows.notify import EVENT
from flows.quantize import quantize_flow
from tasks.config import load_audit_config

# the event's payload becomes the audit's parameters: that checkpoint against that baseline. Only
# model_path is required: a field a payload lacks renders as a value the server cannot send, and the
# run silently never starts, so the others default to "" (the audit reads it as "not given")
EVENT_PARAMETERS = {
    "model_path": "{{ event.payload.model_path }}",
    "method": "{{ event.payload.method | default('') }}",
    "bits": "{{ event.payload.bits | default('') }}",
    "baseline": "{{ event.payload.baseline | default('') }}",
    "name": "{{ event.payload.name | default('') }}",
}


def deployments(config_path: str) -> list:
    config = load_audit_config(config_path)
    path = str(Path(config_path).resolve())
    trigger = DeploymentEventTrigger(expect={EVENT}, parameters={"config": path, **EVENT_PARAMETERS})
    schedule = config.schedule
    schedules = [Cron(schedule.cron, timezone=schedule.timezone)] if schedule.cron else []
    return [
        audit.to_deployment(name=config.name, parameters={"config": path}, schedules=schedules,
                            triggers=[trigger], description=f"ppl-audit {config.name}: nightly and on {EVENT}"),
        quantize_flow.to_deployment(name=f"{config.name}-quantize", description="GPTQ/AWQ, then emits " + EVENT),
    ]


def serve_config(config_path: str) -> None:
    serve(*deployments(config_path))
