"""The quantize flow: make a GPTQ/AWQ checkpoint, then announce it with ``quantization.completed``.

Any job that emits the same event (ours or anyone's) starts an audit of the new checkpoint when
``ppl-audit serve`` is running; the payload carries ``model_path``, ``method``, ``bits``, ``baseline``
and, when one is given, the variant's ``name`` (see ``tasks.events`` for how an audit names it).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from flows.notify import announcement
from tasks.config import QUANTIZED_BY_US, check_group_size, check_name
from tasks.corpus import CorpusSpec, cached_tokenize, corpus_text
from tasks.errors import InputError
from tasks.models import load_tokenizer
from tasks.quantize import draw_calibration, quantize


def check_request(method: str, out: str, name: str | None, group_size: int) -> Path:
    """The checkpoint's folder (new or empty), or one line saying which argument to change."""
    if method not in QUANTIZED_BY_US:
        raise InputError(f"method {method} cannot be quantized here; use gptq or awq")
    try:
        check_group_size(method, group_size)
    except ValueError as error:
        raise InputError(str(error)) from None
    check_name(name)
    folder = Path(out)
    if folder.exists() and any(folder.iterdir()):
        raise InputError(f"output folder {folder} is not empty; give a new folder")
    return folder


@task(cache_policy=NO_CACHE)
def quantize_model(model: str, method: str, bits: int, group_size: int, sym: bool, calibration: str,
                   column: str, samples: int, seq_len: int, seed: int, holdout_tokens: int, out: str,
                   name: str | None) -> dict:
    stream = cached_tokenize(corpus_text(CorpusSpec(calibration, column)), load_tokenizer(model), bos="none",
                             progress="tokenize calibration")
    holdout = (0, holdout_tokens) if holdout_tokens > 0 else None
    drawn = draw_calibration(stream.ids, samples, seq_len, seed, calibration, stream.text_digest, holdout)
    return quantize(model, method, bits, group_size, sym, drawn, Path(out), name=name, progress=True)


@flow(name="ppl-audit-quantize", flow_run_name="quantize-{method}-{bits}bit")
def quantize_flow(model: str, method: str, out: str, calibration: str, bits: int = 4, group_size: int = 128,
                  sym: bool = True, column: str = "text", samples: int = 128, seq_len: int = 512, seed: int = 0,
                  holdout_tokens: int = 0, name: str | None = None) -> dict:
    """Quantize ``model`` into ``out`` and emit ``quantization.completed`` for it.

    Args:
        holdout_tokens: never calibrate on the first N tokens of the calibration corpus (what an audit
            with ``max_tokens: N`` on the same corpus scores).
        name: the variant's name in audits of this checkpoint (it picks the gate); recorded in the
            manifest and sent with the event.
    """
    folder = check_request(method, out, name, group_size)
    manifest = quantize_model(model, method, bits, group_size, sym, calibration, column, samples, seq_len, seed,
                              holdout_tokens, out, name)
    emit_event(**announcement(folder, {"method": method, "bits": bits, "group_size": group_size, "baseline": model,
                                       "calibration_digest": manifest["calibration"]["digest"], "name": name}))
    return manifest
