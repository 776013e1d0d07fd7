"""One role per file: module size and role docstrings, and the README's map of the decode step to its files."""
from __future__ import annotations

import ast
import re
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


def _stage_rows() -> list[tuple[str, list[str], list[str]]]:
    """(stage, files, entry points) of the README's decode-step table (first table under '## Layout')."""
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("stage", "folder") or set(cells[0]) <= {"-"}:
            continue
        files = re.findall(r"`([\w/]+\.py)`", cells[1] + " " + cells[2])
        entries = [e for e in re.findall(r"`([\w.]+)`", cells[2]) if not e.endswith(".py")]
        rows.append((cells[0], files, entries))
    return rows


def _defines(path: str, dotted: str) -> bool:
    """Whether the module at `path` defines `dotted` (a function, a class, or `Class.method`)."""
    tree = ast.parse(open(os.path.join(REPO, path)).read())
    head, _, attr = dotted.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == head:
            if not attr:
                return True
            return isinstance(node, ast.ClassDef) and any(
                isinstance(n, ast.FunctionDef) and n.name == attr for n in node.body)
    return False


def test_readme_maps_each_decode_stage_to_files_that_define_it():
    rows = _stage_rows()
    stages = " ".join(r[0] for r in rows)
    for word in ("attention", "gate", "dispatch", "experts", "combine"):
        assert word in stages, f"README Layout table has no '{word}' stage"
    for stage, files, entries in rows:
        assert files and entries, stage
        for f in files:
            assert os.path.isfile(os.path.join(REPO, f)), f"{stage}: {f} does not exist"
        for e in entries:
            assert any(_defines(f, e) for f in files), f"{stage}: no file of {files} defines {e}"
