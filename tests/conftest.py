"""Fixtures: small models built locally from a config and a fixed seed, a tokenizer trained on the spot,
a corpus, a Prefect server, and a temporary audit home. The plain functions behind them live in helpers.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import build_llama, build_tokenizer, make_text, train_briefly

# This project's machines reach no model hub. Offline, the Hub libraries refuse a Hub name at once; online they
# wait ~23 s for the resolver to give up. They read these once, when first imported, so a test's own setenv
# came too late whenever another test had imported them first. Set before any test (or process it starts) runs.
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

# The suite runs one xdist worker per core, and each starts processes of its own (commands, servers, workers). When
# every one of them also split each tensor operation over all the cores, they fought for them (OpenMP's threads spin
# while they wait): the quick tier took 5 min 4 s on 2 cores, 3 min 27 s with a thread each. So each worker, and all
# it starts, gets its share of the cores, as Dask's nannies give theirs. Alone (-n0), a test keeps them all.
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
os.environ.update(OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS))
torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_llama(folder, tokenizer)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from tasks.models.loading import load_model

    return load_model(str(tiny_model_dir), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def tiny_model64(tmp_path_factory, tokenizer):
    return build_llama(tmp_path_factory.mktemp("tiny-llama64"), tokenizer, dtype=torch.float64)


@pytest.fixture(scope="session")
def text() -> str:
    return make_text(3000)


@pytest.fixture(scope="session")
def cli(prefect_harness):
    """Run ``ppl-audit`` as users do, in a subprocess: returns (exit code, stdout, stderr). Its audits report to the
    session's Prefect server, as a user's do with PREFECT_API_URL set (without it each command starts a temporary
    server of its own: ~10 s); ``own_server``: as a user's without it."""
    import subprocess

    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()

    def run(*args: str, timeout: float = 600, own_server: bool = False):
        env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}  # as a test set it
        done = subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=env if own_server else env | {"PREFECT_API_URL": url})
        return done.returncode, done.stdout, done.stderr

    return run


def built_once(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """The folder ``build(folder)`` makes, made once per test session whatever the number of xdist workers: the first
    to ask builds it, under a lock, the others wait and use it (each would build the same bytes: the builds are
    seeded). Read-only to tests, like any session fixture."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent  # the session's folder, which its workers share
    folder = root / name
    with FileLock(f"{folder}.lock"):
        if not folder.is_dir():
            scratch = root / f".{name}-{worker_id}"
            build(scratch)
            scratch.rename(folder)
    return folder


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory, tokenizer, worker_id) -> Path:
    """A 128-wide, 2-layer Llama trained briefly: widths that GPTQ/AWQ group sizes 32/64 divide. Training it takes
    ~35 s: once a session."""
    def build(folder: Path) -> None:
        model = build_llama(folder, tokenizer, hidden_size=128, intermediate_size=256, initializer_range=0.02)
        train_briefly(model, tokenizer)
        model.save_pretrained(folder)

    return built_once(tmp_path_factory, worker_id, "trained-llama", build)


@pytest.fixture(scope="session")
def prefect_harness():
    """A real, temporary Prefect server and database for the whole session (it takes 10-17 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_database(tmp_path_factory, worker_id) -> Path:
    """An empty Prefect database at the installed Prefect's schema, made once a session. A test that starts a Prefect
    server in a folder of its own (a command's temporary one, `serve`'s, the network's) puts a copy where it will look,
    as a user's later commands find the first one's: making the schema (Prefect's 114 migrations) costs each new
    server ~4 CPU-s, which tests of how processes stop and what they report never needed."""
    import subprocess

    def build(folder: Path) -> None:
        folder.mkdir()
        subprocess.run([str(Path(sys.executable).with_name("prefect")), "server", "database", "upgrade", "-y"],
                       env={**os.environ, "PREFECT_HOME": str(folder),
                            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{folder / 'prefect.db'}"},
                       check=True, capture_output=True, timeout=300)

    return built_once(tmp_path_factory, worker_id, "prefect-database", build) / "prefect.db"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A quantization and token cache of the module's own (a module may override it with one per test)."""
    with pytest.MonkeyPatch.context() as patch:
        folder = tmp_path_factory.mktemp("cache")
        patch.setenv("PPL_AUDIT_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="session")
def corpus_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audit-corpus") / "corpus.txt"
    path.write_text(make_text(3000))
    return path


@pytest.fixture(scope="session")
def noisy_model_dir(tmp_path_factory, trained_model_dir, tokenizer) -> Path:
    """The trained model with noise added to its weights: clearly worse, same tokenizer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_model_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, weight in model.named_parameters():
            if weight.ndim == 2:  # the briefly trained model leans on its embeddings and head: noise them too
                weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * 0.5)
    folder = tmp_path_factory.mktemp("noisy-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pytest_configure(config):
    """The tests call flows and tasks as the command line does, after the same process set-up."""
    from flows.cli import process_defaults

    process_defaults()
    # Prefect's console log handler keeps the sys.stderr of when its logging is set up (at the first `from prefect
    # import flow`). Set up by a test that captures with capsys, it kept that test's stream, closed after it: the
    # worker's next flow failed with "I/O operation on closed file", then a RecursionError (test_diagnose.py alone,
    # -n0). Set up here, it keeps pytest's own, as when any other test came first.
    try:
        from prefect.logging.configuration import ensure_logging_setup
    except ModuleNotFoundError:  # a GPU machine's image runs tests/gpu without Prefect (benchmarks/gpu.py)
        return
    ensure_logging_setup()


_FILE_SECONDS: dict[str, float] = {}  # each test file's tests' durations (set-up, call, tear-down), summed


def pytest_runtest_logreport(report):
    """Each file's time, for the table CI prints at the end (``pytest_terminal_summary``): with xdist the workers'
    reports reach the controller, which sums them."""
    file = report.nodeid.split("::")[0]
    _FILE_SECONDS[file] = _FILE_SECONDS.get(file, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Each test file's time, slowest first (with ``--durations=20``'s slowest tests above it): where the suite's
    time goes, as docs/benchmarks.md keeps it. A file's tests run on one worker (``--dist loadfile``), so its sum is
    the least wall time the suite can take."""
    if not _FILE_SECONDS:
        return
    terminalreporter.write_sep("=", "time by test file (set-up, call and tear-down of its tests, summed)")
    total = sum(_FILE_SECONDS.values())
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  100.0%  every file")


@pytest.fixture(autouse=True, scope="session")
def audit_home(tmp_path_factory):
    """Spooled records, baseline references and the local MLflow store of every test (and of the processes tests start) stay
    in a temporary folder, never in the user's ~/.ppl-audit. Modules that inspect it set their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(tmp_path_factory.mktemp("ppl-audit-home")))
        # baseline references too: a test's audit never reuses one from an earlier session
        patch.setenv("PPL_AUDIT_REFERENCES", str(tmp_path_factory.mktemp("references")))
        yield
