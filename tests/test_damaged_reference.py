"""A stored baseline reference that does not hold what was written is never used: an audit removes it, says so
in one line and scores the baseline again, ending with a clean run's figures to the last bit; under
``rescore: never`` it stops in one line. Each batch of a variant's KL checks the reference's head and hidden
states against its stored NLL, and ``ppl-audit reference verify`` checks every stored one on demand."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import perturbed, write_config

from tasks.audit import reference, scoring
from tasks.audit.checkpoints import prepare
from tasks.config import BaselineSpec, EvaluationConfig, VariantSpec, parse
from tasks.core.errors import DamagedReference
from tasks.core.files import file_digest
from tasks.data.evaluation import evaluation
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import ScoreOptions, Windowing


@pytest.fixture(scope="module")
def variant_dir(tmp_path_factory, tiny_model_dir, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("noisy-variant")
    perturbed(tiny_model_dir, torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def references(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PPL_AUDIT_REFERENCES", str(tmp_path / "references"))
    return tmp_path / "references"


def audit(model_dir: Path, variant_dir: Path, text: str, rescore: str = "auto"):
    """The baseline's and the variant's outcomes, as the audit flow scores them (KL through the reference)."""
    lineup = prepare(BaselineSpec(name="baseline", path=str(model_dir), rescore=rescore),
                     [VariantSpec(name="noisy", path=str(variant_dir))])
    settings = parse(EvaluationConfig, {"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 500}, "test")
    scored = evaluation(text, lineup.tokenizer, settings)
    base = scoring.baseline_outcome(lineup.baseline, scored)
    return base, scoring.variant_outcome(lineup.variants[0], lineup, scored, against=base)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_model_dir, variant_dir, text):
    """One clean audit's outcomes, its reference stored in a folder of its own. The tests below copy that reference
    into their own references folder (``stored_clean``) where each once ran the same audit again to store it: the
    same model, text and settings give the same reference and figures (each test's later audits are compared with
    these to the last bit), and the file's time went into those ~20 repeated audits."""
    folder = tmp_path_factory.mktemp("clean-references")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_REFERENCES", str(folder))
        return audit(tiny_model_dir, variant_dir, text)


def stored_clean(clean, references: Path) -> tuple[str, Path]:
    """The clean audit's reference, copied into this test's references folder as its own first audit stored it:
    (key, folder)."""
    folder = references / clean[0].reference.key
    shutil.copytree(clean[0].reference.path, folder)
    return clean[0].reference.key, folder


def figures(base, variant) -> dict:
    assert base.ok and variant.ok, (base.reason, variant.reason)
    return {"baseline ppl": base.result.ppl, "baseline nll": base.result.token_nll.tobytes(),
            "variant ppl": variant.result.ppl, **{k: v.tobytes() for k, v in variant.result.extra.items()}}


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _hidden(folder: Path) -> np.memmap:
    return np.memmap(folder / reference.HIDDEN, dtype=np.float32, mode="r+")


def _edit_manifest(folder: Path) -> None:
    manifest = json.loads((folder / reference.MANIFEST).read_text())
    manifest["result"]["ppl"] = 1.0  # the edit once printed as the baseline's PPL
    (folder / reference.MANIFEST).write_text(json.dumps(manifest))


def _reseal(folder: Path, change) -> None:
    """``change`` the manifest and write its digests again, as a hand or a tool that means well would: only what the
    manifest holds can tell."""
    manifest = json.loads((folder / reference.MANIFEST).read_text())
    change(manifest)
    if isinstance(manifest.get("files"), dict):
        manifest["files"][reference.HIDDEN]["sha256"] = file_digest(folder / reference.HIDDEN)
    manifest["digest"] = reference.manifest_digest(manifest)
    (folder / reference.MANIFEST).write_text(json.dumps(manifest))


def _without(key: str, seal: bool):
    def edit(folder: Path) -> None:
        if seal:
            _reseal(folder, lambda manifest: manifest.pop(key))
        else:
            manifest = json.loads((folder / reference.MANIFEST).read_text())
            del manifest[key]
            (folder / reference.MANIFEST).write_text(json.dumps(manifest))
    return edit


DAMAGE = {
    "hidden bytes flipped": lambda f: _flip(f / reference.HIDDEN, (f / reference.HIDDEN).stat().st_size // 2 + 3),
    "hidden values reversed": lambda f: _hidden(f).__setitem__(slice(None), _hidden(f)[::-1].copy()),
    "hidden zeroed": lambda f: _hidden(f).__setitem__(slice(None), 0),
    "hidden truncated": lambda f: os.truncate(f / reference.HIDDEN, (f / reference.HIDDEN).stat().st_size // 2),
    "hidden missing": lambda f: (f / reference.HIDDEN).unlink(),
    "scores missing": lambda f: (f / reference.SCORES).unlink(),
    "scores bytes flipped": lambda f: _flip(f / reference.SCORES, (f / reference.SCORES).stat().st_size - 9),
    "manifest edited": _edit_manifest,
    "manifest not JSON": lambda f: (f / reference.MANIFEST).write_text("{\"format\": 2, "),
    # each once failed every audit of every baseline (KeyError) and crashed `reference ls`/`rm`
    "manifest lacks created": _without("created", seal=False),
    "manifest lacks environment, resealed": _without("environment", seal=True),
    "manifest identity null, resealed": lambda f: _reseal(f, lambda manifest: manifest.update(identity=None)),
    # once never healed: found by no search, kept in its baseline's folder, used by the variant (KeyError: 'dtype')
    "manifest identity empty, resealed": lambda f: _reseal(f, lambda manifest: manifest.update(identity={})),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_reference_is_removed_and_the_audit_ends_as_a_clean_run(tiny_model_dir, variant_dir, text, clean,
                                                                         references, damage, capfd):
    key, folder = stored_clean(clean, references)
    DAMAGE[damage](folder)
    capfd.readouterr()
    again = audit(tiny_model_dir, variant_dir, text)
    assert again[0].reference.baseline == "scored", damage
    assert figures(*again) == figures(*clean), damage
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and ("is damaged" in warnings[0]) and (key in warnings[0] or str(folder) in warnings[0])
    assert again[0].reference.removed == (f"{key}: {warnings[0].split(': ', 3)[3].split('; it is')[0]}",)
    [intact] = reference.stored()
    assert intact.key == key and intact.damage() is None and reference.verify(intact.folder) is None
    reused = audit(tiny_model_dir, variant_dir, text)
    assert reused[0].reference.baseline == "reused" and figures(*reused) == figures(*clean)


IDENTITY_FIELDS = ["format", "model", "tokenizer", "stream", "mode", "window", "stride", "bos", "dtype"]
WRONG_IDENTITY = {**{f"lacks {name}": (lambda name: lambda identity: identity.pop(name))(name) for name in IDENTITY_FIELDS},
                  "dtype unknown": lambda identity: identity.update(dtype="float8"),
                  "window a string": lambda identity: identity.update(window="64"),
                  "mode unknown": lambda identity: identity.update(mode="rolling"),
                  "format another": lambda identity: identity.update(format=1)}


@pytest.mark.parametrize("wrong", list(WRONG_IDENTITY))
def test_a_manifest_without_a_whole_valid_identity_is_removed_by_its_baseline_s_search(clean, references, wrong, capfd):
    """Sealed again after the edit, so that only the identity's own fields can tell: the search for the baseline
    it was made for removes it in one line (its audit then scores the baseline again), and nothing reads it."""
    _, folder = stored_clean(clean, references)
    written = json.loads((folder / reference.MANIFEST).read_text())
    _reseal(folder, lambda manifest: WRONG_IDENTITY[wrong](manifest["identity"]))
    assert reference.Reference.open(folder) is None and reference.stored() == []
    capfd.readouterr()
    reuse, previous, removed = reference.find_intact(written["identity"], written["environment"], "auto")
    assert (reuse, previous) == (None, None) and not folder.exists()
    [warning] = capfd.readouterr().err.splitlines()
    assert warning.startswith(f"ppl-audit: warning: baseline reference {folder.name} is damaged: manifest.json's")
    assert removed == [f"{folder.name}: {warning.split(': ', 3)[3].split('; it is')[0]}"]


@pytest.mark.parametrize("damage", ["hidden values reversed", "manifest edited", "scores bytes flipped"])
def test_under_rescore_never_a_damaged_reference_stops_the_baseline_in_one_line(tiny_model_dir, variant_dir,
                                                                                 text, clean, references, damage):
    key, folder = stored_clean(clean, references)
    DAMAGE[damage](folder)
    base, variant = audit(tiny_model_dir, variant_dir, text, rescore="never")
    assert not base.ok and f"baseline reference {key} is damaged" in base.reason
    assert "\n" not in base.reason and "rescore: never" in base.reason
    assert "kl" not in variant.result.extra  # no KL against what cannot be trusted
    assert [r.key for r in reference.stored()] == [key]  # kept, not rebuilt


@pytest.mark.slow  # audits through the CLI
def test_rescore_never_with_a_damaged_reference_exits_2_before_anything_starts(cli, tiny_model_dir, variant_dir, text,
                                                                               references, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    config = write_config(tmp_path / "audit.yaml", tiny_model_dir, corpus, [{"name": "noisy", "path": str(variant_dir)}],
                          evaluation={"window": 64, "stride": 32, "max_tokens": 500},
                          tracking={"uri": f"sqlite:///{tmp_path}/mlflow.db"})
    code, _, err = cli("reference", "build", str(config))
    assert code == 0, err[-2000:]
    [stored] = reference.stored()
    DAMAGE["hidden zeroed"](stored.folder)
    code, out, err = cli("run", str(config), "--set", "baseline.rescore=never")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"ppl-audit: error: baseline reference {stored.key} is damaged: hidden.bin")
    assert not (tmp_path / "mlflow.db").exists()  # refused before tracking started


def test_each_batch_checks_the_reference_against_its_own_nll(tiny_model_dir, text, clean, references):
    """Damage that comes after the check on reuse (a worker's copy, a file changed mid-audit) fails the variant
    at its first batch, not with a wrong KL."""
    stored = reference.Reference.open(stored_clean(clean, references)[1])
    lineup = prepare(BaselineSpec(name="baseline", path=str(tiny_model_dir)), [])
    scored = evaluation(text, lineup.tokenizer, parse(EvaluationConfig, {"window": 64, "stride": 32,
                                                                         "max_tokens": 500}, "test"))
    variant = perturbed(tiny_model_dir, torch.float32)
    against = stored.baseline(str(tiny_model_dir), torch.device("cpu"))
    perplexity(variant, scored.stream, Windowing(64, 32), 4, ScoreOptions(reference=against))  # intact: no complaint
    hidden = _hidden(stored.folder)
    hidden[5] *= 1.5  # one token's hidden state
    hidden.flush()
    with pytest.raises(DamagedReference, match=f"baseline reference {stored.key} is damaged"):
        perplexity(variant, scored.stream, Windowing(64, 32), 4,
                   ScoreOptions(reference=stored.baseline(str(tiny_model_dir), torch.device("cpu"))))
    os.truncate(stored.folder / reference.HIDDEN, 100)
    with pytest.raises(DamagedReference, match="hidden.bin holds 100 bytes"):  # before it is mapped
        stored.baseline(str(tiny_model_dir), torch.device("cpu"))


@pytest.mark.slow  # audits through the CLI
def test_reference_verify_says_which_are_damaged(cli, tiny_model_dir, variant_dir, text, references, tmp_path):
    base, _ = audit(tiny_model_dir, variant_dir, text)
    intact = base.reference.key
    other = audit(tiny_model_dir, variant_dir, text.replace("the", "a"))[0].reference.key
    code, out, err = cli("reference", "verify", "--all")
    assert code == 0 and out.count("intact: files, result and NLL check out") == 2, out
    # the libraries' noise (torchao's kernels that fail to load, torch's warnings) goes to the log, as every command's
    [said] = err.strip().splitlines()
    assert said.startswith("log: ") and "-reference-" in said, err[-2000:]
    # damage the hidden states and seal the files' digests again: only the NLL check can tell
    DAMAGE["hidden values reversed"](references / other)
    _reseal(references / other, lambda manifest: None)
    code, out, _ = cli("reference", "verify", "--all")
    assert code == 1 and f"{intact}  intact" in out
    assert f"{other}  DAMAGED: its LM head on its hidden states does not give back its stored NLL" in out
    code, out, _ = cli("reference", "verify", intact)
    assert code == 0 and out.splitlines() == [f"{intact}  intact: files, result and NLL check out"]
    code, _, err = cli("reference", "verify", "nope")
    assert code == 2 and err.strip().splitlines() == [
        "ppl-audit: error: reference verify: no reference nope; `ppl-audit reference ls` lists them"]


@pytest.mark.parametrize("damage", ["manifest lacks created", "manifest identity null, resealed"])
def test_an_unreadable_manifest_fails_no_other_audit_and_reference_ls_and_rm_handle_it(
        tiny_model_dir, variant_dir, text, clean, references, damage, capfd):
    """Another baseline's audit leaves it alone (it is not that audit's to judge) and does not fail; `reference ls`
    lists it as damaged, `rm --older-than` and `rm KEY` work with it there."""
    from flows.cli import main

    damaged, _ = stored_clean(clean, references)
    DAMAGE[damage](references / damaged)
    capfd.readouterr()
    other = audit(tiny_model_dir, variant_dir, text.replace("the", "a"))
    assert other[0].reference.baseline == "scored" and other[1].ok, other[1].reason
    assert "warning:" not in capfd.readouterr().err
    assert main(["reference", "ls"]) == 0
    listing = capfd.readouterr().out.splitlines()
    [line] = [line for line in listing if line.startswith(damaged)]
    assert f"DAMAGED: {reference.verify(references / damaged)}; the audit of its baseline replaces it" in line, line
    assert any(line.startswith(other[0].reference.key) and "DAMAGED" not in line for line in listing), listing
    assert listing[-1].startswith("2 reference(s) (1 damaged), ")
    assert main(["reference", "rm", "--older-than", "30d"]) == 0 and sorted(reference.folders()) == sorted(
        [damaged, other[0].reference.key])
    capfd.readouterr()
    assert main(["reference", "rm", damaged]) == 0
    assert capfd.readouterr().out.splitlines()[1:] == [f"  {damaged}"]
    assert list(reference.folders()) == [other[0].reference.key]


def test_a_manifest_swapped_with_another_reference_s_is_removed_and_its_reference_made_again(
        tiny_model_dir, variant_dir, text, clean, references, capfd):
    """Swapped, each manifest is whole and sealed, but names the other folder's key: the audit of either baseline
    reads it as damaged, as `reference verify` says, replaces it, and names the reference it stored."""
    mine = stored_clean(clean, references)[0]
    theirs = audit(tiny_model_dir, variant_dir, text.replace("the", "a"))[0].reference.key
    manifests = {key: (references / key / reference.MANIFEST).read_bytes() for key in (mine, theirs)}
    (references / mine / reference.MANIFEST).write_bytes(manifests[theirs])
    (references / theirs / reference.MANIFEST).write_bytes(manifests[mine])
    verified = reference.verify(references / mine)
    assert verified == f"{reference.MANIFEST} is reference {theirs}'s, not {mine}'s (swapped or copied)"
    capfd.readouterr()
    again = audit(tiny_model_dir, variant_dir, text)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning:" in line]
    assert warnings == [f"ppl-audit: warning: baseline reference {mine} is damaged: {verified}; it is removed and not used"]
    assert again[0].reference.baseline == "scored" and again[0].reference.key == mine
    assert figures(*again) == figures(*clean)
    assert reference.verify(references / mine) is None and reference.verify(references / theirs) is not None


def test_a_reference_a_variant_finds_damaged_is_removed_so_the_next_audit_scores_the_baseline_again(
        tiny_model_dir, variant_dir, text, clean, references):
    """Hidden states changed and every digest sealed again: only the variant's check of the head on them against the
    stored NLL tells. Its line says the next audit scores the baseline again: that audit does, and ends clean."""
    _, folder = stored_clean(clean, references)
    DAMAGE["hidden values reversed"](folder)
    _reseal(folder, lambda manifest: None)
    base, variant = audit(tiny_model_dir, variant_dir, text)
    assert base.reference.baseline == "reused" and not variant.ok
    assert "is damaged: its LM head on its hidden states" in variant.reason
    assert "the next audit scores the baseline again" in variant.reason
    # failed while it scored: what its load measured stays in its record (the run's params say its backend, dtype...)
    assert variant.facts is not None and variant.facts.backend == clean[1].facts.backend and not variant.retry_elsewhere
    assert not reference.folders()
    again = audit(tiny_model_dir, variant_dir, text)
    assert again[0].reference.baseline == "scored" and figures(*again) == figures(*clean)
