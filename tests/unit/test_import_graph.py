"""The package's import graph: every module imports, and no two modules import each other.

The graph is read statically (`ast`) from the package's files, so a cycle is caught even
where Python happens to resolve it at import time (a `TYPE_CHECKING` import, or modules
imported in an order that hides it). Two views:

- module level: what a module imports when it is imported (its top-level statements,
  `if TYPE_CHECKING:` and `try:` blocks included). No cycle at all: such a cycle makes
  the import order matter.
- every import, those inside functions included: no cycle but the known ones below,
  each an exact set of modules, so a new cycle, or a module joining a known one, fails.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import vllm_flashinfer_ep

PACKAGE = "vllm_flashinfer_ep"
ROOT = Path(vllm_flashinfer_ep.__file__).resolve().parent

# Cycles through imports inside functions, owned elsewhere and on their way out. An entry
# that is no longer a cycle fails the test too: remove it then (so it cannot come back).
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: top-level statements and the blocks of
    top-level if/try statements (TYPE_CHECKING included), not function or class bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _top_level_imports(node.body) + _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            found += _top_level_imports(node.body) + _top_level_imports(node.orelse)
            found += _top_level_imports(node.finalbody)
            for handler in node.handlers:
                found += _top_level_imports(handler.body)
    return found


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules one import statement of module `name` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = node.module or ""
    if node.level:
        package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    found = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in MODULES:  # `from pkg import module`
            found.add(f"{base}.{alias.name}")
        elif base in MODULES:  # `from module import name`
            found.add(base)
    return found


def import_graph(module_level_only: bool) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        if module_level_only:
            nodes = _top_level_imports(tree.body)
        else:
            nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[name] = set().union(*(_targets(name, n) for n in nodes)) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return "; ".join(edges)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.endswith(".__main__")))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_module_level_import_cycle():
    graph = import_graph(module_level_only=True)
    found = cycles(graph)
    assert not found, [_describe(c, graph) for c in found]


def test_no_import_cycle_but_the_known_ones():
    graph = import_graph(module_level_only=False)
    found = cycles(graph)
    new = [_describe(c, graph) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"new import cycles: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


def test_the_graph_reader_sees_the_edges_it_must():
    """The reader itself: a cycle the checks above rely on it to see."""
    graph = import_graph(module_level_only=False)
    assert "vllm_flashinfer_ep.runtime.rounds" in graph["vllm_flashinfer_ep.runtime.ep_runtime"]
    # `from vllm_flashinfer_ep import envs` names the module envs, not the package
    assert "vllm_flashinfer_ep.envs" in graph["vllm_flashinfer_ep.runtime.fp8_wire"]
    assert "vllm_flashinfer_ep" not in graph["vllm_flashinfer_ep.runtime.fp8_wire"]
    assert "vllm_flashinfer_ep.vllm.patches" in graph["vllm_flashinfer_ep"]  # inside register()
    assert "vllm_flashinfer_ep.vllm.patches" not in import_graph(True)["vllm_flashinfer_ep"]
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(toy) == [frozenset({"a", "b", "c"})]


@pytest.mark.parametrize(
    "name",
    [
        "vllm_flashinfer_ep.doctor",
        "vllm_flashinfer_ep.vllm.config_rules",
        "vllm_flashinfer_ep.vllm.fp8_experts_choice",
        "vllm_flashinfer_ep.vllm.config_validation",
    ],
)
def test_config_time_modules_import_without_vllm_or_torch(name):
    """doctor reports a missing or broken vLLM or torch instead of failing to import, and
    config validation costs no torch import: these modules import neither (a fresh
    interpreter, so nothing imported earlier hides it)."""
    import subprocess
    import sys

    code = f"import sys, {name}; print(sorted({{'vllm', 'torch'}} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]", (name, done.stdout, done.stderr[-2000:])
