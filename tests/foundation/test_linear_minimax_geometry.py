"""Issue 27 foundations: hybrid linear-attention models (Qwen3.5, Qwen3-Next) and the MiniMax family.

Geometry from the published configs, the rotation preflight for linear-attention layers, and the
oracle check that a rotation of the cached post-RoPE rows is exact under MiniMax-M2's partial RoPE.

Config dicts hold the config.json keys that matter. Verified against the transformers 5.12
config classes, whose defaults document these checkpoints (``Qwen3_5MoeTextConfig``:
Qwen/Qwen3.5-35B-A3B; ``Qwen3NextConfig``; ``MiniMaxM2Config``: 62 layers, 48/8 heads x 128,
intermediate 1536; ``MiniMaxM3VLTextConfig``: MiniMax-M3-preview, 60 layers, 64/4 heads x 128,
rotary_dim 64, 4 index heads x 128). Values marked "illustrative" could not be checked here.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.rotation import ModelGeometry, RotationError, RotationSet, default_hadamard
from _support.configs import write_config

QWEN35_FULL = tuple(range(3, 40, 4))
QWEN3_5_35B_A3B = {  # Qwen/Qwen3.5-35B-A3B: multimodal wrapper, text under text_config
    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "text_config": {
        "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "hidden_size": 2048, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
        "layer_types": ["full_attention" if i in QWEN35_FULL else "linear_attention" for i in range(40)],
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},  # rope numbers illustrative
    },
}
QWEN3_NEXT_80B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct: no layer_types, only the interval
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48,
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "full_attention_interval": 4, "partial_rotary_factor": 0.25, "num_experts": 512, "num_experts_per_tok": 10,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}
MINIMAX_M2 = {  # MiniMaxAI/MiniMax-M2 (M2.5 / M2.7 share it); attn_type_list / qk_norm keys per SGLang's reader
    "model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "num_hidden_layers": 62,
    "hidden_size": 3072, "intermediate_size": 1536, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "use_qk_norm": True, "qk_norm_type": "per_layer",
    "num_local_experts": 256, "num_experts_per_tok": 8, "attn_type_list": [1] * 62,
    "quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}
# MiniMax-M3 in SGLang's form (MiniMaxM3SparseForConditionalGeneration reads sparse_attention_config;
# its text model_type is minimax_m2). Which layers are sparse and which drop the index V: illustrative.
M3_SPARSE = [0] * 3 + [1] * 57
M3_NO_INDEX_V = [0] * 3 + [1] * 56 + [0]
MINIMAX_M3 = {
    "model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
    "text_config": {
        "model_type": "minimax_m2", "num_hidden_layers": 60, "hidden_size": 6144, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64, "qk_norm_type": "per_head",
        "sparse_attention_config": {"sparse_attention_freq": M3_SPARSE, "sparse_disable_index_value": M3_NO_INDEX_V,
                                    "sparse_num_index_heads": 4, "sparse_index_dim": 128, "sparse_block_size": 128,
                                    "sparse_topk_blocks": 16, "sparse_local_block": 1, "sparse_init_block": 1},
    },
}




# ---------------------------------------------------------------- geometry
def test_qwen35_full_attention_layers_only():
    g = ModelGeometry.from_hf_config(QWEN3_5_35B_A3B)
    assert (g.model_type, g.num_hidden_layers, g.num_q_heads) == ("qwen3_5_moe_text", 40, 16)
    assert g.layer_ids == list(QWEN35_FULL)
    assert g.linear_layer_ids == tuple(i for i in range(40) if i not in QWEN35_FULL)
    (only,) = g.groups()
    assert (only.kind, only.num_kv_heads, only.head_dim_k, only.head_dim_v) == ("full", 2, 256, 256)
    # the pool index is SGLang's HybridLinearKVPool mapping: position among full-attention layers
    assert [g.pool_index(i) for i in QWEN35_FULL] == list(range(10))
    with pytest.raises(KeyError, match="layer 4 .* is a linear-attention layer: it has no KV cache"):
        g.pool_index(4)
    with pytest.raises(KeyError, match="linear-attention layer"):
        g.layer(0)
    assert ModelGeometry.from_dict(g.to_dict()) == g


def test_qwen3_next_from_the_interval_as_sglang_serves_it():
    g = ModelGeometry.from_hf_config(QWEN3_NEXT_80B)
    assert g.layer_ids == list(range(3, 48, 4)) and len(g.linear_layer_ids) == 36
    assert {(x.num_kv_heads, x.head_dim_k) for x in g.layers} == {(2, 256)}
    # transformers' own config classes agree (they build layer_types from the same interval)
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    tiny = ModelGeometry.from_hf_config(Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=2,
                                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64))
    assert tiny.layer_ids == [1, 3, 5, 7]
    assert ModelGeometry.from_hf_config(Qwen3_5MoeTextConfig(num_hidden_layers=8)).layer_ids == [3, 7]
    # a layer_types list that disagrees with the interval SGLang reads is refused, not guessed
    bad = {**QWEN3_NEXT_80B, "layer_types": ["full_attention"] + ["linear_attention"] * 47}
    with pytest.raises(ValueError, match=r"layer_types disagrees with full_attention_interval 4 \(first at layer 0\)"):
        ModelGeometry.from_hf_config(bad)


def test_minimax_m2_is_plain_gqa():
    g = ModelGeometry.from_hf_config(MINIMAX_M2)
    (only,) = g.groups()
    assert (g.num_hidden_layers, g.num_q_heads, only.num_kv_heads, only.head_dim_k, only.head_dim_v) == (62, 48, 8, 128, 128)
    assert only.layer_ids == tuple(range(62)) and g.linear_layer_ids == ()
    assert not any(x.is_sparse for x in g.layers)


def test_minimax_m3_index_branch_per_layer():
    g = ModelGeometry.from_hf_config(MINIMAX_M3)
    assert (g.num_hidden_layers, g.num_q_heads) == (60, 64)
    # every layer has main attention (4 kv heads x 128) in one INT2 pool, global ids = pool ids
    (only,) = g.groups()
    assert (only.num_kv_heads, only.head_dim_k, only.layer_ids) == (4, 128, tuple(range(60)))
    dense = [x.layer_id for x in g.layers if not x.is_sparse]
    assert dense == [0, 1, 2]
    assert {(x.index_num_heads, x.index_head_dim) for x in g.layers if x.is_sparse} == {(4, 128)}
    assert [x.layer_id for x in g.layers if x.is_sparse and x.index_has_value] == [59]
    # transformers 5.12's flattened form: layer_types "minimax_m3_sparse", no index V anywhere
    from transformers import AutoConfig

    hf = AutoConfig.for_model("minimax_m3_vl", text_config={
        "num_hidden_layers": 4, "sparse_attention_config": {"sparse_attention_freq": [0, 1, 0, 1]}})
    t = ModelGeometry.from_hf_config(hf)
    assert [(x.layer_id, x.is_sparse, x.index_has_value, x.index_head_dim) for x in t.layers] == \
        [(0, False, False, None), (1, True, False, 128), (2, False, False, None), (3, True, False, 128)]
    with pytest.raises(ValueError, match="sparse_attention_freq has 3 entries but num_hidden_layers is 60"):
        bad = json.loads(json.dumps(MINIMAX_M3))
        bad["text_config"]["sparse_attention_config"]["sparse_attention_freq"] = [0, 1, 1]
        ModelGeometry.from_hf_config(bad)


# ---------------------------------------------------------------- rotation preflight
def test_rotation_covering_linear_layers_is_refused_naming_them(tmp_path):
    g = ModelGeometry.from_hf_config(QWEN3_5_35B_A3B)
    h = default_hadamard(256).float()
    every = {i: h for i in range(40)}  # fitted as if all 40 layers attended
    with pytest.raises(RotationError) as exc:
        RotationSet(every, dict(every), source="r.safetensors").validate(g)
    msg = str(exc.value)
    assert "has rotations for layers [0..2, 4..6, 8..10, 12..14, 16..18, 20..22, ...] (30 layers), which are " \
        "linear-attention layers" in msg
    assert "no KV cache" in msg and "10 full-attention layers are [3, 7, ..., 39] (10 layers, every 4)" in msg
    assert "sglang-oscar hadamard --config CONFIG.json --out FILE.safetensors" in msg and "recalibrate" in msg
    few = {i: h for i in (0, 1, 2)}  # a handful: named one by one, with the missing attention layers
    with pytest.raises(RotationError, match=r"layers \[0, 1, 2\], which are linear-attention.*misses full-attention "
                                            r"layers \[3, 7, \.\.\., 39\] \(10 layers, every 4\)"):
        RotationSet(few, dict(few)).validate(g)


def test_rotation_missing_a_full_attention_layer_names_it(tmp_path):
    g = ModelGeometry.from_hf_config(QWEN3_5_35B_A3B)
    h = default_hadamard(256).float()
    part = {i: h for i in QWEN35_FULL if i != 19}
    with pytest.raises(RotationError, match=r"missing full-attention layers \[19\]"):
        RotationSet(part, dict(part)).validate(g)
    # the data-free file of this config validates, through the CLI as well
    RotationSet.data_free(g).validate(g)
    from sglang_oscar.cli.main import main

    cfg, out = write_config(tmp_path, QWEN3_5_35B_A3B), str(tmp_path / "q35.safetensors")
    assert main(["hadamard", "--config", cfg, "--out", out]) == 0
    assert RotationSet.load(out).layer_ids == list(QWEN35_FULL)
    assert main(["validate", out, "--config", cfg]) == 0


# ---------------------------------------------------------------- partial RoPE (MiniMax-M2)
def _partial_rope(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, base: float = 5_000_000.0) -> torch.Tensor:
    """NeoX-style RoPE on the first ``rotary_dim`` of ``D`` dims (the rest pass through), as
    MiniMax-M2 applies it (rotary_dim 64 of head_dim 128). ``x [T, H, D]``, ``pos [T]``."""
    half = rotary_dim // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :].float(), ang.sin()[:, None, :].float()
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


@pytest.mark.parametrize("rotation", ["hadamard", "random"])
def test_rotation_of_post_rope_rows_is_exact_under_partial_rope(rotation):
    """The cache holds ``RoPE_64(k) R`` (full 128-wide R after partial RoPE) and the query is
    ``RoPE_64(q) R``: ``(q' R)(k' R)^T = q' k'^T`` for any orthogonal R, so the unquantized oracle
    equals plain attention over the post-RoPE rows. MiniMax-M2's cross-head QK RMSNorm (over all
    heads of a rank, before RoPE) also happens before the cache write, so it needs nothing either."""
    from sglang_oscar.reference.attention import oscar_attention, plain_attention

    gen = torch.Generator().manual_seed(27)
    t, hq, hkv, d = 96, 6, 1, 128  # 48/8 heads over TP 8: 6 query heads per kv head
    pos = torch.arange(t)
    q0 = torch.randn(t, hq, d, generator=gen)
    q = _partial_rope(q0, pos, 64)
    k = _partial_rope(torch.randn(t, hkv, d, generator=gen) * 2, pos, 64)
    v = torch.randn(t, hkv, d, generator=gen)
    assert torch.equal(q[..., 64:], q0[..., 64:]) and not torch.allclose(q[1:, :, :64], q0[1:, :, :64])
    if rotation == "hadamard":
        rk = rv = default_hadamard(d).float()
    else:
        rk = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
        rv = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
    got = oscar_attention(q, k, v, rk, rv, OscarConfig(), quantize=False, hp_dtype=torch.float32, window_mode="none")
    want = plain_attention(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # a rotation over the rotary half only (block-diagonal 64 + identity) is exact too, but not needed
    blk = torch.eye(d)
    blk[:64, :64] = default_hadamard(64).float()
    torch.testing.assert_close(oscar_attention(q, k, v, blk, blk, OscarConfig(), quantize=False,
                                               hp_dtype=torch.float32, window_mode="none"), want, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- recipe
def test_qwen35_recipe_matches_the_config():
    from pathlib import Path

    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.calibrate.recipes import check_geometry, geometry_mismatches, load, oscar_config

    path = Path(__file__).resolve().parents[2] / "recipes" / "Qwen3.5-35B-A3B" / "recipe.toml"
    r = load(path)
    assert r.model.family == "qwen3_5" and r.model.served is True and "qwen3_5.py" in r.model.notes
    assert r.quant.quantizer == "lloyd-max" and "Lloyd-Max" in r.model.notes
    geo = geometry_of(QWEN3_5_35B_A3B)
    assert geometry_mismatches(r, geo, QWEN3_5_35B_A3B) == []
    check_geometry(r, geo, QWEN3_5_35B_A3B)
    cfg = oscar_config(r)
    cfg.check_head_dims(256)
    wrong = json.loads(json.dumps(QWEN3_5_35B_A3B))
    wrong["text_config"]["num_key_value_heads"] = 4
    assert geometry_mismatches(r, geometry_of(wrong), wrong) == ["num_kv_heads: recipe 2, model 4"]
