"""The IR and fusion packages' modules import one another one way: no module reaches itself
through its module-level imports (a cycle makes the import order decide what a module sees
half-built)."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuautograd.fusion.partition as partition
import gpuautograd.ir as ir

IR = Path(ir.__file__).parent
FUSION = Path(partition.__file__).parent


def module_level_imports(path: Path) -> set[str]:
    """Sibling modules that `path` imports at module level (`from .x import ...`, `from . import x`)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return found


def import_graph(package: Path = IR) -> dict[str, set[str]]:
    graph = {p.stem: module_level_imports(p) for p in package.glob("*.py")}
    return {m: deps & graph.keys() for m, deps in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m) :] + [m]
        if m in done:
            return None
        for d in sorted(graph[m]):
            if cycle := visit(d, path + [m]):
                return cycle
        done.add(m)
        return None

    for m in sorted(graph):
        if cycle := visit(m, []):
            return cycle
    return None


def test_ir_modules_import_one_way():
    graph = import_graph()
    assert {"registry", "ops", "program", "printer"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_fusion_modules_import_one_way():
    graph = import_graph(FUSION)
    assert {"partition", "analysis", "steps", "matmul", "partial_sums"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_registers_every_op_module():
    registering = {m for m, deps in import_graph().items() if "registry" in deps and m != "__init__"}
    assert registering - import_graph()["__init__"] == set(), "an op module the package doesn't import"
    assert {"ops", "composite_ops", "extern_ops", "linalg_ops"} <= registering
