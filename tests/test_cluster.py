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

import numpy as np
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
    """A scheduler and ``workers`` worker processes; ``(address, worker addresses in start order)``. With
    ``hide``, the last worker runs in its own mount namespace with an empty tmpfs over that folder: a worker
    that cannot see it."""
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
            named = client.scheduler_info()["workers"]
            yield address, sorted(named, key=lambda worker: named[worker]["name"])  # worker-0 first
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


def test_sharded_variants_on_an_existing_cluster_equal_one_worker_bit_for_bit(tmp_path, trained_model_dir,
                                                                              corpus_path, noisy_model_dir):
    """Each variant scored as 3 slices of its windows over 2 workers: every per-token array (NLL, KL both ways,
    top-1) and every figure equals the unsharded audit's exactly, and each shard names the worker it ran on."""
    variants = [{"name": "int8", "method": "torchao-int8"}, {"name": "noisy", "path": str(noisy_model_dir)}]
    whole = audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                  return_state=True).result()
    with dask_cluster(2) as (address, workers):
        config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                              runner={"kind": "dask", "address": address, "shards": 3})
        state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    sharded = state.result()
    timing = {"tokens_per_second", "load_seconds", "weight_mib", "baseline"}  # how long, and reused or not
    assert [{k: v for k, v in row.items() if k not in timing} for row in sharded["rows"]] == \
        [{k: v for k, v in row.items() if k not in timing} for row in whole["rows"]]
    for one, split in zip(whole["results"][1:], sharded["results"][1:]):
        a, b = one.result, split.result
        assert (a.nll_sum, a.n_tokens, a.stderr) == (b.nll_sum, b.n_tokens, b.stderr)
        for name, x, y in [("nll", a.token_nll, b.token_nll), ("windows", a.window_nll, b.window_nll),
                           *((key, a.extra[key], split.result.extra[key]) for key in ("kl", "kl_reverse", "top1"))]:
            assert np.array_equal(x, y), name
        assert [row["windows"] for row in split.shards] == [[0, 16], [16, 32], [32, 46]]
        assert {row["worker"] for row in split.shards} <= set(workers)
        assert sum(row["tokens"] for row in split.shards) == b.n_tokens
        assert split.facts.worker.split(", ")[0] == split.shards[0]["worker"]


def kill_a_worker_mid_shard(address: str, name: str, killed: list) -> None:
    """Once a shard of ``name`` has been running for a second (its Prefect task run Running, the scheduler
    processing it on a worker), kill that worker's process with SIGKILL; its address goes into ``killed``."""
    import signal
    import time

    from distributed import Client
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    with Client(address, timeout=60, set_as_default=False) as client, get_client(sync_client=True) as api:
        pids = client.run(os.getpid)

        def running_shard():
            shards = TaskRunFilter(name=TaskRunFilterName(like_=f"score-{name}-windows"))
            runs = api.read_task_runs(task_run_filter=shards)
            return any(run.state and run.state.is_running() for run in runs)

        wait_for(running_shard, 300, f"a running shard of {name}", every=0.1)
        time.sleep(1)
        busy = [worker for worker, keys in client.processing().items() if keys]
        os.kill(pids[busy[0]], signal.SIGKILL)
        killed.append(busy[0])


def test_a_worker_killed_mid_shard_costs_a_retry_not_the_audit(tmp_path):
    """SmolLM2 in two shards on two workers; one worker's process is killed while its shard runs: the shard runs
    again on a worker that lives, and the audit's figures are the unsharded audit's to the last bit."""
    import threading

    import yaml

    config = {"name": "killed", "baseline": {"path": "embedded"}, "corpus": {"source": "embedded"},
              "evaluation": {"window": 256, "stride": 128, "batch_size": 2, "max_tokens": 1536},
              "variants": [{"name": "int8", "method": "torchao-int8"}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(config))
    whole = audit(config=str(tmp_path / "s.yaml"), return_state=True).result()
    killed: list[str] = []
    with dask_cluster(2) as (address, workers):
        (tmp_path / "d.yaml").write_text(yaml.safe_dump(config | {"runner": {"kind": "dask", "address": address,
                                                                             "shards": 2}}))
        killer = threading.Thread(target=kill_a_worker_mid_shard, args=(address, "int8", killed))
        killer.start()
        state = audit(config=str(tmp_path / "d.yaml"), return_state=True)
        killer.join()
    assert state.is_completed(), state.message
    assert killed and killed[0] in workers
    outcome = state.result()["results"][1]
    assert killed[0] not in {row["worker"] for row in outcome.shards}  # its shard ran again on a live worker
    assert np.array_equal(outcome.result.token_nll, whole["results"][1].result.token_nll)
    assert outcome.result.nll_sum == whole["results"][1].result.nll_sum


def test_a_shard_that_fails_on_one_worker_runs_again_on_another(tmp_path, trained_model_dir, corpus_path):
    """One worker sees its own, empty references folder (an unsynced mount): the shards it takes cannot read the
    baseline reference, fail, and run again on the other worker; the audit's figures are still exact."""
    from tasks.places import references_dir

    variants = [{"name": "int8", "method": "torchao-int8"}]
    whole = audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                  return_state=True).result()
    with dask_cluster(2, hide=references_dir()) as (address, workers):
        config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                              runner={"kind": "dask", "address": address, "shards": 4})
        state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    outcome = state.result()["results"][1]
    failed = [row for row in outcome.shards if "failed" in row]
    assert failed, outcome.shards  # the hidden worker took shards
    for row in failed:
        assert row["worker"] == workers[-1]
        assert row["failed"] == (f"the baseline reference {references_dir()}/{outcome.divergence['reference']} is "
                                 f"not on {row['worker']}; every worker must see $PPL_AUDIT_REFERENCES at the same path")
    done = [row for row in outcome.shards if "failed" not in row]
    assert [row["windows"] for row in done] == [[0, 12], [12, 24], [24, 36], [36, 46]]
    assert all(row["worker"] != failed[0]["worker"] for row in done)
    assert np.array_equal(outcome.result.extra["kl"], whole["results"][1].result.extra["kl"])
    assert outcome.result.nll_sum == whole["results"][1].result.nll_sum


@pytest.fixture(scope="module")
def ray_address():
    """A Ray head on 127.0.0.1 started with `ray start` (2 CPUs, no GPU, a small object store): its client address."""
    ray = str(Path(sys.executable).with_name("ray"))
    port, client_port = free_port(), free_port()
    environment = worker_environment() | {"RAY_USAGE_STATS_ENABLED": "0"}  # its workers inherit it
    subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--ray-client-server-port", str(client_port), "--num-cpus", "2", "--num-gpus", "0",
                    "--include-dashboard=false", "--disable-usage-stats", "--object-store-memory", str(300 << 20)],
                   env=environment, check=True, capture_output=True, timeout=180)
    try:
        yield f"ray://127.0.0.1:{client_port}"
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=180)


def test_an_audit_on_a_ray_cluster_in_shards_scores_as_sequential(tmp_path, trained_model_dir, corpus_path,
                                                                   ray_address):
    variants = [{"name": "int8", "method": "torchao-int8"}]
    whole = audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                  return_state=True).result()
    config = write_config(tmp_path / "r.yaml", trained_model_dir, corpus_path, variants,
                          runner={"kind": "ray", "address": ray_address, "shards": 2})
    state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    outcome, alone = state.result()["results"][1], whole["results"][1]
    assert np.array_equal(outcome.result.token_nll, alone.result.token_nll)
    assert np.array_equal(outcome.result.extra["kl"], alone.result.extra["kl"])
    assert outcome.result.nll_sum == alone.result.nll_sum
    assert [row["windows"] for row in outcome.shards] == [[0, 24], [24, 46]]
    assert all(re.fullmatch(r"ray node [\d.]+ \(pid \d+\)", row["worker"]) for row in outcome.shards), outcome.shards
    assert os.getpid() not in {int(re.search(r"pid (\d+)", row["worker"]).group(1)) for row in outcome.shards}


def test_gpus_no_worker_offers_are_one_line_before_anything_loads(cli, tmp_path, trained_model_dir, corpus_path,
                                                                  ray_address):
    """Tasks that ask for a GPU no worker has would wait forever: refused up front, on Ray and on Dask."""
    config = write_config(tmp_path / "g.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"}])
    code, out, err = cli("run", str(config), "--set", "runner.kind=ray", "--set", f"runner.address={ray_address}",
                         "--set", "runner.gpus_per_variant=1")
    assert code == 2 and err.strip().splitlines() == [
        f"ppl-audit: error: runner.gpus_per_variant is 1 but no worker of {ray_address} offers that many GPUs "
        "(the most is 0); start workers with --num-gpus N or lower it"], err
    with dask_cluster(1) as (address, _):
        code, out, err = cli("run", str(config), "--set", "runner.kind=dask", "--set", f"runner.address={address}",
                             "--set", "runner.gpus_per_variant=0.5")
    assert code == 2 and err.strip().splitlines() == [
        f"ppl-audit: error: runner.gpus_per_variant is 0.5 but no worker of {address} offers that many GPUs "
        "(the most is 0); start workers with --resources GPU=N or lower it"], err


def test_a_variant_made_here_is_quantized_once_then_sharded(tmp_path, trained_model_dir, corpus_path, monkeypatch):
    """A gptq variant the audit makes: one task quantizes it, three shards score the checkpoint it made; the
    figures equal a sequential audit of that checkpoint to the last bit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))  # nothing quantized yet; the workers share it
    variants = [{"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32,
                 "calibration": {"samples": 4, "seq_len": 64}}]
    with dask_cluster(2) as (address, workers):
        config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants, name="made-here",
                              runner={"kind": "dask", "address": address, "shards": 3})
        state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    sharded = state.result()["results"][1]
    assert len(list((tmp_path / "cache" / "quantized").iterdir())) == 1
    with get_client(sync_client=True) as api:
        def runs(like: str) -> int:
            return len([run for run in api.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(
                like_=like))) if run.flow_run_id == state.state_details.flow_run_id])

        assert (runs("make-gptq"), runs("score-gptq-windows")) == (1, 3)
    assert {row["worker"] for row in sharded.shards} <= set(workers)
    alone = audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                  return_state=True).result()["results"][1]
    assert alone.manifest == sharded.manifest  # the checkpoint the sharded audit made
    assert np.array_equal(alone.result.token_nll, sharded.result.token_nll)
