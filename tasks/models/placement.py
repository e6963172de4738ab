"""One model split over several devices (``device_map``): how it loads, and what scoring it on one device needs.

transformers places each module on its device (``accelerate``'s hooks move activations between them); modules
mapped to ``cpu`` or ``disk`` beside a GPU are offloaded: kept there, run on the first GPU.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass

import torch

from tasks.core.errors import InputError
from tasks.core.places import cache_dir


@dataclass(frozen=True)
class Split:
    """How a model is split over devices (``spec.device_map``): the map, ``max_memory``, and the scratch folder
    for what goes to ``disk`` (removed with the model: ``forget_with``)."""

    device_map: object
    max_memory: object
    offload_folder: str

    def arguments(self) -> dict:
        """As ``from_pretrained`` takes them."""
        return {"device_map": self.device_map, "max_memory": self.max_memory, "offload_folder": self.offload_folder}


def split_of(spec) -> Split | None:
    """How ``spec`` splits its model, its scratch folder made; None for a model on one device."""
    if spec.device_map is None:
        return None
    scratch = cache_dir() / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    return Split(device_map=spec.device_map, max_memory=spec.max_memory,
                 offload_folder=tempfile.mkdtemp(prefix="offload-", dir=scratch))


def forget_with(model, split: Split | None) -> None:
    """Remove the model's offload folder when the model is collected."""
    if split is not None:
        weakref.finalize(model, shutil.rmtree, split.offload_folder, True)


def _placed_on(device_map: dict, module: str):
    """The device ``device_map`` gives ``module``: its own entry or its closest enclosing module's."""
    enclosing = [key for key in device_map if key == "" or module == key or module.startswith(key + ".")]
    return device_map[max(enclosing, key=len)] if enclosing else None


def check_ties(spec, config) -> None:
    """Refuse an explicit map that puts a tied input embedding and LM head (one tensor) on different devices:
    accelerate cannot place one tensor twice and fails in loading or at the first forward pass
    (``KeyError: 'lm_head.weight'``, ``weight is on the meta device``). ``auto`` keeps tied modules together itself."""
    if not isinstance(spec.device_map, dict):
        return
    from transformers import AutoModelForCausalLM

    if not getattr(config.get_text_config(), "tie_word_embeddings", False):
        return
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {module: name for name, module in skeleton.named_modules()}
    embeddings, head = names[skeleton.get_input_embeddings()], names[skeleton.get_output_embeddings()]
    apart = _placed_on(spec.device_map, embeddings), _placed_on(spec.device_map, head)
    if apart[0] != apart[1]:
        raise InputError(f"variant '{spec.name}': device_map puts {embeddings} on {apart[0]} and {head} on "
                         f"{apart[1]}, but this model ties them (one tensor): give both the same device")


def devices(model) -> list[str]:
    """Where the model's modules were placed (``cpu``, ``disk``, GPU numbers); one entry for a model on one device."""
    placed = getattr(model, "hf_device_map", None) or {"": str(model.device)}
    return sorted({str(device) for device in placed.values()})


def is_split(model) -> bool:
    """Whether accelerate's hooks run the model: over several devices, or streamed in from disk."""
    placed = devices(model)
    return len(placed) > 1 or "disk" in placed


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
