"""One model split over several devices (``device_map``): how it loads, and what scoring it on one device needs.

transformers places each module on its device (``accelerate``'s hooks move activations between them); modules
mapped to ``cpu`` or ``disk`` beside a GPU are offloaded: kept there, run on the first GPU.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref

import torch

from tasks.errors import InputError
from tasks.places import cache_dir


def split_arguments(spec) -> dict:
    """``from_pretrained``'s arguments for ``spec.device_map``: the map, ``max_memory``, and a scratch folder for
    what goes to ``disk`` (removed with the model: ``forget_with``). Empty for a model on one device."""
    if spec.device_map is None:
        return {}
    scratch = cache_dir() / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    return {"device_map": spec.device_map, "max_memory": spec.max_memory,
            "offload_folder": tempfile.mkdtemp(prefix="offload-", dir=scratch)}


def forget_with(model, arguments: dict) -> None:
    """Remove the model's offload folder when the model is collected."""
    if "offload_folder" in arguments:
        weakref.finalize(model, shutil.rmtree, arguments["offload_folder"], True)


def check_placed(model, name: str) -> None:
    """Refuse a map that left no module on a device: all of the model offloaded is run through hooks on the
    model's own forward, which scoring (the base model, then the head) does not call."""
    if set(getattr(model, "hf_device_map", {}).values()) <= {"disk"} and hasattr(model, "hf_device_map"):
        raise InputError(f"{name}: device_map put the whole model on disk; give max_memory room for its first "
                         "modules on a device")


def devices(model) -> list[str]:
    """Where the model's modules were placed (``cpu``, ``disk``, GPU numbers); one entry for a model on one device."""
    placed = getattr(model, "hf_device_map", None) or {"": str(model.device)}
    return sorted({str(device) for device in placed.values()})


def is_split(model) -> bool:
    return len(devices(model)) > 1


def main_device(model) -> torch.device:
    """The device a split model computes on first: its first GPU, else the CPU (offloaded modules run there too)."""
    gpus = sorted(int(device) for device in devices(model) if device.isdigit())
    return torch.device("cuda", gpus[0]) if gpus else torch.device("cpu")


def run_on(model, device: torch.device):
    """``model`` (loaded in host memory) computing on ``device``: on a GPU its weights are streamed there module by
    module (``accelerate.cpu_offload``), so it takes host memory, not the GPU's."""
    if device.type != "cpu":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=device)
    return model
