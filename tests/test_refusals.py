"""Bad input that once passed silently or failed late (#51): each is one line naming what is wrong and what to do,
exit 2, before Prefect starts or a model loads. Every case runs the command in-process, as a user's would run up to
its refusal: nothing here loads a model or starts a flow."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
from helpers import one_line_error, typed, write_config


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
    from tasks.record.verdict import format_table, judge_row, overall

    row = {"variant": "worse", "method": "gptq", "status": "ok", "reason": "", "delta_ppl_pct": 9384.0,
           "delta_ppl_pct_low": 9000.0, "delta_ppl_pct_high": 9800.0}
    said = judge_row(typed(row), Thresholds())
    assert (said.status, said.said) == ("ungated", "no gate")
    assert said.reason == "ΔPPL +9384.00%, judged against no limit (thresholds)"
    audit = overall(typed({"status": "ok"}), [said])
    assert audit.status == "ungated" and audit.reason.startswith("no variant has a limit in thresholds")
    near = {"variant": "gated", "delta_ppl_pct": 0.5, "delta_ppl_pct_low": 0.1, "delta_ppl_pct_high": 0.9}
    gated = judge_row(typed(row | near), Thresholds(per_variant={"gated": {"max_ppl_increase_pct": 5}}))
    mixed = overall(typed({"status": "ok"}), [gated, said])
    assert mixed.status == "pass" and mixed.reason == "all 1 gated variant(s) passed; no gate for worse"
    assert "no gate: ΔPPL +9384.00%" in format_table([typed(row | {"ppl": 1.0, "ppl_stderr": 0.1, "bits_per_byte": None,
                                                                  "tokens_per_second": 1.0, "weight_mib": 1.0})],
                                                     {"worse": said})


def test_the_stats_block_says_its_errors_are_over_windows():
    """llama-perplexity's ± are over tokens (0.00699 on the same tokens where ours said 0.00908): not one figure."""
    from tasks.engine.paired import divergence_summary, paired_difference
    from tasks.engine.token_figures import TokenFigures
    from tasks.record.verdict import format_stats

    rng = np.random.default_rng(0)
    counts = rng.integers(20, 40, size=10)
    base = rng.gamma(2.0, 1.5, int(counts.sum()))
    variant = base + rng.normal(0, 0.2, len(base))
    extra = TokenFigures(kl=rng.gamma(0.5, 0.02, len(base)), kl_reverse=rng.gamma(0.5, 0.03, len(base)),
                         top1=rng.random(len(base)) < 0.9)
    row = {"variant": "q", "ppl": 10.0, "ppl_stderr": 0.1, "delta_ppl": 0.2, **paired_difference(base, variant, counts),
           **divergence_summary(extra, base, variant, counts)}
    block = format_stats([typed({"variant": "baseline", "ppl": 9.8, "ppl_stderr": 0.1}), typed(row)]).splitlines()
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


@pytest.mark.parametrize("variable", ["PPL_AUDIT_HOME", "PPL_AUDIT_CACHE"])
def test_a_folder_setting_set_but_empty_is_refused(capsys, monkeypatch, tiny_model_dir, corpus_file, variable):
    """Path("") is the current folder: records or caches would be written wherever the command ran."""
    monkeypatch.setenv(variable, "")
    err = one_line_error(capsys, "ppl", "--model", str(tiny_model_dir), "--corpus", str(corpus_file))
    assert err == f"ppl-audit: error: {variable} is set but empty; unset it for its default, or name a folder"


# #67: refused in one line before anything loads, each naming the key (or the `--set`) and what to give instead
MISTAKES = {
    # a GPU index past those visible (on a machine without a GPU, every one) and a device torch cannot name
    "cuda-index": (["run", "{config}", "--set", "variants.0.device=cuda:1"],
                   "int8: device 'cuda:1' asked for, but no CUDA GPU is visible; use device cpu or auto"),
    "device-map-gpu": (["run", "{config}", "--set", "variants.0.device_map={{lm_head: 1}}"],
                       "int8: device_map puts 'lm_head' on '1': device 'cuda:1' asked for, but no CUDA GPU is visible"),
    "cuda-typo": (["run", "{config}", "--set", "variants.0.device=cudax"], "int8: unknown device 'cudax'"),
    # calibration longer than the positions the model was built for: quantized on activations it never saw
    "calibration-past-positions": (["run", "{config}", "--set", "variants.0={{name: g, method: gptq, group_size: 32, "
                                    "calibration: {{samples: 1, seq_len: 512}}}}"],
                                   "g: calibration seq_len 512 is longer than the 256 positions {model} was built for "
                                   "(max_position_embeddings); use 256 or fewer"),
    "quantize-past-positions": (["quantize", "--model", "{model}", "--method", "gptq", "--group-size", "32",
                                 "--calibration", "{corpus}", "--samples", "1", "--seq-len", "512", "--out", "{tmp}/q"],
                                "error: calibration seq_len 512 is longer than the 256 positions {model} was built for"),
    # a boolean where a number is wanted was read as 1 or 0: `max_tokens: true` scored 1 token
    "max-tokens-true": (["run", "{config}", "--set", "evaluation.max_tokens=true"],
                        "evaluation.max_tokens: true is a yes/no (YAML reads true, on and yes as one), not a number; "
                        "give a whole number"),
    "window-on": (["run", "{config}", "--set", "evaluation.window=on"], "evaluation.window: true is a yes/no"),
    "samples-true": (["run", "{config}", "--set", "variants.0={{name: g, method: gptq, group_size: 32, calibration: "
                      "{{samples: true}}}}"], "variants.0.calibration.samples: true is a yes/no"),
    "workers-false": (["run", "{config}", "--set", "runner.workers=false"], "runner.workers: false is a yes/no"),
    "gate-true": (["run", "{config}", "--set", "thresholds.max_ppl_increase_pct=true"],
                  "thresholds.max_ppl_increase_pct: true is a yes/no (YAML reads true, on and yes as one), not a "
                  "number; give a number"),
    "batch-size-true": (["run", "{config}", "--set", "evaluation.batch_size=true"], "evaluation.batch_size: true is a"),
    "device-map-true": (["run", "{config}", "--set", "variants.0.device_map={{lm_head: true}}"],
                        "variants.0.device_map: lm_head: true is a yes/no"),
    # a floor of a dtype it cannot take: a union error named floor.bool before
    "floor-int8": (["run", "{config}", "--set", "evaluation.floor=[int8]"],
                   "evaluation.floor: int8 is not a dtype the noise floor can take; give bfloat16, float16 or both "
                   "(or on, or off)"),
    "floor-float32": (["run", "{config}", "--set", "evaluation.floor=[bfloat16, float32]"],
                      "evaluation.floor: float32 is not a dtype the noise floor can take"),
    "floor-a-string": (["run", "{config}", "--set", "evaluation.floor=float16"],
                       "evaluation.floor: float16 is one dtype; give on, off or a list: [float16]"),
    # a key `--set` made up was blamed on the file
    "set-unknown-key": (["run", "{config}", "--set", "a.b.c=1"], "error: --set a.b.c=1: a: unknown key"),
    "set-unknown-nested": (["run", "{config}", "--set", "evaluation.windw=64"],
                           "error: --set evaluation.windw=64: evaluation.windw: unknown key"),
}


@pytest.mark.parametrize("case", {**CASES, **SIBLINGS, **MISTAKES})
def test_refused_before_anything_starts(capsys, tmp_path, cache, tiny_model_dir, corpus_file, case):
    """Each of ``CASES``, ``SIBLINGS`` and ``MISTAKES``: one line naming what is wrong, before anything is made."""
    args, expected = {**CASES, **SIBLINGS, **MISTAKES}[case]
    (tmp_path / "folder.png").mkdir()
    fill = {"tmp": tmp_path, "model": tiny_model_dir, "corpus": corpus_file,
            "config": audit_yaml(tmp_path, tiny_model_dir, corpus_file)}
    err = one_line_error(capsys, *[arg.format(**fill) for arg in args])
    assert err.startswith("ppl-audit: error: ") and expected.format(**fill) in err, err
    assert not (tmp_path / "q").exists()


def test_a_gpu_index_past_those_visible_names_both():
    """``cuda:N`` on a machine with fewer GPUs failed when the model loaded, not before."""
    from tasks.models.resolve import device_problem

    assert device_problem("cuda:2", 2) == ("device 'cuda:2' asked for, but only 2 CUDA GPUs are visible (cuda:0 to "
                                           "cuda:1); use one of them, or auto")
    assert device_problem("cuda:1", 1) == ("device 'cuda:1' asked for, but only 1 CUDA GPU is visible (cuda:0); use "
                                           "one of them, or auto")
    assert device_problem("cuda:3", 0) == "device 'cuda:3' asked for, but no CUDA GPU is visible; use device cpu or auto"
    assert device_problem("cuda", 0) == "device 'cuda' asked for, but no CUDA GPU is visible; use device cpu or auto"
    assert [device_problem(name, 2) for name in ("cuda", "cuda:0", "cuda:1", "cpu", "auto")] == [None] * 5
    for wrong in ("cuda:x", "cuda:-1", "gpu", "cuda0"):
        assert device_problem(wrong, 2) == f"unknown device '{wrong}'; use cpu, cuda, cuda:N or auto"


def test_a_tab_in_the_yaml_is_named_with_its_line_and_column(capsys, tmp_path, tiny_model_dir, corpus_file):
    """PyYAML's first line said only `while scanning for the next token`."""
    config = Path(audit_yaml(tmp_path, tiny_model_dir, corpus_file))
    lines = config.read_text().splitlines()
    at = lines.index("evaluation:") + 1
    lines[at] = "\t" + lines[at].lstrip()
    config.write_text("\n".join(lines) + "\n")
    assert one_line_error(capsys, "run", str(config)) == (
        f"ppl-audit: error: {config} is not valid YAML: line {at + 1}, column 1: a tab; YAML indents with spaces "
        "only: replace it with spaces")
    config.write_text("name: x\nbaseline: [1, 2\n")
    assert one_line_error(capsys, "run", str(config)) == (
        f"ppl-audit: error: {config} is not valid YAML: line 3, column 1: expected ',' or ']', but got '<stream end>'")


def test_llama_cpp_settings_it_cannot_take_are_refused():
    """`threads: 100000` was accepted, and llama.cpp's worker died with SIGSEGV once scoring started."""
    from tasks.config import LlamaCppSettings, parse
    from tasks.core.errors import InputError

    refused = {
        "threads: 100000": ({"threads": 100_000}, "llama_cpp: threads: 100000 is more than llama.cpp can run (ggml's "
                                                  "most: 512); use at most the machine's cores"),
        "threads: 0": ({"threads": 0}, "llama_cpp: threads: Input should be greater than or equal to 1"),
        "batch: 0": ({"batch": 0}, "llama_cpp: batch: Input should be greater than or equal to 1"),
        "batch: 2**40": ({"batch": 2**40}, "llama_cpp: batch: Input should be less than or equal to 1048576"),
        "gpu_layers: -1": ({"gpu_layers": -1}, "llama_cpp: gpu_layers: Input should be greater than or equal to 0"),
        "gpu_layers: 2**40": ({"gpu_layers": 2**40}, "llama_cpp: gpu_layers: Input should be less than or equal to "
                                                     "2147483647"),
        "threads: true": ({"threads": True}, "llama_cpp: threads: true is a yes/no"),
    }
    for case, (settings, expected) in refused.items():
        with pytest.raises(InputError) as error:
            parse(LlamaCppSettings, settings, "llama_cpp")
        assert str(error.value).startswith(expected), (case, str(error.value))


def test_more_llama_cpp_threads_than_the_machine_has_cores_is_refused(tmp_path):
    import os

    from tasks.audit.preflight import check_audit_settings
    from tasks.config import AuditConfig
    from tasks.core.errors import InputError

    variant = {"name": "q", "method": "gguf", "path": str(tmp_path / "q.gguf"), "runtime": "llama.cpp",
               "llama_cpp": {"threads": os.cpu_count() + 1}}
    config = AuditConfig.model_validate({"name": "a", "baseline": {"path": str(tmp_path)},
                                         "corpus": {"source": "embedded"}, "variants": [variant]})
    with pytest.raises(InputError) as error:
        check_audit_settings(config)
    assert str(error.value) == (f"variant 'q': llama_cpp.threads {os.cpu_count() + 1} is more than this machine's "
                                f"{os.cpu_count()} CPUs; llama.cpp's threads wait on each other: use {os.cpu_count()} "
                                "or fewer (or leave threads out: the cores it may use)")


def test_flash_attn_on_or_off_as_yaml_reads_them_is_taken():
    """YAML reads `flash_attn: on` as true, which was refused with "Input should be 'auto', 'on' or 'off'"."""
    from tasks.config import LlamaCppSettings, read_yaml

    assert LlamaCppSettings.model_validate(read_yaml("flash_attn: on", "x")).flash_attn == "on"
    assert LlamaCppSettings.model_validate(read_yaml("flash_attn: off", "x")).flash_attn == "off"
    assert LlamaCppSettings.model_validate({"flash_attn": "auto"}).flash_attn == "auto"
    assert LlamaCppSettings.model_fields["flash_attn"].annotation == Literal["auto", "on", "off"]
