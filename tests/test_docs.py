"""The documentation keeps working: its examples run, its commands parse, its links and citations resolve.

Every fenced ```python block of README.md and docs/*.md runs, the blocks of one page in order in one fresh
namespace, in a temporary working directory. A block that genuinely cannot run here (several processes, a
GPU, a download) carries a visible mark right above it, ``<!-- not run: <reason> -->``; it is still
compiled, and the marks are counted so that they stay rare. Every ```bash / ```sh block's ``curvlab``
commands (also as ``python -m curvlab`` and under ``torchrun``) are checked against the typer app's click
commands: the subcommand exists (its ``--help`` exits 0), every flag is one of its options, and the
positional arguments fit its arguments. Scripts a block runs (``python benchmarks/x.py``) must exist.

Links: every relative link or image in those pages resolves to a file of the repository (and a
``#fragment`` into a markdown page to one of its headings). Citations: every ``science.md section N`` in
code, tests, benchmarks, experiments, notebooks and the pages names a section docs/science.md has, and no
code cites the development-only SCIENCE.md/ARCHITECTURE.md or a path outside the repository.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import socket
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
import torch.distributed as dist
import typer.main
from typer.core import TyperArgument, TyperGroup, TyperOption
from typer.testing import CliRunner

from curvlab.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("curvlab", "tests", "benchmarks", "experiments", "notebooks")
CODE_SUFFIXES = {".py", ".ipynb", ".md", ".json", ".toml", ".txt"}
MAX_NOT_RUN = 3  # marks must stay rare: raise this only with a reason in the mark itself

FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not run:\s*([^>]*?)\s*-->\s*\Z")
TORCHRUN = re.compile(r"<!--\s*run as one torchrun process\b[^>]*-->\s*\Z")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CITATION = re.compile(
    r"science\.md[\s\"'#*,]*(?:\\n[\s\"',]*)?(?:§|sections?)\s*(\d+(?:\s*(?:-|–|,|and)\s*\d+)*)", re.IGNORECASE
)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason given in the mark, or None when the block must run
    torchrun: bool = False  # run as the one process of ``torchrun --nproc_per_node 1`` would

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[max(0, m.start() - 300) : m.start()]
        mark = NOT_RUN.search(before)
        line = text.count("\n", 0, m.start()) + 1
        lang, code = m.group(1).lower(), m.group(2)
        out.append(Block(page, line, lang, code, mark.group(1) if mark else None, bool(TORCHRUN.search(before))))
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
PYTHON_PAGES = sorted({b.page for b in ALL_BLOCKS if b.lang == "python"})
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell", "console")]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# --- python examples ------------------------------------------------------------------------------


@contextlib.contextmanager
def one_process_torchrun(monkeypatch):
    """The environment ``torchrun --standalone --nproc_per_node 1`` gives its one process; the process
    group a block sets up in it is torn down after."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=page_id)
def test_python_examples_run(page, tmp_path, monkeypatch):
    """The page's python blocks, in order, in one namespace and a scratch working directory."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for block in (b for b in blocks(page) if b.lang == "python"):
        code = compile(block.code, block.where, "exec")  # every block, marked or not, is valid Python
        if block.not_run is not None:
            continue
        if block.torchrun:
            with one_process_torchrun(monkeypatch):
                exec(code, namespace)
        else:
            exec(code, namespace)


def test_not_run_marks_are_rare_and_say_why():
    marked = [b for b in ALL_BLOCKS if b.not_run is not None]
    assert all(len(b.not_run) >= 10 for b in marked), [b.where for b in marked]
    assert all(b.lang == "python" for b in marked), "shell blocks are only parsed: they need no mark"
    assert len(marked) <= MAX_NOT_RUN, [f"{b.where}: {b.not_run}" for b in marked]


def test_fences_are_found():
    """The parser sees the pages' blocks (a broken fence regex would make every test above vacuous)."""
    langs = [b.lang for b in ALL_BLOCKS]
    assert langs.count("python") >= 10 and len(SHELL_BLOCKS) >= 10
    for page in PAGES:  # every opening fence has its closing one
        assert page.read_text().count("```") == 2 * len(blocks(page)), page_id(page)


# --- shell commands ----------------------------------------------------------------------------


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at ; && || |."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                commands.append(command)
                command = []
            else:
                command.append(token)
        commands.append(command)
    return [c for c in commands if c]


def curvlab_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``curvlab`` (direct, ``python -m curvlab``, or under ``torchrun``), else None."""
    if argv[0] == "curvlab":
        return argv[1:]
    if "-m" in argv and argv[0] in ("python", "python3", "torchrun"):
        i = argv.index("-m")
        if argv[i + 1 : i + 2] == ["curvlab"]:
            return argv[i + 2 :]
    return None


def script(argv: list[str]) -> str | None:
    """The repository script a ``python path.py`` / ``torchrun ... path.py`` command runs, else None."""
    if argv[0] not in ("python", "python3", "torchrun") or "-m" in argv:
        return None
    return next((a for a in argv[1:] if a.endswith(".py")), None)


def check_click_args(command, args: list[str]) -> list[str]:
    """Problems of ``args`` against one click command's parameters (no callbacks run, no file touched)."""
    options = {o: p for p in command.params if isinstance(p, TyperOption) for o in (*p.opts, *p.secondary_opts)}
    arguments = [p for p in command.params if isinstance(p, TyperArgument)]
    problems, positional, i = [], 0, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0]
            option = options.get(name)
            if option is None:
                problems.append(f"no option {name}")
            elif not (option.is_flag or option.count) and "=" not in arg:
                if i + 1 >= len(args):
                    problems.append(f"{name} needs a value")
                i += option.nargs
        else:
            positional += 1
        i += 1
    if any(a.nargs == -1 for a in arguments):
        limit = float("inf")
    else:
        limit = sum(a.nargs for a in arguments)
    required = sum(a.nargs for a in arguments if a.required and a.nargs > 0)
    if not required <= positional <= limit:
        problems.append(f"{positional} positional argument(s), the command takes {required} to {limit}")
    return problems


def resolve(args: list[str]) -> tuple:
    """The click command ``args`` name (through groups), the names, and the rest of ``args``."""
    command = typer.main.get_command(app)
    names: list[str] = []
    while isinstance(command, TyperGroup) and args and not args[0].startswith("-"):
        sub = command.commands.get(args[0])
        assert sub is not None, f"curvlab has no command {' '.join([*names, args[0]])}"
        command, names, args = sub, [*names, args[0]], args[1:]
    return command, names, args


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_shell_commands_parse(block):
    runner = CliRunner()
    checked = 0
    for argv in shell_commands(block.code):
        args = curvlab_args(argv)
        if args is None:
            path = script(argv)
            if path is not None:
                assert (ROOT / path).is_file(), f"{block.where}: {path} is not in the repository"
            continue
        command, names, rest = resolve(args)
        help_ = runner.invoke(app, [*names, "--help"])
        assert help_.exit_code == 0 and "Usage" in help_.output, f"{block.where}: curvlab {' '.join(names)} --help"
        problems = check_click_args(command, rest)
        assert not problems, f"{block.where}: curvlab {' '.join(args)}: {'; '.join(problems)}"
        checked += 1
    assert checked or not any("curvlab" in " ".join(a) for a in shell_commands(block.code))


def test_click_check_can_fail():
    """The flag check rejects what the CLI rejects (so the test above is not vacuous)."""
    train, _, _ = resolve(["train"])
    assert check_click_args(train, ["--steps", "3", "--out", "r"]) == []
    assert check_click_args(train, ["--no-such-flag"]) == ["no option --no-such-flag"]
    nds, _, rest = resolve(["nds", "a.pt", "b.pt"])
    assert check_click_args(nds, rest) and not check_click_args(nds, rest[:1])
    with pytest.raises(AssertionError, match="no command"):
        resolve(["pcfg", "nonsense"])


# --- links and citations -------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.MULTILINE)}


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of ``page`` that name no file under ``root`` (or no heading of a linked page)."""
    text = FENCE.sub("", page.read_text())  # code blocks hold no links
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, flags=re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or root.resolve() not in (file, *file.parents):
            broken.append(target)
            continue
        if fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    assert not broken_links(page), f"{page_id(page)}: broken links {broken_links(page)}"


def test_link_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part 2\n")
    (tmp_path / "outside.md").write_text("")
    page = tmp_path / "docs" / "b.md"
    links = "[ok](a.md) [ok](a.md#its-part-2) ![missing](fig.png) [no heading](a.md#nothing) [web](https://x.org)"
    page.write_text(f"{links} [up](../outside.md)\n```python\n[in code](nowhere.md)\n```\n")
    assert broken_links(page, root=tmp_path / "docs") == ["fig.png", "a.md#nothing", "../outside.md"]
    assert broken_links(page, root=tmp_path) == ["fig.png", "a.md#nothing"]


def science_sections() -> set[int]:
    text = (ROOT / "docs" / "science.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\.", text, flags=re.MULTILINE)}


def cited_sections(spec: str) -> list[int]:
    """``"3, 10-12"`` -> [3, 10, 11, 12]."""
    out: list[int] = []
    for part in re.split(r"\s*(?:,|and)\s*", spec):
        ends = re.split(r"\s*[-–]\s*", part)
        out.extend(range(int(ends[0]), int(ends[-1]) + 1))
    return out


def cited_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in CODE_SUFFIXES and p.is_file()]
    return [p for p in files if "__pycache__" not in p.parts and p != Path(__file__).resolve()] + PAGES


def test_citations_parse():
    assert cited_sections("3, 10-12") == [3, 10, 11, 12] and cited_sections("3 and 10") == [3, 10]
    assert cited_sections("1–2") == [1, 2]
    found = CITATION.findall('docs/science.md\n    # sections 3 and 10, and "docs/science.md", section 4')
    assert found == ["3 and 10", "4"]
    assert science_sections() >= set(range(1, 13))


def test_science_citations_name_existing_sections():
    sections = science_sections()
    bad, total = [], 0
    for file in cited_files():
        for spec in CITATION.findall(file.read_text(errors="replace")):
            total += 1
            missing = [n for n in cited_sections(spec) if n not in sections]
            if missing:
                bad.append(f"{file.relative_to(ROOT)}: section(s) {missing}")
    assert total >= 20, "the citation pattern no longer finds the code's citations"
    assert not bad, bad


def test_no_citation_outside_the_repository():
    bad = []
    for file in cited_files():
        text = file.read_text(errors="replace")
        for pattern in (r"\bSCIENCE\.md", r"\bARCHITECTURE\.md", r"/work/", r"\.\./\.\./"):
            if re.search(pattern, text):
                bad.append(f"{file.relative_to(ROOT)}: {pattern}")
        for doc in re.findall(r"\bdocs/[\w./-]+?\.md\b", text):  # a cited page exists
            if not (ROOT / doc).is_file():
                bad.append(f"{file.relative_to(ROOT)}: {doc}")
    assert not bad, bad


# What a newcomer types, word for word: a change here is a change of what every user runs first.
MAIN_JOB = "pip install -e . && curvlab reproduce"
TESTS = 'pip install -e ".[dev]" && python -m pytest'
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
LOCAL_CPU_TORCH = "pip install torch==2.13.0"


def test_the_readme_quick_start_is_the_two_commands_ci_runs():
    """The README's ``# main job`` and ``# tests`` lines are these literal strings, ``.ci/run`` extracts the
    test line with its own ``sed`` (run here as CI runs it), installs the same local CPU wheel the README
    names, and the CPU install line points at PyTorch's CPU wheel index."""
    readme = (ROOT / "README.md").read_text()
    tagged = {tag: [line for line in readme.splitlines() if line.endswith(f"# {tag}")] for tag in ("main job", "tests")}
    assert tagged == {"main job": [f"{MAIN_JOB}  # main job"], "tests": [f"{TESTS}  # tests"]}
    ci = (ROOT / ".ci" / "run").read_text()
    sed = re.search(r"\$\((sed -n .*? README\.md) \| head -n 1\)", ci)
    assert sed, ".ci/run no longer extracts the README's test line"
    extracted = subprocess.run(["bash", "-c", sed.group(1)], cwd=ROOT, capture_output=True, text=True, check=True)
    assert extracted.stdout.splitlines() == [TESTS]
    assert "python3 -m venv" in ci  # a fresh virtual environment, then the same CPU wheel as the README's
    assert re.search(r"^python -m pip install (-q )?" + re.escape(LOCAL_CPU_TORCH.split()[-1]) + "$", ci, re.M)
    assert CPU_TORCH in readme and LOCAL_CPU_TORCH in readme


def test_the_readme_is_a_front_page():
    """The README stays a front page, 150 lines at most: its results sections keep the headline tables and
    link to their pages for the rest (issue 49)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail to docs/"


def test_the_quick_start_installs_what_it_runs():
    """``.[dev]`` names pytest and the test suite's packages, every core dependency states its supported
    range, and ``curvlab`` is an installed command (read from the installed package's own metadata)."""
    requirements = metadata.requires("curvlab")
    dev = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requirements if 'extra == "dev"' in r}
    assert {"pytest", "transformers", "peft", "nbclient", "lightning"} <= dev
    for requirement in (r for r in requirements if "extra ==" not in r):
        assert re.fullmatch(r"[\w-]+(<[\d.]+,>=[\d.]+|>=[\d.]+,<[\d.]+)", requirement), requirement
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts.get("curvlab") == "curvlab.cli:app"
