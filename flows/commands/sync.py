"""``ppl-audit sync``: send the spooled audits to MLflow, each record on its own."""

from __future__ import annotations

import argparse
import os

from tasks.core import console
from tasks.core.errors import one_line

NAME, LOGGED = "sync", True


def add(commands) -> None:
    sync = commands.add_parser(NAME, help="send spooled audits (tracking was down) to MLflow")
    sync.add_argument("--tracking-uri", help="default: each audit's configured URI, MLFLOW_TRACKING_URI, or the local store")


# what a replay raises on a record's own content (a field missing or of another type), not on a server's failure
OF_THE_RECORD = (KeyError, TypeError, IndexError, AttributeError)


def _set_aside(folder, problem: str) -> None:
    from tasks.record.spool import quarantine

    print(f"ppl-audit: warning: {folder.name} is damaged ({problem}); moved to {quarantine(folder)}: "
          "inspect its record.json, then move it back to the spool or delete it", file=console.err())


def run(args: argparse.Namespace) -> int:
    from tasks.config import check_tracking
    from tasks.record.spool import claim, spooled_damage, mark_synced, pending, sweep_partials
    from tasks.record.tracking import is_tracking_outage, replay

    if args.tracking_uri is not None or os.environ.get("MLFLOW_TRACKING_URI"):  # else each record's own: checked as it was made
        check_tracking(args.tracking_uri, "--tracking-uri")
    sweep_partials()
    waiting = pending()
    synced = elsewhere = failed = damaged = 0
    for folder in waiting:
        with claim(folder) as state:
            if state != "mine":  # another sync, or an audit tracking its own record: not a failure
                elsewhere += 1
                print(f"{folder.name}: skipped, {'being synced' if state == 'busy' else 'synced'} by another process",
                      file=console.out())
                continue
            problem = spooled_damage(folder)
            if problem:  # it would fail every later sync too: set aside, as any damaged cache is
                damaged += 1
                _set_aside(folder, problem)
                continue
            try:
                run_id = replay(folder, args.tracking_uri)
            except Exception as error:  # keep going: each record is independent
                if isinstance(error, OF_THE_RECORD) and not is_tracking_outage(error):
                    damaged += 1  # a field deeper than ``damage`` looks: this record fails every sync, not the server
                    _set_aside(folder, f"replaying it failed on its content: {type(error).__name__}: "
                                       f"{one_line(error)[:100]}")
                    continue
                failed += 1
                print(f"{folder.name}: not synced ({type(error).__name__}: {one_line(error)[:200]})",
                      file=console.err())
                continue
            mark_synced(folder)
        synced += 1
        print(f"{folder.name}: synced as MLflow run {run_id}", file=console.out())
    others = (f", {elsewhere} by another process" if elsewhere else "") + (f", {damaged} damaged" if damaged else "")
    print(f"{synced} of {len(waiting)} spooled audit(s) synced{others}", file=console.out())
    return 1 if failed else 0
