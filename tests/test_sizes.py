"""Pieces a reader can hold in mind: no module in ``curvlab/`` runs over 600 lines and no function over 80 lines
of code (its docstring not counted), so a long job is split into named steps and a long module by concept."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "curvlab").rglob("*.py"))
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines of code) of every function and method in ``source``.

    A function's lines run from its ``def`` line to its last line, ``end_lineno - lineno + 1``, less the lines of
    its docstring; a nested function counts within its enclosing one as well as on its own.

    Args:
        source: the text of a Python module.

    Returns:
        One entry per function, in source order (an enclosing function before those it holds).
    """
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                first = child.body[0]
                if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                    lines -= first.end_lineno - first.lineno + 1
                found.append((name, child.lineno, lines))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_function_lengths_counts_code_and_leaves_out_the_docstring():
    body = "".join(f"    x{k} = {k}\n" for k in range(81))
    docstring = '    """A docstring\n\n    over three lines."""\n'
    source = f"def long_one():\n{docstring}{body}\n\nclass Holder:\n    def short(self):\n        return 1\n"
    lengths = {name: (line, n) for name, line, n in function_lengths(source)}
    # the def line and 81 assignments: one line over the limit, which the tree test would report
    assert lengths["long_one"] == (1, 82)
    assert lengths["long_one"][1] > MAX_FUNCTION_LINES
    assert lengths["Holder.short"][1] == 2


def test_function_lengths_reports_an_81_line_function():
    body = "".join(f"    x{k} = {k}\n" for k in range(80))  # with the def line: 81 lines of code
    lengths = dict((name, n) for name, _, n in function_lengths(f"def too_long():\n{body}"))
    assert lengths == {"too_long": 81}


def test_function_lengths_counts_a_nested_function_in_its_parent():
    source = "def outer():\n    def inner():\n        '''Doc.'''\n        return 1\n    return inner\n"
    assert function_lengths(source) == [("outer", 1, 5), ("outer.inner", 2, 2)]


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_the_line_limit():
    long = [
        f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
        for p in SOURCES
        for name, line, n in function_lengths(p.read_text())
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code: {long}"


ALLOWED_ALIASES = {("torch.nn.functional", "F")}  # the field's one universal single-letter alias


def single_letter_aliases(source: str) -> list[str]:
    """``line: import`` for every import in ``source`` bound to a one-letter name (``from curvlab.engine import
    params as P``), but for :data:`ALLOWED_ALIASES`: a reader meets ``P.dot`` far from the import, where
    ``param_dicts.dot`` says what it is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                prefix = f"{node.module}." if isinstance(node, ast.ImportFrom) and node.module else ""
                name = f"{prefix}{alias.name}"
                if alias.asname and len(alias.asname) == 1 and (name, alias.asname) not in ALLOWED_ALIASES:
                    found.append(f"{node.lineno}: {name} as {alias.asname}")
    return found


def test_no_single_letter_import_alias():
    synthetic = (
        "import torch.nn.functional as F\nfrom torch.nn import functional as F\nimport numpy as np\n"
        "from curvlab.engine import params as P\ndef f():\n    import curvlab.util.schema as S\n"
    )
    assert single_letter_aliases(synthetic) == ["4: curvlab.engine.params as P", "6: curvlab.util.schema as S"]
    found = [f"{p.relative_to(ROOT)}:{hit}" for p in SOURCES for hit in single_letter_aliases(p.read_text())]
    assert not found, f"single-letter import aliases (name the module): {found}"
