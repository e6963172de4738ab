"""``ppl-audit setup``: build the embedded model and corpora (once; cached)."""

from __future__ import annotations

import argparse

from tasks.core import console

NAME, LOGGED = "setup", True


def add(commands) -> None:
    commands.add_parser(NAME, help="build the embedded model and corpora (once; cached)")


def run(args: argparse.Namespace) -> int:
    from tasks.data.embedded import EMBEDDED_CORPORA, ensure_embedded_corpus, ensure_embedded_model

    print(f"embedded model:  {ensure_embedded_model()}", file=console.out())
    for name in EMBEDDED_CORPORA:
        print(f"embedded corpus {name}: {ensure_embedded_corpus(name)}", file=console.out())
    return 0
