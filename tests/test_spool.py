"""The spool under stress: two syncs at once, a sync during an audit's own tracking, a record that cannot
be written, an audit killed mid-write. Real processes, a real Prefect server and real MLflow stores."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from helpers import dead_pid, write_config
from mlflow import MlflowClient

from flows.audit import audit
from flows.cli import main
from tasks.core.places import spool_dir
from tasks.record.spool import pending, read_record, sealed_record_json, write_record

ROOT = Path(__file__).resolve().parents[1]  # the tree under test: its subprocesses import this code
PARTIAL = ".partial-"  # spelled out, not imported: these tests also run against the code from before it

# `ppl-audit sync`, entered once its slow imports are done (it says so in a file) and a gate file appears,
# so that two of them (or one and the test) really start replaying at the same moment
GATED_SYNC = """
import sys, time, pathlib
import mlflow, tasks.record.plots, tasks.record.tracking
from flows.cli import main
pathlib.Path(sys.argv[1]).touch()
while not pathlib.Path(sys.argv[2]).exists():
    time.sleep(0.005)
sys.exit(main(["sync"]))
"""

# `ppl-audit run` in a process that may write files of `limit` bytes at most, as on a disk that is full;
# SIGXFSZ ignored (Python's default), a write past it fails with EFBIG, else the kernel kills the process
LIMITED_RUN = """
import resource, signal, sys
import flows.audit, flows.cli  # compiled before the limit
signal.signal(signal.SIGXFSZ, signal.SIG_IGN if sys.argv[1] == "error" else signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
sys.exit(flows.cli.main(["run", sys.argv[3]]))
"""
LIMIT = 12_000  # above the token cache (7 KB), below one variant's per-token arrays (17 KB)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """This test's PPL_AUDIT_HOME, for it and the processes it starts."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("PPL_AUDIT_HOME", str(folder))
    return folder


@pytest.fixture(scope="module")
def audited(tmp_path_factory, prefect_harness, trained_model_dir, corpus_path) -> Path:
    """The record of a real audit (a baseline and one variant) as the flow wrote it."""
    folder = tmp_path_factory.mktemp("audited")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(folder / "home"))
        patch.setenv("PPL_AUDIT_CACHE", str(folder / "cache"))
        config = write_config(folder / "audit.yaml", trained_model_dir, corpus_path,
                              [{"name": "copy", "path": str(trained_model_dir)}], name="spooled",
                              tracking={"uri": f"sqlite:///{folder / 'first.db'}", "experiment": "tests"})
        state = audit(config=str(config), return_state=True)
        assert state.is_completed(), state.message
        [record] = (folder / "home" / "synced").iterdir()
    return record


def spool_copy(audited: Path, target: Path, uri: str) -> str:
    """A copy of the real record at ``target`` as a distinct audit (a new id) tracked to ``uri``; its id."""
    record = read_record(audited) | {"audit_id": uuid.uuid4().hex}
    record["config"]["tracking"]["uri"] = uri
    shutil.copytree(audited, target)
    (target / "record.json").write_text(sealed_record_json(record))
    return record["audit_id"]


def spool_copies(audited: Path, count: int, uri: str) -> list[str]:
    return [spool_copy(audited, spool_dir() / f"{audited.name}-{i}", uri) for i in range(count)]


@pytest.fixture(scope="module")
def made_store(tmp_path_factory) -> Path:
    """A local SQLite store with MLflow's tables made, once a module: making them (MLflow's migrations) took seconds
    a store, in a dozen tests whose subject is what a sync logs, not how a store is made."""
    path = tmp_path_factory.mktemp("made-store") / "store.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(made_store, tmp_path) -> str:
    """A local SQLite store of this test's own, its tables made (two processes both making them is MLflow's own
    race): a copy of the module's made store."""
    shutil.copyfile(made_store, tmp_path / "store.db")
    return f"sqlite:///{tmp_path / 'store.db'}"


def runs_of(client: MlflowClient, audit_id: str) -> tuple[list, list]:
    """(parent runs, child runs) in the store for one audit id."""
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`ppl_audit.audit_id` = '{audit_id}'")
    parents = [r for r in runs if r.data.tags.get("ppl_audit.kind") == "audit"]
    return parents, [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def logged_once(client: MlflowClient, audit_id: str) -> str:
    """The audit's one parent run id, after checking it is complete and has its children, once each."""
    parents, children = runs_of(client, audit_id)
    assert len(parents) == 1 and parents[0].data.tags.get("ppl_audit.complete") == "true"
    assert sorted(r.data.tags["ppl_audit.variant"] for r in children) == ["baseline", "copy"]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    return parents[0].info.run_id


def gated_syncs(folder: Path, count: int) -> tuple[list[subprocess.Popen], Path]:
    """``count`` syncs ready to start; touching the returned gate starts them."""
    gate = folder / "go"
    syncs = [subprocess.Popen([sys.executable, "-c", GATED_SYNC, str(folder / f"ready-{i}"), str(gate)], cwd=ROOT,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(count)]
    deadline = time.monotonic() + 120
    while not all((folder / f"ready-{i}").exists() for i in range(count)):
        assert time.monotonic() < deadline and all(s.poll() is None for s in syncs), "a sync died before the gate"
        time.sleep(0.05)
    return syncs, gate


@pytest.mark.slow  # three sync processes at once
def test_syncs_at_once_log_each_audit_once_to_a_store_not_made_yet(tmp_path, home, audited):
    """Each spooled audit is claimed by one sync alone; and (issue 67) processes tracking at once to a fresh SQLite
    store (two audits on a fresh home) raced on MLflow's making of its tables: one failed with a page of SQL
    (``table experiments already exists``)."""
    uri = f"sqlite:///{tmp_path / 'fresh.db'}"  # not made: the syncs make it
    ids = spool_copies(audited, 4, uri)
    syncs, gate = gated_syncs(tmp_path, 3)
    gate.touch()
    outputs = [process.communicate(timeout=300)[0] for process in syncs]
    for process, output in zip(syncs, outputs):
        assert process.returncode == 0 and "Traceback" not in output, output
    counts = [int(line.split(" of ")[0]) for out in outputs for line in out.splitlines() if "spooled audit(s)" in line]
    assert sum(counts) == 4, outputs
    client = MlflowClient(uri)
    for audit_id in ids:
        logged_once(client, audit_id)
    assert pending() == [] and len(list((home / "synced").iterdir())) == 4


def test_syncs_logging_the_same_new_corpus_at_once_all_link_it(store):
    """MLflow looks a dataset up, then inserts it: four runs logging the same new corpus at the same moment race
    on the store's unique constraint (without the retry, most of ten rounds lost a run's input)."""
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput

    from tasks.record.tracking import _log_dataset

    uri = store
    client = MlflowClient(uri)
    experiment = client.create_experiment("race")
    for round_ in range(10):
        corpus = MetaDataset(source=HTTPDatasetSource("https://example.org/corpus.txt"), name="corpus",
                             digest=f"{round_:016x}")  # a new dataset each round: the race is on its first insert
        runs = [client.create_run(experiment).info.run_id for _ in range(4)]
        start, errors = threading.Barrier(len(runs)), []

        def log(run_id: str) -> None:
            own = MlflowClient(uri)  # a client each, as separate syncs have
            start.wait()
            try:
                _log_dataset(own, run_id, [DatasetInput(corpus._to_mlflow_entity())])
            except Exception as error:  # noqa: BLE001 -- collected and shown by the assert below
                errors.append(error)

        threads = [threading.Thread(target=log, args=(run_id,)) for run_id in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [], f"round {round_}: {errors[0]}"
        for run_id in runs:
            assert [d.dataset.digest for d in client.get_run(run_id).inputs.dataset_inputs] == [corpus.digest]


def test_a_sync_during_an_audits_own_tracking_logs_it_once(tmp_path, home, audited, store):
    from tasks.steps import track

    uri = store
    [audit_id] = spool_copies(audited, 1, uri)
    [folder] = pending()
    [sync], gate = gated_syncs(tmp_path, 1)
    gate.touch()
    run_id = track.fn(folder)  # the task's own body, as the flow runs it, against a real sync process
    output = sync.communicate(timeout=300)[0]
    assert sync.returncode == 0 and "Traceback" not in output, output
    assert logged_once(MlflowClient(uri), audit_id) == run_id
    assert pending() == [] and [p.name for p in (home / "synced").iterdir()] == [folder.name]


def test_tracking_waits_for_a_sync_that_holds_the_record_and_returns_its_run(home, audited, store):
    from tasks.record.spool import claim, mark_synced
    from tasks.record.tracking import replay
    from tasks.steps import track

    uri = store
    [audit_id] = spool_copies(audited, 1, uri)
    [folder] = pending()
    tracked = {}
    with claim(folder) as state:  # as `ppl-audit sync` holds it while it replays the record
        assert state == "mine"
        waiting = threading.Thread(target=lambda: tracked.update(run_id=track.fn(folder)))
        waiting.start()
        run_id = replay(folder)
        mark_synced(folder)
    waiting.join(timeout=120)
    assert tracked["run_id"] == run_id == logged_once(MlflowClient(uri), audit_id)


def run_in_process(tmp_path: Path, trained_model_dir: Path, corpus_path: Path, name: str,
                   limit: int | None = None, on_limit: str = "error") -> subprocess.CompletedProcess:
    """``ppl-audit run`` of an audit (a baseline and one variant) in its own process, on the session's
    Prefect server, writing files of ``limit`` bytes at most when given."""
    from prefect.settings import PREFECT_API_URL

    config = write_config(tmp_path / "audit.yaml", trained_model_dir, corpus_path,
                          [{"name": "copy", "path": str(trained_model_dir)}], name=name,
                          tracking={"uri": f"sqlite:///{tmp_path / 'store.db'}", "experiment": "tests"})
    command = ["-m", "flows.cli", "run", str(config)] if limit is None else \
        ["-c", LIMITED_RUN, on_limit, str(limit), str(config)]
    return subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(),
                               "PPL_AUDIT_CACHE": str(tmp_path / "cache")})


@pytest.mark.slow  # an audit process each
@pytest.mark.parametrize("failure", ["spool is a file", "file too large"])
def test_an_audit_whose_record_cannot_be_written_prints_it_fails_and_leaves_nothing(
        tmp_path, home, prefect_harness, trained_model_dir, corpus_path, failure):
    if failure == "spool is a file":
        (home / "spool").write_text("")
        done = run_in_process(tmp_path, trained_model_dir, corpus_path, "unspooled")
    else:  # EFBIG while writing the first per-token arrays, as a full disk fails a write
        done = run_in_process(tmp_path, trained_model_dir, corpus_path, "unspooled", limit=LIMIT)
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    loud = [line for line in done.stderr.splitlines() if line.startswith("ppl-audit: ERROR:")]
    assert len(loud) == 1 and f"could not write the audit's record in {home / 'spool'}: [Errno" in loud[0], done.stderr
    assert {"spool is a file": "File exists", "file too large": "File too large"}[failure] in loud[0]
    said = [line for line in done.stderr.strip().splitlines() if not line.startswith("log: ")]  # a log's place comes last
    assert said[-1].startswith("ppl-audit: audit failed: record not written: ")
    record, _ = json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{"):])
    assert record["name"] == "unspooled" and record["verdict"]["status"] == "ungated"  # no thresholds: no gate
    assert [v["name"] for v in record["variants"]] == ["baseline", "copy"]
    assert record["variants"][1]["row"]["ppl"] == pytest.approx(record["variants"][0]["row"]["ppl"])
    assert record["variants"][0]["result"]["n_tokens"] > 1000 and record["config"]["name"] == "unspooled"
    assert not (tmp_path / "store.db").exists()  # nothing was sent that the spool did not hold first
    if failure == "file too large":
        assert list((home / "spool").iterdir()) == []


@pytest.mark.slow  # kills an audit process
def test_an_audit_killed_while_writing_its_record_leaves_no_pending_folder_and_sync_sweeps_it(
        tmp_path, home, prefect_harness, trained_model_dir, corpus_path, capsys):
    done = run_in_process(tmp_path, trained_model_dir, corpus_path, "killed", limit=LIMIT, on_limit="die")
    assert done.returncode == -signal.SIGXFSZ, done.stderr[-3000:]  # killed by the kernel mid-write
    [leftover] = spool_dir().iterdir()
    assert leftover.name.startswith(PARTIAL) and not (leftover / "record.json").exists()
    assert pending() == []
    assert main(["sync"]) == 0
    assert list(spool_dir().iterdir()) == []
    assert f"removed {leftover.name}, an unfinished record of a process that died" in capsys.readouterr().err


def partial(name: str, pid: int, host: str = platform.node()) -> Path:
    """A partial folder as a writer that did not get to record.json leaves it."""
    folder = spool_dir() / f"{PARTIAL}{pid}@{host}@20250101T000000-{name}-0123abcd"
    folder.mkdir(parents=True)
    (folder / "baseline.parquet").write_bytes(b"PAR1")
    return folder


def test_sync_sweeps_partial_folders_of_dead_writers_only(home, capsys):
    dead = dead_pid()
    unfinished = partial("unfinished", dead)
    writing = partial("writing", os.getpid())
    (writing / "record.json").write_text("{}")  # a live writer, between record.json and the rename
    elsewhere = partial("elsewhere", dead, host="another-host")  # its pids mean nothing here
    assert pending() == []
    assert main(["sync"]) == 0
    assert not unfinished.exists() and writing.exists() and elsewhere.exists()
    assert f"removed {unfinished.name}" in capsys.readouterr().err
    assert pending() == []


def test_a_complete_record_whose_writer_died_before_the_rename_is_recovered_and_synced(home, audited, store,
                                                                                        capsys):
    uri = store
    final = "20250101T000000-spooled-0123abcd"
    audit_id = spool_copy(audited, spool_dir() / f"{PARTIAL}{dead_pid()}@{platform.node()}@{final}", uri)
    assert pending() == []
    assert main(["sync"]) == 0
    assert f"recovered the record {final}" in capsys.readouterr().err
    assert [p.name for p in (home / "synced").iterdir()] == [final] and list(spool_dir().iterdir()) == []
    logged_once(MlflowClient(uri), audit_id)


def test_writing_a_record_sweeps_what_dead_writers_left(home):
    unfinished = partial("unfinished", dead_pid())
    record = {"audit_id": uuid.uuid4().hex, "name": "next", "created": datetime.now(timezone.utc).isoformat()}
    written = write_record(record, {})
    assert not unfinished.exists() and list(spool_dir().iterdir()) == pending() == [written]
    assert read_record(written) == json.loads(sealed_record_json(record))  # sealed: its digest in it


def _ppl_halved(text: str) -> str:
    """record.json with its variant's PPL edited (issue 67.12: sent as it was, its ΔPPL no longer following)."""
    record = json.loads(text)
    record["variants"][1]["row"]["ppl"] *= 0.5
    return json.dumps(record, indent=2)


@pytest.mark.parametrize("damage,expected", [
    (lambda text: text[: len(text) // 2], "record.json is not readable JSON (JSONDecodeError"),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "verdict"}), "record.json lacks verdict"),
    (_ppl_halved, "{name}/record.json was changed after it was written: its figures are not the audit's; "
                    "to send it as it now is, remove its \"digest\" field"),
], ids=["truncated", "a-field-missing", "a-ppl-edited"])
def test_a_damaged_record_is_set_aside_and_the_others_sync(home, audited, store, capsys, damage, expected):
    """Before, a damaged record failed every later sync (exit 1) and was never set aside: a scheduled sync
    never succeeded again."""
    uri = store
    broken, good = spool_copies(audited, 2, uri)
    folder = spool_dir() / f"{audited.name}-0"
    (folder / "record.json").write_text(damage((folder / "record.json").read_text()))
    assert main(["sync"]) == 0
    out, err = capsys.readouterr()
    [warning] = [line for line in err.splitlines() if "damaged" in line]
    assert warning.startswith(f"ppl-audit: warning: {folder.name} is damaged ({expected.format(name=folder.name)}") and \
        warning.endswith(f"moved to {home / 'quarantine' / folder.name}: inspect its record.json, then move it back "
                         "to the spool or delete it"), warning
    assert "1 of 2 spooled audit(s) synced, 1 damaged" in out
    logged_once(MlflowClient(uri), good)
    assert runs_of(MlflowClient(uri), broken) == ([], [])
    assert (home / "quarantine" / folder.name / "record.json").is_file() and pending() == []
    assert main(["sync"]) == 0  # the next scheduled sync succeeds


def _cut_short(folder: Path) -> None:
    arrays = folder / "copy.parquet"
    arrays.write_bytes(arrays.read_bytes()[: arrays.stat().st_size // 2])


def _wrong_type(folder: Path) -> None:
    record = read_record(folder)
    record["variants"][1]["row"] = "fast"
    (folder / "record.json").write_text(json.dumps(record))


def _deeper_field_missing(folder: Path) -> None:
    """A field ``damage`` does not look for, which the replay reads: it fails on it, not on the server."""
    record = read_record(folder)
    del record["config"]["tracking"]["experiment"]
    (folder / "record.json").write_text(sealed_record_json(record))  # as ppl-audit wrote it: its digest matches


def _older_record_cut_short(folder: Path) -> None:
    """A record spooled before the arrays' digests were kept (no files.json), its arrays cut short."""
    (folder / "files.json").unlink(missing_ok=True)
    _cut_short(folder)


@pytest.mark.parametrize("damage,expected", [
    (_cut_short, "copy.parquet holds "),
    (lambda folder: (folder / "copy.parquet").unlink(), "copy.parquet is missing"),
    (_wrong_type, "record.json holds a value of the wrong type in variants[].row"),
    (_older_record_cut_short, "copy.parquet is missing or not a Parquet file"),
    (_deeper_field_missing, "replaying it failed on its content: KeyError: 'experiment'"),
], ids=["arrays-cut-short", "arrays-missing", "a-field-of-the-wrong-type", "an-older-record-cut-short",
        "a-deeper-field-missing"])
def test_a_record_whose_arrays_or_fields_are_damaged_is_set_aside_and_the_others_sync(home, audited, store, capsys,
                                                                                      damage, expected):
    """Issue 51: such a record failed every sync (exit 1), each leaving a parent run RUNNING in MLflow."""
    uri = store
    broken, good = spool_copies(audited, 2, uri)
    folder = spool_dir() / f"{audited.name}-0"
    damage(folder)
    assert main(["sync"]) == 0
    out, err = capsys.readouterr()
    [warning] = [line for line in err.splitlines() if "damaged" in line]
    assert warning.startswith(f"ppl-audit: warning: {folder.name} is damaged ({expected}"), warning
    assert "1 of 2 spooled audit(s) synced, 1 damaged" in out
    logged_once(MlflowClient(uri), good)
    assert runs_of(MlflowClient(uri), broken) == ([], [])
    assert (home / "quarantine" / folder.name).is_dir() and pending() == []


def test_a_replay_that_fails_midway_leaves_no_parent_run_running(home, audited, store, capsys):
    """Issue 51: each failed replay left its parent run in status RUNNING for good."""
    uri = store
    [audit_id] = spool_copies(audited, 1, uri)
    (home / "mlartifacts").write_text("")  # where a local store's artifacts go: none can be written
    assert main(["sync"]) == 1
    [parent], _ = runs_of(MlflowClient(uri), audit_id)
    assert parent.info.status == "FAILED"
    (home / "mlartifacts").unlink()
    assert main(["sync"]) == 0  # the next sync logs it whole
    logged_once(MlflowClient(uri), audit_id)
