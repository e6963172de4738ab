"""Compare variants with the baseline and judge each against its gate. Pure Python, no Prefect."""

from __future__ import annotations

import math
from dataclasses import replace

from typing import TYPE_CHECKING

from tasks.config import Gate, Thresholds
from tasks.engine.paired import MIN_WINDOWS, divergence_summary, paired_difference, token_slots
from tasks.record.figures import GATED, Gated, kl_text
from tasks.record.floor import floor_text
from tasks.record.reference_said import Divergence, Drift, LlamaCppRan, ReferenceSaid
from tasks.record.results import VariantResult
from tasks.record.row import BaselineSaid, Change, Divergences, Interval, OwnFigures, ModelRow, Spread
from tasks.record.sequential_said import SequentialSaid
from tasks.record.verdict_said import Verdict

if TYPE_CHECKING:
    from tasks.engine.perplexity import PerplexityResult

FRONT = "front of size against quality (bits per weight, ΔPPL and KLD)"


def comparison_row(outcome: VariantResult, baseline: VariantResult, window: int) -> ModelRow:
    """One row of the comparison table: the variant's figures and its change against the baseline (``window``: the
    audit's, which its key/value cache holds)."""
    if not outcome.ok:
        return ModelRow(outcome.name, outcome.method, outcome.status, outcome.reason)
    r, facts = outcome.result, outcome.facts
    method = facts.quantization.get("label", outcome.method)  # "gguf Q4_K_M", not a float model
    if facts.kv_cache:  # the cache it was scored with: "baseline kv:int8"
        method += f" kv:{facts.kv_cache.split()[0]}"
    ran = facts.quantization.get("llama_cpp")  # run by llama.cpp: the settings that ran, which move its figures
    saving = (100 * (1 - facts.kv_bytes_per_token / baseline.facts.kv_bytes_per_token)
              if baseline.ok and outcome is not baseline else None)
    measured = OwnFigures(r.ppl, r.ppl_stderr, r.mean_nll, r.bits_per_byte, r.n_tokens, r.tokens_per_second,
                        facts.weight_memory_bytes / 2**20, facts.bits_per_weight, facts.model_bits_per_weight,
                        facts.load_seconds, facts.backend, facts.kv_bytes_per_token,
                        facts.kv_bytes_per_token * window / 2**20, saving, facts.kv_cache or None,
                        llama_cpp_text(ran) if ran else None, r.scored_fraction)
    row = ModelRow(outcome.name, method, outcome.status, outcome.reason, measured)
    if outcome is baseline:
        return _baseline_row(row, outcome.reference or ReferenceSaid())
    if baseline.ok:
        row = _against(row, outcome, baseline.result)
    return row


def _baseline_row(row: ModelRow, said: ReferenceSaid) -> ModelRow:
    drift = Drift.of_record(said.drift) if said.drift else None
    return replace(row, reference=said.key, said=BaselineSaid(
        said.baseline, tuple(said.removed), ("environment drift" if drift.drift else "none") if drift else None,
        drift.reference if drift else None))


def _against(row: ModelRow, outcome: VariantResult, base: PerplexityResult) -> ModelRow:
    """``row`` with its change against the baseline's scores ``base``: paired over the same tokens where it scored
    them, with its divergence statistics where KL was measured, and a sequential run's figures at its stop."""
    r = outcome.result
    ratio = r.ppl / base.ppl
    flat = {"delta_ppl": r.ppl - base.ppl, "ppl_ratio": ratio, "delta_ppl_pct": 100 * (ratio - 1)}
    base_nll = base.token_nll if r.scored_windows is None else base.token_nll[
        token_slots(base.window_tokens, r.scored_windows)]
    said = outcome.divergence or Divergence()
    if len(base_nll) == len(r.token_nll):  # the same tokens: pair them
        flat |= paired_difference(base_nll, r.token_nll, r.window_tokens)
        row = replace(row, divergence_absent=said.absent)
        if r.extra.kl is not None:
            flat |= (divergence_summary(r.extra, base_nll, r.token_nll, r.window_tokens)
                     | {"divergence_mib": said.memory_bytes / 2**20})
            row = replace(row, reference=said.reference)
    row = replace(row, change=Change.of_flat(flat), divergences=Divergences.of_flat(flat))
    return _sequential_figures(row, outcome.sequential, base.ppl) if outcome.sequential else row


def _sequential_figures(row: ModelRow, said: SequentialSaid, base_ppl: float) -> ModelRow:
    """A sequential run's row: where it stopped early, the gated figures' bounds are their anytime-valid
    sequences' at the stop, and PPL is the baseline's (over every window) moved by the paired estimate of the
    change; a run that went to the end keeps its figures and intervals, judged as without ``sequential``."""
    if said.stopped != "settled":
        return replace(row, sequential=f"scored every window: not settled earlier (order seed {said.seed})")
    row = replace(row, sequential=f"stopped at {100 * said.scored_fraction:.0f}% of tokens: settled "
                                  f"(anytime-valid {100 * said.level:g}% bounds, order seed {said.seed})")
    change = row.change
    if change.paired:
        ppl = base_ppl * math.exp(change.delta_nll.value)
        row = replace(row, measured=replace(row.measured, ppl=ppl, ppl_stderr=ppl * change.delta_nll.stderr),
                      change=replace(change, delta_ppl=ppl - base_ppl,
                                     ppl_ratio=replace(change.ppl_ratio, value=ppl / base_ppl)))
    for key, (low, high) in said.bounds.items():
        row = row.with_figure(key, replace(row.figure(key), low=low, high=high))
    return row


def _check(row: ModelRow, figure: Gated, limit: float) -> tuple[str, str]:
    """One gate, on the pessimistic end of the figure's interval: 'fail' when the estimate is past the limit,
    'noise' when only that end is, 'unjudged' when the estimate or an end is not a finite number."""
    number, unit, measured = figure.said, figure.unit, row.figure(figure.key)
    value, low, high = measured.value, measured.low, measured.high
    interval = f"{number(value)}{unit} [{number(low)}, {number(high)}]"
    sign = "≤" if figure.above else "≥"
    if not all(math.isfinite(x) for x in (value, low, high)):
        windows = row.windows or 0
        why = (f"it rests on {windows} window(s), and an interval needs at least {MIN_WINDOWS}"
               if windows < MIN_WINDOWS else "it is not a finite number")
        return "unjudged", f"{figure.name} {interval} cannot be judged against {sign} {limit:g}: {why}"
    worst = high if figure.above else low
    past = (lambda x: x > limit) if figure.above else (lambda x: x < limit)
    if past(value):
        return "fail", f"{figure.name} {interval} breaks the limit {sign} {limit:g}"
    if past(worst):
        return "noise", f"{figure.name} {interval} is inside the noise of the limit {sign} {limit:g}"
    return "pass", f"{figure.name} {interval} {sign} {limit:g}"


def gate_checks(row: ModelRow, gate: Gate) -> list[tuple[str, str, str]]:
    """``(gate's name, status, reason)`` of each limit ``gate`` sets, on a row whose gated figures were measured
    (``judge_row``'s, and a chart's of one figure, which says which gate a verdict rests on); none where one was
    not (the verdict's reason says why)."""
    limited = [figure for figure in GATED if getattr(gate, figure.limit) is not None]
    if not all(gated_measured(row, figure) for figure in limited):
        return []
    return [(figure.name, *_check(row, figure, getattr(gate, figure.limit))) for figure in limited]


def gated_measured(row: ModelRow, figure: Gated) -> bool:
    """Whether a gated figure was measured: one against the baseline's logits is there or not with them; ΔPPL
    without its interval is not paired."""
    found = row.figure(figure.key)
    return found is not None and (figure.divergence or found.bounded)


def judge_row(row: ModelRow, thresholds: Thresholds) -> Verdict:
    """pass / fail against the variant's gate, on the pessimistic end of each 95% interval.

    A variant whose estimate is within a limit but whose interval reaches past it fails too ("inside
    the noise"): a release gate passes what is shown to be within the limit. ``error`` when the variant
    or the baseline could not be scored, a gated figure was not measured, or its estimate or interval is not
    a finite number (too few windows, a NaN), unless another gate fails it.
    """
    name = row.variant
    if not row.ok:
        return Verdict(name, "error", row.reason)
    if row.change is None:
        return Verdict(name, "error", "no baseline result to compare with")
    gate = thresholds.for_variant(name)
    unmeasured = [f for f in GATED if getattr(gate, f.limit) is not None and not gated_measured(row, f)]
    paired = [f.name for f in unmeasured if not f.divergence]
    if paired:
        return Verdict(name, "error", f"{paired[0]} has no interval: the variant did not score the baseline's tokens")
    if any(f.divergence for f in unmeasured):
        why = row.divergence_absent or "evaluation.divergence is off"
        return Verdict(name, "error", f"KL divergence was not measured: {why}")
    checks = [(status, reason) for _, status, reason in gate_checks(row, gate)]
    if not checks:  # nothing to judge against: a variant at +9000% must not read as passing
        return Verdict(name, "ungated", f"ΔPPL {row.delta_ppl_pct:+z.2f}%, judged against no limit (thresholds)")
    failed = [reason for status, reason in checks if status != "pass"]
    how = f"; {row.sequential}" if row.sequential else ""
    if any(status in ("fail", "noise") for status, _ in checks):
        return Verdict(name, "fail", "; ".join(failed) + how)
    if failed:
        return Verdict(name, "error", "; ".join(failed) + how)
    return Verdict(name, "pass", "; ".join(reason for _, reason in checks) + how)


def drift_text(drift: dict) -> str:
    """One line on a rescored baseline against its stored reference (``tasks.audit.reference.drift``)."""
    said = Drift.of_record(drift)
    changed = ", ".join(f"{k} {v}" for k, v in said.changed.items()) or "same versions and device"
    what = "environment drift" if said.drift else "no drift"
    return (f"{what}: the baseline's NLL moved by up to {said.max_abs_delta_nll:.3g} nats a token "
            f"(ΔPPL {said.delta_ppl_pct:+.4f}%) since reference {said.reference} ({changed})")


def overall(baseline_row: ModelRow, verdicts: list[Verdict], drift: dict | None = None, stopped: int = 0,
            front: list[str] | None = None) -> Verdict:
    """The audit's verdict: pass only when the baseline was scored and every variant passed. Environment
    drift of the baseline (``drift``) is said in the reason: the variants' verdicts still stand, as each
    was compared with the baseline in this environment, but the numbers differ from earlier audits'.
    ``stopped``: how many variants a sequential audit stopped early, said in a passing audit's reason (a failing
    variant's own reason says it). ``front``: the variants no other dominates (``tasks.record.dominance``), named
    last."""
    if not baseline_row.ok:
        return Verdict("audit", "error", f"baseline failed: {baseline_row.reason}")
    bad = [v for v in verdicts if v.status not in ("pass", "ungated")]
    ungated = [v.name for v in verdicts if v.status == "ungated"]
    if not bad and len(ungated) == len(verdicts):
        verdict = Verdict("audit", "ungated", "no variant has a limit in thresholds, so none was judged; set "
                                              "thresholds (max_ppl_increase_pct, ...) to gate them")
    elif not bad:
        early = f" ({stopped} stopped early, settled: sequential)" if stopped else ""
        unjudged = f"; no gate for {', '.join(ungated)}" if ungated else ""
        verdict = Verdict("audit", "pass", f"all {len(verdicts) - len(ungated)} gated variant(s) passed{early}{unjudged}"
                          if ungated else f"all {len(verdicts)} variant(s) passed{early}")
    else:
        status = "fail" if any(v.status == "fail" for v in bad) else "error"
        verdict = Verdict("audit", status, "; ".join(f"{v.name}: {v.reason}" for v in bad))
    if drift and Drift.of_record(drift).drift:
        verdict = Verdict("audit", verdict.status, f"{drift_text(drift)}; {verdict.reason}")
    if front:
        verdict = Verdict("audit", verdict.status, f"{verdict.reason}; {FRONT}: {', '.join(front)}")
    return verdict


def _baseline_said(row: ModelRow) -> str:
    said = row.said
    if said is None or not said.baseline:
        return "baseline"
    notes = [f"reference {row.reference}"] if row.reference else []
    notes += [f"damaged reference {line.split(':')[0]} removed" for line in said.removed_references]
    if said.drift:
        notes.append(f"{'ENVIRONMENT DRIFT' if said.drift != 'none' else 'no drift'} from {said.drift_from}")
    return f"baseline, {said.baseline}" + (f" ({'; '.join(notes)})" if notes else "")


def _said(row: ModelRow, verdict: Verdict | None) -> str:
    """A row's last column: its verdict and why, or how the baseline or a floor came, and what else is to know."""
    said = f"{verdict.said}: {verdict.reason}" if verdict else (_baseline_said(row) if row.ok else row.reason)
    if row.floor_of is not None:
        said = floor_text(row)
    if row.floor:
        said += f"; {row.floor.said}"
    if row.divergence_absent and "KL divergence was not measured" not in said:
        said += f"; no KLD: {row.divergence_absent}"  # a blank column says why
    if row.dominated_by:
        said += f"; dominated by {row.dominated_by}"
    if row.measured and row.measured.kv_cache:
        said += f"; {kv_cache_text(row.measured)}"
    if row.measured and row.measured.llama_cpp:
        said += f"; llama.cpp: {row.measured.llama_cpp}"
    return said


def _figure_cells(row: ModelRow) -> list[str]:
    """A scored row's figures as the table prints them, PPL to MiB."""
    m, change, d = row.measured, row.change, row.divergences
    delta = f"{change.delta_ppl_pct.value:+z.2f}" if change else ""
    if change and change.delta_ppl_pct.bounded:
        delta += f" [{change.delta_ppl_pct.low:+z.2f},{change.delta_ppl_pct.high:+z.2f}]"
    windows = change.windows if change else None
    return [f"{m.ppl:.4f}", f"{m.ppl_stderr:.4f}", delta, "" if windows is None else str(windows),
            kl_text(d.kld_mean.value) if d else "", f"{100 * d.top1_agreement.value:.1f}%" if d else "",
            f"{m.bits_per_byte:.4f}" if m.bits_per_byte is not None else "", f"{m.tokens_per_second:.0f}",
            f"{m.bits_per_weight:.2f}" if math.isfinite(m.bits_per_weight) else "", f"{m.weight_mib:.0f}"]


def format_table(rows: list[ModelRow], verdicts: dict[str, Verdict]) -> str:
    """A fixed-width comparison table for the terminal and the logs: each column at least its usual width and
    wider where a figure needs it, so that no two figures ever run together. ``win``: the windows the paired
    interval rests on."""
    columns = [("variant", "<16"), ("method", "<16"), ("PPL", ">12"), ("± err", ">10"), ("ΔPPL % [95% CI]", ">24"),
               ("win", ">6"), ("KLD", ">9"), ("top-1", ">8"), ("bits/B", ">8"), ("tok/s", ">8"), ("bpw", ">7"), ("MiB", ">7")]
    domains = any(row.domain is not None for row in rows)  # an audit of several corpora: each row its worst domain's
    if domains:
        columns.insert(2, ("domain", "<10"))
    body = []
    for row in rows:
        cells = [row.variant, row.method] + ([row.domain or ""] if domains else [])
        cells += [""] * (len(columns) - len(cells))
        first = len(cells) - 10  # where the figures start
        if row.ok:
            cells[first:] = _figure_cells(row)
        else:
            cells[first] = "—"
        body.append((cells, _said(row, verdicts.get(row.variant))))
    return fixed_width(columns, body, "verdict")


def llama_cpp_text(settings: dict) -> str:
    """What llama.cpp ran a model with (``tasks.models.llama_cpp.described``), in a line: ``flash attention on (asked:
    auto), K/V cache f16/f16, n_ctx 65, batch 65/65, 2 threads`` (a record from before what ran was kept: its
    settings as asked)."""
    ran = LlamaCppRan.of_record(settings)
    asked = f" (asked: {ran.flash_attn_asked})" if ran.flash_attn_asked is not None else ""
    said = [f"flash attention {ran.flash_attn}{asked}", f"K/V cache {ran.type_k}/{ran.type_v}"]
    if ran.n_ctx is not None:
        said += [f"n_ctx {ran.n_ctx}", f"batch {ran.n_batch}/{ran.n_ubatch}"]
    said.append(f"{ran.threads} threads")
    if ran.gpu_layers or ran.gpu_layers_asked:
        said.append(f"{ran.gpu_layers} layers on a GPU" + (f" ({ran.gpu_layers_asked} asked: this build cannot "
                                                           "offload)" if ran.gpu_layers_asked else ""))
    return ", ".join(said)


def kv_cache_text(m: OwnFigures) -> str:
    """What a variant's key/value cache costs: per token, and against the baseline's."""
    text = f"KV cache {m.kv_cache}: {m.kv_bytes_per_token:.0f} B/token, {m.kv_window_mib:.2f} MiB a window"
    saving = m.kv_saving_pct
    return text + (f", {saving:.0f}% less than the baseline's" if saving is not None and math.isfinite(saving) else "")


def fixed_width(columns: list[tuple[str, str]], body: list[tuple[list[str], str]], last: str) -> str:
    """A table whose ``columns`` (title, alignment and least width, e.g. ``">9"``) are each as wide as their widest
    cell and one more, and whose last column, ``last``, is free text."""
    widths = [max([int(spec[1:])] + [len(cells[i]) + 1 for cells, _ in body]) for i, (_, spec) in enumerate(columns)]

    def line(cells: list[str], said: str) -> str:
        return "".join(f"{cell:{spec[0]}{width}}" for cell, (_, spec), width in zip(cells, columns, widths)) + f"  {said}"

    header = line([name for name, _ in columns], last).rstrip()
    return "\n".join([header, "-" * len(header)] + [line(cells, said) for cells, said in body])


def _percentile_lines(spread: Spread, label: str, scale: float, unit: str) -> list[str]:
    def line(title: str, value: float) -> str:
        return f"{title:<8}{label}: {scale * value:{'z9.3f' if unit else 'z11.6f'}}{unit}"

    return ([line("Maximum", spread.max)]
            + [line("Median" if p == 50 else f"{p:.1f}%", value) for p, value in spread.percentiles]
            + [line("Minimum", spread.min)])


# llama-perplexity's ± are taken over tokens, as if independent; these are over windows (a window's tokens are not
# independent), so wider on the same tokens: said in the block, so that nobody sets the two side by side as one figure
STATS_ERRORS = "(± is a standard error over windows, not over tokens as llama-perplexity's: not the same figure)"


# mode llama.cpp: what differs from the exact mean KLD above it, said where the two stand together
LLAMA_KLD = "(base log-probs in 16 bits, those not above -16 left out: the figure a llama-perplexity table gives)"


def _pm(figure: Interval, scale: float = 1.0, width: int = 11, digits: int = 6) -> str:
    return f"{scale * figure.value:{width}.{digits}f} ± {scale * figure.stderr:{width - 2}.{digits}f}"


def _stats_block(row: ModelRow, base: ModelRow) -> str:
    m, b, change, d = row.measured, base.measured, row.change, row.divergences
    lines = [f"### {row.variant} against {base.variant} (reference {row.reference or '—'})",
             STATS_ERRORS,
             "====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {m.ppl:11.6f} ± {m.ppl_stderr:9.6f}",
             f"Mean PPL(base)                : {b.ppl:11.6f} ± {b.ppl_stderr:9.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * d.token_lnppl_correlation:6.2f}% "
             f"(per window: {100 * change.window_lnppl_correlation:.2f}%)",
             f"Mean ln(PPL(Q)/PPL(base))     : {_pm(change.delta_nll)}",
             f"Mean PPL(Q)/PPL(base)         : {_pm(change.ppl_ratio)}",
             f"Mean PPL(Q)-PPL(base)         : {change.delta_ppl:11.6f}",
             "",
             "====== KL divergence statistics ======",
             f"Mean    KLD: {_pm(d.kld_mean)}",
             *_percentile_lines(d.kld, "KLD", 1, ""),
             *([f"Mean    KLD as llama-perplexity estimates it: {_pm(d.kld_llama_mean)} {LLAMA_KLD}"]
               if d.kld_llama_mean is not None else []),
             f"Mean    KLD(Q‖base), reverse: {_pm(d.kld_reverse_mean)}",
             f"Maximum KLD(Q‖base), reverse: {d.kld_reverse.max:11.6f}",
             "",
             "====== Token probability statistics ======",
             f"Mean    Δp: {_pm(d.dp_mean, 100, 7, 3)} %",
             *_percentile_lines(d.dp, "Δp", 100, "%"),
             f"RMS Δp    : {_pm(d.dp_rms, 100, 7, 3)} %",
             f"Same top p: {_pm(d.top1_agreement, 100, 7, 3)} %"]
    shown = row.shown()
    if shown:  # ppl-audit's own figures, after llama-perplexity's: each with its error and interval over windows
        lines += ["", "====== Further figures (95% intervals over windows) ======"]
        lines += [f"{figure.name:<17}: {figure.text(found.value, found.low, found.high)} "
                  f"(± {figure.shown(found.stderr)}{figure.unit})" for figure, found in shown]
    return "\n".join(lines)


def format_stats(rows: list[ModelRow]) -> str:
    """llama-perplexity's statistics block for each variant with KL (``ppl-audit run --stats full``),
    in its wording, with KL(variant‖base) beside it. Errors are taken over windows (``tasks.engine.paired``)."""
    base, blocks = rows[0], []
    for row in rows[1:]:
        if row.divergences is not None:
            blocks.append(_stats_block(row, base))
        elif row.divergence_absent:
            blocks.append(f"### {row.variant} against {base.variant}: no KL divergence statistics: "
                          f"{row.divergence_absent}")
    return "\n\n".join(blocks)
