"""Statistics equal a direct float64 computation; resuming; checkpoints; foreign statistics."""

from __future__ import annotations

import os

import pytest
import torch

from _support.orthogonal import random_orthogonal
from calib_tiny import build_model, make_text
from sglang_oscar.calibrate import CalibrationError
from sglang_oscar.calibrate.capture import attention_override, latent_hooks
from sglang_oscar.calibrate.fit import fit_rotations
from sglang_oscar.calibrate.model import geometry_of
from sglang_oscar.calibrate.prompts import Documents, build_prompt_set
from sglang_oscar.calibrate.run import calibrate_model
from sglang_oscar.calibrate.stats import CalibrationStats
from sglang_oscar.rotation import orthogonality_error
from sglang_oscar.rotation.latent import LatentRotationSet, latent_hadamard


def _prompts(tokenizer, budget=1200, seq_len=96, seed=0):
    docs = Documents(make_text(30, 120, seed), "text", "mem", "0" * 64)
    return build_prompt_set(tokenizer, "mem", budget=budget, seq_len=seq_len, documents=docs)


def _sylvester(n: int) -> torch.Tensor:
    """Normalised Sylvester Hadamard, built here independently of the package."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _bitrev_perm_matrix(eigvals: torch.Tensor) -> torch.Tensor:
    """Spec §3.4, written out: sort by eigenvalue descending, ``perm[br[i]] = sorted[i]``, ``P = I[:, perm]``."""
    d = eigvals.shape[0]
    bits = (d - 1).bit_length()
    br = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(d)]
    order = sorted(range(d), key=lambda i: -float(eigvals[i]))
    perm = [0] * d
    for i in range(d):
        perm[br[i]] = order[i]
    return torch.eye(d, dtype=torch.float64)[:, perm]


def _reference_covariances(q, k, v):
    """Loop-based float64 reference of ``C_h`` and ``S_h`` (no package code involved)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    cs, ss = [], []
    for h in range(hkv):
        c = torch.zeros(d, d, dtype=torch.float64)
        for i in range(h * g, (h + 1) * g):
            qi = q[:, i].double()
            c += qi.T @ qi
        c /= t * g
        kh, vh = k[:, h].double(), v[:, h].double()
        w = ((kh @ c) * kh).sum(-1)
        s = torch.zeros(v.shape[-1], v.shape[-1], dtype=torch.float64)
        for row in range(t):
            s += w[row] * torch.outer(vh[row], vh[row])
        cs.append(c)
        ss.append(s / w.sum())
    return torch.stack(cs), torch.stack(ss)


def _raw_rows(model, prompts):
    """Every captured (q, k, v) row, concatenated per layer (what the accumulators must summarise)."""
    rows: dict[int, list] = {}

    def handler(call):
        b, _, t, _ = call.query.shape
        flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[3]) for x in (call.query, call.key, call.value)]
        rows.setdefault(call.layer_id, []).append(flat)
        return None

    with torch.inference_mode(), attention_override(model, handler):
        for s in prompts.sequences:
            model(input_ids=torch.tensor([s]), use_cache=False)
    return {lid: [torch.cat([r[i] for r in rs]) for i in range(3)] for lid, rs in rows.items()}


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_statistics_equal_direct_float64(family, tokenizer, tmp_path):
    model = build_model(family)
    prompts = _prompts(tokenizer)
    st = calibrate_model(model, prompts, str(tmp_path / "s.safetensors"), batch_size=3, progress=False)
    st = CalibrationStats.load(str(tmp_path / "s.safetensors"))
    raw = _raw_rows(model, prompts)
    assert sorted(raw) == st.geometry.layer_ids
    for lid, (q, k, v) in raw.items():
        assert st.tokens_per_layer(1)[lid] == st.tokens_per_layer(2)[lid] == q.shape[0] == prompts.num_tokens
        qcov, vcov = _reference_covariances(q, k, v)
        torch.testing.assert_close(st.query_covariance(lid), qcov, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(st.value_covariance(lid), vcov, rtol=1e-9, atol=1e-12)
        kd = k.double()
        torch.testing.assert_close(st.sums["k_sum"][lid], torch.einsum("thd,the->hde", kd, kd), rtol=1e-10, atol=1e-10)
        assert st.sums["q_sum"][lid].dtype == torch.float64
        mk, mv = st.means(lid)
        torch.testing.assert_close(mk, kd.mean(0), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mv, v.double().mean(0), rtol=1e-10, atol=1e-12)


def test_latent_statistics_equal_direct_float64(tokenizer, tmp_path):
    model = build_model("deepseek_v2")
    prompts = _prompts(tokenizer)
    st = calibrate_model(model, prompts, str(tmp_path / "s.safetensors"), progress=False)
    seen: dict[int, list] = {}
    with torch.inference_mode(), latent_hooks(model, lambda lid, m, c: seen.setdefault(lid, []).append(c.reshape(-1, c.shape[-1]))):
        for s in prompts.sequences:
            model(input_ids=torch.tensor([s]), use_cache=False)
    assert sorted(seen) == st.geometry.layer_ids
    for lid, cs in seen.items():
        c = torch.cat(cs).double()
        torch.testing.assert_close(st.latent_covariance(lid), c.T @ c / c.shape[0], rtol=1e-10, atol=1e-12)
    rs = fit_rotations(st, "oscar", min_tokens=100, latent_block=16)
    assert all(orthogonality_error(r) < 1e-6 and r.shape == (64, 64) for r in rs.r.values())
    # R = U P Hblock (spec §3.5): eigenvectors of the latent covariance (ascending), the
    # eigenvalue-sorted bit-reversal permutation, then four 16-blocks of Hadamard
    hblock = torch.block_diag(*[_sylvester(16)] * 4)
    for lid in st.geometry.layer_ids:
        lam, u = torch.linalg.eigh(st.latent_covariance(lid))
        perm = _bitrev_perm_matrix(lam)
        r = rs.r[lid].double()
        # eigenvectors are defined up to sign: R = U S P Hblock with S = diag(+-1)
        signs = torch.diagonal(u.T @ r @ hblock.T @ perm.T)
        torch.testing.assert_close(signs.abs(), torch.ones(64, dtype=torch.float64), atol=1e-5, rtol=0)
        torch.testing.assert_close(r, u @ torch.diag(signs.sign()) @ perm @ hblock, atol=1e-5, rtol=0)
    assert rs.metadata["hadamard_block"] == 16


def test_invalid_latent_block_is_refused(tokenizer, tmp_path):
    """A block that is not a power of two dividing kv_lora_rank raises instead of silently
    falling back to a full Hadamard while the metadata records the requested block."""
    with pytest.raises(ValueError, match="power of two dividing kv_lora_rank 32"):
        latent_hadamard(32, 12)
    with pytest.raises(ValueError, match="power of two dividing"):
        latent_hadamard(32, 64)
    torch.testing.assert_close(latent_hadamard(32, None), _sylvester(32))
    model = build_model("deepseek_v2")
    geo = geometry_of(model.config)
    with pytest.raises(ValueError, match="power of two dividing"):
        LatentRotationSet.data_free(geo, "hadamard", 24)
    st = calibrate_model(model, _prompts(tokenizer, budget=300), str(tmp_path / "s.safetensors"), progress=False)
    with pytest.raises(CalibrationError, match="--latent-block"):
        fit_rotations(st, "oscar", min_tokens=10, latent_block=48)
    with pytest.raises(CalibrationError, match="--latent-block"):
        fit_rotations(st, "hadamard", latent_block=48)
    ok = fit_rotations(st, "hadamard", latent_block=8)
    torch.testing.assert_close(ok.r[geo.layer_ids[0]].double(), torch.block_diag(*[_sylvester(8)] * 8), atol=1e-7, rtol=0)
    assert ok.metadata["hadamard_block"] == 8


def test_perhead_kv_is_upstreams_method(tokenizer, tmp_path):
    """perhead-kv (spec §3.4 per-head fit): per kv head, eigenvectors of the raw K (V) second
    moment in descending eigenvalue order times the Hadamard, no permutation; format_version 2."""
    model = build_model("qwen3")
    prompts = _prompts(tokenizer)
    st = calibrate_model(model, prompts, str(tmp_path / "s.safetensors"), progress=False)
    rs = fit_rotations(st, "perhead-kv", min_tokens=100)
    assert rs.format_version == 2 and rs.metadata["objective"] == "cov_eig_hadamard_perhead"
    h = _sylvester(32)
    raw = _raw_rows(model, prompts)
    for lid, (_, k, v) in raw.items():
        for which, rows in (("k", k), ("v", v)):
            mats = rs.matrices(lid, which)
            assert mats.shape == (2, 32, 32)
            for head in range(2):
                x = rows[:, head].double()
                cov = x.T @ x / x.shape[0]  # independent reference of k_sum / T
                u = mats[head].double() @ h.T  # R = U_desc H  =>  U_desc = R H^T
                d = u.T @ cov @ u
                lam = torch.linalg.eigvalsh(cov).flip(0)
                torch.testing.assert_close(torch.diagonal(d), lam, rtol=1e-4, atol=1e-6)
                off = d - torch.diag(torch.diagonal(d))
                assert float(off.abs().max()) < 1e-4 * float(lam[0])
    # oscar-perhead (query-aware, this project's method) is a different rotation
    qa = fit_rotations(st, "oscar-perhead", min_tokens=100)
    lid = st.geometry.layer_ids[0]
    assert not torch.allclose(qa.matrices(lid, "k"), rs.matrices(lid, "k"), atol=1e-3)


def test_resume_equals_single_run(tokenizer, tmp_path):
    model = build_model("qwen3")
    prompts = _prompts(tokenizer, budget=960, seq_len=96)  # 10 sequences
    n = len(prompts.sequences)
    ref = calibrate_model(model, prompts, str(tmp_path / "ref.safetensors"), progress=False)
    out = str(tmp_path / "res.safetensors")
    # stop mid pass 1, then mid pass 2, then finish: each rerun continues from the checkpoint
    assert calibrate_model(model, prompts, out, checkpoint_every=2, progress=False, stop_after=3) is None
    assert os.path.exists(out + ".ckpt") and not os.path.exists(out)
    ck = CalibrationStats.load(out + ".ckpt")
    assert ck.meta["checkpoint"] == {"pass": 1, "next_sequence": 3} and ck.passes_done == 0
    assert calibrate_model(model, prompts, out, checkpoint_every=2, progress=False, stop_after=n) is None
    ck = CalibrationStats.load(out + ".ckpt")
    assert ck.meta["checkpoint"] == {"pass": 2, "next_sequence": 3} and ck.passes_done == 1
    st = calibrate_model(model, prompts, out, checkpoint_every=2, progress=False)
    assert not os.path.exists(out + ".ckpt")
    for name in ("q_sum", "v_wsum", "w_sum", "k_sum", "v_sum"):
        for lid in ref.geometry.layer_ids:
            torch.testing.assert_close(st.sums[name][lid], ref.sums[name][lid], rtol=1e-12, atol=1e-12)
    assert st.tokens == ref.tokens
    # a rerun with the same arguments finds the output complete and does nothing
    again = calibrate_model(model, prompts, out, progress=False)
    assert again.meta["args_key"] == st.meta["args_key"]


def test_checkpoint_from_other_arguments_is_refused(tokenizer, tmp_path):
    model = build_model("qwen3")
    out = str(tmp_path / "s.safetensors")
    calibrate_model(model, _prompts(tokenizer, seed=0), out, progress=False, stop_after=2, checkpoint_every=1)
    other = _prompts(tokenizer, seed=1)
    with pytest.raises(CalibrationError, match="other arguments.*--restart"):
        calibrate_model(model, other, out, progress=False)
    st = calibrate_model(model, other, out, progress=False, restart=True)
    assert st.complete and st.meta["prompts"]["tokens_sha256"] == other.meta["tokens_sha256"]


def test_statistics_from_another_model_are_refused(tokenizer, tmp_path):
    model = build_model("qwen3")
    st = calibrate_model(model, _prompts(tokenizer), str(tmp_path / "s.safetensors"), progress=False)
    other = geometry_of(build_model("llama").config)
    with pytest.raises(CalibrationError, match="another model|cannot be used"):
        fit_rotations(st, "oscar", min_tokens=10, geometry=other)
    with pytest.raises(CalibrationError, match="incomplete"):
        fit_rotations(CalibrationStats(st.geometry), "oscar", min_tokens=0)


def test_every_kv_head_is_required(tokenizer):
    model = build_model("qwen3")
    st = CalibrationStats(geometry_of(model.config))
    q = torch.randn(5, 4, 32)
    k = torch.randn(5, 1, 32)  # one of two kv heads: a per-rank blind spot
    with pytest.raises(CalibrationError, match="every kv head"):
        st.add_pass1(0, q, k, k)


def test_spectrum_of_planted_second_moments():
    """``CalibrationStats.spectrum``: rank-one keys give top-1 1 and eff. dim 1, values spread
    equally over two directions 0.5 and 2, isotropic queries ~1/D and ~D (by hand)."""
    model = build_model("qwen3")
    geo = geometry_of(model.config)
    st = CalibrationStats(geo)
    lg = geo.layers[0]
    hkv, d, g = lg.num_kv_heads, lg.head_dim_k, geo.num_q_heads // lg.num_kv_heads
    n = 200  # few rows, so the isotropic finite-sample value d / (1 + d / rows) differs from d
    torch.manual_seed(0)
    u = random_orthogonal(d, dtype=torch.float64)
    k = (torch.randn(n, hkv, 1, dtype=torch.float64) * u[:, 0]).float()  # every key on one direction
    v = (torch.randn(n, hkv, 1, dtype=torch.float64) * u[:, 1]
         + torch.randn(n, hkv, 1, dtype=torch.float64) * u[:, 2]).float()  # two equal directions
    q = torch.randn(n, hkv * g, d)
    st.add_pass1(lg.layer_id, q, k, v)
    spec = st.spectrum()
    assert set(spec) == {lg.layer_id}  # layers without statistics give no entry
    r = spec[lg.layer_id]
    assert r["k_top1"] == pytest.approx(1.0, abs=1e-6) and r["k_eff_dim"] == pytest.approx(1.0, abs=1e-5)
    assert r["v_top1"] == pytest.approx(0.5, abs=0.12) and r["v_eff_dim"] == pytest.approx(2.0, abs=0.1)
    # isotropic queries: eff. dim ~ D / (1 + D / rows) with the g query heads of a kv head pooled
    # (rows = n g; n alone would give D / (1 + D / n)), top-1 above 1 / D
    rows = n * g
    assert r["q_eff_dim"] == pytest.approx(d / (1 + d / rows), rel=0.015)
    assert abs(r["q_eff_dim"] - d / (1 + d / n)) > 0.03 * d
    assert 1.0 / d < r["q_top1"] < 2.0 / d
    assert r["k_top1_max"] >= r["k_top1"]


def test_centred_fits_carry_the_calibration_means(tokenizer, tmp_path):
    """fit_rotations(center=True) stores the per-kv-head K / V means of the captured rows for every
    method; perhead-kv then diagonalises the centred second moment; statistics written before the
    first moments were recorded are refused with the fix."""
    model = build_model("qwen3")
    prompts = _prompts(tokenizer)
    path = str(tmp_path / "s.safetensors")
    st = calibrate_model(model, prompts, path, progress=False)
    raw = _raw_rows(model, prompts)
    for method in ("hadamard", "oscar", "oscar-perhead", "perhead-kv"):
        rs = fit_rotations(st, method, min_tokens=100, center=True)
        assert rs.centered and rs.metadata["centered"] is True
        plain = fit_rotations(st, method, min_tokens=100)
        assert not plain.centered
        for lid, (_, k, v) in raw.items():
            torch.testing.assert_close(rs.mean(lid, "k").double(), k.double().mean(0), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(rs.mean(lid, "v").double(), v.double().mean(0), rtol=1e-5, atol=1e-6)
            if method != "perhead-kv":  # the other objectives do not depend on the means
                torch.testing.assert_close(rs.matrices(lid, "k"), plain.matrices(lid, "k"), rtol=0, atol=0)
    rs = fit_rotations(st, "perhead-kv", min_tokens=100, center=True)
    h = _sylvester(32)
    for lid, (_, k, _) in raw.items():
        for head in range(2):
            x = k[:, head].double()
            x = x - x.mean(0)
            cov = x.T @ x / x.shape[0]
            u = rs.matrices(lid, "k")[head].double() @ h.T
            lam = torch.linalg.eigvalsh(cov).flip(0)
            torch.testing.assert_close(torch.diagonal(u.T @ cov @ u), lam, rtol=1e-4, atol=1e-6)
    # a file without the first moments (written before centering existed)
    old = CalibrationStats.load(path)
    for name in ("k_lin", "v_lin"):
        old.sums[name].clear()
    old.save(str(tmp_path / "old.safetensors"))
    old = CalibrationStats.load(str(tmp_path / "old.safetensors"))
    fit_rotations(old, "oscar", min_tokens=100)  # uncentred fits still work
    with pytest.raises(CalibrationError, match="predates centering.*sglang-oscar calibrate"):
        fit_rotations(old, "oscar", min_tokens=100, center=True)


def test_centering_refusals(tokenizer, tmp_path, capsys):
    """--center on a soft-capped model, a centred data-free set used with another model, and resuming a
    checkpoint written without first moments are refused with the fix."""
    from sglang_oscar.calibrate.fit import check_rotation
    from sglang_oscar.calibrate.model import config_fingerprint
    from sglang_oscar.rotation.geometry import attention_logit_softcap

    assert attention_logit_softcap({"attn_logit_softcapping": 50.0}) == 50.0
    assert attention_logit_softcap({"text_config": {"attn_logit_softcapping": 30}}) == 30.0
    assert attention_logit_softcap({"attn_logit_softcapping": None, "final_logit_softcapping": 30}) is None
    model = build_model("qwen3")
    prompts = _prompts(tokenizer)
    out = str(tmp_path / "s.safetensors")
    st = calibrate_model(model, prompts, out, progress=False)
    capped = CalibrationStats.load(out)
    capped.meta["model"]["config"]["attn_logit_softcapping"] = 50.0
    with pytest.raises(CalibrationError, match="soft.*fit without --center"):
        fit_rotations(capped, "oscar", min_tokens=100, center=True)
    fit_rotations(capped, "oscar", min_tokens=100)  # uncentred fits are fine
    # a centred Hadamard set carries one model's means: the fingerprint is compared
    rs = fit_rotations(st, "hadamard", min_tokens=100, center=True)
    other = dict(st.meta["model"]["config"], intermediate_size=256)
    with pytest.raises(CalibrationError):
        check_rotation(rs, st.geometry, config_fingerprint(other, "other-model"))
    check_rotation(fit_rotations(st, "hadamard", min_tokens=100), st.geometry, config_fingerprint(other, "other-model"))
    # attention sinks (GPT-OSS): fit refuses --center up front, and validate / validate-rotation refuse a
    # centred file for such a model, as the server does
    import dataclasses
    import json

    from sglang_oscar.cli.main import main

    sink_geo = dataclasses.replace(st.geometry, layers=tuple(dataclasses.replace(x, has_sinks=True)
                                                             for x in st.geometry.layers))
    sinked = CalibrationStats.load(out)
    sinked.geometry = sink_geo
    with pytest.raises(CalibrationError, match=r"--center: this model's layers \[0, 1\] have attention-sink logits"
                                               r".*fit without --center"):
        fit_rotations(sinked, "oscar", min_tokens=100, center=True)
    centred = str(tmp_path / "centred.safetensors")
    rs.save(centred)
    with pytest.raises(CalibrationError, match=r"centres the keys/values .* attention-sink logits.*without --center"):
        check_rotation(rs, sink_geo)
    config = tmp_path / "gpt_oss.json"  # GPT-OSS has sinks on every layer (ModelGeometry.from_hf_config)
    config.write_text(json.dumps(dict(model_type="gpt_oss", num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, hidden_size=64, sliding_window=16,
                                      layer_types=["sliding_attention", "full_attention"])))
    capsys.readouterr()
    assert main(["validate", centred, "--config", str(config)]) == 2
    assert f"{centred} centres the keys/values (k_mean / v_mean) but this model's layers [0, 1] have attention-sink" \
        in capsys.readouterr().err
    rs_plain = fit_rotations(st, "hadamard", min_tokens=100)
    rs_plain.save(centred)
    assert main(["validate", centred, "--config", str(config)]) == 0  # the same file uncentred fits that model
    # resuming a checkpoint without k_lin / v_lin would average over part of the tokens only
    out2 = str(tmp_path / "r.safetensors")
    assert calibrate_model(model, prompts, out2, checkpoint_every=2, progress=False, stop_after=3) is None
    ck = CalibrationStats.load(out2 + ".ckpt")
    for name in ("k_lin", "v_lin"):
        ck.sums[name].clear()
    ck.save(out2 + ".ckpt", extra={"checkpoint": ck.meta.get("checkpoint")})
    with pytest.raises(CalibrationError, match="without first moments.*--restart"):
        calibrate_model(model, prompts, out2, checkpoint_every=2, progress=False)
    assert calibrate_model(model, prompts, out2, restart=True, progress=False).complete
