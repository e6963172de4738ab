"""What the engine asks of a loaded model: the device its input ids go to, the positions it was built for."""

from __future__ import annotations

import torch


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
