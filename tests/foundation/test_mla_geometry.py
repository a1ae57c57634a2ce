"""ModelGeometry of MLA configs (DeepSeek-V3, GLM-5 ``glm_moe_dsa``, Kimi-K2.5, Kimi-Linear).

The configs are dicts with the published config.json values, trimmed to the keys that matter:
deepseek-ai/DeepSeek-V3, a GLM-5.x ``glm_moe_dsa`` config (the DSA indexer keys of GLM-5.2),
moonshotai/Kimi-Linear-48B-A3B-Instruct; Kimi-K2.5's wrapper is the point of its dict (a
``kimi_k25`` config around a DeepSeek-V3 ``text_config``), its rope numbers are illustrative.
"""

from __future__ import annotations

import math

import pytest

from sglang_oscar.rotation.geometry import ModelGeometry, mla_softmax_scale
from sglang_oscar.rotation.latent import LatentRotationSet

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 3, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
GLM_5 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 192,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048, "index_topk_freq": 4,
    "index_skip_topk_offset": 3, "first_k_dense_replace": 3, "max_position_embeddings": 1048576,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
}
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "max_position_embeddings": 262144, "rope_theta": 50000.0,
                    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                     "type": "yarn"}},
    "vision_config": {"model_type": "kimi_k25_vision"},
}
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 2304,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
}


def _mla_fields(g):
    return (g.attention_kind, g.kv_lora_rank, g.qk_rope_head_dim, g.qk_nope_head_dim, g.v_head_dim)


def test_deepseek_v3():
    g = ModelGeometry.from_hf_config(DEEPSEEK_V3)
    assert _mla_fields(g) == ("mla", 512, 64, 128, 128)
    assert g.layer_ids == list(range(61)) and g.num_q_heads == 128
    assert all((x.num_kv_heads, x.head_dim_k, x.head_dim_v) == (1, 512, 512) for x in g.layers)
    assert g.index_topk is None and g.index_head_dim is None
    LatentRotationSet.data_free(g).validate(g)


def test_glm5_glm_moe_dsa():
    g = ModelGeometry.from_hf_config(GLM_5)  # transformers 5.12 has GlmMoeDsaConfig (layer_types: DSA)
    assert _mla_fields(g) == ("mla", 512, 64, 192, 256)
    assert g.layer_ids == list(range(78)) and g.num_q_heads == 64
    assert (g.index_topk, g.index_head_dim) == (2048, 128)
    # a partial dict: num_key_value_heads from the config class's defaults does not matter for MLA
    small = ModelGeometry.from_hf_config({"model_type": "glm_moe_dsa", "num_hidden_layers": 4,
                                          "num_attention_heads": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64})
    assert small.layer_ids == [0, 1, 2, 3] and small.attention_kind == "mla"


def test_kimi_k25_reads_its_deepseek_text_config():
    g = ModelGeometry.from_hf_config(KIMI_K25)
    assert _mla_fields(g) == ("mla", 512, 64, 128, 128)
    assert g.layer_ids == list(range(61)) and g.num_q_heads == 64


def test_kimi_linear_mla_layers_only():
    g = ModelGeometry.from_hf_config(KIMI_LINEAR)
    assert _mla_fields(g) == ("mla", 512, 64, 128, 128)
    assert g.num_hidden_layers == 27
    assert g.layer_ids == [3, 7, 11, 15, 19, 23, 26]  # full_attn_layers are 1-based
    LatentRotationSet.data_free(g).validate(g)
    only_full = {**KIMI_LINEAR, "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27]}}
    assert ModelGeometry.from_hf_config(only_full).layer_ids == g.layer_ids
    clash = {**KIMI_LINEAR, "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3]}}
    with pytest.raises(ValueError, match="partition"):
        ModelGeometry.from_hf_config(clash)
    zero_based = {**KIMI_LINEAR, "linear_attn_config": {"kda_layers": [0, 1, 2]}}
    with pytest.raises(ValueError, match="1-based"):
        ModelGeometry.from_hf_config(zero_based)


@pytest.mark.parametrize("config", [DEEPSEEK_V3, GLM_5, KIMI_LINEAR], ids=["deepseek_v3", "glm5", "kimi_linear"])
def test_an_mla_model_type_without_kv_lora_rank_is_refused(config):
    """SGLang serves these model types as MLA whatever the config says: without a rank the config is
    not read as an MHA model (a K/V rotation file for it would never be served)."""
    with pytest.raises(ValueError, match=rf"model_type {config['model_type']!r} sets no kv_lora_rank: SGLang serves "
                                         "this model as MLA"):
        ModelGeometry.from_hf_config({**config, "kv_lora_rank": None})


def test_expanded_geometry():
    e = ModelGeometry.from_hf_config(DEEPSEEK_V3).expanded()
    assert e.attention_kind == "mha" and e.layer_ids == list(range(61))
    assert {(x.num_kv_heads, x.head_dim_k, x.head_dim_v) for x in e.layers} == {(128, 192, 128)}
    assert {(x.num_kv_heads, x.head_dim_k, x.head_dim_v) for x in ModelGeometry.from_hf_config(GLM_5).expanded().layers} \
        == {(64, 256, 256)}
    with pytest.raises(ValueError, match="not an MLA"):
        ModelGeometry.from_hf_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "hidden_size": 256}).expanded()


def test_dict_round_trip_keeps_the_new_fields_and_reads_old_dicts():
    g = ModelGeometry.from_hf_config(GLM_5)
    assert ModelGeometry.from_dict(g.to_dict()) == g
    old = {k: v for k, v in g.to_dict().items() if k not in ("qk_nope_head_dim", "v_head_dim", "index_topk",
                                                             "index_head_dim")}
    assert ModelGeometry.from_dict(old).cache_shapes() == g.cache_shapes()


def test_softmax_scale():
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert mla_softmax_scale(DEEPSEEK_V3) == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert mla_softmax_scale(GLM_5) == pytest.approx(256 ** -0.5)  # rope_type default: no YaRN factor
    assert mla_softmax_scale(KIMI_K25) == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2)
    assert mla_softmax_scale(KIMI_LINEAR) == pytest.approx(192 ** -0.5)  # NoPE MLA: no rope, no mscale
    no_all_dim = {**DEEPSEEK_V3, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "mscale_all_dim": 0}}
    assert mla_softmax_scale(no_all_dim) == pytest.approx(192 ** -0.5)
    with pytest.raises(ValueError, match="not an MLA"):
        mla_softmax_scale({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
