"""The package's imports point one way down the pipeline and never form a cycle (read from the source's AST).

Every import counts, also one inside a function (a lazy import is still an arrow); only imports under
``if TYPE_CHECKING:`` are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ampdoctor

PACKAGE = Path(ampdoctor.__file__).parent

# The stage of each file (by its first path part under the package), and the stages each one may import.
# capture and analysis are independent: capture measures a live model, analysis reads records.
FOUNDATION = {"errors", "_version", "_optional", "thresholds", "records", "serial", "autocast_ops", "numbers",
              "atomic"}
STAGE_MAY_IMPORT: dict[str, set[str]] = {
    "foundation": set(),
    "capture": {"foundation"},
    "analysis": {"foundation"},
    "fixes": {"foundation", "capture", "analysis"},
    "report": {"foundation", "analysis"},
    "checkpoint": {"foundation", "capture", "analysis", "report"},
    "api": {"foundation", "capture", "analysis", "fixes", "report"},
    "training": {"foundation", "capture", "analysis", "fixes", "report", "api"},
    "front": {"foundation", "capture", "analysis", "fixes", "report", "checkpoint", "api", "training"},
}
FRONT = {"cli", "integrations", "demo", "__init__", "__main__"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage_of(module: str) -> str:
    parts = module.split(".")
    first = parts[1] if len(parts) > 1 else "__init__"
    if first in FOUNDATION:
        return "foundation"
    if first in FRONT:
        return "front"
    assert first in STAGE_MAY_IMPORT, f"{module}: a new top-level module needs a stage in tests/test_imports.py"
    return first


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path = PACKAGE, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports at run time (``from .x import name`` names the submodule
    ``x.name`` when that is a module, else ``x``); with ``type_checking``, the annotation-only imports too."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8")), type_checking):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "ampdoctor")
                continue
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ampdoctor":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                targets.add(sub if sub in files else target)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a path ``[a, b, ..., a]``, or ``[]`` (depth-first search, colouring)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        stage = stage_of(module)
        for target in targets:
            to = stage_of(target)
            # A package __init__ may re-export its own stage; a stage may import itself and the ones it lists.
            if to != stage and to not in STAGE_MAY_IMPORT[stage]:
                bad.append(f"{module} ({stage}) imports {target} ({to})")
    return sorted(bad)


def test_the_package_has_no_import_cycle() -> None:
    assert find_cycle(import_graph()) == []


def test_annotation_only_imports_form_no_cycle_either() -> None:
    """Import checkers that read ``if TYPE_CHECKING:`` blocks see no cycle either (the renderers annotate with
    ``report.data.ReportData``, not with the ``Report`` whose methods import them)."""
    assert find_cycle(import_graph(type_checking=True)) == []


def test_no_stage_imports_a_later_stage() -> None:
    assert backward_imports(import_graph()) == []


def test_the_checker_finds_the_cycles_this_package_once_had(tmp_path: Path) -> None:
    """The two cycles fixed in issue 17, rebuilt in a scratch package: each must be caught."""
    pkg = tmp_path / "ampdoctor"
    for rel, text in {
        "__init__.py": "",
        "api.py": "from .training.sharded import full_model\n",
        "training/__init__.py": "",
        "training/sharded.py": "def full_model(): ...\n",
        "training/replay.py": "from ..api import diagnose\n",
        "records.py": "",
        "checkpoint/__init__.py": "",
        "checkpoint/scan_records.py": "def f():\n    from ..report.scan_text import render\n",
        "report/__init__.py": "",
        "report/scan_text.py": "from ..checkpoint.scan_records import ScanReport\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph["ampdoctor.checkpoint.scan_records"] == {"ampdoctor.report.scan_text"}  # a lazy import counts
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and set(cycle) == {"ampdoctor.checkpoint.scan_records", "ampdoctor.report.scan_text"}
    del graph["ampdoctor.report.scan_text"]
    # api -> training.sharded and training.replay -> api: no cycle between files, but a backward import.
    assert find_cycle(graph) == []
    assert "ampdoctor.api (api) imports ampdoctor.training.sharded (training)" in backward_imports(graph)


def test_type_checking_imports_are_not_arrows(tmp_path: Path) -> None:
    pkg = tmp_path / "ampdoctor"
    (pkg / "report").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "report" / "__init__.py").write_text("")
    (pkg / "report" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "report" / "b.py").write_text("from .a import A\n")
    assert import_graph(pkg)["ampdoctor.report.a"] == set()
    assert import_graph(pkg, type_checking=True)["ampdoctor.report.a"] == {"ampdoctor.report.b"}


def test_no_module_is_over_500_lines() -> None:
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
