"""The test suite refuses to run against an sglang_oscar imported from another tree (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_suite_refuses_another_tree(tmp_path):
    fake = (tmp_path / "sglang_oscar").resolve()
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_OSCAR_TEST_INSTALLED"}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "foundation" / "test_checkout_guard.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out
    assert f"sglang_oscar is imported from {fake}" in out and f"not from this checkout ({REPO / 'python'})" in out
    # on purpose: an installed copy may be tested
    env["SGLANG_OSCAR_TEST_INSTALLED"] = "1"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                        str(REPO / "tests" / "foundation" / "test_checkout_guard.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "1 test collected" in r.stdout, r.stdout + r.stderr
