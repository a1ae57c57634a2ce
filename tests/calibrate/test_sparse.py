"""Sparse (DSA) attention: the capture path keeps the model's top-k selection, and the dense
oracle refuses calls where the selection drops keys instead of reporting dense attention."""

from __future__ import annotations

import pytest
import torch

from calib_tiny import VOCAB, build_model, make_text
from sglang_oscar.calibrate import CalibrationError
from sglang_oscar.calibrate.capture import _dispatch, attention_override, register
from sglang_oscar.calibrate.error import functional_error
from sglang_oscar.calibrate.ppl import perplexity
from sglang_oscar.calibrate.prompts import Documents, build_prompt_set
from sglang_oscar.config import OscarConfig

SEQ = 40


def glm_dsa(index_topk: int):
    """A tiny GLM-5.x (GlmMoeDsa: MLA + DeepSeek sparse attention) with a top-k of ``index_topk`` keys."""
    import transformers as tf

    cfg = tf.GlmMoeDsaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             max_position_embeddings=1024, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                             kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=2, n_shared_experts=1,
                             index_topk=index_topk, index_head_dim=16, index_n_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")):
                p.normal_(0.0, 0.25)
    return model


def _prompts(tokenizer):
    return build_prompt_set(tokenizer, "mem", budget=2 * SEQ, seq_len=SEQ,
                            documents=Documents(make_text(10, 60, 3), "text", "mem", "0" * 64))


def test_observe_only_capture_keeps_the_sparse_selection():
    """With the capture override active (handler observes only), the model computes the same
    logits as with its own SDPA path, which folds the top-k selection into the mask."""
    model = glm_dsa(index_topk=8)
    ids = torch.randint(4, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(input_ids=ids, use_cache=False).logits
        dropped = []
        with attention_override(model, lambda call: dropped.append(call.sparse_dropped)):
            got = model(input_ids=ids, use_cache=False).logits
    assert dropped and all(n > 0 for n in dropped)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_oracle_refuses_sparse_attention_that_drops_keys(tokenizer):
    model = glm_dsa(index_topk=8)
    prompts = _prompts(tokenizer)
    cfg = OscarConfig(group_size=16, sink_tokens=2, recent_tokens=4)
    with pytest.raises(CalibrationError, match="sparse DSA attention .*index_topk 8.*not supported by the oracle"):
        functional_error(model, prompts, {}, cfg, progress=False)
    with pytest.raises(CalibrationError, match="sparse DSA attention"):
        perplexity(model, prompts, None, cfg, progress=False)


def test_sparse_model_within_its_topk_is_dense_and_accepted(tokenizer):
    """Sequences no longer than index_topk: the selection drops nothing, the oracle applies."""
    model = glm_dsa(index_topk=64)
    prompts = _prompts(tokenizer)
    cfg = OscarConfig(group_size=16, sink_tokens=2, recent_tokens=4)
    rep = functional_error(model, prompts, {}, cfg, progress=False)
    assert rep["overall_db"]["hadamard"] < -3.0
    rep = perplexity(model, prompts, None, cfg, progress=False)
    assert rep["relative_change"] != 0.0


def test_block_sparse_attention_is_refused():
    """MiniMax-M3's block-sparse selection (block_indices) cannot be reproduced: refused, not ignored."""
    register()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(CalibrationError, match="block-sparse attention"):
        _dispatch(torch.nn.Module(), q, q, q, None, block_indices=torch.zeros(1, 4, 1, dtype=torch.long))


def test_softcap_uses_the_models_eager_attention():
    """Logit softcap (no SDPA support): the observe-only path runs the model's own eager attention."""
    model = build_model("gemma3", attn_logit_softcapping=5.0)
    ids = torch.randint(4, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, use_cache=False).logits
        with attention_override(model, lambda call: None):
            got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_attention_sinks_use_the_models_eager_attention():
    """Attention sinks (GPT-OSS ``s_aux``, which SDPA would drop): the observe-only path runs the
    model's own eager attention, and every call carries the layer's sinks."""
    import transformers as tf

    cfg = tf.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                          num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(3.0, 1.0)  # large enough to matter
    ids = torch.randint(4, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    seen = []

    def observe(call):
        seen.append(call.sinks is call.module.sinks)
        return None

    with torch.inference_mode():
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, use_cache=False).logits
        with attention_override(model, observe):
            got = model(input_ids=ids, use_cache=False).logits
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.fill_(-1e4)  # no sink: what transformers' SDPA (which ignores s_aux) would compute
        no_sink = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert seen == [True, True] and (no_sink - ref).abs().max() > 1e-2
