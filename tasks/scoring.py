"""Score one model of an audit: make or load it, check it is comparable, and measure it.

``score_variant`` never raises but for a transient failure: a model that cannot be loaded, is
refused, runs out of memory or produces NaN ends as a failed ``VariantResult`` with a one-line reason,
so the others carry on.
"""

from __future__ import annotations

import gc
import time
from contextlib import ExitStack

import torch

from pathlib import Path

from tasks import reference
from tasks.batching import auto_batch_size
from tasks.checkpoints import Checkpoint, Lineup, quantized_checkpoint
from tasks.cluster import worker
from tasks.corpus import tokenizer_digest
from tasks.errors import InputError, NumericalError, TransientError, one_line
from tasks.evaluation import Evaluation
from tasks.models import load_tokenizer, resolve_device, resolve_dtype
from tasks.perplexity import PerplexityResult, perplexity
from tasks.places import references_dir
from tasks.quantize import check_disjoint, read_manifest
from tasks.results import VariantResult
from tasks.variants import VariantFacts, check_same_tokenizer, load_variant
from tasks.windows import plan


def perplexity_with_backoff(model, evaluation_: Evaluation, name: str, progress: bool, **options) -> PerplexityResult:
    """Score at the configured batch size, halving it on out-of-memory (the result does not depend on it)."""
    settings = evaluation_.settings
    batch_size = settings.batch_size
    if batch_size == "auto":
        batch_size = auto_batch_size(model, evaluation_.stream, settings.window, settings.stride, settings.mode)
    while True:
        try:
            return perplexity(model, evaluation_.stream, settings.window, settings.stride, batch_size,
                              progress=progress, model_name=name, mode=settings.mode, **options)
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _reuse(found: reference.Reference) -> tuple[PerplexityResult, VariantFacts]:
    found.touch()
    return found.result(), VariantFacts(**found.manifest["facts"])


def _score_baseline(checkpoint: Checkpoint, evaluation_: Evaluation, progress: bool
                    ) -> tuple[PerplexityResult, VariantFacts, dict]:
    """The baseline's result, from its stored reference or scored (writing one), and what happened, for
    the record: ``baseline`` (``reused``/``scored``), ``key`` and ``path`` of the reference, ``drift``
    (a rescore against the reference stored before), ``problem`` (why there is no reference)."""
    spec, settings = checkpoint.spec, evaluation_.settings
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    folder = reference.model_files(checkpoint.source)
    environment = reference.environment(device)
    identity = reuse = previous = None
    if folder is not None:
        identity = reference.identity(folder, checkpoint.tokenizer, evaluation_.stream, settings, dtype)
        reuse, previous = reference.find(identity, environment, spec.rescore)
    if reuse is not None:
        result, facts = _reuse(reuse)
        return result, facts, {"baseline": "reused", "key": reuse.key, "path": str(reuse.folder)}
    model, facts = load_variant(spec, checkpoint.source)
    with ExitStack() as stack:
        writer, key = None, None
        problem = f"{checkpoint.source} is not on this machine: nothing identifies it well enough to keep a reference"
        if identity is not None:
            key = reference.key_of(identity, environment)
            try:
                writer = reference.Writer(stack.enter_context(reference.building()) / key, n_scored(evaluation_))
                writer.staging.mkdir()
            except OSError as error:  # the reference is lost, not the baseline's score
                writer = None
                problem = f"could not write the baseline reference in {references_dir()}: {error}"
        result = perplexity_with_backoff(model, evaluation_, spec.name, progress, keep_hidden=writer)
        said = {"baseline": "scored", "key": None}
        if previous is not None:
            said["drift"] = reference.drift(previous, result, environment)
        if writer is None:
            return result, facts, said | {"problem": problem}
        try:
            manifest = {"identity": identity, "environment": environment, "facts": facts.summary(),
                        "source": str(folder), "softcap": getattr(model.config, "final_logit_softcapping", None)}
            # a rescore in this environment takes the old one's place; a race with another audit keeps theirs
            replace = previous is not None and previous.key == key
            stored = writer.publish(key, manifest, result, model.get_output_embeddings(), replace)
            said |= {"key": stored.key, "path": str(stored.folder)}
        except OSError as error:
            said["problem"] = writer.problem or f"could not write the baseline reference: {error}"
    return result, facts, said


def n_scored(evaluation_: Evaluation) -> int:
    settings = evaluation_.settings
    return sum(w.n_scored for w in plan(evaluation_.stream, settings.window, settings.stride, settings.mode))


def score_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
                  progress: bool = False, baseline_outcome: VariantResult | None = None) -> VariantResult:
    """Score one model on the audit's stream; failures become a failed result, never an exception.

    The baseline is read from its stored reference when one matches (``tasks.reference``), else scored
    and its reference written; a variant measures its divergence from the baseline (``baseline_outcome``)
    through that reference: the baseline's LM head and hidden states, never the baseline model.

    Only a ``TransientError`` (network, remote storage) is raised, for the caller to retry. Out of
    memory is not retried at the same batch size: the batch size is halved until it fits.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (gptq/awq made here).
    """
    spec, settings = checkpoint.spec, evaluation_.settings
    model = None
    outcome = VariantResult(spec.name, spec.method, "failed", started=time.time())
    try:
        if checkpoint.problem:
            raise InputError(checkpoint.problem)
        if checkpoint.role == "baseline":
            outcome.manifest = checkpoint.manifest
            outcome.result, outcome.facts, outcome.reference = _score_baseline(checkpoint, evaluation_, progress)
            outcome.facts.worker = worker()
            outcome.status = "ok"
            return outcome
        source, tokenizer, outcome.manifest = checkpoint.source, checkpoint.tokenizer, checkpoint.manifest
        if source is None:  # made here: a new folder, with its own manifest and the baseline's tokenizer saved
            source = quantized_checkpoint(spec, lineup, evaluation_, corpus_text_of, progress)
            tokenizer, outcome.manifest = tokenizer_digest(load_tokenizer(source)), read_manifest(source)
        if outcome.manifest:
            check_disjoint(outcome.manifest, evaluation_.stream.text_digest, evaluation_.evaluated, spec.name)
        check_same_tokenizer(spec.name, lineup.baseline.tokenizer, tokenizer)
        model, outcome.facts = load_variant(spec, source)
        outcome.facts.worker = worker()
        if checkpoint.detected:
            outcome.facts.quantization["detected"] = checkpoint.detected
        against = None
        baseline_said = baseline_outcome.reference if baseline_outcome is not None and baseline_outcome.ok else {}
        if settings.divergence and baseline_said.get("path"):
            against = reference.Reference.open(Path(baseline_said["path"])).baseline(lineup.baseline.source,
                                                                                     model.device)
            outcome.divergence = {"reference": baseline_said["key"],
                                  "memory_bytes": sum(t.nbytes for t in against.head.parameters())}
        elif settings.divergence:
            outcome.divergence = {"absent": baseline_said.get("problem", "the baseline was not scored")}
        outcome.result = perplexity_with_backoff(model, evaluation_, spec.name, progress, reference=against)
        outcome.status = "ok"
    except torch.OutOfMemoryError:
        outcome.reason = "out of memory at batch size 1; use a smaller window or a larger device"
    except TransientError:
        raise
    except (InputError, NumericalError) as error:
        outcome.reason = one_line(error)
    except Exception as error:  # any other failure of one model must not lose the others
        outcome.reason = f"{type(error).__name__}: {one_line(error)}"
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        outcome.ended = time.time()
    return outcome
