"""Records written before a change read as they did: every view of the demo's record of 2026-11-28 (written by main
on its last evening, from a fresh clone, schema 1: before ``AuditResult``), kept beside its views as that day's code drew
them. A change to how a record is read (``from_record``) or shown (console, ``--json``, the card, MLflow's metrics
and description) that moves one figure of the demo fails here (#68). And the demo's record of 2026-11-29 (schema 2,
written through ``AuditResult``, on the same machine from the same quantized checkpoints and references) shows every
figure the old one showed: only what is timed and what names the run differ."""

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


# what differs from one run of an audit to the next on the same machine: how long it took, and what names the run
TIMED = {"tokens_per_second", "load_seconds", "wall_seconds", "peak_memory_bytes", "started", "ended"}
NAMED = {"audit_id": "the-audit", "created": "2026-01-01T00:00:00+00:00", "started": "2026-01-01T00:00:00+00:00"}


def _steady(value, top: bool = True):
    """``value`` (a record) with every timed figure 0 and what names the run the same, at every depth."""
    if isinstance(value, dict):
        steady = {key: 0 if key in TIMED else _steady(item, False) for key, item in value.items()}
        return steady | {key: name for key, name in NAMED.items() if key in steady} if top else steady
    if isinstance(value, list):
        return [_steady(item, False) for item in value]
    return value


def _untimed(text: str) -> str:
    """A console answer with each table's tok/s column blanked: the table is kept as printed, timing and all."""
    lines, span = text.splitlines(), None
    for i, line in enumerate(lines):
        if line.startswith("variant "):  # a table's header: its tok/s column ends where the title does
            span = (line.index("bits/B") + len("bits/B"), line.index("tok/s") + len("tok/s"))
            first = line.index("method")
        elif span and not line[:first].endswith(" ") and not line.startswith("-"):
            span = None  # past the table's rows (each padded in its first column)
        if span:
            lines[i] = line[:span[0]] + " " * (span[1] - span[0]) + line[span[1]:]
    return "\n".join(lines)


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


def test_the_demo_record_written_through_the_audit_result_shows_what_the_old_one_showed():
    old, new = _read("demo-2026-11-28.record.json.xz"), _read("demo-2026-11-29.record.json.xz")
    assert new["schema"] == 2 and "runtime_costs" in new["domains"]["austen"]
    before, after = views(_steady(old)), views(_steady(new))
    for name, text in before.items():
        untimed = _untimed if name.startswith("console") else str
        assert untimed(after[name]) == untimed(text), f"{name}: the demo's record of today shows other figures"


def _rows(record: dict):
    """Every comparison row a record holds: each model's, each floor's, in every domain."""
    yield from (entry["row"] for entry in record["variants"])
    yield from (floor["row"] for floor in record.get("floor", []))
    for domain in record.get("domains", {}).values():
        yield from _rows(domain)


def test_a_row_reads_into_its_typed_value_and_back_key_for_key_in_order():
    """The record's flat row and the audit's typed one (``ModelRow``) are one: read and written again, each row of
    both demo records is the same dict with its keys in the same order (``--json`` prints them in that order). Rows the
demo has not (a key/value cache, llama.cpp, drift, a sequential stop) are read back wherever a test reads a live
audit's rows (``helpers.flat``)."""
    from tasks.record.row import ModelRow

    rows = [row for name in ("demo-2026-11-28.record.json.xz", "demo-2026-11-29.record.json.xz")
            for row in _rows(_read(name))]
    assert len(rows) == 66 and any("floor_of" in row for row in rows) and any("dominated_by" in row for row in rows)
    for row in rows:
        assert list(ModelRow.of_record(row).as_record().items()) == list(row.items()), row["variant"]


def test_a_dataclass_reads_from_plain_data_by_its_fields_names_and_writes_back_the_same():
    """``tasks.core.plain``: the readers' one way of reading a dataclass whose keys are its fields' names: a nested
    dataclass and a tuple read by the converter given for them, a key an older record lacks read as the field's
    default or as None where it may be None, a key of another name or read otherwise given; and written back, the
    same plain data."""
    from dataclasses import dataclass

    import pytest

    from tasks.core.plain import read_fields, write_fields

    @dataclass(frozen=True)
    class Inner:
        kl: float
        top1: float

    @dataclass(frozen=True)
    class Outer:
        name: str
        inner: Inner
        weights: tuple[str, ...]
        location: str | None
        tokenizer: str = "transformers"

    flat = {"name": "q4", "inner": {"kl": 0.25, "top1": 0.5}, "weights": ["int4", "int8"], "location": "/data",
            "tokenizer": "llama.cpp"}
    read = {"inner": lambda said: read_fields(Inner, said), "weights": tuple}
    value = read_fields(Outer, flat | {"unread": 1}, read)
    assert value == Outer("q4", Inner(0.25, 0.5), ("int4", "int8"), "/data", "llama.cpp")
    assert write_fields(value) == flat and read_fields(Outer, write_fields(value), read) == value
    older = read_fields(Outer, {"name": "q4", "inner": {"kl": 0.25, "top1": 0.5}, "weights": []}, read)
    assert (older.location, older.tokenizer, older.weights) == (None, "transformers", ())
    assert read_fields(Outer, flat | {"inner": None}, read).inner is None  # None is not read
    assert read_fields(Outer, flat, read, given={"name": "q8"}).name == "q8"
    with pytest.raises(KeyError, match="weights"):
        read_fields(Outer, {"name": "q4", "inner": {"kl": 0.25, "top1": 0.5}}, read)
