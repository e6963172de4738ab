"""A mixed-precision recipe under a size budget, chosen from measured gains (``ppl-audit tune``).

A variant's decoder-layer matrices are the units a recipe can give more precision: a whole layer, or its fused
groups (q/k/v, the output projection, gate/up, down), each with one choice, as runtimes fuse them. Each option is a
GGUF tensor type above the variant's (``Q6_K``, ``Q8_0``, ``F16``): llama.cpp quantizes every tensor on its own, so
the variant with a unit's tensors taken from the uniform file of that type *is* the recipe's model, bit for bit.

What a unit at an option wins back is measured on a seeded sample of the audit's windows (every domain's), as the KL
to the baseline it removes; its cost is exact, read from the files' headers. A multiple-choice knapsack picks the
assignment of most gain within the budget; the combination is then scored as a whole (gains do not add), and refined
by scoring its neighbours (the best assignment with one of its choices left out) and keeping the best measured.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tasks.audit.checkpoints import Checkpoint, Lineup, baseline_gguf
from tasks.audit.diagnose import held_baseline, sample, sample_feed
from tasks.config import AuditConfig
from tasks.core.errors import InputError
from tasks.data.evaluation import Evaluation
from tasks.engine.layers import Swap, decoder_layers, recovered_share, swapped_scores
from tasks.engine.paired import CONFIDENCE
from tasks.models.gguf_file import read_header

MIB = 2**20
# A Hugging Face decoder layer's matrices and the GGUF tensors llama.cpp's converter makes of them
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
# The groups runtimes fuse into one kernel (vLLM's qkv_proj and gate_up_proj): one choice each
PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
TYPES = ("Q6_K", "Q8_0", "F16")  # the options a unit may take by default: more bits, and left unquantized
# Uniform file types by their nominal bits per weight (llama.cpp's table): the uniform variant of equal or larger size
# the recipe is audited beside is the first of these at least as large as the recipe, as built
UNIFORM = (("Q2_K", 2.625), ("Q3_K_S", 3.4375), ("Q4_0", 4.5), ("Q4_1", 5.0), ("Q5_0", 5.5), ("Q5_1", 6.0),
           ("Q6_K", 6.5625), ("Q8_0", 8.5))
CURVE = (0.25, 0.5, 0.75)  # the budgets, as shares of the one asked, at which the curve of KL is also measured
NEIGHBOURS = 4  # assignments scored per refining round
ROUNDS = 2


@dataclass(frozen=True)
class Budget:
    """What the tuned variant may take: bits per weight of the decoder layers' matrices (``4.5bpw``), or MiB of the
    whole file (``120MiB``); ``+`` before the number: more than the variant itself takes (``+0.25bpw``)."""

    value: float
    unit: str  # "bpw" or "MiB"
    added: bool
    text: str = field(default="", compare=False)  # as the user gave it

    @classmethod
    def parse(cls, text: str) -> Budget:
        found = re.fullmatch(r"\s*(\+?)\s*(\d+(?:\.\d+)?)\s*(bpw|MiB)\s*", text, re.IGNORECASE)
        if found is None:
            raise InputError(f"--budget {text!r}: give bits per weight (4.5bpw), MiB of the file (120MiB), or what "
                             "is added to the variant's own (+0.25bpw, +8MiB)")
        unit = "bpw" if found[3].lower() == "bpw" else "MiB"
        if float(found[2]) <= 0:
            raise InputError(f"--budget {text!r}: give a budget above zero")
        return cls(float(found[2]), unit, bool(found[1]), text.strip())

    def __str__(self) -> str:
        return self.text or f"{'+' if self.added else ''}{self.value:g}{self.unit}"


@dataclass(frozen=True)
class Unit:
    """What a recipe gives one choice: decoder layer ``layer``'s matrices ``modules`` (its part ``part``)."""

    layer: int
    part: str
    modules: tuple[str, ...]

    @property
    def label(self) -> str:
        return str(self.layer) if self.part == "layer" else f"{self.layer}.{self.part}"

    @property
    def tensors(self) -> list[str]:
        return [f"blk.{self.layer}.{GGUF_NAMES[m]}.weight" for m in self.modules]

    def entry(self, ggml_type: str) -> str:
        """The llama-quantize ``--tensor-type`` entry that gives these tensors ``ggml_type`` (and no others: the
        pattern is anchored on the layer's number and the tensors' names)."""
        names = "|".join(GGUF_NAMES[m] for m in self.modules)
        return f"blk\\.{self.layer}\\.({names})\\.weight={ggml_type.lower()}"


def units_of(layers: int) -> list[Unit]:
    """A model's decoder layers as units, each layer's matrices one choice."""
    return [Unit(i, "layer", tuple(GGUF_NAMES)) for i in range(layers)]


def split(unit: Unit) -> list[Unit]:
    """A layer's fused groups as units of their own."""
    return [Unit(unit.layer, part, modules) for part, modules in PARTS.items()]


def splits(layers: int) -> int:
    """How many layers ``--per module`` splits into their groups: those that win back most whole, a quarter of the
    layers (at least 4): a layer that wins back little whole rarely holds a group that wins back much."""
    return min(layers, max(4, layers // 4))


@dataclass(frozen=True)
class Sizes:
    """A GGUF file's tensors: bytes and type by name, and the decoder layers' matrices' weights and bytes."""

    bytes: dict[str, int]
    types: dict[str, str]
    total: int

    @classmethod
    def of(cls, path: Path) -> Sizes:
        tensors = read_header(path).tensors
        return cls({t.name: int(t.n_bytes) for t in tensors}, {t.name: t.tensor_type.name for t in tensors},
                   sum(int(t.n_bytes) for t in tensors))

    def matrices(self, units: list[Unit]) -> list[str]:
        return [name for unit in units for name in unit.tensors]

    def matrix_bytes(self, units: list[Unit]) -> int:
        return sum(self.bytes[name] for name in self.matrices(units))


def matrix_weights(path: Path, units: list[Unit]) -> int:
    wanted = {name for unit in units for name in unit.tensors}
    return sum(int(t.n_elements) for t in read_header(path).tensors if t.name in wanted)


def check_tunable(config: AuditConfig, variant: str) -> None:
    """Refuse, in one line, a variant whose precision cannot be set module by module here."""
    from tasks.audit.diagnose import variant_spec

    spec = variant_spec(config, variant)
    if spec.method != "gguf" or spec.type is None:
        what = f"method {spec.method}" + (f" ({spec.path})" if spec.path else "")
        raise InputError(f"variant '{variant}' is {what}: tune sets each tensor's type in a GGUF file llama.cpp's "
                         "quantizer makes from the baseline, so give the variant as method gguf with a type "
                         "(type: Q4_0); gptq/awq recipes (gptqmodel's dynamic) are not made here yet")
    if spec.imatrix:
        raise InputError(f"variant '{variant}' is quantized with an importance matrix, which tune does not carry into "
                         "its uniform files yet; tune the variant without imatrix")
    if spec.tensor_types:
        raise InputError(f"variant '{variant}' already has tensor_types (a recipe): tune the uniform variant")


@dataclass(frozen=True)
class Span:
    """The sizes a budget is read against: the variant's and the baseline's decoder-layer matrices (bits per weight)
    and the variant's whole file (MiB)."""

    weights: int  # the decoder layers' matrices' weights
    variant_bytes: int  # what they take in the variant
    baseline_bytes: int  # and in the baseline's GGUF file
    file_bytes: int  # the variant's whole file

    def bpw(self, matrix_bytes: float) -> float:
        return 8 * matrix_bytes / self.weights

    def extra_bytes(self, budget: Budget) -> int:
        """What the budget allows the matrices beyond the variant's own; one line when it is below the variant's
        own size or above the baseline's."""
        if budget.unit == "bpw":
            target = (self.bpw(self.variant_bytes) + budget.value if budget.added else budget.value) * self.weights / 8
            own, top = f"{self.bpw(self.variant_bytes):.3f}bpw", f"{self.bpw(self.baseline_bytes):.3f}bpw"
        else:
            whole = (self.file_bytes + budget.value * MIB) if budget.added else budget.value * MIB
            target = whole - (self.file_bytes - self.variant_bytes)
            own = f"{self.file_bytes / MIB:.2f}MiB"
            top = f"{(self.file_bytes - self.variant_bytes + self.baseline_bytes) / MIB:.2f}MiB"
        if target <= self.variant_bytes:
            raise InputError(f"--budget {budget}: the variant itself takes {own} (its decoder layers' matrices in bits "
                             f"per weight, or its file in MiB); give more, e.g. +0.25bpw")
        if target > self.baseline_bytes:
            raise InputError(f"--budget {budget}: more than the baseline itself takes ({top}); give less, or audit "
                             "the baseline")
        return int(target - self.variant_bytes)


def span_of(variant_file: Path, baseline_file: Path, units: list[Unit]) -> Span:
    mine, theirs = Sizes.of(variant_file), Sizes.of(baseline_file)
    return Span(matrix_weights(variant_file, units), mine.matrix_bytes(units), theirs.matrix_bytes(units), mine.total)


@dataclass(frozen=True)
class Choice:
    """A unit at an option (an index into the options), what it costs beyond the variant and what it wins back
    alone on the sample: KL in nats per token, and as a share of the variant's KL with its interval."""

    unit: int
    option: int
    cost: int
    gain: float
    share: tuple[float, float, float]


def knapsack(choices: list[Choice], budget: int, steps: int = 2000, excluded: frozenset = frozenset()) -> tuple:
    """The choices (at most one per unit) of most summed gain whose costs sum within ``budget`` bytes: a
    multiple-choice knapsack solved exactly over costs rounded up to ``budget / steps`` (so never over budget).
    ``excluded``: ``(unit, option)`` pairs not to take. Returns the chosen ``Choice`` objects, by unit."""
    if budget <= 0:
        return ()
    quantum = budget / steps
    by_unit: dict[int, list[Choice]] = {}
    for choice in choices:
        if choice.gain > 0 and (choice.unit, choice.option) not in excluded:
            by_unit.setdefault(choice.unit, []).append(choice)
    best = np.full(steps + 1, -np.inf)
    best[0] = 0.0
    taken: list[np.ndarray] = []
    for options in by_unit.values():
        nxt, pick = best.copy(), np.full(steps + 1, -1)
        for k, choice in enumerate(options):
            units = math.ceil(choice.cost / quantum - 1e-9)
            if units > steps:
                continue
            shifted = np.full(steps + 1, -np.inf)
            shifted[units:] = best[: steps + 1 - units] + choice.gain
            better = shifted > nxt
            nxt[better], pick[better] = shifted[better], k
        taken.append(pick)
        best = nxt
    at = int(np.argmax(best))
    chosen = []
    for options, pick in zip(reversed(list(by_unit.values())), reversed(taken)):
        k = pick[at]
        if k >= 0:
            chosen.append(options[k])
            at -= math.ceil(options[k].cost / quantum - 1e-9)
    return tuple(sorted(chosen, key=lambda c: c.unit))


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
    """The models a tune scores on its sample: the baseline, the variant and one uniform file per option (its
    donors), loaded once."""

    baseline: object
    variant: object
    donors: list
    files: list[Path]


@dataclass
class Sample:
    """The sample the gains are measured on: each domain's evaluation and windows, and the baseline on them."""

    parts: list[tuple[Evaluation, list, object]] = field(default_factory=list)  # (evaluation, windows, Baseline)
    window_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    base_nll: np.ndarray = field(default_factory=lambda: np.zeros(0))


def draw(models: Models, evaluations: list[Evaluation], windows: int | None, seed: int) -> Sample:
    """``windows`` windows of each domain's plan drawn by ``seed``, and the baseline's scores on them."""
    found = Sample()
    tokens, base = [], []
    for evaluation_ in evaluations:
        chosen = sample(evaluation_, windows, seed)
        scores, against = held_baseline(models.baseline, evaluation_, chosen, sample_feed(evaluation_))
        found.parts.append((evaluation_, chosen, against))
        tokens += [w.n_scored for w in chosen]
        base.append(scores.token_nll.double().numpy())
    found.window_tokens, found.base_nll = np.array(tokens), np.concatenate(base)
    return found


def score_sets(models: Models, drawn: Sample, sets: list[tuple[Swap, ...]], label: str) -> list[tuple[np.ndarray, np.ndarray]]:
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
        """The recipe as llama-quantize ``--tensor-type`` entries."""
        return [self.units[c.unit].entry(self.types[c.option]) for c in self.final.chosen]

    def expected_types(self, donors: list[Sizes]) -> dict[str, str]:
        """Each changed tensor's type as the uniform file of its option has it (llama.cpp's fallback for shapes a
        type cannot hold included): what the recipe's file must hold."""
        return {name: donors[c.option].types[name] for c in self.final.chosen for name in self.units[c.unit].tensors}


def measured(choices: tuple[Choice, ...], nll: np.ndarray, kl: np.ndarray, seen_kl: np.ndarray, drawn: Sample) -> Measured:
    share = recovered_share(seen_kl, kl, drawn.window_tokens, CONFIDENCE)
    return Measured(choices, float(kl.mean()), float((nll - drawn.base_nll).mean()), sum(c.cost for c in choices),
                    share, float(seen_kl.mean()) - sum(c.gain for c in choices))


def tune(models: Models, drawn: Sample, layers: list[Unit], types: list[str], extra: int, donor_sizes: list[Sizes],
         variant_sizes: Sizes, per: str) -> Tuning:
    """Measure every layer at every option alone (with ``per`` module: then the groups of the layers that win back
    most, in place of those layers), choose (``knapsack``), score the choice and refine it."""
    started = time.perf_counter()
    seen_nll, seen_kl = score_sets(models, drawn, [()], "the variant")[0]

    def alone(units: list[Unit], label: str) -> list[Choice]:
        pairs = [(u, o) for u in range(len(units)) for o in range(len(types))
                 if donor_sizes[o].matrix_bytes([units[u]]) > variant_sizes.matrix_bytes([units[u]])]
        scored = score_sets(models, drawn, [swaps_of(units, (Choice(u, o, 0, 0.0, (0, 0, 0)),)) for u, o in pairs], label)
        return [Choice(u, o, donor_sizes[o].matrix_bytes([units[u]]) - variant_sizes.matrix_bytes([units[u]]),
                       float(seen_kl.mean() - kl.mean()), recovered_share(seen_kl, kl, drawn.window_tokens, CONFIDENCE))
                for (u, o), (_, kl) in zip(pairs, scored)]

    units, choices = list(layers), alone(layers, "each layer alone")
    tried = 1 + len(choices)
    if per == "module":
        best_of = {u: max((c.gain for c in choices if c.unit == u), default=0.0) for u in range(len(units))}
        chosen = set(sorted(best_of, key=best_of.get, reverse=True)[: splits(len(layers))])
        kept = [u for u in range(len(units)) if u not in chosen]
        groups = [g for u in sorted(chosen) for g in split(units[u])]
        renumbered = {u: i for i, u in enumerate(kept)}
        units = [units[u] for u in kept] + groups
        grouped = alone(units[len(kept):], "the groups of the layers that win back most")
        tried += len(grouped)
        choices = [Choice(renumbered[c.unit], c.option, c.cost, c.gain, c.share) for c in choices if c.unit in renumbered]
        choices += [Choice(c.unit + len(kept), c.option, c.cost, c.gain, c.share) for c in grouped]
    first = knapsack(choices, extra)
    curve_sets = [knapsack(choices, int(extra * share)) for share in CURVE]
    scored = score_sets(models, drawn, [swaps_of(units, c) for c in [first, *curve_sets]], "the choice and the curve")
    found = [measured(c, nll, kl, seen_kl, drawn) for c, (nll, kl) in zip([first, *curve_sets], scored)]
    best, curve = found[0], found[1:]
    tried += len(found)
    for _ in range(ROUNDS):
        neighbours = [knapsack(choices, extra, excluded=frozenset({(c.unit, c.option)}))
                      for c in sorted(best.chosen, key=lambda c: c.gain)[:NEIGHBOURS]]
        neighbours = list(dict.fromkeys(n for n in neighbours if n and n != best.chosen))
        if not neighbours:
            break
        scored = score_sets(models, drawn, [swaps_of(units, n) for n in neighbours], "refining")
        tried += len(neighbours)
        better = min((measured(n, nll, kl, seen_kl, drawn) for n, (nll, kl) in zip(neighbours, scored)),
                     key=lambda m: m.kl)
        if better.kl >= best.kl:
            break
        best = better
    return Tuning(units, types, extra, float(seen_kl.mean()), float((seen_nll - drawn.base_nll).mean()), choices,
                  found[0], best, tried, [*curve, best], int(drawn.window_tokens.sum()), len(drawn.window_tokens),
                  time.perf_counter() - started)


def uniform_beside(built_bpw_file: float, own_type: str) -> str | None:
    """The first uniform file type at least as large (nominal bits per weight) as the recipe as built, other than
    the variant's own; None when none is."""
    return next((name for name, bits in UNIFORM if bits >= built_bpw_file and name != own_type.upper()), None)


def load_models(lineup: Lineup, checkpoint: Checkpoint, files: list[Path]) -> Models:
    """The baseline, the variant and each option's uniform file, loaded here (dequantized: the same weights
    llama.cpp runs), on one device in one dtype."""
    from tasks.models.resolve import Located
    from tasks.models.variants import load_variant

    baseline, _ = load_variant(lineup.baseline.spec, lineup.baseline.model)
    variant, _ = load_variant(checkpoint.spec, checkpoint.model)
    donors = [load_variant(checkpoint.spec.model_copy(update={"runtime": "transformers", "llama_cpp": None}),
                           Located.at(str(file), file.name))[0] for file in files]
    if len(decoder_layers(baseline)) != len(decoder_layers(variant)):
        raise InputError(f"{checkpoint.name} has not the baseline's decoder layers: it cannot be tuned against it")
    return Models(baseline, variant, donors, files)


def option_files(lineup: Lineup, checkpoint: Checkpoint, types: list[str]) -> list[Path]:
    """Each option's uniform file: the variant's file type with every decoder-layer matrix in that type (llama.cpp's
    quantizer, cached)."""
    from tasks.models import llama_cpp

    source = baseline_gguf(lineup.baseline.model)
    return [llama_cpp.made_file(source, checkpoint.spec.type, tensor_types=(f"^blk\\.\\d+\\..*\\.weight={t.lower()}",))
            for t in types]


@dataclass(frozen=True)
class Prepared:
    """A tune checked before anything loads: the variant's file, the baseline's, the units, the sizes a budget is
    read against and the bytes it allows beyond the variant."""

    variant: str
    budget: Budget
    per: str
    types: tuple[str, ...]
    variant_file: Path
    baseline_file: Path
    units: tuple[Unit, ...]
    span: Span
    extra: int


def alone(config: AuditConfig, variant: str) -> AuditConfig:
    """The audit ``config`` with its variant ``variant`` alone, refused in one line where tune cannot set its
    precision module by module."""
    from tasks.audit.diagnose import variant_spec

    spec = variant_spec(config, variant)
    check_tunable(config, variant)
    return config.model_copy(update={"variants": [spec]})


def check_types(types: list[str]) -> tuple[str, ...]:
    """The option types, each a GGUF tensor type llama-quantize's --tensor-type takes; one line naming them when not."""
    from gguf import GGMLQuantizationType

    known = {t.name for t in GGMLQuantizationType}
    wrong = [t for t in types if t.upper() not in known]
    if wrong or not types:
        raise InputError(f"--types {','.join(types)}: {', '.join(wrong) or 'none given'} is not a GGUF tensor type; "
                         f"give some of {', '.join(sorted(known))}")
    return tuple(t.upper() for t in types)


def prepare(lineup: Lineup, variant: str, budget: Budget, per: str, types: tuple[str, ...]) -> Prepared:
    """The tune of ``lineup``'s one variant, checked: its file made (cached), its units, and the budget read
    against it (below the variant's own size or above the baseline's: one line)."""
    [checkpoint] = lineup.variants
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    variant_file, baseline_file = Path(checkpoint.source), baseline_gguf(lineup.baseline.model)
    layers = 1 + max(int(name.split(".")[1]) for name in Sizes.of(variant_file).bytes if name.startswith("blk."))
    units = tuple(units_of(layers))
    span = span_of(variant_file, baseline_file, list(units))
    return Prepared(variant, budget, per, types, variant_file, baseline_file, units, span, span.extra_bytes(budget))


def report(tuning: Tuning, prepared: Prepared, file_type: str) -> dict:
    """The tune as plain data: what the console, ``--json``, the files and the MLflow run are written from."""
    span, units, types = prepared.span, tuning.units, tuning.types

    def point(found: Measured) -> dict:
        return {"kl": found.kl, "delta_nll": found.delta_nll, "predicted": found.predicted, "share": list(found.share),
                "cost": found.cost, "bpw": span.bpw(span.variant_bytes + found.cost),
                "units": [units[c.unit].label for c in found.chosen]}

    chosen = [{"unit": units[c.unit].label, "layer": units[c.unit].layer, "part": units[c.unit].part,
               "modules": list(units[c.unit].modules), "type": types[c.option], "gain": c.gain, "share": list(c.share),
               "cost": c.cost} for c in tuning.final.chosen]
    every = [{"unit": units[c.unit].label, "type": types[c.option], "gain": c.gain, "share": list(c.share),
              "cost": c.cost} for c in tuning.choices]
    return {"variant": prepared.variant, "file_type": file_type, "budget": str(prepared.budget), "per": prepared.per,
            "types": list(types), "budget_bpw": span.bpw(span.variant_bytes + prepared.extra),
            "extra_bytes": prepared.extra, "variant_bpw": span.bpw(span.variant_bytes),
            "baseline_bpw": span.bpw(span.baseline_bytes), "variant_kl": tuning.variant_kl,
            "variant_delta_nll": tuning.variant_delta_nll, "windows": tuning.windows, "tokens": tuning.tokens,
            "chosen": chosen, "every": every, "first": point(tuning.first), "final": point(tuning.final),
            "curve": [point(m) for m in tuning.curve], "tried": tuning.tried, "seconds": tuning.seconds,
            "tensor_types": tuning.tensor_types(), "group_size": 32}


def built(tuning: Tuning, prepared: Prepared, file_type: str, donor_sizes: list[Sizes]) -> tuple[Path, dict]:
    """The recipe made by llama.cpp's quantizer (cached), checked on the file: every tensor of a chosen unit in the
    type its option's uniform file gives it, every other as in the uniform variant, the whole within the budget."""
    from tasks.models import llama_cpp

    file = llama_cpp.made_file(prepared.baseline_file, file_type, tensor_types=tuple(tuning.tensor_types()))
    sizes, uniform = Sizes.of(file), Sizes.of(prepared.variant_file)
    expected = {name: uniform.types[name] for name in uniform.types} | tuning.expected_types(donor_sizes)
    wrong = sorted(name for name in expected if sizes.types.get(name) != expected[name])
    matrix = sizes.matrix_bytes(list(prepared.units))
    return file, {"file": file.name, "path": str(file), "bpw": prepared.span.bpw(matrix), "bytes": matrix,
                  "file_mib": sizes.total / MIB, "within": matrix <= prepared.span.variant_bytes + prepared.extra,
                  "checked": len(expected) - len(wrong), "tensors": len(expected), "wrong": wrong[:5]}


def uniform_above(prepared: Prepared, file_type: str, bpw: float) -> tuple[str, float] | None:
    """The smallest uniform file type (``UNIFORM``) whose decoder-layer matrices take at least ``bpw`` as
    llama.cpp's quantizer makes it from the baseline, and its bits per weight; None when none does."""
    from tasks.models import llama_cpp

    for name, nominal in UNIFORM:
        if nominal < bpw - 0.5 or name == file_type.upper():
            continue
        sizes = Sizes.of(llama_cpp.made_file(prepared.baseline_file, name))
        found = prepared.span.bpw(sizes.matrix_bytes(list(prepared.units)))
        if found >= bpw:
            return name, found
    return None


def audit_of(config: AuditConfig, variant: str, tensor_types: list[str], uniform: str | None) -> tuple[dict, dict]:
    """The audit of the recipe as a config (plain data, to be written as YAML): the uniform variant, the recipe,
    and the uniform variant of equal or larger size, with divergence on and the variant's gate for each; and the
    names it gives them (``tuned``, ``uniform``, ``larger``)."""
    spec = next(v for v in config.variants if v.name == variant)
    names = {"uniform": variant, "tuned": f"{variant}-tuned"}
    variants = [spec.model_dump(mode="json", exclude_defaults=True),
                spec.model_dump(mode="json", exclude_defaults=True) | {"name": names["tuned"], "tensor_types": tensor_types}]
    if uniform is not None:
        names["larger"] = f"{variant}-as-{uniform.lower()}"
        variants.append(spec.model_dump(mode="json", exclude_defaults=True) | {"name": names["larger"], "type": uniform})
    data = config.model_dump(mode="json", exclude_defaults=True)
    data |= {"name": f"{config.name}-tune", "variants": variants, "diagnose": False}
    data["evaluation"] = data.get("evaluation", {}) | {"divergence": "on"}
    gate = (data.get("thresholds") or {}).get("per_variant", {}).get(variant)
    if gate is not None:
        data["thresholds"]["per_variant"] = {name: gate for name in names.values()}
    data.pop("schedule", None)
    return data, names


def compared(tuned, other, tuned_bpw: float, other_bpw: float, label: str) -> tuple[bool, str]:
    """Whether the recipe's model is better than ``other`` beyond the paired intervals on the audit's tokens (its
    KL lower with the interval of the difference wholly below zero, its NLL not higher beyond noise), and the line
    that says so."""
    from tasks.engine.paired import cluster_mean

    a, b = tuned.result, other.result
    tokens = np.asarray(a.window_tokens)
    kl = recovered_share(np.asarray(b.extra["kl"], np.float64), np.asarray(a.extra["kl"], np.float64), tokens, CONFIDENCE)
    nll = cluster_mean(np.asarray(a.token_nll, np.float64) - np.asarray(b.token_nll, np.float64), tokens)
    better = kl[1] > 0 and not nll.low > 0
    mine, theirs = float(np.mean(a.extra["kl"])), float(np.mean(b.extra["kl"]))
    relative = (f"KL {-kl[0]:+.0f}% [{-kl[2]:+.0f}, {-kl[1]:+.0f}]" if theirs > 0 and kl[1] == kl[1]
                else f"KL {mine:.5f} against {theirs:.5f}")
    change = f"{relative}, ΔNLL {nll.value:+.5f} [{nll.low:+.5f}, {nll.high:+.5f}]"
    return better, (f"{'proven better' if better else 'not proven better'} than {label} "
                    f"({other_bpw:.3f} bpw) at {tuned_bpw - other_bpw:+.3f} bpw: {change}")


def measure(lineup: Lineup, evaluations: list[Evaluation], prepared: Prepared, windows: int | None,
            seed: int) -> tuple[Tuning, list[Sizes]]:
    """Load the models (each option's uniform file made first, cached), draw the sample from every domain and
    tune: the tuning, and each option's file's sizes (what the recipe's tensors must be, as built)."""
    import gc

    [checkpoint] = lineup.variants
    files = option_files(lineup, checkpoint, list(prepared.types))
    models = load_models(lineup, checkpoint, files)
    try:
        drawn = draw(models, evaluations, windows, seed)
        donor_sizes = [Sizes.of(file) for file in files]
        found = tune(models, drawn, list(prepared.units), list(prepared.types), prepared.extra, donor_sizes,
                     Sizes.of(prepared.variant_file), prepared.per)
    finally:
        del models
        gc.collect()
    return found, donor_sizes
