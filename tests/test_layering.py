"""The design card's layering, enforced: import-linter contracts in pyproject.toml."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_linter_contracts_hold():
    exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([exe, "--config", os.path.join(REPO, "pyproject.toml")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "broken" not in r.stdout.lower() or "0 broken" in r.stdout.lower()

