"""Records written before a change read as they did: every view of the demo's record of 2026-11-28 (written by main
at 0a98ad8, from a fresh clone, schema 1: before ``AuditResult``), kept beside its views as that day's code drew
them. A change to how a record is read (``from_record``) or shown (console, ``--json``, the card, MLflow's metrics
and description) that moves one figure of the demo fails here (#68)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

RECORDS = Path(__file__).parent / "records"
SOURCE = "https://example.org/runs/0"  # the card's link back to the run: any, the same each time


def views(record: dict) -> dict[str, str]:
    """Everything a user reads of ``record``: the console's answer in each form, its JSON line, the card in each form,
    the parent run's description, and each model's metrics as MLflow gets them (without ``window_nll``, which is
    read from the per-token files, not the record)."""
    from tasks.record.answer import answer_json, answer_text
    from tasks.record.card import render
    from tasks.record.serial import from_record
    from tasks.record.tracking import _glance_metrics, _metrics, description

    result = from_record(record)
    found = {"console": answer_text(result), "console --by-domain": answer_text(result, by_domain=True),
             "console --stats full": answer_text(result, stats="full"), "--json": answer_json(result),
             "description": description(record)}
    found |= {f"card {form}": render(record, form, SOURCE) for form in ("md", "json", "model-index", "eval-results")}
    bare = _without_arrays(record)
    metrics = [*_glance_metrics(record, 0), *(m for entry in bare["variants"] for m in _metrics(bare, entry, RECORDS, 0))]
    found["metrics"] = "\n".join(f"{m.key} {m.value!r} {m.step}" for m in metrics)
    return found


def _without_arrays(record: dict) -> dict:
    """The record as if no model had per-token files (``arrays``), in each domain too."""
    def bare(entries: list[dict]) -> list[dict]:
        return [{key: value for key, value in entry.items() if key != "arrays"} for entry in entries]

    return record | {"variants": bare(record["variants"]),
                     "domains": {name: domain | {"variants": bare(domain["variants"])}
                                 for name, domain in record.get("domains", {}).items()}}


def _read(name: str) -> dict:
    return json.loads(lzma.open(RECORDS / name).read())


def test_the_demo_record_of_2026_11_28_reads_and_shows_as_it_did():
    record = _read("demo-2026-11-28.record.json.xz")
    assert record.get("schema") is None and list(record["domains"]) == ["austen", "python", "russian", "chinese"]
    expected = _read("demo-2026-11-28.views.json.xz")
    found = views(record)
    assert found.keys() == expected.keys()
    for name, text in expected.items():
        assert found[name] == text, f"{name} of the demo's record changed"
