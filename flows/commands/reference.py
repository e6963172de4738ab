"""``ppl-audit reference``: stored baseline references: build, list, verify, remove."""

from __future__ import annotations

import argparse

from flows.commands.arguments import VERBOSE, age, size
from tasks.core import console
from tasks.core.errors import InputError, one_line

# `reference build` and `verify` log (each has its own --verbose): both load libraries whose noise is no answer
NAME, LOGGED, LOGGED_ACTIONS = "reference", False, ("build", "verify")


def add(commands) -> None:
    reference = commands.add_parser(NAME, help="stored baseline references: build, list, verify, remove")
    actions = reference.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="score an audit's baseline once and store its reference "
                                             "(audits then reuse it and load only their variants)")
    build.add_argument("config", help="audit YAML: its baseline, corpus and evaluation settings")
    build.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set baseline.rescore=always (repeatable)")
    build.add_argument("--verbose", action="store_true", help=VERBOSE)
    actions.add_parser("ls", help="list the stored references")
    verify = actions.add_parser("verify", help="check stored references: every file's digest, the result against "
                                               "the scores, the LM head on the hidden states against the NLL")
    verify.add_argument("keys", nargs="*", help="keys from `ppl-audit reference ls`")
    verify.add_argument("--all", action="store_true", help="check every reference")
    verify.add_argument("--verbose", action="store_true", help=VERBOSE)
    rm = actions.add_parser("rm", help="remove references by key, by age or to a size")
    rm.add_argument("keys", nargs="*", help="keys from `ppl-audit reference ls`")
    rm.add_argument("--all", action="store_true", help="remove every reference")
    rm.add_argument("--older-than", type=age, metavar="AGE", help="remove those unused for AGE (30d, 12h, ...)")
    rm.add_argument("--over", type=size, metavar="SIZE",
                    help="remove the least recently used until the rest fit in SIZE (20G, 500M, ...)")


def run(args: argparse.Namespace) -> int:
    actions = {"build": _build, "ls": _listed, "verify": lambda a: _verify_references(a.keys, a.all), "rm": _removed}
    return actions[args.action](args)


def _build(args: argparse.Namespace) -> int:
    """``reference build``: each domain's baseline scored and stored, with the noise floor the config asks for; 1
    when any could not be stored."""
    from flows.reference import build_reference
    from tasks.audit.plan import baseline_alone, open_audit

    plan = open_audit(args.config, args.set, narrow=baseline_alone)  # before Prefect starts: the baseline only
    outcomes = build_reference(config=args.config, overrides=args.set, plan=plan)
    stored = True
    for domain in plan.domains:  # as build_reference made them, by name
        outcome, floors = outcomes[domain.name]
        on = domain.corpus.on
        if not outcome.ok:
            print(f"ppl-audit: failed: {outcome.name}{on}: {outcome.reason}", file=console.err())
            stored = False
            continue
        _said_built(outcome, floors, on)
        stored = stored and bool(outcome.reference.path)
    return 0 if stored else 1


def _said_built(outcome, floors: list, on: str) -> None:
    """A stored baseline's lines: its perplexity and where its reference is, its drift, its noise floor."""
    from tasks.record.floor import kept_as
    from tasks.record.verdict import drift_text

    say, said, result = console.out(), outcome.reference, outcome.result
    where = f"reference {said.key} in {said.path}" if said.path else f"no reference: {said.problem}"
    print(f"baseline {said.baseline}{on}: PPL {result.ppl:.4f} ± {result.ppl_stderr:.4f} over "
          f"{result.n_tokens} tokens; {where}", file=say)
    if said.drift:
        print(drift_text(said.drift), file=say)
    for floor in floors:  # the noise floor the config asks for, kept with the reference
        measured = floor.result.extra.kl if floor.ok else None
        kl = f", KL {measured.astype('float64').mean():.4g}" if measured is not None else ""
        print(f"noise floor {floor.name}{on}: " + (f"{kept_as(floor)}, PPL {floor.result.ppl:.4f}{kl}" if floor.ok
                                                    else f"failed: {floor.reason}"), file=say)


def _listed(args: argparse.Namespace) -> int:
    """``reference ls``: one line per stored reference, a damaged one saying what to do."""
    from tasks.audit import reference
    from tasks.core.places import references_dir

    say, found = console.out(), reference.listed()
    print(f"{'key':<17}{'created':<17}{'last used':<17}{'size':>10}  {'tokens':>8}  {'dtype':<9}{'device':<12}"
          "torch / transformers  model", file=say)
    for r, problem in found:
        m = r.manifest
        about = (f"{m.result.n_tokens!s:>8}  {m.identity.dtype!s:<9}"
                 f"{str(m.environment.get('device'))[:11]:<12}{m.environment.get('torch')} / "
                 f"{m.environment.get('transformers')}  {m.source}"
                 # a baseline llama.cpp ran: its logits are the reference, whatever torch computes after
                 + (f" (scored in {m.identity.runtime})" if m.identity.runtime is not None else "")) \
            if problem is None else \
            f"DAMAGED: {problem}; the audit of its baseline replaces it (or: ppl-audit reference rm {r.key})"
        print(f"{r.key:<17}{_when(r.created):<17}{_when(r.last_used):<17}{_mib(r.size_bytes):>10}  {about}", file=say)
    damaged = sum(problem is not None for _, problem in found)
    print(f"{len(found)} reference(s){f' ({damaged} damaged)' if damaged else ''}, "
          f"{_mib(sum(r.size_bytes for r, _ in found))} in {references_dir()}", file=say)
    return 0


def _removed(args: argparse.Namespace) -> int:
    """``reference rm``: by key, all, by age or to a size."""
    from tasks.audit import reference

    if not (args.keys or args.all or args.older_than is not None or args.over is not None):
        raise InputError("reference rm: name the keys to remove (see `ppl-audit reference ls`), or give --all, "
                         "--older-than AGE or --over SIZE")
    found = {r.key: r for r, _ in reference.listed()}  # a damaged one too: rm is how a user clears it
    unknown = [key for key in args.keys if key not in found]
    if unknown:
        raise InputError(f"reference rm: no reference {', '.join(unknown)}; `ppl-audit reference ls` lists them")
    removed = [found[key] for key in args.keys] if not args.all else list(found.values())
    for r in removed:
        reference.remove(r)
    if args.older_than is not None or args.over is not None:
        removed += reference.prune_references(args.older_than, args.over)
    print(f"removed {len(removed)} reference(s), {_mib(sum(r.size_bytes for r in removed))}"
          + "".join(f"\n  {r.key}" for r in removed), file=console.out())
    return 0


def _verify_references(keys: list[str], every: bool) -> int:
    """One line per reference: intact, or what is damaged; 1 when any is damaged."""
    from tasks.audit import reference

    if bool(keys) == every:
        raise InputError("reference verify: name the keys to check (see `ppl-audit reference ls`), or give --all")
    folders = reference.folders()
    unknown = [key for key in keys if key not in folders]
    if unknown:
        raise InputError(f"reference verify: no reference {', '.join(unknown)}; `ppl-audit reference ls` lists them")
    damaged = 0
    for key in keys or sorted(folders):
        try:
            problem = reference.verify(folders[key])
            said = f"DAMAGED: {problem}" if problem else "intact: files, result and NLL check out"
        except (InputError, OSError, ValueError) as error:  # the baseline's files, whose head it needs, are gone
            problem, said = None, f"files and result intact; NLL not checked: {one_line(error)}"
        damaged += problem is not None
        print(f"{key}  {said}", file=console.out())
    if damaged:
        print(f"{damaged} damaged: an audit never uses one; it removes it and scores the baseline again "
              "(or: ppl-audit reference rm KEY)", file=console.out())
    return 1 if damaged else 0


def _when(epoch: float) -> str:
    from datetime import datetime

    return f"{datetime.fromtimestamp(epoch):%Y-%m-%d %H:%M}"


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"
