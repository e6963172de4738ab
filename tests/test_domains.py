"""An audit of several corpora (``corpora:``): a fault planted in one domain is found there and only there, each
domain's figures are its one-corpus audit's to the last digit, bad input is one line before anything loads, and
the family rule (a variant passes only where it passes on every domain) keeps its false-pass rate."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import build_llama, flat, typed, make_text, train_briefly

from tasks.config import Thresholds
from tasks.engine.paired import paired_difference
from tasks.record.domains import across
from tasks.record.result import DomainResult
from tasks.record.verdict import judge_row

# Russian words for a second domain in another script: the test tokenizer is byte-level BPE trained on English
# words only, so it encodes Cyrillic as single bytes, tokens that English text never uses
RUSSIAN = ("и в не на я он что с а как это она по но его к из за у же бы от мы вы так было дом утро вечер "
           "письмо сказал думал очень милый").split()
SETTINGS = {"evaluation": {"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 640},  # 19 windows a domain
            "thresholds": {"max_ppl_increase_pct": 5}}
# a domain's own max_tokens (its one-corpus audit's evaluation.max_tokens): 15 windows
DOMAIN_TOKENS = {"russian": 512}
NOISE = 3.0  # the planted noise, in standard deviations of the embedding: +40% PPL on Russian, measured
# what differs between two runs of the same audit: how fast it ran, and whether the baseline was scored or its
# stored reference (made by the first) reused; every other figure of a row must be equal
NOT_FIGURES = {"tokens_per_second", "load_seconds", "baseline"}


def token_ids(tokenizer, text: str) -> set[int]:
    return set(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def domains(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("domains")
    texts = {"english": make_text(3000), "russian": make_text(3000, vocabulary=RUSSIAN)}
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    return {name: folder / f"{name}.txt" for name in texts}


@pytest.fixture(scope="module")
def bilingual_dir(tmp_path_factory, trained_model_dir, tokenizer) -> Path:
    """The trained model taught some Russian too (25 steps, ~20 s): trained on English alone, it gave Russian a PPL
    of ~38,000 (it had learnt never to predict those bytes), which noise in their embeddings lowered, not raised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(trained_model_dir)
    text = make_text(8000, seed=2) + "\n\n" + make_text(8000, seed=2, vocabulary=RUSSIAN)
    train_briefly(model, tokenizer, steps=25, text=text)
    folder = tmp_path_factory.mktemp("bilingual")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def planted(tmp_path_factory, bilingual_dir, tokenizer, domains) -> tuple[Path, list[int]]:
    """The bilingual model with noise in the input embedding rows of the tokens Russian text uses and English text
    does not; every other weight, the output head's included, as it was. Returns its folder and those rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bilingual_dir)
    # a tied head would share the noised rows, and the fault would reach every domain's predictions
    assert not model.config.tie_word_embeddings
    rows = sorted(token_ids(tokenizer, domains["russian"].read_text())
                  - token_ids(tokenizer, domains["english"].read_text()))
    embedding = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embedding[rows] += torch.randn(len(rows), embedding.shape[1], generator=generator) * embedding.std() * NOISE
    folder = tmp_path_factory.mktemp("planted")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, rows


def audit_config(path: Path, baseline: Path, variant: Path, texts: dict[str, Path]) -> str:
    """An audit of ``variant`` against ``baseline`` on ``texts``: ``corpora`` where there are several, ``corpus``
    where there is one, with the domain's own max_tokens; the same settings either way."""
    evaluation = SETTINGS["evaluation"]
    if len(texts) > 1:
        corpus = {"corpora": [{"name": name, "source": str(text)} | (
            {"max_tokens": DOMAIN_TOKENS[name]} if name in DOMAIN_TOKENS else {}) for name, text in texts.items()]}
    else:
        (name, text), = texts.items()
        corpus = {"corpus": {"source": str(text)}}
        evaluation = evaluation | ({"max_tokens": DOMAIN_TOKENS[name]} if name in DOMAIN_TOKENS else {})
    config = {"name": path.stem, "baseline": {"path": str(baseline)}, **corpus,
              "variants": [{"name": "planted", "path": str(variant)}], **SETTINGS, "evaluation": evaluation}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def audits(prefect_harness, cache, tmp_path_factory, bilingual_dir, planted, domains):
    """The audit of both domains (its final state) and each domain's one-corpus audit (its summary), run once."""
    from flows.audit import audit, result_of

    folder = tmp_path_factory.mktemp("domain-audits")
    variant, _ = planted
    both = audit(config=audit_config(folder / "both.yaml", bilingual_dir, variant, domains), return_state=True)
    alone = {}
    for name, text in domains.items():
        state = audit(config=audit_config(folder / f"{name}.yaml", bilingual_dir, variant, {name: text}),
                      return_state=True)
        alone[name] = result_of(state)
    return both, alone


def test_the_planted_variant_differs_only_in_the_input_rows_of_the_other_script(bilingual_dir, planted):
    from safetensors.torch import load_file

    folder, rows = planted
    base, variant = load_file(bilingual_dir / "model.safetensors"), load_file(folder / "model.safetensors")
    assert set(base) == set(variant) and "lm_head.weight" in variant  # the head is saved apart from the embedding
    assert 20 < len(rows) < 100  # Cyrillic bytes (and a few pieces), not the tokens of words
    for name, weight in variant.items():
        if name != "model.embed_tokens.weight":
            assert torch.equal(weight, base[name]), name
    changed = (variant["model.embed_tokens.weight"] != base["model.embed_tokens.weight"]).any(dim=1)
    assert changed.nonzero().flatten().tolist() == rows


def test_a_fault_planted_in_one_domain_fails_that_domain_alone(audits):
    import json

    from flows.audit import result_of
    from tasks.record.answer import answer_json

    both, _ = audits
    assert both.is_failed()
    assert both.message.startswith("fail: planted: fails on russian: ΔPPL +"), both.message
    assert "breaks the limit ≤ 5; ΔPPL by domain: english +0.00%, russian +" in both.message
    summary = result_of(both)
    said = json.loads(answer_json(summary))
    assert said["verdict"] == "fail"
    assert {name: domain["verdict"] for name, domain in said["domains"].items()} == {"english": "pass",
                                                                                       "russian": "fail"}
    assert [m["verdict"] for m in said["domains"]["english"]["models"]] == ["baseline", "pass"]
    assert [m["verdict"] for m in said["domains"]["russian"]["models"]] == ["baseline", "fail"]
    english, russian = (flat(summary.domains[name].rows)[1] for name in ("english", "russian"))
    # English never meets a noised row: the variant's predictions there are the baseline's, bit for bit
    assert english["delta_ppl_pct"] == 0 and english["kld_mean"] == 0 and english["top1_agreement"] == 1
    assert russian["delta_ppl_pct_low"] > 5
    assert flat(summary.rows)[1]["domain"] == "russian" and flat(summary.rows)[1]["ppl"] == russian["ppl"]


def test_each_domain_is_scored_and_judged_as_its_one_corpus_audit(audits):
    both, alone = audits
    from flows.audit import result_of

    domains = result_of(both).domains
    assert list(domains) == ["english", "russian"]
    for name, summary in domains.items():
        one = alone[name]
        assert [v.status for v in summary.verdicts] == [v.status for v in one.verdicts]
        assert [v.reason for v in summary.verdicts] == [v.reason for v in one.verdicts]
        for row, single in zip(flat(summary.rows), flat(one.rows), strict=True):
            assert set(row) == set(single), name
            compared = set(row) - NOT_FIGURES
            assert {"ppl", "delta_ppl_pct", "delta_ppl_pct_low", "delta_ppl_pct_high", "kld_mean", "top1_agreement",
                    "n_tokens", "windows"} <= compared or row["variant"] == "baseline"
            differ = {key: (row[key], single[key]) for key in compared
                      if not (row[key] == single[key] or row[key] != row[key] and single[key] != single[key])}
            assert not differ, f"{name} {row['variant']}: {differ}"
        # the reference each domain's baseline made is the one its one-corpus audit found: the same tokens
        assert (flat(summary.rows)[0]["baseline"], flat(one.rows)[0]["baseline"]) == ("scored", "reused")
    assert flat(domains["russian"].rows)[1]["n_tokens"] < flat(domains["english"].rows)[1]["n_tokens"]  # its own


# -- bad input: one line, exit 2, before anything loads --------------------------------------------------------

@pytest.fixture(scope="module")
def words_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer knows only the test text's English words: any other word is its unknown token
    (word-level, no byte fallback), as a model whose vocabulary lacks a script."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from helpers import WORDS

    vocabulary = ["<unk>", "<s>", "</s>", ".", ",", "!", "?", *WORDS]
    words = Tokenizer(models.WordLevel({word: i for i, word in enumerate(vocabulary)}, unk_token="<unk>"))
    words.normalizer = normalizers.Lowercase()
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    folder = tmp_path_factory.mktemp("words-llama")
    build_llama(folder, fast)
    return folder


CHINESE = "我们今天去公园散步，天气很好。她说这封信是昨天写的。" * 200
ENGLISH = {"name": "english", "source": "{english}"}
REFUSED = {
    "same-name-twice": ({"corpora": [ENGLISH, {"name": "english", "source": "{russian}"}]},
                        "{config}: corpora names must be unique: english repeats"),
    "no-corpora": ({"corpora": []},
                   "{config}: corpora is empty: list the domains to audit (name and source each), or give corpus"),
    "blank-domain": ({"corpora": [ENGLISH, {"name": "blank", "source": "{blank}"}]},
                     "corpora.blank: corpus {blank} is empty or only whitespace; give a source with text"),
    "per-corpus-names-none": ({"corpora": [ENGLISH, {"name": "russian", "source": "{russian}"}],
                               "thresholds": {"per_corpus": {"french": {"max_ppl_increase_pct": 2}}}},
                              "{config}: thresholds.per_corpus names no corpus: french (the corpora are english, "
                              "russian)"),
    "per-corpus-of-one-corpus": ({"corpus": {"source": "{english}"},
                                  "thresholds": {"per_corpus": {"english": {"max_ppl_increase_pct": 2}}}},
                                 "{config}: thresholds.per_corpus names no corpus: english (the audit has one "
                                 "corpus: use corpora to name several)"),
    "corpus-and-corpora": ({"corpus": {"source": "{english}"}, "corpora": [ENGLISH]},
                           "{config}: corpus and corpora are both given: keep corpus (one text) or corpora (several "
                           "domains, each with a name), not both"),
    "neither": ({}, "{config}: no text to score: give corpus (one text) or corpora (several domains, each with a "
                    "name)"),
    "unencodable-domain": ({"corpora": [ENGLISH, {"name": "chinese", "source": "{chinese}"}]},
                           "corpora.chinese: the baseline's tokenizer cannot encode this text: <N> of its <N> "
                           "tokens are its unknown token '<unk>'; remove the domain, or audit a model whose "
                           "vocabulary covers its script"),
}


def filled(value, fill: dict):
    """``value`` (a config section) with ``{name}`` in its strings replaced by ``fill``'s paths."""
    if isinstance(value, dict):
        return {key: filled(item, fill) for key, item in value.items()}
    if isinstance(value, list):
        return [filled(item, fill) for item in value]
    return value.format(**fill) if isinstance(value, str) else value


def refused(folder: Path, words_model_dir: Path, case: str) -> tuple[Path, str]:
    """The case's config, written in ``folder`` with the texts it names, and the pattern of the one line that
    refuses it."""
    import re

    change, expected = REFUSED[case]
    files = {"english": make_text(3000), "russian": make_text(3000, vocabulary=RUSSIAN), "blank": " \n\t\n",
             "chinese": CHINESE}
    fill = {"config": folder / "audit.yaml"}
    for name, text in files.items():
        (folder / f"{name}.txt").write_text(text)
        fill[name] = folder / f"{name}.txt"
    config = {"name": "domains", "baseline": {"path": str(words_model_dir)},
              # a float variant: quantizing at load would import torchao, seconds a refusal never needs
              "variants": [{"name": "same", "path": str(words_model_dir)}], **SETTINGS, **filled(change, fill)}
    fill["config"].write_text(yaml.safe_dump(config, sort_keys=False))
    return fill["config"], re.escape(f"ppl-audit: error: {expected.format(**fill)}\n").replace(re.escape("<N>"), r"\d+")


@pytest.mark.parametrize("case", REFUSED)
def test_bad_domains_are_one_line_exit_2_before_anything_loads(tmp_path, words_model_dir, capsys, case):
    """Exit 2 is said only for a refusal before the flow (one inside it exits 1), and Prefect's API is a closed port
    here: had the command reached Prefect, it would have crashed on it. In-process (``main``), as the console script
    runs it; the script's own part (its log) is the next test's."""
    import re

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from helpers import command_here, free_port

    config, line = refused(tmp_path, words_model_dir, case)
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        code, out, err = command_here(capsys, "run", str(config))
    assert code == 2 and out == "", err
    assert re.fullmatch(line, err), err


def test_a_bad_domain_through_the_console_script_is_one_line_and_leaves_no_log(tmp_path, words_model_dir):
    """Through the command a user runs (each case's answer is ``main``'s, the previous test's): the domain its
    tokenizer cannot encode, refused after the tokenizer is read, with Prefect's API a closed port."""
    import re

    from helpers import free_port

    config, line = refused(tmp_path, words_model_dir, "unencodable-domain")
    home = tmp_path / "home"
    env = {**os.environ, "PPL_AUDIT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(config)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert re.fullmatch(line, done.stderr), done.stderr
    assert not list(home.glob("logs/*")), "a refused command leaves no log behind"


# -- the family rule: pass only where every domain passes -------------------------------------------------------

LIMIT = 5.0  # ΔPPL %, the gate of every domain
GATE = Thresholds(max_ppl_increase_pct=LIMIT)


def synthetic_row(rng: np.random.Generator, true_pct: float, windows: int = 20, tokens: int = 32):
    """A variant's row on one domain whose true ΔPPL is ``true_pct``: paired per-token NLL with an error shared by
    each window's tokens (a hard passage) and one of each token, through the engine's own paired statistics."""
    base = rng.gamma(2.0, 1.5, windows * tokens)
    shared = np.repeat(rng.normal(0, 0.02, windows), tokens)
    variant = base + math.log1p(true_pct / 100) + shared + rng.normal(0, 0.1, windows * tokens)
    figures = paired_difference(base, variant, np.full(windows, tokens))
    return typed({"variant": "q", "method": "gptq", "status": "ok", "reason": "", **figures})


def pass_rates(true_pcts: list[float], draws: int, seed: int) -> tuple[float, list[float]]:
    """How often a variant whose true ΔPPL on each domain is ``true_pcts`` passes across them, and on each alone."""
    rng = np.random.default_rng(seed)
    passed, each = 0, np.zeros(len(true_pcts))
    for _ in range(draws):
        domains = []
        for k, true_pct in enumerate(true_pcts):
            row = synthetic_row(rng, true_pct)
            verdict = judge_row(row, GATE)
            each[k] += verdict.status == "pass"
            domains.append(DomainResult(f"d{k}", (), (typed({"variant": "baseline", "status": "ok"}), row), (verdict,),
                                        verdict, ""))
        passed += across(domains, 0).status == "pass"
    return passed / draws, list(each / draws)


def test_a_variant_at_the_limit_on_one_domain_of_four_passes_at_most_5_percent_of_the_time():
    """The intersection-union test (docs/statistics.md): no correction for the number of domains is needed, and the
    rule is not more conservative than one domain's gate, as a Bonferroni correction would make it (~0.6%)."""
    at_limit, each = pass_rates([LIMIT, 0.0, 0.0, 0.0], draws=2000, seed=1)
    assert each[1:] == [1.0, 1.0, 1.0]  # the others are well within: the domain at the limit decides
    assert at_limit == each[0]
    # one end of a 95% interval: 2.5% at the limit (0.35% of standard error over 2000 draws), within the 5%
    assert 0.0125 < at_limit <= 0.05
    everywhere, _ = pass_rates([LIMIT] * 4, draws=300, seed=2)
    assert everywhere <= 0.05


def test_a_good_variant_passes_every_domain_with_the_product_of_its_chances():
    """K independent domains each passed with probability p are all passed with p^K: more domains, less power."""
    combined, each = pass_rates([3.0] * 4, draws=800, seed=3)
    assert all(0.75 < p < 0.95 for p in each), each
    # 1.8% of standard error over 800 draws
    assert combined == pytest.approx(math.prod(each), abs=0.05) and combined < min(each) - 0.2
