"""What a user of the command line sees: the answer on stdout, one progress bar per stage on stderr, and
library output (warnings, gptqmodel, Prefect, MLflow) in a log file named at the end."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
from contextlib import suppress
from pathlib import Path

import pytest
from helpers import place_prefect_database, write_config

# what the libraries print on every command, in the log and nowhere else
LIBRARY_NOISE = ("Loading weights", "Failed to load", "_pytree", "INFO", "prefect", "Traceback")


def ppl_audit(folder: Path, *args: str, home: Path, cache: Path | None = None) -> subprocess.CompletedProcess:
    """The console script's way in (``python -m flows.cli``), started from ``folder`` as a user's shell
    would, with stderr on a terminal (a pseudo-terminal: progress bars are drawn on terminals only)."""
    # a cache of its own holds its own baseline references too: its audit scores its baseline
    env = {**os.environ, "PPL_AUDIT_HOME": str(home),
           **({"PPL_AUDIT_CACHE": str(cache), "PPL_AUDIT_REFERENCES": str(cache / "references")} if cache else {})}
    reader, writer = pty.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns, as a real one has
    chunks: list[bytes] = []

    def drain() -> None:
        with suppress(OSError):  # EIO once the process is gone and the writer closed
            while chunk := os.read(reader, 1 << 16):
                chunks.append(chunk)

    drainer = threading.Thread(target=drain)
    drainer.start()
    try:
        done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=folder, env=env, stdout=subprocess.PIPE,
                              stderr=writer, timeout=900)
    finally:
        os.close(writer)
        drainer.join()
        os.close(reader)
    # the terminal ends lines with \r\n; a bar redraws itself after a lone \r
    stderr = b"".join(chunks).decode().replace("\r\n", "\n")
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), stderr)


def bars(stderr: str) -> list[str]:
    """The stages that drew a progress bar: each bar's last state, up to its colon."""
    return [line.split("\r")[-1].split(":")[0] for line in stderr.split("\n") if "|" in line]


def named_log(stderr: str) -> Path:
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("log: "), stderr
    return Path(last.removeprefix("log: "))


@pytest.fixture(scope="module")
def quiet_audit(tmp_path_factory, trained_model_dir, corpus_path, prefect_database):
    """A GPTQ variant quantized on the spot and an int8 one, audited from an empty working folder."""
    folder, home = tmp_path_factory.mktemp("user-folder"), tmp_path_factory.mktemp("home")
    # its temporary Prefect server finds the database a user's earlier command made (conftest: the schema's
    # migrations cost ~4 CPU-s, which what this audit shows never needed)
    place_prefect_database(prefect_database, home / "prefect")
    config = write_config(folder / "audit.yaml", trained_model_dir, corpus_path, [
        {"name": "int8", "method": "torchao-int8"},
        {"name": "gptq", "method": "gptq", "bits": 4, "group_size": 32,
         "calibration": {"samples": 4, "seq_len": 64, "seed": 0}}], thresholds={"max_ppl_increase_pct": 50})
    cache = tmp_path_factory.mktemp("cache")
    done = ppl_audit(folder, "run", str(config), "--json", home=home, cache=cache)
    return folder, home, done, cache


def test_an_audit_prints_the_table_the_verdict_and_the_record_only(quiet_audit):
    folder, home, done, cache = quiet_audit
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table, population, tail = lines[:-4], lines[-4], lines[-3:]
    assert "ΔPPL %" in table[0] and [line.split()[0] for line in table[2:]] == ["baseline", "int8", "gptq"]
    assert population.startswith("token population ")  # which tokens the figures are of, under the table
    assert tail[0].startswith("verdict: PASS") and tail[1].startswith("record: MLflow run ")
    result = json.loads(tail[2])
    assert result["verdict"] == "pass" and [m["verdict"] for m in result["models"]] == ["baseline", "pass", "pass"]
    assert not any(noise in done.stdout for noise in LIBRARY_NOISE)


def test_an_audit_draws_one_bar_per_stage_and_names_its_log(quiet_audit):
    folder, home, done, cache = quiet_audit
    assert bars(done.stderr) == ["tokenize", "tokenize calibration", "score baseline", "score int8", "quantize gptq", "score gptq"], done.stderr
    assert not any(noise in done.stderr for noise in LIBRARY_NOISE), done.stderr
    log = named_log(done.stderr)
    assert log.parent == home / "logs" and log.name.endswith(f"-run-audit-{log.stem.rsplit('-', 1)[1]}.log")
    text = log.read_text()
    assert "Loading weights" in text and "prefect" in text.lower() and "gptq" in text.lower()


def test_the_log_keeps_prefect_s_lines_after_gptqmodel_is_imported(quiet_audit):
    """tokenicer (imported with gptqmodel) sets up the root logger as it is imported: the log of an audit that
    quantized with GPTQ used to hold Python's bare ``INFO:prefect:`` lines, no times, no task names, and one line per
    HTTP request to Prefect's server."""
    text = named_log(quiet_audit[2].stderr).read_text()
    finished = r"\d\d:\d\d:\d\d\.\d{3} \| INFO +\| Task run 'score-gptq' - Finished in state Completed"
    assert re.search(finished, text), text[-3000:]
    assert "INFO:httpx" not in text and "INFO:prefect" not in text


def test_gptqmodel_keeps_its_layer_logs_with_the_checkpoint_not_in_the_users_folder(quiet_audit):
    folder, home, done, cache = quiet_audit
    assert sorted(p.name for p in folder.iterdir()) == ["audit.yaml"]
    [checkpoint] = (cache / "quantized").iterdir()
    assert [log.name.split("_")[0] for log in (checkpoint / "quantize-logs").iterdir()] == ["gptq"]


@pytest.mark.slow  # three CLI processes
def test_ppl_output_is_the_figure_and_verbose_shows_the_libraries_live(tmp_path, tiny_model_dir, corpus_path):
    args = ("ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus_path), "--window", "64", "--max-tokens", "300")
    quiet = ppl_audit(tmp_path, *args, home=tmp_path / "home", cache=tmp_path / "cache")  # no stream tokenized yet
    assert quiet.returncode == 0, quiet.stderr
    assert len(quiet.stdout.splitlines()) == 1 and quiet.stdout.startswith(f"{tiny_model_dir.name}: PPL ")
    assert bars(quiet.stderr) == ["tokenize", f"score {tiny_model_dir.name}"]
    assert not any(noise in quiet.stderr for noise in LIBRARY_NOISE), quiet.stderr
    assert "Loading weights" in named_log(quiet.stderr).read_text()
    piped = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=tmp_path, capture_output=True, text=True,
                           env={**os.environ, "PPL_AUDIT_HOME": str(tmp_path / "home")}, timeout=900)
    assert piped.stdout.split(" (")[0] == quiet.stdout.split(" (")[0]
    assert piped.stderr.startswith("log: ") and len(piped.stderr.splitlines()) == 1  # no bars in a CI log
    verbose = ppl_audit(tmp_path, *args, "--verbose", home=tmp_path / "home")
    assert verbose.stdout.split(" (")[0] == quiet.stdout.split(" (")[0]  # the same figure; its speed varies
    assert "Loading weights" in verbose.stderr and "Loading weights" in named_log(verbose.stderr).read_text()


def test_bad_input_is_one_line_and_names_no_log(tmp_path, tiny_model_dir):
    done = ppl_audit(tmp_path, "ppl", "--model", str(tiny_model_dir), "--corpus", str(tmp_path / "missing.txt"),
                     home=tmp_path / "home")
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("ppl-audit: error: corpus not found")


@pytest.mark.parametrize("live", [False, True], ids=["quiet", "verbose"])
def test_a_log_that_cannot_be_written_costs_the_log_only(live):
    """A full disk under the log (/dev/full answers every write with ENOSPC) must not raise from a library's
    print, warning or log line, and --verbose still shows them: the audit goes on to keep its record."""
    script = f"""
import logging, sys, warnings
from pathlib import Path
from tasks.core import console
console.capture(Path("/dev/full"), live={live})
print("library chatter " * 10000)
warnings.warn("a library warning")
logging.basicConfig()
logging.getLogger("library").error("a library error")
console.settle()
print("answer", file=console.out())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "answer\n"), done.stderr
    assert ("a library error" in done.stderr) == live and "Traceback" not in done.stderr
