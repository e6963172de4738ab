"""Score one model of an audit: make or load it, check it is comparable, and measure it.

The baseline (``baseline_outcome``) and a variant (``variant_outcome``), whole or in a piece, never raise but for a
transient failure: a model that cannot be loaded, is refused, runs out of memory or produces NaN ends as a failed
``VariantResult`` with a one-line reason (``tasks.audit.failures``), so the others carry on.
"""

from __future__ import annotations

import gc
import math
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from tasks.audit import reference
from tasks.audit.checkpoints import Checkpoint, Lineup, importance_gguf, loading_from, quantized_checkpoint
from tasks.audit.cluster import worker
from tasks.audit.failures import Failure, attempt
from tasks.audit.manifest import drift_tolerance
from tasks.audit.pieces import WHOLE, Against, Piece, Sample, Slices, Whole, Windows
from tasks.audit.sequential import Watch
from tasks.config import VariantSpec
from tasks.core.errors import DamagedReference, InputError, WorkerError, one_line
from tasks.core.places import references_dir
from tasks.data.evaluation import Evaluation
from tasks.engine import kv_cache
from tasks.engine.batching import auto_batch_size
from tasks.engine.body import speed_up
from tasks.engine.model_facts import input_device
from tasks.engine.perplexity import Part, PerplexityResult, combine, score_part, scored_targets
from tasks.engine.scoring_options import ScoreOptions
from tasks.engine.sequential import window_order
from tasks.models.placement import devices, is_split, main_device, run_on
from tasks.models.quantize import check_disjoint
from tasks.models.resolve import Located, device_and_dtype, model_files
from tasks.models.variants import VariantFacts, cache_format, check_same_tokenizer, load_variant
from tasks.record.reference_said import Divergence, ReferenceSaid
from tasks.record.results import VariantResult
from tasks.record.shard_said import ShardSaid


def score_with_backoff(model, evaluation_: Evaluation, name: str, progress: bool,
                       windows: tuple[int, int] | None = None, **options) -> Part:
    """Score the windows ``windows`` (all when None) at the configured batch size, halving it on out-of-memory
    (the result does not depend on it)."""
    settings = evaluation_.settings
    batch_size = settings.batch_size
    if batch_size == "auto":
        batch_size = auto_batch_size(model, evaluation_.stream, settings.window, settings.stride, settings.mode,
                                     kv_cache=options.get("kv_cache"))
    while True:
        try:
            return score_part(model, evaluation_.stream, settings.windowing, batch_size, windows,
                              ScoreOptions(progress, name, **options))
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
        # Freed only here, out of the handler: the error's traceback holds the frames of the batch that failed, and
        # with them its tensors. Emptied inside the handler, the cache kept them: on an H200 every halving down to
        # a batch of 1 ran out of memory again (tests/gpu, 2026-11-27).
        batch_size //= 2
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def result_of_parts(parts: list[Part], evaluation_: Evaluation, name: str) -> PerplexityResult:
    """The model's result from parts that cover the audit's windows."""
    settings = evaluation_.settings
    return combine(parts, evaluation_.stream, name, settings.window, settings.stride, settings.mode)


def perplexity_with_backoff(model, evaluation_: Evaluation, name: str, progress: bool, **options) -> PerplexityResult:
    """Every window scored here (``score_with_backoff``), as one result."""
    return result_of_parts([score_with_backoff(model, evaluation_, name, progress, **options)], evaluation_, name)


PARITY_WINDOWS = 2  # a split model's first windows, scored on one device too: enough to see a broken split


def check_parity(spec: VariantSpec, source: Located, model, facts: VariantFacts, evaluation_: Evaluation) -> dict:
    """Refuse a model split over several devices (``device_map``) that scores the first windows differently
    from the same checkpoint on one device, beyond the float noise of its dtype (``reference.DRIFT_TOLERANCE``):
    multi-GPU splits have silently wrecked perplexity elsewhere (llama.cpp #8685: 7.10 became 26,727).

    The one-device copy is loaded in host memory and computes on the split's first device (``run_on``), so
    the check needs host memory for one more copy of the model, not GPU memory. Returns what it compared.
    """
    windows = (0, min(PARITY_WINDOWS, len(evaluation_.windows)))
    form = cache_format(spec)
    split = score_with_backoff(model, evaluation_, spec.name, False, windows, kv_cache=form).scores.token_nll.double()
    alone = spec.model_copy(update={"device_map": None, "max_memory": None, "device": "cpu", "dtype": facts.dtype})
    copy, _ = load_variant(alone, source)
    try:
        one = score_with_backoff(run_on(copy, main_device(model)), evaluation_, spec.name, False, windows,
                                 kv_cache=form)
    finally:
        del copy
        gc.collect()
    difference = split - one.scores.token_nll.double()
    worst, mean = float(difference.abs().max()), float(difference.mean().abs())
    token_limit, mean_limit = drift_tolerance(facts.dtype)
    split_over = ", ".join(devices(model))
    if not (worst <= token_limit and mean <= mean_limit):  # NaN fails too
        raise InputError(f"{spec.name}: split over {split_over} it scores the first {len(difference)} tokens unlike "
                         f"one device (largest |ΔNLL| {worst:.3g}, mean {mean:.3g}; {facts.dtype} noise is "
                         f"{token_limit:g}, {mean_limit:g}): the split computes something else; check the device_map")
    return {"devices": split_over, "tokens": len(difference), "max_abs_nll_difference": worst,
            "mean_nll_difference": mean}


def _loaded(spec: VariantSpec, source: Located, evaluation_: Evaluation):
    """``load_variant``, and a model split over several devices checked against one device first."""
    model, facts = load_variant(spec, source, evaluation_.settings.window)
    if is_split(model):
        facts.parity = check_parity(spec, source, model, facts, evaluation_)
    speed_up(model, evaluation_.settings.body)
    facts.body = evaluation_.settings.body
    return model, facts


def _reuse(found: reference.Reference, model: Located) -> tuple[PerplexityResult, VariantFacts]:
    found.touch()
    facts = VariantFacts(**found.manifest.facts)
    # a reference stored before caches were measured: its model says (llama.cpp's cache is its own: not measured)
    if math.isnan(facts.kv_bytes_per_token) and facts.quantization.get("runtime") != "llama.cpp":
        facts.kv_bytes_per_token = kv_cache.bytes_per_token(model.config.get_text_config(),
                                                            torch.finfo(getattr(torch, facts.dtype)).bits)
    return found.result(), facts


def baseline_identity(checkpoint: Checkpoint, evaluation_: Evaluation) -> tuple[Path | None, dict | None, dict]:
    """``(its local files, identity, environment)`` of an audit's baseline (``tasks.audit.reference``); no identity
    for a model whose files are not on this machine."""
    device, dtype = device_and_dtype(checkpoint.spec)
    folder = model_files(checkpoint.source)  # on this machine, now: a worker may see what the lineup's did not
    identity = None if folder is None else reference.identity(folder, checkpoint.tokenizer, evaluation_.stream,
                                                              evaluation_.settings, dtype)
    if identity is not None and checkpoint.spec.runtime_backend.llama_cpp:  # its kernels and settings make its logits
        from tasks.models import llama_cpp

        settings = llama_cpp.described(checkpoint.spec.llama_cpp_settings)
        identity |= {"runtime": f"llama.cpp {llama_cpp.version()}",
                     "llama_cpp": {k: v for k, v in settings.items() if k != "threads"}}  # threads do not move them
    return folder, identity, reference.environment(device)


@dataclass
class Lookup:
    """What the stored references say of an audit's baseline before it is loaded: its result and facts when one is
    ``reused``; else the ``key`` its reference is written under (None: none can be, ``problem`` says why), what its
    manifest starts from (the baseline's ``identity``, ``environment`` and ``source``: ``made_from``), the reference a
    rescore is compared with (``previous``), and, for the record, ``said`` (``baseline_key``, damaged references
    ``removed``)."""

    said: ReferenceSaid
    reused: tuple[PerplexityResult, VariantFacts] | None = None
    key: str | None = None
    identity: dict | None = None
    environment: dict = field(default_factory=dict)
    source: str = ""
    previous: reference.Reference | None = None
    problem: str = ""
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # its slices' folder: this audit's own

    def writer(self, stack: ExitStack, targets, offset: int = 0) -> reference.Writer | None:
        """A ``Writer`` in a scratch folder that ``stack`` removes; None, and ``problem`` set, where none can be."""
        if self.key is None:
            return None
        try:
            writer = reference.Writer(stack.enter_context(reference.building()) / self.key, targets, offset)
            writer.staging.mkdir()
            return writer
        except OSError as error:  # the reference is lost, not the baseline's score
            self.problem = f"could not write the baseline reference in {references_dir()}: {error}"
            return None

    def made_from(self, facts: dict) -> dict:
        """What its reference's manifest is made from (``reference.Draft``), with the baseline's load ``facts``."""
        return {"identity": self.identity, "environment": self.environment, "source": self.source, "facts": facts}

    def scored(self, result: PerplexityResult) -> ReferenceSaid:
        """What the record says of a baseline scored to ``result`` before its reference is put in place."""
        drift = None if self.previous is None else reference.drift(self.previous, result, self.environment)
        return replace(self.said, baseline="scored", key=None, drift=drift, problem=self.problem or None)

    def publish(self, write, said: ReferenceSaid) -> ReferenceSaid:
        """``said`` with the reference ``write()`` puts in place, or the problem that kept it from being written. A
        rescore in this environment takes the old one's place; a race with another audit keeps theirs."""
        if self.problem:
            return said
        try:
            stored = write(self.previous is not None and self.previous.key == self.key)
            return replace(said, key=stored.key, path=str(stored.folder))
        except (OSError, DamagedReference) as error:  # a Writer's own problem (no errno) already says what it is
            problem = str(error) if getattr(error, "errno", 0) is None else f"could not write the baseline reference: {error}"
            return replace(said, problem=problem)


def look_up(checkpoint: Checkpoint, evaluation_: Evaluation) -> Lookup:
    """The baseline's ``Lookup``: its reference found (checked; a damaged one removed) or the key to write one under."""
    folder, identity, environment = baseline_identity(checkpoint, evaluation_)
    if identity is None:
        return Lookup(ReferenceSaid(), problem=f"{checkpoint.source} is not on this machine: nothing identifies it "
                                               "well enough to keep a reference")
    reuse, previous, removed = reference.find_intact(identity, environment, checkpoint.spec.rescore)
    said = ReferenceSaid(baseline_key=reference.baseline_key(identity), removed=tuple(removed))
    if reuse is not None:
        result, facts = _reuse(reuse, checkpoint.model)
        facts.worker = worker()
        return Lookup(replace(said, baseline="reused", key=reuse.key, path=str(reuse.folder)), reused=(result, facts))
    return Lookup(said, key=reference.key_of(identity, environment), previous=previous,
                  identity=identity, environment=environment, source=str(folder))


def _score_baseline(checkpoint: Checkpoint, evaluation_: Evaluation, progress: bool
                    ) -> tuple[PerplexityResult, VariantFacts, ReferenceSaid]:
    """The baseline's result, from its stored reference or scored (writing one), and what happened, for
    the record (``ReferenceSaid``): ``baseline`` (``reused``/``scored``), ``key`` and ``path`` of the reference,
    ``drift`` (a rescore against the reference stored before), ``problem`` (why there is no reference), ``removed``
    (damaged references found and removed, ``reference.find_intact``), ``baseline_key`` (which audits compare with
    this one, ``reference.baseline_key``)."""
    settings = evaluation_.settings
    found = look_up(checkpoint, evaluation_)
    if found.reused is not None:
        return *found.reused, found.said
    model, facts = _loaded(checkpoint.spec, checkpoint.model, evaluation_)
    with ExitStack() as stack:
        writer = found.writer(stack, scored_targets(evaluation_.stream, settings.window, settings.stride, settings.mode))
        result = perplexity_with_backoff(model, evaluation_, checkpoint.spec.name, progress, keep_hidden=writer)
        manifest = found.made_from(facts.summary()) | {"softcap": softcap(model)}
        said = found.publish(lambda replace: writer.publish(found.key, manifest, result, model.get_output_embeddings(),
                                                            replace), found.scored(result))
    return result, facts, said


def softcap(model) -> float | None:
    """The soft-cap its LM head's logits pass through (Gemma 2's), None for most models."""
    return getattr(model.config, "final_logit_softcapping", None)


def slices_dir(lookup: Lookup) -> Path:
    """Where an audit's baseline shards put their slices of its reference (``reference.Writer.seal``)."""
    return references_dir() / ".slices" / f"{lookup.key}-{lookup.token}"


def _baseline_slice(checkpoint: Checkpoint, evaluation_: Evaluation, lookup: Lookup, windows: tuple[int, int],
                    progress: bool) -> tuple[Part, VariantFacts, ReferenceSaid | None]:
    """A shard of the baseline: its windows scored and their slice of the reference written (``slice``: its folder),
    or the problem that kept it from being written."""
    settings = evaluation_.settings
    model, facts = _loaded(checkpoint.spec, checkpoint.model, evaluation_)
    targets = scored_targets(evaluation_.stream, settings.window, settings.stride, settings.mode)
    counts = [w.n_scored for w in evaluation_.windows]
    first, stop = sum(counts[:windows[0]]), sum(counts[:windows[1]])
    with ExitStack() as stack:
        writer = lookup.writer(stack, targets[first:stop], first)
        part = score_with_backoff(model, evaluation_, checkpoint.spec.name, progress, windows, keep_hidden=writer)
        if writer is None:
            return part, facts, ReferenceSaid(problem=lookup.problem) if lookup.problem else None
        try:
            head = None if windows[0] else reference.head_entry(
                Path(lookup.source), model.get_output_embeddings(), writer.staging) | {"softcap": softcap(model)}
            out = slices_dir(lookup) / f"windows-{windows[0]}-{windows[1] - 1}-{uuid.uuid4().hex[:8]}"
            return part, facts, ReferenceSaid(key=lookup.key, slice=str(writer.seal(head, out)))
        except OSError as error:
            return part, facts, ReferenceSaid(problem=writer.problem or f"could not write the baseline reference: {error}")


def join_reference(lookup: Lookup, baseline: VariantResult, shards: list[VariantResult], evaluation_: Evaluation
                   ) -> ReferenceSaid | None:
    """What the record says of a baseline scored in ``shards`` (merged into ``baseline``): its reference joined from
    their slices and put in place whole (``reference.assemble``), or the problem that kept it from being; the
    audit's slices removed either way. None for a baseline that failed: it has no reference to speak of."""
    settings = evaluation_.settings
    try:
        if not baseline.ok:
            return None
        said = lookup.scored(baseline.result)
        problem = next((s.reference.problem for s in shards if s.reference is not None and s.reference.problem), None)
        if problem or lookup.problem:
            return replace(said, problem=problem or lookup.problem)
        targets = scored_targets(evaluation_.stream, settings.window, settings.stride, settings.mode)
        manifest = lookup.made_from(baseline.facts.summary())
        with reference.building() as scratch:
            staging = scratch / lookup.key
            staging.mkdir()
            return lookup.publish(lambda replace: reference.assemble(
                [Path(s.reference.slice) for s in shards], staging, lookup.key, manifest, baseline.result, targets,
                replace), said)
    finally:
        shutil.rmtree(slices_dir(lookup), ignore_errors=True)


def made(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
         progress: bool = False) -> Checkpoint:
    """A gptq/awq variant made here from the baseline, as a checkpoint with its new folder, tokenizer (the
    baseline's, saved with it) and manifest, or a GGUF variant made with an importance matrix (its file); any other
    checkpoint as it is. Raises what quantizing raises."""
    if checkpoint.source is not None or checkpoint.problem or checkpoint.role == "baseline":
        return checkpoint
    if checkpoint.spec.imatrix:
        return loading_from(checkpoint, importance_gguf(checkpoint.spec, lineup, evaluation_, corpus_text_of))
    source = quantized_checkpoint(checkpoint.spec, lineup, evaluation_, corpus_text_of, progress)
    return loading_from(checkpoint, source)


def make_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
                 progress: bool = False) -> Checkpoint:
    """``made``, with a failure to make it as the checkpoint's ``problem``: once, before its shards load it."""
    done = attempt(lambda: made(checkpoint, lineup, evaluation_, corpus_text_of, progress))
    return replace(checkpoint, problem=done.reason) if isinstance(done, Failure) else done


@dataclass(frozen=True)
class BaselineSlice:
    """A shard of the baseline: its ``windows`` scored and their slice of its reference written under the key its
    ``look_up`` found (``lookup``), for ``join_reference`` to join."""

    windows: Windows
    lookup: Lookup

    def row(self) -> dict:
        return self.windows.row()

    def named(self) -> str:
        return self.windows.named()


def baseline_outcome(checkpoint: Checkpoint, evaluation_: Evaluation, piece: Whole | BaselineSlice = WHOLE,
                   progress: bool = False) -> VariantResult:
    """The audit's baseline, whole or a shard of it (``piece``); a failure is a failed result, never an exception.

    Whole, it is read from its stored reference when one matches (``tasks.audit.reference``), else scored and its
    reference written; a shard writes its slice of the reference (its ``reference`` says its ``slice`` or
    ``problem``; ``join_reference``). Only a ``TransientError`` (network, remote storage) is raised, for the caller
    to retry; out of memory is not retried at the same batch size: the batch size is halved until it fits.
    """
    if isinstance(piece, BaselineSlice):
        return _timed(lambda: _baseline_shard(checkpoint, evaluation_, piece, progress))
    return _timed(lambda: _whole_baseline(checkpoint, evaluation_, progress))


def _whole_baseline(checkpoint: Checkpoint, evaluation_: Evaluation, progress: bool) -> VariantResult:
    spec = checkpoint.spec
    if checkpoint.problem:
        return _failed(spec, _refused(checkpoint.problem))
    scored = attempt(lambda: _score_baseline(checkpoint, evaluation_, progress))
    if isinstance(scored, Failure):
        return _failed(spec, scored, manifest=checkpoint.manifest)
    result, facts, said = scored
    return VariantResult(spec.name, spec.method, "ok", result=result, facts=replace(facts, worker=worker()),
                         manifest=checkpoint.manifest, reference=said)


def _baseline_shard(checkpoint: Checkpoint, evaluation_: Evaluation, piece: BaselineSlice, progress: bool
                    ) -> VariantResult:
    spec, rows = checkpoint.spec, (piece.row(),)
    if checkpoint.problem:
        return _failed(spec, _refused(checkpoint.problem), shards=rows)
    scored = attempt(lambda: _baseline_slice(checkpoint, evaluation_, piece.lookup, piece.windows.bounds, progress))
    if isinstance(scored, Failure):
        return _failed(spec, scored, manifest=checkpoint.manifest, shards=rows)
    part, facts, said = scored
    return VariantResult(spec.name, spec.method, "ok", facts=replace(facts, worker=worker()),
                         manifest=checkpoint.manifest, reference=said, part=part, shards=_done(rows, part))


def variant_outcome(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, against: Against = None,
                  piece: Piece = WHOLE, corpus_text_of=None, progress: bool = False) -> VariantResult:
    """One variant made (gptq/awq made here), checked, loaded and scored on the audit's stream, whole or in a piece
    (``piece``: a shard's windows, a sequential run's sample); a failure is a failed result, never an exception.

    It measures its divergence from the baseline through its reference, ``against``: the baseline's outcome (the
    stored reference its ``reference`` names), or the slices the baseline's shards wrote (``Slices``): the baseline's
    LM head and hidden states, never the baseline model. Whole and against a scored baseline, a sequential run stops
    itself once its verdict is settled.

    Only a ``TransientError`` (network, remote storage) is raised, for the caller to retry. Out of memory is not
    retried at the same batch size: the batch size is halved until it fits.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (gptq/awq made here).
    """
    return _timed(lambda: _variant(checkpoint, lineup, evaluation_, against, piece, corpus_text_of, progress))


def _timed(measure: Callable[[], VariantResult]) -> VariantResult:
    """``measure()``'s outcome, with when it began and ended (quantizing and loading included)."""
    started = time.time()
    try:
        outcome = measure()
    finally:  # the model, loaded in a function of its own, is gone: its memory is handed back now
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return replace(outcome, started=started, ended=time.time())


def _failed(spec: VariantSpec, failure: Failure, **known) -> VariantResult:
    return VariantResult.failed(spec.name, spec.method, failure.reason, failure.retry_elsewhere, **known)


def _refused(problem: str) -> Failure:
    """A checkpoint's ``problem``, found as it was prepared or made, as its failure."""
    return Failure(one_line(InputError(problem)))


def _done(rows: tuple[ShardSaid, ...], part: Part) -> tuple[ShardSaid, ...]:
    """A piece's row (none for a whole model) with what it scored."""
    return tuple(replace(row, tokens=int(part.scores.window_tokens.sum()), seconds=part.wall_seconds) for row in rows)


def _variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, against: Against, piece: Piece,
             corpus_text_of, progress: bool) -> VariantResult:
    """``variant_outcome``'s outcome but for its times: what was known of the variant when it failed is kept (its
    manifest once made, its facts once loaded)."""
    spec, rows = checkpoint.spec, tuple(filter(None, [piece.row()]))
    if checkpoint.problem:
        return _failed(spec, _refused(checkpoint.problem), shards=rows)
    ready = attempt(lambda: made(checkpoint, lineup, evaluation_, corpus_text_of, progress))
    if isinstance(ready, Failure):
        return _failed(spec, ready, manifest=checkpoint.manifest, shards=rows)
    loaded = attempt(lambda: _checked_and_loaded(ready, lineup, evaluation_))
    if isinstance(loaded, Failure):
        return _failed(spec, loaded, manifest=ready.manifest, shards=rows)
    model, facts = loaded
    measured = attempt(lambda: _measured(model, ready, lineup, evaluation_, against, piece, progress))
    if isinstance(measured, Failure):
        return _failed(spec, measured, manifest=ready.manifest, facts=facts, shards=rows)
    part, result, divergence, sequential = measured
    return VariantResult(spec.name, spec.method, "ok", result=result, facts=replace(facts, worker=worker()),
                         manifest=ready.manifest, divergence=divergence,
                         part=None if isinstance(piece, Whole) else part, shards=_done(rows, part),
                         sequential=sequential)


def _checked_and_loaded(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation) -> tuple:
    """A made variant checked (its calibration disjoint from the evaluated text, the baseline's tokenizer) and loaded:
    ``(model, facts)``."""
    if checkpoint.manifest:
        check_disjoint(checkpoint.manifest, evaluation_.stream.text_digest, evaluation_.evaluated, checkpoint.spec.name)
    check_same_tokenizer(checkpoint.spec.name, lineup.baseline.tokenizer, checkpoint.tokenizer)
    model, facts = _loaded(checkpoint.spec, checkpoint.model, evaluation_)
    if checkpoint.detected:
        facts = replace(facts, quantization=facts.quantization | {"detected": checkpoint.detected})
    return model, facts


def _measured(model, checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, against: Against, piece: Piece,
              progress: bool) -> tuple[Part, PerplexityResult | None, Divergence | None, dict | None]:
    """A loaded variant scored: ``(part, result, divergence, sequential)``; a piece has no ``result`` (its ``part``
    is merged with the others'), and ``sequential`` is a run's that may stop once its verdict is settled."""
    spec, settings = checkpoint.spec, evaluation_.settings
    baseline, divergence, stored = None, None, None
    said = against.reference if isinstance(against, VariantResult) and against.ok else None
    if settings.divergence and isinstance(against, Slices):
        baseline, divergence = _read_slices(against.shards, lineup.baseline.source, input_device(model))
    elif settings.divergence and said is not None and said.path:
        stored = reference.Reference.open(Path(said.path))
        if stored is None:
            raise WorkerError(f"the baseline reference {said.path} is not on {worker()}; every "
                              "worker must see $PPL_AUDIT_REFERENCES at the same path")
        with _removed_when_damaged(stored):
            baseline = stored.baseline(lineup.baseline.source, input_device(model))
        divergence = Divergence(said.key, _head_bytes(baseline))
    elif settings.divergence:
        divergence = Divergence.missing((said is not None and said.problem) or "the baseline was not scored")
    if baseline is not None and settings.mode == "llama.cpp":  # llama-perplexity's KLD too, to set beside its tables
        baseline = replace(baseline, llama_kld=True)
    watch, sequence = None, {}
    n_windows = len(evaluation_.windows)
    if isinstance(piece, Sample):
        rest = np.setdiff1d(np.arange(n_windows), piece.windows)
        sequence = {"order": np.concatenate([np.asarray(piece.windows, np.int64), rest]), "stop_at": len(piece.windows)}
    elif settings.sequential and isinstance(piece, Whole) and isinstance(against, VariantResult) and against.ok:
        watch = Watch.against(checkpoint.gate, against.result, settings.order_seed)
        sequence = {"order": window_order(n_windows, settings.order_seed), "until": watch}
    bounds = piece.bounds if isinstance(piece, Windows) else None
    with _removed_when_damaged(stored):
        part = score_with_backoff(model, evaluation_, spec.name, progress, bounds, reference=baseline,
                                  kv_cache=cache_format(spec), **sequence)
    if not isinstance(piece, Whole):
        return part, None, divergence, None
    result = result_of_parts([part], evaluation_, spec.name)
    return part, result, divergence, watch.said(result) if watch else None


def _head_bytes(baseline) -> int:
    """The memory the baseline's LM head takes beside the variant."""
    return sum(t.nbytes for t in baseline.head.parameters())


@contextmanager
def _removed_when_damaged(stored: reference.Reference | None):
    """A stored reference that a variant finds damaged (its head on its hidden states against its NLL, checked at each
    batch; its hidden states' size) is removed as the failure is raised, so that the next audit scores the baseline
    again, as the failure's line says, instead of reusing it and failing the same way."""
    try:
        yield
    except DamagedReference:
        if stored is not None:
            reference.remove_damaged(stored)
        raise


def _read_slices(shards: tuple[VariantResult, ...], source: str, device: torch.device) -> tuple:
    """The baseline a variant's shard measures its divergence against while its reference is in slices (the outcomes
    of the baseline's ``shards`` that wrote them), and its ``Divergence``; None, and why, where they wrote none."""
    said = [shard.reference for shard in shards]
    problem = next((s.problem for s in said if s is not None and s.problem), None)
    if problem or not all(s is not None and s.slice for s in said):
        return None, Divergence.missing(problem or "the baseline's shards wrote no reference")
    folders = [Path(s.slice) for s in said]
    if not all(folder.is_dir() for folder in folders):
        raise WorkerError(f"the baseline reference's slices in {folders[0].parent} are not on {worker()}; every "
                          "worker must see $PPL_AUDIT_REFERENCES at the same path")
    against = reference.slice_baseline(folders, shards[-1].part.scores.token_nll, source, device)
    return against, Divergence(said[0].key, _head_bytes(against))


def merge_shards(shards: list[VariantResult], evaluation_: Evaluation) -> VariantResult:
    """One variant's outcome from its shards' (in window order): their parts combined into one result
    (``tasks.engine.perplexity.combine``: bit for bit what one worker scoring every window gives), every worker named.
    It fails, with the first failed shard's reason, when a shard failed."""
    first, rows = shards[0], tuple(row for s in shards for row in s.shards)
    known = {"manifest": first.manifest, "facts": first.facts, "divergence": first.divergence, "shards": rows,
             # a task that raised before it started (e.g. on a worker that cannot reach
             # Prefect's API) has no times
             "started": min((s.started for s in shards if s.started), default=None),
             "ended": max((s.ended for s in shards if s.ended), default=None)}
    failed = next((n for n, shard in enumerate(shards) if not shard.ok), None)
    if failed is not None:
        reason = shards[failed].reason
        if len(shards) > 1:
            reason = f"shard {failed + 1} of {len(shards)}: {reason}"
        return VariantResult.failed(first.name, first.method, reason, **known)
    result = attempt(lambda: result_of_parts([shard.part for shard in shards], evaluation_, first.name))
    if isinstance(result, Failure):
        return VariantResult.failed(first.name, first.method, result.reason, result.retry_elsewhere, **known)
    workers = ", ".join(dict.fromkeys(row.worker for row in rows))
    return VariantResult(first.name, first.method, "ok", result=result, **known | {"facts": replace(first.facts,
                                                                                                  worker=workers)})
