"""The embedded default: Austen from the Debian package, SmolLM2 from the GGUF file, a sane PPL."""

from __future__ import annotations

import math

import pytest
from helpers import command_here, json_line

from tasks.core.places import cache_dir
from tasks.data.embedded import austen_novels, reflow

NOVELS = {"emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"}


def test_austen_novels_come_out_of_the_deb_as_plain_prose():
    debs = sorted((cache_dir() / "downloads").glob("r-cran-janeaustenr_*.deb"))
    assert debs, f"no r-cran-janeaustenr_*.deb in {cache_dir() / 'downloads'}: the embedded corpus was never fetched"
    deb = debs[-1]
    novels = austen_novels(deb.read_bytes())
    assert set(novels) == NOVELS
    pride = novels["prideprejudice"]
    assert "It is a truth universally acknowledged, that a single man in possession of a good fortune, " \
           "must be in want of a wife." in pride
    assert 3_500_000 < sum(len(text) for text in novels.values()) < 4_500_000


def test_reflow_joins_wrapped_lines_and_keeps_paragraphs():
    assert reflow(["One line", "wrapped here.", "", "", "Next  ", "paragraph."]) == "One line wrapped here.\n\nNext paragraph."


@pytest.mark.slow  # the embedded 135M model
def test_embedded_model_gives_a_sane_perplexity_on_the_embedded_corpus(cli):
    code, out, err = cli("ppl", "--model", "embedded", "--corpus", "embedded", "--max-tokens", "3000",
                         "--batch-size", "4", "--json")
    assert code == 0, err
    result = json_line(out, err)
    required = {"model", "ppl", "nll_sum", "n_tokens", "mean_nll", "stderr", "window", "stride", "batch_size",
                "bos", "tokens_per_second", "peak_memory_bytes"}
    assert required <= set(result)
    assert result["n_tokens"] == 2999 and result["bos"] == "stream"
    assert 10 < result["ppl"] < 80
    assert math.isclose(result["ppl"], math.exp(result["nll_sum"] / result["n_tokens"]), rel_tol=1e-12)


@pytest.fixture(scope="module")
def embedded():
    """The embedded model in float32 and its tokenizer, with 1024 tokens of the embedded corpus."""
    import torch

    from tasks.config import CorpusConfig
    from tasks.data.corpus import corpus_text, tokenize
    from tasks.models.loading import load_model
    from tasks.models.resolve import load_tokenizer

    tokenizer = load_tokenizer("embedded")
    stream = tokenize(corpus_text(CorpusConfig(source="embedded")), tokenizer, bos="none", max_tokens=1024)
    return load_model("embedded", torch.float32, torch.device("cpu")), tokenizer, stream


def ppl_here(capsys, *args: str) -> str:
    """``ppl-audit ppl ARGS --json`` run in this process: its stdout, the command checked to have succeeded; the first
    test runs `ppl` as users do."""
    code, out, err = command_here(capsys, "ppl", *args, "--json")
    assert code == 0, err
    return out


@pytest.mark.slow  # the embedded 135M model
def test_float32_ppl_is_within_1e6_of_a_float64_computation(capsys, embedded):
    """`ppl` in float32 against our own float64 computation of the same windows (L=256, S=128)."""
    import torch
    from test_perplexity import brute_force_nll_sum

    result = json_line(ppl_here(capsys, "--model", "embedded", "--corpus", "embedded", "--window", "256", "--stride",
                                "128", "--max-tokens", "1024", "--bos", "none", "--dtype", "float32", "--batch-size", "4"))
    model, _, stream = embedded
    reference, count = brute_force_nll_sum(model.to(torch.float64), stream, 256, 128)
    model.to(torch.float32)
    assert result["n_tokens"] == count == 1023
    assert abs(result["ppl"] / math.exp(reference / count) - 1) < 1e-6


@pytest.mark.slow  # the embedded 135M model
def test_nll_does_not_depend_on_what_else_is_kept(embedded, tmp_path):
    """Plain NLL, NLL while the hidden states are kept (a reference being written) and NLL beside a
    baseline reference (KL being taken) are one computation."""
    from tasks.audit.reference import Writer
    from tasks.engine.perplexity import hidden_states, perplexity, scored_targets
    from tasks.engine.baseline import Baseline
    from tasks.engine.scoring_options import ScoreOptions, Windowing

    model, _, stream = embedded
    plain = perplexity(model, stream, Windowing(256, 128), batch_size=4)
    writer = Writer(tmp_path, scored_targets(stream, 256, 128))
    writing = perplexity(model, stream, Windowing(256, 128), batch_size=4, options=ScoreOptions(keep_hidden=writer))
    against = Baseline(model.get_output_embeddings(), None, lambda slots, inputs: hidden_states(model, *inputs[:4]))
    beside = perplexity(model, stream, Windowing(256, 128), batch_size=4, options=ScoreOptions(reference=against))
    assert writing.nll_sum == plain.nll_sum
    assert abs(beside.nll_sum / plain.nll_sum - 1) < 1e-7
    assert float(beside.extra["kl"].max()) < 1e-6 and beside.extra["top1"].all()


@pytest.mark.slow  # the embedded 135M model
def test_llama_cpp_mode_follows_the_model_s_add_bos_flag(capsys, embedded):
    """SmolLM2 adds no BOS, so llama-perplexity scores its plain stream: so must `--mode llama.cpp`."""
    _, tokenizer, _ = embedded
    assert tokenizer.bos_token_id is not None, "the embedded tokenizer names no BOS token"
    ids = tokenizer("a").input_ids
    assert ids, "the embedded tokenizer gives no tokens for 'a'"
    assert ids[0] != tokenizer.bos_token_id, f"the embedded tokenizer adds BOS: {ids}"
    args = ("--model", "embedded", "--corpus", "embedded", "--window", "128", "--mode", "llama.cpp", "--chunks", "3",
            "--batch-size", "3")
    out = ppl_here(capsys, *args)
    default = json_line(out)
    plain = json_line(ppl_here(capsys, *args, "--bos", "none"))
    assert default["bos"] == "none" and default["ppl"] == plain["ppl"]
    assert default["n_windows"] == 3 and default["n_tokens"] == 3 * (128 - 1 - 64)
    assert default["bits_per_byte"] is not None and "nan" not in out.lower()
