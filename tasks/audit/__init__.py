"""An audit's own logic: its preflight checks, its lineup of checkpoints, scoring one model, the stored baseline reference, events, served-audit policy and cluster checks."""
