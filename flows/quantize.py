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
from tasks.config import (
    DEFAULT_BITS,
    DEFAULT_CALIBRATION,
    DEFAULT_GROUP_SIZE,
    QUANTIZED_BY_US,
    CorpusConfig,
    check_group_size,
    check_name,
)
from tasks.core.errors import InputError
from tasks.models.quantize import check_destination, check_group_fits, check_quantizable
from tasks.steps import quantize_model


def check_request(model: str, method: str, out: str, name: str | None, group_size: int) -> Path:
    """The checkpoint's folder (new or empty), or one line saying which argument to change."""
    if method not in QUANTIZED_BY_US:
        raise InputError(f"method {method} cannot be quantized here; use gptq or awq")
    check_name(name)
    check_quantizable(model)
    try:
        check_group_size(method, group_size)
    except ValueError as error:
        raise InputError(str(error)) from None
    check_group_fits(model, method, group_size)
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"output folder {folder} is a file; give a new folder")
    if folder.exists() and any(folder.iterdir()):
        raise InputError(f"output folder {folder} is not empty; give a new folder")
    check_destination(folder)
    return folder


@flow(name="ppl-audit-quantize", flow_run_name="quantize-{method}-{bits}bit")
def quantize_flow(model: str, method: str, out: str, calibration: str, bits: int = DEFAULT_BITS,
                  group_size: int = DEFAULT_GROUP_SIZE, sym: bool = True,
                  column: str = CorpusConfig.model_fields["column"].default,
                  samples: int = DEFAULT_CALIBRATION.samples, seq_len: int = DEFAULT_CALIBRATION.seq_len,
                  seed: int = DEFAULT_CALIBRATION.seed, holdout_tokens: int = 0, name: str | None = None) -> dict:
    """Quantize ``model`` into ``out`` and emit ``quantization.completed`` for it.

    Args:
        holdout_tokens: never calibrate on the first N tokens of the calibration corpus (what an audit
            with ``max_tokens: N`` on the same corpus scores).
        name: the variant's name in audits of this checkpoint (it picks the gate); recorded in the
            manifest and sent with the event.
    """
    served = Policy.current()
    if served:  # a run of the served deployment: it reads and writes only where the served config allows
        try:
            for what, path in (("model", model), ("out", out), ("calibration", calibration)):
                served.check_path(what, path)
        except Refused as error:  # an answer for whoever asked, not a crash of the serving process
            return failed(f"refused: {error}")
    folder = check_request(model, method, out, name, group_size)
    manifest = quantize_model(model, method, bits, group_size, sym, CorpusConfig(source=calibration, column=column),
                              samples, seq_len, seed, holdout_tokens, out, name)
    emit_event(**announcement(folder, {"method": method, "bits": bits, "group_size": group_size, "baseline": model,
                                       "calibration_digest": manifest["calibration"]["digest"], "name": name}))
    return manifest
