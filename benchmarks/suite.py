"""Where the test suite's time goes: run pytest, sample every process under it, and print CPU by kind of process.

    .venv/bin/python benchmarks/suite.py                    # the whole suite, as CI runs it
    .venv/bin/python benchmarks/suite.py -m "not slow"      # any pytest arguments

Every 0.3 s it reads each process under pytest (its command line and CPU time, through ``psutil``); a process's
CPU is the last it was seen with, so a process that lived less than 0.3 s may be missed (a few ms each). Prints the
wall time, the total CPU and a table by kind of process; ``--json PATH`` keeps every process's row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict

import psutil

EVERY = 0.3  # seconds between two readings

KINDS = [  # (what the command line holds, what its parent's holds, the kind), first match wins
    ("exec(eval(sys.stdin", "", "xdist workers (tests run in-process)"),
    ("prefect.server.api.server", "flows.cli", "Prefect servers started by commands"),
    ("prefect.server.api.server", "", "Prefect servers (the tests' own)"),
    ("flows.cli", "flows.cli", "ppl-audit commands"),
    ("flows.cli", "", "ppl-audit commands' wrappers"),
    ("spawn_main", "dask", "Dask worker processes"),
    ("dask scheduler", "", "Dask schedulers"),
    ("dask worker", "", "Dask nannies"),
    ("prefect.engine", "", "serve's flow-run processes"),
    ("ray", "", "Ray"),
    ("mlflow", "", "MLflow"),
    ("llama", "", "llama.cpp"),
]


def kind(command: str, parent: str) -> str:
    return next((name for text, under, name in KINDS if text in command and under in parent), "other")


def sample(root: subprocess.Popen) -> dict:
    """Every process under ``root`` until it exits: ``{(pid, start): row}``."""
    seen: dict = {}
    while root.poll() is None:  # an exited child stays a zombie, which psutil still finds, until it is reaped
        try:
            processes = [psutil.Process(root.pid), *psutil.Process(root.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for process in processes:
            try:
                with process.oneshot():
                    row = seen.setdefault((process.pid, process.create_time()), {
                        "pid": process.pid, "ppid": process.ppid(), "command": " ".join(process.cmdline())[:300]})
                    times = process.cpu_times()
                    row["cpu"] = times.user + times.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(EVERY)
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every process's row here")
    ours, pytest_args = parser.parse_known_args()
    started = time.perf_counter()
    suite = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args])
    seen = sample(suite)
    code = suite.returncode
    wall = time.perf_counter() - started
    commands = {row["pid"]: row["command"] for row in seen.values()}
    by_kind: dict = defaultdict(lambda: [0, 0.0])
    for row in seen.values():
        totals = by_kind[kind(row["command"], commands.get(row["ppid"], ""))]
        totals[0] += 1
        totals[1] += row.get("cpu", 0.0)
    cpu = sum(total for _, total in by_kind.values())
    print(f"\npytest exited {code}; wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min over {len(seen)} processes")
    print("| processes | how many | CPU (min) |\n| --- | --- | --- |")
    for name, (count, total) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        print(f"| {name} | {count} | {total / 60:.2f} |")
    if ours.json:
        with open(ours.json, "w") as out:
            json.dump(list(seen.values()), out)
    return code


if __name__ == "__main__":
    sys.exit(main())
