"""No dead code: every function, class, method and module-level name defined in vllm/ is
referred to somewhere else in the repository (package, tests, benchmarks, docs), except the
names below that exist for callers outside it (upstream vLLM's API) or for Python itself."""
from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("vllm", "tests", "benchmarks", "examples", "docs")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".yaml", ".json"}

# Upstream vLLM's public API, kept for its users, and hooks that Python or a library call by
# name (decorated registrations count as used: their decorator is their reference).
API = {
    "envs.py": {"__dir__"},
    "config/compilation.py": {"max_cudagraph_mode"},
    "engine/llm_engine.py": {"from_vllm_config"},
    "model_executor/models/registry.py": {"is_supported", "register_model"},
    "distributed/parallel_state.py": {"is_first_rank"},
    "platforms/interface.py": {"is_cuda_alike"},
    "utils/torch_utils.py": {"is_torch_equal"},
}


def defined_names(tree: ast.Module) -> list[tuple[str, int]]:
    """Top-level functions, classes and assignments, and the methods of top-level classes;
    decorated definitions (registered by their decorator) and dunders left out."""
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.decorator_list:
                names.append((node.name, node.lineno))
            if isinstance(node, ast.ClassDef):
                names += [(m.name, m.lineno) for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                          and not m.decorator_list and not m.name.startswith("__")]
        elif isinstance(node, ast.Assign):
            names += [(t.id, node.lineno) for t in node.targets if isinstance(t, ast.Name)]
    return [(n, line) for n, line in names if n not in ("logger", "__all__")]


def unreferenced(root: Path = ROOT) -> list[str]:
    words: collections.Counter = collections.Counter()
    for top in SOURCES:
        for path in (root / top).rglob("*"):
            if path.suffix in TEXT_SUFFIXES and path.is_file():
                words.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
    dead = []
    for path in sorted((root / "vllm").rglob("*.py")):
        rel = str(path.relative_to(root / "vllm"))
        for name, line in defined_names(ast.parse(path.read_text())):
            if words[name] <= 1 and name not in API.get(rel, ()):
                dead.append(f"vllm/{rel}:{line} {name}")
    return dead


def test_finder_reports_a_name_nobody_uses(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "m.py").write_text(
        "X = 1\n\ndef used():\n    return X\n\ndef unused_helper():\n    return used()\n\n"
        "class C:\n    def old_method(self):\n        pass\n")
    assert unreferenced(tmp_path) == ["vllm/m.py:6 unused_helper", "vllm/m.py:9 C",
                                      "vllm/m.py:10 old_method"]


def test_no_dead_code_in_the_package():
    dead = unreferenced()
    assert not dead, "defined but never used (remove, or list in API with its reason):\n" + \
        "\n".join(dead)
