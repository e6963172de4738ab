"""What the engine asks of a loaded model: the device its input ids go to, the positions it was built for."""

from __future__ import annotations

import torch

from tasks.core.errors import InputError

# a family's own head scales the logits by its config's key (Granite divides by logits_scaling, Cohere multiplies by
# logit_scale); the engine's head is the output embeddings and its one transform the final_logit_softcapping (Gemma 2)
LOGIT_SCALES = ("logits_scaling", "logit_scale")


def input_device(model) -> torch.device:
    """The device a model takes its input ids on: where its input embeddings run. That is not ``model.device``
    (its first parameter's) when accelerate's hooks run offloaded modules (``device_map`` with ``cpu``/``disk``
    beside a GPU, ``cpu_offload``): their weights wait on ``meta`` and are brought to the hook's device per call.
    """
    embeddings = model.get_input_embeddings()
    hook = getattr(embeddings, "_hf_hook", None)
    for each in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
        if getattr(each, "execution_device", None) is not None:
            device = each.execution_device
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return embeddings.weight.device

def max_positions(config) -> int | None:
    """The longest sequence the model's position scheme was built for, when its config says."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_logits(config, whose: str) -> None:
    """Refuse a model whose head scales its logits: the engine would score another model (a tiny Granite with
    ``logits_scaling`` 2 read 0.3% off its own forward's loss)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in LOGIT_SCALES:
        value = getattr(config, key, None)
        if isinstance(value, int | float) and value != 1:
            raise InputError(f"{whose}: its config's {key} {value} scales the logits its head gives, which this "
                             "audit's engine does not apply yet (its figures would be another model's); audit a "
                             f"model whose {key} is 1")
