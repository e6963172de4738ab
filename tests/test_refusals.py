"""Bad input that once passed silently or failed late (#51): each is one line naming what is wrong and what to do,
exit 2, before Prefect starts or a model loads. Every case runs the command in-process, as a user's would run up to
its refusal: nothing here loads a model or starts a flow."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import one_line_error, write_config


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text)
    return path


def audit_yaml(folder: Path, model: Path, corpus: Path, variants=None, **sections) -> str:
    """An audit of the tiny model, refused (or not) by what ``sections`` and ``variants`` change."""
    return str(write_config(folder / "audit.yaml", model, corpus, variants or [{"name": "int8", "method": "torchao-int8"}],
                            **sections))


TWICE = """name: twice
baseline: {{path: {model}}}
corpus: {{source: {corpus}}}
evaluation: {{window: 64, max_tokens: 1500}}
variants:
  - name: int8
    method: torchao-int8
    name: other
thresholds:
  max_ppl_increase_pct: 5
thresholds:
  max_ppl_increase_pct: 900
"""


@pytest.mark.parametrize("where,expected", [
    ("top", "twice.yaml: key 'thresholds' is given twice (lines 9 and 11); keep one of them"),
    ("nested", "twice.yaml: key 'name' is given twice (lines 6 and 8); keep one of them"),
])
def test_a_key_given_twice_is_refused(capsys, tmp_path, tiny_model_dir, corpus_file, where, expected):
    """YAML keeps a repeated key's last value: a second thresholds block replaced a gate of 5 by one of 900."""
    text = TWICE.format(model=tiny_model_dir, corpus=corpus_file)
    if where == "nested":  # only the variant's name twice
        text = text[:text.index("thresholds:")]
    (tmp_path / "twice.yaml").write_text(text)
    assert one_line_error(capsys, "run", str(tmp_path / "twice.yaml")).endswith(expected)


LONG = "n" * 300
CASES = {
    # corpus.source "" is Path("") == ".": the audit scored whatever lay in the folder it ran in
    "blank-source": (["run", "{config}", "--set", "corpus.source=''"], "corpus.source: source is empty; give a text file"),
    "blank-ppl-corpus": (["ppl", "--model", "{model}", "--corpus", " "], "arguments: source: source is empty"),
    "hf-without-a-name": (["ppl", "--model", "{model}", "--corpus", "hf:"], "source 'hf:' names no dataset; give hf:NAME"),
    "blank-calibration": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32", "--calibration", "",
                           "--out", "{tmp}/q"], "--calibration: source: source is empty"),
    # names become file names: refused before scoring, not when the record cannot be written
    "long-variant-name": (["run", "{config}", "--set", f"variants.0.name={LONG}"],
                          f"variants.0.name: '{LONG[:40]}…' is 300 characters; use at most 100"),
    "long-audit-name": (["run", "{config}", "--set", "name=" + "a" * 100_000], "name: 'aaaa"),
    "long-quantize-name": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32", "--calibration",
                            "{corpus}", "--out", "{tmp}/q", "--name", LONG], "is 300 characters; use at most 100"),
    "long-experiment": (["run", "{config}", "--set", f"tracking.experiment={LONG}"],
                        "tracking.experiment: 'nnnn"),
    # tracking that can never work: refused, not spooled for a sync that can never succeed
    "ftp-tracking": (["run", "{config}", "--set", "tracking.uri=ftp://x"],
                     "tracking.uri: 'ftp://x' is not an MLflow tracking URI"),
    "http-without-host": (["run", "{config}", "--set", "tracking.uri=http://"], "'http://' names no host; use http://HOST:PORT"),
    "compare-ftp": (["compare", "--baseline", "k", "--tracking-uri", "ftp://x"], "--tracking-uri: 'ftp://x' is not an MLflow"),
    "sync-no-host": (["sync", "--tracking-uri", "https://:5000"], "--tracking-uri: 'https://:5000' names no host"),
    "sqlite-in-no-folder": (["compare", "--baseline", "k", "--tracking-uri", "sqlite:///{tmp}/none/m.db"],
                            "the folder {tmp}/none does not exist"),
    # gptq/awq made here with groups that do not divide the layers' widths: quantized, cached, then unscorable
    "gptq-group-128": (["run", "{config}", "--set", "variants.0={{name: g, method: gptq}}"],
                       "g: group_size 128 does not divide the input widths of {model}'s layers (64, 128); use one of "
                       "-1, 16, 32, 64 (-1: per channel)"),
    "awq-group-128": (["run", "{config}", "--set", "variants.0={{name: a, method: awq, group_size: 128}}"],
                      "a: group_size 128 does not divide the input widths"),
    "quantize-group-128": (["quantize", "--model", "{model}", "--method", "gptq", "--calibration", "{corpus}", "--out",
                            "{tmp}/q"], "group_size 128 does not divide the input widths of {model}'s layers"),
    "ppl-method-gptq": (["ppl", "--model", "{model}", "--corpus", "{corpus}", "--window", "64", "--method", "gptq"],
                        "--method gptq quantizes {model} here: group_size 128 does not divide the input widths"),
    # calibration the corpus cannot supply: gptqmodel was given fewer samples and said so only in its log
    "calibration-past-the-corpus": (["run", "{config}", "--set",
                                     "variants.0={{name: g, method: gptq, group_size: 32, calibration: {{samples: 100000, "
                                     "seq_len: 64}}}}"], "g: calibration: 100000 samples of 64 tokens cannot be drawn"),
    "quantize-past-the-corpus": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32",
                                  "--calibration", "{corpus}", "--samples", "5000", "--seq-len", "64", "--out", "{tmp}/q"],
                                 "calibration: 5000 samples of 64 tokens cannot be drawn: there is room for"),
    "quantize-samples-0": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32", "--calibration",
                            "{corpus}", "--samples", "0", "--out", "{tmp}/q"],
                           "arguments: samples: Input should be greater than or equal to 1"),
    "quantize-out-a-file": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32", "--calibration",
                             "{corpus}", "--out", "{corpus}"], "output folder {corpus} is a file; give a new folder"),
    # the printed chart must be where the chart is: matplotlib writes FOLDER.png and /dev/full.png
    "chart-a-folder": (["compare", "--baseline", "k", "--chart", "{tmp}"], "--chart {tmp}: name a .png file"),
    "chart-dev-full": (["compare", "--baseline", "k", "--chart", "/dev/full"], "--chart /dev/full: name a .png file"),
    "chart-a-png-folder": (["compare", "--baseline", "k", "--chart", "{tmp}/folder.png"], "--chart {tmp}/folder.png is a folder"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_before_anything_starts(capsys, tmp_path, cache, tiny_model_dir, corpus_file, case):
    args, expected = CASES[case]
    (tmp_path / "folder.png").mkdir()
    fill = {"tmp": tmp_path, "model": tiny_model_dir, "corpus": corpus_file,
            "config": audit_yaml(tmp_path, tiny_model_dir, corpus_file)}
    err = one_line_error(capsys, *[arg.format(**fill) for arg in args])
    assert err.startswith("ppl-audit: error: ") and expected.format(**fill) in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.skipif(importlib.util.find_spec("MySQLdb") is not None, reason="mysqlclient is installed here")
@pytest.mark.parametrize("variable", ["MLFLOW_TRACKING_URI", "tracking.uri"])
def test_a_database_without_its_driver_is_refused(capsys, monkeypatch, tmp_path, tiny_model_dir, corpus_file, variable):
    uri = "mysql://user@db.example/mlflow"
    config = audit_yaml(tmp_path, tiny_model_dir, corpus_file)
    if variable == "MLFLOW_TRACKING_URI":
        monkeypatch.setenv(variable, uri)
        argv = ["run", config]
    else:
        argv = ["run", config, "--set", f"tracking.uri={uri}"]
    assert one_line_error(capsys, *argv).endswith(
        f"{variable}: '{uri}' needs the database driver MySQLdb, which is not installed: pip install mysqlclient")


@pytest.mark.parametrize("variable", ["PPL_AUDIT_CACHE", "PPL_AUDIT_REFERENCES"])
def test_a_folder_setting_that_names_a_file_is_refused(capsys, monkeypatch, tmp_path, tiny_model_dir, corpus_file,
                                                       variable):
    """It crashed with NotADirectoryError (…/tokens) after the model had loaded."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(variable, str(tmp_path / "a-file" / "below"))
    err = one_line_error(capsys, "ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus_file))
    assert err == (f"ppl-audit: error: {variable} {tmp_path}/a-file/below: {tmp_path}/a-file is a file, not a folder; "
                   f"set {variable} to a folder (it is made where missing)")


@pytest.mark.parametrize("damage,expected", [
    ("no-added-tokens", "tokenizer.json or tokenizer_config.json is malformed: it lacks the key 'added_tokens'"),
    ("not-json", "tokenizer.json is not readable JSON (Expecting"),
])
def test_a_malformed_tokenizer_says_which_file_and_what_to_do(capsys, tmp_path, tiny_model_dir, corpus_file, damage,
                                                              expected):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    del tokenizer["added_tokens"]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer) if damage == "no-added-tokens" else "{cut sho")
    err = one_line_error(capsys, "ppl", "--model", str(model), "--corpus", str(corpus_file), "--window", "64")
    assert f"cannot load the tokenizer of {model}: {expected}" in err
    assert err.endswith("; copy the tokenizer's files again from where the model came from (or its original repository)")


def test_an_audit_without_a_gate_is_never_said_to_pass():
    """A variant at +9384% read PASS with no thresholds: with no limit, nothing was judged, and the verdict says so."""
    from tasks.config import Thresholds
    from tasks.record.verdict import format_table, judge, overall

    row = {"variant": "worse", "method": "gptq", "status": "ok", "reason": "", "delta_ppl_pct": 9384.0,
           "delta_ppl_pct_low": 9000.0, "delta_ppl_pct_high": 9800.0}
    said = judge(row, Thresholds())
    assert (said.status, said.said) == ("ungated", "no gate")
    assert said.reason == "ΔPPL +9384.00%, judged against no limit (thresholds)"
    audit = overall({"status": "ok"}, [said])
    assert audit.status == "ungated" and audit.reason.startswith("no variant has a limit in thresholds")
    near = {"variant": "gated", "delta_ppl_pct": 0.5, "delta_ppl_pct_low": 0.1, "delta_ppl_pct_high": 0.9}
    gated = judge(row | near, Thresholds(per_variant={"gated": {"max_ppl_increase_pct": 5}}))
    mixed = overall({"status": "ok"}, [gated, said])
    assert mixed.status == "pass" and mixed.reason == "all 1 gated variant(s) passed; no gate for worse"
    assert "no gate: ΔPPL +9384.00%" in format_table([row | {"ppl": 1.0, "ppl_stderr": 0.1, "bits_per_byte": None,
                                                            "tokens_per_second": 1.0, "weight_mib": 1.0}],
                                                     {"worse": said})


def test_the_stats_block_says_its_errors_are_over_windows():
    """llama-perplexity's ± are over tokens (0.00699 on the same tokens where ours said 0.00908): not one figure."""
    from tasks.engine.paired import divergence_summary, paired_difference
    from tasks.record.verdict import format_stats

    rng = np.random.default_rng(0)
    counts = rng.integers(20, 40, size=10)
    base = rng.gamma(2.0, 1.5, int(counts.sum()))
    variant = base + rng.normal(0, 0.2, len(base))
    extra = {"kl": rng.gamma(0.5, 0.02, len(base)), "kl_reverse": rng.gamma(0.5, 0.03, len(base)),
             "top1": rng.random(len(base)) < 0.9}
    row = {"variant": "q", "ppl": 10.0, "ppl_stderr": 0.1, "delta_ppl": 0.2, **paired_difference(base, variant, counts),
           **divergence_summary(extra, base, variant, counts)}
    block = format_stats([{"variant": "baseline", "ppl": 9.8, "ppl_stderr": 0.1}, row]).splitlines()
    assert block[1] == "(± is a standard error over windows, not over tokens as llama-perplexity's: not the same figure)"


def test_a_served_variant_with_groups_that_do_not_fit_fails_alone_before_quantizing(tiny_model_dir):
    """A flow run (a served audit) is not preflighted variant by variant: the lineup refuses it, as a GGUF source."""
    from tasks.audit.checkpoints import prepare
    from tasks.config import BaselineSpec, VariantSpec

    lineup = prepare(BaselineSpec(name="baseline", path=str(tiny_model_dir)),
                     [VariantSpec(name="g", method="gptq"), VariantSpec(name="fits", method="awq", group_size=32)])
    assert [variant.problem for variant in lineup.variants] == [
        f"group_size 128 does not divide the input widths of {tiny_model_dir}'s layers (64, 128); use one of -1, 16, "
        "32, 64 (-1: per channel)", ""]


SIBLINGS = {
    # an empty string is Path("") == ".": the current folder's model, or caches and records, unasked
    "empty-baseline-path": (["run", "{config}", "--set", "baseline.path=''"], "baseline.path: path is empty; name a model"),
    "empty-variant-path": (["run", "{config}", "--set", "variants.0={{name: v, path: ''}}"], "variants.0.path: path is empty"),
    "empty-tracking-uri": (["run", "{config}", "--set", "tracking.uri=''"], "tracking.uri: the tracking URI is empty"),
    "compare-empty-uri": (["compare", "--baseline", "k", "--tracking-uri", ""], "--tracking-uri: the tracking URI is empty"),
    "serve-allow-empty": (["serve", "{config}", "--allow", ""], "--allow '': no such folder"),
    "negative-holdout": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32", "--calibration",
                          "{corpus}", "--holdout-tokens", "-5", "--out", "{tmp}/q"], "--holdout-tokens -5: give a number"),
}


@pytest.mark.parametrize("case", SIBLINGS)
def test_siblings_are_refused_too(capsys, tmp_path, cache, tiny_model_dir, corpus_file, case):
    args, expected = SIBLINGS[case]
    fill = {"tmp": tmp_path, "model": tiny_model_dir, "corpus": corpus_file,
            "config": audit_yaml(tmp_path, tiny_model_dir, corpus_file)}
    err = one_line_error(capsys, *[arg.format(**fill) for arg in args])
    assert expected.format(**fill) in err, err


@pytest.mark.parametrize("variable", ["PPL_AUDIT_HOME", "PPL_AUDIT_CACHE"])
def test_a_folder_setting_set_but_empty_is_refused(capsys, monkeypatch, tiny_model_dir, corpus_file, variable):
    """Path("") is the current folder: records or caches would be written wherever the command ran."""
    monkeypatch.setenv(variable, "")
    err = one_line_error(capsys, "ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus_file))
    assert err == f"ppl-audit: error: {variable} is set but empty; unset it for its default, or name a folder"
