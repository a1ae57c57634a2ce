"""The model-level MLA oracle (``tests.e2e.mla_oracle``) against transformers' own models, and the
check models' sharpening: DeepSeek-V3 (latent and expanded storage) and GLM-5 (dense DSA)."""

from __future__ import annotations

import pytest

from . import mla_models


def _tiny_dsv3_config():
    """A 2-layer DeepSeek-V3 config with the latent geometry scaled down (rank 128, nope 32, rope 16, V 32)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=64,
                            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2,
                            initializer_range=0.08)


def test_mla_oracle_patch_equals_the_model_without_quantization(tmp_path):
    """The model-level MLA oracle (``tests.e2e.mla_oracle``): with window mode "none", or with a sink
    window that covers the prompt (every key from the fp32 window tier; the rotation is exact), the
    patched model's prompt log-probs equal the unpatched model's; with INT2 reads they move."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.latent import LatentRotationSet

    from . import mla_oracle
    from .checkpoints import random_prompt

    cfg = _tiny_dsv3_config()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    ids = random_prompt(48, 1, 256)
    base = mla_oracle.prompt_logprobs(model, ids)
    rot = LatentRotationSet.data_free(ModelGeometry.from_hf_config(cfg.to_dict())).r
    for mode, config in (("none", OscarConfig(sink_tokens=4, recent_tokens=8)),
                         ("extend", OscarConfig(group_size=32, sink_tokens=64, recent_tokens=8))):
        patched = DeepseekV3ForCausalLM(cfg).eval()
        patched.load_state_dict(model.state_dict())
        assert mla_oracle.install(patched, config, rot, window_mode=mode) == 2
        assert torch.allclose(mla_oracle.prompt_logprobs(patched, ids), base, atol=1e-4), mode
    mla_oracle.install(patched, OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8), rot)
    assert (mla_oracle.prompt_logprobs(patched, ids) - base).abs().mean() > 1e-3


def test_glm5_oracle_patch_equals_the_dense_model_without_quantization():
    """GLM-5 (GlmMoeDsaAttention: DeepSeek-V3's MLA with a DSA indexer) under the same oracle: with
    ``index_topk`` above the prompt the indexer selects every position, so window mode "none" equals the
    unpatched model; INT2 reads move it; a prompt longer than ``index_topk`` is refused."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.latent import LatentRotationSet

    from . import mla_oracle
    from .checkpoints import random_prompt

    cfg = GlmMoeDsaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
                          q_lora_rank=64, initializer_range=0.08, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                          num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=2,
                          index_topk=64, index_head_dim=32, index_n_heads=4, max_position_embeddings=256,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(cfg).eval()
    ids = random_prompt(48, 1, 256)
    base = mla_oracle.prompt_logprobs(model, ids)
    rot = LatentRotationSet.data_free(ModelGeometry.from_hf_config(cfg.to_dict())).r
    patched = GlmMoeDsaForCausalLM(cfg).eval()
    patched.load_state_dict(model.state_dict())
    assert mla_oracle.install(patched, OscarConfig(sink_tokens=4, recent_tokens=8), rot, window_mode="none") == 2
    assert torch.allclose(mla_oracle.prompt_logprobs(patched, ids), base, atol=1e-4)
    mla_oracle.install(patched, OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8), rot)
    assert (mla_oracle.prompt_logprobs(patched, ids) - base).abs().mean() > 1e-3
    with pytest.raises(ValueError, match="index_topk 64"):
        mla_oracle.prompt_logprobs(patched, random_prompt(80, 2, 256))


def test_expanded_mla_oracle_equals_the_model_without_quantization():
    """The expanded-storage oracle (per-head K ``[k_nope | k_pe]`` 48 / V 32 in the MHA oracle): window
    mode "none" or a sink covering the prompt equals the unpatched model; INT2 reads move it, by about
    as much as the latent oracle's (both quantize the same information at 2 bits)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.latent import LatentRotationSet
    from sglang_oscar.rotation.rotation_set import RotationSet

    from . import mla_oracle
    from .checkpoints import random_prompt

    cfg = _tiny_dsv3_config()
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    ids = random_prompt(48, 1, 256)
    base = mla_oracle.prompt_logprobs(model, ids)
    geo = ModelGeometry.from_hf_config(cfg.to_dict())
    rs = RotationSet.data_free(geo.expanded())
    rot = {i: (rs.matrices(i, "k"), rs.matrices(i, "v")) for i in rs.layer_ids}
    assert rot[0][0].shape == (48, 48) and rot[0][1].shape == (32, 32)
    moved = {}
    for mode, config in (("none", OscarConfig(group_size=16, sink_tokens=4, recent_tokens=8)),
                         ("extend", OscarConfig(group_size=16, sink_tokens=64, recent_tokens=8)),
                         ("int2", OscarConfig(group_size=16, sink_tokens=4, recent_tokens=8))):
        patched = DeepseekV3ForCausalLM(cfg).eval()
        patched.load_state_dict(model.state_dict())
        assert mla_oracle.install(patched, config, rot, window_mode="extend" if mode == "int2" else mode,
                                  storage="expanded") == 2
        moved[mode] = float((mla_oracle.prompt_logprobs(patched, ids) - base).abs().mean())
    latent = DeepseekV3ForCausalLM(cfg).eval()
    latent.load_state_dict(model.state_dict())
    mla_oracle.install(latent, OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8),
                       LatentRotationSet.data_free(geo).r)
    moved["latent"] = float((mla_oracle.prompt_logprobs(latent, ids) - base).abs().mean())
    assert moved["none"] < 1e-5 and moved["extend"] < 1e-5, moved
    assert moved["int2"] > 1e-3 and 0.2 < moved["int2"] / moved["latent"] < 5.0, moved
    with pytest.raises(ValueError, match="storage must be"):
        mla_oracle.install(model, OscarConfig(), None, storage="mha")


def test_oracle_interleave_gives_sglangs_gpt_j_rope_layout():
    """transformers' interleaved RoPE returns ``[evens | odds]``; :func:`mla_oracle._interleave` of it is
    the GPT-J rotation SGLang applies in place (pair ``(x_2i, x_2i+1)`` turned by ``pos * inv_freq_i``),
    the column order expanded storage rotates and quantizes ``k_pe`` in."""
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from . import mla_oracle

    cfg = _tiny_dsv3_config()
    rope = hf.DeepseekV3RotaryEmbedding(cfg)
    t, p = 7, cfg.qk_rope_head_dim
    x = torch.randn(1, 1, t, p, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(t)[None]
    cos, sin = rope(x, pos)
    _, got = hf.apply_rotary_pos_emb_interleave(x, x, cos, sin)
    theta = pos[0, :, None].float() * rope.inv_freq[None]  # [T, P/2]
    a, b = x[0, 0, :, 0::2], x[0, 0, :, 1::2]
    want = torch.stack([a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()], -1).flatten(-2)
    assert torch.allclose(mla_oracle._interleave(got[0, 0]), want, atol=1e-5)
    assert not torch.allclose(got[0, 0], want, atol=1e-2)  # without it the columns are permuted


def test_sharpen_reaches_its_targets_on_an_mla_model():
    """checkpoints.sharpen on a DeepSeek-V3 (MLA: the query projection carries the score gain):
    attention scores std 1.5 and logits std 0.5, as on the MHA families."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from .checkpoints import sharpen

    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=64,
                           qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2)
    torch.manual_seed(0)
    stats = sharpen(DeepseekV3ForCausalLM(cfg).eval(), mla_models.LOGIT_STD, mla_models.SCORE_STD, seed=0)
    assert abs(stats["score_std"] - 1.5) < 0.15 and abs(stats["logit_std"] - 0.5) < 1e-3, stats
