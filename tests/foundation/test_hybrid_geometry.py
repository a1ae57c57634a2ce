"""Hybrid sliding-window models: geometry groups, --oscar-skip-layers, per-layer rotation preflight.

The published configs are written out as dicts (the keys their config.json sets; everything else
is the transformers default, which ModelGeometry fills in through AutoConfig).
"""

from __future__ import annotations


import pytest
import torch

from sglang_oscar.cli.main import main
from sglang_oscar.config import OscarConfig, parse_skip_layers, resolve_skip_layers
from sglang_oscar.rotation import ModelGeometry, RotationError, RotationSet, default_hadamard
from _support.configs import write_config

G4_FULL = list(range(5, 48, 6))  # every 6th layer is full attention (5:1)
GEMMA4_12B = {  # google/gemma-4-12b-it: multimodal config, text under text_config
    "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
    "text_config": {
        "model_type": "gemma4_text", "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
        "sliding_window": 1024, "hidden_size": 3840,
        "layer_types": ["full_attention" if i in G4_FULL else "sliding_attention" for i in range(48)],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1000000.0}},
    },
}
GEMMA3_12B = {  # google/gemma-3-12b-it: layer kinds from sliding_window_pattern 6 (the default)
    "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
    "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                    "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
}
GPT_OSS_20B = {  # openai/gpt-oss-20b: alternating sliding / full, learned sinks on every layer
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880,
    "sliding_window": 128, "num_local_experts": 32, "experts_per_token": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}




# ---------------------------------------------------------------- geometry
def test_gemma4_12b_two_geometry_groups():
    g = ModelGeometry.from_hf_config(GEMMA4_12B)
    assert g.model_type == "gemma4_text" and g.num_hidden_layers == 48 and g.num_q_heads == 16
    sliding, full = g.groups()
    assert (sliding.kind, sliding.num_kv_heads, sliding.head_dim_k, sliding.head_dim_v, sliding.k_eq_v) == \
        ("sliding", 8, 256, 256, False)
    assert sliding.sliding_windows == (1024,) and sliding.layer_ids == tuple(i for i in range(48) if i not in G4_FULL)
    assert (full.kind, full.num_kv_heads, full.head_dim_k, full.head_dim_v, full.k_eq_v) == ("full", 1, 512, 512, False)
    assert full.sliding_windows == () and full.layer_ids == tuple(G4_FULL)
    # attention_k_eq_v: V from K's projection, but the cache holds both (V = v_norm(x W_k) != K)
    assert all(g.layer(i).v_shares_k_proj and not g.layer(i).k_eq_v for i in G4_FULL)
    assert not any(g.layer(i).v_shares_k_proj for i in sliding.layer_ids)
    assert not any(x.has_sinks for x in g.layers)
    assert g.group_of(11) == full and g.group_of(0) == sliding and g.has_sliding
    assert full.describe() == "full: 8 layers x 1 kv heads x D 512/512"
    assert sliding.describe() == "sliding (window 1024): 40 layers x 8 kv heads x D 256/256"
    with pytest.raises(KeyError):
        g.group_of(48)


def test_gemma4_in_sglang_names_reads_the_same_geometry():
    """The served backend reads SGLang's own config object, whose Gemma-4 names are swapped (base keys =
    full layers, ``swa_*`` = sliding; sglang/srt/utils/hf_transformers/config.py:159-185); it gives
    the same layers as the HF config.json, so a rotation file checked at launch fits the server."""
    text = dict(GEMMA4_12B["text_config"])
    sglang = {**text, "head_dim": 512, "num_key_value_heads": 1, "swa_head_dim": 256, "swa_v_head_dim": 256,
              "swa_num_key_value_heads": 8}
    hf = ModelGeometry.from_hf_config(GEMMA4_12B)
    served = ModelGeometry.from_hf_config({**GEMMA4_12B, "text_config": sglang})
    assert served.layers == hf.layers
    assert {(x.num_kv_heads, x.head_dim_k, x.sliding_window) for x in served.layers} == {(8, 256, 1024), (1, 512, None)}
    # SGLang sets swa_head_dim = head_dim on every text config: a one-geometry model reads the same
    qwen = {"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 128, "hidden_size": 256}
    assert ModelGeometry.from_hf_config({**qwen, "swa_head_dim": 128}).layers == ModelGeometry.from_hf_config(qwen).layers


@pytest.mark.parametrize("edit,match", [
    ({"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ({"sliding_window": -5}, "sliding_window must be a positive integer, got -5"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"num_hidden_layers": "two"}, "num_hidden_layers must be a positive integer, got 'two'"),
    ({"num_hidden_layers": None}, "has no 'num_hidden_layers'"),
    ({"num_attention_heads": 8.5}, "num_attention_heads must be a positive integer, got 8.5"),
])
def test_bad_config_values_are_named_not_defaulted(edit, match):
    """Each bad count is named: a 0 is not read as "unset" (0 kv heads would become the query heads, a 0
    window would make the sliding layers full), a negative window is not kept, a null or non-integer count
    is not a bare TypeError / int() error."""
    with pytest.raises(ValueError, match=match):
        ModelGeometry.from_hf_config({**GPT_OSS_20B, **edit})


def test_global_kv_heads_must_divide_the_query_heads():
    text = {**GEMMA4_12B["text_config"], "num_global_key_value_heads": 3}
    with pytest.raises(ValueError, match="16 attention heads are not a multiple of num_global_key_value_heads 3"):
        ModelGeometry.from_hf_config({**GEMMA4_12B, "text_config": text})
    bad = {**GEMMA4_12B["text_config"], "num_global_key_value_heads": 0}
    with pytest.raises(ValueError, match="num_global_key_value_heads must be a positive integer, got 0"):
        ModelGeometry.from_hf_config({**GEMMA4_12B, "text_config": bad})


def test_gemma3_and_gpt_oss_groups():
    g3 = ModelGeometry.from_hf_config(GEMMA3_12B)
    s, f = g3.groups()
    assert (s.kind, s.num_kv_heads, s.head_dim_k, s.sliding_windows, len(s.layer_ids)) == ("sliding", 8, 256, (1024,), 40)
    assert (f.kind, f.num_kv_heads, f.head_dim_k, f.layer_ids) == ("full", 8, 256, tuple(G4_FULL))
    assert not any(x.has_sinks or x.v_shares_k_proj for x in g3.layers)

    oss = ModelGeometry.from_hf_config(GPT_OSS_20B)
    s, f = oss.groups()
    # same row layout, still two pools: SGLang's hybrid-SWA pool keeps sliding and full apart
    assert (s.kind, s.num_kv_heads, s.head_dim_k, s.sliding_windows, s.layer_ids) == \
        ("sliding", 8, 64, (128,), tuple(range(0, 24, 2)))
    assert (f.kind, f.num_kv_heads, f.head_dim_k, f.layer_ids) == ("full", 8, 64, tuple(range(1, 24, 2)))
    assert all(x.has_sinks for x in oss.layers)


def test_tiny_transformers_configs():
    from transformers import Gemma3TextConfig, Gemma4TextConfig, GptOssConfig, Qwen3Config

    g4 = ModelGeometry.from_hf_config(Gemma4TextConfig(
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=64, hidden_size=64))
    assert [(g.kind, g.num_kv_heads, g.head_dim_k, g.layer_ids) for g in g4.groups()] == \
        [("sliding", 2, 32, (0, 1, 2, 3, 4)), ("full", 1, 64, (5,))]
    assert g4.layer(5).v_shares_k_proj and g4.layer(0).sliding_window == 64
    g3 = ModelGeometry.from_hf_config(Gemma3TextConfig(num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1,
                                                       head_dim=32, sliding_window=96))
    assert [x.kind for x in g3.layers] == ["sliding"] * 5 + ["full", "sliding"]
    oss = ModelGeometry.from_hf_config(GptOssConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                                    head_dim=32, sliding_window=64, hidden_size=64))
    assert [(x.kind, x.sliding_window, x.has_sinks) for x in oss.layers] == [("sliding", 64, True), ("full", None, True)] * 2
    q = ModelGeometry.from_hf_config(Qwen3Config(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=32, hidden_size=64))
    (only,) = q.groups()
    assert only.kind == "full" and only.layer_ids == (0, 1, 2) and not q.has_sliding


def test_geometry_dicts_round_trip_and_old_dicts_still_match():
    g = ModelGeometry.from_hf_config(GEMMA4_12B)
    assert ModelGeometry.from_dict(g.to_dict()) == g
    # a geometry recorded before has_sinks / v_shares_k_proj / k_eq_v existed
    old = g.to_dict()
    for layer in old["layers"]:
        for key in ("has_sinks", "v_shares_k_proj", "k_eq_v"):
            del layer[key]
    back = ModelGeometry.from_dict(old)
    assert back != g and back.cache_shapes() == g.cache_shapes()
    assert ModelGeometry.from_hf_config(GEMMA3_12B).cache_shapes() != g.cache_shapes()


# ---------------------------------------------------------------- --oscar-skip-layers
def test_skip_layers_parsing():
    assert OscarConfig().skip_layers == "none"
    assert OscarConfig(skip_layers=" Sliding ").skip_layers == "sliding"
    assert OscarConfig(skip_layers="11, 5,5").skip_layers == "5,11"
    assert parse_skip_layers([3, 1]) == "1,3" and parse_skip_layers([]) == "none"
    for bad in ("", "sliding,3", "-1", "1,,2", "a", "1.5"):
        with pytest.raises(ValueError, match="sliding, full or comma-separated|one of none, sliding, full"):
            OscarConfig(skip_layers=bad)
    with pytest.raises(ValueError, match="skip_layers must be"):
        parse_skip_layers([True])


def test_resolve_skip_layers():
    g = ModelGeometry.from_hf_config(GEMMA4_12B)
    assert resolve_skip_layers("none", g) == frozenset()
    assert resolve_skip_layers("full", g) == frozenset(G4_FULL)
    assert resolve_skip_layers("sliding", g) == frozenset(range(48)) - frozenset(G4_FULL)
    assert resolve_skip_layers("0,47", g) == {0, 47}
    assert resolve_skip_layers(OscarConfig(skip_layers="5").skip_layers, g) == {5}
    with pytest.raises(ValueError) as exc:
        resolve_skip_layers("3,48,60", g)
    msg = str(exc.value)
    assert "names layers [48, 60]" in msg and "attention layers are 0..47" in msg
    assert "40 sliding, 8 full" in msg and "Fix: list ids from that range, or pass sliding, full or none" in msg
    q = ModelGeometry.from_hf_config({"model_type": "qwen3", "num_hidden_layers": 4, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "head_dim": 32})
    assert resolve_skip_layers("sliding", q) == frozenset()  # nothing of that kind: nothing skipped
    # hybrids with linear-attention layers: ids that exist but have no KV cache are named as such
    hyb = ModelGeometry.from_hf_config({"model_type": "m", "num_hidden_layers": 4, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "head_dim": 32,
                                        "layer_types": ["linear_attention", "full_attention"] * 2})
    with pytest.raises(ValueError, match=r"layers \[0\] have no KV cache.*attention layers are 1, 3"):
        resolve_skip_layers("0,1", hyb)


# ---------------------------------------------------------------- rotation preflight
def test_hadamard_cli_writes_a_valid_two_geometry_file(tmp_path, capsys):
    cfg = write_config(tmp_path, GEMMA4_12B)
    out = str(tmp_path / "g4.safetensors")
    assert main(["hadamard", "--config", cfg, "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "48 layers of gemma4_text" in printed and "full: 8 layers x 1 kv heads x D 512/512" in printed
    rs = RotationSet.load(out)
    g = ModelGeometry.from_hf_config(cfg)
    for i in range(48):
        d = 512 if i in G4_FULL else 256
        assert rs.head_dims(i) == (d, d)
        assert torch.equal(rs.k[i], default_hadamard(d).float()) and torch.equal(rs.v[i], rs.k[i])
    rs.validate(g)
    assert main(["validate", out, "--config", cfg]) == 0


def test_one_head_dim_for_all_layers_is_refused_naming_the_layer(tmp_path):
    g = ModelGeometry.from_hf_config(GEMMA4_12B)
    h = default_hadamard(256).float()
    rs = RotationSet({i: h for i in range(48)}, {i: h for i in range(48)}, source="r.safetensors")
    with pytest.raises(RotationError) as exc:
        rs.validate(g)
    msg = str(exc.value)
    assert "layer 5 (full) K rotation has shape (256, 256), expected (512, 512) (per layer) or (1, 512, 512)" in msg
    assert "more than one layer geometry" in msg and "full layers [5, 11, 17, 23, 29, 35, 41, 47]" in msg
    assert "sglang-oscar hadamard --config CONFIG.json --out FILE.safetensors" in msg and "refit" in msg
    # with the full layers kept BF16 the same file is valid: skipped layers need no rotation
    rs.validate(g, skip_layers=resolve_skip_layers("full", g))
    # and a file without the skipped layers at all is valid too
    sliding_only = {i: h for i in range(48) if i not in G4_FULL}
    RotationSet(sliding_only, dict(sliding_only)).validate(g, skip_layers=frozenset(G4_FULL))
    with pytest.raises(RotationError, match=r"missing \[5, 11"):
        RotationSet(sliding_only, dict(sliding_only)).validate(g)


def test_per_head_rotation_with_the_wrong_head_count_names_the_layer():
    g = ModelGeometry.from_hf_config(GEMMA4_12B)
    k = {i: default_hadamard(512 if i in G4_FULL else 256).float() for i in range(48)}
    v = dict(k)
    v[11] = default_hadamard(512).float().expand(8, 512, 512).clone()  # 8 heads, the full layers have 1
    rs = RotationSet({i: t.expand(8 if i not in G4_FULL else 1, *t.shape).clone() for i, t in k.items()},
                     {i: t.expand(8 if i not in G4_FULL else 1, *t.shape).clone() if t.dim() == 2 else t
                      for i, t in v.items()})
    with pytest.raises(RotationError, match=r"layer 11 \(full\) V rotation has shape \(8, 512, 512\), expected"):
        rs.validate(g)


def test_k_eq_v_layers_need_the_k_rotation():
    from sglang_oscar.rotation import LayerGeometry

    layers = (LayerGeometry(0, 2, 32, 32, 16), LayerGeometry(1, 1, 64, 64, k_eq_v=True))
    g = ModelGeometry("toy", 2, 4, layers)
    k = {0: default_hadamard(32).float(), 1: default_hadamard(64).float()}
    RotationSet(k, dict(k)).validate(g)
    other = dict(k)
    other[1] = torch.eye(64)
    with pytest.raises(RotationError, match=r"layer 1 caches V as its K rows.*R_v = R_k.*V rotation differs"):
        RotationSet(k, other).validate(g)
    # the sliding layer 0 may differ: it stores V separately
    other0 = dict(k)
    other0[0] = torch.eye(32)
    RotationSet(k, other0).validate(g)
    means = {0: torch.zeros(2, 32), 1: torch.zeros(1, 64)}
    with pytest.raises(RotationError, match="V mean differs"):
        RotationSet(k, dict(k), k_mean=means, v_mean={0: torch.zeros(2, 32), 1: torch.ones(1, 64)}).validate(g)
    # the data-free set satisfies it by construction
    RotationSet.data_free(g).validate(g)


@pytest.mark.parametrize("center", [False, True])
def test_fit_gives_k_eq_v_layers_the_k_rotation(center):
    from sglang_oscar.calibrate.fit import fit_rotations
    from sglang_oscar.calibrate.stats import CalibrationStats
    from sglang_oscar.rotation import LayerGeometry

    g = ModelGeometry("toy", 2, 4, (LayerGeometry(0, 2, 16, 16, 8), LayerGeometry(1, 1, 32, 32, k_eq_v=True)))
    st = CalibrationStats(g)
    gen = torch.Generator().manual_seed(0)
    rows = {0: (torch.randn(400, 4, 16, generator=gen), torch.randn(400, 2, 16, generator=gen) * 3,
                torch.randn(400, 2, 16, generator=gen) + 1),
            1: (torch.randn(400, 4, 32, generator=gen), torch.randn(400, 1, 32, generator=gen) * 2 + 0.5, None)}
    for lid, (q, k, v) in rows.items():
        st.add_pass1(lid, q, k, k if v is None else v)
    st.passes_done = 1
    for lid, (q, k, v) in rows.items():
        st.add_pass2(lid, k, k if v is None else v)
    st.passes_done = 2
    rs = fit_rotations(st, "oscar", min_tokens=100, center=center)
    assert torch.equal(rs.v[1], rs.k[1]) and not torch.equal(rs.v[0], rs.k[0])
    if center:
        assert torch.equal(rs.v_mean[1], rs.k_mean[1]) and not torch.equal(rs.v_mean[0], rs.k_mean[0])
    rs.validate(g)
