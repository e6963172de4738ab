"""Score one model of an audit: make or load it, check it is comparable, and measure it.

``score_variant`` never raises but for a transient failure: a model that cannot be loaded, is
refused, runs out of memory or produces NaN ends as a failed ``VariantResult`` with a one-line reason,
so the others carry on.
"""

from __future__ import annotations

import gc
import time

import torch

from tasks.batching import auto_batch_size
from tasks.checkpoints import Checkpoint, Lineup, quantized_checkpoint
from tasks.divergence import TopKCache
from tasks.errors import InputError, NumericalError, TransientError, one_line
from tasks.evaluation import Evaluation
from tasks.memory import lockstep_fits
from tasks.models import load_tokenizer
from tasks.perplexity import PerplexityResult, perplexity
from tasks.quantize import check_disjoint, read_manifest
from tasks.corpus import tokenizer_digest
from tasks.results import VariantResult
from tasks.variants import check_same_tokenizer, load_variant


def perplexity_with_backoff(model, evaluation_: Evaluation, name: str, progress: bool, **divergence) -> PerplexityResult:
    """Score at the configured batch size, halving it on out-of-memory (the result does not depend on it)."""
    settings = evaluation_.settings
    batch_size = settings.batch_size
    if batch_size == "auto":
        batch_size = auto_batch_size(model, evaluation_.stream, settings.window, settings.stride, settings.mode)
    while True:
        try:
            return perplexity(model, evaluation_.stream, settings.window, settings.stride, batch_size,
                              progress=progress, model_name=name, mode=settings.mode, **divergence)
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def divergence_plan(evaluation_: Evaluation, baseline: VariantResult | None, device: torch.device) -> str:
    """How a variant's KL is measured: ``lockstep``, ``topk`` or ``off``."""
    wanted = evaluation_.settings.divergence
    if baseline is None or not baseline.ok or wanted == "off":
        return "off"
    if wanted == "auto":
        return "lockstep" if lockstep_fits(baseline.facts.weight_memory_bytes, device) else "topk"
    return wanted


def score_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, corpus_text_of=None,
                  progress: bool = False, baseline_outcome: VariantResult | None = None) -> VariantResult:
    """Score one model on the audit's stream; failures become a failed result, never an exception.

    The baseline keeps its top-k cache when KL may be taken from it; a variant then measures KL against
    the baseline (``baseline_outcome``) in lockstep (loading it beside itself) or from that cache, as the
    evaluation's ``divergence`` says (``auto``: lockstep when it fits).

    Only a ``TransientError`` (network, remote storage) is raised, for the caller to retry. Out of
    memory is not retried at the same batch size: the batch size is halved until it fits.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (gptq/awq made here).
    """
    spec, settings = checkpoint.spec, evaluation_.settings
    model = reference = None
    outcome = VariantResult(spec.name, spec.method, "failed", started=time.time())
    try:
        if checkpoint.problem:
            raise InputError(checkpoint.problem)
        source, tokenizer, outcome.manifest = checkpoint.source, checkpoint.tokenizer, checkpoint.manifest
        if source is None:  # made here: a new folder, with its own manifest and the baseline's tokenizer saved
            source = quantized_checkpoint(spec, lineup, evaluation_, corpus_text_of, progress)
            tokenizer, outcome.manifest = tokenizer_digest(load_tokenizer(source)), read_manifest(source)
        if outcome.manifest:
            check_disjoint(outcome.manifest, evaluation_.stream.text_digest, evaluation_.evaluated, spec.name)
        check_same_tokenizer(spec.name, lineup.baseline.tokenizer, tokenizer)
        model, outcome.facts = load_variant(spec, source)
        options = {}
        how = divergence_plan(evaluation_, baseline_outcome, model.device)
        if checkpoint.role == "baseline" and settings.divergence in ("auto", "topk"):
            options["keep_top_k"] = settings.top_k
        elif how == "lockstep":
            reference, _ = load_variant(lineup.baseline.spec, lineup.baseline.source)
            options["reference"] = reference
            outcome.divergence = {"method": how, "memory_bytes": baseline_outcome.facts.weight_memory_bytes}
        elif how == "topk":
            cache = TopKCache(*(torch.from_numpy(baseline_outcome.result.extra[k]) for k in ("topk_ids", "topk_logp")))
            options["reference"] = cache
            outcome.divergence = {"method": how, "memory_bytes": cache.nbytes, "top_k": settings.top_k}
        outcome.result = perplexity_with_backoff(model, evaluation_, spec.name, progress, **options)
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
        del model, reference
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        outcome.ended = time.time()
    return outcome
