"""An audit's model card: what a model publisher pastes into a Hugging Face model card, made from the audit's record
alone (no model loaded, no corpus read).

One content in four forms: Markdown (``markdown``: the verdict, a table per corpus, the noise floor, the token
population and how to reproduce it), the model card's metadata (``model_index``: Hugging Face's ``model-index`` as the
YAML front matter of a README.md, in the shape ``huggingface_hub``'s ``EvalResult`` reads and writes back unchanged),
the Hub's ``.eval_results/`` files (``eval_results``: one per corpus read from a Hub dataset, in the shape
``huggingface_hub``'s ``EvalResultEntry`` reads and writes back unchanged) and plain data (``card_json``). Tracking logs the record and the three forms on every audit's parent run
(``log_card``), so that ``ppl-audit card`` needs nothing but the tracking server.

The figures are the console table's (``tasks.record.verdict.format_table``), to the digit: a card that said +1.2%
where the audit's own table said +1.19% would be a second, unchecked account of one measurement. The intervals of KL
and top-1, which the console leaves out for width, are given in their figures' precision; a KL, and each end of its
interval, as every view gives it (``tasks.record.floor.kl_text``: two significant digits where four decimals would
print 0.0000).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from tasks.config import EvaluationConfig
from tasks.record.domains import domain_view
from tasks.record.figures import GATED, Text, fixed
from tasks.record.floor import kl_text
from tasks.record.logged import RECORD
from tasks.record.plots import verdict_of
from tasks.record.spool import record_json
from tasks.record.verdict import said as said_as

FORMATS = ("md", "model-index", "json", "eval-results")
EVAL_RESULTS = ".eval_results"  # the folder of a model's repo the Hub reads these files from
ARTIFACTS = {"md": "card/card.md", "model-index": "card/model-index.yaml", "json": "card/card.json"}
SOURCE = "ppl-audit"  # the model index's source.name: who measured (the Hub shows it beside each result)
TASK = {"type": "text-generation", "name": "Text Generation"}
# a row's figures as the card carries them: the console table's, and the intervals of KL and top-1 it leaves out
CARD_FIGURES = ("bits_per_weight", "weight_mib", "ppl",
                *(key for figure in GATED for key in (figure.key, f"{figure.key}_low", f"{figure.key}_high")))
COLUMNS = ("variant", "method", "bpw", "MiB", "PPL", *(figure.header for figure in GATED), "verdict", "floor")


@dataclass(frozen=True)
class Section:
    """One token stream of the audit and its record as a one-corpus audit's (``domain``: its name in an audit of
    several corpora, None for an audit of one)."""

    domain: str | None
    record: dict


def sections(record: dict) -> list[Section]:
    """The audit's token streams: each domain's (``tasks.record.domains.domain_view``), or its one corpus."""
    if "domains" not in record:
        return [Section(None, record)]
    return [Section(name, domain_view(record, name)) for name in record["domains"]]


def _number(value) -> float | None:
    """A figure as the card gives it: a finite number, else None (not measured, or NaN, which JSON cannot hold)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def card_row(entry: dict) -> dict:
    """A model's row of one token stream as plain data: its figures (None where not measured), its verdict and why,
    and what the noise floor says of it (``row["floor"]``, None in an audit without a floor)."""
    row = entry["row"]
    floor = row.get("floor")
    return {"variant": entry["name"], "role": entry["role"],
            "method": row.get("method") or entry.get("spec", {}).get("method"), "status": entry["status"],
            **{key: _number(row.get(key)) for key in CARD_FIGURES},
            "verdict": verdict_of(entry),
            "reason": (entry.get("verdict") or {}).get("reason") or entry.get("reason") or None,
            "floor": {key: floor.get(key) for key in ("dtype", "kld", "above", "said")} if floor else None}


# the noise floor's figures with an interval as the console writes them: ΔPPL to two decimals, KL as every view does
DELTA, KL = fixed("+z.2f"), kl_text


def _form(value: float | None, text: Text) -> str | None:
    return None if value is None else text(value)


def _interval(row: dict, key: str, text: Text, unit: str = "") -> str:
    """``row[key]`` and its 95% interval, each as ``text`` writes it, or a dash where it was not measured."""
    value = _form(row[key], text)
    if value is None:
        return "—"
    low, high = _form(row[f"{key}_low"], text), _form(row[f"{key}_high"], text)
    return f"{value}{unit}" + (f" [{low}, {high}]" if low is not None and high is not None else "")


def floor_cell(floor: dict | None) -> str:
    """The table's floor column: ``above`` (lost more than the floor's numerics, beyond noise), ``within DTYPE``,
    ``not judged`` (one window), blank in an audit without a floor."""
    if not floor:
        return ""
    return {True: "above", False: f"within {floor.get('dtype')}"}.get(floor.get("above"), "not judged")


def cells(row: dict) -> list[str]:
    """A card row's Markdown cells, in ``COLUMNS``' order; the figures as ``format_table`` prints them."""
    verdict = "baseline" if row["verdict"] == "baseline" else said_as(row["verdict"]).upper()
    return [row["variant"], row["method"] or "—", _form(row["bits_per_weight"], fixed(".2f")) or "—",
            _form(row["weight_mib"], fixed(".0f")) or "—", _form(row["ppl"], fixed(".4f")) or "—",
            *(_interval(row, figure.key, figure.shown, figure.shown_unit) for figure in GATED), verdict,
            floor_cell(row["floor"])]


def _cell(text: str) -> str:
    """Text that stays in its Markdown table cell: a pipe would end it, a line break the row."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(header: tuple[str, ...] | list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in body]


def floor_rows(view: dict) -> list[dict]:
    """The noise floor's rows of one token stream (``record["floor"]``): the baseline in each 16-bit dtype against its
    float32 self; none in a record from before the floor, or of an audit without one."""
    return [{"name": floor["name"], "dtype": floor.get("dtype"), "status": floor["row"].get("status", "ok"),
             "reason": floor["row"].get("reason") or None, **{key: _number(floor["row"].get(key)) for key in CARD_FIGURES}}
            for floor in view.get("floor") or []]


def population_in(view: dict) -> dict:
    """Which tokens were scored: the record's token population (its digest names them), or for a record from before
    the population was digested, the same facts from its corpus and settings (``digest`` None)."""
    found = view.get("population")
    if found and "domains" not in found:
        return dict(found)
    corpus, evaluation = view["corpus"], view["config"]["evaluation"]
    settings = EvaluationConfig.of_record(evaluation)
    return {"digest": None, "tokens": corpus.get("n_tokens"), "tokenizer": corpus.get("tokenizer"),
            "text": corpus.get("digest"), "window": settings.window, "stride": settings.stride, "mode": settings.mode,
            "bos": corpus.get("bos"), "max_tokens": settings.max_tokens}


def population_text(found: dict) -> str:
    """The token population in one sentence of Markdown."""
    named = f"Token population `{found['digest']}`" if found.get("digest") else "Tokens (a record from before token " \
                                                                               "population digests)"
    tokens = f"{found['tokens']:,}" if isinstance(found.get("tokens"), int) else "?"
    how = f", stride {found.get('stride')}" if found.get("mode", "sliding") == "sliding" else ""
    return (f"{named}: {tokens} tokens of the text `{found.get('text')}`, tokenizer `{found.get('tokenizer')}`, "
            f"window {found.get('window')}{how}, mode {found.get('mode')}, BOS {found.get('bos')}, "
            f"max_tokens {found.get('max_tokens') or 'all'}.")


def reproduce(record: dict) -> dict:
    """How to run the audit again: the command, the config as it was written (the config as the audit read it, for
    a record without its text), and the versions and machine it ran with."""
    config = record.get("config_text") or yaml.safe_dump(record["config"], sort_keys=False, allow_unicode=True)
    file = Path(record.get("config_path") or f"{record['name']}.yaml").name
    return {"command": f"ppl-audit run {file}", "config_file": file, "config": config,
            "environment": record.get("environment") or {}}


def _plain(value):
    """``value`` as strict JSON holds it: a number that is not finite becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def card_data(record: dict, source_url: str, model_id: str | None = None) -> dict:
    """The card as plain data: the verdict, each token stream's rows, floor and population, each variant's verdict
    across the audit, how to reproduce it, and the model index. ``source_url``: where the record is
    (``source_url``)."""
    verdict = record["verdict"]
    return _plain({
        "name": record["name"], "audit_id": record["audit_id"], "created": record["created"],
        "baseline": record["config"]["baseline"].get("path"), "source_url": source_url,
        "verdict": {"status": verdict["status"], "reason": verdict["reason"]},
        "population": record.get("population") if "domains" in record else None,  # the domains' populations, named
        "sections": [{"domain": section.domain,
                      "source": section.record["corpus"]["source"],
                      "verdict": {key: section.record["verdict"][key] for key in ("status", "reason")},
                      "rows": [card_row(entry) for entry in section.record["variants"]],
                      "floor": floor_rows(section.record), "population": population_in(section.record)}
                     for section in sections(record)],
        "variants": card_verdicts(record),
        "reproduce": reproduce(record),
        "model-index": model_index(record, source_url, model_id),
    })


def card_verdicts(record: dict) -> list[dict]:
    """Each variant's verdict on the whole audit and why, and what the noise floor says of it (in an audit of several
    domains: on its worst domain, named)."""
    return [{"variant": entry["name"], "verdict": verdict_of(entry), "domain": entry.get("domain"),
             "reason": (entry.get("verdict") or {}).get("reason") or entry.get("reason") or None,
             "floor": (entry["row"].get("floor") or {}).get("said"),
             "llama_cpp": entry["row"].get("llama_cpp")}  # run by llama.cpp: the settings that ran, which move figures
            for entry in record["variants"] if entry["role"] == "variant"]


def source_url(page: str | None, run_id: str) -> str:
    """Where the card's figures come from, for the model index's ``source.url`` (the Hub wants one with a source's
    name): the audit's run page on a tracking server, else the run as MLflow names it (a local store has no page a
    reader could open)."""
    return page or f"runs:/{run_id}"


def _dataset(section: Section) -> dict:
    """The model index's dataset of a token stream: its domain's name (a one-corpus audit: the corpus's), its source
    as the type (a Hub dataset's id), a Hub dataset's config and split."""
    corpus = section.record["corpus"]
    source = corpus["source"]
    if source.startswith("hf:"):
        return {"name": section.domain or source[3:], "type": source[3:], "config": corpus.get("hf_config"),
                "split": corpus.get("hf_split")}
    return {"name": section.domain or Path(source).name or source, "type": source}


def _metrics(section: Section, baseline: str) -> list[dict]:
    """Each model's perplexity, and each variant's ΔPPL %, mean KL and top-1 agreement against the baseline, rounded
    as the console prints them (the intervals in the names); self-reported, so not verified by the Hub."""
    metrics = []
    for row in (card_row(entry) for entry in section.record["variants"]):
        name = row["variant"]
        figures = [("perplexity", "ppl", fixed(".4f"), f"{name} perplexity")]
        if row["role"] == "variant":
            figures += [(figure.card[0], figure.key, figure.shown, f"{name} {figure.card[1]} {baseline}")
                        for figure in GATED]
        for kind, key, text, said in figures:
            if row[key] is None:
                continue
            low, high = _form(row.get(f"{key}_low"), text), _form(row.get(f"{key}_high"), text)
            said += f" [95% CI {low}, {high}]" if low is not None and high is not None else ""
            metrics.append({"type": kind, "value": float(text(row[key])), "name": said, "verified": False})
    return metrics


def _baseline(record: dict) -> str:
    return next((entry["name"] for entry in record["variants"] if entry["role"] == "baseline"), "baseline")


def model_index(record: dict, source_url: str, model_id: str | None = None) -> list[dict]:
    """Hugging Face's ``model-index`` of the audit: one result per token stream (task text-generation, the stream's
    dataset, every model's figures), as ``huggingface_hub.repocard_data.eval_results_to_model_index`` writes it, so
    that reading it into ``EvalResult``s and writing them back gives it unchanged. The Hub keys results by task,
    dataset type, config and split, not by name: where two domains read one source, each has its name as config.
    ``model_id``: the Hub model the results are of, its name (default: the audit's)."""
    baseline = _baseline(record)
    results, seen = [], set()
    for section in sections(record):
        metrics = _metrics(section, baseline)
        if not metrics:  # nothing scored on it: the Hub's reader would drop it
            continue
        dataset = {key: value for key, value in _dataset(section).items() if value is not None}
        key = (dataset["type"], dataset.get("config"), dataset.get("split"))
        if key in seen:
            dataset["config"] = section.domain
        seen.add((dataset["type"], dataset.get("config"), dataset.get("split")))
        results.append({"task": dict(TASK), "dataset": dataset, "metrics": metrics,
                        "source": {"name": SOURCE, "url": source_url}})
    return [{"name": model_id or record["name"], "results": results}] if results else []


def model_index_yaml(record: dict, source_url: str, model_id: str | None = None) -> str:
    """The model index as a README.md's YAML front matter (``---`` above and below): what
    ``huggingface_hub.repocard.metadata_load`` and ``ModelCard.load`` read."""
    text = _yaml({"model-index": model_index(record, source_url, model_id)})
    return f"---\n{text}---\n"


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def card_json(record: dict, source_url: str, model_id: str | None = None) -> str:
    return json.dumps(card_data(record, source_url, model_id), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


@dataclass(frozen=True)
class EvalResults:
    """The Hub's ``.eval_results/`` files of an audit: each file's entries by its name (``prose.yaml``), and the token
    streams left out, by name, with their source (a local file or an embedded text: the Hub keys a result by the Hub
    dataset it is on)."""

    files: dict[str, list[dict]]
    left_out: dict[str, str]


def eval_results(record: dict, source_url: str) -> EvalResults:
    """The audit's ``.eval_results/`` files (huggingface/community-evals; the Hub's ``eval_results.yaml``
    specification), as ``huggingface_hub``'s ``eval_result_entries_to_yaml`` writes them: one per token stream read
    from a Hub dataset, named for its domain (a one-corpus audit: for the dataset), holding an entry per figure of the
    model index's result on it. Each entry: ``dataset.id`` the dataset, ``dataset.task_id`` its config (``default``
    without one), ``value`` the figure as the model index has it, ``date`` when the audit ended, ``notes`` the model
    index's metric name (which model, which figure, its interval), and ``source`` the run's page where there is one
    (``runs:/ID`` of a local store is no link)."""
    baseline = _baseline(record)
    source = {"source": {"url": source_url, "name": SOURCE}} if source_url.startswith(("http://", "https://")) else {}
    files, left_out = {}, {}
    for section in sections(record):
        corpus = section.record["corpus"]
        dataset = corpus["source"].removeprefix("hf:")
        name = section.domain or dataset.rsplit("/", 1)[-1]
        if not corpus["source"].startswith("hf:"):
            left_out[name] = corpus["source"]
            continue
        entries = [{"dataset": {"id": dataset, "task_id": corpus.get("hf_config") or "default"},
                    "value": metric["value"], "date": record["created"], **source, "notes": metric["name"]}
                   for metric in _metrics(section, baseline)]
        if entries:
            files[f"{name}.yaml"] = entries
    return EvalResults(files, left_out)


def eval_results_file(entries: list[dict]) -> str:
    """One ``.eval_results/`` file's text: its entries as a YAML list."""
    return _yaml(entries)


def eval_results_text(found: EvalResults) -> str:
    """The ``.eval_results/`` files one after another as YAML documents, each headed by its name as a comment."""
    return "---\n".join(f"# {EVAL_RESULTS}/{name}\n{eval_results_file(entries)}" for name, entries in found.files.items())


def _section_lines(section: Section, several: bool) -> list[str]:
    """One token stream's part of the Markdown card: its table, its noise floor and its token population."""
    view = section.record
    source = view["corpus"]["source"]
    said = said_as(view["verdict"]["status"]).upper()
    lines = [f"### Domain `{section.domain}` ({source}): {said}" if several else f"### Results on `{source}`", ""]
    rows = [card_row(entry) for entry in view["variants"]]
    floors = floor_rows(view)
    # an audit without a noise floor has nothing to say in its column: left out rather than blank in every row
    shown = len(COLUMNS) if floors or any(row["floor"] for row in rows) else len(COLUMNS) - 1
    lines += _table(COLUMNS[:shown], [cells(row)[:shown] for row in rows])
    if floors:
        lines += ["", "Noise floor: the baseline in each dtype against its float32 self, on the same tokens (a variant "
                      "*within* a floor lost no more than those numerics do):", ""]
        lines += _table(("floor", "dtype", "ΔPPL % [95% CI]", "KL [95% CI]"), [
            [floor["name"], floor["dtype"] or "—", _interval(floor, "delta_ppl_pct", DELTA),
             _interval(floor, "kld_mean", KL)] if floor["status"] == "ok" else
            [floor["name"], floor["dtype"] or "—", f"not measured: {floor['reason']}", "—"] for floor in floors])
    return lines + ["", population_text(population_in(view)), ""]


def markdown(record: dict, source_url: str) -> str:
    """The card in Markdown, under a second-level heading (the model card has its own title)."""
    verdict, several = record["verdict"], "domains" in record
    variants = card_verdicts(record)
    streams = sections(record)
    on = (f"{len(streams)} domains ({', '.join(s.domain for s in streams)}), each its own token stream, a variant's "
          "verdict its worst domain's" if several else f"`{record['corpus']['source']}`")
    lines = [f"## Perplexity audit: {record['name']}", "",
             f"**Verdict: {said_as(verdict['status']).upper()}.** {verdict['reason']}", "",
             f"Audited {record['created'][:19].replace('T', ' ')} UTC with ppl-audit: the baseline "
             f"`{record['config']['baseline'].get('path')}` and {len(variants)} variant(s) scored on the same tokens of "
             f"{on}. ΔPPL, KL and top-1 agreement are taken against the baseline, with paired 95% intervals over "
             f"windows; a variant passes when the pessimistic end of each interval is within its limit. "
             f"Record: `{source_url}` (audit `{record['audit_id']}`).", ""]
    if several and (record.get("population") or {}).get("digest"):
        named = ", ".join(f"{name} `{digest}`" for name, digest in record["population"].get("domains", {}).items())
        lines += [f"Token populations `{record['population']['digest']}`: {named}.", ""]
    for section in streams:
        lines += _section_lines(section, several)
    lines += ["### Why each verdict", ""]
    lines += [f"- **{row['variant']}**: {said_as(row['verdict']).upper()}" + (f": {row['reason']}" if row["reason"] else "")
              + (f"; {row['floor']}" if row["floor"] else "")
              + (f"; llama.cpp: {row['llama_cpp']}" if row.get("llama_cpp") else "") for row in card_verdicts(record)]
    again = reproduce(record)
    environment = again["environment"]
    versions = ", ".join(f"{name} {version}" for name, version in (environment.get("versions") or {}).items())
    lines += ["", "### How to reproduce", "", "With ppl-audit installed and the models and corpora at the config's "
              "paths:", "", "```bash", again["command"], "```", "", f"`{again['config_file']}`:", "", "```yaml",
              again["config"].rstrip("\n"), "```", "",
              f"Ran on {environment.get('hardware', 'an unrecorded machine')}, Python "
              f"{environment.get('python', '?')}" + (f"; {versions}." if versions else "."), ""]
    return "\n".join(lines)


def render(record: dict, form: str, source_url: str, model_id: str | None = None) -> str:
    """The card in ``form`` (one of ``FORMATS``); ``model_id``: the Hub model the results are of, the model index's
    name (default: the audit's)."""
    if form == "md":
        return markdown(record, source_url)
    if form == "eval-results":
        return eval_results_text(eval_results(record, source_url))
    return {"model-index": model_index_yaml, "json": card_json}[form](record, source_url, model_id)


def log_card(client, run_id: str, record: dict, page: str | None) -> None:
    """Log the audit's record (``record.json``, as the spool writes it) and its card in every form (``card/``) to its
    parent run ``run_id``; ``page``: the run's page in the tracking server's UI, None for a local store."""
    client.log_text(run_id, record_json(record), RECORD)
    for form, name in ARTIFACTS.items():
        client.log_text(run_id, render(record, form, source_url(page, run_id)), name)
