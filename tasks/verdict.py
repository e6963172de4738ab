"""Compare variants with the baseline and judge each against its gate. Pure Python, no Prefect."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.audit import VariantResult
from tasks.config import Thresholds


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # pass, fail or error
    reason: str


def comparison_row(outcome: VariantResult, baseline: VariantResult) -> dict:
    """One row of the comparison table: the variant's figures and its change against the baseline."""
    row = {"variant": outcome.name, "method": outcome.method, "status": outcome.status, "reason": outcome.reason}
    if outcome.ok:
        r, facts = outcome.result, outcome.facts
        row.update(ppl=r.ppl, ppl_stderr=r.ppl_stderr, mean_nll=r.mean_nll, bits_per_byte=r.bits_per_byte,
                   n_tokens=r.n_tokens, tokens_per_second=r.tokens_per_second,
                   weight_mib=facts.weight_memory_bytes / 2**20, load_seconds=facts.load_seconds,
                   backend=facts.backend)
        if baseline.ok and outcome is not baseline:
            b = baseline.result.ppl
            row.update(delta_ppl=r.ppl - b, ppl_ratio=r.ppl / b, delta_ppl_pct=100 * (r.ppl / b - 1))
    return row


def judge(row: dict, thresholds: Thresholds) -> Verdict:
    """pass / fail against the variant's gate; error when it or the baseline could not be scored."""
    name = row["variant"]
    if row["status"] != "ok":
        return Verdict(name, "error", row["reason"])
    if "delta_ppl_pct" not in row:
        return Verdict(name, "error", "no baseline result to compare with")
    gate = thresholds.for_variant(name)
    change = row["delta_ppl_pct"]
    if gate.max_ppl_increase_pct is not None and change > gate.max_ppl_increase_pct:
        return Verdict(name, "fail", f"PPL {change:+.2f}% exceeds the limit of +{gate.max_ppl_increase_pct:g}%")
    limit = f" (limit +{gate.max_ppl_increase_pct:g}%)" if gate.max_ppl_increase_pct is not None else ""
    return Verdict(name, "pass", f"PPL {change:+.2f}%{limit}")


def overall(baseline_row: dict, verdicts: list[Verdict]) -> Verdict:
    """The audit's verdict: pass only when the baseline was scored and every variant passed."""
    if baseline_row["status"] != "ok":
        return Verdict("audit", "error", f"baseline failed: {baseline_row['reason']}")
    bad = [v for v in verdicts if v.status != "pass"]
    if not bad:
        return Verdict("audit", "pass", f"all {len(verdicts)} variant(s) passed")
    status = "fail" if any(v.status == "fail" for v in bad) else "error"
    return Verdict("audit", status, "; ".join(f"{v.name}: {v.reason}" for v in bad))


def format_table(rows: list[dict], verdicts: dict[str, Verdict]) -> str:
    """A fixed-width comparison table for the terminal (and Markdown-friendly enough for logs)."""
    header = f"{'variant':<16}{'method':<14}{'PPL':>12}{'± err':>10}{'ΔPPL %':>9}{'bits/B':>8}{'tok/s':>8}{'MiB':>7}  verdict"
    lines = [header, "-" * len(header)]
    for row in rows:
        verdict = verdicts.get(row["variant"])
        said = f"{verdict.status}: {verdict.reason}" if verdict else ("baseline" if row["status"] == "ok" else row["reason"])
        if row["status"] != "ok":
            lines.append(f"{row['variant']:<16}{row['method']:<14}{'—':>12}{'':>10}{'':>9}{'':>8}{'':>8}{'':>7}  {said}")
            continue
        delta = f"{row['delta_ppl_pct']:+.2f}" if "delta_ppl_pct" in row else ""
        lines.append(f"{row['variant']:<16}{row['method']:<14}{row['ppl']:>12.4f}{row['ppl_stderr']:>10.4f}{delta:>9}"
                     f"{row['bits_per_byte']:>8.4f}{row['tokens_per_second']:>8.0f}{row['weight_mib']:>7.0f}  {said}")
    return "\n".join(lines)
