"""One plan, made once (issue #52): ``open_audit`` is the only place a config becomes a plan, and an audit finds
each of its models once."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import contextmanager

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
