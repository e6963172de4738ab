"""ppl-audit flows and the command line."""
