"""An existing Dask cluster: a real `dask scheduler` and `dask worker` processes on 127.0.0.1, started by the
test, used by an audit through ``runner.address``; an address nothing answers at, and a worker that cannot
see a model folder (hidden from it in its own mount namespace), are one line each before anything loads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from flows.audit import audit
from helpers import free_port, wait_for, write_config

pytestmark = pytest.mark.usefixtures("prefect_harness")
DASK = str(Path(sys.executable).with_name("dask"))


def worker_environment() -> dict[str, str]:
    """What a worker on another machine would be configured with: the audit's Prefect server, cache and home."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


@contextmanager
def dask_cluster(workers: int, hide: Path | None = None):
    """A scheduler and ``workers`` worker processes; ``(address, worker processes)``. With ``hide``, the last
    worker runs in its own mount namespace with an empty tmpfs over that folder: a worker that cannot see it."""
    from distributed import Client

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    started = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for n in range(workers):
            command = [DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard",
                       "--name", f"worker-{n}"]
            if hide is not None and n == workers - 1:
                command = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs none "{hide}" && exec "$@"', "sh", *command]
            started.append(subprocess.Popen(command, env=worker_environment(), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        with Client(address, timeout=60, set_as_default=False) as client:
            wait_for(lambda: len(client.scheduler_info()["workers"]) == workers, 120, "the dask workers", every=0.5)
            yield address, sorted(client.scheduler_info()["workers"])
    finally:
        for process in reversed(started):
            process.terminate()
        for process in started:
            process.wait(timeout=60)


def test_an_audit_on_an_existing_dask_cluster_scores_as_sequential_and_names_each_worker(
        tmp_path, trained_model_dir, corpus_path):
    variants = [{"name": "int8", "method": "torchao-int8"}, {"name": "copy", "path": str(trained_model_dir)}]
    sequential = audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                       return_state=True).result()
    with dask_cluster(2) as (address, workers):
        config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                              runner={"kind": "dask", "address": address})
        state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    on_cluster = state.result()
    assert [r["ppl"] for r in on_cluster["rows"]] == [r["ppl"] for r in sequential["rows"]]  # to the last bit
    ran_on = {outcome.name: outcome.facts.worker for outcome in on_cluster["results"]}
    assert ran_on["int8"] in workers and ran_on["copy"] in workers  # the variants ran on the cluster's workers
    assert ran_on["baseline"] not in workers  # the baseline is scored by the flow itself


def test_an_address_nothing_answers_at_is_one_line_before_anything_loads(cli, tmp_path, trained_model_dir,
                                                                          corpus_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                          runner={"kind": "dask", "address": address})
    code, out, err = cli("run", str(config))
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [f"ppl-audit: error: runner.address {address}: nothing answers there "
                                        "(Connection refused); start the scheduler or correct the address"]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) to hide a folder from a worker")
def test_a_model_folder_a_worker_cannot_see_is_one_line(cli, tmp_path, trained_model_dir, corpus_path):
    private = tmp_path / "private"
    variant = shutil.copytree(trained_model_dir, private / "variant")
    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, [{"name": "v", "path": str(variant)}])
    with dask_cluster(2, hide=private) as (address, workers):
        code, out, err = cli("run", str(config), "--set", "runner.kind=dask", "--set", f"runner.address={address}")
    assert code == 2 and "Traceback" not in err, err
    [line] = err.strip().splitlines()
    named = re.match(rf"ppl-audit: error: runner.address: worker (\S+) cannot see {re.escape(str(variant))} \(v\); ", line)
    assert named and named.group(1) in workers, line


@pytest.mark.parametrize("runner, says", [
    ({"kind": "sequential", "address": "tcp://127.0.0.1:8786"}, "address is a Dask or Ray scheduler's"),
    ({"kind": "dask", "address": "http://127.0.0.1:8787"}, "not a dask scheduler address; use tcp://HOST:8786"),
    ({"kind": "ray", "address": "tcp://127.0.0.1:10001"}, "use ray://HOST:10001 or auto"),
])
def test_an_address_that_cannot_be_a_scheduler_is_one_line(runner, says):
    from tasks.config import Runner, parse
    from tasks.errors import InputError

    with pytest.raises(InputError, match=says):
        parse(Runner, runner, "runner")
    assert parse(Runner, {"kind": "ray", "address": "auto"}, "runner").address == "auto"
