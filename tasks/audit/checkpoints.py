"""The models of an audit, resolved once before scoring, and the gptq/awq checkpoints made here.

``prepare`` finds each model's files (a folder, a Hub id, a registered version fetched once), digests
its tokenizer and reads its manifest; every later step takes the resulting ``Checkpoint`` objects, so
no step resolves a name again. A variant that cannot be found is prepared with its problem and fails
alone when it is scored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Literal

from tasks.config import DEFAULT_CALIBRATION, BaselineSpec, Gate, Thresholds, VariantSpec
from tasks.core import sealed
from tasks.core.errors import InputError, one_line
from tasks.core.files import discard
from tasks.core.places import cache_dir
from tasks.data.corpus import cached_tokenize, tokenizer_digest
from tasks.data.evaluation import Evaluation
from tasks.models.formats import detect, locate
from tasks.models.quantize import (Calibration, Scheme, check_group_fits, check_quantizable, checkpoint_damage,
                                   draw_calibration, model_digest, quantize, read_manifest)
from tasks.models.resolve import load_tokenizer, model_files, resolve_model_path


@dataclass(frozen=True)
class Checkpoint:
    """One model of an audit, resolved.

    Attributes:
        spec: its validated spec.
        role: ``baseline`` (what the others are compared with) or ``variant``.
        source: the local folder, ``.gguf`` file or Hub id it loads from (variants quantized at load without
            a path: the baseline's); None for a gptq/awq variant made from the baseline on first use, or one
            whose files cannot be found (``problem``).
        tokenizer: ``tokenizer_digest`` of its tokenizer, when ``source`` is known.
        manifest: the ``ppl_audit.json`` of a checkpoint we quantized, if it has one.
        problem: why it cannot be scored, in one line; empty when it can.
        detected: how ``method: auto`` found the method ``spec`` now holds; empty when it was given.
        gate: a variant's limits, which a sequential run watches (``tasks.audit.sequential``).
    """

    spec: VariantSpec
    role: Literal["baseline", "variant"]
    source: str | None = None
    tokenizer: str | None = None
    manifest: dict | None = None
    problem: str = ""
    detected: str = ""
    gate: Gate | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Lineup:
    """The audit's models: the baseline, its variants, and the baseline's tokenizer (which tokenizes the
    corpus and calibration text)."""

    baseline: Checkpoint
    variants: list[Checkpoint]
    tokenizer: object


def prepare(baseline: BaselineSpec, variants: list[VariantSpec], registry: str | None = None,
            thresholds: Thresholds | None = None) -> Lineup:
    """Resolve every model once. A baseline that cannot be resolved raises ``InputError`` (there is
    nothing to compare with); a variant that cannot is prepared with its ``problem``.

    Args:
        registry: the tracking server whose model registry holds ``models:/`` names (the audit's).
        thresholds: the audit's, which give each variant its gate.
    """
    folder = resolve_model_path(baseline.path, registry)
    tokenizer = load_tokenizer(folder)
    digest = tokenizer_digest(tokenizer)
    lead = Checkpoint(baseline, "baseline", folder, digest, read_manifest(folder))
    gates = thresholds or Thresholds()
    return Lineup(lead, [replace(_variant(spec, lead, registry), gate=gates.for_variant(spec.name))
                         for spec in variants], tokenizer)


def _variant(spec: VariantSpec, baseline: Checkpoint, registry: str | None) -> Checkpoint:
    if spec.quantize_here:
        try:  # a served run's variants are not preflighted: refused here, before hours of quantizing
            check_quantizable(baseline.source)
            check_group_fits(baseline.source, spec.method, spec.quantization[1])
        except InputError as error:
            return Checkpoint(spec, "variant", problem=one_line(error))
        return Checkpoint(spec, "variant")
    if spec.path is None:  # quantized from the baseline's files as it loads
        return Checkpoint(spec, "variant", baseline.source, baseline.tokenizer)
    try:
        source = locate(spec, registry)
        detected = ""
        if spec.method == "auto":
            method, detected = detect(source)
            spec = spec.model_copy(update={"method": method})
        return Checkpoint(spec, "variant", source, tokenizer_digest(load_tokenizer(source)), read_manifest(source),
                          detected=detected)
    except InputError as error:
        return Checkpoint(spec, "variant", problem=one_line(error))


def calibration_for(spec: VariantSpec, lineup: Lineup, evaluation_: Evaluation, corpus_text_of,
                    progress: bool = False) -> Calibration:
    """The calibration samples a gptq/awq variant made here is quantized with.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (only called when one is given).
    """
    settings = spec.calibration or DEFAULT_CALIBRATION
    if settings.corpus:
        text, source = corpus_text_of(settings.corpus), settings.corpus.source
    else:
        text, source = evaluation_.text, "audit corpus"
    stream = cached_tokenize(text, lineup.tokenizer, bos="none", progress="tokenize calibration" if progress else None)
    # the evaluated text, under whatever name, keeps its evaluated tokens out of calibration
    exclude = evaluation_.evaluated if stream.text_digest == evaluation_.stream.text_digest else None
    return draw_calibration(stream.ids, settings.samples, settings.seq_len, settings.seed, source, stream.text_digest,
                            exclude)


def quantized_checkpoint(spec: VariantSpec, lineup: Lineup, evaluation_: Evaluation, corpus_text_of,
                         progress: bool = False) -> str:
    """The folder of a gptq/awq variant made from the baseline, quantizing it on first use (cached)."""
    bits, group_size, sym = spec.quantization
    calibration = calibration_for(spec, lineup, evaluation_, corpus_text_of)
    baseline = lineup.baseline.source
    baseline_digest = model_digest(str(model_files(baseline, fetch=True)))
    key = json.dumps([baseline_digest, spec.method, bits, group_size, sym, calibration.digest])
    out = cache_dir() / "quantized" / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    made_from = {"source_model_digest": baseline_digest, "method": spec.method, "bits": bits, "group_size": group_size,
                 "sym": sym, "calibration": calibration.describe()}
    manifest = read_manifest(str(out))
    problem = None if manifest is None else checkpoint_damage(out, manifest, made_from)
    if problem:  # never scored: it would give wrong numbers, or fail every later audit
        sealed.warn_remade("quantized checkpoint", out, problem)
    if manifest is None or problem:
        if out.exists():  # a folder without its manifest is not a checkpoint: made again
            discard(out)
        try:
            quantize(baseline, Scheme(spec.method, bits, group_size, sym), calibration, out, name=spec.name,
                     progress=progress)
        except FileExistsError:  # another audit made the same one meanwhile
            if read_manifest(str(out)) is None:
                raise
    return str(out)
