"""ppl-audit tasks: the perplexity engine and the steps an audit is built from."""
