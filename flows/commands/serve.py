"""``ppl-audit serve``: the audit's deployments, on its schedule and on quantization.completed."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tasks.core import console
from tasks.core.errors import InputError

NAME, LOGGED = "serve", True


def add(commands) -> None:
    serve = commands.add_parser(NAME, help="serve the audit deployment: cron schedule + quantization.completed trigger")
    serve.add_argument("config", help="audit YAML")
    serve.add_argument("--allow", action="append", default=[], metavar="DIR",
                       help="a folder whose checkpoints events may name (again for more); the config's own paths "
                            "and the cache's quantized checkpoints always are")


def run(args: argparse.Namespace) -> int:
    from datetime import datetime

    from flows.serve import serve_config
    from tasks.audit.plan import open_audit
    from tasks.audit.served import Policy

    config = open_audit(args.config).config  # what each served run will make again on entry, checked once now
    missing = [folder for folder in args.allow if not folder.strip() or not Path(folder).is_dir()]  # "": not "."
    if missing:
        raise InputError(f"--allow '{missing[0]}': no such folder; give a folder served audits may read checkpoints from")
    # the serve's flow runs run in processes of its own, which inherit it; the Prefect API cannot set it
    os.environ.update(Policy.of(args.config, config, args.allow).environment())
    serve_config(args.config, config, lambda line: print(f"{datetime.now():%H:%M:%S} {line}", file=console.out(), flush=True))
    return 0
