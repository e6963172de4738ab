"""One gptq/awq checkpoint to make (``ppl-audit quantize``, or a run of the quantize deployment), as one value made
and checked once: ``QuantizeRequest``, opened by ``open_quantize``."""

from __future__ import annotations

from pathlib import Path
from pydantic import Field, PrivateAttr, model_validator

from tasks.config import (
    DEFAULT_BITS,
    DEFAULT_GROUP_SIZE,
    Bits,
    CalibrationConfig,
    GptqDynamic,
    Strict,
    check_group_size,
    check_name,
)
from tasks.core.errors import InputError
from tasks.engine.model_facts import max_positions
from tasks.methods.registry import find_method
from tasks.models.quantize import Scheme, calibration_of, check_destination, check_group_fits, check_quantizable
from tasks.models.resolve import Located, locate_model, read_tokenizer


class QuantizeRequest(Strict):
    """A checkpoint to make with gptqmodel: from what, how, calibrated on what, and where it goes. A flow parameter:
    Prefect shows its fields in its UI and takes them as a deployment's parameters.

    Attributes:
        model: the baseline's folder, Hub id, or ``embedded``.
        method, bits, group_size, sym: the scheme (``scheme``); ``group_size`` -1: per channel.
        calibration: the corpus (required) and the samples drawn from it.
        holdout_tokens: never calibrate on the first N tokens of the calibration corpus (what an audit
            with ``max_tokens: N`` on the same corpus scores).
        out: the checkpoint's folder, new or empty.
        name: the variant's name in audits of this checkpoint (it picks the gate); recorded in the
            manifest and sent with the event.
        dynamic: gptq only: gptqmodel's per-module overrides, a recipe as ``ppl-audit tune`` writes it
            (``GptqDynamic``, the type a variant's ``dynamic`` has).
    """

    model: str
    method: str
    out: str
    calibration: CalibrationConfig
    bits: Bits = DEFAULT_BITS
    group_size: int = DEFAULT_GROUP_SIZE
    sym: bool = True
    holdout_tokens: int = Field(0, ge=0)
    name: str | None = None
    dynamic: GptqDynamic | None = None
    # set by ``open_quantize`` alone, never from a flow run's parameters: the model as this machine found it (once),
    # and its tokenizer; None: not checked here yet
    _found: tuple[Located, object] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _calibrated_on_a_corpus(self) -> QuantizeRequest:
        if self.calibration.corpus is None:
            raise ValueError("calibration.corpus: give the corpus to calibrate on (same forms as a corpus source)")
        if self.dynamic is not None and not getattr(find_method(self.method), "takes_dynamic", False):
            raise ValueError(f"dynamic: gptqmodel's per-module overrides make gptq checkpoints, not {self.method} "
                             "ones; use method gptq")
        return self

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.method, self.bits, self.group_size, self.sym, self.dynamic)

    @property
    def opened(self) -> bool:
        return self._found is not None

    @property
    def found(self) -> tuple[Located, object]:
        """The model, found once by ``open_quantize``, and its tokenizer."""
        if self._found is None:
            raise RuntimeError("open_quantize(request) first: it finds the model once")
        return self._found


def open_quantize(request: QuantizeRequest) -> QuantizeRequest:
    """``request`` checked on this machine before anything loads, or one line saying which argument to change
    (``InputError``); the request returned is ``opened``: its ``out`` the checkpoint's folder, new or empty.

    ``ppl-audit quantize`` opens its request before Prefect starts; the flow opens one it was handed unopened (a run
    of the deployment, whose parameters came through the API).
    """
    made = find_method(request.method)
    if made is None or not made.quantized_here:
        raise InputError(f"method {request.method} cannot be quantized here; use gptq or awq")
    check_name(request.name)
    model = locate_model(request.model)  # the one place the quantize command finds its model
    check_quantizable(model)
    try:
        check_group_size(request.method, request.group_size)
    except ValueError as error:
        raise InputError(str(error)) from None
    check_group_fits(model, request.method, request.group_size)
    folder = Path(request.out)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"output folder {folder} is a file; give a new folder")
    if folder.exists() and any(folder.iterdir()):
        raise InputError(f"output folder {folder} is not empty; give a new folder")
    check_destination(folder)
    check_calibration_length(model, request.calibration.seq_len)
    # drawing the calibration (cached tokens, so the flow's own draw costs nothing more) refuses a corpus without
    # room for the samples
    tokenizer = read_tokenizer(model.source, request.model)
    calibration_of(tokenizer, request.calibration, request.holdout_tokens)
    opened = request.model_copy(update={"out": str(folder)})
    opened._found = (model, tokenizer)
    return opened


def check_calibration_length(model: Located, seq_len: int) -> None:
    """Refuse calibration sequences longer than the positions ``model`` was built for (its config, no weights read):
    quantizing on activations at positions it never saw calibrates it for text it will never score."""
    positions = max_positions(model.config)
    if positions is not None and seq_len > positions:
        raise InputError(f"calibration seq_len {seq_len} is longer than the {positions} positions {model.name} was "
                         f"built for (max_position_embeddings); use {positions} or fewer")
