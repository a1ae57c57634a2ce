"""The end-to-end device checks as one pytest case (CUDA machine, SGLang and the plugin's entry
point installed, e.g. after ``source device/env.sh``).

    OSCAR_E2E_CHECKS=b,d OSCAR_E2E_ARGS="--int2-args='--oscar-decode-engine triton'" \\
        python -m pytest -q -m gpu tests/e2e/test_e2e.py

``OSCAR_E2E_CHECKS`` picks the checks (default ``a,b,c,d,e,i``: the ones that share the concurrent
servers; f/g run their servers alone, h needs ``--tp2`` and two GPUs), ``OSCAR_E2E_ARGS`` adds
harness options. The harness runs as ``python -m tests.e2e`` in a child process; its table is the
failure message.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from .config import ROOT


@pytest.mark.gpu
def test_device_checks(tmp_path):
    checks = os.environ.get("OSCAR_E2E_CHECKS", "a,b,c,d,e,i")
    extra = shlex.split(os.environ.get("OSCAR_E2E_ARGS", ""))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tests.e2e", "--only", checks, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert (out / "e2e.json").is_file(), report
    with open(out / "e2e.json") as f:
        res = json.load(f)
    assert sorted(r["check"] for r in res["results"]) == sorted(c for c in checks.replace(",", "")), report
    assert proc.returncode == 0 and res["passed"], report
