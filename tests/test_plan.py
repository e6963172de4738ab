"""One plan, made once (issue #52): ``open_audit`` is the only place a config becomes a plan, and an audit finds
each of its models once."""

from __future__ import annotations

import ast
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from helpers import write_config

from flows.cli import main
from tasks.config import load_audit_config
from tasks.models import resolve

# what finding a model is: its name resolved to files, its config read, its tokenizer read
RESOLVERS = {resolve.resolve_model_path.__code__: "resolve_model_path", resolve.read_config.__code__: "read_config",
             resolve.read_tokenizer.__code__: "read_tokenizer", load_audit_config.__code__: "load_audit_config"}


@contextmanager
def counted_calls():
    """Every call of a ``RESOLVERS`` function in this process, from any thread (Prefect runs tasks in threads) and
    through whatever name a module imported it by: a profiler, not a replacement of the functions."""
    calls = Counter()

    def profile(frame, event, _):
        if event == "call" and frame.f_code in RESOLVERS:
            calls[RESOLVERS[frame.f_code]] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def test_an_audit_finds_each_model_once(tmp_path, cache, trained_model_dir, noisy_model_dir, corpus_path, capsys):
    """Before: the CLI and then the flow each loaded the config, preflighted it and found the models, and loading,
    the window check and the tokenizer check found them again (measured on dc24c64: ``resolve_model_path`` called at
    9 places, ``load_config`` at 11)."""
    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path,
                          [{"name": "int8", "method": "torchao-int8"}, {"name": "noisy", "path": str(noisy_model_dir)}])
    with counted_calls() as calls:
        assert main(["run", str(config)]) in (0, 1)
    assert "verdict:" in capsys.readouterr().out
    # two models with files of their own (the baseline and `noisy`); `int8` is the baseline's, quantized as it loads
    assert dict(calls) == {"load_audit_config": 1, "resolve_model_path": 2, "read_config": 2, "read_tokenizer": 2}


ROOT = Path(__file__).resolve().parents[1]
FINDERS = {"resolve_model_path", "read_config", "read_tokenizer", "load_config", "load_tokenizer", "locate_model"}
# where a name may become a model: the lineup (an audit's models), the quantize command's request (its one model),
# a name a tool or a test gives the loader (``as_located``; an audit hands it what the lineup found), and resolve.py
FINDING = {"tasks/audit/checkpoints.py", "tasks/models/quantize_request.py", "tasks/models/loading.py",
           "tasks/models/resolve.py"}


def called(names: set[str]) -> dict[str, set[str]]:
    """``{module: the names of ``names`` it calls}`` over flows/ and tasks/ (``Located.at`` counts as ``at``)."""
    found = {}
    for path in sorted([*ROOT.glob("flows/**/*.py"), *ROOT.glob("tasks/**/*.py")]):
        calls = {node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                 and isinstance(node.func, (ast.Name, ast.Attribute))}
        if calls & names:
            found[str(path.relative_to(ROOT))] = calls & names
    return found


def test_only_the_lineup_finds_a_model_and_only_open_audit_reads_a_config():
    """Before: ``resolve_model_path`` was called in 6 modules, ``load_config`` in 9, ``load_audit_config`` in 8."""
    assert set(called(FINDERS | {"at"})) <= FINDING, called(FINDERS | {"at"})
    assert set(called({"load_audit_config"})) == {"tasks/audit/plan.py"}, called({"load_audit_config"})
    assert set(called({"open_audit"})) == {"tasks/steps.py", "flows/commands/audit.py",
                                           "flows/commands/serve.py", "flows/commands/diagnose.py",
                                           "flows/commands/reference.py", "flows/commands/compare.py",
                                           "flows/commands/tune.py"}


def test_a_command_narrows_the_plan_to_what_it_needs(tmp_path, trained_model_dir, corpus_path):
    """``reference build`` and ``compare CONFIG`` open the baseline alone: a config no whole audit could run (no
    variants), which the plan holds as its command narrowed it (both commands crashed on it before)."""
    from tasks.audit.plan import baseline_alone, open_audit

    config = write_config(tmp_path / "a.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}])
    plan = open_audit(str(config), [], narrow=baseline_alone)
    assert plan.config.variants == [] and plan.lineup.variants == [] and plan.path == str(config)
    assert plan.model_dump() == {"audit": plan.name, "config": str(config), "baseline": str(trained_model_dir),
                                 "variants": [], "tokens": len(plan.evaluation.stream.ids),
                                 "window": plan.config.evaluation.window, "stride": plan.config.evaluation.stride}
