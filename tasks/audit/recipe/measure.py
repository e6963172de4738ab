"""Gains measured, not predicted: each unit at each option scored alone on a sample, the knapsack's choice scored
as a whole and refined by scoring its neighbours."""

from __future__ import annotations

import hashlib
import json
import time
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tasks.audit.checkpoints import Checkpoint, Lineup, baseline_gguf, loading_from
from tasks.audit.diagnose import held_baseline, sample, sample_feed
from tasks.audit.recipe.choose import Choice, knapsack
from tasks.audit.recipe.gains_said import choices_of, rows_of
from tasks.audit.recipe.gptq import FLOAT, as_name
from tasks.audit.recipe.plan import Prepared
from tasks.audit.recipe.sizes import Sizes, Unit, split, splits
from tasks.core.errors import InputError
from tasks.data.evaluation import Evaluation
from tasks.engine.layers import Swap, decoder_layers, recovered_share, swapped_scores
from tasks.engine.paired import CONFIDENCE

CURVE = (0.25, 0.5, 0.75)  # the budgets, as shares of the one asked, at which the curve of KL is also measured
NEIGHBOURS = 4  # assignments scored per refining round
ROUNDS = 2


@dataclass
class Measured:
    """One assignment scored on the sample: its KL and ΔNLL per token, what it costs, and the share of the
    variant's KL it wins back with its interval."""

    chosen: tuple[Choice, ...]
    kl: float
    delta_nll: float
    cost: int
    share: tuple[float, float, float]
    predicted: float  # the variant's KL less the chosen units' gains alone: what adding them up would say


@dataclass
class Models:
    """The models a tune scores on its sample: the baseline, the variant and one uniform model per option (its
    donors), loaded once; ``files``: what each donor was loaded from (its file, its folder), which names it."""

    baseline: object
    variant: object
    donors: list
    files: list[str]


@dataclass
class TuneSample:
    """The sample the gains are measured on: each domain's evaluation and windows, and the baseline on them."""

    parts: list[tuple[Evaluation, list, object]] = field(default_factory=list)  # (evaluation, windows, Baseline)
    window_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    base_nll: np.ndarray = field(default_factory=lambda: np.zeros(0))


def draw(models: Models, evaluations: list[Evaluation], windows: int | None, seed: int) -> TuneSample:
    """``windows`` windows of each domain's plan drawn by ``seed``, and the baseline's scores on them."""
    found = TuneSample()
    tokens, base = [], []
    for evaluation_ in evaluations:
        chosen = sample(evaluation_, windows, seed)
        scores, against = held_baseline(models.baseline, evaluation_, chosen, sample_feed(evaluation_))
        found.parts.append((evaluation_, chosen, against))
        tokens += [w.n_scored for w in chosen]
        base.append(scores.token_nll.double().numpy())
    found.window_tokens, found.base_nll = np.array(tokens), np.concatenate(base)
    return found


def score_sets(models: Models, drawn: TuneSample, sets: list[tuple[Swap, ...]], label: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(nll, kl)`` per token of the variant with each set of modules lent from the donors, over every domain's
    sample in turn."""
    per_domain = [swapped_scores(models.variant, models.donors, sets, sample_feed(evaluation_), windows, against,
                                 f"{label} ({len(sets)} sets)")
                  for evaluation_, windows, against in drawn.parts]
    return [(np.concatenate([d[i][0].numpy() for d in per_domain]), np.concatenate([d[i][1].numpy() for d in per_domain]))
            for i in range(len(sets))]


def swaps_of(units: list[Unit], chosen: tuple[Choice, ...]) -> tuple[Swap, ...]:
    return tuple((units[c.unit].layer, module, c.option) for c in chosen for module in units[c.unit].modules)


@dataclass
class Tuning:
    """What a tune found: every unit's gain at every option, the assignment chosen and how it was refined, the
    curve of budget against KL."""

    units: list[Unit]
    types: list[str]
    extra: int  # bytes the budget allows beyond the variant
    variant_kl: float
    variant_delta_nll: float
    choices: list[Choice]
    first: Measured
    final: Measured
    tried: int
    curve: list[Measured]
    tokens: int
    windows: int
    seconds: float

    def tensor_types(self) -> list[str]:
        """The recipe as llama-quantize ``--tensor-type`` entries (a GGUF tune's)."""
        return [self.units[c.unit].entry(self.types[c.option]) for c in self.final.chosen]

    def expected_types(self, donors: list[Sizes]) -> dict[str, str]:
        """Each changed tensor's type as the uniform model of its option has it (llama.cpp's fallback for shapes a
        type cannot hold included): what the recipe's file must hold."""
        return {name: donors[c.option].types[name] for c in self.final.chosen
                for name in donors[c.option].names(self.units[c.unit])}


def measured_choice(choices: tuple[Choice, ...], nll: np.ndarray, kl: np.ndarray, seen_kl: np.ndarray, drawn: TuneSample) -> Measured:
    share = recovered_share(seen_kl, kl, drawn.window_tokens, CONFIDENCE)
    return Measured(choices, float(kl.mean()), float((nll - drawn.base_nll).mean()), sum(c.cost for c in choices),
                    share, float(seen_kl.mean()) - sum(c.gain for c in choices))


def measure_tune_units(models: Models, drawn: TuneSample, prepared: Prepared, donor_sizes: list[Sizes]) -> Tuning:
    """Measure every layer at every option alone (with ``--per module``: then the groups of the layers that win back
    most, in place of those layers), choose (``knapsack``), score the choice and refine it."""
    layers, types, extra = list(prepared.units), list(prepared.types), prepared.extra
    started = time.perf_counter()
    seen_nll, seen_kl = score_sets(models, drawn, [()], "the variant")[0]

    def alone(units: list[Unit], label: str) -> list[Choice]:
        made_from = {"sample": _digest(seen_nll, seen_kl, drawn.window_tokens), "units": [u.label for u in units],
                     "options": [Path(file).name for file in models.files]}
        kept = _remembered(made_from)
        if kept is not None:
            return kept
        costs = {(u, o): donor_sizes[o].matrix_bytes([unit]) - prepared.sizes.matrix_bytes([unit])
                 for u, unit in enumerate(units) for o in range(len(types))}
        pairs = [pair for pair, cost in costs.items() if cost > 0]  # an option no larger than the variant's is none
        scored = score_sets(models, drawn, [swaps_of(units, (Choice(u, o, 0, 0.0, (0, 0, 0)),)) for u, o in pairs], label)
        tried.append(len(pairs))
        found = [Choice(u, o, costs[u, o], float(seen_kl.mean() - kl.mean()),
                        recovered_share(seen_kl, kl, drawn.window_tokens, CONFIDENCE))
                 for (u, o), (_, kl) in zip(pairs, scored)]
        _remember(made_from, found)
        return found

    tried = [1]  # assignments scored here (gains kept from a tune at another budget are not scored again)
    units, choices = list(layers), alone(layers, "each layer alone")
    if prepared.per == "module":
        best_of = {u: max((c.gain for c in choices if c.unit == u), default=0.0) for u in range(len(units))}
        chosen = set(sorted(best_of, key=best_of.get, reverse=True)[: splits(len(layers))])
        kept = [u for u in range(len(units)) if u not in chosen]
        groups = [g for u in sorted(chosen) for g in split(units[u])]
        renumbered = {u: i for i, u in enumerate(kept)}
        units = [units[u] for u in kept] + groups
        grouped = alone(units[len(kept):], "the groups of the layers that win back most")
        choices = [Choice(renumbered[c.unit], c.option, c.cost, c.gain, c.share) for c in choices if c.unit in renumbered]
        choices += [Choice(c.unit + len(kept), c.option, c.cost, c.gain, c.share) for c in grouped]
    first = knapsack(choices, extra)
    curve_sets = [knapsack(choices, int(extra * share)) for share in CURVE]
    scored = score_sets(models, drawn, [swaps_of(units, c) for c in [first, *curve_sets]], "the choice and the curve")
    found = [measured_choice(c, nll, kl, seen_kl, drawn) for c, (nll, kl) in zip([first, *curve_sets], scored)]
    best, curve = found[0], found[1:]
    tried.append(len(found))
    for _ in range(ROUNDS):
        neighbours = [knapsack(choices, extra, excluded=frozenset({(c.unit, c.option)}))
                      for c in sorted(best.chosen, key=lambda c: c.gain)[:NEIGHBOURS]]
        neighbours = list(dict.fromkeys(n for n in neighbours if n and n != best.chosen))
        if not neighbours:
            break
        scored = score_sets(models, drawn, [swaps_of(units, n) for n in neighbours], "refining")
        tried.append(len(neighbours))
        better = min((measured_choice(n, nll, kl, seen_kl, drawn) for n, (nll, kl) in zip(neighbours, scored)),
                     key=lambda m: m.kl)
        if better.kl >= best.kl:
            break
        best = better
    return Tuning(units, types, extra, float(seen_kl.mean()), float((seen_nll - drawn.base_nll).mean()), choices,
                  found[0], best, sum(tried), [*curve, best], int(drawn.window_tokens.sum()), len(drawn.window_tokens),
                  time.perf_counter() - started)


def load_models(lineup: Lineup, checkpoint: Checkpoint, donors: list[Checkpoint | str]) -> Models:
    """The baseline, the variant and each option's uniform model, loaded here on one device in one dtype, their
    matrices plain floats: a GGUF file dequantized (the weights llama.cpp runs), a gptq module as its kernel computes
    it. A donor given as ``FLOAT`` is the baseline with its decoder layers' matrices in bfloat16, as a gptq
    checkpoint keeps a module it leaves unquantized."""
    from tasks.models.variants import load_variant

    def weights(each: Checkpoint):  # its weights in transformers, whatever runtime the audit scores it in
        spec = each.spec.model_copy(update={"runtime": "transformers", "llama_cpp": None})
        return _plain(load_variant(spec, each.model)[0])

    baseline, variant = weights(lineup.baseline), weights(checkpoint)
    loaded = [_rounded(baseline) if donor == FLOAT else weights(donor) for donor in donors]
    if len(decoder_layers(baseline)) != len(decoder_layers(variant)):
        raise InputError(f"{checkpoint.name} has not the baseline's decoder layers: it cannot be tuned against it")
    names = [f"{lineup.baseline.source}:{FLOAT}" if d == FLOAT else str(d.source) for d in donors]
    return Models(baseline, variant, loaded, names)


@torch.inference_mode()
def _plain(model):
    """``model`` with each quantized matrix of its decoder layers (one with packed ``qweight``: gptqmodel's) made a
    plain Linear of the weights its kernel computes with: what it gives for each unit vector (bias aside)."""
    for layer in decoder_layers(model):
        for name, module in list(layer.named_modules()):
            if not hasattr(module, "qweight"):
                continue
            device = module.qweight.device
            eye = torch.eye(module.in_features, dtype=model.dtype, device=device)
            bias = getattr(module, "bias", None)
            weight = module(eye) - (bias if bias is not None else 0)
            plain = torch.nn.Linear(module.in_features, module.out_features, bias=bias is not None, device=device,
                                    dtype=model.dtype)
            plain.weight.copy_(weight.T)
            if bias is not None:
                plain.bias.copy_(bias)
            parent, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, leaf, plain)
    return model


@torch.inference_mode()
def _rounded(baseline):
    """A copy of ``baseline`` with its decoder layers' matrices rounded to bfloat16 and back."""
    copy = deepcopy(baseline)
    for layer in decoder_layers(copy):
        for module in layer.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(module.weight.to(torch.bfloat16).to(module.weight.dtype))
    return copy


def option_files(lineup: Lineup, checkpoint: Checkpoint, types: list[str]) -> list[Path]:
    """Each option's uniform file: the variant's file type with every decoder-layer matrix in that type (llama.cpp's
    quantizer, cached)."""
    from tasks.models import llama_cpp

    source = baseline_gguf(lineup.baseline.model)
    return [llama_cpp.made_file(source, checkpoint.spec.type, tensor_types=(f"^blk\\.\\d+\\..*\\.weight={t.lower()}",))
            for t in types]


def gptq_donors(lineup: Lineup, checkpoint: Checkpoint, prepared: Prepared,
                evaluation_: Evaluation) -> tuple[Checkpoint, list[Checkpoint | str]]:
    """The gptq variant and each option's uniform checkpoint, quantized here from the baseline with the variant's
    calibration (cached as an audit's are); ``FLOAT`` for the option that leaves a unit unquantized."""
    from tasks.audit.checkpoints import quantized_checkpoint
    from tasks.audit.scoring import made
    from tasks.data.corpus import corpus_text

    variant = made(checkpoint, lineup, evaluation_, corpus_text, progress=True)
    donors: list[Checkpoint | str] = []
    for option in prepared.options:
        if option.bits is None:
            donors.append(FLOAT)
            continue
        spec = checkpoint.spec.model_copy(update={"name": as_name(checkpoint.name, option.scheme), "bits": option.bits,
                                                  "group_size": option.group})
        donors.append(loading_from(checkpoint, quantized_checkpoint(spec, lineup, evaluation_, corpus_text, True)))
    return variant, donors


def measure(lineup: Lineup, evaluations: list[Evaluation], prepared: Prepared, windows: int | None,
            seed: int) -> tuple[Tuning, list[Sizes], Checkpoint]:
    """Load the models (each option's uniform model made first, cached), draw the sample from every domain and
    tune: the tuning, each option's sizes (what the recipe's matrices must be, as built), and the variant as
    measured (a gptq variant made here: its checkpoint)."""
    import gc

    [checkpoint] = lineup.variants
    if prepared.tune.gptqmodel:
        checkpoint, donors = gptq_donors(lineup, checkpoint, prepared, evaluations[0])
        donor_sizes = prepared.option_sizes()
    else:
        files = option_files(lineup, checkpoint, list(prepared.types))
        donors = [loading_from(checkpoint, str(file)) for file in files]
        donor_sizes = [Sizes.of(file) for file in files]
    models = load_models(lineup, checkpoint, donors)
    try:
        drawn = draw(models, evaluations, windows, seed)
        found = measure_tune_units(models, drawn, prepared, donor_sizes)
    finally:
        del models
        gc.collect()
    return found, donor_sizes, checkpoint


def _digest(*arrays: np.ndarray) -> str:
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array, np.float64).tobytes())
    return digest.hexdigest()


def _cached(made_from: dict) -> Path:
    from tasks.core.places import cache_dir

    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "tune" / f"gains-{key}.json"


def _remembered(made_from: dict) -> list[Choice] | None:
    """Each unit's gains alone, as a tune at another budget measured them on the same sample (the variant's own
    per-token scores on it name the variant, the baseline and the windows), with the same options' files; None when
    none were kept. An entry changed or made from something else is one line and measured again."""
    from tasks.core import sealed

    path = _cached(made_from)
    if not path.is_file():
        return None
    entry = sealed.read_entry(path)
    problem = sealed.damage(entry, "its entry", made_from)
    if problem is None:
        return choices_of(entry)
    sealed.warn_remade("a tune's kept gains", path, problem, "they are measured again")
    return None


def _remember(made_from: dict, choices: list[Choice]) -> None:
    from tasks.core import sealed
    from tasks.core.files import write_atomically

    path = _cached(made_from)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(sealed.seal(made_from | {"choices": rows_of(choices)})))
