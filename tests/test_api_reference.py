"""The API reference: every name ``curvlab`` exports has a docstring and a page, and the site builds strictly.

The reference is mkdocs + mkdocstrings (mkdocs.yml at the repository root, pages under docs/api/): each
page names what it renders with ``::: dotted.path`` lines, a module optionally with ``members: [...]``
(its listed members) or ``members: false`` (its docstring alone). Coverage is computed here from
``curvlab.__all__`` at test time, by identity: an exported object is documented when some identifier of
a page resolves to that very object, so a rename or a move shows up as the one name without a page.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import griffe
import pytest
import typer.main
import yaml

import curvlab
from curvlab.cli import app

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
# ``::: path`` at the start of a line, then the indented YAML of its options (if any)
IDENTIFIER = re.compile(r"^::: *(\S+)[ \t]*\n((?:[ \t]+\S.*(?:\n|\Z))*)", re.MULTILINE)


def identifiers(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The ``::: path`` identifiers of a page with their ``options`` (``{}`` when none)."""
    out = []
    for m in IDENTIFIER.finditer(text):
        block = yaml.safe_load(textwrap.dedent(m.group(2))) if m.group(2).strip() else None
        out.append((m.group(1), (block or {}).get("options") or {}))
    return out


def page_identifiers() -> list[tuple[str, dict[str, Any]]]:
    return [i for page in sorted(API.glob("*.md")) for i in identifiers(page.read_text())]


def resolve(path: str) -> Any:
    """The object a dotted path names: its longest importable module prefix, then attributes.

    Raises:
        LookupError: nothing of that name.
    """
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise LookupError(path)


def rendered(path: str, options: dict[str, Any]) -> list[tuple[str, Any]]:
    """(path, object) of what one identifier documents: the object, or a module's rendered members."""
    obj = resolve(path)
    if not isinstance(obj, ModuleType):
        return [(path, obj)]
    members = options.get("members", True)
    if members is False:  # the module's docstring alone
        return []
    if members is True:  # every public member the module defines, and the module itself
        names = [n for n, v in vars(obj).items() if not n.startswith("_") and getattr(v, "__module__", None) == path]
        return [(path, obj)] + [(f"{path}.{n}", getattr(obj, n)) for n in names]
    return [(f"{path}.{n}", getattr(obj, n)) for n in members]


def defined_at(obj: Any) -> str | None:
    """Where an object is defined, as a dotted path (``None`` for a plain value, which has no such record)."""
    if isinstance(obj, ModuleType):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else None


def undocumented(exports: dict[str, Any], pages: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The exported names no page renders, each with the identifier that would document it."""
    documented = [obj for path, options in pages for _, obj in rendered(path, options)]
    missing = []
    for name, obj in exports.items():
        if not any(obj is d for d in documented):
            where = defined_at(obj) or f"<where curvlab.{name} is defined>"
            missing.append(f"curvlab.{name}: add `::: {where}` to a docs/api/*.md page")
    return missing


def exports() -> dict[str, Any]:
    return {name: getattr(curvlab, name) for name in curvlab.__all__}


def test_every_identifier_resolves():
    pages = page_identifiers()
    assert len(pages) >= 40, "the identifier pattern no longer finds the pages' identifiers"
    bad = []
    for path, options in pages:
        try:
            rendered(path, options)
        except (LookupError, AttributeError) as e:
            bad.append(f"{path}: {e!r}")
    assert not bad, bad


def test_every_export_has_a_page():
    assert not undocumented(exports(), page_identifiers())


def test_every_export_has_a_docstring():
    """Each exported object has a docstring, at run time (``inspect.getdoc``) and as the reference reads it
    (griffe, statically: a class without its own docstring has none there, where ``inspect.getdoc`` would
    give a base class's or the one ``dataclass`` writes)."""
    package = griffe.load("curvlab", search_paths=[str(ROOT)], docstring_parser="google")
    placed = {id(obj): path for path, options in page_identifiers() for path, obj in rendered(path, options)}
    missing = []
    for name, obj in exports().items():
        path = defined_at(obj) or placed.get(id(obj))
        if path is None:
            missing.append(f"curvlab.{name}: neither defined by name nor on a page")
            continue
        try:
            static = package[path.removeprefix("curvlab.")] if path != "curvlab" else package
        except KeyError:
            missing.append(f"curvlab.{name}: the reference finds no {path}")
            continue
        if not inspect.getdoc(obj) or static.docstring is None or not static.docstring.value.strip():
            missing.append(f"curvlab.{name} ({path}) has no docstring")
    assert not missing, missing


def test_coverage_check_can_fail():
    """The coverage check names what no identifier renders (so the test above is not vacuous)."""
    from curvlab.engine import params
    from curvlab.engine.hvp import CurvaturePoint, hvp, hvps

    some = {"hvp": hvp, "hvps": hvps, "CurvaturePoint": CurvaturePoint, "params": params}
    page = """
::: curvlab.engine.hvp
    options:
      members: false

::: curvlab.engine.hvp.CurvaturePoint

::: curvlab.engine.hvp
    options:
      members: [hvps]
"""
    assert undocumented(some, identifiers(page)) == [
        "curvlab.hvp: add `::: curvlab.engine.hvp.hvp` to a docs/api/*.md page",
        "curvlab.params: add `::: curvlab.engine.params` to a docs/api/*.md page",
    ]
    assert undocumented(some, identifiers(page + "\n::: curvlab.engine.hvp.hvp\n\n::: curvlab.engine.params\n")) == []
    with pytest.raises(LookupError):
        resolve("curvlab.engine.hvp.no_such_function")


def test_the_cli_page_lists_every_command():
    commands = set(typer.main.get_command(app).commands)
    listed = set(re.findall(r"^\| `curvlab ([\w-]+)`", (API / "cli.md").read_text(), flags=re.MULTILINE))
    assert listed == commands


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The documentation site, built as a user builds it, with every warning an error."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = build.stdout + build.stderr
    assert build.returncode == 0 and "WARNING" not in log, log
    return out


def test_the_site_builds_strictly_with_every_export(site):
    """Every exported object is an anchor of a built API page, under the path it is defined at."""
    html = "\n".join(p.read_text() for p in (site / "api").rglob("*.html"))
    placed = {id(obj): path for path, options in page_identifiers() for path, obj in rendered(path, options)}
    absent = [name for name, obj in exports().items() if f'id="{placed.get(id(obj))}"' not in html]
    assert not absent, absent
    assert (site / "guide" / "index.html").is_file() and (site / "science" / "index.html").is_file()
