"""Where in the model a variant departs from its baseline: each decoder layer's error, and the variant with some of
the baseline's layers put back. Plain PyTorch over two Hugging Face causal LMs of one architecture.

A layer's *accumulated* error is its output in the variant run end to end against the baseline's: what the user
gets. Its *own* error is the variant's layer fed the baseline's input to that layer, so that what a layer does
wrong is not confused with what the layers before it passed on. Errors are taken on the residual stream at the
scored positions only (the hidden states that predict a scored token), summed in float64 over every batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from tasks.core import console
from tasks.engine.model_facts import input_device
from tasks.engine.paired import t_quantile
from tasks.engine.perplexity import batch_inputs, hidden_states, token_stats
from tasks.engine.baseline import Baseline, BaselineBatch
from tasks.engine.scoring_options import Feed
from tasks.engine.windows import Window

# A variant layer identical to its baseline's has no error: an SQNR of infinity, shown as this. 200 dB is a noise
# power 1e-20 of the signal's, below float64's own rounding of the sums, so no real error reaches it.
SQNR_CAP_DB = 200.0


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder layers: the list of ``num_hidden_layers`` blocks its base model runs in turn."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = config.num_hidden_layers
    for _, module in model.base_model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__} has no list of its {count} decoder layers")


def _output(value) -> torch.Tensor:
    """A decoder layer's hidden states: transformers' layers return them alone, older ones first in a tuple."""
    return value[0] if isinstance(value, tuple) else value


@dataclass
class ErrorSums:
    """Float64 sums, per layer, of one model's layer outputs against the baseline's at the same tokens.

    Attributes:
        signal: ``[L]`` Σ‖baseline output‖² over the tokens.
        noise: ``[L]`` Σ‖output − baseline output‖².
        cos_error: ``[L]`` Σ (1 − cos(output, baseline output)), one term per token.
        tokens: how many tokens the sums hold.
    """

    signal: np.ndarray
    noise: np.ndarray
    cos_error: np.ndarray
    tokens: int = 0

    @classmethod
    def empty(cls, layers: int) -> ErrorSums:
        return cls(np.zeros(layers), np.zeros(layers), np.zeros(layers))

    def add(self, layer: int, base: torch.Tensor, other: torch.Tensor) -> None:
        """Add the tokens ``[T, H]`` of one batch at ``layer`` (``tokens`` is counted by the caller, once a batch)."""
        base, other = base.double(), other.double()
        noise = ((other - base) ** 2).sum(-1)
        self.signal[layer] += float((base * base).sum())
        self.noise[layer] += float(noise.sum())
        cosine = torch.nn.functional.cosine_similarity(other, base, dim=-1, eps=1e-30)
        # an identical vector's cosine rounds a few ulps off 1: what is equal has no error
        self.cos_error[layer] += float(torch.where(noise > 0, 1 - cosine, 0).sum())

    def sqnr_db(self) -> np.ndarray:
        """10·log10(signal / noise) per layer; ``SQNR_CAP_DB`` where the noise is nothing."""
        with np.errstate(divide="ignore"):
            sqnr = 10 * np.log10(self.signal / self.noise)
        return np.minimum(np.nan_to_num(sqnr, nan=SQNR_CAP_DB, posinf=SQNR_CAP_DB), SQNR_CAP_DB)

    def relative_error(self) -> np.ndarray:
        """‖output − baseline output‖_F / ‖baseline output‖_F per layer."""
        return np.sqrt(self.noise / np.where(self.signal > 0, self.signal, 1.0))

    def mean_cos_error(self) -> np.ndarray:
        return self.cos_error / max(self.tokens, 1)


@dataclass
class LayerErrors:
    """Each decoder layer's own and accumulated error; the input embeddings' (a quantizer may round them too); and
    the LM head's own: the variant's head on the baseline's final hidden states, as KL(baseline‖variant head) and
    agreement on the top token, summed over ``tokens``."""

    own: ErrorSums
    accumulated: ErrorSums
    embeddings: ErrorSums
    head_kl_sum: float = 0.0
    head_top1_sum: float = 0.0
    tokens: int = 0
    per_window: dict[int, float] = field(default_factory=dict)  # the head's KL sum by window index

    @property
    def head_kl(self) -> float:
        return self.head_kl_sum / max(self.tokens, 1)

    @property
    def head_top1(self) -> float:
        return self.head_top1_sum / max(self.tokens, 1)


class _Taps:
    """Hooks on a model's decoder layers that keep each layer's inputs (arguments as called) and output for one
    forward pass: what one batch's per-layer errors need, never more than one batch's."""

    def __init__(self, layers: torch.nn.ModuleList, inputs: bool):
        self.inputs: list[tuple[tuple, dict] | None] = [None] * len(layers)
        self.outputs: list[torch.Tensor | None] = [None] * len(layers)
        self.returned: list = [None] * len(layers)  # as the layer returned it (a tensor, or a tuple)
        self.handles = []
        for i, layer in enumerate(layers):
            if inputs:
                self.handles.append(layer.register_forward_pre_hook(self._keep_input(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(self._keep_output(i)))

    def _keep_input(self, i: int):
        def hook(module, args, kwargs):
            self.inputs[i] = (args, kwargs)
        return hook

    def _keep_output(self, i: int):
        def hook(module, args, output):
            self.outputs[i] = _output(output)
            self.returned[i] = output
        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextmanager
def _tapped(model, inputs: bool) -> Iterator[_Taps]:
    taps = _Taps(decoder_layers(model), inputs)
    try:
        yield taps
    finally:
        taps.close()


@torch.inference_mode()
def layer_errors(baseline, variant, feed: Feed, windows: list[Window]) -> LayerErrors:
    """Every decoder layer's own and accumulated error of ``variant`` against ``baseline`` on ``windows``, and the
    LM head's own error, one batch at a time (memory: both models, and one batch's per-layer inputs and outputs).

    Args:
        baseline, variant: causal LMs of one architecture, on one device.
        feed, windows: as ``tasks.engine.perplexity.score_windows`` takes them.
    """
    layers = decoder_layers(variant)
    count = len(layers)
    errors = LayerErrors(ErrorSums.empty(count), ErrorSums.empty(count), ErrorSums.empty(1))
    base_head, head = baseline.get_output_embeddings(), variant.get_output_embeddings()
    base_softcap = getattr(baseline.config, "final_logit_softcapping", None)
    softcap = getattr(variant.config, "final_logit_softcapping", None)
    prefix_ids = torch.tensor(feed.prefix, dtype=torch.long)
    for b in range(0, len(windows), feed.batch_size):
        batch = windows[b : b + feed.batch_size]
        input_ids, mask, row_index, columns, targets = batch_inputs(feed.ids, batch, prefix_ids, feed.first_token)
        with _tapped(baseline, inputs=True) as base:
            base_final = hidden_states(baseline, input_ids, mask, row_index, columns)
        with _tapped(variant, inputs=False) as run:
            hidden_states(variant, input_ids, mask, row_index, columns)
        rows, cols = row_index.to(base_final.device), columns.to(base_final.device)
        embedded = input_ids.to(input_device(baseline))
        errors.embeddings.add(0, baseline.get_input_embeddings()(embedded)[rows, cols],
                              variant.get_input_embeddings()(embedded)[rows, cols])
        for i, layer in enumerate(layers):
            expected = base.outputs[i][rows, cols]
            errors.accumulated.add(i, expected, run.outputs[i][rows, cols])
            args, kwargs = base.inputs[i]
            errors.own.add(i, expected, _output(layer(*args, **kwargs))[rows, cols])
        tokens = len(targets)
        errors.own.tokens += tokens
        errors.accumulated.tokens += tokens
        errors.embeddings.tokens += tokens
        stats = token_stats(head, base_final, targets.to(base_final.device), softcap,
                            reference=BaselineBatch(base_head, base_final, base_softcap), stream_tokens=len(feed.ids))
        errors.head_kl_sum += float(stats.kl.sum())
        errors.head_top1_sum += float(stats.top1.double().sum())
        errors.tokens += tokens
    return errors


@contextmanager
def restored(variant, baseline, layers: Iterable[int]) -> Iterator[None]:
    """``variant`` with its decoder layers ``layers`` replaced by the baseline's, every one of its weights; put
    back as they were on leaving. The baseline's layers are lent, not copied: no more memory is taken."""
    mine, theirs = decoder_layers(variant), decoder_layers(baseline)
    chosen = sorted(set(layers))
    kept = {i: mine[i] for i in chosen}
    try:
        for i in chosen:
            mine[i] = theirs[i]
        yield
    finally:
        for i, layer in kept.items():
            mine[i] = layer


class _Replay(torch.nn.Module):
    """Stands in for a decoder layer and returns what it returned for this batch, computing nothing: the layers
    before the first restored one give the variant's own outputs, which need not be computed again. Anything else
    the model reads of the layer (Gemma's ``attention_type``) is the layer's."""

    def __init__(self, layer: torch.nn.Module, returned):
        super().__init__()
        self.returned = returned
        object.__setattr__(self, "layer", layer)  # not a submodule: its weights are not this one's

    def forward(self, *args, **kwargs):
        return self.returned

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "layer"), name)


@contextmanager
def _replayed(model, returned: list) -> Iterator[None]:
    """``model`` with its first ``len(returned)`` decoder layers giving back ``returned``, put back on leaving."""
    layers = decoder_layers(model)
    kept = list(layers[: len(returned)])
    try:
        for i, value in enumerate(returned):
            layers[i] = _Replay(kept[i], value)
        yield
    finally:
        for i, layer in enumerate(kept):
            layers[i] = layer


@dataclass
class RestoredScores:
    """Per-token NLL and KL(baseline‖variant) of the variant with ``layers`` restored, in the token arrays' order."""

    layers: tuple[int, ...]
    nll: torch.Tensor
    kl: torch.Tensor


# One module lent to a variant: (decoder layer, the module's path in it, e.g. ``mlp.down_proj``, which donor)
Swap = tuple[int, str, int]


@contextmanager
def swapped(variant, donors: list, swaps: Iterable[Swap]) -> Iterator[None]:
    """``variant`` with each module ``(layer, path, donor)`` of ``swaps`` replaced by the same module of
    ``donors[donor]``'s same decoder layer; put back as they were on leaving. Lent, not copied."""
    mine = decoder_layers(variant)
    kept = []
    try:
        for layer, path, donor in swaps:
            parent_path, _, leaf = path.rpartition(".")
            parent = mine[layer].get_submodule(parent_path) if parent_path else mine[layer]
            kept.append((parent, leaf, getattr(parent, leaf)))
            setattr(parent, leaf, decoder_layers(donors[donor])[layer].get_submodule(path))
        yield
    finally:
        for parent, leaf, module in reversed(kept):
            setattr(parent, leaf, module)


@torch.inference_mode()
def restored_scores(baseline, variant, sets: list[tuple[int, ...]], feed: Feed, windows: list[Window],
                    against: Baseline, label: str | None = None) -> list[RestoredScores]:
    """Score ``windows`` with each set of the baseline's decoder layers in ``sets`` restored in the variant
    (``_changed_scores``: the variant runs once a batch, each set from its first restored layer on).

    Args:
        against: the baseline's head and its final hidden states at the scored tokens (``Baseline.states``).
        feed, windows: as ``tasks.engine.perplexity.score_windows`` takes them.
        label: a progress bar's name (one step per set and batch); no bar when None.
    """
    found = _changed_scores(variant, [(lambda s=layers: restored(variant, baseline, s), min(layers)) for layers in sets],
                            feed, windows, against, label)
    return [RestoredScores(tuple(layers), nll, kl) for layers, (nll, kl) in zip(sets, found)]


@torch.inference_mode()
def swapped_scores(variant, donors: list, sets: list[tuple[Swap, ...]], feed: Feed, windows: list[Window],
                   against: Baseline, label: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-token NLL and KL(baseline‖·) of the variant with each set of modules in ``sets`` lent from ``donors``
    (``swapped``), as ``restored_scores`` scores restored layers; an empty set scores the variant as it is."""
    count = len(decoder_layers(variant))
    changes = [(lambda s=swaps: swapped(variant, donors, s), min((swap[0] for swap in swaps), default=count))
               for swaps in sets]
    return _changed_scores(variant, changes, feed, windows, against, label)


def _changed_scores(variant, changes: list, feed: Feed, windows: list[Window], against: Baseline,
                    label: str | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(nll, kl)`` per token of the variant under each change ``(context, first changed layer)``.

    Batch by batch, the variant runs once as it is and each layer's output is kept; a change whose first layer is
    ``m`` then runs only from layer ``m`` on (the layers before it would compute the same outputs again): about
    half of a whole pass for one changed layer, and the same bits as a whole pass. Memory: the models, and one
    batch's per-layer outputs.
    """
    head = variant.get_output_embeddings()
    softcap = getattr(variant.config, "final_logit_softcapping", None)
    total = sum(w.n_scored for w in windows)
    scores = [(torch.zeros(total, dtype=torch.float64), torch.zeros(total, dtype=torch.float64)) for _ in changes]
    prefix_ids = torch.tensor(feed.prefix, dtype=torch.long)
    done = 0
    with console.bar(len(changes) * len(windows), label or "restore", "window", enabled=label is not None) as bar:
        for b in range(0, len(windows), feed.batch_size):
            batch = windows[b : b + feed.batch_size]
            inputs = batch_inputs(feed.ids, batch, prefix_ids, feed.first_token)
            input_ids, mask, row_index, columns, targets = inputs
            slots = torch.arange(done, done + len(targets))
            done += len(targets)
            with _tapped(variant, inputs=False) as run:
                hidden_states(variant, input_ids, mask, row_index, columns)
            reference = BaselineBatch(against.head, against.states(slots, inputs), against.softcap)
            for (change, first), (nll, kl) in zip(changes, scores):
                with change(), _replayed(variant, run.returned[:first]):
                    hidden = hidden_states(variant, input_ids, mask, row_index, columns)
                stats = token_stats(head, hidden, targets.to(hidden.device), softcap,
                                    reference=dataclasses.replace(reference, hidden=reference.hidden.to(hidden.device)),
                                    stream_tokens=len(feed.ids))
                nll[slots] = stats.nll.double().cpu()
                kl[slots] = stats.kl.double().cpu()
                bar.update(len(batch))
    return scores


def recovered_share(variant_loss: np.ndarray, restored_loss: np.ndarray, window_tokens: np.ndarray,
                    confidence: float) -> tuple[float, float, float]:
    """How much of a variant's loss restoring layers wins back on the same tokens: ``(share, low, high)``, the
    share in % of the variant's loss and its ``confidence`` interval.

    The share is a ratio of sums over the windows, ``Σ (variant − restored) / Σ variant``; its error is taken
    over windows (the tokens of a window are not independent) from the linearized residuals, as
    ``tasks.engine.paired`` takes a mean's. A variant that loses nothing has nothing to recover: 0 %.

    Args:
        variant_loss, restored_loss: ``[n]`` per-token losses (ΔNLL against the baseline, or KL), window by window.
        window_tokens: ``[W]`` tokens per window, summing to ``n``.
    """
    counts = np.asarray(window_tokens, np.int64)
    counts = counts[counts > 0]
    starts = np.cumsum(counts) - counts
    loss = np.add.reduceat(np.asarray(variant_loss, np.float64), starts)
    gain = loss - np.add.reduceat(np.asarray(restored_loss, np.float64), starts)
    total = loss.sum()
    if not total > 0:
        return 0.0, 0.0, 0.0
    share = gain.sum() / total
    clusters = len(counts)
    if clusters < 2:
        return 100 * share, math.nan, math.nan
    residuals = gain - share * loss
    stderr = math.sqrt(clusters / (clusters - 1) * float((residuals**2).sum())) / total
    half = t_quantile(confidence, clusters - 1) * stderr
    return 100 * share, 100 * (share - half), 100 * (share + half)
