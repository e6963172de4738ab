"""An audit's record as its MLflow parent run keeps it (``record.json``), read back and checked: by ``ppl-audit
card``, which is made from it, and by ``ppl-audit compare``, which prints the figures the audit's model runs hold and
checks them against it.

The record carries the digest of its own content (``spool.sealed_record_json``): an edit to it in the artifact store
is told. The figures compare reads are MLflow metrics and tags, which anyone with the store can log again; they are
held to the sealed record, so an edit to either is told, and the audit is named instead of printed.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from tasks.core import console

RECORD = "record.json"  # the audit's record, as the spool keeps it, on its parent run


class Untrusted(Exception):
    """A record, or the figures of an audit's runs, that cannot be trusted: one line saying why."""


def logged_record(client, run_id: str) -> dict | None:
    """The record the parent run ``run_id`` keeps, checked against its seal; None for a run tracked before records
    were logged. Raises ``Untrusted`` for one changed, cut short or unreadable."""
    from mlflow.exceptions import MlflowException

    from tasks.record.spool import record_damage

    if RECORD not in {artifact.path for artifact in client.list_artifacts(run_id)}:
        return None
    where = f"{RECORD} of run {run_id}"
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, RECORD, folder)
        except MlflowException as error:
            raise Untrusted(f"cannot read {where}: {str(error).splitlines()[0][:200]}") from None
        try:
            record = json.loads(Path(path).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):  # cut short or overwritten in the store: damaged as a changed one is
            raise Untrusted(f"{where} is not a JSON record (cut short or overwritten)") from None
    problem = record_damage(record, where)
    if problem:
        raise Untrusted(problem)
    return record


# what compare reads of a model's run (tasks.record.history.Audited), and where its sealed record holds each
ROW_FIGURES = ("delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "kld_mean", "kld_mean_low", "kld_mean_high")
FACT_FIGURES = {"bpw": ("bits_per_weight", 1), "mib": ("weight_memory_bytes", 2**20),
                "kv_bytes_per_token": ("kv_bytes_per_token", 1)}


def _entry(record: dict, name: str, domain: str | None) -> dict | None:
    if domain is None:
        return next((entry for entry in record.get("variants", []) if entry.get("name") == name), None)
    return next((entry for entry in record.get("domains", {}).get(domain, {}).get("variants", [])
                 if entry.get("name") == name), None)


def _same(logged: float, kept: object) -> bool:
    kept = math.nan if kept is None else float(kept)
    if not (math.isfinite(logged) or math.isfinite(kept)):
        return True
    return math.isclose(logged, kept, rel_tol=1e-9, abs_tol=1e-12)


def figures_differ(record: dict, row) -> str | None:
    """Where the figures compare read of a model's runs (``row``, an ``Audited``) differ from the audit's sealed record:
    ``delta_ppl_pct of int8 on prose: logged 0.5, recorded 1.2``; None when they agree."""
    from tasks.record.plots import verdict_of

    entry = _entry(record, row.name, row.domain)
    on = f"{row.name}" + (f" on {row.domain}" if row.domain else "")
    if entry is None:
        return f"the record has no model {on}"
    kept = entry.get("row") or {}
    for key in ROW_FIGURES:
        if not _same(getattr(row, key), kept.get(key)):
            return f"{key} of {on}: logged {getattr(row, key):.6g}, recorded {kept.get(key)}"
    facts = (_entry(record, row.name, None) or entry).get("facts") or {}  # the model's own: one across domains
    for field, (key, unit) in FACT_FIGURES.items():
        recorded = facts.get(key)
        if not _same(getattr(row, field), None if recorded is None else float(recorded) / unit):
            return f"{key} of {on}: logged {getattr(row, field) * unit:.6g}, recorded {recorded}"
    if row.verdict != "?" and row.verdict != verdict_of(entry):
        return f"the verdict of {on}: logged {row.verdict}, recorded {verdict_of(entry)}"
    return None


class Records:
    """The sealed records of the audits one command reads (``client``'s store), each downloaded and checked once, however
    many of its domains are read; the lines said of them, said once."""

    def __init__(self, client) -> None:
        self.client = client
        self._kept: dict[str, dict | Untrusted | None] = {}
        self.told: set[str] = set()

    def _record(self, run_id: str) -> dict | Untrusted | None:
        if run_id not in self._kept:
            try:
                self._kept[run_id] = logged_record(self.client, run_id)
            except Untrusted as error:
                self._kept[run_id] = error
            if self._kept[run_id] is None:
                print(f"ppl-audit: warning: audit run {run_id} keeps no {RECORD} (tracked by an older ppl-audit): "
                      "its figures are read unchecked", file=console.err())
        return self._kept[run_id]

    def untrusted(self, parent, rows: list) -> str | None:
        """Why the figures compare read of the audit ``parent`` (its parent run: ``rows``, of one of its domains)
        cannot be printed (its record changed, or its runs' figures differ from the record), or None. An audit
        tracked before records were logged is read as it is, with a one-line warning."""
        record = self._record(parent.info.run_id)
        if isinstance(record, Untrusted):
            return str(record)
        for row in rows if record is not None else ():
            differ = figures_differ(record, row)
            if differ:
                return f"its runs' figures are not its sealed {RECORD}'s ({differ})"
        return None
