"""Announce a checkpoint with ``quantization.completed``: what any job does to have it audited.

``ppl-audit serve`` audits the checkpoint an event names (``model_path``, the only field it needs;
``method``, ``bits``, ``name`` and ``baseline`` refine it, see ``tasks.audit.events``). An event only
reaches a serving process through the Prefect server it listens to: without ``PREFECT_API_URL``
Prefect would emit into a temporary server of the emitter's own, and no audit would ever start.
"""

from __future__ import annotations

from pathlib import Path

from tasks.config import check_name
from tasks.core.errors import InputError, one_line

EVENT = "quantization.completed"


def announcement(folder: Path, payload: dict) -> dict:
    """The event's resource and payload for a checkpoint folder; ``payload`` adds the optional fields
    (those that are None are left out, so that the trigger's defaults apply)."""
    resource = {"prefect.resource.id": f"ppl-audit.model.{folder.resolve()}", "prefect.resource.name": folder.name}
    return {"event": EVENT, "resource": resource,
            "payload": {"model_path": str(folder.resolve()), **{k: v for k, v in payload.items() if v is not None}}}


def configured_server() -> str:
    """The Prefect API this process sends to, checked to answer; one line when none is set or up."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise InputError("no Prefect server is configured: set PREFECT_API_URL to the one `ppl-audit serve` uses "
                         "(e.g. http://127.0.0.1:4200/api)")
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as error:
        raise InputError(f"the Prefect server {url} does not answer ({one_line(error)}); start it "
                         "(prefect server start) or fix PREFECT_API_URL") from None
    return url


def notify(model_path: str, **payload) -> str:
    """Send ``quantization.completed`` for the checkpoint in ``model_path`` to the configured server.

    Args:
        model_path: the checkpoint's folder (a local path the serving machine can read).
        payload: ``method``, ``bits``, ``name``, ``baseline``: optional, None leaves one out.

    Returns:
        ``"<event id> to <server URL>"``.
    """
    import asyncio

    from prefect.events import Event
    from prefect.events.clients import get_events_client

    from tasks.models.loading import check_checkpoint

    check_name(payload.get("name"))
    if not Path(model_path).expanduser().exists():  # a Hub id would be announced as a folder of that name here
        raise InputError(f"model folder not found: {model_path}; notify announces a local checkpoint (a folder or "
                         ".gguf file the serving machine reads at the same path)")
    check_checkpoint(model_path)
    url = configured_server()
    event = Event(**announcement(Path(model_path), payload))

    async def send() -> None:
        async with get_events_client() as client:  # sent before it returns, unlike emit_event's worker
            await client.emit(event)

    asyncio.run(send())
    return f"{event.id} to {url}"
