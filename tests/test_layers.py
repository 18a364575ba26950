"""The import-layers contract: a subpackage imports only its own layer and the layers below, and no module
imports the package root (the facade) or takes part in an import cycle. Imports inside functions count."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "curvlab"
# bottom to top; one entry a layer
LAYERS = ("errors", "util", "inference", "models", "data", "engine", "curvature", "optim", "steps", "theory",
          "runs", "analysis", "studies", "output", "jobs", "cli")  # fmt: skip
FACADES = {"curvlab", "curvlab.__main__"}  # the package root re-exports the public API; __main__ runs the CLI


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return "" if len(parts) == 1 else parts[1]


def imports(path: Path, modules: set[str]) -> set[str]:
    """The curvlab modules ``path`` imports (``from curvlab.x import y`` names the module ``curvlab.x.y``
    when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "curvlab"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "curvlab":
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    return {m: imports(p, modules) - {m} for m, p in paths.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every arrow that runs up a layer or into the facade, and every import cycle."""
    rank = {name: k for k, name in enumerate(LAYERS)}
    bad = []
    for src, targets in edges.items():
        if src in FACADES:
            continue
        for dst in sorted(targets):
            if dst in FACADES:
                if layer(src) != "cli":  # the CLI, at the top, may read the version
                    bad.append(f"{src} imports the package root {dst}")
            elif layer(src) not in rank or layer(dst) not in rank:
                bad.append(f"{src} -> {dst}: a layer outside {LAYERS}")
            elif rank[layer(dst)] > rank[layer(src)]:
                bad.append(f"{src} ({layer(src)}) imports {dst} ({layer(dst)}), a higher layer")
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                bad.append("cycle: " + " -> ".join([*stack[stack.index(nxt) :], node, nxt]))
            elif nxt in edges and not state.get(nxt):
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(edges):
        if not state.get(node):
            visit(node, [])
    return bad


def test_every_module_sits_in_a_known_layer():
    unknown = sorted(m for m in graph() if m not in FACADES and layer(m) not in LAYERS)
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_imports_flow_down_the_layers_without_cycles():
    assert violations(graph()) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"curvlab.engine.hvp": {"curvlab.runs.train"}, "curvlab.runs.train": set()}, "a higher layer"),
        ({"curvlab.engine.a": {"curvlab.engine.b"}, "curvlab.engine.b": {"curvlab.engine.a"}}, "cycle"),
        ({"curvlab.studies.x": {"curvlab"}}, "package root"),
    ],
)
def test_the_contract_catches_an_arrow_up_a_cycle_and_the_facade(edges, expected):
    assert any(expected in v for v in violations(edges))


def test_output_imports_nothing_from_the_training_layer():
    """Output formats results; importing it must not load training (runs/), not even for a type hint."""
    reach = sorted(f"{m} -> {d}" for m, ds in graph().items() if layer(m) == "output" for d in ds if layer(d) == "runs")
    assert reach == []
