"""Score one model of an audit: make or load it, check it is comparable, and measure it.

``score_variant`` never raises but for a transient failure: a model that cannot be loaded, is
refused, runs out of memory or produces NaN ends as a failed ``VariantResult`` with a one-line reason,
so the others carry on.
"""

from __future__ import annotations

import gc
import math
import shutil
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from tasks.audit import reference
from tasks.audit.checkpoints import Checkpoint, Lineup, loading_from, quantized_checkpoint
from tasks.audit.cluster import worker
from tasks.audit.sequential import Watch
from tasks.config import Gate, VariantSpec
from tasks.core.errors import (Abandoned, DamagedReference, InputError, NumericalError, TransientError, WorkerError,
                               one_line)
from tasks.core.places import references_dir
from tasks.data.evaluation import Evaluation
from tasks.engine import kv_cache
from tasks.engine.batching import auto_batch_size
from tasks.engine.body import speed_up
from tasks.engine.model_facts import input_device
from tasks.engine.perplexity import Part, PerplexityResult, combine, score_part, scored_targets
from tasks.engine.scoring_options import ScoreOptions
from tasks.engine.sequential import window_order
from tasks.engine.windows import plan
from tasks.models.placement import devices, is_split, main_device, run_on
from tasks.models.quantize import check_disjoint
from tasks.models.resolve import Located, device_and_dtype, model_files
from tasks.models.variants import VariantFacts, cache_format, check_same_tokenizer, load_variant
from tasks.record.results import VariantResult


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


def combined(parts: list[Part], evaluation_: Evaluation, name: str) -> PerplexityResult:
    """The model's result from parts that cover the audit's windows."""
    settings = evaluation_.settings
    return combine(parts, evaluation_.stream, name, settings.window, settings.stride, settings.mode)


def perplexity_with_backoff(model, evaluation_: Evaluation, name: str, progress: bool, **options) -> PerplexityResult:
    """Every window scored here (``score_with_backoff``), as one result."""
    return combined([score_with_backoff(model, evaluation_, name, progress, **options)], evaluation_, name)


PARITY_WINDOWS = 2  # a split model's first windows, scored on one device too: enough to see a broken split


def check_parity(spec: VariantSpec, source: Located, model, facts: VariantFacts, evaluation_: Evaluation) -> dict:
    """Refuse a model split over several devices (``device_map``) that scores the first windows differently
    from the same checkpoint on one device, beyond the float noise of its dtype (``reference.DRIFT_TOLERANCE``):
    multi-GPU splits have silently wrecked perplexity elsewhere (llama.cpp #8685: 7.10 became 26,727).

    The one-device copy is loaded in host memory and computes on the split's first device (``run_on``), so
    the check needs host memory for one more copy of the model, not GPU memory. Returns what it compared.
    """
    windows = (0, min(PARITY_WINDOWS, len(plan(evaluation_.stream, evaluation_.settings.window,
                                                evaluation_.settings.stride, evaluation_.settings.mode))))
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
    token_limit, mean_limit = reference.DRIFT_TOLERANCE.get(facts.dtype, reference.DRIFT_TOLERANCE["float32"])
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
    facts = VariantFacts(**found.manifest["facts"])
    if math.isnan(facts.kv_bytes_per_token):  # a reference stored before caches were measured: its model says
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
    return folder, identity, reference.environment(device)


@dataclass
class Lookup:
    """What the stored references say of an audit's baseline before it is loaded: its result and facts when one is
    ``reused``; else the ``key`` its reference is written under (None: none can be, ``problem`` says why), the
    ``manifest`` it starts from, the reference a rescore is compared with (``previous``), and, for the record,
    ``said`` (``baseline_key``, damaged references ``removed``)."""

    said: dict
    reused: tuple[PerplexityResult, VariantFacts] | None = None
    key: str | None = None
    manifest: dict = field(default_factory=dict)
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

    def scored(self, result: PerplexityResult) -> dict:
        """What the record says of a baseline scored to ``result`` before its reference is put in place."""
        said = self.said | {"baseline": "scored", "key": None}
        if self.previous is not None:
            said["drift"] = reference.drift(self.previous, result, self.manifest["environment"])
        return said | ({"problem": self.problem} if self.problem else {})

    def publish(self, write, said: dict) -> dict:
        """``said`` with the reference ``write()`` puts in place, or the problem that kept it from being written. A
        rescore in this environment takes the old one's place; a race with another audit keeps theirs."""
        if self.problem:
            return said
        try:
            stored = write(self.previous is not None and self.previous.key == self.key)
            return said | {"key": stored.key, "path": str(stored.folder)}
        except (OSError, DamagedReference) as error:  # a Writer's own problem (no errno) already says what it is
            problem = str(error) if getattr(error, "errno", 0) is None else f"could not write the baseline reference: {error}"
            return said | {"problem": problem}


def look_up(checkpoint: Checkpoint, evaluation_: Evaluation) -> Lookup:
    """The baseline's ``Lookup``: its reference found (checked; a damaged one removed) or the key to write one under."""
    folder, identity, environment = baseline_identity(checkpoint, evaluation_)
    if identity is None:
        return Lookup({}, problem=f"{checkpoint.source} is not on this machine: nothing identifies it well enough to "
                                  "keep a reference")
    reuse, previous, removed = reference.find_intact(identity, environment, checkpoint.spec.rescore)
    said = {"baseline_key": reference.baseline_key(identity)} | ({"removed": removed} if removed else {})
    if reuse is not None:
        result, facts = _reuse(reuse, checkpoint.model)
        facts.worker = worker()
        return Lookup(said | {"baseline": "reused", "key": reuse.key, "path": str(reuse.folder)}, reused=(result, facts))
    return Lookup(said, key=reference.key_of(identity, environment), previous=previous,
                  manifest={"identity": identity, "environment": environment, "source": str(folder)})


def _score_baseline(checkpoint: Checkpoint, evaluation_: Evaluation, progress: bool
                    ) -> tuple[PerplexityResult, VariantFacts, dict]:
    """The baseline's result, from its stored reference or scored (writing one), and what happened, for
    the record: ``baseline`` (``reused``/``scored``), ``key`` and ``path`` of the reference, ``drift``
    (a rescore against the reference stored before), ``problem`` (why there is no reference), ``removed``
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
        manifest = found.manifest | {"facts": facts.summary(), "softcap": softcap(model)}
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
                    progress: bool) -> tuple[Part, VariantFacts, dict]:
    """A shard of the baseline: its windows scored and their slice of the reference written (``slice``: its folder),
    or the problem that kept it from being written."""
    settings = evaluation_.settings
    model, facts = _loaded(checkpoint.spec, checkpoint.model, evaluation_)
    targets = scored_targets(evaluation_.stream, settings.window, settings.stride, settings.mode)
    counts = [w.n_scored for w in plan(evaluation_.stream, settings.window, settings.stride, settings.mode)]
    first, stop = sum(counts[:windows[0]]), sum(counts[:windows[1]])
    with ExitStack() as stack:
        writer = lookup.writer(stack, targets[first:stop], first)
        part = score_with_backoff(model, evaluation_, checkpoint.spec.name, progress, windows, keep_hidden=writer)
        if writer is None:
            return part, facts, {"problem": lookup.problem} if lookup.problem else {}
        try:
            head = None if windows[0] else reference.head_entry(
                Path(lookup.manifest["source"]), model.get_output_embeddings(), writer.staging) | {"softcap": softcap(model)}
            out = slices_dir(lookup) / f"windows-{windows[0]}-{windows[1] - 1}-{uuid.uuid4().hex[:8]}"
            return part, facts, {"slice": str(writer.seal(head, out)), "key": lookup.key}
        except OSError as error:
            return part, facts, {"problem": writer.problem or f"could not write the baseline reference: {error}"}


def join_reference(lookup: Lookup, baseline: VariantResult, shards: list[VariantResult], evaluation_: Evaluation) -> dict:
    """What the record says of a baseline scored in ``shards`` (merged into ``baseline``): its reference joined from
    their slices and put in place whole (``reference.assemble``), or the problem that kept it from being; the
    audit's slices removed either way."""
    settings = evaluation_.settings
    try:
        if not baseline.ok:
            return {}
        said = lookup.scored(baseline.result)
        problem = next((s.reference["problem"] for s in shards if "problem" in s.reference), None)
        if problem or lookup.problem:
            return said | {"problem": problem or lookup.problem}
        targets = scored_targets(evaluation_.stream, settings.window, settings.stride, settings.mode)
        manifest = lookup.manifest | {"facts": baseline.facts.summary()}
        with reference.building() as scratch:
            staging = scratch / lookup.key
            staging.mkdir()
            return lookup.publish(lambda replace: reference.assemble(
                [Path(s.reference["slice"]) for s in shards], staging, lookup.key, manifest, baseline.result, targets,
                replace), said)
    finally:
        shutil.rmtree(slices_dir(lookup), ignore_errors=True)


@contextmanager
def failing_alone(outcome: VariantResult):
    """Turn a failure of one model into ``outcome.reason`` (one line), so that the others carry on; only a
    ``TransientError`` (network, remote storage) escapes, for the caller to retry. A failure that another
    worker may not meet (out of memory, an unexpected error) marks the outcome ``retry_elsewhere``."""
    try:
        yield
    except torch.OutOfMemoryError:
        outcome.reason = "out of memory at batch size 1; use a smaller window or a larger device"
        outcome.retry_elsewhere = True
    except TransientError:
        raise
    except (InputError, NumericalError, Abandoned) as error:
        outcome.reason = one_line(error)
    except WorkerError as error:
        outcome.reason = one_line(error)
        outcome.retry_elsewhere = True
    except Exception as error:  # any other failure of one model must not lose the others
        outcome.reason = f"{type(error).__name__}: {one_line(error)}"
        outcome.retry_elsewhere = True


def made(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
         progress: bool = False) -> Checkpoint:
    """A gptq/awq variant made here from the baseline, as a checkpoint with its new folder, tokenizer (the
    baseline's, saved with it) and manifest; any other checkpoint as it is. Raises what quantizing raises."""
    if checkpoint.source is not None or checkpoint.problem or checkpoint.role == "baseline":
        return checkpoint
    source = quantized_checkpoint(checkpoint.spec, lineup, evaluation_, corpus_text_of, progress)
    return loading_from(checkpoint, source)


def make_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
                 progress: bool = False) -> Checkpoint:
    """``made``, with a failure to make it as the checkpoint's ``problem``: once, before its shards load it."""
    outcome = VariantResult(checkpoint.name, checkpoint.spec.method, "failed")
    with failing_alone(outcome):
        return made(checkpoint, lineup, evaluation_, corpus_text_of, progress)
    return replace(checkpoint, problem=outcome.reason)


def score_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
                  progress: bool = False, baseline_outcome: VariantResult | None = None,
                  windows: tuple[int, int] | None = None, sample: list[int] | None = None,
                  lookup: Lookup | None = None, baseline_slices: list[VariantResult] | None = None) -> VariantResult:
    """Score one model on the audit's stream; failures become a failed result, never an exception.

    The baseline is read from its stored reference when one matches (``tasks.audit.reference``), else scored
    and its reference written; a variant measures its divergence from the baseline (``baseline_outcome``)
    through that reference: the baseline's LM head and hidden states, never the baseline model.

    Only a ``TransientError`` (network, remote storage) is raised, for the caller to retry. Out of
    memory is not retried at the same batch size: the batch size is halved until it fits.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (gptq/awq made here).
        windows: a variant's shard: only these windows ``(first, stop)`` are scored; the outcome holds them
            as its ``part`` (no ``result``), for ``merge_shards``.
        sample: a piece of a sequential run on a cluster: only these windows of the plan, in this order, as
            a ``part``; without it, a sequential run stops itself once its verdict is settled.
        lookup: a baseline's shard (``windows``): what its ``look_up`` found, which names the slice of its
            reference that the shard writes (its ``reference``: ``slice`` or ``problem``; ``join_reference``).
        baseline_slices: a variant's shard (``windows``) scored while the baseline's reference is still in slices:
            the outcomes of the baseline's first shard (its LM head) and of the shard over the same windows, whose
            slice it measures its divergence against (``reference.slice_baseline``), instead of ``baseline_outcome``.
    """
    spec = checkpoint.spec
    outcome = VariantResult(spec.name, spec.method, "failed", started=time.time())
    if windows is not None:
        outcome.shards = [{"windows": list(windows), "worker": worker()}]
    if sample is not None:
        outcome.shards = [{"sample": [int(w) for w in sample], "worker": worker()}]
    try:
        with failing_alone(outcome):
            if checkpoint.problem:
                raise InputError(checkpoint.problem)
            outcome.manifest, part = checkpoint.manifest, None
            if checkpoint.role == "baseline" and windows is None:
                outcome.result, outcome.facts, outcome.reference = _score_baseline(checkpoint, evaluation_, progress)
            elif checkpoint.role == "baseline":
                part, outcome.facts, outcome.reference = _baseline_slice(checkpoint, evaluation_, lookup, windows,
                                                                         progress)
            else:
                part = _scored_variant(outcome, checkpoint, lineup, evaluation_, corpus_text_of, progress,
                                       baseline_outcome, windows, sample, baseline_slices)
            outcome.facts.worker = worker()
            if windows is not None or sample is not None:
                outcome.part = part
                outcome.shards[0] |= {"tokens": int(part.scores.window_tokens.sum()), "seconds": part.wall_seconds}
            outcome.status = "ok"
    finally:  # the model, loaded in a function of its own, is gone: its memory is handed back now
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        outcome.ended = time.time()
    return outcome


def _scored_variant(outcome: VariantResult, checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation,
                    corpus_text_of, progress: bool, baseline_outcome: VariantResult | None,
                    windows: tuple[int, int] | None, sample: list[int] | None,
                    baseline_slices: list[VariantResult] | None = None) -> Part:
    """``score_variant`` of a variant: made, checked, loaded and scored, its facts and divergence in ``outcome``, and
    its ``result`` too when it scored every window it was to; returns what it scored."""
    spec, settings = checkpoint.spec, evaluation_.settings
    checkpoint = made(checkpoint, lineup, evaluation_, corpus_text_of, progress)
    outcome.manifest = checkpoint.manifest
    if outcome.manifest:
        check_disjoint(outcome.manifest, evaluation_.stream.text_digest, evaluation_.evaluated, spec.name)
    check_same_tokenizer(spec.name, lineup.baseline.tokenizer, checkpoint.tokenizer)
    model, outcome.facts = _loaded(spec, checkpoint.model, evaluation_)
    if checkpoint.detected:
        outcome.facts.quantization["detected"] = checkpoint.detected
    against, stored = None, None
    baseline_said = baseline_outcome.reference if baseline_outcome is not None and baseline_outcome.ok else {}
    if settings.divergence and baseline_slices is not None:
        against = _read_slices(outcome, baseline_slices, lineup.baseline.source, input_device(model))
    elif settings.divergence and baseline_said.get("path"):
        stored = reference.Reference.open(Path(baseline_said["path"]))
        if stored is None:
            raise WorkerError(f"the baseline reference {baseline_said['path']} is not on {worker()}; every "
                              "worker must see $PPL_AUDIT_REFERENCES at the same path")
        with _removed_when_damaged(stored):
            against = stored.baseline(lineup.baseline.source, input_device(model))
        outcome.divergence = {"reference": baseline_said["key"],
                              "memory_bytes": sum(t.nbytes for t in against.head.parameters())}
    elif settings.divergence:
        outcome.divergence = {"absent": baseline_said.get("problem", "the baseline was not scored")}
    watch, sequence = None, {}
    n_windows = len(plan(evaluation_.stream, settings.window, settings.stride, settings.mode))
    if sample is not None:
        rest = np.setdiff1d(np.arange(n_windows), sample)
        sequence = {"order": np.concatenate([np.asarray(sample, np.int64), rest]), "stop_at": len(sample)}
    elif settings.sequential and windows is None and baseline_outcome is not None and baseline_outcome.ok:
        watch = Watch(checkpoint.gate or Gate(), baseline_outcome.result.window_nll, settings.order_seed)
        sequence = {"order": window_order(n_windows, settings.order_seed), "until": watch}
    with _removed_when_damaged(stored):
        part = score_with_backoff(model, evaluation_, spec.name, progress, windows, reference=against,
                                  kv_cache=cache_format(spec), **sequence)
    if windows is None and sample is None:
        outcome.result = combined([part], evaluation_, spec.name)
        if watch:
            outcome.sequential = watch.said(outcome.result)
    return part


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


def _read_slices(outcome: VariantResult, shards: list[VariantResult], source: str, device: torch.device):
    """The baseline a variant's shard measures its divergence against while its reference is in slices (the outcomes
    of the baseline's ``shards`` that wrote them), its divergence recorded; None, and why, where they wrote none."""
    said = [shard.reference for shard in shards]
    problem = next((s["problem"] for s in said if "problem" in s), None)
    if problem or not all("slice" in s for s in said):
        outcome.divergence = {"absent": problem or "the baseline's shards wrote no reference"}
        return None
    folders = [Path(s["slice"]) for s in said]
    if not all(folder.is_dir() for folder in folders):
        raise WorkerError(f"the baseline reference's slices in {folders[0].parent} are not on {worker()}; every "
                          "worker must see $PPL_AUDIT_REFERENCES at the same path")
    against = reference.slice_baseline(folders, shards[-1].part.scores.token_nll, source, device)
    outcome.divergence = {"reference": said[0]["key"], "memory_bytes": sum(t.nbytes for t in against.head.parameters())}
    return against


def merge_shards(shards: list[VariantResult], evaluation_: Evaluation) -> VariantResult:
    """One variant's outcome from its shards' (in window order): their parts combined into one result
    (``tasks.engine.perplexity.combine``: bit for bit what one worker scoring every window gives), every worker named.
    It fails, with the first failed shard's reason, when a shard failed."""
    first = shards[0]
    merged = VariantResult(first.name, first.method, "failed", manifest=first.manifest, facts=first.facts,
                           divergence=first.divergence, shards=[row for s in shards for row in s.shards],
                           # a task that raised before it started (e.g. on a worker that cannot reach
                           # Prefect's API) has no times
                           started=min((s.started for s in shards if s.started), default=None),
                           ended=max((s.ended for s in shards if s.ended), default=None))
    failed = next((n for n, shard in enumerate(shards) if not shard.ok), None)
    if failed is not None:
        merged.reason = shards[failed].reason
        if len(shards) > 1:
            merged.reason = f"shard {failed + 1} of {len(shards)}: {merged.reason}"
        return merged
    with failing_alone(merged):
        merged.result = combined([shard.part for shard in shards], evaluation_, first.name)
        merged.facts.worker = ", ".join(dict.fromkeys(row["worker"] for row in merged.shards))
        merged.status = "ok"
    return merged
