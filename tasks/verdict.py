"""Compare variants with the baseline and judge each against its gate. Pure Python, no Prefect."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.results import VariantResult
from tasks.config import Thresholds
from tasks.paired import divergence_summary, paired_difference


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
        base = baseline.result if baseline.ok else None
        if base is not None and outcome is not baseline:
            row.update(delta_ppl=r.ppl - base.ppl, ppl_ratio=r.ppl / base.ppl, delta_ppl_pct=100 * (r.ppl / base.ppl - 1))
            if len(base.token_nll) == len(r.token_nll):  # the same tokens: pair them
                row.update(paired_difference(base.token_nll, r.token_nll, r.window_tokens))
                if "kl" in r.extra:
                    row.update(divergence_summary(r.extra, base.token_nll, r.token_nll, r.window_tokens))
                    row.update(divergence=outcome.divergence.get("method", ""),
                               divergence_mib=outcome.divergence.get("memory_bytes", 0) / 2**20)
    return row


def _check(what: str, point: float, worst: float, interval: str, limit: float, above: bool) -> tuple[str, str]:
    """One gate: 'fail' when the estimate is past the limit, 'noise' when only its pessimistic end is."""
    past = (lambda x: x > limit) if above else (lambda x: x < limit)
    sign = "≤" if above else "≥"
    if past(point):
        return "fail", f"{what} {interval} breaks the limit {sign} {limit:g}"
    if past(worst):
        return "noise", f"{what} {interval} is inside the noise of the limit {sign} {limit:g}"
    return "pass", f"{what} {interval} {sign} {limit:g}"


def judge(row: dict, thresholds: Thresholds) -> Verdict:
    """pass / fail against the variant's gate, on the pessimistic end of each 95% interval.

    A variant whose estimate is within a limit but whose interval reaches past it fails too ("inside
    the noise"): a release gate passes what is shown to be within the limit. ``error`` when the variant
    or the baseline could not be scored, or a gated figure was not measured.
    """
    name = row["variant"]
    if row["status"] != "ok":
        return Verdict(name, "error", row["reason"])
    if "delta_ppl_pct" not in row:
        return Verdict(name, "error", "no baseline result to compare with")
    gate = thresholds.for_variant(name)
    checks = []
    if gate.max_ppl_increase_pct is not None:
        if "delta_ppl_pct_high" not in row:
            return Verdict(name, "error", "ΔPPL has no interval: the variant did not score the baseline's tokens")
        interval = f"{row['delta_ppl_pct']:+.2f}% [{row['delta_ppl_pct_low']:+.2f}, {row['delta_ppl_pct_high']:+.2f}]"
        checks.append(_check("ΔPPL", row["delta_ppl_pct"], row["delta_ppl_pct_high"], interval,
                             gate.max_ppl_increase_pct, above=True))
    if gate.max_kld_mean is not None or gate.min_top1_agreement is not None:
        if "kld_mean" not in row:
            return Verdict(name, "error", "KL divergence was not measured (evaluation.divergence: off?)")
    if gate.max_kld_mean is not None:
        if row["kld_bound_mean"] > 0:  # a top-k cache: the KL is a lower bound, its worst case is far off
            return Verdict(name, "error", f"max_kld_mean needs exact KL, but this variant's came from the top-k cache "
                           f"(a lower bound, {row['kld_mean']:.4f}, worst-case error {row['kld_bound_mean']:.2f}); "
                           "set evaluation.divergence: lockstep")
        interval = f"{row['kld_mean']:.4f} [{row['kld_mean_low']:.4f}, {row['kld_mean_high']:.4f}]"
        checks.append(_check("KLD mean", row["kld_mean"], row["kld_mean_high"], interval, gate.max_kld_mean, above=True))
    if gate.min_top1_agreement is not None:
        interval = f"{row['top1_agreement']:.4f} [{row['top1_agreement_low']:.4f}, {row['top1_agreement_high']:.4f}]"
        checks.append(_check("top-1 agreement", row["top1_agreement"], row["top1_agreement_low"], interval,
                             gate.min_top1_agreement, above=False))
    if not checks:
        return Verdict(name, "pass", f"ΔPPL {row['delta_ppl_pct']:+.2f}% (no limit set)")
    failed = [reason for status, reason in checks if status != "pass"]
    if failed:
        return Verdict(name, "fail", "; ".join(failed))
    return Verdict(name, "pass", "; ".join(reason for _, reason in checks))


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
    """A fixed-width comparison table for the terminal and the logs."""
    columns = [("variant", "<16"), ("method", "<14"), ("PPL", ">12"), ("± err", ">10"), ("ΔPPL % [95% CI]", ">24"),
               ("KLD", ">9"), ("top-1", ">8"), ("bits/B", ">8"), ("tok/s", ">8"), ("MiB", ">7")]
    header = "".join(f"{name:{spec}}" for name, spec in columns) + "  verdict"
    lines = [header, "-" * len(header)]
    for row in rows:
        verdict = verdicts.get(row["variant"])
        said = f"{verdict.status}: {verdict.reason}" if verdict else ("baseline" if row["status"] == "ok" else row["reason"])
        cells = [row["variant"], row["method"]] + [""] * (len(columns) - 2)
        if row["status"] == "ok":
            delta = f"{row['delta_ppl_pct']:+.2f}" if "delta_ppl_pct" in row else ""
            if "delta_ppl_pct_low" in row:
                delta += f" [{row['delta_ppl_pct_low']:+.2f},{row['delta_ppl_pct_high']:+.2f}]"
            cells[2:] = [f"{row['ppl']:.4f}", f"{row['ppl_stderr']:.4f}", delta,
                         f"{row['kld_mean']:.4f}" if "kld_mean" in row else "",
                         f"{100 * row['top1_agreement']:.1f}%" if "top1_agreement" in row else "",
                         f"{row['bits_per_byte']:.4f}" if row["bits_per_byte"] is not None else "",
                         f"{row['tokens_per_second']:.0f}", f"{row['weight_mib']:.0f}"]
        else:
            cells[2] = "—"
        lines.append("".join(f"{cell:{spec}}" for cell, (_, spec) in zip(cells, columns)) + f"  {said}")
    return "\n".join(lines)
