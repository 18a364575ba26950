"""The public surface keeps its one calling convention: options by keyword only and named alike, each ``f``
with its ``f_at`` or neither, no internal module imported across subpackages, the examples importing from
``curvlab`` alone, and ``import curvlab`` without the training layer."""

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import curvlab

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "curvlab"
OPTIONS = ("method", "dtype", "chunk_size", "blocks", "scope", "block_method")
OLD_NAMES = ("via", "subset", "hvp_method", "grouping")  # what the options were called before they had one name


def _callables(names):
    """``{name: function}`` for the functions among ``names`` of :mod:`curvlab`, and a class's constructor and
    public methods under ``Class.method`` (a record's constructor takes its fields, not options)."""
    out = {}
    for name in names:
        obj = getattr(curvlab, name)
        if inspect.isfunction(obj):
            out[name] = obj
        elif inspect.isclass(obj):
            if not dataclasses.is_dataclass(obj):
                out[f"{name}.__init__"] = obj.__init__
            out |= {f"{name}.{m}": f for m, f in vars(obj).items() if inspect.isfunction(f) and not m.startswith("_")}
    return out


def positional_options(functions) -> list[str]:
    """``name(option)`` for every option of :data:`OPTIONS` that a function takes positionally."""
    bad = []
    for name, f in functions.items():
        for p in inspect.signature(f).parameters.values():
            if p.name in OPTIONS and p.kind is not p.KEYWORD_ONLY:
                bad.append(f"{name}({p.name})")
    return bad


def test_every_exported_function_takes_its_options_by_keyword_only():
    functions = _callables(curvlab.__all__)
    assert len(functions) > 40  # (the lazy training-layer names are resolved too)
    assert positional_options(functions) == []


def test_the_keyword_only_check_can_fail():
    def hvp_like(loss_fn, params, batch, v, method="rev_rev", *, dtype=None):
        pass

    def fine(loss_fn, params, batch, v, *, method="rev_rev", dtype=None):
        pass

    assert positional_options({"hvp_like": hvp_like, "fine": fine}) == ["hvp_like(method)"]


def test_an_option_has_one_name_everywhere():
    old = [
        f"{name}({p})"
        for name, f in _callables(curvlab.__all__).items()
        for p in inspect.signature(f).parameters
        if p in OLD_NAMES
    ]
    assert old == []


def test_each_f_has_its_f_at_or_neither():
    exported = set(curvlab.__all__)
    twins = {n.removesuffix("_at") for n in exported if n.endswith("_at")}
    assert twins <= exported, twins - exported
    # every curvature function of a step over (loss_fn, params, batch, z) runs at a point: its twin is exported
    for name in ("nds", "taylor_split", "block_matrix", "taylor_split_and_block_matrix"):
        assert name in exported and f"{name}_at" in exported, name
        params = list(inspect.signature(getattr(curvlab, f"{name}_at")).parameters)
        assert params[:2] == ["point", "z"], name


def imports_of(path: Path) -> set[str]:
    """The curvlab modules ``path`` imports (``from curvlab.x import _y`` names ``curvlab.x._y``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("curvlab.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("curvlab"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")}
    return found


def foreign_internals(edges: dict[str, set[str]]) -> list[str]:
    """Every import of an underscore module (``curvlab.<sub>._x``) from outside its subpackage ``<sub>``."""
    bad = []
    for src, targets in edges.items():
        for dst in sorted(targets):
            parts = dst.split(".")
            internal = any(p.startswith("_") and not p.startswith("__") for p in parts[2:])
            if internal and src.split(".")[:2] != parts[:2]:
                bad.append(f"{src} imports {dst}")
    return bad


def test_no_module_imports_an_internal_module_of_another_subpackage():
    edges = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        edges[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = imports_of(path)
    assert len(edges) > 100
    assert foreign_internals(edges) == []


def test_the_internal_import_check_can_fail():
    edges = {
        "curvlab.steps.update": {"curvlab.engine._gathered", "curvlab.steps._no_trace"},
        "curvlab.runs.dcp": {"curvlab.runs._dcp_reader"},
    }
    assert foreign_internals(edges) == ["curvlab.steps.update imports curvlab.engine._gathered"]


def _modules_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\nprint(sorted(m for m in sys.modules if m.startswith('curvlab')))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_import_curvlab_loads_no_training_layer():
    loaded = _modules_after("import curvlab")
    assert "curvlab.engine.hvp" in loaded and "curvlab.curvature.taylor" in loaded
    assert [m for m in loaded if m.startswith("curvlab.runs")] == []


def test_the_training_layer_comes_on_first_use():
    loaded = _modules_after("from curvlab import CurvatureMonitor, restore_lightning")
    assert "curvlab.runs.monitor" in loaded and "curvlab.runs.checkpoint" in loaded
    from curvlab.runs.monitor import CurvatureMonitor, lightning_curvature_callback

    assert curvlab.CurvatureMonitor is CurvatureMonitor
    assert curvlab.lightning_curvature_callback is lightning_curvature_callback
    with pytest.raises(AttributeError, match="no attribute 'curvature_callback'"):
        getattr(curvlab, "curvature_callback")  # noqa: B009 (the old name is gone, not lazily found)


IMPORT = re.compile(r"^\s*from (curvlab[\w.]*) import ([^\n(]+|\([^)]*\))", re.MULTILINE)


@pytest.mark.parametrize("page", ["README.md", "docs/guide.md"])
def test_the_readme_and_the_guide_import_from_curvlab_alone(page):
    text = (ROOT / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    found = [
        (m, [n.strip() for n in names.strip("()").split(",") if n.strip()])
        for b in blocks
        for m, names in IMPORT.findall(b)
    ]
    assert found
    assert [m for m, _ in found if m != "curvlab"] == []
    assert [n for _, names in found for n in names if n not in curvlab.__all__] == []


def test_singular_and_plural_return_the_same_pair_on_a_quadratic():
    """L(w) = ½ wᵀAw + bᵀw: G = Aw + b and H = A, so <G,z> and <z,Az> are known exactly."""
    g = torch.Generator().manual_seed(0)
    M = torch.randn(5, 5, generator=g, dtype=torch.float64)
    A, b = M @ M.T, torch.randn(5, generator=g, dtype=torch.float64)
    w, zs = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)

    def loss_fn(p, batch):
        return 0.5 * p["w"] @ A @ p["w"] + b @ p["w"]

    params = {"w": w}
    gz, zhz = curvlab.forward_quadratic_forms(loss_fn, params, None, {"w": zs}, chunk_size=2)
    torch.testing.assert_close(gz, zs @ (A @ w + b))
    torch.testing.assert_close(zhz, torch.einsum("ki,ij,kj->k", zs, A, zs))
    for k in range(3):
        one = curvlab.forward_quadratic_form(loss_fn, params, None, {"w": zs[k]})
        assert one == pytest.approx((float(gz[k]), float(zhz[k])), rel=1e-12)
    with curvlab.CurvaturePoint(loss_fn, params, None) as point:
        torch.testing.assert_close(point.quadratic_forms({"w": zs}), (gz, zhz))
        torch.testing.assert_close(point.forward_quadratic_forms({"w": zs}), (gz, zhz))
        hv = curvlab.hvps(loss_fn, params, None, {"w": zs})["w"]
        torch.testing.assert_close(hv, zs @ A)
        torch.testing.assert_close(curvlab.hvp(loss_fn, params, None, {"w": zs[0]})["w"], hv[0])
