"""clgpt/ops/ stays readable: short modules, each naming the kernels it launches, importing only below itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from clgpt.stage import code_inputs

ROOT = Path(__file__).resolve().parent.parent
OPS = sorted((ROOT / "clgpt" / "ops").rglob("*.py"))  # the GEMM backends' folder, clgpt/ops/gemm/, too
MAX_LINES = 600


@pytest.mark.parametrize("path", OPS, ids=lambda p: str(p.relative_to(ROOT / "clgpt" / "ops")))
def test_an_ops_module_is_short_and_names_the_kernels_it_launches(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_LINES, f"{path.name}: {text.count(chr(10))} lines, split it"
    doc = ast.get_docstring(ast.parse(text)) or ""
    named = re.findall(r"kernels/(\w+)\.cl", doc)
    assert named, f"{path.name}: its docstring names no kernels/*.cl file"
    assert all((ROOT / "kernels" / f"{name}.cl").is_file() for name in named), named


def test_ops_modules_import_nothing_above_them():
    """A module under clgpt/ops imports its siblings and the package's lower modules, never one that itself
    imports clgpt.ops (the engines, the parameter store, ...)."""
    inner = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in OPS}
    inner.discard("clgpt.ops")
    above = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "clgpt").rglob("*.py")
             if (ROOT / "clgpt" / "ops") not in p.parents and p.name != "__init__.py"
             and "clgpt/ops/__init__.py" in code_inputs(p.relative_to(ROOT), ROOT)}
    assert {"clgpt.models.base", "clgpt.models.gpt2", "clgpt.models.llama", "clgpt.models.params"} <= above
    for path in OPS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clgpt"):
                module = node.module
                assert module not in above, f"{path.name} imports {module}, which imports clgpt.ops"
                if path != ROOT / "clgpt" / "ops" / "__init__.py":
                    assert module != "clgpt.ops", f"{path.name}: import {[a.name for a in node.names]} from its sibling"
                    assert not module.startswith("clgpt.ops.") or module in inner, module
