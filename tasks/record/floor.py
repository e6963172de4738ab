"""Whether a variant lost more than numerics alone: its KL and ΔPPL against the noise floor's (``tasks.audit.floor``).

The floor (the baseline in bfloat16 or float16) scored the same tokens as every variant, so the comparison is paired:
per token, the variant's KL less the floor's, its mean with a 95% interval over windows (``tasks.engine.paired``), and
the same of their NLL (ΔPPL). A variant is *above* a floor when the interval's low end is above zero: it lost more
than that numerics lose, beyond noise. It is *within* the floor otherwise: what it lost cannot be told from what
running the baseline in that dtype loses, and is reported so, not as a loss. Against several floors, a variant
within any of them is within (named: the floor it cannot be told from); above all, it is judged against the
highest.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tasks.config import FLOOR_SHORT as SHORT
from tasks.engine.paired import cluster_mean, token_slots
from tasks.record.figures import kl_text
from tasks.record.floor_said import AgainstFloor, FloorDifference, FloorJudgement
from tasks.record.results import VariantResult
from tasks.record.row import ModelRow


def _paired(variant: np.ndarray, floor: np.ndarray, windows: np.ndarray) -> FloorDifference:
    estimate = cluster_mean(np.asarray(variant, np.float64) - np.asarray(floor, np.float64), windows)
    return FloorDifference(float(estimate.value), float(estimate.low), float(estimate.high))


def against(variant: VariantResult, floor: VariantResult) -> AgainstFloor | None:
    """``variant`` against one ``floor`` on the tokens both scored: KL (where both have it) and NLL, paired; None where
    either was not scored."""
    if not (variant.ok and floor.ok):
        return None
    r, f = variant.result, floor.result
    slots = slice(None) if r.scored_windows is None else token_slots(f.window_tokens, r.scored_windows)
    if len(f.token_nll[slots]) != len(r.token_nll):
        return None
    nll = _paired(r.token_nll, f.token_nll[slots], r.window_tokens)
    if r.extra.kl is None or f.extra.kl is None:
        return AgainstFloor(floor.name, floor.facts.dtype, nll, nll.above, nll.above)
    kl = _paired(r.extra.kl, f.extra.kl[slots], r.window_tokens)
    return AgainstFloor(floor.name, floor.facts.dtype, nll, nll.above, kl.above,
                        float(np.asarray(f.extra.kl[slots], np.float64).mean()),  # the floor's own mean KL
                        float(np.asarray(r.extra.kl, np.float64).mean()), kl)


def judged(variant: VariantResult, floors: list[VariantResult], delta_ppl_pct: float | None = None
           ) -> FloorJudgement | None:
    """The row's ``floor``: the variant against every floor (``floors``), the one that decides (``dtype``, ``kld``,
    ``above``) and one line for the table and the report (``said``); None without a floor."""
    each = [found for floor in floors if (found := against(variant, floor)) is not None]
    if not each:
        return None
    within = [found for found in each if found.above is False]
    decides = within[0] if within else max(each, key=lambda found: found.kld if found.kl else found.nll.difference)
    return FloorJudgement(decides.dtype, decides.kld, decides.above, _said(decides, delta_ppl_pct), tuple(each))


def _said(found: AgainstFloor, delta_ppl_pct: float | None) -> str:
    name = SHORT.get(found.dtype, found.dtype)
    where = {True: "above", False: "within", None: "not judged against"}[found.above]
    if found.kl is not None:
        paired = found.kl
        text = f"KL {kl_text(found.kld_variant)}: {where} the {name} floor {kl_text(found.kld)}"
        text += (f" (+{kl_text(paired.difference)} [{kl_text(paired.low, '+')}, {kl_text(paired.high, '+')}])"
                 if found.above else "")
        if found.ppl_above is not None:  # the NLL, paired the same way: ΔPPL beyond the floor's, or not
            text += f", ΔPPL {'above' if found.ppl_above else 'within'} it"
        return text
    paired = found.nll
    shown = f"ΔPPL {delta_ppl_pct:+.2f}%: " if delta_ppl_pct is not None else ""
    return (f"{shown}{where} the {name} floor (ΔNLL against it {paired.difference:+.5f} "
            f"[{paired.low:+.5f}, {paired.high:+.5f}])")


def kept_as(floor: VariantResult) -> str:
    """How this audit has its floor: ``reused`` (kept with the baseline's reference), ``scored``, or ""."""
    said = floor.reference
    return said.baseline if said is not None and said.baseline else ""


def floor_row(row: ModelRow, dtype: str, kept: str) -> ModelRow:
    """A floor's comparison row, marked as the floor (``floor_of``: its dtype; ``kept``: scored or reused)."""
    return replace(row, floor_of=dtype, floor_kept=kept)


def floor_figures(row: ModelRow) -> str:
    """A floor row's KL and ΔPPL, short: ``KL 0.0009, ΔPPL -0.14%``."""
    if not row.ok:
        return "not measured"
    kl = f"KL {kl_text(row.divergences.kld_mean.value)}, " if row.divergences else ""
    return f"{kl}ΔPPL {row.delta_ppl_pct:+.2f}%" if row.change else kl.rstrip(", ")


def floor_text(row: ModelRow) -> str:
    """The table's line on a floor's row."""
    kept = f", {row.floor_kept}" if row.floor_kept else ""
    if not row.ok:
        return f"noise floor ({row.floor_of}) not measured: {row.reason}"
    return f"noise floor: the baseline in {row.floor_of} against its float32 self{kept}"
