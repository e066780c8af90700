"""The attention op's name is written once (ATTENTION_OP_NAME in vllm/config/compilation.py);
the layer, the default splitting ops, the split's messages and the attention+quant fusion
all take it from there."""
from __future__ import annotations

import ast
from pathlib import Path

import torch

from vllm.config.compilation import ATTENTION_OP_NAME

PACKAGE = Path(__file__).resolve().parents[2] / "vllm"
SHORT = ATTENTION_OP_NAME.split("::")[1]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                     ast.Constant):
                ids.add(id(body[0].value))
    return ids


def spellings(path: Path) -> list[int]:
    """Lines of `path` whose code (not docstrings or comments) spells the op's name: a string
    holding "vllm::<name>" or an attribute chain `ops.vllm.<name>`."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in skip and f"::{SHORT}" in node.value):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr == SHORT
              and isinstance(node.value, ast.Attribute) and node.value.attr == "vllm"):
            lines.append(node.lineno)
    return lines


def test_the_name_is_spelt_once_in_the_package():
    found = {str(p.relative_to(PACKAGE)): lines for p in PACKAGE.rglob("*.py")
             if (lines := spellings(p))}
    assert list(found) == ["config/compilation.py"] and len(found["config/compilation.py"]) == 1, \
        found


def test_spelling_finder(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(f'"""Calls torch.ops.vllm.{SHORT}."""\n'
                   f'import torch\nx = torch.ops.vllm.{SHORT}\ny = "vllm::{SHORT}"\n')
    assert spellings(src) == [3, 4]


def test_every_user_agrees_with_the_name():
    from vllm.attention import layer
    from vllm.compilation import split
    from vllm.compilation.passes.fusion import attn_quant_fusion
    from vllm.config.vllm import ATTENTION_OPS

    namespace, name = ATTENTION_OP_NAME.split("::")
    assert layer.ATTENTION_OP_NAME == ATTENTION_OP_NAME
    assert layer.attention_op is getattr(getattr(torch.ops, namespace), name)
    assert ATTENTION_OPS == [ATTENTION_OP_NAME]
    assert ATTENTION_OP_NAME in split._EAGER_IMPLS
    assert attn_quant_fusion._attention_op() is layer.attention_op.default
    assert layer.attention_op.default.name() == ATTENTION_OP_NAME
