"""Diff the `assert` statements of tests/ between two git revisions (a refactor must leave them unchanged).

Usage: python scripts/assert_diff.py BASE [HEAD]   (HEAD defaults to the working tree)

Asserts are compared as a multiset over the whole tests/ tree (so moving a test file is not a change), each
normalised by `ast.unparse` (formatting and comments do not count). Prints the asserts only in BASE and only in
HEAD, and exits 1 when there are any.
"""
from __future__ import annotations

import ast
import collections
import os
import subprocess
import sys


def _files(rev: str | None) -> dict[str, str]:
    if rev is None:
        out = {}
        for root, _, names in os.walk("tests"):
            for n in names:
                if n.endswith(".py"):
                    p = os.path.join(root, n)
                    out[p] = open(p).read()
        return out
    names = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, "tests"], text=True).split()
    return {n: subprocess.check_output(["git", "show", f"{rev}:{n}"], text=True) for n in names if n.endswith(".py")}


def asserts(rev: str | None) -> collections.Counter:
    """Multiset of normalised assert statements in tests/ at `rev` (None: the working tree)."""
    c: collections.Counter = collections.Counter()
    for src in _files(rev).values():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Assert):
                c[ast.unparse(node)] += 1
    return c


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__)
        return 2
    a, b = asserts(argv[0]), asserts(argv[1] if len(argv) > 1 else None)
    gone, new = a - b, b - a
    for s, n in sorted(gone.items()):
        print(f"- ({n}x) {s}")
    for s, n in sorted(new.items()):
        print(f"+ ({n}x) {s}")
    print(f"{sum(a.values())} asserts before, {sum(b.values())} after; {sum(gone.values())} gone, {sum(new.values())} new")
    return 1 if gone or new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
