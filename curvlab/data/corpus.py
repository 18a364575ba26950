"""A natural-English corpus every machine with Python already holds: the text of the Python documentation that
ships with the interpreter, made into one UTF-8 file, offline and deterministically.

Two sources, both in the standard library of the running Python (PSF License Version 2; the documentation's
own licence): the reference manual's topics that ``pydoc`` shows (``pydoc_data.topics``, the Language
Reference's sections as plain text), then the docstrings of every standard-library module, class and
function (``ast.get_docstring``; ``test``, ``tests``, ``idlelib`` and ``site-packages`` left out). Each topic
and each docstring is one document, one line of the file: its whitespace collapsed to single spaces.
Files go in sorted order and nodes in ``ast.walk`` order, so the file depends only on the Python build: its
version and which standard-library files its distribution installs (both recorded, with the text's digest; a
distribution may split modules into packages of their own or patch them). A run on another Python is a
replicate on another text.

Why this text: it is prose written by people (technical English, with code names in it), a few megabytes,
on every machine that runs curvlab, and under a licence that allows it; a public-domain book would need a
download.
"""

from __future__ import annotations

import ast
import hashlib
import platform
import sysconfig
from pathlib import Path
from typing import Any

from curvlab.errors import CurvlabError
from curvlab.util.atomic import atomic_write_text

CORPORA = ("python-docs",)
"""The corpora curvlab makes itself (a preset's ``Language.corpus``)."""
LICENCE = "PSF License Version 2 (Python's documentation and standard library)"
LEFT_OUT = {"test", "tests", "idlelib", "site-packages"}


def _documents_of(path: Path) -> list[str]:
    """The docstrings of a module's nodes, in walk order (a file Python can't parse gives none)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = (
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    )
    return [text for n in nodes if (text := ast.get_docstring(n, clean=True))]


def python_docs_documents() -> tuple[list[str], int, int]:
    """The corpus's documents (module docstring), whitespace collapsed, with the counts of topics and of files.

    Raises:
        CurvlabError: a Python without the sources of its standard library (some distributions strip them), or
            without ``pydoc_data``.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if not LEFT_OUT & set(p.relative_to(stdlib).parts))
    if not files:
        raise CurvlabError(
            f"{stdlib}: no standard-library sources to take the Python documentation from (install them, e.g. "
            "`apt install libpython3-stdlib`, or give your own text: curvlab data text FILE --vocab-size 1024 "
            "--out DIR, then --data DIR)"
        )
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise CurvlabError(
            "this Python has no pydoc_data (the Language Reference's topics): install its full standard library, "
            "or give your own text: curvlab data text FILE --vocab-size 1024 --out DIR, then --data DIR"
        ) from None
    documents = [topics[k] for k in sorted(topics)]
    for path in files:
        documents += _documents_of(path)
    return [line for d in documents if (line := " ".join(d.split()))], len(topics), len(files)


def write_corpus(name: str, path: str | Path) -> dict[str, Any]:
    """Write the corpus ``name`` to ``path`` (one document a line, atomically) and return its record: name,
    licence, the Python version it was made from, documents, bytes and sha256.

    Raises:
        CurvlabError: an unknown corpus name, or one this machine can't make.
    """
    if name not in CORPORA:
        raise CurvlabError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    documents, topics, files = python_docs_documents()
    text = "\n".join(documents) + "\n"
    atomic_write_text(path, text)
    data = text.encode("utf-8")
    return {
        "name": name,
        "licence": LICENCE,
        "python": platform.python_version(),
        "documents": len(documents),
        "topics": topics,
        "files": files,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
