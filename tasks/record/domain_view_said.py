"""One domain of an audit's record of several as its one-corpus audit's record (``domain_view``): what the one-corpus
charts, report and metrics are drawn from. Light: plain data."""

from __future__ import annotations

# what every domain's record shares with the audit's: said once, at the top
SHARED = ("schema", "audit_id", "name", "started", "created", "scheduled", "config_path", "config_text", "environment")


def domain_view(record: dict, name: str) -> dict:
    """Domain ``name`` of an audit's record as its one-corpus audit's record (the shared fields put back), with
    ``domain`` naming it."""
    return {key: record[key] for key in SHARED if key in record} | record["domains"][name] | {"domain": name}
