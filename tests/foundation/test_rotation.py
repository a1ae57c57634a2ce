import json
import os
import re
import stat

import pytest
import torch
from safetensors.torch import save_file

from sglang_oscar.reference.synthetic import synthetic_qkv
from sglang_oscar.rotation import (
    ModelGeometry,
    RotationError,
    RotationSet,
    bit_reversal_permutation,
    block_hadamard,
    default_hadamard,
    eig_bitrev_permutation,
    fit_layer,
    hadamard_matrix,
    orthogonality_error,
    query_covariance,
    rotation_from_covariance,
    score_weighted_value_covariance,
)


def qwen3_config(layers=4, kv=2, q=8, d=128):
    return {"model_type": "qwen3", "num_hidden_layers": layers, "num_attention_heads": q,
            "num_key_value_heads": kv, "head_dim": d, "hidden_size": q * d}


@pytest.mark.parametrize("n", [1, 2, 64, 128, 256, 512])
def test_hadamard_is_orthonormal_and_pm(n):
    h = hadamard_matrix(n)
    assert orthogonality_error(h) < 1e-12
    assert torch.allclose(h.abs(), torch.full_like(h, n**-0.5))


def test_block_hadamard_for_192():
    h = block_hadamard(192)
    assert h.shape == (192, 192) and orthogonality_error(h) < 1e-12
    assert torch.equal(h[:64, 64:], torch.zeros(64, 128, dtype=h.dtype))
    assert torch.equal(default_hadamard(192), h)
    with pytest.raises(ValueError):
        hadamard_matrix(192)
    with pytest.raises(ValueError):
        block_hadamard(192, block=128)


def test_bit_reversal():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    for n in (6, 128, 192):
        assert sorted(bit_reversal_permutation(n).tolist()) == list(range(n))


def test_eig_bitrev_permutation_places_sorted_eigs_at_bitreversed_positions():
    lam = torch.tensor([0.1, 5.0, 3.0, 0.5, 9.0, 2.0, 7.0, 1.0])
    p = eig_bitrev_permutation(lam)
    x = torch.arange(8, dtype=torch.float64)
    perm = (x @ p).long()  # (x P)[c] = x[perm[c]]
    order = torch.argsort(-lam)
    br = bit_reversal_permutation(8)
    for i in range(8):
        assert perm[br[i]] == order[i]


def test_query_and_value_covariances_match_direct_float64():
    q, k, v = synthetic_qkv(64, 4, 2, 16, seed=3)
    c = query_covariance(q, 2)
    for h in range(2):
        rows = q[:, 2 * h : 2 * h + 2].reshape(-1, 16).double()
        torch.testing.assert_close(c[h], rows.T @ rows / rows.shape[0])
    s = score_weighted_value_covariance(k, v, c)
    for h in range(2):
        kd, vd = k[:, h].double(), v[:, h].double()
        w = torch.stack([kd[t] @ c[h] @ kd[t] for t in range(64)])
        want = (vd.T * w) @ vd / w.sum()
        torch.testing.assert_close(s[h], want)


@pytest.mark.parametrize("d", [64, 128, 192])
def test_fitted_rotations_are_orthogonal(d):
    q, k, v = synthetic_qkv(512, 8, 2, d, seed=1)
    for per_head in (False, True):
        rk, rv = fit_layer(q, k, v, per_head=per_head)
        assert rk.shape == ((2, d, d) if per_head else (d, d))
        for r in (rk, rv):
            r32 = r.float()
            eye = torch.eye(d).expand_as(r32)
            assert float((r32.transpose(-1, -2) @ r32 - eye).abs().max()) < 1e-5


def test_rotation_composition_is_u_h_p():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen, dtype=torch.float64)
    sigma = a @ a.T
    r, lam = rotation_from_covariance(sigma)
    lam2, u = torch.linalg.eigh(sigma)
    torch.testing.assert_close(lam, lam2)
    # eigenvectors with their largest entry positive (canonical signs, written out here)
    u = u * torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))
    # R = U H P: removing U on the left gives H P, a signed permutation of Hadamard columns
    hp = u.T @ r
    torch.testing.assert_close(hp, hadamard_matrix(16) @ eig_bitrev_permutation(lam))


def test_fit_rejects_bad_input():
    q, k, v = synthetic_qkv(32, 8, 2, 16, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        query_covariance(q, 3)
    with pytest.raises(ValueError, match="dims"):
        query_covariance(q[0], 2)
    bad = q.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        query_covariance(bad, 2)
    with pytest.raises(ValueError, match="square"):
        rotation_from_covariance(torch.zeros(3, 4))


# ---------------------------------------------------------------- geometry
def test_geometry_from_configs():
    g = ModelGeometry.from_hf_config(qwen3_config())
    assert g.layer_ids == [0, 1, 2, 3] and g.layers[0].num_kv_heads == 2 and g.layers[0].head_dim_k == 128
    from transformers import DeepseekV2Config, Gemma3TextConfig, Gemma4TextConfig, Qwen3NextConfig

    g3 = ModelGeometry.from_hf_config(Gemma3TextConfig(num_hidden_layers=6, sliding_window=512))
    assert [layer.sliding_window for layer in g3.layers] == [512] * 5 + [None]
    g4 = ModelGeometry.from_hf_config(Gemma4TextConfig(num_hidden_layers=6, num_key_value_heads=8,
                                                       num_global_key_value_heads=1, global_head_dim=512))
    full = g4.layer(5)
    assert (full.num_kv_heads, full.head_dim_k, full.sliding_window) == (1, 512, None)
    assert (g4.layer(0).num_kv_heads, g4.layer(0).head_dim_k) == (8, 256)
    nxt = ModelGeometry.from_hf_config(Qwen3NextConfig(num_hidden_layers=8))
    assert nxt.layer_ids == [3, 7]
    mla = ModelGeometry.from_hf_config(DeepseekV2Config(num_hidden_layers=2))
    assert mla.attention_kind == "mla" and mla.kv_lora_rank == 512
    # raw config.json dicts get derived keys from transformers (Gemma-3 sliding_window_pattern)
    raw = ModelGeometry.from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 12, "num_attention_heads": 8,
                                        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 512,
                                        "sliding_window_pattern": 6})
    assert [layer.sliding_window for layer in raw.layers] == ([512] * 5 + [None]) * 2
    with pytest.raises(ValueError, match="multiple of 4"):
        ModelGeometry.from_hf_config(qwen3_config(d=66))
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        ModelGeometry.from_hf_config(qwen3_config(kv=3))
    with pytest.raises(ValueError, match="no attention layers"):
        ModelGeometry.from_hf_config({"model_type": "m", "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "hidden_size": 8, "layer_types": ["linear_attention"] * 2})


# ---------------------------------------------------------------- rotation sets
def _fitted_set(per_head, layers=4, kv=2, d=128):
    k, v = {}, {}
    for i in range(layers):
        qq, kk, vv = synthetic_qkv(256, 8, kv, d, seed=i)
        rk, rv = fit_layer(qq, kk, vv, per_head=per_head)
        k[i], v[i] = rk, rv
    return RotationSet(k, v, {"method": "oscar-perhead" if per_head else "oscar", "model_type": "qwen3"})


@pytest.mark.parametrize("per_head", [False, True])
def test_save_load_roundtrip_and_validate(tmp_path, per_head):
    rs = _fitted_set(per_head)
    path = str(tmp_path / "rot.safetensors")
    rs.save(path)
    back = RotationSet.load(path)
    assert back.format_version == (2 if per_head else 1)
    assert back.metadata["method"] == rs.metadata["method"]
    for i in rs.layer_ids:
        assert torch.equal(back.k[i], rs.k[i]) and torch.equal(back.v[i], rs.v[i])
    back.validate(ModelGeometry.from_hf_config(qwen3_config()))
    # a directory holding exactly one file loads too (no temporary file left next to it)
    assert RotationSet.load(str(tmp_path)).layer_ids == [0, 1, 2, 3]
    assert os.listdir(tmp_path) == ["rot.safetensors"]


def test_saved_files_follow_the_umask(tmp_path, monkeypatch):
    """Rotation files get the mode a plain open() gives (safetensors alone writes 0600), and a failed
    write leaves neither a partial file nor a temporary one."""
    rs = _fitted_set(False)
    old = os.umask(0o022)
    try:
        rs.save(str(tmp_path / "a.safetensors"))
        os.umask(0o077)
        rs.save(str(tmp_path / "b.safetensors"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.safetensors").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "b.safetensors").st_mode) == 0o600
    from sglang_oscar import fileio

    def full_disk(src, dst):  # the temporary file exists when the rename fails
        assert os.path.exists(src)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space"):
        rs.save(str(tmp_path / "a.safetensors"))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors"]
    assert RotationSet.load(str(tmp_path / "a.safetensors")).layer_ids == rs.layer_ids  # the old file intact


def test_save_into_a_missing_folder_is_an_os_error(tmp_path):
    """fileio.save_safetensors raises the OSError its docstring names (safetensors alone raises its own type)."""
    from sglang_oscar import fileio

    with pytest.raises(FileNotFoundError, match="folder .*nope does not exist"):
        fileio.save_safetensors({"x": torch.zeros(2)}, str(tmp_path / "nope" / "a.safetensors"))
    assert os.listdir(tmp_path) == []


def test_upstream_pt_files_load(tmp_path):
    h = hadamard_matrix(128).float()
    for which in ("k", "v"):
        torch.save({"format_version": 1, "objective": "hadamard", "source_grouping": "layer",
                    "layers": {i: {"layer_id": i, "rotation": h, "eigenvalues": torch.ones(128)} for i in range(4)}},
                   tmp_path / f"{which}_rotation_hadamard.pt")
    rs = RotationSet.load(str(tmp_path))
    assert rs.layer_ids == [0, 1, 2, 3] and rs.metadata["upstream"]["k"]["objective"] == "hadamard"
    rs.validate(ModelGeometry.from_hf_config(qwen3_config()))
    # a second K file makes the directory ambiguous
    torch.save({"layers": {}}, tmp_path / "k_rotation_qqt_r_h_pbr.pt")
    with pytest.raises(RotationError, match="exactly one of each"):
        RotationSet.load(str(tmp_path))


def test_junk_upstream_pt_names_the_problem(tmp_path, capsys):
    """A file torch.load cannot read: the exception type and what was expected, not a bare ``101``."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"hello, not a checkpoint")
    good = tmp_path / "v.pt"
    torch.save({"layers": {0: {"rotation": torch.eye(4)}}}, good)
    msg = r"junk\.pt could not be read by torch\.load\(weights_only=True\) \(\w+Error: .*\); expected an upstream OSCAR rotation file"
    with pytest.raises(RotationError, match=msg):
        RotationSet.from_paths(str(junk), str(good))
    with pytest.raises(RotationError, match=msg):
        RotationSet.from_upstream_pt(str(good), str(junk))
    # through `sglang-oscar convert` too
    from sglang_oscar.cli.main import main

    out = tmp_path / "o.safetensors"
    assert main(["convert", "--k", str(junk), "--v", str(good), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"junk\.pt could not be read by torch\.load\(weights_only=True\) \(\w+Error: .*'layers' dict", err)
    assert not out.exists()


def test_convert_refuses_a_missing_file_and_a_safetensors_file(tmp_path, capsys):
    """`convert` takes upstream .pt files: a missing one says so, and an sglang-oscar .safetensors file
    is named as one (it needs no conversion), not sent through torch.load's unpickling advice."""
    from sglang_oscar.cli.main import main

    good = tmp_path / "v.pt"
    torch.save({"layers": {0: {"rotation": torch.eye(4)}}}, good)
    with pytest.raises(FileNotFoundError, match=r"rotation file .*nope\.pt does not exist"):
        RotationSet.from_upstream_pt(str(tmp_path / "nope.pt"), str(good))
    st = tmp_path / "r.safetensors"
    RotationSet.data_free(ModelGeometry.from_hf_config(qwen3_config())).save(str(st))
    out = tmp_path / "o.safetensors"
    assert main(["convert", "--k", str(st), "--v", str(good), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "r.safetensors is a safetensors file, not an upstream OSCAR .pt file" in err and "--oscar-rotation" in err
    assert "weights_only" not in err and not out.exists()


def test_tp_slicing_of_per_head_rotations():
    rs = _fitted_set(True, layers=1, kv=4)
    r0 = rs.for_tp_rank(0, 2, 4)
    r1 = rs.for_tp_rank(1, 2, 4)
    assert torch.equal(r0.k[0], rs.k[0][:2]) and torch.equal(r1.k[0], rs.k[0][2:])
    # replicated kv heads: tp 8 over 4 heads -> rank r owns head r // 2
    r5 = rs.for_tp_rank(5, 8, 4)
    assert torch.equal(r5.v[0], rs.v[0][2:3])
    shared = _fitted_set(False, layers=1)
    assert shared.for_tp_rank(1, 2, 2) is shared


def _expect_invalid(rs, geometry, match):
    with pytest.raises(RotationError, match=match):
        rs.validate(geometry)


def test_validation_errors_name_the_problem(tmp_path):
    geo = ModelGeometry.from_hf_config(qwen3_config())
    rs = RotationSet.data_free(geo)
    rs.validate(geo)
    _expect_invalid(rs, ModelGeometry.from_hf_config(qwen3_config(layers=6)), r"missing \[4, 5\]")
    _expect_invalid(rs, ModelGeometry.from_hf_config(qwen3_config(d=64)), "head_dim 64")
    per_head = _fitted_set(True)
    _expect_invalid(per_head, ModelGeometry.from_hf_config(qwen3_config(kv=4)), "4 kv heads")
    bad = RotationSet({i: t.clone() for i, t in rs.k.items()}, dict(rs.v))
    bad.k[2][0, 0] += 0.1
    _expect_invalid(bad, geo, "layer 2 K rotation is not orthogonal")
    bad.k[2][0, 0] = float("nan")
    _expect_invalid(bad, geo, "layer 2 K rotation contains NaN")
    with pytest.raises(RotationError, match="K rotations cover layers \\[0, 1\\] but V rotations cover \\[0\\]"):
        RotationSet({0: torch.eye(4), 1: torch.eye(4)}, {0: torch.eye(4)})
    with pytest.raises(RotationError, match="not orthogonal"):
        bad.k[2][0, 0] = 1.5
        bad.save(str(tmp_path / "bad.safetensors"))
    assert not os.path.exists(tmp_path / "bad.safetensors")
    with pytest.raises(RotationError, match="all \\[D, D\\]"):
        RotationSet({0: torch.eye(4), 1: torch.eye(4).expand(2, 4, 4)}, {0: torch.eye(4), 1: torch.eye(4)})
    # unknown format version
    path = str(tmp_path / "future.safetensors")
    save_file({"k.0": torch.eye(4), "v.0": torch.eye(4)}, path, metadata={"oscar": json.dumps({"format_version": 7})})
    with pytest.raises(RotationError, match="unknown format_version 7"):
        RotationSet.load(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RotationSet.load(str(tmp_path / "nope.safetensors"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(RotationError, match="no rotation file"):
        RotationSet.load(str(tmp_path / "empty"))


def test_fitted_rotations_do_not_depend_on_eigenvector_signs():
    """eigh returns eigenvectors up to sign (LAPACK and cuSOLVER choose differently) and under U H a
    flipped eigenvector is another rotation; canonical_signs fixes each column's largest entry positive,
    so a fit is the same whatever signs the solver picked."""
    from sglang_oscar.rotation.fit import canonical_signs, rotation_from_covariance
    from sglang_oscar.rotation.hadamard import default_hadamard, eig_bitrev_permutation

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = torch.randn(500, 64, generator=g, dtype=torch.float64) * torch.logspace(0, 1.5, 64, dtype=torch.float64)
    sigma = x.T @ x / 500
    lam, u = torch.linalg.eigh(sigma)
    flips = torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    cu, cf = canonical_signs(u), canonical_signs(u * flips)
    torch.testing.assert_close(cu, cf, rtol=0, atol=0)
    assert bool((cu.gather(0, cu.abs().argmax(0, keepdim=True)) > 0).all())
    torch.testing.assert_close(cu @ torch.diag(lam) @ cu.T, sigma, rtol=1e-10, atol=1e-10)
    r, eig = rotation_from_covariance(sigma)
    want = cf @ default_hadamard(64, dtype=torch.float64) @ eig_bitrev_permutation(eig)
    torch.testing.assert_close(r, want, rtol=0, atol=1e-12)
    # the flip is not harmless without it: U H and (U S) H are different rotations
    assert float((u @ default_hadamard(64, dtype=torch.float64) - (u * flips) @ default_hadamard(64, dtype=torch.float64)).abs().max()) > 0.1
