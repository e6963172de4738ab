"""The house the next features land in (issue #68): figures of the code that say how far it is from one typed result,
held where they are today so that they only go down. Each ceiling is today's figure with the issue's target beside it;
lower a ceiling when a change lowers its figure."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("tasks", "flows")

# string-key subscripts (``row["ppl"]``): results travelling as untyped dicts. Target (#68): at most 300, all in the
# serialization and MLflow modules
SUBSCRIPTS_CEILING = 148
# ... and those outside the modules that read a format (a ``*_said.py`` reader, the record's serial.py, row.py, spool.py,
# a reference's manifest.py) or write MLflow (tracking.py). Target (#68): none
OUTSIDE_READERS_CEILING = 0
READERS = ("serial.py", "row.py", "spool.py", "manifest.py", "tracking.py")
# branches on whether an audit has one corpus or several (an audit's ``named``/``by_domain``, a config's ``corpora``, a
# record's ``domains``): one corpus and several as two shapes. Target (#68): at most 3
SHAPE_BRANCHES_CEILING = 2
# flows/audit.py reads top to bottom: target (#68) at most 120 lines
AUDIT_FLOW_LINES_CEILING = 118
# no function in flows/ over 40 lines (#68): none is today; one that must be (say why) is listed here with its length
LONG_FLOW_FUNCTIONS: dict[tuple[str, str], int] = {}
FUNCTION_LINES = 40


def _modules() -> list[Path]:
    return sorted(path for package in CODE for path in (ROOT / package).rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def string_subscripts() -> Counter:
    """The string-key subscripts of each module of tasks/ and flows/."""
    found = Counter()
    for path in _modules():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str) and not _not_a_key_read(node):
                found[str(path.relative_to(ROOT))] += 1
    return found


def _not_a_key_read(node: ast.Subscript) -> bool:
    """``Literal["auto"]``: a type that holds a string, not a key read from a dict; ``os.environ["X"]``: the
    process's environment, not a result."""
    if isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
        return isinstance(node.value.value, ast.Name) and node.value.value.id == "os"
    return isinstance(node.value, ast.Name) and node.value.id == "Literal"


def test_string_key_subscripts_only_go_down():
    found = string_subscripts()
    total = sum(found.values())
    most = ", ".join(f"{module} {count}" for module, count in found.most_common(5))
    assert total <= SUBSCRIPTS_CEILING, (f"{total} string-key subscripts in tasks/ and flows/, more than the "
                                         f"{SUBSCRIPTS_CEILING} of before (most in {most}): a new figure belongs in "
                                         "a typed value, not a dict")


def _a_reader(module: str) -> bool:
    name = Path(module).name
    return name.endswith("_said.py") or name in READERS


def test_string_key_subscripts_outside_the_readers_only_go_down():
    outside = Counter({module: count for module, count in string_subscripts().items() if not _a_reader(module)})
    total = sum(outside.values())
    assert total <= OUTSIDE_READERS_CEILING, (f"{total} string-key subscripts outside the modules that read a format, "
                                              f"more than the {OUTSIDE_READERS_CEILING} of before "
                                              f"({outside.most_common(5)}): read it once, in a *_said.py reader")


def _on_the_shape(test: ast.AST) -> bool:
    """Whether a condition asks one corpus or several."""
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and node.attr in ("named", "by_domain", "corpora"):
            return True
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and node.left.value in ("domains", "domain") and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in ("domains", "domain"):
            return True
    return False


def shape_branches() -> Counter:
    """The branches of each module of tasks/ and flows/ on one corpus or several: an if, a conditional expression or a
    comprehension's condition that asks it."""
    found = Counter()
    for path in _modules():
        for node in ast.walk(_tree(path)):
            tests = ([node.test] if isinstance(node, ast.If | ast.IfExp | ast.While)
                     else node.ifs if isinstance(node, ast.comprehension) else [])
            if any(_on_the_shape(test) for test in tests):
                found[str(path.relative_to(ROOT))] += 1
    return found


def test_one_corpus_and_several_are_branched_on_less_and_less():
    found = shape_branches()
    total = sum(found.values())
    assert total <= SHAPE_BRANCHES_CEILING, (f"{total} branches on one corpus or several, more than the "
                                             f"{SHAPE_BRANCHES_CEILING} of before ({found.most_common(5)}): an audit of "
                                             "one corpus is an audit of one domain")


def test_the_audit_flow_only_gets_shorter():
    lines = len((ROOT / "flows" / "audit.py").read_text(encoding="utf-8").splitlines())
    assert lines <= AUDIT_FLOW_LINES_CEILING, f"flows/audit.py has {lines} lines, more than {AUDIT_FLOW_LINES_CEILING}"


def test_no_function_in_flows_grows_past_forty_lines():
    over = {}
    for path in _modules():
        if path.relative_to(ROOT).parts[0] != "flows":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_LINES:
                    over[(str(path.relative_to(ROOT)), node.name)] = length
    grown = {name: length for name, length in over.items() if length > LONG_FLOW_FUNCTIONS.get(name, FUNCTION_LINES)}
    assert not grown, f"functions in flows/ over {FUNCTION_LINES} lines, or longer than before: {grown}"


# names defined in several modules that are the same thing in each: each method module's descriptor, 2**20, a
# process's entry point (#68: a public name defined in two modules is the same thing or is renamed)
SAME_THING = {"METHOD", "MIB", "main"}


def test_a_public_name_is_defined_in_one_module_unless_it_is_the_same_thing():
    where: dict[str, list[str]] = {}
    for path in _modules():
        for node in _tree(path).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [target.id for target in node.targets if isinstance(target, ast.Name)]
            else:
                names = [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else []
            for name in names:
                where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    # a command module's parts (NAME, add, run...) are its interface to flows/cli.py, the same in each
    interface = {"NAME", "LOGGED", "LOGGED_ACTIONS", "add", "run"}
    twice = {name: modules for name, modules in where.items()
             if len(modules) > 1 and not name.startswith("_") and name not in SAME_THING | interface}
    assert not twice, f"public names defined in more than one module: {twice}"
