"""One variant of an audit, end to end: find or make its checkpoint, check it is comparable, score it.

``score_variant`` never raises: a variant that cannot be loaded, is refused, runs out of memory or
produces NaN ends as a failed ``VariantResult`` with a one-line reason, so the others carry on.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import dataclass, field

import torch

from tasks.batching import auto_batch_size
from tasks.config import AuditConfig, VariantSpec
from tasks.corpus import TokenStream, cached_tokenize, default_bos
from tasks.divergence import TopKCache
from tasks.places import cache_dir
from tasks.errors import InputError, NumericalError, TransientError, one_line
from tasks.models import check_checkpoint, load_tokenizer, resolve_model_path
from tasks.perplexity import PerplexityResult, chunk_limit, count_scored_text, perplexity
from tasks.quantize import Calibration, check_disjoint, draw_calibration, model_digest, quantize, read_manifest
from tasks.variants import VariantFacts, check_same_tokenizer, load_variant


@dataclass(frozen=True)
class Evaluation:
    """What is scored and how: the same for every variant of an audit.

    Attributes:
        stream: the evaluated token stream.
        text: the whole corpus text (calibration may come from the part not evaluated).
        evaluated: ``[start, end)`` of the evaluated tokens in the corpus's BOS-free token stream.
    """

    stream: TokenStream
    text: str
    evaluated: tuple[int, int]
    window: int
    stride: int
    batch_size: int | str  # a number, or "auto"
    mode: str = "sliding"
    divergence: str = "auto"
    top_k: int = 32


@dataclass
class VariantResult:
    """One model's outcome. ``divergence`` says how KL was measured (lockstep/topk) and its memory."""

    name: str
    method: str
    status: str  # "ok" or "failed"
    reason: str = ""
    result: PerplexityResult | None = None
    facts: VariantFacts | None = None
    manifest: dict | None = field(default=None, repr=False)
    divergence: dict = field(default_factory=dict)
    started: float | None = None  # epoch seconds: when it began and ended (quantizing and loading included)
    ended: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def evaluation(text: str, tokenizer, bos: str | None, max_tokens: int | None, window: int, stride: int,
               batch_size: int, progress: bool = False, chunks: int | None = None, **options) -> Evaluation:
    """Tokenize once; ``options`` are ``mode``, ``divergence`` and ``top_k`` of ``Evaluation``.

    ``bos`` None takes the mode's own convention (``default_bos``); ``chunks`` limits a chunk mode to
    its first ``chunks`` chunks.
    """
    mode = options.get("mode", "sliding")
    max_tokens = chunk_limit(chunks, window, mode, max_tokens)
    stream = cached_tokenize(text, tokenizer, bos or default_bos(tokenizer, mode), max_tokens,
                             "tokenize" if progress else None)
    if mode != "sliding":
        stream = count_scored_text(stream, tokenizer, window, mode)
    evaluated_text_tokens = len(stream.ids) - (1 if stream.bos == "stream" else 0)
    return Evaluation(stream, text, (0, evaluated_text_tokens), window, stride, batch_size, **options)


def preflight(config, variants: bool = True) -> None:
    """Check an audit's models and window before anything is loaded: one line naming what is wrong.

    Args:
        variants: also check that every variant's checkpoint exists (the CLI does, before a run; a flow
            run does not, so that a checkpoint gone missing fails its variant, not the audit).
    """
    from tasks.models import load_config, max_positions, resolve_device

    for spec in [config.baseline, *config.variants]:
        try:
            resolve_device(spec.device)
        except InputError as error:
            raise InputError(f"{spec.name}: {error}") from None
    positions = max_positions(load_config(config.baseline.path))
    window = config.evaluation.window
    if positions is not None and window > positions:
        raise InputError(f"evaluation.window {window} is longer than the baseline's {positions} positions; "
                         f"use {positions} or less")
    check_checkpoint(config.baseline.path)
    for spec in config.variants if variants else []:
        if spec.path is not None:
            check_checkpoint(spec.path)


def audit_evaluation(config: AuditConfig, text: str, progress: bool = False) -> Evaluation:
    """The audit's ``Evaluation`` of ``text``, as its ``evaluation`` settings say."""
    settings = config.evaluation
    return evaluation(text, load_tokenizer(config.baseline.path), settings.bos, settings.max_tokens, settings.window,
                      settings.effective_stride, settings.batch_size, progress=progress, chunks=settings.chunks,
                      mode=settings.mode, divergence=settings.divergence, top_k=settings.top_k)


def check_calibration_room(config: AuditConfig, text: str, corpus_text_of, progress: bool = False) -> None:
    """Draw the calibration of every variant quantized here: one without room is refused now, not after
    the baseline is scored. Tokenizing is cached, so the audit reads the same stream back."""
    makers = [spec for spec in config.variants if spec.quantize_here]
    scored = audit_evaluation(config, text, progress) if makers else None
    for spec in makers:
        try:
            calibration_for(spec, config.baseline.path, scored, corpus_text_of, progress)
        except InputError as error:
            raise InputError(f"{spec.name}: {error}") from None


def calibration_for(spec: VariantSpec, baseline: str, evaluation_: Evaluation, corpus_text_of,
                    progress: bool = False) -> Calibration:
    """The calibration samples a gptq/awq variant made here is quantized with.

    Args:
        corpus_text_of: maps a calibration ``CorpusConfig`` to its text (only called when one is given).
    """
    settings = spec.calibration
    samples, seq_len, seed = (settings.samples, settings.seq_len, settings.seed) if settings else (128, 512, 0)
    if settings and settings.corpus:
        text, source = corpus_text_of(settings.corpus), settings.corpus.source
    else:
        text, source = evaluation_.text, "audit corpus"
    stream = cached_tokenize(text, load_tokenizer(baseline), bos="none", progress="tokenize calibration" if progress else None)
    # the evaluated text, under whatever name, keeps its evaluated tokens out of calibration
    exclude = evaluation_.evaluated if stream.text_digest == evaluation_.stream.text_digest else None
    return draw_calibration(stream.ids, samples, seq_len, seed, source, stream.text_digest, exclude)


def quantized_checkpoint(spec: VariantSpec, baseline: str, evaluation_: Evaluation, corpus_text_of,
                         progress: bool = False) -> str:
    """The folder of a gptq/awq variant made from the baseline, quantizing it on first use (cached)."""
    bits, group_size, sym = spec.quantization
    calibration = calibration_for(spec, baseline, evaluation_, corpus_text_of)
    key = json.dumps([model_digest(resolve_model_path(baseline)), spec.method, bits, group_size, sym, calibration.digest])
    out = cache_dir() / "quantized" / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if read_manifest(str(out)) is None:
        quantize(baseline, spec.method, bits, group_size, sym, calibration, out, name=spec.name, progress=progress)
    return str(out)


def perplexity_with_backoff(model, evaluation_: Evaluation, name: str, progress: bool, **divergence) -> PerplexityResult:
    """Score at the configured batch size, halving it on out-of-memory (the result does not depend on it)."""
    batch_size = evaluation_.batch_size
    if batch_size == "auto":
        batch_size = auto_batch_size(model, evaluation_.stream, evaluation_.window, evaluation_.stride, evaluation_.mode)
    while True:
        try:
            return perplexity(model, evaluation_.stream, evaluation_.window, evaluation_.stride, batch_size,
                              progress=progress, model_name=name, mode=evaluation_.mode, **divergence)
        except torch.OutOfMemoryError:
            if batch_size == 1:
                raise
            batch_size //= 2
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def lockstep_fits(baseline_weight_bytes: int, device: torch.device) -> bool:
    """Whether a second copy of the baseline fits beside the variant with room to spare."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return 2 * baseline_weight_bytes < free // 2


def divergence_plan(evaluation_: Evaluation, baseline: VariantResult | None, device: torch.device) -> str:
    """How this variant's KL is measured: ``lockstep``, ``topk`` or ``off``."""
    if baseline is None or not baseline.ok or evaluation_.divergence == "off":
        return "off"
    if evaluation_.divergence == "auto":
        return "lockstep" if lockstep_fits(baseline.facts.weight_memory_bytes, device) else "topk"
    return evaluation_.divergence


def score_variant(spec: VariantSpec, baseline: str, baseline_tokenizer: str, evaluation_: Evaluation,
                  corpus_text_of=None, progress: bool = False, baseline_outcome: VariantResult | None = None,
                  baseline_spec: VariantSpec | None = None) -> VariantResult:
    """Score one variant on the audit's stream; failures become a failed result, never an exception.

    The baseline itself (``baseline_outcome`` None) keeps its top-k cache when KL may be taken from
    it; a variant then measures KL against the baseline in lockstep (loading it beside itself) or
    from that cache, as ``evaluation_.divergence`` says (``auto``: lockstep when it fits).

    Only a ``TransientError`` (network, remote storage) is raised, for the caller to retry. Out of
    memory is not retried at the same batch size: the batch size is halved until it fits.

    Args:
        baseline: the baseline model (folder, Hub id or ``embedded``).
        baseline_tokenizer: ``tokenizer_digest`` of the baseline's tokenizer.
    """
    model = reference = None
    outcome = VariantResult(spec.name, spec.method, "failed", started=time.time())
    try:
        if spec.quantize_here:
            source = quantized_checkpoint(spec, baseline, evaluation_, corpus_text_of, progress)
        else:
            source = spec.path or baseline
        outcome.manifest = read_manifest(resolve_model_path(source))
        if outcome.manifest:
            check_disjoint(outcome.manifest, evaluation_.stream.text_digest, evaluation_.evaluated, spec.name)
        check_same_tokenizer(spec.name, baseline_tokenizer, load_tokenizer(source))
        model, outcome.facts = load_variant(spec, source)
        options = {}
        how = divergence_plan(evaluation_, baseline_outcome, model.device)
        if baseline_outcome is None and evaluation_.divergence in ("auto", "topk"):
            options["keep_top_k"] = evaluation_.top_k
        elif how == "lockstep":
            reference, _ = load_variant(baseline_spec or VariantSpec(name="baseline", path=baseline), baseline)
            options["reference"] = reference
            outcome.divergence = {"method": how, "memory_bytes": baseline_outcome.facts.weight_memory_bytes}
        elif how == "topk":
            cache = TopKCache(*(torch.from_numpy(baseline_outcome.result.extra[k]) for k in ("topk_ids", "topk_logp")))
            options["reference"] = cache
            outcome.divergence = {"method": how, "memory_bytes": cache.nbytes, "top_k": evaluation_.top_k}
        outcome.result = perplexity_with_backoff(model, evaluation_, spec.name, progress, **options)
        outcome.status = "ok"
    except torch.OutOfMemoryError:
        outcome.reason = "out of memory at batch size 1; use a smaller window or a larger device"
    except TransientError:
        raise
    except (InputError, NumericalError) as error:
        outcome.reason = one_line(error)
    except Exception as error:  # any other failure of one variant must not lose the others
        outcome.reason = f"{type(error).__name__}: {one_line(error)}"
    finally:
        del model, reference
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        outcome.ended = time.time()
    return outcome
