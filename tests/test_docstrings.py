"""Docstrings say what the code does: no escape sequence turned into a control character (in a non-raw
docstring ``\\top`` is a tab and "op"), one spelling for a backslash, and every name they cite exists
where they say it does."""

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

from griffe import Docstring, DocstringSectionKind

import curvlab

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "curvlab").rglob("*.py"))
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# a Sphinx cross-reference, :role:`name` or :role:`~name`
REFERENCE = re.compile(r":(?:meth|attr|class|func|mod|data|obj|exc):`~?([A-Za-z_][\w.]*)`")
# a literal ``Class.attr`` (or ``Class.method()``); checked where Class is one of curvlab's classes
LITERAL = re.compile(r"``([A-Z]\w*)\.([A-Za-z_]\w*)(?:\(\))?``")


def _docstrings(tree: ast.Module):
    """(the names of the enclosing classes, the node, its docstring's literal) for every documented node."""

    def walk(node, classes):
        if isinstance(node, DOCUMENTED) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
                yield classes, node, first.value
        inner = (*classes, node.name) if isinstance(node, ast.ClassDef) else classes
        for child in ast.iter_child_nodes(node):
            yield from walk(child, inner)

    yield from walk(tree, ())


def _where(path: Path, node) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '<module>')}"


def control_characters(source: str) -> list[tuple[int, str]]:
    """(line, characters) of each docstring in ``source`` holding a control character other than a newline:
    what a non-raw ``\\t``, ``\\b``, ``\\f``, ``\\r``, ``\\v`` or ``\\a`` becomes."""
    out = []
    for _, _, doc in _docstrings(ast.parse(source)):
        bad = sorted({repr(c) for c in doc.value if (ord(c) < 32 and c != "\n") or ord(c) == 127})
        if bad:
            out.append((doc.lineno, ", ".join(bad)))
    return out


def unraw_backslashes(source: str) -> list[int]:
    """The lines of the docstrings in ``source`` whose literal holds a backslash but isn't raw."""
    lines = source.encode().splitlines()  # (get_source_segment splits the whole source again for each literal)
    found = []
    for _, _, doc in _docstrings(ast.parse(source)):
        span = lines[doc.lineno - 1 : doc.end_lineno]  # the offsets count UTF-8 bytes
        literal = b"\n".join([*span[:-1], span[-1][: doc.end_col_offset]])[doc.col_offset :].decode()
        if "\\" in literal and literal[0] not in "rR":
            found.append(doc.lineno)
    return found


BROKEN = 'def f(F, Q):\n    """:math:`\\frac{1}{2} (I - QQ^\\top)F`."""\n'


def test_the_scans_see_an_escape_turned_control_character():
    assert control_characters(BROKEN) == [(2, "'\\t', '\\x0c'")]
    assert unraw_backslashes(BROKEN) == [2]
    raw = BROKEN.replace('"""', 'r"""', 1)
    assert control_characters(raw) == [] and unraw_backslashes(raw) == []


def test_no_docstring_holds_a_control_character():
    found = [f"{p.relative_to(ROOT)}:{line}: {c}" for p in SOURCES for line, c in control_characters(p.read_text())]
    assert not found, "docstrings with control characters (make them raw):\n" + "\n".join(found)


def test_a_docstring_with_a_backslash_is_raw():
    """One spelling for LaTeX in a docstring: ``r\"\"\"... \\langle ...\"\"\"``, not a doubled backslash."""
    found = [f"{p.relative_to(ROOT)}:{line}" for p in SOURCES for line in unraw_backslashes(p.read_text())]
    assert not found, "non-raw docstrings with a backslash:\n" + "\n".join(found)


def _self_attributes() -> dict[str, set[str]]:
    """Per class name, the attributes its methods assign on ``self`` (instance attributes)."""
    out: dict[str, set[str]] = {}
    for path in SOURCES:
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            names = out.setdefault(cls.name, set())
            for node in ast.walk(cls):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return out


def _has(obj, name: str, assigned: dict[str, set[str]]) -> bool:
    """``obj.name`` exists: an attribute, a dataclass field without a default, or one a method sets on self."""
    if hasattr(obj, name):
        return True
    if not isinstance(obj, type):
        return False
    fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    return name in fields or any(name in assigned.get(c.__name__, ()) for c in obj.__mro__)


def _resolves(root, parts: list[str], assigned: dict[str, set[str]]) -> bool:
    obj = root
    for i, name in enumerate(parts):
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif i < len(parts) - 1 or not _has(obj, name, assigned):
            return False
    return True


def _absolute(parts: list[str]):
    """(the longest importable module prefix of ``parts``, the rest), or None."""
    for i in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:i])), parts[i:]
        except ImportError:
            continue
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_name_a_docstring_cites_exists():
    """Each cross-reference resolves as Sphinx looks it up (an absolute path, else from the enclosing
    classes outwards to the module), and each literal ``Class.attr`` naming a curvlab class names one of
    its attributes, fields or methods."""
    assigned = _self_attributes()
    modules = {p: importlib.import_module(_module_name(p)) for p in SOURCES if p.name != "__main__.py"}
    classes: dict[str, list[type]] = {}
    for module in modules.values():
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__.startswith("curvlab."):
                classes.setdefault(value.__name__, []).append(value)
    found, checked = [], 0
    for path, module in modules.items():
        for enclosing, node, doc in _docstrings(ast.parse(path.read_text())):
            scopes = [module]
            for name in (*enclosing, node.name) if isinstance(node, ast.ClassDef) else enclosing:
                if not hasattr(scopes[0], name):  # a class made inside a function
                    break
                scopes.insert(0, getattr(scopes[0], name))  # innermost first
            for name in REFERENCE.findall(doc.value):
                checked += 1
                parts = name.split(".")
                absolute = _absolute(parts)
                if not (
                    (absolute is not None and _resolves(*absolute, assigned))
                    or any(_resolves(scope, parts, assigned) for scope in scopes)
                ):
                    found.append(f"{_where(path, node)}: {name}")
            for cls, attr in LITERAL.findall(doc.value):
                if cls in classes:
                    checked += 1
                    if not any(_has(c, attr, assigned) for c in classes[cls]):
                        found.append(f"{_where(path, node)}: ``{cls}.{attr}``")
    assert checked > 500, checked  # the scan sees the references (there are hundreds)
    assert not found, "docstrings citing names that don't exist:\n" + "\n".join(found)


# a context manager's generator: ``with`` gives None, so there is nothing to return
NOTHING_RETURNED = {None, type(None), "None", "Iterator[None]", "Generator[None, None, None]"}


def _sections(obj) -> list:
    """The Google-style sections of what the reference renders for ``obj``: its docstring, and for a class
    its own ``__init__``'s (``merge_init_into_class``) and, for a dataclass, its bases' (where inherited
    fields are documented)."""
    owners = [c for c in obj.__mro__ if c is not object] if dataclasses.is_dataclass(obj) else [obj]
    docs = [vars(c).get("__doc__") if isinstance(c, type) else c.__doc__ for c in owners]
    if isinstance(obj, type) and "__init__" in vars(obj):
        docs.append(vars(obj)["__init__"].__doc__)
    return [s for d in docs if d for s in Docstring(inspect.cleandoc(d)).parse("google", warnings=False)]


def missing_sections(obj) -> list[str]:
    """What the docstring of a function or class leaves out: each parameter of its signature (a class's
    constructor, ``self`` aside) not under ``Args:`` (a dataclass's fields may be under ``Attributes:``),
    and ``Returns:`` where a function's return annotation isn't ``None`` (or absent)."""
    sections = _sections(obj)
    kinds = {DocstringSectionKind.parameters}
    if dataclasses.is_dataclass(obj):
        kinds.add(DocstringSectionKind.attributes)
    documented = {item.name.lstrip("*") for s in sections if s.kind in kinds for item in s.value}
    signature = inspect.signature(obj)
    out = [f"Args: {name}" for name in signature.parameters if name != "self" and name not in documented]
    returns = signature.return_annotation
    if (
        not isinstance(obj, type)
        and returns not in NOTHING_RETURNED
        and not any(s.kind is DocstringSectionKind.returns for s in sections)
    ):
        out.append("Returns:")
    return out


def _documented_example(loss_fn, params, *, dtype=None) -> float:
    """An example.

    Args:
        loss_fn: the loss.
        dtype: a dtype.
    """
    return 0.0


def test_the_section_check_names_a_missing_parameter_and_returns():
    assert missing_sections(_documented_example) == ["Args: params", "Returns:"]
    assert missing_sections(curvlab.hvp) == []


def test_every_export_documents_its_arguments_and_return_value():
    """Each function and class of ``curvlab.__all__`` names every parameter under ``Args:`` and, where it
    returns a value, has ``Returns:`` (as mkdocstrings renders them: tests/test_api_reference.py)."""
    checked, found = 0, []
    for name in curvlab.__all__:
        obj = getattr(curvlab, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue  # the constants (METHODS, ...) and the params module have no signature
        checked += 1
        found += [f"curvlab.{name}: {what}" for what in missing_sections(obj)]
    assert checked > 45, checked  # every function and class is seen, the lazily loaded ones included
    assert not found, "docstrings without these sections:\n" + "\n".join(found)
