"""The layout is the architecture: import-linter's contracts in pyproject.toml hold, and they catch a break."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    done = lint(ROOT)
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout + done.stderr


def test_an_upward_import_or_a_cycle_breaks_a_contract(tmp_path):
    """The contracts see what a future change could add: the engine importing the record, a cycle in models."""
    for part in ("flows", "tasks", "pyproject.toml"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, tmp_path / part)
    with open(tmp_path / "tasks/engine/windows.py", "a") as module:
        module.write("\nfrom tasks.record import tracking  # noqa\n")
    with open(tmp_path / "tasks/models/resolve.py", "a") as module:
        module.write("\nfrom tasks.models import loading  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Layers: each imports only those below it BROKEN" in done.stdout, done.stdout
    assert "No import cycle inside any package BROKEN" in done.stdout, done.stdout
    assert "tasks.engine.windows -> tasks.record.tracking" in done.stdout, done.stdout


def _imports(path: Path) -> set[str]:
    """The modules of flows/ and tasks/ a module names at its top level, those named for annotations alone
    (``if TYPE_CHECKING:``) too; imports inside functions are left out: they are how a module defers a heavy one."""
    tree = ast.parse(path.read_text())
    body = [*tree.body, *(node for block in tree.body if isinstance(block, ast.If) for node in block.body)]
    named = set()
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            named |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
    return named


def test_no_module_names_another_that_names_it_even_for_a_type():
    """import-linter leaves out imports made for annotations (``exclude_type_checking_imports``), so it did not see
    perplexity.py and scoring_options.py naming each other (#68): a circle a reader has to hold either way."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for package in ("flows", "tasks") for p in (ROOT / package).rglob("*.py")}
    graph = {name: (_imports(path) & modules.keys()) - {name} for name, path in modules.items()}
    circles = set()
    for start in graph:  # breadth first from each module: a path back to it is a circle
        paths, frontier = {start: (start,)}, [start]
        while frontier:
            step = []
            for module in frontier:
                if start in graph[module]:
                    circles.add(" -> ".join(sorted(paths[module])))
                for name in graph[module] - paths.keys():
                    paths[name] = (*paths[module], name)
                    step.append(name)
            frontier = step
    assert not circles, "modules that name each other: " + "; ".join(sorted(circles))


# a command run as the console script runs it, then a last line naming the heavy libraries it imported
IMPORTED = """
import sys
from flows.cli import main
try:
    main(sys.argv[1:])
except SystemExit:  # --help
    pass
print("imported:", *(name for name in ("torch", "transformers") if name in sys.modules))
"""


def test_the_light_commands_import_neither_torch_nor_transformers(tmp_path):
    """``ppl-audit sync`` and ``ui`` need neither (a second and 1 GB of imports): issue 67 found them imported again
    through card's arguments (the record's floor line reached the engine for one numpy helper), and nothing checked."""
    for argv in (["sync", "--help"], ["ui", "--help"], ["sync"]):
        done = subprocess.run([sys.executable, "-c", IMPORTED, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={"PPL_AUDIT_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "imported:", f"{argv}: {done.stdout.splitlines()[-1]}"


# The method tests left outside tasks.methods, by file, each with its reason: none today (#68's acceptance)
METHOD_TESTS_LEFT: dict[str, int] = {}


def _method_tests(tree) -> int:
    """``method ==``/``!=``/``in``/``not in`` and ``runtime ==``/``!=`` in a module: a comparison of a name, an
    attribute or a ``["method"]`` key that ends in method or is runtime."""
    import ast

    def named(node) -> bool:
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.slice.value if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                else None)
        return isinstance(name, str) and (name.endswith("method") or name == "runtime")

    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Compare)
               and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
               and any(named(side) for side in [node.left, *node.comparators]))


def test_a_method_is_dispatched_through_its_backend_not_its_name():
    """Issue 68: what a quantization method or runtime is lives in its module of tasks.methods, reached through the
    registry; a test of its name elsewhere is a place a new format would have to be added again."""
    import ast

    found = {}
    for file in sorted([*(ROOT / "tasks").rglob("*.py"), *(ROOT / "flows").rglob("*.py")]):
        where = file.relative_to(ROOT).as_posix()
        if not where.startswith("tasks/methods/"):
            count = _method_tests(ast.parse(file.read_text()))
            if count:
                found[where] = count
    over = {where: count for where, count in found.items() if count > METHOD_TESTS_LEFT.get(where, 0)}
    assert not over, f"method or runtime names tested outside tasks.methods: {over}"
    assert _method_tests(ast.parse('if spec.method == "gptq" or runtime != "x" or m in ("awq",): pass')) == 2
