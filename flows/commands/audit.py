"""``ppl-audit run``: an audit from its YAML config, checked before any model loads."""

from __future__ import annotations

import argparse

from tasks.core import console

NAME, LOGGED = "run", True


def add(commands) -> None:
    run = commands.add_parser(NAME, help="run an audit flow from a YAML config")
    run.add_argument("config", help="audit YAML, e.g. configs/demo.yaml")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set evaluation.max_tokens=4096 (repeatable)")
    run.add_argument("--sequential", action="store_true",
                     help="stop scoring each variant once its verdict is settled (evaluation.sequential: on)")
    run.add_argument("--json", action="store_true", help="end stdout with one JSON line of the audit's result")
    run.add_argument("--by-domain", action="store_true",
                     help="an audit of several corpora: every domain's full table, not one line per model with its "
                          "worst domain")
    run.add_argument("--stats", choices=("summary", "full"), default="summary",
                     help="full: after the table, llama-perplexity's statistics block for each variant (KL both "
                          "ways, its percentiles, Δp, same top token)")


def run(args: argparse.Namespace) -> int:
    from tasks.audit.plan import open_audit

    overrides = args.set + (["evaluation.sequential=true"] if args.sequential else [])
    plan = open_audit(args.config, overrides)  # bad input ends here, before any model loads or Prefect starts
    from flows.audit import audit, result_of  # Prefect and the flow: not for a config refused above
    from tasks.record.answer import answer_json, answer_text

    state = audit(config=args.config, overrides=overrides, plan=plan, return_state=True)
    result = result_of(state)
    if result is None:
        print(f"ppl-audit: audit failed: {state.message}", file=console.err())
        return 1
    say = console.out()
    print(answer_text(result, args.by_domain, args.stats), file=say)
    if args.json:
        print(answer_json(result), file=say)
    return 0 if result.passed else 1  # no gate: nothing failed, and it is not said to pass
