"""The noise floor of an audit (``evaluation.floor``): the baseline itself in the 16-bit numerics a deployment may run
it in, scored as a variant against its own float32 reference on the same windows.

What it measures is what numerics alone cost: a variant whose KL and ΔPPL are no larger than the floor's lost nothing
a bfloat16 deployment of the baseline would not lose too (``tasks.record.floor`` judges it). A floor is a function of
the baseline's reference (its model, tokens, settings, library versions and device kind) and of its dtype, so it is
kept in the reference's folder (``floors/DTYPE``) and reused as the reference is: a warm audit pays nothing for it. A
rescored reference is a new folder, without the old floors; a damaged floor is removed and scored again.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from tasks.audit.checkpoints import Checkpoint, Lineup
from tasks.audit.floor_kept_said import EXTRA, FloorScores, KeptFloor
from tasks.audit.reference import save_scores
from tasks.config import VariantSpec, floor_name
from tasks.core import sealed
from tasks.core.files import write_atomically
from tasks.data.evaluation import Evaluation
from tasks.engine.perplexity import PerplexityResult
from tasks.models.variants import VariantFacts
from tasks.record.reference_said import Divergence, ReferenceSaid
from tasks.record.results import VariantResult

FOLDER, ENTRY, SCORES = "floors", "floor.json", "scores.npz"
FLOOR_FORMAT = 1


def checkpoints(lineup: Lineup, dtypes: tuple[str, ...]) -> list[Checkpoint]:
    """The baseline as a variant in each of ``dtypes``: the same files, found once, loaded in another dtype."""
    lead = lineup.baseline
    fields = lead.spec.model_dump(exclude={"rescore", "name", "dtype", "method"}, exclude_unset=True)
    return [Checkpoint(VariantSpec(**fields, name=floor_name(dtype), method="baseline", dtype=dtype), "variant", lead.model,
                       lead.tokenizer, lead.manifest) for dtype in dtypes]


def not_measurable(baseline: VariantResult) -> str:
    """Why no floor can be measured against this baseline as it was scored ("" when one can): a floor is 16-bit
    numerics against a float32 (or float64) baseline, and ``dtype: auto`` is bfloat16 on CUDA."""
    dtype = baseline.facts.dtype.removeprefix("torch.")
    if dtype in ("float32", "float64"):
        return ""
    return (f"the baseline was scored in {dtype} (on {baseline.facts.device}), and a noise floor is 16-bit numerics "
            "against a float32 baseline: set baseline.dtype float32")


def whole(scored: Evaluation) -> Evaluation:
    """The evaluation a floor is scored on: every window (a sequential audit's watch would stop it, its gate unset)."""
    return replace(scored, settings=scored.settings.model_copy(update={"sequential": False}))


def _folder(baseline: VariantResult, name: str) -> Path | None:
    said = baseline.reference
    if not baseline.ok or said is None or not said.path or not Path(said.path).is_dir():
        return None
    return Path(said.path) / FOLDER / name


def stored_floor(baseline: VariantResult, name: str) -> VariantResult | None:
    """The floor ``name`` kept with the baseline's reference, checked (its entry's digest, its files' sizes and
    sha256); None when there is none. A damaged one is removed, and said, so that it is scored again."""
    folder = _folder(baseline, name)
    if folder is None or not (folder / ENTRY).is_file():
        return None
    try:
        raw = json.loads((folder / ENTRY).read_text())
        problem = sealed.damage(raw, f"noise floor {name}", {"format": FLOOR_FORMAT, "name": name,
                                                               "reference": baseline.reference.key})
        if problem is None:  # sealed as written: it holds every key
            entry = KeptFloor.of_json(raw)
            problem = sealed.files_damage(folder, entry.files, (SCORES,))
        if problem is None:
            return replace(_read(folder, entry), reference=ReferenceSaid("reused", baseline.reference.key,
                                                                         str(folder)))
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"it cannot be read ({type(error).__name__}: {error})"
    sealed.warn_remade(f"the noise floor {name} kept with reference {baseline.reference.key}", folder, problem,
                       "it is removed and scored again")
    shutil.rmtree(folder, ignore_errors=True)
    return None


def _read(folder: Path, entry: KeptFloor) -> VariantResult:
    scores = FloorScores.read(folder / SCORES)
    result = PerplexityResult(**entry.result, token_nll=scores.token_nll, window_nll=scores.window_nll,
                              window_tokens=scores.window_tokens, extra=scores.extra)
    return VariantResult(entry.name, entry.method, "ok", result=result, facts=VariantFacts(**entry.facts),
                         divergence=Divergence(**entry.divergence) if entry.divergence else None)


def store(baseline: VariantResult, outcome: VariantResult) -> str | None:
    """Keep the scored floor ``outcome`` with the baseline's reference; the problem that kept it from being kept (its
    figures stand: they are this audit's), None when it was."""
    folder = _folder(baseline, outcome.name)
    if folder is None or not outcome.ok or outcome.result.scored_fraction < 1:
        return None
    result = outcome.result
    staging = folder.with_name(f".{folder.name}.partial")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        save_scores(staging / SCORES, token_nll=result.token_nll, window_nll=result.window_nll,
                    window_tokens=result.window_tokens, **{f"{EXTRA}{k}": v for k, v in result.extra.items()})
        # as JSON gives it back (numpy scalars as numbers), so that the digest sealed is the digest read
        entry = sealed.seal(json.loads(json.dumps({
            "format": FLOOR_FORMAT, "name": outcome.name, "method": outcome.method, "reference": baseline.reference.key,
            "result": result.summary(), "facts": outcome.facts.summary(), "files": sealed.files_entry(staging, [SCORES]),
            "divergence": vars(outcome.divergence) if outcome.divergence else None}, default=float)))
        write_atomically(staging / ENTRY, json.dumps(entry))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        return f"could not keep the noise floor {outcome.name} with reference {baseline.reference.key}: {error}"
    return None
