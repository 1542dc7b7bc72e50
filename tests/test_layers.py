"""The packages are layered and import only downward (docs/architecture.md, "Layers"): the shared core, then the
three processes (which never import one another), then the tools, the simulator and the development stack."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYER = {
    "flying": 0,  # the shared core: keys, messages, queue, groups, settings, control, workers, procs
    "gateway": 1,
    "router": 1,
    "worker_ext": 1,
    "loadgen": 2,
    "flyctl": 2,
    "sim": 3,
    "devstack": 4,
}


def imports(path: Path) -> set[str]:
    """The first-party top-level packages a module imports (anywhere in it, lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & LAYER.keys()


def violations(package: str, root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / package).rglob("*.py")):
        for dep in imports(path) - {package}:
            if LAYER[dep] >= LAYER[package]:
                out.append(f"{path.relative_to(root)} imports {dep} (layer {LAYER[dep]} >= {LAYER[package]})")
    return out


@pytest.mark.parametrize("package", sorted(LAYER))
def test_a_package_imports_only_lower_layers(package):
    assert (ROOT / package / "__init__.py").exists()
    assert violations(package) == []


def test_every_first_party_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert packages == LAYER.keys()


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "flying"
    bad.mkdir()
    (bad / "__init__.py").write_text("")
    (bad / "x.py").write_text("def f():\n    from gateway.app import app\n")
    assert violations("flying", tmp_path) == ["flying/x.py imports gateway (layer 1 >= 0)"]
