"""No import circles inside the package.

Every `import` statement of every module under vllm/ is read (module level and inside
functions, which run later but still tie the modules together; not `if TYPE_CHECKING:`), and
the graph of vllm modules they name must have no cycle. The modules that once formed circles
(serve <-> api_server; serving_chat -> serving_completion -> frontend_options -> serving_chat;
config -> platforms -> custom_op -> config) are also imported alone, each in a fresh
interpreter, so that none depends on another having been imported first.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm"

# Lazy imports between a kernel front end and its loader: the loader registers the ops the
# front end's fallback then calls, at run time only; and the executor interface's factory
# (`Executor.get_class`, upstream's API) importing the Ray executor, a subclass that needs Ray,
# only when it is asked for. Each pair is a known, intended circle.
ALLOWED_CYCLES = [
    {"vllm.engine.executor", "vllm.engine.ray_executor"},
    {"vllm.model_executor.kernels.cpu_loader", "vllm.model_executor.kernels.fp8_ops"},
    {"vllm.model_executor.layers.cpu_linear", "vllm.model_executor.layers.cpu_prepacked_linear"},
]

ONCE_CIRCULAR = [
    "vllm.entrypoints.cli.serve",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.openai.cli_args",
    "vllm.entrypoints.openai.serving_engine",
    "vllm.entrypoints.openai.serving_chat",
    "vllm.entrypoints.openai.serving_completion",
    "vllm.entrypoints.openai.serving_responses",
    "vllm.entrypoints.openai.frontend_options",
    "vllm.entrypoints.chat_utils",
    "vllm.config",
    "vllm.platforms",
    "vllm.model_executor.custom_op",
    "vllm.utils.startup_timer",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The vllm modules `tree` (module `name`) imports anywhere but under TYPE_CHECKING."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = name if is_package else name.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in known else base)
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in package.rglob("*.py")}
    known = set(files)
    return {name: _imported(ast.parse(path.read_text()), name, path.name == "__init__.py",
                            known)
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_cycle_finder_finds_a_circle(tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from vllm.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from vllm import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    import vllm.a\nimport vllm.sub.d\n")
    (pkg / "sub" / "d.py").write_text("from .. import a\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = import_graph(pkg)
    finally:
        ROOT = saved
    assert graph["vllm.a"] == {"vllm.sub.b"}
    assert graph["vllm.c"] == {"vllm.sub.d"}  # the TYPE_CHECKING import does not count
    assert cycles(graph) == [{"vllm.a", "vllm.sub.b", "vllm.c", "vllm.sub.d"}]


def test_no_import_cycles_in_the_package():
    found = [c for c in cycles(import_graph()) if c not in ALLOWED_CYCLES]
    assert not found, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in found)


@pytest.mark.parametrize("module", ONCE_CIRCULAR)
def test_module_imports_alone_in_a_fresh_interpreter(module):
    result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
