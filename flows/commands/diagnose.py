"""``ppl-audit diagnose``: where in the model and in the text one variant of an audit loses, and what restoring
layers would win back."""

from __future__ import annotations

import argparse

from tasks.core import console

NAME, LOGGED = "diagnose", True


def add(commands) -> None:
    from flows.commands.arguments import config_field
    from tasks.config import Diagnosis

    diagnose = commands.add_parser(NAME, help="where a variant loses: per-layer errors, restoring layers, the text")
    diagnose.add_argument("config", help="the audit YAML the variant is in, e.g. configs/demo.yaml")
    diagnose.add_argument("--variant", required=True, help="the name of the variant to diagnose")
    diagnose.add_argument("--corpus", metavar="NAME",
                          help="in a config with corpora: the domain whose text and settings the variant is diagnosed "
                               "on (default: the first; the output names it)")
    diagnose.add_argument("--windows", type=int, metavar="N",
                          help=f"windows of the audit's stream to score, a seeded sample (default: diagnosis.windows, "
                               f"{config_field(Diagnosis, 'windows')[0]})")
    diagnose.add_argument("--restore", type=int, metavar="K",
                          help=f"the greedy restore curve's length in layers (default: diagnosis.restore, "
                               f"{config_field(Diagnosis, 'restore')[0]})")
    diagnose.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="override a config value, e.g. --set diagnosis.seed=1 (repeatable)")
    diagnose.add_argument("--json", action="store_true", help="end stdout with one JSON line of the diagnosis")


def overrides(args: argparse.Namespace) -> list[str]:
    """The command's settings as config overrides: the config stays the one source of every default."""
    given = {"diagnosis.windows": args.windows, "diagnosis.restore": args.restore}
    return args.set + [f"{key}={value}" for key, value in given.items() if value is not None]


def run(args: argparse.Namespace) -> int:
    from functools import partial

    from flows.diagnose import diagnose, on_domain
    from tasks.audit.diagnose import narrowed
    from tasks.audit.plan import open_audit
    from tasks.record.diagnosis import diagnosis_json, diagnosis_table
    from tasks.record.diagnosis_said import VariantDiagnosis

    plan = open_audit(args.config, overrides(args), narrow=partial(narrowed, variant=args.variant))  # before any model loads
    on_domain(plan, args.corpus)  # an unknown --corpus too: refused before Prefect starts the flow
    found = diagnose(config=args.config, variant=args.variant, overrides=overrides(args), plan=plan, corpus=args.corpus)
    said = VariantDiagnosis.of_record(found)
    say = console.out()
    print(diagnosis_table(said), file=say)
    print(f"record: {said.record}", file=say)
    if args.json:
        print(diagnosis_json(found), file=say)
    return 0
