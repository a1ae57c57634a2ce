"""scripts/sign_spread.py: the sign vector S of U S H P changes the rotation and its INT2 error."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sign_spread.py"


def _load():
    spec = importlib.util.spec_from_file_location("sign_spread", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sign_spread_runs_and_signs_change_the_rotation(capsys):
    mod = _load()
    assert mod.main(["--trials", "3", "--tokens", "256", "--center"]) == 0
    assert capsys.readouterr().out.startswith("centred K/V; ")
    assert mod.main(["--trials", "3", "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    nums = [float(x) for x in re.findall(r"(-?\d+\.\d+) dB", out)]
    assert len(nums) == 3 and all(x < -1.0 for x in nums), out  # Hadamard, canonical signs, trial mean
    m = re.search(r"min (-?\d+\.\d+) max (-?\d+\.\d+)", out)
    assert float(m.group(1)) < float(m.group(2)), out  # three sign vectors, three different errors
    # U S H P is orthogonal for any S and differs from U H P when S is not all ones
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g, dtype=torch.float64)
    cov = x.T @ x / 300
    ones = torch.ones(32, dtype=torch.float64)
    flip = ones.clone()
    flip[3] = -1.0
    a, b = mod.rotation_with_signs(cov, ones), mod.rotation_with_signs(cov, flip)
    torch.testing.assert_close(a @ a.T, torch.eye(32), atol=1e-5, rtol=0)
    assert float((a - b).abs().max()) > 0.05


def test_sign_search_never_raises_its_calibration_objective(capsys):
    """Greedy flips are kept only when they lower the calibration score error: the ratio is <= 1."""
    mod = _load()
    assert mod.main(["--trials", "1", "--tokens", "128", "--search", "1"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"sign search \(1 sweeps, (\d+) signs flipped\): calibration score error (\d+\.\d+) of the canonical", out)
    assert m, out
    assert float(m.group(2)) <= 1.0 and (int(m.group(1)) == 0) == (float(m.group(2)) == 1.0), out
