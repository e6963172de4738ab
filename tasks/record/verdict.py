"""Compare variants with the baseline and judge each against its gate. Pure Python, no Prefect."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tasks.config import Gate, Thresholds
from tasks.engine.paired import MIN_WINDOWS, divergence_summary, paired_difference, token_slots
from tasks.record.figures import GATED, Gated
from tasks.record.floor import floor_text, kl_text
from tasks.record.reference_said import Divergence, ReferenceSaid
from tasks.record.results import VariantResult
from tasks.record.sequential_said import SequentialSaid


FRONT = "front of size against quality (bits per weight, ΔPPL and KLD)"


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # pass, fail, error, or ungated: no limit applied, so nothing was judged (never said as a pass)
    reason: str

    @property
    def said(self) -> str:
        return said(self.status)

    def as_record(self) -> dict[str, str]:
        """The verdict as a record holds it (its name is the key or the entry it is under)."""
        return {"status": self.status, "reason": self.reason}

    @classmethod
    def of_record(cls, name: str, said: dict) -> Verdict:
        return cls(name, said["status"], said["reason"])


def said(status: str) -> str:
    """A verdict's status as a person reads it (tables, badges, run names): ``no gate`` for ``ungated``."""
    return "no gate" if status == "ungated" else status


def comparison_row(outcome: VariantResult, baseline: VariantResult, window: int) -> dict:
    """One row of the comparison table: the variant's figures and its change against the baseline (``window``: the
    audit's, which its key/value cache holds)."""
    row = {"variant": outcome.name, "method": outcome.method, "status": outcome.status, "reason": outcome.reason}
    if outcome.ok:
        r, facts = outcome.result, outcome.facts
        row["method"] = facts.quantization.get("label", outcome.method)  # "gguf Q4_K_M", not a float model
        if facts.kv_cache:  # the cache it was scored with: "baseline kv:int8"
            row["method"] += f" kv:{facts.kv_cache.split()[0]}"
            row["kv_cache"] = facts.kv_cache
        if facts.quantization.get("llama_cpp"):  # run by llama.cpp: the settings that ran, which move its figures
            row["llama_cpp"] = llama_cpp_text(facts.quantization["llama_cpp"])
        row.update(kv_bytes_per_token=facts.kv_bytes_per_token, kv_window_mib=facts.kv_bytes_per_token * window / 2**20)
        if baseline.ok and outcome is not baseline:
            row["kv_saving_pct"] = 100 * (1 - facts.kv_bytes_per_token / baseline.facts.kv_bytes_per_token)
        row.update(ppl=r.ppl, ppl_stderr=r.ppl_stderr, mean_nll=r.mean_nll, bits_per_byte=r.bits_per_byte,
                   n_tokens=r.n_tokens, tokens_per_second=r.tokens_per_second,
                   weight_mib=facts.weight_memory_bytes / 2**20, bits_per_weight=facts.bits_per_weight,
                   model_bits_per_weight=facts.model_bits_per_weight, load_seconds=facts.load_seconds,
                   backend=facts.backend)
        if outcome is baseline:
            said = outcome.reference or ReferenceSaid()
            row.update(baseline=said.baseline, reference=said.key)
            if said.removed:
                row["removed_references"] = list(said.removed)
            if said.drift:
                row.update(drift="environment drift" if said.drift["drift"] else "none",
                           drift_from=said.drift["reference"])
        row["scored_fraction"] = r.scored_fraction
        base = baseline.result if baseline.ok else None
        if base is not None and outcome is not baseline:
            row.update(delta_ppl=r.ppl - base.ppl, ppl_ratio=r.ppl / base.ppl, delta_ppl_pct=100 * (r.ppl / base.ppl - 1))
            base_nll = base.token_nll if r.scored_windows is None else base.token_nll[
                token_slots(base.window_tokens, r.scored_windows)]
            if len(base_nll) == len(r.token_nll):  # the same tokens: pair them
                row.update(paired_difference(base_nll, r.token_nll, r.window_tokens))
                divergence = outcome.divergence or Divergence()
                if divergence.absent is not None:
                    row["divergence_absent"] = divergence.absent
                if "kl" in r.extra:
                    row.update(divergence_summary(r.extra, base_nll, r.token_nll, r.window_tokens))
                    row.update(reference=divergence.reference, divergence_mib=divergence.memory_bytes / 2**20)
            if outcome.sequential:
                row.update(_sequential_figures(row, outcome.sequential, base.ppl))
    return row


def _sequential_figures(row: dict, said: SequentialSaid, base_ppl: float) -> dict:
    """A sequential run's row: where it stopped early, the gated figures' bounds are their anytime-valid
    sequences' at the stop, and PPL is the baseline's (over every window) moved by the paired estimate of the
    change; a run that went to the end keeps its figures and intervals, judged as without ``sequential``."""
    if said.stopped != "settled":
        return {"sequential": f"scored every window: not settled earlier (order seed {said.seed})"}
    figures = {"sequential": f"stopped at {100 * said.scored_fraction:.0f}% of tokens: settled "
                             f"(anytime-valid {100 * said.level:g}% bounds, order seed {said.seed})"}
    if "delta_nll" in row:
        ppl = base_ppl * math.exp(row["delta_nll"])
        figures |= {"ppl": ppl, "ppl_stderr": ppl * row["delta_nll_stderr"], "delta_ppl": ppl - base_ppl,
                    "ppl_ratio": ppl / base_ppl}
    for key, (low, high) in said.bounds.items():
        figures |= {f"{key}_low": low, f"{key}_high": high}
    return figures


def _check(row: dict, figure: Gated, limit: float) -> tuple[str, str]:
    """One gate, on the pessimistic end of the figure's interval: 'fail' when the estimate is past the limit,
    'noise' when only that end is, 'unjudged' when the estimate or an end is not a finite number."""
    key, number, unit = figure.key, figure.said, figure.unit
    value, low, high = row[key], row[f"{key}_low"], row[f"{key}_high"]
    interval = f"{number(value)}{unit} [{number(low)}, {number(high)}]"
    sign = "≤" if figure.above else "≥"
    if not all(math.isfinite(x) for x in (value, low, high)):
        windows = row.get("windows", 0)
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


def gate_checks(row: dict, gate: Gate) -> list[tuple[str, str, str]]:
    """``(gate's name, status, reason)`` of each limit ``gate`` sets, on a row whose gated figures were measured
    (``judge_row``'s, and a chart's of one figure, which says which gate a verdict rests on)."""
    return [(figure.name, *_check(row, figure, getattr(gate, figure.limit)))
            for figure in GATED if getattr(gate, figure.limit) is not None]


def judge_row(row: dict, thresholds: Thresholds) -> Verdict:
    """pass / fail against the variant's gate, on the pessimistic end of each 95% interval.

    A variant whose estimate is within a limit but whose interval reaches past it fails too ("inside
    the noise"): a release gate passes what is shown to be within the limit. ``error`` when the variant
    or the baseline could not be scored, a gated figure was not measured, or its estimate or interval is not
    a finite number (too few windows, a NaN), unless another gate fails it.
    """
    name = row["variant"]
    if row["status"] != "ok":
        return Verdict(name, "error", row["reason"])
    if "delta_ppl_pct" not in row:
        return Verdict(name, "error", "no baseline result to compare with")
    gate = thresholds.for_variant(name)
    # a figure measured against the baseline's logits is there or not with them; ΔPPL without its interval is not paired
    unmeasured = [f for f in GATED if getattr(gate, f.limit) is not None
                  and (f.key if f.divergence else f"{f.key}_high") not in row]
    paired = [f.name for f in unmeasured if not f.divergence]
    if paired:
        return Verdict(name, "error", f"{paired[0]} has no interval: the variant did not score the baseline's tokens")
    if any(f.divergence for f in unmeasured):
        why = row.get("divergence_absent") or "evaluation.divergence is off"
        return Verdict(name, "error", f"KL divergence was not measured: {why}")
    checks = [(status, reason) for _, status, reason in gate_checks(row, gate)]
    if not checks:  # nothing to judge against: a variant at +9000% must not read as passing
        return Verdict(name, "ungated", f"ΔPPL {row['delta_ppl_pct']:+z.2f}%, judged against no limit (thresholds)")
    failed = [reason for status, reason in checks if status != "pass"]
    how = f"; {row['sequential']}" if row.get("sequential") else ""
    if any(status in ("fail", "noise") for status, _ in checks):
        return Verdict(name, "fail", "; ".join(failed) + how)
    if failed:
        return Verdict(name, "error", "; ".join(failed) + how)
    return Verdict(name, "pass", "; ".join(reason for _, reason in checks) + how)


def drift_text(drift: dict) -> str:
    """One line on a rescored baseline against its stored reference (``tasks.audit.reference.drift``)."""
    changed = ", ".join(f"{k} {v}" for k, v in drift["changed"].items()) or "same versions and device"
    what = "environment drift" if drift["drift"] else "no drift"
    return (f"{what}: the baseline's NLL moved by up to {drift['max_abs_delta_nll']:.3g} nats a token "
            f"(ΔPPL {drift['delta_ppl_pct']:+.4f}%) since reference {drift['reference']} ({changed})")


def overall(baseline_row: dict, verdicts: list[Verdict], drift: dict | None = None, stopped: int = 0,
            front: list[str] | None = None) -> Verdict:
    """The audit's verdict: pass only when the baseline was scored and every variant passed. Environment
    drift of the baseline (``drift``) is said in the reason: the variants' verdicts still stand, as each
    was compared with the baseline in this environment, but the numbers differ from earlier audits'.
    ``stopped``: how many variants a sequential audit stopped early, said in a passing audit's reason (a failing
    variant's own reason says it). ``front``: the variants no other dominates (``tasks.record.dominance``), named
    last."""
    if baseline_row["status"] != "ok":
        return Verdict("audit", "error", f"baseline failed: {baseline_row['reason']}")
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
    if drift and drift["drift"]:
        verdict = Verdict("audit", verdict.status, f"{drift_text(drift)}; {verdict.reason}")
    if front:
        verdict = Verdict("audit", verdict.status, f"{verdict.reason}; {FRONT}: {', '.join(front)}")
    return verdict


def _baseline_said(row: dict) -> str:
    if not row.get("baseline"):
        return "baseline"
    notes = [f"reference {row['reference']}"] if row.get("reference") else []
    notes += [f"damaged reference {line.split(':')[0]} removed" for line in row.get("removed_references", [])]
    if row.get("drift"):
        notes.append(f"{'ENVIRONMENT DRIFT' if row['drift'] != 'none' else 'no drift'} from {row['drift_from']}")
    return f"baseline, {row['baseline']}" + (f" ({'; '.join(notes)})" if notes else "")


def format_table(rows: list[dict], verdicts: dict[str, Verdict]) -> str:
    """A fixed-width comparison table for the terminal and the logs: each column at least its usual width and
    wider where a figure needs it, so that no two figures ever run together. ``win``: the windows the paired
    interval rests on."""
    columns = [("variant", "<16"), ("method", "<16"), ("PPL", ">12"), ("± err", ">10"), ("ΔPPL % [95% CI]", ">24"),
               ("win", ">6"), ("KLD", ">9"), ("top-1", ">8"), ("bits/B", ">8"), ("tok/s", ">8"), ("bpw", ">7"), ("MiB", ">7")]
    domains = any("domain" in row for row in rows)  # an audit of several corpora: each row its worst domain's
    if domains:
        columns.insert(2, ("domain", "<10"))
    body = []
    for row in rows:
        verdict = verdicts.get(row["variant"])
        said = f"{verdict.said}: {verdict.reason}" if verdict else (_baseline_said(row) if row["status"] == "ok" else row["reason"])
        if "floor_of" in row:
            said = floor_text(row)
        if row.get("floor"):
            said += f"; {row['floor']['said']}"
        if row.get("divergence_absent") and "KL divergence was not measured" not in said:
            said += f"; no KLD: {row['divergence_absent']}"  # a blank column says why
        if row.get("dominated_by"):
            said += f"; dominated by {row['dominated_by']}"
        if row.get("kv_cache"):
            said += f"; {kv_cache_text(row)}"
        if row.get("llama_cpp"):
            said += f"; llama.cpp: {row['llama_cpp']}"
        cells = [row["variant"], row["method"]] + ([row.get("domain", "")] if domains else [])
        cells += [""] * (len(columns) - len(cells))
        first = len(cells) - 10  # where the figures start
        if row["status"] == "ok":
            delta = f"{row['delta_ppl_pct']:+z.2f}" if "delta_ppl_pct" in row else ""
            if "delta_ppl_pct_low" in row:
                delta += f" [{row['delta_ppl_pct_low']:+z.2f},{row['delta_ppl_pct_high']:+z.2f}]"
            cells[first:] = [f"{row['ppl']:.4f}", f"{row['ppl_stderr']:.4f}", delta, str(row.get("windows", "")),
                         kl_text(row["kld_mean"]) if "kld_mean" in row else "",
                         f"{100 * row['top1_agreement']:.1f}%" if "top1_agreement" in row else "",
                         f"{row['bits_per_byte']:.4f}" if row["bits_per_byte"] is not None else "",
                         f"{row['tokens_per_second']:.0f}",
                         f"{row['bits_per_weight']:.2f}" if math.isfinite(row.get("bits_per_weight", math.nan)) else "",
                         f"{row['weight_mib']:.0f}"]
        else:
            cells[first] = "—"
        body.append((cells, said))
    return fixed_width(columns, body, "verdict")


def llama_cpp_text(settings: dict) -> str:
    """What llama.cpp ran a model with (``tasks.models.llama_cpp.described``), in a line: ``flash attention on (asked:
    auto), K/V cache f16/f16, n_ctx 65, batch 65/65, 2 threads`` (a record from before what ran was kept: its
    settings as asked)."""
    asked = f" (asked: {settings['flash_attn_asked']})" if "flash_attn_asked" in settings else ""
    said = [f"flash attention {settings['flash_attn']}{asked}", f"K/V cache {settings['type_k']}/{settings['type_v']}"]
    if "n_ctx" in settings:
        said += [f"n_ctx {settings['n_ctx']}", f"batch {settings['n_batch']}/{settings['n_ubatch']}"]
    said.append(f"{settings['threads']} threads")
    if settings.get("gpu_layers") or settings.get("gpu_layers_asked"):
        said.append(f"{settings['gpu_layers']} layers on a GPU" + (f" ({settings['gpu_layers_asked']} asked: this "
                                                                 "build cannot offload)" if settings.get(
                                                                     "gpu_layers_asked") else ""))
    return ", ".join(said)


def kv_cache_text(row: dict) -> str:
    """What a variant's key/value cache costs: per token, and against the baseline's."""
    text = f"KV cache {row['kv_cache']}: {row['kv_bytes_per_token']:.0f} B/token, {row['kv_window_mib']:.2f} MiB a window"
    return text + (f", {row['kv_saving_pct']:.0f}% less than the baseline's" if math.isfinite(row.get("kv_saving_pct",
                                                                                                    math.nan)) else "")


def fixed_width(columns: list[tuple[str, str]], body: list[tuple[list[str], str]], last: str) -> str:
    """A table whose ``columns`` (title, alignment and least width, e.g. ``">9"``) are each as wide as their widest
    cell and one more, and whose last column, ``last``, is free text."""
    widths = [max([int(spec[1:])] + [len(cells[i]) + 1 for cells, _ in body]) for i, (_, spec) in enumerate(columns)]

    def line(cells: list[str], said: str) -> str:
        return "".join(f"{cell:{spec[0]}{width}}" for cell, (_, spec), width in zip(cells, columns, widths)) + f"  {said}"

    header = line([name for name, _ in columns], last).rstrip()
    return "\n".join([header, "-" * len(header)] + [line(cells, said) for cells, said in body])


def _percentile_lines(row: dict, name: str, label: str, percentiles: tuple[float, ...], scale: float, unit: str) -> list[str]:
    def line(title: str, key: str) -> str:
        return f"{title:<8}{label}: {scale * row[key]:{'z9.3f' if unit else 'z11.6f'}}{unit}"

    return ([line("Maximum", f"{name}_max")]
            + [line("Median" if p == 50 else f"{p:.1f}%", f"{name}_p{p:g}") for p in percentiles]
            + [line("Minimum", f"{name}_min")])


# llama-perplexity's ± are taken over tokens, as if independent; these are over windows (a window's tokens are not
# independent), so wider on the same tokens: said in the block, so that nobody sets the two side by side as one figure
STATS_ERRORS = "(± is a standard error over windows, not over tokens as llama-perplexity's: not the same figure)"


# mode llama.cpp: what differs from the exact mean KLD above it, said where the two stand together
LLAMA_KLD = "(base log-probs in 16 bits, those not above -16 left out: the figure a llama-perplexity table gives)"


def format_stats(rows: list[dict]) -> str:
    """llama-perplexity's statistics block for each variant with KL (``ppl-audit run --stats full``),
    in its wording, with KL(variant‖base) beside it. Errors are taken over windows (``tasks.engine.paired``)."""
    from tasks.engine.paired import DP_PERCENTILES, KLD_PERCENTILES

    base, blocks = rows[0], []
    for row in rows[1:]:
        if "kld_mean" not in row:
            if row.get("divergence_absent"):
                blocks.append(f"### {row['variant']} against {base['variant']}: no KL divergence statistics: "
                              f"{row['divergence_absent']}")
            continue
        def pm(key: str, scale: float = 1.0, width: int = 11, digits: int = 6, row=row) -> str:
            return f"{scale * row[key]:{width}.{digits}f} ± {scale * row[key + '_stderr']:{width - 2}.{digits}f}"

        lines = [f"### {row['variant']} against {base['variant']} (reference {row.get('reference') or '—'})",
                 STATS_ERRORS,
                 "====== Perplexity statistics ======",
                 f"Mean PPL(Q)                   : {row['ppl']:11.6f} ± {row['ppl_stderr']:9.6f}",
                 f"Mean PPL(base)                : {base['ppl']:11.6f} ± {base['ppl_stderr']:9.6f}",
                 f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * row['token_lnppl_correlation']:6.2f}% "
                 f"(per window: {100 * row['window_lnppl_correlation']:.2f}%)",
                 f"Mean ln(PPL(Q)/PPL(base))     : {pm('delta_nll')}",
                 f"Mean PPL(Q)/PPL(base)         : {pm('ppl_ratio')}",
                 f"Mean PPL(Q)-PPL(base)         : {row['delta_ppl']:11.6f}",
                 "",
                 "====== KL divergence statistics ======",
                 f"Mean    KLD: {pm('kld_mean')}",
                 *_percentile_lines(row, "kld", "KLD", KLD_PERCENTILES, 1, ""),
                 *([f"Mean    KLD as llama-perplexity estimates it: {pm('kld_llama_mean')} {LLAMA_KLD}"]
                   if "kld_llama_mean" in row else []),
                 f"Mean    KLD(Q‖base), reverse: {pm('kld_reverse_mean')}",
                 f"Maximum KLD(Q‖base), reverse: {row['kld_reverse_max']:11.6f}",
                 "",
                 "====== Token probability statistics ======",
                 f"Mean    Δp: {pm('dp_mean', 100, 7, 3)} %",
                 *_percentile_lines(row, "dp", "Δp", DP_PERCENTILES, 100, "%"),
                 f"RMS Δp    : {pm('dp_rms', 100, 7, 3)} %",
                 f"Same top p: {pm('top1_agreement', 100, 7, 3)} %"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
