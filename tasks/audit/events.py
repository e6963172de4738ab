"""What a ``quantization.completed`` event audits: one checkpoint, under the name that picks its gate.

The name decides which ``thresholds.per_variant`` entry judges the checkpoint, so the same checkpoint
must get the same name under ``serve`` as under ``run``. It is chosen, first match wins, from:

1. the event's ``name``;
2. the config's variant with the same ``path``;
3. the config's one gptq/awq variant quantized here whose method, bits, group size and symmetry are
   the checkpoint manifest's;
4. the manifest's ``name`` (``ppl-audit quantize --name``, or the audit that made it);
5. the checkpoint's folder name.
"""

from __future__ import annotations

from pathlib import Path

from tasks.config import AuditConfig, VariantSpec, parse
from tasks.methods.registry import find_method
from tasks.models.quantize import read_manifest


def _same_folder(path: str | None, folder: Path) -> bool:
    return path is not None and Path(path).expanduser().resolve() == folder


def name_event_variant(config: AuditConfig, model_path: str, method: str | None = None,
                       name: str | None = None) -> tuple[VariantSpec, str]:
    """The variant an event's checkpoint is audited as, and a line saying how its name was chosen.

    Args:
        model_path: the checkpoint's folder (or Hub id) from the event.
        method: the event's method; else the manifest's; else ``auto``: read from the checkpoint as a config's
            ``path`` is (``tasks.models.formats.detect``), so that a float model is not audited as gptq.
        name: the event's name for it, if it gave one.
    """
    manifest = read_manifest(model_path) or {}
    method = method or manifest.get("method") or "auto"
    folder = Path(model_path).expanduser().resolve()
    by_name = {v.name: v for v in config.variants}
    settings = (manifest.get("bits"), manifest.get("group_size"), manifest.get("sym"))
    same_path = [v for v in config.variants if _same_folder(v.path, folder)]
    # the manifest's method as the registry knows it (None: no method of that name)
    backend = find_method(method)
    same_settings = [v for v in config.variants
                     if v.quantize_here and v.backend is backend and v.quantization == settings]
    if name:
        template, why = by_name.get(name), "the event names it"
    elif len(same_path) == 1:
        return same_path[0], "the config's variant with this path"
    elif len(same_settings) == 1:
        template = same_settings[0]
        name, why = template.name, f"the config's {method} variant with the manifest's bits, group size and symmetry"
    else:
        name = manifest.get("name")
        template = by_name.get(name)
        why = "the checkpoint's manifest names it" if name else "its folder name (no event, config or manifest name)"
        name = name or folder.name or "variant"
        if len(same_settings) > 1:
            why += f"; {len(same_settings)} config variants have its settings, so none lends its name"
    base = template or config.baseline
    spec = {"name": name, "method": method, "path": model_path, "dtype": base.dtype, "device": base.device}
    return parse(VariantSpec, spec, "quantization.completed event"), why


def event_config(config: AuditConfig, model_path: str, method: str | None = None, baseline: str | None = None,
                 name: str | None = None) -> tuple[AuditConfig, str]:
    """The config narrowed to the one variant an event names, with that variant's own gate."""
    variant, why = name_event_variant(config, model_path, method, name)
    thresholds = config.thresholds
    gates = {k: v for k, v in thresholds.per_variant.items() if k == variant.name}
    domains = {domain: gate.model_copy(update={"per_variant": {k: v for k, v in gate.per_variant.items()
                                                               if k == variant.name}})
               for domain, gate in thresholds.per_corpus.items()}
    update = {"variants": [variant], "thresholds": thresholds.model_copy(update={"per_variant": gates,
                                                                                 "per_corpus": domains})} \
        | ({"baseline": config.baseline.model_copy(update={"path": baseline})} if baseline else {})
    return parse(AuditConfig, config.model_copy(update=update).model_dump(), "quantization.completed event"), why
