"""What a transformers checkpoint's files and loader say, typed: a sharded checkpoint's weight index, and the loading
info ``from_pretrained(..., output_loading_info=True)`` gives; read once, so that ``tasks.models.loading`` reads
attributes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WeightIndex:
    """A sharded checkpoint's index (``model.safetensors.index.json``): the shard files its ``weight_map`` names
    (none where it has no ``weight_map``)."""

    shards: frozenset[str]

    @classmethod
    def read(cls, file: Path) -> WeightIndex:
        """The index ``file`` holds; ``OSError``, ``ValueError`` (not JSON) or ``AttributeError`` (not a mapping of
        a mapping) where it is no index."""
        said = json.loads(file.read_text())
        return cls(shards=frozenset(said.get("weight_map", {}).values()))


@dataclass(frozen=True)
class LoadingInfo:
    """What transformers' loader said of a load: the weights the model needs that the files lack (``missing``),
    those the files hold that it does not use (``unexpected``), and those of another shape (``mismatched``)."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]

    @classmethod
    def of_info(cls, info: dict) -> LoadingInfo:
        return cls(missing=tuple(info["missing_keys"]), unexpected=tuple(info["unexpected_keys"]),
                   mismatched=tuple(key for key, *_ in info["mismatched_keys"]))
