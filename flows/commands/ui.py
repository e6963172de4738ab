"""``ppl-audit ui``: the MLflow UI on the local store, on 127.0.0.1."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from flows.commands.arguments import tcp_port
from tasks.core.errors import InputError

NAME, LOGGED = "ui", False  # a service: its output is its log


def add(commands) -> None:
    ui = commands.add_parser(NAME, help="start the MLflow UI on the local store (127.0.0.1)")
    ui.add_argument("--port", type=tcp_port, default=5000)


def run(args: argparse.Namespace) -> int:
    import subprocess

    from mlflow import MlflowClient

    from tasks.core.places import default_uri, home
    from tasks.record.tracking import ui_link

    home().mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:  # before the address is printed: mlflow would fail with a page of traceback
        try:
            probe.bind(("127.0.0.1", args.port))
        except OSError as error:
            raise InputError(f"port {args.port} on 127.0.0.1 is taken ({error.strerror}); use --port with a free "
                             "one") from None
    url = f"http://127.0.0.1:{args.port}"
    experiments = []  # a store not made yet has none (and reading it would make it, with a page of logs)
    if (home() / "mlflow.db").exists():
        experiments = [e for e in MlflowClient(default_uri()).search_experiments() if e.name != "Default"]
    print(f"MLflow UI on {url} (store {default_uri()}); Ctrl-C stops it", flush=True)
    for experiment in experiments:
        print(f"  {experiment.name}: {ui_link(url, experiment.experiment_id)}", flush=True)
    mlflow = Path(sys.executable).parent / "mlflow"
    # one worker process: a reviewer's UI is served as well by one (its requests run on threads), which starts in ~7 s
    # and ~6 CPU-s where MLflow's default of four takes ~11 s and ~14 CPU-s
    command = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(args.port), "--workers", "1",
               "--backend-store-uri", default_uri(), "--default-artifact-root", (home() / "mlartifacts").as_uri()]
    return subprocess.call(command)  # Ctrl-C: main says so, and the supervisor stops what the server started
