"""An audit's report: one self-contained HTML file that MLflow's artifact viewer shows inline and that a reviewer
can download and mail.

The verdict, the comparison table, the charts, where in the text each variant loses, the settings and the lineage
of every model, in that order. An audit of several domains has a summary first (each model on its worst domain, the
domains' verdicts, ΔPPL by domain), then a section per domain as its one-corpus audit's report shows it (table, charts,
where it loses, settings and gate), then the lineage once. The file stands alone: CSS inline, charts as base64 PNG, no script and no outside
address. Every text from the record is escaped, so a path or a reason cannot inject markup.
"""

from __future__ import annotations

import base64
from datetime import datetime
from html import escape

from tasks.record import plots
from tasks.record.entry_said import CompressedFormat, GgufFormat, HqqFormat, Lineage, ModelSaid, RecordSaid, WhereSaid
from tasks.record.figures import GATED, SHOWN, kl_text
from tasks.record.floor import floor_text
from tasks.record.population import population_line
from tasks.record.row import Interval, ModelRow
from tasks.record.verdict_said import said as said_as

STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #212121; margin: 24px;
        max-width: 1280px; }
h1 { font-size: 26px; margin: 0 0 6px; }
h2 { font-size: 19px; margin: 30px 0 8px; border-bottom: 1px solid #e0e0e0; padding-bottom: 4px; }
table { border-collapse: collapse; margin: 6px 0 12px; }
th, td { border: 1px solid #e0e0e0; padding: 5px 10px; text-align: left; vertical-align: top; }
th, td.n { white-space: nowrap; }
.long { overflow-wrap: anywhere; }  /* paths and digests have no spaces to break at */
th { background: #f5f5f5; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font: 13px ui-monospace, Menlo, Consolas, monospace; }
pre { background: #f5f5f5; padding: 10px; overflow-x: auto; }
.badge { display: inline-block; color: #fff; border-radius: 4px; padding: 1px 9px; font-weight: 600; }
.reason { color: #424242; background: #fafafa; font-size: 13px; overflow-wrap: anywhere; padding-left: 24px; }
.lead { font-size: 17px; margin: 4px 0; }
.meta { color: #616161; }
.wide { overflow-x: auto; }  /* a narrow viewer scrolls a table rather than cut it */
.side { display: flex; flex-wrap: wrap; gap: 0 40px; align-items: flex-start; }
img { max-width: 100%; height: auto; border: 1px solid #eeeeee; margin: 6px 0 14px; }
""" + "".join(f".{verdict} {{ background: {colour}; }}\n" for verdict, colour in plots.COLOURS.items())


def html_report(record: dict, pictures: dict[str, bytes], diagnoses: dict[str, str] | None = None) -> str:
    """The audit's report as one HTML document.

    Args:
        record: the audit's record (``tasks.record.contents.audit_record``).
        pictures: its charts as PNG (``tasks.record.plots.pictures``), drawn once for the report and the run.
        diagnoses: by variant, the address of its diagnosis's run in the MLflow UI, from the UI's root.
    Returns the HTML text.
    """
    said = plots.said_of(record)
    title = f"ppl-audit {said.result.name}: {said.result.verdict.said.upper()}"
    if said.domains:  # a summary over the domains, then each domain's section
        summary = {name: picture for name, picture in pictures.items() if "/" not in name}  # a domain's: DOMAIN/
        body = [_verdict(said), _comparison(said) + _further(said), _domains(said), _charts(summary),
                _diagnoses(said, diagnoses or {}), *(_domain(name, view, pictures) for name, view in said.domains.items()),
                _lineage(said)]
    else:
        body = [_verdict(said), _comparison(said) + _further(said), _diagnoses(said, diagnoses or {}),
                _charts(pictures),
                _where(said), _settings(said), _lineage(said)]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _verdict(said: RecordSaid) -> str:
    """The title: the audit's name, its verdict as a coloured badge, the reason and when it ran."""
    verdict = said.result.verdict
    started, ended = said.started, said.created
    when = f"{_time(started)} – {_time(ended)} ({_duration(started, ended)})" if started else f"ended {_time(ended)}"
    return (f"<h1>Audit {escape(said.result.name)} {_badge(verdict.status)}</h1>"
            f"<p class=\"lead\">{escape(verdict.reason)}</p>"
            f"<p class=\"meta\">{escape(when)} · audit id <code>{escape(said.audit_id)}</code></p>")


def _comparison(said: RecordSaid) -> str:
    """A row per model: its verdict (first, where a narrow viewer still shows it), PPL ± s.e., ΔPPL % with its
    paired 95% interval, KLD, top-1, the gate's limit and bits per weight (the figures as the run's description
    prints them), then the verdict's reason across the table, with the variant that dominates it. In an audit of
    several domains, each model's row is its worst domain's, which a column names."""
    several = bool(said.domains)  # each model's row is its worst domain's, which a column names
    rows = []
    for model in said.models:
        row, verdict = model.row, plots.verdict_of(model)
        limit = plots.ppl_limit(said, row.variant) if model.role == "variant" else None
        reason = (model.verdict.reason if model.verdict else None) or model.reason
        cells = _cells(row, "—" if limit is None else f"≤ {limit:g}", stderr=True)
        if row.dominated_by:
            reason = f"{reason}; dominated by {row.dominated_by}"
        if row.floor:  # whether it lost more than running the baseline in 16 bits
            reason = f"{reason}; {row.floor.said}"
        domain = f'<td>{escape(model.domain or "—")}</td>' if several else ""
        rows.append(f'<tr class="model"><th>{escape(row.variant)}</th><td>{_badge(verdict)}</td>{domain}'
                    f'<td>{escape(row.method or model.method)}</td>'
                    + "".join(f'<td class="n">{escape(c)}</td>' for c in cells) + "</tr>")
        if reason:  # under its model, across the table: a reason is too long for a column
            rows.append(f'<tr><td class="reason" colspan="{9 + several}">{escape(reason)}</td></tr>')
    for floor in said.floor:  # the noise floor: the baseline in 16 bits, never judged
        row = floor.row
        cells = _cells(row, "—", stderr=False)
        rows.append(f'<tr class="model"><th>{escape(row.variant)}</th><td>floor</td>' + "<td>—</td>" * several
                    + f'<td>{escape(floor.dtype)}</td>' + "".join(f'<td class="n">{escape(c)}</td>' for c in cells)
                    + f'</tr><tr><td class="reason" colspan="{9 + several}">{escape(floor_text(row))}</td></tr>')
    title = "Each model on its worst domain" if several else "Comparison with the baseline"
    population = said.population_said
    named = ("" if population is None else f'<p class="meta">{escape(population_line(population.said))}</p>'
             if population.counted else f'<p class="meta">token population {escape(population.digest)}</p>')
    return (f'<h2>{title}</h2><div class="wide"><table><tr><th>model</th><th>verdict</th>'
            + "<th>worst domain</th>" * several + "<th>method</th><th>PPL ± s.e.</th><th>ΔPPL % [95% CI]</th><th>KLD</th><th>top-1</th>"
            "<th>limit ΔPPL %</th><th>bits per weight</th></tr>" + "".join(rows) + f"</table></div>{named}")


def _further(said: RecordSaid) -> str:
    """The per-model figures shown beside the gated ones (``tasks.record.figures.SHOWN``) that the variants measured,
    each with its interval (in an audit of several domains, on each variant's worst domain), and what each is."""
    variants = [model.row for model in said.models[1:]]  # the baseline's entry comes first
    measured = [figure for figure in SHOWN if any(row.figure(figure.key) for row in variants)]
    if not measured:
        return ""
    rows = [[row.variant, *(figure.text(found.value, found.low, found.high) if (found := row.figure(figure.key))
                            else None for figure in measured)] for row in variants]
    about = "".join(f"<li>{escape(figure.name)}: {escape(figure.about)}</li>" for figure in measured)
    return (f'<h2>Further figures</h2><div class="wide">{_table(["variant", *(f.name for f in measured)], rows)}'
            f'</div><ul class="meta">{about}</ul>')


def _cells(row: ModelRow, limit: str, stderr: bool) -> list[str]:
    """A model's figures in the comparison table: PPL (with its standard error where ``stderr``), ΔPPL % with its
    interval, KLD, top-1, its gate's ``limit`` and bits per weight."""
    ppl, error, bits = ((row.measured.ppl, row.measured.ppl_stderr, row.measured.bits_per_weight) if row.measured
                        else (None, None, None))
    top1 = _value(row.figure("top1_agreement"))
    return [_number(ppl, ".4f") + (f" ± {error:.4f}" if stderr and plots.measured(error) else ""),
            _delta(row.figure("delta_ppl_pct")), _kl(_value(row.figure("kld_mean"))),
            f"{100 * top1:.1f}%" if plots.measured(top1) else "—", limit, _number(bits, ".2f")]


def _domains(said: RecordSaid) -> str:
    """A line per domain of an audit of several: its verdict, its text and how many tokens of it were scored, why."""
    rows = "".join(f'<tr><th><a href="#domain-{escape(name)}">{escape(name)}</a></th>'
                   f'<td>{_badge(view.result.verdict.status)}</td><td class="long">{escape(view.corpus.source)}</td>'
                   f'<td class="n">{view.corpus.n_tokens:,}</td>'
                   f'<td class="reason">{escape(view.result.verdict.reason)}</td></tr>'
                   for name, view in said.domains.items())
    return ('<h2>Domains</h2><p class="meta">Each scored and judged as its own audit; a variant passes only where it '
            'passes on every domain.</p><div class="wide"><table><tr><th>domain</th><th>verdict</th><th>text</th>'
            f"<th>tokens</th><th>why</th></tr>{rows}</table></div>")


def _domain(name: str, view: RecordSaid, pictures: dict[str, bytes]) -> str:
    """Domain ``name``'s section (``view``: its one-corpus audit's record): its verdict, then its table, charts, where
    each variant loses, its corpus and its gate, as a one-corpus report shows them, a heading level down."""
    verdict = view.result.verdict
    own = {chart.removeprefix(f"{name}/"): picture for chart, picture in pictures.items()
           if chart.startswith(f"{name}/")}
    inner = "".join([_comparison(view), _charts(own), _where(view), _settings(view)])
    # the record's texts are escaped, so the only headings in ``inner`` are its own markup
    inner = inner.replace("<h3>", "<h4>").replace("</h3>", "</h4>").replace("<h2>", "<h3>").replace("</h2>", "</h3>")
    return (f'<section><h2 id="domain-{escape(name)}">Domain {escape(name)} {_badge(verdict.status)}</h2>'
            f'<p class="lead">{escape(verdict.reason)}</p>{inner}</section>')


def _charts(pictures: dict[str, bytes]) -> str:
    """Every chart, embedded as a base64 PNG."""
    images = [f'<img alt="{escape(name)}" src="data:image/png;base64,{base64.b64encode(picture).decode()}">'
              for name, picture in pictures.items()]
    return "<h2>Charts</h2>" + "".join(images)


def _where(said: RecordSaid) -> str:
    """Where in the text each variant loses (its record's ``where``, ``tasks.record.where``); nothing for a record
    without any (divergence off, or an audit from before it was kept)."""
    found = [model for model in said.models if model.where]
    if not found:
        return ""
    interval = escape(found[0].where.interval)
    sections = [_variant_where(model, model.where) for model in found]
    return ("<h2>Where in the text</h2><p>Mean change in NLL (variant less baseline, nats a token) and KL(baseline ‖ "
            f"variant) over each group's tokens. Intervals: {interval}.</p>" + "".join(sections))


def _variant_where(model: ModelSaid, where: WhereSaid) -> str:
    """One variant's groups side by side (by position in the window, by the baseline's top-1 probability, by whether
    the baseline was right) and its tokens of largest KL, each in its context."""
    groups = [("position in window", plots.position_label, where.by_position)]
    if where.by_confidence is not None:  # measured with KL
        groups += [("baseline's top-1 p", plots.confidence_label, where.by_confidence),
                   ("baseline", lambda group: group.baseline, where.by_baseline)]
    tables = "".join("<div>" + _table([title, "tokens", "ΔNLL [95%]", "KL [95%]"],
                                      [[label(group), f"{group.tokens:,}", _where_figure(group.delta_nll, "+.4f"),
                                        _where_figure(group.kl, ".4f")] for group in rows]) + "</div>"
                     for title, label, rows in groups)
    every = where.all
    section = (f"<h3>{escape(model.name)} {_badge(plots.verdict_of(model))}</h3>"
               f"<p>All {every.tokens:,} tokens: ΔNLL {escape(_where_figure(every.delta_nll, '+.4f'))}, "
               f"KL {escape(_where_figure(every.kl, '.4f'))}</p><div class=\"side\">{tables}</div>")
    if where.top_kl:
        rows = [[n, f"{token.kl:.4f}", f"{token.delta_nll:+.4f}", token.window, token.position,
                 _shown(token.context), repr(token.target_text), repr(token.base_top_text), repr(token.top_text)]
                for n, token in enumerate(where.top_kl, 1)]
        section += (f"<p>The {len(rows)} tokens of largest KL:</p><div class=\"wide\">"
                    + _table(["", "KL", "ΔNLL", "window", "position", "text before it", "token", "baseline's top",
                              "variant's top"], rows) + "</div>")
    return section


def _where_figure(figure: Interval, form: str) -> str:
    """A group's ΔNLL (signed: ``form``) or KL with its interval; a dash where the group has no tokens or no KL was
    measured."""
    if not plots.measured(figure.value):
        return "—"
    text = format(figure.value, form)
    if plots.measured(figure.low):
        text += f" [{figure.low:{form}}, {figure.high:{form}}]"
    return text


def _shown(text: str) -> str:
    """Text as one line of a table: a line break shows as ⏎ rather than vanish into a space."""
    return text.replace("\n", "⏎")


def _diagnoses(said: RecordSaid, runs: dict[str, str]) -> str:
    """Each diagnosed variant: the layers most responsible, what restoring them wins back and costs, and a link
    to its diagnosis's run; a diagnosis that failed, why. Nothing when no variant was diagnosed."""
    parts = []
    for model in said.models:
        name = escape(model.name)
        if model.problem is not None:
            parts.append(f"<p><b>{name}</b>: not diagnosed: {escape(model.problem)}</p>")
        found = model.diagnosis
        if not found:
            continue
        # the report is viewed inside the MLflow UI: a path from its root opens the run there, whatever its host
        link = (f' · <a href="{escape(runs[model.name])}" target="_top">its diagnosis run</a>'
                if model.name in runs else "")
        curve = [[len(step.restored), ", ".join(map(str, step.restored)) or "none", f"{step.kl:.5f}",
                  f"{step.kl_recovery.pct:.1f}%", f"{step.delta_nll:+.5f}", f"{step.mib:.1f}"]
                 for step in found.restore_curve]
        parts.append(f"<p><b>{name}</b>: on {found.windows} windows ({found.tokens} tokens), the layers most "
                     f"responsible, first: {escape(', '.join(map(str, found.ranking[:5])))}; the LM head's own KL "
                     f"{found.head.kl:.2e}, the input embeddings' SQNR {found.embeddings.sqnr_db:.1f} dB"
                     f"{link}</p>" + _table(["layers restored", "which", "KL left", "KL won back", "ΔNLL left", "MiB"],
                                            curve))
    if not parts:
        return ""
    return ("<h2>Diagnoses: where in the model it loses</h2><p class=\"meta\">Greedy: each step restores the "
            "baseline's layer that wins back most beside those before (<code>ppl-audit diagnose</code>).</p>"
            + "".join(parts))


def _settings(said: RecordSaid) -> str:
    """How the audit scored (evaluation settings), on what (the corpus) and what it demanded (the gate)."""
    corpus = said.corpus
    source = corpus.source + (f" ({corpus.hf_config or 'default'}, {corpus.hf_split})"
                              if corpus.source.startswith("hf:") else "")
    gates = [[model.name, *(_limit(getattr(said.thresholds.for_variant(model.name), figure.limit)) for figure in GATED)]
             for model in said.variants]
    limits = [f"{'max' if figure.above else 'min'} {figure.name}" + (f" {figure.unit}" if figure.unit else "")
              for figure in GATED]
    evaluation = said.evaluation.model_dump()  # as scored: the stride filled in
    return ('<h2>Settings</h2><div class="side">'
            + _pairs("Evaluation", evaluation)
            + _pairs("Corpus", {"source": source, "location": corpus.location,
                                "digest (SHA-256)": corpus.digest, "tokens scored": corpus.n_tokens,
                                "bytes": corpus.n_bytes, "beginning of sequence": corpus.bos})
            + "<div><h3>Gate</h3>" + _table(["variant", *limits], gates)
            + "<p>Judged on the pessimistic end of each 95% interval.</p></div></div>")


def _lineage(said: RecordSaid) -> str:
    """Where every model came from (path, method, quantization and calibration), what ran the audit, and its
    config as written."""
    models = {model.name: _model_lineage(model) for model in said.models}
    rows = [[what, *(model[what] for model in models.values())] for what in next(iter(models.values()))]
    env = said.environment
    return ('<h2>Lineage</h2><div class="wide">' + _table(["", *models], rows) + "</div>"
            + '<div class="side">'
            + _pairs("Environment", {"hardware": env.hardware, "python": env.python, **env.versions})
            + _pairs("Audit", {"audit id": said.audit_id, "config file": said.config_path,
                               "started": _time(said.started), "ended": _time(said.created),
                               "duration": _duration(said.started, said.created)})
            + f"</div><details><summary>config as written</summary><pre>{escape(said.config_text or '')}"
              "</pre></details>")


def _model_lineage(model: ModelSaid) -> dict:
    """One model's lineage by row name: what the config asked for, what was loaded and how it was made."""
    lineage, calibration = model.lineage, model.lineage.calibration
    size = lineage.size_on_disk_bytes
    return {"role": model.role, "method": lineage.method,
            "method found": lineage.detected, "format": _format_text(lineage.format),
            "path": lineage.loaded_from, "bits": lineage.bits, "group size": lineage.group_size, "symmetric": lineage.sym,
            "dtype · device": f"{lineage.dtype} · {lineage.device}",
            "backend": lineage.backend, "size on disk": None if size is None else f"{size / 2**20:.1f} MiB",
            "bits per weight": _bits_text(lineage),
            "quantized from (digest)": lineage.source_model_digest,
            "calibration": (f"{calibration.samples} × {calibration.seq_len} tokens, seed "
                            f"{calibration.seed}") if calibration else None,
            "calibration digest": calibration.digest if calibration else None,
            "baseline reference": _reference_text(model)}


def _bits_text(lineage: Lineage) -> str | None:
    """Bits per weight of the quantized layers as shipped and of the whole model as loaded (NaN: not measured)."""
    layers, whole = lineage.bits_per_weight, lineage.model_bits_per_weight
    if not plots.measured(layers):
        return None
    return f"{layers:.3f} (quantized layers, scales and zeros included); {whole:.3f} the whole model as loaded"


def _format_text(found: GgufFormat | CompressedFormat | HqqFormat | None) -> str | None:
    """A format's facts in a line: GGUF file type, tensor types and bits per weight; a compressed-tensors
    scheme and whether its activations were quantized; HQQ's bits, group and backend."""
    if isinstance(found, GgufFormat):
        types = ", ".join(f"{n} {name}" for name, n in found.tensor_types.items())
        return f"GGUF {found.file_type}, {found.bits_per_weight:.2f} bits per weight ({types})"
    if isinstance(found, CompressedFormat):
        return (f"compressed-tensors {found.scheme} ({found.format}): weights {', '.join(found.weights)}; "
                f"activations {found.activation_quantization}")
    if isinstance(found, HqqFormat):
        return f"HQQ {found.bits}-bit, group {found.group_size}, {found.backend} backend"
    return None


def _reference_text(model: ModelSaid) -> str | None:
    """The baseline's: scored or reused, its reference, drift; a variant's: the reference its KL came from."""
    said = model.reference
    if said is None:
        key = model.row.reference
        return f"KL against {key}" if key else None
    from tasks.record.verdict import drift_text

    parts = [f"{said.baseline}" + (f", reference {said.key}" if said.key else "")]
    parts += [drift_text(said.drift)] if said.drift else []
    parts += [said.problem] if said.problem else []
    return "; ".join(parts)


def _table(header: list[str] | None, rows: list[list]) -> str:
    """An HTML table of escaped cells, with a header row when given; None shows as a dash."""
    head = "" if header is None else "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(_cell("—" if c is None else str(c)) for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _cell(text: str) -> str:
    """A table cell; a long word (a path, a digest) may break anywhere, so that it cannot widen the page."""
    long = len(text) > 24 and " " not in text
    return f'<td class="long">{escape(text)}</td>' if long else f"<td>{escape(text)}</td>"


def _pairs(title: str, values: dict) -> str:
    """A titled two-column table: name, value."""
    return f"<div><h3>{escape(title)}</h3>" + _table(None, [[k, v] for k, v in values.items()]) + "</div>"


def _badge(verdict: str) -> str:
    colour = verdict if verdict in plots.COLOURS else "error"
    return f'<span class="badge {colour}">{escape(said_as(verdict).upper())}</span>'


def figure_text(row: dict, key: str, form: str) -> str:
    """``row[key]`` of a flat row (the run's description's, the history's) in ``form``, or a dash where it was not
    measured."""
    return _number(row.get(key), form)


def _number(value: float | None, form: str) -> str:
    """A figure in ``form``, or a dash where it was not measured (the report's and the run's description's)."""
    return format(value, form) if plots.measured(value) else "—"


def kl_figure(row: dict, key: str = "kld_mean") -> str:
    """``row[key]`` of a flat row, a KL figure, as every view gives it (``tasks.record.floor.kl_text``), or a dash
    where it was not measured."""
    return _kl(row.get(key))


def _kl(value: float | None) -> str:
    return kl_text(value) if plots.measured(value) else "—"


def _value(figure: Interval | None) -> float | None:
    """A typed row's figure's estimate; None where it was not measured."""
    return None if figure is None else figure.value


def delta_text(row: dict) -> str:
    """ΔPPL % of a flat row and its paired 95% interval (here, in the run's description and the history)."""
    return _delta(Interval.of_flat(row, "delta_ppl_pct"))


def _delta(figure: Interval | None) -> str:
    """ΔPPL % and its paired 95% interval, or a dash where it was not measured."""
    if figure is None:
        return "—"
    text = _number(figure.value, "+z.2f")
    if plots.measured(figure.low):
        text += f" [{figure.low:+z.2f}, {figure.high:+z.2f}]"
    return text


def _limit(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def _time(stamp: str | None) -> str:
    """An ISO time of the record as UTC to the second, or a dash (records from before ``started`` lack it)."""
    return "—" if not stamp else datetime.fromisoformat(stamp).strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _duration(started: str | None, ended: str) -> str:
    if not started:
        return "—"
    seconds = round((datetime.fromisoformat(ended) - datetime.fromisoformat(started)).total_seconds())
    return f"{seconds // 3600} h {seconds // 60 % 60} min {seconds % 60} s" if seconds >= 3600 else \
        f"{seconds // 60} min {seconds % 60} s"
