"""One role per file: module size and role docstrings, and the README's map of the decode step to its files."""
from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moeray", "router_service", "cluster", "actors", "kernels")
MAX_LINES = 350


def _modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for root, _, names in os.walk(os.path.join(REPO, pkg)):
            if "csrc" in root.split(os.sep) or "__pycache__" in root:
                continue
            out += [os.path.relpath(os.path.join(root, n), REPO) for n in names
                    if n.endswith(".py") and "_pb2" not in n]
    return sorted(out)


@pytest.mark.parametrize("path", _modules())
def test_module_is_small_and_says_its_role(path):
    src = open(os.path.join(REPO, path)).read()
    n = src.count("\n")
    assert n <= MAX_LINES, f"{path}: {n} lines > {MAX_LINES} (one role per file: split it)"
    doc = ast.get_docstring(ast.parse(src))
    assert doc and doc.strip().splitlines()[0].strip(), f"{path}: no module docstring stating its role"
