"""The models of an audit, resolved once before scoring, and the gptq/awq checkpoints made here.

``prepare`` finds each model's files (a folder, a Hub id, a registered version fetched once), reads its
config, digests its tokenizer and reads its manifest; every later step takes the resulting ``Checkpoint``
objects, so no step resolves a name again (tests/test_architecture.py holds the name resolvers to this
module). A variant that cannot be found is prepared with its problem and fails alone when it is scored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from tasks.config import DEFAULT_CALIBRATION, BaselineSpec, Gate, Thresholds, VariantSpec
from tasks.core import console, sealed
from tasks.core.errors import InputError, one_line
from tasks.core.files import discard
from tasks.core.places import cache_dir
from tasks.data.corpus import cached_tokenize, tokenizer_digest
from tasks.data.evaluation import Evaluation
from tasks.models.formats import detect
from tasks.models.loading import check_checkpoint
from tasks.models.quantize import (Calibration, Scheme, check_group_fits, check_quantizable, checkpoint_damage,
                                   draw_calibration, model_digest, quantize, read_manifest)
from tasks.models.resolve import Located, model_files, read_tokenizer, resolve_model_path


@dataclass(frozen=True)
class Checkpoint:
    """One model of an audit, resolved.

    Attributes:
        spec: its validated spec.
        role: ``baseline`` (what the others are compared with) or ``variant``.
        model: what it loads from, found and read once: its folder, ``.gguf`` file or Hub id, its config, its
            files (variants quantized at load without a path: the baseline's); None for a gptq/awq variant made
            from the baseline on first use (``made``), or one whose files cannot be found (``problem``).
        tokenizer: ``tokenizer_digest`` of its tokenizer, when ``source`` is known.
        manifest: the ``ppl_audit.json`` of a checkpoint we quantized, if it has one.
        problem: why it cannot be scored, in one line; empty when it can.
        detected: how ``method: auto`` found the method ``spec`` now holds; empty when it was given.
        gate: a variant's limits, which a sequential run watches (``tasks.audit.sequential``).
    """

    spec: VariantSpec
    role: Literal["baseline", "variant"]
    model: Located | None = None
    tokenizer: str | None = None
    manifest: dict | None = None
    problem: str = ""
    detected: str = ""
    gate: Gate | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def source(self) -> str | None:
        """Where it loads from (``model.source``)."""
        return self.model.source if self.model is not None else None


@dataclass(frozen=True)
class Lineup:
    """The audit's models: the baseline, its variants, and the baseline's tokenizer (which tokenizes the
    corpus and calibration text)."""

    baseline: Checkpoint
    variants: list[Checkpoint]
    tokenizer: object
    # where the stream is llama.cpp's tokenization (a variant runs in llama.cpp), the baseline's transformers
    # tokenizer, to say where the two part; else None
    transformers_tokenizer: object = None

    def gated(self, thresholds: Thresholds) -> Lineup:
        """The lineup with each variant's gate as ``thresholds`` set it (a domain's, ``Thresholds.for_corpus``)."""
        return replace(self, variants=[replace(c, gate=thresholds.for_variant(c.name)) for c in self.variants])


def prepare(baseline: BaselineSpec, variants: list[VariantSpec], registry: str | None = None,
            thresholds: Thresholds | None = None) -> Lineup:
    """Resolve every model once. A baseline that cannot be resolved raises ``InputError`` (there is
    nothing to compare with); a variant that cannot is prepared with its ``problem``.

    Args:
        registry: the tracking server whose model registry holds ``models:/`` names (the audit's).
        thresholds: the audit's, which give each variant its gate.
    """
    # a path error names the path; a baseline llama.cpp runs is its GGUF file (embedded: the packaged one)
    where = (locate(baseline, registry) if baseline.runtime_backend.llama_cpp
             else resolve_model_path(baseline.path, registry))
    model = Located.at(where, baseline.path)
    tokenizer = _tokenizer(model)
    lead = Checkpoint(baseline, "baseline", model, tokenizer_digest(tokenizer), read_manifest(model.source))
    gates = thresholds or Thresholds()
    found = [replace(_variant(spec, lead, registry), gate=gates.for_variant(spec.name)) for spec in variants]
    served = next((c for c in [lead, *found] if c.spec.runtime_backend.llama_cpp and not c.problem), None)
    if served is None:
        return Lineup(lead, found, tokenizer)
    # the stream as served: llama.cpp's tokenizer of the file it runs (one made later: of the file it is made from);
    # every model scores that one stream
    from tasks.models import llama_cpp

    file = Path(served.model.source) if served.model is not None else baseline_gguf(lead.model)
    return Lineup(lead, found, llama_cpp.Tokenizer(file, lead.tokenizer), tokenizer)


def llama_perplexity_stream(lineup: Lineup, mode: str) -> Lineup:
    """``lineup`` with its stream made by llama.cpp's tokenizer of its GGUF baseline where ``mode`` llama.cpp scores
    that file in transformers (llama-perplexity's stream on any text: transformers' tokenizer of a GGUF file splits
    runs of whitespace its own way); as it is otherwise, and where a model already runs in llama.cpp."""
    source = lineup.baseline.source or ""
    if lineup.transformers_tokenizer is not None or mode != "llama.cpp" or not source.endswith(".gguf"):
        return lineup
    tokenizer = served_tokenizer(Path(source), lineup.baseline.tokenizer)
    if tokenizer is None:
        return lineup
    return replace(lineup, tokenizer=tokenizer, transformers_tokenizer=lineup.tokenizer)


def served_tokenizer(file: Path, digest: str):
    """llama.cpp's tokenizer of the GGUF ``file`` (its transformers tokenizer's ``digest``); None, said in a note,
    where the llama.cpp runtime is not installed (transformers' stream then stands, which can differ)."""
    from tasks.models import llama_cpp

    if llama_cpp.version() is None:
        print(f"ppl-audit: note: {file} is tokenized by transformers, whose stream can differ from llama-perplexity's "
              f"on runs of whitespace; `{llama_cpp.SETUP}` installs llama.cpp's", file=console.err())
        return None
    return llama_cpp.Tokenizer(file, digest)


def _variant(spec: VariantSpec, baseline: Checkpoint, registry: str | None) -> Checkpoint:
    if spec.type is not None:  # a gguf variant made from the baseline's GGUF file by llama.cpp's quantizer
        from tasks.models import llama_cpp

        try:
            llama_cpp.require_llama_cpp(f"variant '{spec.name}'")
            source = baseline_gguf(baseline.model)
            if spec.imatrix:  # its importance matrix needs the calibration text: made with the gptq/awq variants
                llama_cpp.tool("llama-imatrix")
                return Checkpoint(spec, "variant")
            made = llama_cpp.made_file(source, spec.type, tensor_types=tuple(spec.tensor_types or ()))
        except (InputError, RuntimeError) as error:
            return Checkpoint(spec, "variant", problem=one_line(error))
        return Checkpoint(spec, "variant", Located.at(str(made), f"{baseline.model.name} as {spec.type}"),
                          baseline.tokenizer)
    if spec.quantize_here:
        try:  # a served run's variants are not preflighted: refused here, before hours of quantizing
            check_quantizable(baseline.model)
            check_group_fits(baseline.model, spec.method, spec.quantization[1])
        except InputError as error:
            return Checkpoint(spec, "variant", problem=one_line(error))
        return Checkpoint(spec, "variant")
    if spec.path is None:  # quantized from the baseline's files as it loads
        return Checkpoint(spec, "variant", baseline.model, baseline.tokenizer)
    try:
        model = Located.at(locate(spec, registry), spec.location)
        detected = ""
        if spec.backend.detected:
            method, detected = detect(model)
            spec = spec.model_copy(update={"method": method})
        return _with_files(Checkpoint(spec, "variant", detected=detected), model)
    except InputError as error:
        return Checkpoint(spec, "variant", problem=one_line(error))


def loading_from(checkpoint: Checkpoint, folder: str) -> Checkpoint:
    """A variant quantized here, found once it is made in ``folder`` (``tasks.audit.scoring.made``)."""
    return _with_files(checkpoint, Located.at(folder, checkpoint.name))


def _with_files(checkpoint: Checkpoint, model: Located) -> Checkpoint:
    """``checkpoint`` resolved to the files ``model``: its tokenizer digested and its manifest read."""
    return replace(checkpoint, model=model, tokenizer=tokenizer_digest(_tokenizer(model)),
                   manifest=read_manifest(model.source))


def _tokenizer(model: Located):
    """The tokenizer of ``model``; where it cannot be read, a checkpoint's missing or broken files are named first
    (``check_checkpoint``): they say more than the tokenizer library's error."""
    try:
        return read_tokenizer(model.source)
    except InputError:
        check_checkpoint(model)
        raise


def locate(spec: VariantSpec, registry: str | None = None) -> str:
    """The files a variant with a ``path`` loads: its folder, Hub id or ``.gguf`` file; ``embedded`` with method gguf
    is the packaged GGUF file the embedded model is dequantized from."""
    if spec.backend.gguf and spec.path == "embedded":
        from tasks.data.embedded import embedded_gguf

        return str(embedded_gguf())
    return resolve_model_path(spec.location, registry)


def baseline_gguf(model: Located) -> Path:
    """The GGUF file a baseline is (``embedded``: the file it is dequantized from; a transformers checkpoint: its
    conversion by llama.cpp's convert_hf_to_gguf.py, cached): what ``type:`` variants are made from."""
    if model.name == "embedded":
        from tasks.data.embedded import embedded_gguf

        return embedded_gguf()
    if model.source.endswith(".gguf"):
        return Path(model.source)
    from tasks.models import llama_cpp

    folder = model_files(model.source, fetch=True)
    return llama_cpp.converted_file(folder, model_digest(str(folder)))


def calibration_for(spec: VariantSpec, lineup: Lineup, evaluation_: Evaluation, corpus_text_of,
                    progress: bool = False) -> Calibration:
    """The calibration samples a gptq/awq variant made here is quantized with.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (only called when one is given).
    """
    settings = spec.calibration or DEFAULT_CALIBRATION
    evaluation_ = evaluation_.calibration  # an audit of several corpora calibrates on its first, for every domain
    if settings.corpus:
        text, source = corpus_text_of(settings.corpus), settings.corpus.source
    else:
        text, source = evaluation_.text, "audit corpus"
    stream = cached_tokenize(text, lineup.tokenizer, bos="none", progress="tokenize calibration" if progress else None)
    # the evaluated text, under whatever name, keeps its evaluated tokens out of calibration
    exclude = evaluation_.evaluated if stream.text_digest == evaluation_.stream.text_digest else None
    return draw_calibration(stream.ids, settings.samples, settings.seq_len, settings.seed, source, stream.text_digest,
                            exclude)


def importance_gguf(spec: VariantSpec, lineup: Lineup, evaluation_: Evaluation, corpus_text_of) -> str:
    """The GGUF file of a ``type:`` variant with ``imatrix``: made by llama.cpp's quantizer with the importance matrix
    llama-imatrix computes over its calibration samples' text, in chunks of their length (cached)."""
    from tasks.models import llama_cpp

    calibration = calibration_for(spec, lineup, evaluation_, corpus_text_of)
    text = "".join(lineup.tokenizer.decode(sample) for sample in calibration.samples)
    importance = llama_cpp.ImportanceText(text, calibration.seq_len, calibration.digest)
    return str(llama_cpp.made_file(baseline_gguf(lineup.baseline.model), spec.type, importance,
                                   tuple(spec.tensor_types or ())))


def quantized_checkpoint(spec: VariantSpec, lineup: Lineup, evaluation_: Evaluation, corpus_text_of,
                         progress: bool = False) -> str:
    """The folder of a gptq/awq variant made from the baseline, quantizing it on first use (cached)."""
    bits, group_size, sym = spec.quantization
    calibration = calibration_for(spec, lineup, evaluation_, corpus_text_of)
    baseline = lineup.baseline.source
    baseline_digest = model_digest(str(model_files(baseline, fetch=True)))
    dynamic = spec.dynamic or {}  # a recipe's overrides (``ppl-audit tune``): another checkpoint, kept apart
    key = json.dumps([baseline_digest, spec.method, bits, group_size, sym, calibration.digest]
                     + ([dynamic] if dynamic else []), sort_keys=True)
    out = cache_dir() / "quantized" / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    made_from = {"source_model_digest": baseline_digest, "method": spec.method, "bits": bits, "group_size": group_size,
                 "sym": sym, "calibration": calibration.describe()} | ({"dynamic": dynamic} if dynamic else {})
    manifest = read_manifest(str(out))
    problem = None if manifest is None else checkpoint_damage(out, manifest, made_from)
    if problem:  # never scored: it would give wrong numbers, or fail every later audit
        sealed.warn_remade("quantized checkpoint", out, problem)
    if manifest is None or problem:
        if out.exists():  # a folder without its manifest is not a checkpoint: made again
            discard(out)
        try:
            quantize(lineup.baseline.model, Scheme(spec.method, bits, group_size, sym, dynamic), calibration, out,
                     lineup.tokenizer, name=spec.name, progress=progress)
        except FileExistsError:  # another audit made the same one meanwhile
            if read_manifest(str(out)) is None:
                raise
    return str(out)
