"""What a quantization's own files say, typed: the manifest ``tasks.models.quantize.quantize`` writes beside a
checkpoint (``ppl-audit.json``, also what the quantize flow returns) and the model digest it remembers; read once,
so that their users read attributes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ManifestSaid:
    """Of a quantization's manifest, what the quantize command and flow say: the digest of its calibration samples
    (``quantization.completed`` carries it), how many there were, and how long quantizing took (seconds)."""

    calibration_digest: str
    calibration_samples: int
    seconds: float

    @classmethod
    def of_json(cls, manifest: dict) -> ManifestSaid:
        calibration = manifest["calibration"]
        return cls(calibration_digest=calibration["digest"], calibration_samples=calibration["samples"],
                   seconds=manifest["seconds"])


@dataclass(frozen=True)
class RememberedDigest:
    """A remembered model digest's entry (``tasks.models.quantize.model_digest``): the sha256 it keeps, None where it
    keeps none that is a string."""

    sha256: str | None

    @classmethod
    def of_entry(cls, entry: dict) -> RememberedDigest:
        found = entry.get("sha256")
        return cls(sha256=found if isinstance(found, str) else None)


@dataclass(frozen=True)
class DynamicRecipe:
    """A recipe file ``ppl-audit tune`` logs (``gptqmodel-dynamic.json``): gptqmodel's per-module overrides
    (``dynamic``) and the bits and group size they were tuned for (None: not given)."""

    dynamic: object
    bits: int | None
    group_size: int | None

    @classmethod
    def of_json(cls, said: dict) -> DynamicRecipe:
        return cls(dynamic=said["dynamic"], bits=said.get("bits"), group_size=said.get("group_size"))
