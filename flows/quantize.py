"""The quantize flow: make a GPTQ/AWQ checkpoint, then announce it with ``quantization.completed``.

Any job that emits the same event (ours or anyone's) starts an audit of the new checkpoint when
``ppl-audit serve`` is running; the payload carries ``model_path``, ``method``, ``bits``, ``baseline``
and, when one is given, the variant's ``name`` (see ``tasks.audit.events`` for how an audit names it).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.events import emit_event

from flows.answers import failed
from flows.notify import announcement
from tasks.audit.served import Policy, Refused
from tasks.models.quantize_request import QuantizeRequest, open_quantize
from tasks.models.quantize_said import ManifestSaid
from tasks.steps import quantize_model


@flow(name="ppl-audit-quantize", flow_run_name="quantize-{request.method}-{request.bits}bit")
def quantize_flow(request: QuantizeRequest) -> dict:
    """Make the checkpoint ``request`` asks for and emit ``quantization.completed`` for it.

    ``ppl-audit quantize`` hands it a request it opened before Prefect started (``open_quantize``); a run of the
    deployment (served, or a work pool's) is handed the request's fields by whoever reached the API, and opens it here,
    once a served run's paths are within what its config allows.
    """
    served = Policy.current()
    if served:  # a run of the served deployment: it reads and writes only where the served config allows
        try:
            for what, path in (("model", request.model), ("out", request.out),
                               ("calibration", request.calibration.corpus.source)):
                served.check_path(what, path)
        except Refused as error:  # an answer for whoever asked, not a crash of the serving process
            return failed(f"refused: {error}")
    if not request.opened:
        request = open_quantize(request)
    manifest = quantize_model(request)
    emit_event(**announcement(Path(request.out), {
        "method": request.method, "bits": request.bits, "group_size": request.group_size, "baseline": request.model,
        "calibration_digest": ManifestSaid.of_json(manifest).calibration_digest, "name": request.name}))
    return manifest
