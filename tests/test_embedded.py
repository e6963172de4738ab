"""The embedded default: Austen from the Debian package, SmolLM2 from the GGUF file, a sane PPL."""

from __future__ import annotations

import json
import math

from tasks.embedded import austen_novels, cache_dir, reflow

NOVELS = {"emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"}


def test_austen_novels_come_out_of_the_deb_as_plain_prose():
    deb = sorted((cache_dir() / "downloads").glob("r-cran-janeaustenr_*.deb"))[-1]
    novels = austen_novels(deb.read_bytes())
    assert set(novels) == NOVELS
    pride = novels["prideprejudice"]
    assert "It is a truth universally acknowledged, that a single man in possession of a good fortune, " \
           "must be in want of a wife." in pride
    assert 3_500_000 < sum(len(text) for text in novels.values()) < 4_500_000


def test_reflow_joins_wrapped_lines_and_keeps_paragraphs():
    assert reflow(["One line", "wrapped here.", "", "", "Next  ", "paragraph."]) == "One line wrapped here.\n\nNext paragraph."


def test_embedded_model_gives_a_sane_perplexity_on_the_embedded_corpus(cli):
    code, out, err = cli("ppl", "--model", "embedded", "--corpus", "embedded", "--max-tokens", "3000",
                         "--batch-size", "4", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    required = {"model", "ppl", "nll_sum", "n_tokens", "mean_nll", "stderr", "window", "stride", "batch_size",
                "bos", "tokens_per_second", "peak_memory_bytes"}
    assert required <= set(result)
    assert result["n_tokens"] == 2999 and result["bos"] == "stream"
    assert 10 < result["ppl"] < 80
    assert math.isclose(result["ppl"], math.exp(result["nll_sum"] / result["n_tokens"]), rel_tol=1e-12)
