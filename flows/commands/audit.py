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
    run.add_argument("--stats", choices=("summary", "full"), default="summary",
                     help="full: after the table, llama-perplexity's statistics block for each variant (KL both "
                          "ways, its percentiles, Δp, same top token)")


def checked_config(path: str, overrides: list[str]):
    """Load, validate and preflight an audit config: bad input ends here, before any model loads."""
    from tasks.audit.preflight import check_calibration_room, check_stream, preflight
    from tasks.config import load_audit_config
    from tasks.data.corpus import corpus_text

    config = load_audit_config(path, overrides)
    preflight(config)
    # read once more in the flow; a bad corpus is refused here, not there
    text = corpus_text(config.corpus)
    check_calibration_room(config, text, progress=True)
    check_stream(config, text)
    return config


def run(args: argparse.Namespace) -> int:
    overrides = args.set + (["evaluation.sequential=true"] if args.sequential else [])
    checked_config(args.config, overrides)
    from flows.audit import audit, summary_json, summary_of  # Prefect and the flow: not for a config refused above

    state = audit(config=args.config, overrides=overrides, return_state=True)
    summary = summary_of(state)
    if summary is None:
        print(f"ppl-audit: audit failed: {state.message}", file=console.err())
        return 1
    verdict, say = summary["verdict"], console.out()
    print(summary["table"], file=say)
    if args.stats == "full":
        from tasks.record.verdict import format_stats

        print(f"\n{format_stats(summary['rows'])}\n", file=say)
    print(f"verdict: {verdict.said.upper()} — {verdict.reason}", file=say)
    print(f"record: {summary['record']}", file=say)
    if args.json:
        print(summary_json(summary), file=say)
    return 0 if verdict.status in ("pass", "ungated") else 1  # no gate: nothing failed, and it is not said to pass
