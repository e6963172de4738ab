"""``ppl-audit notify``: announce a checkpoint with quantization.completed."""

from __future__ import annotations

import argparse
from pathlib import Path

from flows.commands.arguments import config_field
from tasks.core import console

NAME, LOGGED = "notify", True


def add(commands) -> None:
    from tasks.config import VariantSpec

    notify = commands.add_parser(NAME, help="announce a checkpoint (quantization.completed) to the Prefect "
                                                "server at PREFECT_API_URL: `serve` audits it")
    notify.add_argument("--model", required=True, help="the checkpoint's folder, as the serving machine reads it")
    notify.add_argument("--method", choices=[m for m in config_field(VariantSpec, "method")[1] if m != "baseline"],
                        help="how it was quantized (default: the checkpoint's manifest, else read from the "
                             "checkpoint as a config's path is)")
    notify.add_argument("--bits", type=int, help="informative")
    notify.add_argument("--name", help="the variant's name in the audit (it picks the gate)")
    notify.add_argument("--baseline", help="the model it was made from (default: the audit config's baseline)")


def run(args: argparse.Namespace) -> int:
    from flows.notify import notify

    sent = notify(args.model, method=args.method, bits=args.bits, name=args.name, baseline=args.baseline)
    print(f"quantization.completed for {Path(args.model).resolve()} sent: event {sent}", file=console.out())
    return 0
