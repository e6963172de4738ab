"""The tags ppl-audit sets on MLflow runs beyond a run's figures: what tracking writes and history reads back."""

AUDIT_ID = "ppl_audit.audit_id"  # a parent run and its children: one audit's record
COMPLETE = "ppl_audit.complete"  # set last: a parent without it was cut off and is logged again
BASELINE_KEY = "ppl_audit.baseline_key"  # which audits are comparable (tasks.record.history)
REFERENCE = "ppl_audit.reference"  # the baseline reference's key
SCHEDULED = "ppl_audit.scheduled"  # Prefect's schedule started the audit
DOMINATED_BY = "ppl_audit.dominated_by"  # a variant's, within its audit
CHANGED = "ppl_audit.changed"  # ΔPPL moved since the previous scheduled run
# an audit of several corpora (domains): its parent run names them and each one's keys, as NAME=KEY pairs; a variant's
# run holds each domain's figures as METRIC.NAME and, unsuffixed, its worst domain's (named by DOMAIN)
DOMAINS = "ppl_audit.domains"
DOMAIN_KEYS = "ppl_audit.domain_keys"
DOMAIN_REFERENCES = "ppl_audit.domain_references"
DOMAIN = "ppl_audit.domain"
