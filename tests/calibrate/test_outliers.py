"""On a tiny model with planted outlier channels, the fitted rotation beats Hadamard (held-out dB)."""

from __future__ import annotations

import torch

from _support.orthogonal import random_orthogonal
from calib_tiny import build_model, make_text
from sglang_oscar.calibrate.error import functional_error
from sglang_oscar.calibrate.fit import fit_rotations
from sglang_oscar.calibrate.prompts import Documents, build_prompt_set
from sglang_oscar.calibrate.run import calibrate_model
from sglang_oscar.config import OscarConfig
from sglang_oscar.reference import relative_error_db

D = 128
HIDDEN = 128


def plant_outliers(model, seed: int = 1234) -> None:
    """Give every layer the structure that hurts 2-bit caches (as in reference/synthetic.py):
    anisotropic K/Q/V spectra in random bases, key outlier channels with large offsets (bias)
    and extra variance, queries loading on those channels, two offset value channels."""
    g = torch.Generator().manual_seed(seed)
    hkv, hq = model.config.num_key_value_heads, model.config.num_attention_heads
    outl = [5, 37, 69, 100]

    def rows():  # [D, HIDDEN] orthonormal rows
        return random_orthogonal(HIDDEN, generator=g)[:, :D].T

    with torch.no_grad():
        for layer in model.model.layers:
            at = layer.self_attn
            uk, uq, uv = (random_orthogonal(D, generator=g) for _ in range(3))
            kw, vw, qw = (at.k_proj.weight.view(hkv, D, HIDDEN), at.v_proj.weight.view(hkv, D, HIDDEN),
                          at.q_proj.weight.view(hq, D, HIDDEN))
            for h in range(hkv):
                kw[h] = uk @ torch.diag(torch.logspace(0, -1.5, D)) @ rows()
                kw[h, outl] += 2.0 * rows()[: len(outl)]
                vw[h] = uv @ torch.diag(torch.logspace(0.3, -1, D)) @ rows()
            for h in range(hq):
                qw[h] = uq @ torch.diag(torch.logspace(0.5, -1, D)) @ rows()
            for b in (at.k_proj.bias, at.q_proj.bias, at.v_proj.bias):
                b.zero_()
            at.k_proj.bias.view(hkv, D)[:, outl] = torch.tensor([8.0, -6.0, 7.0, 5.0])
            at.q_proj.bias.view(hq, D)[:, outl] = 3.0
            at.v_proj.bias.view(hkv, D)[:, [3, 90]] = torch.tensor([4.0, -3.0])


def test_fitted_rotation_beats_hadamard_on_planted_outliers(tokenizer, tmp_path):
    model = build_model("llama", hidden_size=HIDDEN, head_dim=D)
    plant_outliers(model)
    calib = build_prompt_set(tokenizer, "mem", budget=4096, seq_len=128,
                             documents=Documents(make_text(60, 200, 0), "text", "calib", "0" * 64))
    held = build_prompt_set(tokenizer, "mem", budget=1024, seq_len=128,
                            documents=Documents(make_text(12, 200, 99), "text", "held", "1" * 64))
    st = calibrate_model(model, calib, str(tmp_path / "s.safetensors"), progress=False)
    fitted = fit_rotations(st, "oscar", min_tokens=4096)
    perhead = fit_rotations(st, "oscar-perhead", min_tokens=4096)
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    rep = functional_error(model, held, {"fitted": fitted, "perhead": perhead}, cfg, progress=False)
    db = rep["overall_db"]
    assert db["naive"] > db["hadamard"] + 3.0  # a rotation matters with outlier channels
    assert db["fitted"] < db["hadamard"] - 0.3, db
    assert db["perhead"] < db["hadamard"] - 0.3, db
    for lid, row in rep["layers"].items():
        assert row["fitted"] < row["hadamard"], (lid, row)


def test_error_db_matches_relative_error_db():
    """The report's per-layer energy ratio is exactly reference.relative_error_db for one sequence."""
    from sglang_oscar.calibrate.error import _db
    from sglang_oscar.calibrate.oracle import energies

    g = torch.Generator().manual_seed(0)
    exact, approx = torch.randn(50, 4, 16, generator=g), torch.randn(50, 4, 16, generator=g)
    approx = exact + 0.1 * approx
    num, den = energies(approx, exact)
    assert abs(_db(num, den) - relative_error_db(approx, exact)) < 1e-9
