"""``ppl-audit tune``: a mixed-precision recipe for one variant within a size budget, chosen from measured gains,
made, and audited beside the uniform variants."""

from __future__ import annotations

import argparse

from tasks.core import console

NAME, LOGGED = "tune", True


def add(commands) -> None:
    tune = commands.add_parser(NAME, help="a mixed-precision recipe within a size budget, measured, made and audited")
    tune.add_argument("config", help="the audit YAML the variant is in, e.g. configs/demo.yaml")
    tune.add_argument("--variant", required=True, help="the variant to tune, made here from the baseline: a GGUF type "
                                                       "(method: gguf, type: Q4_0) or gptq without a path")
    tune.add_argument("--budget", required=True,
                      help="bits per weight of the decoder layers' matrices (4.8bpw), MiB of the whole file (120MiB), "
                           "or what is added to the variant's own (+0.25bpw, +8MiB)")
    tune.add_argument("--per", choices=("layer", "module"), default="layer",
                      help="what gets one choice: a decoder layer's matrices (default), or, in the quarter of the "
                           "layers that win back most whole, each of their fused groups (q/k/v, the output projection, "
                           "gate/up, down)")
    tune.add_argument("--types", metavar="T1,T2",
                      help="what a unit may take: GGUF tensor types for a GGUF variant (default Q6_K,Q8_0,F16: more "
                           "bits, unquantized); for a gptq variant 8bit (its group size), g32 (its bits), 8bit-g32 or "
                           "bf16 (unquantized) (default: 8 bits, half its group size, and unquantized)")
    tune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set diagnosis.windows=4 (the sample the gains are "
                           "measured on: diagnosis.windows and diagnosis.seed)")
    tune.add_argument("--json", action="store_true", help="end stdout with one JSON line of the tune")


def run(args: argparse.Namespace) -> int:
    from tasks.audit.recipe.plan import prepare_tune
    from tasks.audit.recipe.sizes import Budget

    budget = Budget.parse(args.budget)  # bad input ends here, before any model loads or Prefect starts
    types = None if args.types is None else args.types.split(",")  # "" is an empty request: refused, not the defaults
    from functools import partial

    from tasks.audit.plan import open_audit
    from tasks.audit.recipe.plan import alone

    plan = open_audit(args.config, args.set, narrow=partial(alone, variant=args.variant))
    types = list(prepare_tune(plan.lineup, args.variant, budget, args.per, types).types)  # checked: the options it takes
    from flows.tune import tune
    from tasks.record.tune_said import TuneFound
    from tasks.record.tuning import tune_table, tune_json

    found = TuneFound.of_record(tune(config=args.config, variant=args.variant, budget=args.budget, per=args.per,
                                     types=list(types), overrides=args.set, plan=plan))
    say = console.out()
    if found.audit_table:
        print(found.audit_table, file=say)
    print(tune_table(found), file=say)
    print(f"record: {found.record}", file=say)
    if args.json:
        print(tune_json(found), file=say)
    # a recipe not proven better than the uniform variant it would replace, in every domain, is not a success
    return 0 if found.proven and found.proven.uniform else 1
