"""Why a variant loses: each decoder layer's own and accumulated error, and what putting the baseline's layers
back wins back (one layer at a time, then a greedy search), on a seeded sample of the audit's own windows.

The evaluations are independent of each other, so the flow runs them as tasks (``flows.diagnose``); each task
takes the two models from the ``Bench`` it is given (loaded by the first task that asks, kept for the next) and
scores the sample with some layers restored. The sample's baseline figures are kept on the bench too, in memory: a
diagnosis never writes a reference.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tasks.audit.checkpoints import Checkpoint, Lineup
from tasks.audit.scoring import made
from tasks.audit.where import located
from tasks.config import AuditConfig, VariantSpec
from tasks.core.errors import InputError
from tasks.data.corpus import corpus_text
from tasks.data.evaluation import Evaluation
from tasks.engine.layers import LayerErrors, decoder_layers, layer_errors, recovered_share, restored_scores
from tasks.engine.model_facts import input_device
from tasks.engine.paired import CONFIDENCE
from tasks.engine.perplexity import WindowScores, score_windows, token_slots
from tasks.engine.baseline import Baseline
from tasks.engine.scoring_options import Feed, ScoreOptions
from tasks.engine.sequential import window_order
from tasks.engine.token_figures import TokenFigures
from tasks.engine.windows import Window
from tasks.models.cost import decoder_layer_bytes, weight_bytes
from tasks.models.variants import check_same_tokenizer, load_variant
from tasks.record.diagnosis_said import EmbeddingError, HeadError, LayerFinding, RestoreStep, VariantDiagnosis, WonBack

# The greedy search tries, at each step, the layers among the CANDIDATES that won back most alone not chosen yet:
# a layer that wins back little alone rarely wins back much beside others, and trying every layer at every step
# would cost L evaluations a step.
CANDIDATES = 4
MIB = 2**20


def variant_spec(config: AuditConfig, variant: str) -> VariantSpec:
    """The variant ``variant`` of ``config``, or one line naming those it has."""
    spec = next((v for v in config.variants if v.name == variant), None)
    if spec is None:
        raise InputError(f"audit {config.name} has no variant '{variant}'; give one of "
                         f"{', '.join(v.name for v in config.variants)}")
    return spec


def narrowed(config: AuditConfig, variant: str) -> AuditConfig:
    """The audit ``config`` with its variant ``variant`` alone: what a diagnosis of it loads and checks."""
    spec = variant_spec(config, variant)
    if spec.kv_cache is not None:  # the layers are compared with their own inputs, through no cache
        raise InputError(f"variant '{variant}' is scored with a quantized key/value cache, which a diagnosis of its "
                         "layers does not model; diagnose the variant without kv_cache, or compare caches in an audit")
    served = next((s for s in (config.baseline, spec) if s.runtime_backend.llama_cpp), None)
    if served is not None:  # llama.cpp gives logits, not the layers' outputs a diagnosis compares and swaps
        raise InputError(f"{served.role} '{served.name}' runs in llama.cpp, whose layers a diagnosis cannot reach; "
                         "diagnose the same GGUF file in transformers (runtime: transformers) against a transformers "
                         "baseline")
    return config.model_copy(update={"variants": [spec]})


def sample(evaluation_: Evaluation, windows: int | None, seed: int) -> list[Window]:
    """The windows a diagnosis scores: ``windows`` of the audit's plan drawn by ``seed`` (all of them when the
    plan has no more, or ``windows`` is None), in the plan's order."""
    planned = evaluation_.windows
    count = len(planned) if windows is None else min(windows, len(planned))
    return [planned[i] for i in sorted(window_order(len(planned), seed)[:count])]


@dataclass
class Pair:
    """The baseline and the variant loaded side by side, and the baseline's figures on a sample (made once)."""

    baseline: torch.nn.Module
    variant: torch.nn.Module
    name: str
    method: str
    layer_mib: np.ndarray  # ``[L]`` memory each decoder layer takes more in the baseline than in the variant
    on_sample: dict[tuple[int, ...], tuple[WindowScores, Baseline]] = field(default_factory=dict)

    def baseline_on(self, evaluation_: Evaluation, windows: list[Window]) -> tuple[WindowScores, Baseline]:
        """The baseline's scores on ``windows`` and itself as a ``Baseline`` (its final hidden states kept in
        memory) for the variant's KL."""
        key = tuple(w.index for w in windows)
        if key not in self.on_sample:
            self.on_sample = {key: held_baseline(self.baseline, evaluation_, windows, sample_feed(evaluation_))}
        return self.on_sample[key]


def held_baseline(model, evaluation_: Evaluation, windows: list[Window], feed: Feed) -> tuple[WindowScores, Baseline]:
    """The baseline ``model``'s scores on ``windows`` and itself as a ``Baseline`` whose final hidden states are
    kept in memory: what a variant's KL on a sample is taken against."""
    held = _Held(_tokens(windows))
    scores = score_windows(model, feed, windows, ScoreOptions(keep_hidden=held.keep))
    against = Baseline(model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None),
                       lambda slots, inputs: held.hidden[slots])
    return scores, against


@dataclass
class _Held:
    """The baseline's final hidden states of a sample's ``tokens``, kept batch by batch as it is scored."""

    tokens: int
    hidden: torch.Tensor | None = None

    def keep(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.hidden is None:
            self.hidden = torch.empty(self.tokens, hidden.shape[-1], dtype=hidden.dtype)
        self.hidden[slots] = hidden


def _tokens(windows: list[Window]) -> int:
    return sum(w.n_scored for w in windows)


def sample_feed(evaluation_: Evaluation) -> Feed:
    """What the sample is scored with: the audit's batch size (1 for ``auto``: a sample is small) and llama.cpp's BOS
    per chunk."""
    settings = evaluation_.settings
    batch_size = settings.batch_size if isinstance(settings.batch_size, int) else 1
    return Feed.of(evaluation_.stream, settings.mode, batch_size)


def _scored(model, evaluation_: Evaluation, windows: list[Window], **options) -> WindowScores:
    return score_windows(model, sample_feed(evaluation_), windows, ScoreOptions(**options))


class Bench:
    """Where the two models of a diagnosis are held between the tasks that score them: loaded by the first task
    that asks (``pair``), kept for the others, let go by ``forget``. One pair at a time: a pair for another
    diagnosis takes the place of the one held. Its owner decides how long the models live: the flow that runs the
    tasks here makes one per diagnosis; a cluster worker keeps one for its process (``tasks.steps``)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._pair: Pair | None = None

    def pair(self, checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation) -> Pair:
        """The baseline and ``checkpoint``'s variant, loaded here unless this bench holds them already."""
        key = (lineup.baseline.source, lineup.baseline.spec.model_dump_json(), checkpoint.source,
               checkpoint.spec.model_dump_json())
        if self._key != key:
            self.forget()
            self._pair, self._key = _loaded_pair(checkpoint, lineup, evaluation_), key
        return self._pair

    def holds(self) -> bool:
        """Whether a pair is loaded here."""
        return self._pair is not None

    def forget(self) -> None:
        """Let go of the pair held (a long-lived process, ``serve``, keeps no model between audits)."""
        self._key = self._pair = None
        gc.collect()


def _loaded_pair(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation) -> Pair:
    checkpoint = made(checkpoint, lineup, evaluation_, corpus_text)
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    check_same_tokenizer(checkpoint.name, lineup.baseline.tokenizer, checkpoint.tokenizer)
    baseline, _ = load_variant(lineup.baseline.spec, lineup.baseline.model)
    variant, facts = load_variant(checkpoint.spec, checkpoint.model)
    if input_device(baseline) != input_device(variant) or baseline.dtype != variant.dtype:
        raise InputError(f"diagnosing {checkpoint.name} puts the baseline's layers in its place: both must run on one "
                         f"device in one dtype (baseline {input_device(baseline)} {baseline.dtype}, variant "
                         f"{input_device(variant)} {variant.dtype}); give the variant the baseline's device and dtype")
    if len(decoder_layers(baseline)) != len(decoder_layers(variant)):
        raise InputError(f"{checkpoint.name} has not the baseline's decoder layers: it cannot be diagnosed against it")
    # the baseline's layers as they run (float, in memory), the variant's as it is shipped
    cost = np.subtract([weight_bytes(layer) for layer in decoder_layers(baseline)],
                       decoder_layer_bytes(variant, checkpoint.spec, checkpoint.source)) / MIB
    return Pair(baseline, variant, checkpoint.name, facts.method, cost)


@dataclass
class Examination:
    """One pass of both models over the sample: per-layer errors, and both models' per-token figures.

    Attributes:
        window_tokens: ``[W]`` tokens each sampled window scores, in the plan's order.
        base_nll, nll, kl: ``[n]`` per-token NLL of the baseline and of the variant, and KL(baseline‖variant).
        extra: the variant's per-token figures against the baseline (``kl`` among them, ``kl_reverse``, ``top1``...).
        layer_mib: ``[L]`` memory each decoder layer takes more in the baseline than in the variant.
        where: where in the sample's text it loses (``tasks.audit.where.located``).
    """

    name: str
    method: str
    windows: list[int]
    window_tokens: np.ndarray
    base_nll: np.ndarray
    nll: np.ndarray
    kl: np.ndarray
    extra: TokenFigures[np.ndarray]
    errors: LayerErrors
    layer_mib: np.ndarray
    where: dict
    seconds: float


def examine(bench: Bench, checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation,
            windows: list[Window]) -> Examination:
    """Both models (held on ``bench``) on the sample: the variant's per-layer errors and its loss, token by token."""
    started = time.perf_counter()
    pair = bench.pair(checkpoint, lineup, evaluation_)
    base, against = pair.baseline_on(evaluation_, windows)
    scores = _scored(pair.variant, evaluation_, windows, reference=against)
    errors = layer_errors(pair.baseline, pair.variant, sample_feed(evaluation_), windows)
    figures = scores.extra.mapped(lambda value: value.numpy())
    indices = np.array([w.index for w in windows])
    counts = np.array([w.n_scored for w in windows])
    slots = token_slots(np.array([w.n_scored for w in evaluation_.windows]), indices)
    base_nll, nll = base.token_nll.double().numpy(), scores.token_nll.double().numpy()
    where = located(base_nll, nll, figures, slots, np.repeat(indices, counts), evaluation_, lineup.tokenizer)
    return Examination(pair.name, pair.method, indices.tolist(), counts, base_nll, nll, figures.kl, figures, errors,
                       pair.layer_mib, where, time.perf_counter() - started)


@dataclass
class Restored:
    """The variant with the baseline's decoder layers ``layers`` in place, on the sample: per-token NLL and KL."""

    layers: tuple[int, ...]
    nll: np.ndarray
    kl: np.ndarray


def restore(bench: Bench, checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, windows: list[Window],
            sets: list[tuple[int, ...]], progress: bool = False) -> list[Restored]:
    """Score the sample with each set of the baseline's decoder layers in ``sets`` put in the variant's place (both
    models held on ``bench``)."""
    pair = bench.pair(checkpoint, lineup, evaluation_)
    _, against = pair.baseline_on(evaluation_, windows)
    label = f"{checkpoint.name}: restore {len(sets)} layer set(s)" if progress else None
    found = restored_scores(pair.baseline, pair.variant, sets, sample_feed(evaluation_), windows, against, label)
    return [Restored(each.layers, each.nll.numpy(), each.kl.numpy()) for each in found]


def _step(seen: Examination, found: Restored) -> RestoreStep:
    """What restoring ``found.layers`` gives: the loss left, what it wins back (with intervals) and costs."""
    kl = recovered_share(seen.kl, found.kl, seen.window_tokens, CONFIDENCE)
    nll = recovered_share(seen.nll - seen.base_nll, found.nll - seen.base_nll, seen.window_tokens, CONFIDENCE)
    return RestoreStep(tuple(found.layers), float(seen.layer_mib[list(found.layers)].sum()),
                       float((found.nll - seen.base_nll).mean()), float(found.kl.mean()), WonBack(*kl), WonBack(*nll))


def _gain(step: RestoreStep) -> tuple[float, float]:
    """How a restore is ranked: by the KL it wins back (every token's, always ≥ 0: a steadier measure than
    ΔNLL on a sample, which can move either way), then by ΔNLL."""
    return step.kl_recovery.pct, step.nll_recovery.pct


Evaluate = Callable[[list[tuple[int, ...]]], list[Restored]]


def search(seen: Examination, evaluate: Evaluate, restore_k: int
           ) -> tuple[list[RestoreStep], list[RestoreStep]]:
    """Every layer restored alone, then the greedy curve: restore the layer that wins back most, then the one that
    wins back most beside it, ... ``restore_k`` layers. ``evaluate`` scores a list of layer sets (as tasks).

    Returns:
        ``(alone, curve)``: one step per layer, by layer; the curve's steps from none restored to ``restore_k``.
    """
    count = len(seen.layer_mib)
    alone = [_step(seen, found) for found in evaluate([(i,) for i in range(count)])]
    nothing = Restored((), seen.nll, seen.kl)
    curve = [_step(seen, nothing)]
    chosen: tuple[int, ...] = ()
    ranked = sorted(range(count), key=lambda i: _gain(alone[i]), reverse=True)
    for k in range(min(restore_k, count)):
        candidates = [i for i in ranked if i not in chosen][: max(CANDIDATES - k, 1)]
        steps = [alone[candidates[0]]] if k == 0 else \
            [_step(seen, found) for found in evaluate([tuple(sorted(chosen + (i,))) for i in candidates])]
        best = max(steps, key=_gain)
        chosen = best.restored
        curve.append(best)
    return alone, curve


def diagnosis_report(seen: Examination, alone: list[RestoreStep], curve: list[RestoreStep], seconds: float) -> dict:
    """The diagnosis as plain data (``VariantDiagnosis.as_record``): the JSON line of ``ppl-audit diagnose --json``,
    the MLflow run's artifact."""
    own, accumulated = seen.errors.own, seen.errors.accumulated
    layers = [LayerFinding(i, float(own.sqnr_db()[i]), float(accumulated.sqnr_db()[i]), float(own.relative_error()[i]),
                           float(accumulated.relative_error()[i]), float(own.mean_cos_error()[i]),
                           float(accumulated.mean_cos_error()[i]), step.kl_recovery, step.nll_recovery, step.mib)
              for i, step in enumerate(alone)]
    delta = seen.nll - seen.base_nll
    embeddings = seen.errors.embeddings
    return VariantDiagnosis(
        seen.name, seen.method, len(seen.windows), tuple(seen.windows), int(seen.window_tokens.sum()),
        float(delta.mean()), float(100 * np.expm1(delta.mean())), float(seen.kl.mean()),
        HeadError(seen.errors.head_kl, seen.errors.head_top1),
        EmbeddingError(float(embeddings.sqnr_db()[0]), float(embeddings.relative_error()[0])), tuple(layers),
        tuple(sorted(range(len(alone)), key=lambda i: _gain(alone[i]), reverse=True)), tuple(curve), seen.where,
        seconds).as_record()
