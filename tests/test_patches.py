"""The patches of library code (``tasks.models.patches``): each still fits the library it was written against, and
none is made anywhere else."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import inspect
import os
import signal
import time
import tomllib
from pathlib import Path

import pytest

from tasks.models import patches

ROOT = Path(__file__).resolve().parents[1]


def _found(where: str):
    module, qualified = where.split(":")
    found = importlib.import_module(module)
    for name in qualified.split("."):
        found = getattr(found, name)  # an AttributeError names what the library no longer has
    return found


@pytest.mark.parametrize("library", ["gptqmodel", "prefect"])
def test_the_patches_are_written_against_the_pinned_release(library):
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = next(pin.split("==")[1].split()[0] for pin in pins if pin.startswith(f"{library}=="))
    assert getattr(patches, library.upper()) == pinned, f"{library}'s pin moved: read its patches again"
    assert importlib.metadata.version(library) == pinned


@pytest.mark.parametrize("where", sorted(patches.WRITTEN_AGAINST))
def test_what_a_patch_replaces_or_relies_on_is_the_pinned_release_s_code(where):
    source = inspect.getsource(_found(where))
    assert hashlib.sha256(source.encode()).hexdigest() == patches.WRITTEN_AGAINST[where], (
        f"{where} is not the code the patch in tasks/models/patches.py was written against "
        f"({where.split('.')[0]} {getattr(patches, where.split('.')[0].upper())}): read the patch again, then record "
        "the new digest")


def test_the_clip_search_takes_what_gptqmodel_s_takes():
    from gptqmodel.looper.awq_processor import AWQProcessor

    theirs = inspect.signature(AWQProcessor._compute_best_clip).parameters
    ours = inspect.signature(patches.best_clip_by_matmul).parameters
    assert [(p.name, p.default) for p in list(theirs.values())[1:]] == \
        [(p.name, p.default) for p in list(ours.values())[1:]]


def test_gptqmodel_s_logs_go_where_they_are_sent_and_back_after(tmp_path):
    from gptqmodel.looper import loop_processor

    stock = loop_processor._PROJECT_LOG_DIR
    assert stock == Path("logs")
    with pytest.raises(RuntimeError), patches.logs_in(tmp_path / "quantize-logs"):
        # gptqmodel's own function that names each quantizer's log: it must read the redirected folder
        assert loop_processor.LoopProcessor._build_log_file_path("gptq", "now").parent == tmp_path / "quantize-logs"
        raise RuntimeError("a quantization that fails")
    assert (tmp_path / "quantize-logs").is_dir()
    assert loop_processor._PROJECT_LOG_DIR is stock


def _imported(tree: ast.AST) -> set[str]:
    """The names a module binds to third-party modules and their members (anywhere in it, functions included)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if not a.name.startswith(("tasks", "flows"))}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not node.module.startswith(("tasks", "flows")):
            names |= {a.asname or a.name for a in node.names}
    return names


def _patched(path: Path) -> list[str]:
    """Where ``path`` sets an attribute of an imported library's module or class: ``x.attr = ...`` or
    ``setattr(x, ...)`` with ``x`` a name bound by an import."""
    tree = ast.parse(path.read_text(), str(path))
    libraries = _imported(tree)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if target is not base and isinstance(base, ast.Name) and base.id in libraries:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_library_is_patched_outside_the_patches_module():
    made = [where for path in sorted([*(ROOT / "tasks").rglob("*.py"), *(ROOT / "flows").rglob("*.py")])
            if path != Path(patches.__file__) for where in _patched(path)]
    assert made == [], "put a patch of a library in tasks/models/patches.py, with what it was written against"
    assert len(_patched(Path(patches.__file__))) == 7  # the check sees the patches there: 4 set, 3 put back


class _Dying:
    """An object whose finalizer is running when the process gets SIGTERM, as an asyncio transport's was."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # bytecode to run: the handler is called here, inside the finalizer
            pass


def test_a_sigterm_in_a_finalizer_during_a_flow_run_still_stops_it():
    """Prefect's handler raised its TerminationSignal inside the finalizer, where it was printed and lost: the
    flow ran on to its end. Now it is raised after the finalizer returns, and handed on to the handler it replaced
    (the command's, which ends the process), as Prefect does."""
    from prefect.exceptions import TerminationSignal
    from prefect.utilities.engine import capture_sigterm

    patches.prefect_sigterm_outside_finalizers()
    handed_on = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: handed_on.append(signum))
    went_on = False
    try:
        with pytest.raises(TerminationSignal), capture_sigterm():
            _Dying()
            time.sleep(2)  # the flow's work: the signal sent again 50 ms later ends it
            went_on = True
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not went_on
    assert handed_on == [signal.SIGTERM]
