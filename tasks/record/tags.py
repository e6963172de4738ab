"""The tags ppl-audit sets on MLflow runs beyond a run's figures: what tracking writes and history reads back."""

AUDIT_ID = "ppl_audit.audit_id"  # a parent run and its children: one audit's record
COMPLETE = "ppl_audit.complete"  # set last: a parent without it was cut off and is logged again
BASELINE_KEY = "ppl_audit.baseline_key"  # which audits are comparable (tasks.record.history)
REFERENCE = "ppl_audit.reference"  # the baseline reference's key
SCHEDULED = "ppl_audit.scheduled"  # Prefect's schedule started the audit
DOMINATED_BY = "ppl_audit.dominated_by"  # a variant's, within its audit
CHANGED = "ppl_audit.changed"  # ΔPPL moved since the previous scheduled run
# an audit of several domains: its parent has these instead of BASELINE_KEY and REFERENCE (each names one token stream)
DOMAINS = "ppl_audit.domains"  # the domains' names, space-separated, in the config's order
DOMAIN_KEYS = "ppl_audit.domain_keys"  # NAME=BASELINE_KEY pairs, space-separated
DOMAIN_REFERENCES = "ppl_audit.domain_references"  # NAME=REFERENCE_KEY pairs, space-separated
DOMAIN = "ppl_audit.domain"  # a model's run: the domain its unsuffixed figures are of (its worst)
POPULATION = "ppl_audit.population"  # the token population's digest (tasks.audit.population): one corpus
DOMAIN_POPULATIONS = "ppl_audit.domain_populations"  # an audit of several domains: NAME=DIGEST pairs
FLOOR = "ppl_audit.floor"  # a variant's run: whether it lost more than the noise floor (tasks.record.floor)
