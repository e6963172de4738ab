"""An existing Dask cluster: a real `dask scheduler` and `dask worker` processes on 127.0.0.1, started by the
test, used by an audit through ``runner.address``; an address nothing answers at, and a worker that cannot
see a model folder (hidden from it in its own mount namespace), are one line each before anything loads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import flat, free_port, one_line_error, only, place_prefect_database, wait_for, write_config

from flows.audit import audit, result_of
from tasks.record.result import AuditResult
from tasks.engine.sequential import minimum_windows

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]
DASK = str(Path(sys.executable).with_name("dask"))


def worker_environment() -> dict[str, str]:
    """What a worker on another machine would be configured with: the audit's Prefect server, cache and home."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}


@dataclass
class Network:
    """Hosts on a real network: each in its own network namespace, cabled (a veth pair) to a bridge on this
    machine. ``gateway`` is this machine's address on the bridge; ``hosts`` each host's namespace and address;
    ``cables`` this machine's end of each host's cable (whose counters show what crossed)."""

    gateway: str
    hosts: list[tuple[str, str]]
    cables: list[str]


@contextmanager
def dask_cluster(workers: int, hide: tuple[Path, ...] = (), network: Network | None = None,
                 environment: dict[str, str] | None = None):
    """A scheduler and ``workers`` worker processes; ``(address, worker addresses in start order)``. With
    ``hide``, the last worker runs in its own mount namespace with an empty tmpfs over each of those folders: a
    worker that cannot see them. With ``network``, the scheduler listens on its gateway and worker ``n`` runs on host
    ``n``, reaching the scheduler, and the scheduler and this process reaching it, across the network.
    ``environment``: the workers' own (default ``worker_environment``)."""
    from distributed import Client

    port, host = free_port(), network.gateway if network else "127.0.0.1"
    address = f"tcp://{host}:{port}"
    started = [subprocess.Popen([DASK, "scheduler", "--host", host, "--port", str(port), "--no-dashboard"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for n in range(workers):
            command = [DASK, "worker", address, "--nthreads", "1", "--host", network.hosts[n][1] if network else host,
                       "--no-dashboard", "--name", f"worker-{n}"]
            if network:
                command = ["ip", "netns", "exec", network.hosts[n][0], *command]
            if hide and n == workers - 1:
                mounts = " && ".join(f'mount -t tmpfs none "{folder}"' for folder in hide)
                command = ["unshare", "--mount", "sh", "-c", f'{mounts} && exec "$@"', "sh", *command]
            started.append(subprocess.Popen(command, env=environment or worker_environment(), stdout=subprocess.DEVNULL,
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


@pytest.fixture(scope="module", autouse=True)
def module_cache(tmp_path_factory):
    """``$PPL_AUDIT_CACHE`` of the module's own, for this process and every worker and Ray node the module starts
    (each inherits it): a variant the module's cluster quantizes is made there, in no earlier session's cache (the
    test of one quantized once had a cluster of its own for a fresh cache). The embedded model and corpus are linked
    in from the session's cache, where they are made once."""
    from tasks.core.places import cache_dir
    from tasks.data.embedded import embedded_corpus_dir, embedded_model_dir

    folder = tmp_path_factory.mktemp("cache")
    for made in (embedded_model_dir(), embedded_corpus_dir()):
        if made.is_dir():  # else made in this cache when first needed
            linked = folder / made.relative_to(cache_dir())
            linked.parent.mkdir(parents=True, exist_ok=True)
            linked.symlink_to(made, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def two_workers(prefect_harness):
    """A scheduler and two workers, kept for the module's tests that need no cluster of their own: each start
    costs some 20 CPU-seconds (every worker process imports torch, transformers and Prefect)."""
    with dask_cluster(2) as started:
        yield started


@dataclass(frozen=True)
class Whole:
    """The tiny models' audit run here in one process, unsharded: what an audit on a cluster must equal. ``variants``:
    each variant's config by name; ``result``: its AuditResult."""

    variants: dict[str, dict]
    result: AuditResult

    def configs(self, *names: str) -> list[dict]:
        """The variants ``names``, configured as in this audit."""
        return [self.variants[name] for name in names]

    def outcome(self, name: str):
        """The model ``name``'s outcome (``baseline`` or a variant's)."""
        return next(outcome for outcome in only(self.result).results if outcome.name == name)

    def rows(self, *names: str) -> list[dict]:
        """The rows of the baseline and the variants ``names``, in that order, flat."""
        rows = {row["variant"]: row for row in flat(self.result.rows)}
        return [rows[name] for name in ("baseline", *names)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory, trained_model_dir, corpus_path, noisy_model_dir, prefect_harness) -> Whole:
    """The unsharded audit of the tiny models (quantized at load, a copy, a noisy one), run once for the module's
    tests that compare a cluster's figures with one process's; its baseline reference stays in the references
    folder, where the audits on a cluster find it. Each test ran its own before (six audits): a variant's figures
    are its own whatever else is audited with it (only a row's dominance reads the others, and the test that
    compares whole rows audits all three)."""
    variants = {"int8": {"name": "int8", "method": "torchao-int8"}, "copy": {"name": "copy", "path": str(trained_model_dir)},
                "noisy": {"name": "noisy", "path": str(noisy_model_dir)}}
    config = write_config(tmp_path_factory.mktemp("whole") / "s.yaml", trained_model_dir, corpus_path,
                          list(variants.values()))
    return Whole(variants, audit(config=str(config), return_state=True).result())


def ppl_by_model(rows: list[dict]) -> list[tuple[str, float]]:
    """Each model's name and perplexity, in the rows' order: what an audit elsewhere must equal to the last bit."""
    return [(row["variant"], row["ppl"]) for row in rows]


def test_an_audit_on_an_existing_dask_cluster_scores_as_sequential_and_names_each_worker(
        tmp_path, trained_model_dir, corpus_path, two_workers, whole):
    variants = whole.configs("int8", "copy")
    address, workers = two_workers
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                          runner={"kind": "dask", "address": address})
    state = audit(config=str(config), overrides=["baseline.rescore=always"], return_state=True)
    assert state.is_completed(), state.message
    on_cluster = state.result()
    assert ppl_by_model(flat(on_cluster.rows)) == ppl_by_model(whole.rows("int8", "copy"))  # to the last bit
    ran_on = {outcome.name: outcome.facts.worker for outcome in only(on_cluster).results}
    assert set(ran_on.values()) <= set(workers)  # every model, the baseline too, ran on the cluster's workers
    baseline = only(on_cluster).results[0]
    assert baseline.reference.baseline == "scored" and baseline.shards[0].worker == ran_on["baseline"]


def prefect_servers_under(address: str) -> list:
    """The Prefect servers that the worker processes of the Dask cluster at ``address`` started."""
    import psutil

    workers = [p for p in psutil.Process().children() if address in p.cmdline() and "worker" in p.cmdline()]
    return [p for worker in workers for p in worker.children(recursive=True)
            if "prefect.server.api.server:create_app" in p.cmdline()]


def test_workers_report_to_the_audits_own_server_and_start_none(tmp_path, trained_model_dir, corpus_path,
                                                               prefect_database):
    """Without PREFECT_API_URL the audit starts a temporary server; its tasks on an existing cluster report there.
    Each worker used to start a temporary server of its own (~220 MB, read by nobody), which outlived it. One worker
    shows it (it runs the baseline and the variant): a second cost some 10 CPU-s to start and showed nothing more."""
    import sqlite3

    import psutil

    flow_home, worker_home, home = tmp_path / "flow-prefect", tmp_path / "worker-prefect", tmp_path / "home"
    place_prefect_database(prefect_database, home / "prefect")  # as a user's earlier command left it
    plain = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    with dask_cluster(1, environment=plain | {"PREFECT_HOME": str(worker_home)}) as (address, _):
        config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path,
                              [{"name": "int8", "method": "torchao-int8"}], runner={"kind": "dask", "address": address})
        done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config)], capture_output=True, text=True,
                              timeout=600, env=plain | {"PREFECT_HOME": str(flow_home), "PPL_AUDIT_HOME": str(home)})
        assert done.returncode in (0, 1), done.stderr[-3000:]
        servers = prefect_servers_under(address)
        started = [server.pid for server in servers]
    assert started == [], "workers started Prefect servers of their own"
    assert not any(psutil.pid_exists(pid) for pid in started)
    with sqlite3.connect(home / "prefect" / "prefect.db") as db:  # the audit's own server keeps it there
        names = [name for (name,) in db.execute("select name from task_run")]
    assert any(name.startswith("score-int8") for name in names), names  # run on a worker, seen by the audit's API


# The refusals below are asked of `ppl-audit run` in this process (``one_line_error``: exit 2, one line on stderr, no
# traceback), which has imported what a command imports: a command of its own spent some 5-8 CPU-s importing torch,
# transformers and Prefect to say its one line. test_processes.py runs the console script itself.


def test_an_address_nothing_answers_at_is_one_line_before_anything_loads(capsys, tmp_path, trained_model_dir,
                                                                          corpus_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}],
                          runner={"kind": "dask", "address": address})
    assert one_line_error(capsys, "run", str(config)) == (f"ppl-audit: error: runner.address {address}: nothing "
                                                          "answers there (Connection refused); start the scheduler or "
                                                          "correct the address")


@dataclass
class BlindWorker:
    """A cluster of two whose last worker sees neither the references folder (an unsynced mount) nor ``private`` (a
    folder on one machine only)."""

    address: str
    workers: list[str]
    private: Path


@pytest.fixture(scope="module")
def blind_worker(tmp_path_factory, prefect_harness):
    """``BlindWorker``: one cluster for the module's tests of a worker that cannot see a folder, each of which
    started one of its own (some 20 CPU-s each). The tests that kill, then stop, the worker that sees everything come
    last."""
    from tasks.core.places import references_dir

    private = tmp_path_factory.mktemp("private")
    with dask_cluster(2, hide=(references_dir(), private)) as (address, workers):
        yield BlindWorker(address, workers, private)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) to hide a folder from a worker")
def test_a_model_folder_a_worker_cannot_see_is_one_line(capsys, tmp_path, trained_model_dir, corpus_path,
                                                        blind_worker):
    variant = shutil.copytree(trained_model_dir, blind_worker.private / "variant")
    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, [{"name": "v", "path": str(variant)}])
    address, workers = blind_worker.address, blind_worker.workers
    line = one_line_error(capsys, "run", str(config), "--set", "runner.kind=dask", "--set", f"runner.address={address}")
    named = re.match(rf"ppl-audit: error: runner.address: worker (\S+) cannot see {re.escape(str(variant))} \(v\); ", line)
    assert named and named.group(1) in workers, line


@pytest.mark.parametrize("runner, says", [
    ({"kind": "sequential", "address": "tcp://127.0.0.1:8786"}, "address is a Dask or Ray scheduler's"),
    ({"kind": "dask", "address": "http://127.0.0.1:8787"}, "not a dask scheduler address; use tcp://HOST:8786"),
    ({"kind": "ray", "address": "tcp://127.0.0.1:10001"}, "use ray://HOST:10001 or auto"),
])
def test_an_address_that_cannot_be_a_scheduler_is_one_line(runner, says):
    from tasks.config import Runner, parse
    from tasks.core.errors import InputError

    with pytest.raises(InputError, match=says):
        parse(Runner, runner, "runner")
    assert parse(Runner, {"kind": "ray", "address": "auto"}, "runner").address == "auto"


def test_sharded_models_on_an_existing_cluster_equal_one_worker_bit_for_bit(tmp_path, trained_model_dir,
                                                                            corpus_path, two_workers, whole):
    """Every model, the baseline too (scored again), as 3 slices of its windows over 2 workers: every per-token array
    (NLL, KL both ways, top-1) and every figure equals the unsharded audit's exactly, each shard names the worker it
    ran on, and the reference joined from the baseline's slices holds the bytes of the one written whole."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    from tasks.audit import reference
    from tasks.core.places import references_dir

    variants = list(whole.variants.values())
    written = Path(whole.outcome("baseline").reference.path)
    data = (reference.HIDDEN, reference.SCORES, reference.HEAD)  # the manifest says when; `used` is touched on reuse
    files = {name: (written / name).read_bytes() for name in data if (written / name).exists()}
    manifest = reference.Reference.open(written).manifest.to_json()
    address, workers = two_workers
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                          runner={"kind": "dask", "address": address, "shards": 3})
    state = audit(config=str(config), overrides=["baseline.rescore=always"], return_state=True)
    assert state.is_completed(), state.message
    sharded = state.result()
    baseline = only(sharded).results[0]
    assert [row.windows for row in baseline.shards] == [(0, 16), (16, 32), (32, 46)]
    assert {row.worker for row in baseline.shards} <= set(workers)
    with get_client(sync_client=True) as api:  # the shards ran at once, one on each worker, not one after another
        runs = {name: sorted((run for run in api.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(
            like_=like))) if run.flow_run_id == state.state_details.flow_run_id), key=lambda run: run.start_time)
            for name, like in (("baseline", "score-baseline-windows"), ("int8", "score-int8-windows"),
                               ("join", "join-reference-"))}
    assert len(runs["baseline"]) == 3 and runs["baseline"][1].start_time < runs["baseline"][0].end_time
    # every variant shard reads the first slice (the LM head), not the reference joined from all of them: the join
    # waits for the variants' shards (before #36 they waited for it). Whether one overlaps the baseline's last shard
    # depends on the machine's load (the baseline's shards of this small model last a second).
    first = next(run for run in runs["baseline"] if run.name.endswith("-windows-0-15"))
    assert first.end_time <= runs["int8"][0].start_time
    assert len(runs["join"]) == 1 and max(run.end_time for run in runs["int8"]) <= runs["join"][0].start_time
    assert baseline.reference.path == str(written) and baseline.reference.drift["max_abs_delta_nll"] == 0
    joined = reference.Reference.open(written)
    assert {name: (written / name).read_bytes() for name in data if (written / name).exists()} == files
    made = ("created", "facts", "result", "size_bytes", "digest")  # when, where and how long: not what
    assert {k: v for k, v in joined.manifest.to_json().items() if k not in made} == \
        {k: v for k, v in manifest.items() if k not in made}
    assert joined.verify() is None
    assert not any((references_dir() / ".slices").iterdir())  # the slices are gone once joined
    timing = {"tokens_per_second", "load_seconds", "weight_mib", "baseline", "drift", "drift_from"}  # how long, how made
    assert [{k: v for k, v in row.items() if k not in timing} for row in flat(sharded.rows)] == \
        [{k: v for k, v in row.items() if k not in timing} for row in flat(whole.result.rows)]
    for one, split in zip(only(whole.result).results[1:], only(sharded).results[1:], strict=True):
        a, b = one.result, split.result
        assert (a.nll_sum, a.n_tokens, a.stderr) == (b.nll_sum, b.n_tokens, b.stderr)
        for name, x, y in [("nll", a.token_nll, b.token_nll), ("windows", a.window_nll, b.window_nll),
                           *((key, a.extra[key], split.result.extra[key]) for key in ("kl", "kl_reverse", "top1"))]:
            assert np.array_equal(x, y), name
        assert [row.windows for row in split.shards] == [(0, 16), (16, 32), (32, 46)]
        assert {row.worker for row in split.shards} <= set(workers)
        assert sum(row.tokens for row in split.shards) == b.n_tokens
        assert split.facts.worker.split(", ")[0] == split.shards[0].worker


def test_a_sequential_audit_on_a_cluster_stops_submitting_once_settled_and_runs_a_borderline_one_to_the_end(
        tmp_path, trained_model_dir, corpus_path, noisy_model_dir, two_workers, whole):
    """`evaluation.sequential` with shards: each variant's windows in random pieces over 2 workers, judged as each
    piece returns; a clear variant stops early, a borderline one scores every window and is judged as without it."""
    variants = [{"name": "clear", "path": str(noisy_model_dir)}, {"name": "borderline", "path": str(noisy_model_dir)}]
    fixed = whole.rows("noisy")[1]  # the same model, audited whole
    thresholds = {"max_ppl_increase_pct": 1000, "per_variant": {
        "borderline": {"max_ppl_increase_pct": (fixed["delta_ppl_pct"] + fixed["delta_ppl_pct_high"]) / 2}}}
    address, workers = two_workers
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants, thresholds=thresholds,
                          runner={"kind": "dask", "address": address, "shards": 2})
    state = audit(config=str(config), overrides=["evaluation.sequential=on"], return_state=True)
    summary = result_of(state)
    rows, verdicts = {r["variant"]: r for r in flat(summary.rows)}, {v.name: v for v in summary.verdicts}
    clear, borderline = only(summary).results[1], only(summary).results[2]
    assert verdicts["clear"].status == "pass" and "stopped at" in verdicts["clear"].reason
    assert rows["clear"]["scored_fraction"] < 1 and clear.sequential.decision == "pass"
    assert minimum_windows(46, 4) <= len(clear.sequential.windows) < 46
    pieces = [row.sample for row in clear.shards]
    assert 1 < len(pieces) < 8 and {row.worker for row in clear.shards} <= set(workers)
    assert sorted(w for piece in pieces for w in piece) == list(clear.sequential.windows)  # each window once
    assert verdicts["borderline"].status == "fail" and rows["borderline"]["scored_fraction"] == 1.0
    assert len(borderline.shards) == 8 and borderline.sequential.stopped == "ran to the end"
    for key in ("ppl", "delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "kld_mean", "top1_agreement"):
        assert rows["borderline"][key] == pytest.approx(fixed[key], rel=1e-6, abs=1e-9), key


def kill_a_worker_mid_shard(address: str, name: str, killed: list, unless: str | None = None) -> None:
    """Once a shard of ``name`` has been running for a second (its Prefect task run Running, the scheduler
    processing it on a worker), and no shard of ``unless`` runs (the busy workers are then ``name``'s: a variant's
    shards start while the baseline's still run), kill that worker's process with SIGKILL; its address goes into
    ``killed``."""
    import signal

    from distributed import Client
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterName,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with Client(address, timeout=60, set_as_default=False) as client, get_client(sync_client=True) as api:
        def running(model: str) -> bool:
            # the running ones only, asked of the server: every shard of every earlier audit of the session
            # matches the name, and each look read them all
            shards = TaskRunFilter(name=TaskRunFilterName(like_=f"score-{model}-windows"),
                                   state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING])))
            runs = api.read_task_runs(task_run_filter=shards)
            return any(run.state and run.state.is_running() for run in runs)

        wait_for(lambda: running(name) and not (unless and running(unless)), 300, f"a running shard of {name}",
                 every=0.2)
        time.sleep(1)
        pids = client.run(os.getpid)  # now: a killed worker's nanny starts it again, under another address
        busy = [worker for worker, keys in client.processing().items()
                if keys and worker in pids and worker not in killed]
        os.kill(pids[busy[0]], signal.SIGKILL)
        killed.append(busy[0])


@pytest.fixture(scope="module")
def smollm2_int8_here(tmp_path_factory, prefect_harness):
    """``embedded_int8``'s audit run here, once for the module's tests that need its figures or its baseline reference
    (which stays in the worker's references folder): SmolLM2 and its int8 variant, loaded and scored."""
    return audit(config=str(embedded_int8(tmp_path_factory.mktemp("smollm2") / "s.yaml")), return_state=True).result()


def test_on_a_cluster_the_flow_process_loads_no_model(cli, tmp_path, two_workers):
    """`ppl-audit run` of SmolLM2 (540 MB of float32 weights) and its int8 variant, the baseline scored again: on a
    cluster the flow's process peaks at least 400 MB below the same audit run here, which loads them."""
    def peak_mib(config: Path) -> float:
        """The largest high-water mark (VmHWM) of the command's processes, read until it exits: their rusage would
        start from this test process's, which Linux carries over a fork and an exec."""
        process = subprocess.Popen([str(Path(sys.executable).with_name("ppl-audit")), "run", str(config),
                                    "--set", "baseline.rescore=always"], env=worker_environment(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import psutil

        peak, parent = 0, psutil.Process(process.pid)
        while process.poll() is None:
            with suppress(OSError, psutil.Error):  # the command runs in a child of its own (flows.lifetime)
                for each in [parent, *parent.children(recursive=True)]:
                    for kib in re.findall(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{each.pid}/status").read_text()):
                        peak = max(peak, int(kib))  # none in an exited process's status
            # a high-water mark stays until its process exits, seconds after the models are loaded: five looks a
            # second see it (each look reads every process on the machine, for their parents: 20 took a core's half)
            time.sleep(0.2)
        assert process.returncode == 0
        return peak / 1024

    # what is loaded, not how long it scores, sets the peak: 2 windows of SmolLM2 (one batch), not 7
    short = {"window": 256, "stride": 128, "batch_size": 2, "max_tokens": 384}
    here = peak_mib(embedded_int8(tmp_path / "s.yaml", evaluation=short))
    flow = peak_mib(embedded_int8(tmp_path / "d.yaml", evaluation=short,
                                  runner={"kind": "dask", "address": two_workers[0]}))
    print(f"peak resident memory of the flow's process: {here:.0f} MiB scoring here, {flow:.0f} MiB on a cluster")
    assert flow < here - 400, (flow, here)


def test_a_stopped_audit_s_shard_stops_on_its_worker_within_a_batch(tmp_path, two_workers):
    """Ctrl-C of `ppl-audit run` while its one shard scores on a worker: the command ends (as anywhere) and the
    worker, which Dask cannot make stop a task it runs, stops scoring after its current batch instead of running
    the shard (some 100 batches of SmolLM2) to its end for nobody; it stays in the cluster, free. On the module's
    cluster (a cluster of one of its own cost a scheduler and a worker): the worker that scored it stops."""
    import signal

    from distributed import Client

    from tasks.audit.reference import HIDDEN
    from tasks.core.places import references_dir

    def scoring(dask_worker) -> list[str]:
        """The tasks the worker's threads run: those it still executes, and those let go but running on."""
        return [str(task.key) for task in dask_worker.state.tasks.values() if task.state in ("executing", "cancelled")]

    address, workers = two_workers
    config = embedded_int8(tmp_path / "d.yaml", evaluation={"window": 256, "stride": 128, "batch_size": 2,
                                                            "max_tokens": 24000},
                           runner={"kind": "dask", "address": address})
    with Client(address, timeout=60, set_as_default=False) as client:
        command = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--set",
                                    "baseline.rescore=always"], env=worker_environment(), start_new_session=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # scoring, not loading the model (seconds on a busy machine): its hidden states are being written
        wait_for(lambda: any(path.stat().st_size for path in (references_dir() / ".building").rglob(HIDDEN)), 300,
                 "the baseline's shard scoring on the worker", every=0.2)
        busy = [worker for worker, keys in client.run(scoring).items() if keys]
        assert busy
        os.killpg(command.pid, signal.SIGINT)
        said = command.communicate(timeout=30)[0]
        ended = time.monotonic()
        assert command.returncode == 128 + signal.SIGINT, said[-2000:]
        wait_for(lambda: not client.run(scoring, workers=busy)[busy[0]], 60, "the worker to stop scoring", every=0.2)
        stopped_after = time.monotonic() - ended
        assert sorted(client.scheduler_info()["workers"]) == sorted(workers)  # the same workers, none started again
    print(f"the worker stopped scoring {stopped_after:.1f} s after the command ended")
    assert stopped_after < 10


def test_a_shard_that_fails_on_one_worker_runs_again_on_another(tmp_path, trained_model_dir, corpus_path, whole,
                                                                blind_worker):
    """One worker sees its own, empty references folder (an unsynced mount): the shards it takes cannot read the
    baseline reference, fail, and run again on the other worker; the audit's figures are still exact."""
    from tasks.core.places import references_dir

    workers = blind_worker.workers
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, whole.configs("int8"),
                          runner={"kind": "dask", "address": blind_worker.address, "shards": 4})
    state = audit(config=str(config), return_state=True)  # the baseline's reference, the whole audit's, reused
    assert state.is_completed(), state.message
    outcome = only(state.result()).results[1]
    failed = [row for row in outcome.shards if row.failed is not None]
    assert failed, outcome.shards  # the hidden worker took shards
    for row in failed:
        assert row.worker == workers[-1]
        assert row.failed == (f"the baseline reference {references_dir()}/{outcome.divergence.reference} is "
                              f"not on {row.worker}; every worker must see $PPL_AUDIT_REFERENCES at the same path")
    done = [row for row in outcome.shards if row.failed is None]
    assert [row.windows for row in done] == [(0, 12), (12, 24), (24, 36), (36, 46)]
    assert all(row.worker != failed[0].worker for row in done)
    assert np.array_equal(outcome.result.extra["kl"], whole.outcome("int8").result.extra["kl"])
    assert outcome.result.nll_sum == whole.outcome("int8").result.nll_sum


def embedded_int8(path: Path, **sections) -> Path:
    """The embedded SmolLM2 (a shard runs for seconds) against its int8 variant, with ``sections`` (a runner),
    as a config file at ``path``. 7 windows (1,024 tokens; 11 before): two shards of two batches each, long enough
    to be killed in, and every SmolLM2 audit of the module a third shorter."""
    config = {"name": "int8", "baseline": {"path": "embedded"}, "corpus": {"source": "embedded"},
              "evaluation": {"window": 256, "stride": 128, "batch_size": 2, "max_tokens": 1024},
              "variants": [{"name": "int8", "method": "torchao-int8"}]}
    path.write_text(yaml.safe_dump(config | sections))
    return path


@pytest.mark.usefixtures("smollm2_int8_here")  # its baseline reference, which worker-1 cannot see
def test_a_retry_whose_workers_all_leave_fails_its_variant_instead_of_waiting(tmp_path, blind_worker):
    """The shards that failed on the worker without references are held to the other worker for their second
    try; that worker is killed while one runs: Dask would keep them waiting for it forever, the audit fails the
    variant with both reasons instead."""
    import signal
    import threading

    from distributed import Client

    def held_retries(dask_scheduler) -> int:
        """Tasks held to some workers that have not finished: the second tries (nothing else is held)."""
        return sum(1 for task in dask_scheduler.tasks.values() if task.worker_restrictions and task.state != "memory")

    def kill_the_other_when_a_retry_runs(address: str, killed: list) -> None:
        with Client(address, timeout=60, set_as_default=False) as client:
            pids = client.run(os.getpid)
            # a retry held to the other worker loads SmolLM2 for seconds there: ten looks a second catch it (fifty
            # took the scheduler's and the cluster's CPU from the shards)
            wait_for(lambda: client.run_on_scheduler(held_retries), 300, "a second try of a shard", every=0.1)
            os.kill(pids[workers[0]], signal.SIGKILL)
            killed.append(workers[0])

    killed: list[str] = []
    address, workers = blind_worker.address, blind_worker.workers  # a worker of it is killed
    config = embedded_int8(tmp_path / "d.yaml", runner={"kind": "dask", "address": address, "shards": 4})
    killer = threading.Thread(target=kill_the_other_when_a_retry_runs, args=(address, killed))
    killer.start()
    state = audit(config=str(config), return_state=True)
    killer.join()
    assert killed == [workers[0]]
    _, variant = only(result_of(state)).results
    assert re.fullmatch(r"shard \d of 4: the baseline reference .* is not on tcp://127\.0\.0\.1:\d+; every worker "
                        r"must see \$PPL_AUDIT_REFERENCES at the same path; no other worker is left to run it again",
                        variant.reason), variant.reason


def stop_worker(address: str, name: str) -> None:
    """Stop the worker ``name`` of the cluster at ``address`` for good: its `dask worker` process (the nanny, which
    would start a killed worker again) ends, and its worker with it."""
    import psutil

    [nanny] = [p for p in psutil.Process().children() if address in p.cmdline() and name in p.cmdline()]
    nanny.terminate()
    nanny.wait(timeout=60)


def test_a_shard_that_fails_on_the_only_worker_is_not_tried_there_again(tmp_path, trained_model_dir, corpus_path,
                                                                         whole, blind_worker):
    """A retry elsewhere with nowhere else to go fails at once (Dask would read an empty list of workers as any
    worker, the one it failed on included). The blind cluster's last user: the worker that sees the references
    stopped, the one that does not is the only one left (a cluster of its own cost a scheduler and a worker). The
    tiny model, against the whole audit's baseline reference (which the worker cannot see): no shard runs long
    enough for SmolLM2 to matter, and loading it cost every try seconds."""
    from distributed import Client

    address, blind = blind_worker.address, blind_worker.workers[-1]
    stop_worker(address, "worker-0")
    with Client(address, timeout=60, set_as_default=False) as client:
        wait_for(lambda: list(client.scheduler_info()["workers"]) == [blind], 60, "the blind worker alone", every=0.5)
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, whole.configs("int8"),
                          runner={"kind": "dask", "address": address, "shards": 2})
    _, variant = only(result_of(audit(config=str(config), return_state=True))).results
    assert variant.reason.endswith("; no other worker is left to run it again"), variant.reason
    assert len(variant.shards) == 2, variant.shards  # one try each
    assert all(row.failed is not None for row in variant.shards), variant.shards


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
                                                                   ray_address, whole):
    config = write_config(tmp_path / "r.yaml", trained_model_dir, corpus_path, whole.configs("int8"),
                          runner={"kind": "ray", "address": ray_address, "shards": 2})
    state = audit(config=str(config), overrides=["baseline.rescore=always"], return_state=True)
    assert state.is_completed(), state.message
    for outcome in only(state.result()).results:  # the baseline scored again, in shards
        alone = whole.outcome(outcome.name)
        assert np.array_equal(outcome.result.token_nll, alone.result.token_nll)
        assert outcome.result.nll_sum == alone.result.nll_sum
        assert [row.windows for row in outcome.shards] == [(0, 24), (24, 46)]
        assert all(re.fullmatch(r"ray node [\d.]+ \(pid \d+\)", row.worker) for row in outcome.shards), outcome.shards
        assert os.getpid() not in {int(re.search(r"pid (\d+)", row.worker).group(1)) for row in outcome.shards}
    baseline, variant = only(state.result()).results
    assert np.array_equal(variant.result.extra["kl"], whole.outcome("int8").result.extra["kl"])
    assert baseline.reference.drift["max_abs_delta_nll"] == 0 and baseline.reference.problem is None


def test_a_sequential_audit_on_a_ray_cluster_stops_a_clear_variant_early(tmp_path, trained_model_dir, corpus_path,
                                                                         noisy_model_dir, ray_address):
    variants = [{"name": "clear", "path": str(noisy_model_dir)}]
    config = write_config(tmp_path / "r.yaml", trained_model_dir, corpus_path, variants,
                          thresholds={"max_ppl_increase_pct": 1000},
                          runner={"kind": "ray", "address": ray_address, "shards": 2})
    state = audit(config=str(config), overrides=["evaluation.sequential=on"], return_state=True)
    assert state.is_completed(), state.message
    outcome = only(state.result()).results[1]
    assert outcome.sequential.decision == "pass" and outcome.result.scored_fraction < 1
    assert 1 < len(outcome.shards) < 8
    assert all(re.fullmatch(r"ray node [\d.]+ \(pid \d+\)", row.worker) for row in outcome.shards), outcome.shards


def test_gpus_no_worker_offers_are_one_line_before_anything_loads(capsys, tmp_path, trained_model_dir, corpus_path,
                                                                  ray_address, two_workers):
    """Tasks that ask for a GPU no worker has would wait forever: refused up front, on Ray and on Dask."""
    config = write_config(tmp_path / "g.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"}])
    assert one_line_error(capsys, "run", str(config), "--set", "runner.kind=ray", "--set",
                          f"runner.address={ray_address}", "--set", "runner.gpus_per_variant=1") == (
        f"ppl-audit: error: runner.gpus_per_variant is 1 but no worker of {ray_address} offers that many GPUs "
        "(the most is 0); start workers with --num-gpus N or lower it")
    address = two_workers[0]
    assert one_line_error(capsys, "run", str(config), "--set", "runner.kind=dask", "--set",
                          f"runner.address={address}", "--set", "runner.gpus_per_variant=0.5") == (
        f"ppl-audit: error: runner.gpus_per_variant is 0.5 but no worker of {address} offers that many GPUs "
        "(the most is 0); start workers with --resources GPU=N or lower it")


def test_a_variant_made_here_is_quantized_once_then_sharded(tmp_path, trained_model_dir, corpus_path, two_workers,
                                                            module_cache):
    """A gptq variant the audit makes: one task quantizes it, started before the baseline's shards end (on the
    worker they leave free), three shards score the checkpoint it made; the figures equal a sequential audit of that
    checkpoint to the last bit. On the module's cluster, whose workers share this process's cache, where no test
    made this variant before."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    quantized = module_cache / "quantized"
    before = set(quantized.iterdir()) if quantized.is_dir() else set()
    variants = [{"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32,
                 "calibration": {"samples": 4, "seq_len": 64}}]
    address, workers = two_workers
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants, name="made-here",
                          runner={"kind": "dask", "address": address, "shards": 3})
    state = audit(config=str(config), overrides=["baseline.rescore=always"], return_state=True)
    assert state.is_completed(), state.message
    sharded = only(state.result()).results[1]
    assert len(set(quantized.iterdir()) - before) == 1
    with get_client(sync_client=True) as api:
        def runs(like: str) -> list:
            return [run for run in api.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(
                like_=like))) if run.flow_run_id == state.state_details.flow_run_id]

        assert (len(runs("make-gptq")), len(runs("score-gptq-windows"))) == (1, 3)
        assert runs("make-gptq")[0].start_time < max(run.end_time for run in runs("score-baseline-windows"))
    assert {row.worker for row in sharded.shards} <= set(workers)
    alone = only(audit(config=str(write_config(tmp_path / "s.yaml", trained_model_dir, corpus_path, variants)),
                       return_state=True).result()).results[1]
    assert alone.manifest == sharded.manifest  # the checkpoint the sharded audit made
    assert np.array_equal(alone.result.token_nll, sharded.result.token_nll)


@pytest.fixture(scope="module")
def network():
    """Two hosts on a network made for the test (``ip netns``, veth, a bridge; needs root): a /24 of 10.x picked
    by process id, so that two test sessions on one machine do not meet."""
    tag = f"pa{os.getpid() % 100000}"
    subnet = f"10.{60 + os.getpid() % 150}.{os.getpid() // 150 % 250}"
    bridge, hosts, cables = f"{tag}br", [], []

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        ip("link", "add", bridge, "type", "bridge")
    except (FileNotFoundError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot make a network here (needs iproute2 and root): {getattr(error, 'stderr', error)}")
    try:
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for n in (1, 2):
            namespace, cable, end = f"{tag}h{n}", f"{tag}c{n}", f"{tag}e{n}"
            ip("netns", "add", namespace)
            hosts.append((namespace, f"{subnet}.{10 + n}"))
            ip("link", "add", cable, "type", "veth", "peer", "name", end)
            cables.append(cable)
            ip("link", "set", cable, "master", bridge, "up")
            ip("link", "set", end, "netns", namespace)
            ip("-n", namespace, "addr", "add", f"{subnet}.{10 + n}/24", "dev", end)
            ip("-n", namespace, "link", "set", end, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
        yield Network(f"{subnet}.1", hosts, cables)
    finally:
        for namespace, _ in hosts:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)  # takes its cable end along
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


# A TCP relay: connections to ``argv[1]:argv[2]`` go on, byte for byte, to ``127.0.0.1:argv[3]``.
RELAY = """
import asyncio, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def relay(reader, writer):
    upstream = await asyncio.open_connection("127.0.0.1", int(sys.argv[3]))
    await asyncio.gather(pipe(reader, upstream[1]), pipe(upstream[0], writer), return_exceptions=True)

async def main():
    server = await asyncio.start_server(relay, sys.argv[1], int(sys.argv[2]))
    print("listening", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


@pytest.fixture
def prefect_on_the_network(network):
    """The harness's Prefect server reached at the network's gateway, as workers on other hosts need: its API URL
    there. A relay on this machine carries each connection to the server on 127.0.0.1, where workers on other
    hosts cannot reach it; a server of its own started on the gateway cost 10-17 s (and ~10 CPU-s) to start."""
    from urllib.parse import urlsplit

    from prefect.settings import PREFECT_API_URL, temporary_settings

    port, harness = free_port(), urlsplit(PREFECT_API_URL.value()).port
    url = f"http://{network.gateway}:{port}/api"
    process = subprocess.Popen([sys.executable, "-c", RELAY, network.gateway, str(port), str(harness)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        import httpx

        assert process.stdout.readline() == "listening\n"
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 120, "the Prefect server")
        with temporary_settings({PREFECT_API_URL: url}):
            yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def sent_bytes(cable: str) -> int:
    """Bytes this machine sent down a host's cable."""
    return int(Path(f"/sys/class/net/{cable}/statistics/tx_bytes").read_text())


def test_an_audit_crosses_a_real_network_to_workers_on_two_hosts(caplog, tmp_path, trained_model_dir, corpus_path,
                                                                 network, hosts, prefect_on_the_network, whole):
    """The scheduler and the Prefect server on this machine, one worker on each of two hosts: the variants'
    shards go over the network (each host's cable carries the token stream), run on both hosts, and merge to
    the sequential audit's figures bit for bit. The workers were started with the harness's API (``hosts``):
    each task carries the flow's, the one on the network, to its worker."""
    address, workers = hosts
    before = [sent_bytes(cable) for cable in network.cables]
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, whole.configs("int8", "copy"),
                          runner={"kind": "dask", "address": address, "shards": 2})
    state = audit(config=str(config), return_state=True)
    assert state.is_completed(), state.message
    on_hosts = state.result()
    assert ppl_by_model(flat(on_hosts.rows)) == ppl_by_model(whole.rows("int8", "copy"))  # to the last bit
    for split in only(on_hosts).results[1:]:
        assert np.array_equal(whole.outcome(split.name).result.token_nll, split.result.token_nll)
    ran_on = {row.worker for outcome in only(on_hosts).results[1:] for row in outcome.shards}
    assert ran_on == set(workers) and {w.split("//")[1].split(":")[0] for w in workers} == {a for _, a in network.hosts}
    host = r"tcp://10\.\d+\.\d+\.1[12]:\d+"
    for name in ("int8", "copy"):  # the run's log says which host scored which windows
        said = [record.getMessage() for record in caplog.records if record.getMessage().startswith(f"{name}: ")]
        assert len(said) == 1 and re.fullmatch(rf"{name}: windows 0-\d+ on {host} \(\d+ tokens, [\d.]+ s\); "
                                               rf"windows \d+-\d+ on {host} \(\d+ tokens, [\d.]+ s\)", said[0]), said
    crossed = [sent_bytes(cable) - then for cable, then in zip(network.cables, before)]
    assert all(amount > 100_000 for amount in crossed), crossed  # the audit's stream (and more) went down each cable


@pytest.fixture(scope="module")
def hosts(network, prefect_harness):
    """A worker on each of the network's two hosts, configured with the harness's Prefect API, on this machine's
    127.0.0.1: an address they cannot reach."""
    with dask_cluster(2, network=network) as started:
        yield started


def test_workers_that_cannot_reach_prefects_api_are_one_line_before_anything_loads(cli, tmp_path, trained_model_dir,
                                                                                   corpus_path, hosts):
    """Each task reports to Prefect's API from its worker. Without PREFECT_API_URL the audit would start its
    temporary server on this machine's 127.0.0.1, which workers on other hosts cannot reach."""
    address, workers = hosts
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"}], runner={"kind": "dask", "address": address})
    code, out, err = cli("run", str(config), own_server=True)
    assert code == 2 and "Traceback" not in err
    assert re.fullmatch(rf"ppl-audit: error: runner\.address: worker ({'|'.join(map(re.escape, workers))}) cannot "
                        r"reach this machine's 127\.0\.0\.1 \(Connection refused\): without PREFECT_API_URL the "
                        r"audit starts a temporary Prefect server there, and workers report each task to it; start a "
                        r"Prefect server the workers reach \(prefect server start --host 0\.0\.0\.0\) and set "
                        r"PREFECT_API_URL to its address", err.strip()), err


def test_a_task_that_fails_before_prefect_records_it_fails_its_variant_not_the_audit(
        monkeypatch, tmp_path, trained_model_dir, corpus_path, hosts):
    """The flow's Prefect API on this machine's 127.0.0.1 (the harness's), the workers on other hosts, and the
    check above skipped (as when the API stops answering after it): every shard fails on its worker before
    Prefect has a state for it; the audit ends with the baseline scored and the variant failed with the reason."""
    monkeypatch.setattr("tasks.audit.preflight.check_workers", lambda runner, paths: None)
    variants = [{"name": "int8", "method": "torchao-int8"}]
    config = write_config(tmp_path / "d.yaml", trained_model_dir, corpus_path, variants,
                          runner={"kind": "dask", "address": hosts[0], "shards": 2})
    state = audit(config=str(config), return_state=True)
    assert state.is_failed()
    baseline, variant = only(result_of(state)).results
    assert baseline.ok and baseline.result.ppl > 1
    assert not variant.ok
    assert re.fullmatch(r"shard 1 of 2: RuntimeError: Failed to reach API at http://127\.0\.0\.1:\d+/api/",
                        variant.reason), variant.reason



def test_the_scheduler_always_sees_every_worker(two_workers):
    """Which workers a retry may go to is asked of the cluster each time; the client's cached view, which its own
    periodic refresh empties, said at times that a cluster of two had none, and a shard's retry was given up as
    having no other worker (a full-suite run, 2026-11-27). The refresh made frequent, to make the race likely. The
    module's cluster, not a local one of its own: the client's cache is the same (test_flows.py starts local ones)."""
    import dask

    from flows.scheduler import Scheduler
    from tasks.config import Runner

    address, workers = two_workers
    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}), \
            Scheduler.started(Runner(kind="dask", address=address)) as scheduler:
        seen = [scheduler.elsewhere("no such worker") for _ in range(300)]
    assert all(set(others) == set(workers) for others in seen), sum(len(others) != 2 for others in seen)


@contextmanager
def one_more_worker(address: str, name: str):
    """A worker named ``name`` joins the cluster at ``address`` for the block (configured as the module's were):
    its address. Ended with the block, as a nanny ends its worker."""
    from distributed import Client

    command = [DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard", "--name", name]
    process = subprocess.Popen(command, env=worker_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(address, timeout=60, set_as_default=False) as client:
            def joined() -> str | None:
                known = client.scheduler_info()["workers"]
                return next((worker for worker in known if known[worker]["name"] == name), None)

            yield wait_for(joined, 120, f"the dask worker {name}", every=0.5)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_workers_killed_mid_shard_cost_a_retry_not_the_audit(tmp_path, smollm2_int8_here, two_workers):
    """SmolLM2 and its int8 variant, each in two shards on three workers, the baseline scored again; one worker's
    process is killed while a baseline shard runs, another's while an int8 shard runs: each shard runs again on a
    worker that lives, the audit's figures are the unsharded audit's to the last bit, and the reference joined
    from the baseline's slices holds the hidden states of the one written whole. The module's cluster and a third
    worker (a cluster of three of its own cost a scheduler and three workers, some 30 CPU-s): the last test of that
    cluster, whose killed workers come back under new addresses."""
    import threading

    from tasks.audit.reference import HIDDEN

    whole = smollm2_int8_here
    hidden = (Path(only(whole).results[0].reference.path) / HIDDEN).read_bytes()
    killed: list[str] = []

    def kill_one_each(address: str) -> None:
        kill_a_worker_mid_shard(address, "baseline", killed)
        kill_a_worker_mid_shard(address, "int8", killed, unless="baseline")

    address = two_workers[0]
    with one_more_worker(address, "worker-2") as third:
        workers = [*two_workers[1], third]
        config = embedded_int8(tmp_path / "d.yaml", runner={"kind": "dask", "address": address, "shards": 2})
        killer = threading.Thread(target=kill_one_each, args=(address,))
        killer.start()
        state = audit(config=str(config), overrides=["baseline.rescore=always"], return_state=True)
        killer.join()
    assert state.is_completed(), state.message
    # two workers killed: the second may be the first one started again by its nanny, under a new address
    assert len(set(killed)) == 2 and killed[0] in workers
    for outcome, alone, dead in zip(only(state.result()).results, only(whole).results, killed):
        assert dead not in {row.worker for row in outcome.shards}  # its shard ran again on a live worker
        assert np.array_equal(outcome.result.token_nll, alone.result.token_nll)
        assert outcome.result.nll_sum == alone.result.nll_sum
    baseline = only(state.result()).results[0]
    assert (Path(baseline.reference.path) / HIDDEN).read_bytes() == hidden
