"""No function of ours takes more than ``MOST_PARAMETERS`` parameters: settings travel as the typed values they are
(a config, a plan, a request), not as their fields one by one (#52)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOST_PARAMETERS = 7


def parameter_count(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional-only, positional and keyword-only parameters, but a method's ``self`` or ``cls``; ``*args`` and
    ``**kwargs`` count none (they pass through what another function takes, and that one is counted)."""
    arguments = function.args
    names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
    return len([name for name in names if name not in ("self", "cls")])


def functions(source: str) -> list[tuple[str, int, int]]:
    """``(name, line, parameters)`` of every function in ``source``, methods and nested functions too (a method is
    named after its class)."""
    found = []

    def visit(node: ast.AST, within: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((within + child.name, child.lineno, parameter_count(child)))
                visit(child, f"{within}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{within}{child.name}.")
            else:
                visit(child, within)

    visit(ast.parse(source), "")
    return found


def test_the_count_is_what_the_rule_says():
    source = ("def f(a, b, /, c, *args, d, e=1, **kwargs): pass\n"
              "class C:\n"
              "    def m(self, a): pass\n"
              "    @classmethod\n"
              "    def k(cls, a, b): pass\n"
              "    def inner(self):\n"
              "        def nested(x, y, z): pass\n")
    assert functions(source) == [("f", 1, 5), ("C.m", 3, 1), ("C.k", 5, 2), ("C.inner", 6, 0),
                                 ("C.inner.nested", 7, 3)]


def test_no_function_takes_more_than_seven_parameters():
    over = [f"{path.relative_to(ROOT)}:{line} {name} takes {count}"
            for folder in ("flows", "tasks") for path in sorted((ROOT / folder).rglob("*.py"))
            for name, line, count in functions(path.read_text()) if count > MOST_PARAMETERS]
    assert not over, (f"{len(over)} function(s) take more than {MOST_PARAMETERS} parameters; pass the typed values "
                      "the settings are (a config, a plan, a request):\n" + "\n".join(over))
