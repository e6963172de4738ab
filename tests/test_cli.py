"""The ``ppl`` command: its JSON line, and one clear line with exit code 2 for each kind of bad input."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import command_here, json_line, one_line_error, write_config


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return path


def test_ppl_json_line(cli, tiny_model_dir, corpus_file):
    code, out, err = cli("ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--window", "64",
                         "--stride", "32", "--batch-size", "3", "--max-tokens", "500", "--json")
    assert code == 0, err
    result = json_line(out, err)
    assert result["n_tokens"] == 499 and result["window"] == 64 and result["stride"] == 32
    assert result["ppl"] > 1


@pytest.fixture
def bad_files(tmp_path):
    """Corpora and model folders each of which a case below refuses; ``{tmp}`` in a case's arguments."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("a")
    (tmp_path / "rows.jsonl").write_text('{"body": "some words here"}\n')
    (tmp_path / "broken-model").mkdir()
    (tmp_path / "broken-model" / "config.json").write_text("{not json")
    (tmp_path / "no-config").mkdir()
    return tmp_path


@pytest.mark.parametrize("expected,override", [
    pytest.param("stride 64 must be at least 1 and below 64", ["--window", "64", "--stride", "64"], id="stride-equals-window"),
    pytest.param("stride 0 must be", ["--window", "64", "--stride", "0"], id="stride-0"),
    pytest.param("longer than the model's 256 positions", ["--window", "512"], id="window-past-the-model"),
    pytest.param("is empty", ["--corpus", "{tmp}/empty.txt"], id="empty-corpus"),
    pytest.param("perplexity needs at least 2", ["--corpus", "{tmp}/one.txt", "--bos", "none"], id="one-token-corpus"),
    pytest.param("model folder not found", ["--model", "{tmp}/missing"], id="missing-model-folder"),
    pytest.param("has no config.json", ["--model", "{tmp}/no-config"], id="model-without-config"),
    pytest.param("cannot load the config", ["--model", "{tmp}/broken-model"], id="model-with-broken-config"),
    pytest.param("corpus not found", ["--corpus", "{tmp}/missing.txt"], id="missing-corpus"),
    pytest.param("column 'text' not in", ["--corpus", "{tmp}/rows.jsonl"], id="jsonl-without-text-column"),
    pytest.param("chunks applies to modes gptq and llama.cpp", ["--chunks", "3"], id="chunks-in-sliding-mode"),
    pytest.param("give chunks or max_tokens, not both", ["--mode", "gptq", "--chunks", "3", "--max-tokens", "300"],
                 id="chunks-and-max-tokens"),
    pytest.param("chunks is 0", ["--mode", "gptq", "--chunks", "0"], id="chunks-0"),
    pytest.param("window 0 must hold at least 2 tokens", ["--window", "0"], id="window-0"),
])
def test_bad_input_gets_one_line_and_exit_2(capsys, bad_files, tiny_model_dir, corpus_file, expected, override):
    override = [item.format(tmp=bad_files) for item in override]
    args = {"--model": str(tiny_model_dir), "--corpus": str(corpus_file), "--window": "64",
            **dict(zip(override[::2], override[1::2]))}
    argv = ["ppl"] + [item for pair in args.items() for item in pair]
    assert expected in one_line_error(capsys, *argv), argv


def test_offline_hub_id_gets_one_line(capsys, monkeypatch, corpus_file):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line_error(capsys, "ppl", "--model", "no-such-org/no-such-model", "--corpus", str(corpus_file))
    assert "no-such-org/no-such-model" in err


def ppl_here(capsys, *args: str) -> tuple[str, str]:
    """``ppl-audit ppl ARGS --json`` run in this process (as test_ppl_json_line's command runs it): its stdout and
    stderr, the command checked to have succeeded."""
    code, out, err = command_here(capsys, "ppl", *args, "--json")
    assert code == 0, err
    return out, err


def test_ppl_json_names_the_model_and_the_method(capsys, tiny_model_dir, corpus_file):
    result = json_line(*ppl_here(capsys, "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--window",
                                 "64", "--max-tokens", "300", "--method", "bnb-int8"))
    assert (result["model"], result["method"], result["name"]) == (str(tiny_model_dir), "bnb-int8", "bnb-int8")


def test_chunk_modes_give_per_byte_figures_of_the_scored_text(capsys, tiny_model_dir, corpus_file, tokenizer):
    """gptq mode, 4 chunks of 64: bits/byte over the decoded text of the tokens scored, never NaN."""
    import math

    from tasks.data.corpus import tokenize

    out, err = ppl_here(capsys, "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--window", "64",
                        "--mode", "gptq", "--chunks", "4")
    assert "nan" not in out.lower()
    result = json_line(out, err)
    assert result["bos"] == "none" and result["n_windows"] == 4 and result["n_tokens"] == 4 * 63
    ids = tokenize(corpus_file.read_text(), tokenizer, bos="none", max_tokens=256).ids
    scored = [tokenizer.decode(ids[i * 64 + 1 : (i + 1) * 64]) for i in range(4)]
    assert result["n_bytes"] == sum(len(text.encode()) for text in scored)
    assert result["n_words"] == sum(len(text.split()) for text in scored)
    assert result["bits_per_byte"] == pytest.approx(result["nll_sum"] / (result["n_bytes"] * math.log(2)))


def test_quantize_refuses_a_name_no_audit_could_use(capsys, tmp_path, tiny_model_dir, corpus_file):
    err = one_line_error(capsys, "quantize", "--model", str(tiny_model_dir), "--method", "gptq", "--calibration",
                         str(corpus_file), "--out", str(tmp_path / "out"), "--name", "my variant")
    assert "name 'my variant' may hold only letters, digits" in err


@pytest.mark.parametrize("command", ["run", "quantize", "ppl"])
def test_gptq_and_awq_are_not_made_from_a_gguf_file(capsys, tmp_path, corpus_file, command):
    """gptqmodel failed on one after the baseline was scored, and swapped the gguf module under transformers for its
    own: every GGUF model the process loaded afterwards (an hqq variant of the same baseline) failed too."""
    from tasks.data.embedded import embedded_gguf

    gguf = str(embedded_gguf())
    variants = [{"name": "g", "method": "gptq"}, {"name": "h", "method": "hqq"}]
    argv = {"run": ["run", str(write_config(tmp_path / "a.yaml", Path(gguf), corpus_file, variants))],
            "quantize": ["quantize", "--model", gguf, "--method", "awq", "--calibration", str(corpus_file), "--out",
                         str(tmp_path / "out")],
            "ppl": ["ppl", "--model", gguf, "--method", "gptq", "--corpus", str(corpus_file)]}[command]
    assert one_line_error(capsys, *argv).endswith(
        f"{gguf} is a GGUF file; gptq and awq are made from a Hugging Face checkpoint (a folder with config.json, or a "
        "Hub id): give that model, or a gptq/awq checkpoint's path")


@pytest.mark.slow  # a CLI process each
@pytest.mark.parametrize("text", ["我们今天去公园散步，天气很好。" * 120, "\0" * 5000], ids=["chinese", "nul-bytes"])
def test_text_without_spaces_gives_no_word_ppl_and_no_crash(cli, tiny_model_dir, tmp_path, text):
    """Few whitespace 'words' make exp(nll_sum / n_words) overflow a float: the figure is absent, not a crash."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    code, out, err = cli("ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--window", "64", "--json")
    assert code == 0, err

    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON line")

    result = json_line(out, err, parse_constant=refuse)
    assert result["n_words"] <= 1 and result["word_ppl"] is None
    assert result["ppl"] > 1 and result["bits_per_byte"] > 0
    why = result["absent"]["word_ppl"]
    assert why in ("no words were counted in the scored text", "e^{:.0f} is past a float: the scored text has too few "
                   "words (1)".format(result["nll_sum"]))
    assert f"no word_ppl: {why}" in out


@pytest.mark.parametrize("args,expected", [
    (["run", "--stats", "bogus", "{tmp}/x.yaml"], "ppl-audit run: error: argument --stats: invalid choice: 'bogus'"),
    (["ppl", "--dtype", "float8", "--model", "m", "--corpus", "c"], "ppl-audit ppl: error: argument --dtype: invalid choice"),
    (["reference", "frobnicate"], "ppl-audit reference: error: argument action: invalid choice: 'frobnicate'"),
    (["ui", "--port", "99999"], "ppl-audit ui: error: argument --port: 99999 is not a TCP port (1 to 65535)"),
    (["ui", "--port", "{taken}"], "ppl-audit: error: port {taken} on 127.0.0.1 is taken"),
    (["run", "{tmp}/latin1.yaml"], "ppl-audit: error: {tmp}/latin1.yaml is not UTF-8 text (byte 6)"),
    (["run", "{tmp}/x.yaml", "--set", "evaluation.window=["], "ppl-audit: error: --set evaluation.window=[: the value is not YAML"),
    (["ppl", "--model", "{model}", "--corpus", "/dev/zero"], "ppl-audit: error: corpus /dev/zero is not a regular file"),
    (["ppl", "--model", "{model}", "--corpus", "{tmp}/fifo.txt"], "ppl-audit: error: corpus {tmp}/fifo.txt is not a regular file"),
    (["ppl", "--model", "{tmp}/listed", "--corpus", "{corpus}"], "holds quantization_config [1, 2], not a mapping"),
    (["ppl", "--model", "{tmp}/bitless", "--corpus", "{corpus}"], "says quant_method gptq but gives no bits"),
    (["ppl", "--model", "{tmp}/cut.gguf", "--corpus", "{corpus}"], "{tmp}/cut.gguf: it is cut short or damaged"),
    (["ppl", "--model", "{tmp}/absurd.gguf", "--corpus", "{corpus}"], "{tmp}/absurd.gguf: it is cut short or damaged"),
], ids=["argparse-choice", "argparse-dtype", "argparse-action", "port-out-of-range", "port-taken", "config-not-utf8",
        "set-not-yaml", "dev-zero", "fifo", "quantization-config-a-list", "gptq-without-bits", "gguf-cut-short",
        "gguf-absurd-count"])
def test_more_bad_input_is_one_line_exit_2_and_leaves_no_log(tmp_path, monkeypatch, capsys, tiny_model_dir, corpus_file,
                                                           args, expected):
    """Found by a probe of bad inputs (#30): usage blocks, tracebacks, crashes, a read that never ends. In-process
    (``main``, what the console script calls); the script's own process is the next test's."""
    home = tmp_path / "home"
    monkeypatch.setenv("PPL_AUDIT_HOME", str(home))
    with _bad_inputs(tmp_path, tiny_model_dir, corpus_file) as fill:
        argv, expected = [a.format(**fill) for a in args], expected.format(**fill)
        code, out, err = command_here(capsys, *argv)
    assert code == 2 and out == "", err
    assert err.count("\n") == 1 and err.startswith("ppl-audit") and expected in err, err
    assert not list(home.glob("logs/*")), "a refused command leaves no log behind"


def test_a_read_that_never_ends_through_the_console_script_is_one_line_and_leaves_no_log(tmp_path, tiny_model_dir,
                                                                                          corpus_file):
    """The probe's fifo as a user meets it: the console script's process ends (a timeout here, not a hung test, had
    the read begun) with one line, exit code 2, and no log."""
    home = tmp_path / "home"
    with _bad_inputs(tmp_path, tiny_model_dir, corpus_file):
        done = subprocess.run([sys.executable, "-m", "flows.cli", "ppl", "--model", str(tiny_model_dir), "--corpus",
                               str(tmp_path / "fifo.txt")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PPL_AUDIT_HOME": str(home)})
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.count("\n") == 1 and \
        done.stderr.startswith(f"ppl-audit: error: corpus {tmp_path}/fifo.txt is not a regular file"), done.stderr
    assert not list(home.glob("logs/*")), "a refused command leaves no log behind"


@contextmanager
def _bad_inputs(tmp_path: Path, tiny_model_dir: Path, corpus_file: Path):
    """The probe's bad files written in ``tmp_path``, and a port taken while the case runs: the cases' ``{...}``."""
    import json
    import socket
    import struct

    from tasks.data.embedded import embedded_gguf

    (tmp_path / "latin1.yaml").write_bytes(b"name: \xe9t\xe9\n")
    write_config(tmp_path / "x.yaml", tiny_model_dir, corpus_file, [{"name": "int8", "method": "torchao-int8"}])
    os.mkfifo(tmp_path / "fifo.txt")
    for name, quantization in (("listed", [1, 2]), ("bitless", {"quant_method": "gptq"})):
        shutil.copytree(tiny_model_dir, tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    head = embedded_gguf().read_bytes()[:4096]
    (tmp_path / "cut.gguf").write_bytes(head[:1000])
    (tmp_path / "absurd.gguf").write_bytes(head[:16] + struct.pack("<Q", 2**60) + head[24:])  # 2^60 metadata keys
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield {"tmp": tmp_path, "model": tiny_model_dir, "corpus": corpus_file, "taken": taken.getsockname()[1]}


def test_an_unwritable_home_is_one_line(tmp_path, tiny_model_dir, corpus_file):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    done = subprocess.run([sys.executable, "-m", "flows.cli", "ppl", "--model", str(tiny_model_dir), "--corpus",
                           str(corpus_file)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PPL_AUDIT_HOME": str(blocked / "home")})
    assert done.returncode == 2 and done.stderr.startswith("ppl-audit: error: cannot write the log ") and \
        done.stderr.strip().endswith("(Not a directory); set PPL_AUDIT_HOME to a folder you can write"), done.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops root's override of file permissions with setpriv")
@pytest.mark.parametrize("what", ["config", "model folder"])
def test_input_without_read_permission_is_one_line(tmp_path, tiny_model_dir, corpus_file, what):
    """As any user but root meets it (root reads everything: the command runs without that capability)."""
    locked = tmp_path / "locked"
    if what == "config":
        write_config(locked, tiny_model_dir, corpus_file, [{"name": "int8", "method": "torchao-int8"}])
        args, expected = ["run", str(locked)], f"ppl-audit: error: cannot read config {locked}: Permission denied"
    else:
        shutil.copytree(tiny_model_dir, locked)
        args = ["ppl", "--model", str(locked), "--corpus", str(corpus_file)]
        expected = f"ppl-audit: error: cannot read model {locked}: Permission denied; give this user read access to it"
    locked.chmod(0)
    done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m", "flows.cli",
                           *args], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    locked.chmod(0o755)
    assert done.returncode == 2 and done.stderr.strip() == expected, done.stderr


def test_a_config_name_too_long_for_the_log_s_name_is_said_not_blamed_on_the_home(cli, tmp_path):
    """The log file is named after the config: a 250-character name, which the file system takes, made the log's name
    too long, and the command said it could not write its log and to set PPL_AUDIT_HOME (issue 67's probe)."""
    code, _, err = cli("run", str(tmp_path / ("a" * 250 + ".yaml")))
    assert code == 2 and "config not found" in err and "cannot write the log" not in err, err
