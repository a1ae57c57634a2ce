"""CPU tests of the ``qwen3_5`` device-check family: Qwen3.5's multimodal wrapper
(``Qwen3_5MoeForConditionalGeneration``) around a Gated-DeltaNet + full-attention MoE, saved as
SGLang 0.5.16 serves it, its processor, its M-RoPE on text positions and the oracle on the
language model inside the wrapper. The rotation files and the family's bad file are checked with
the other hybrids (``test_checkpoints_oracle.test_sink_and_hybrid_oracle_and_rotation_files``)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from . import checkpoints, client, families, oracle
from .tiny import TINY_FAMILY

# the tiny model's vision token ids: vocab_size + 0..3 (families.QWEN3_5_VISION_TOKENS)
TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")


def test_qwen3_5_saves_the_wrapper_sglang_serves(tiny_family):
    """The saved folder is a Qwen3_5MoeForConditionalGeneration checkpoint: the text config keeps
    ``full_attention_interval`` and interleaved M-RoPE, the vision tower has one block of 2 heads and
    no deepstack mergers, the weights have the released names SGLang's loader maps (language model
    under ``model.language_model``, q_proj with its output gate, split GDN projections, per-expert
    MLPs), and SGLang's ModelConfig reads it as a multimodal, M-RoPE hybrid: layer 0 GDN, layer 1
    full attention with 2 kv heads x 64."""
    from safetensors.torch import load_file
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_oscar.rotation.geometry import ModelGeometry

    path, info = tiny_family("qwen3_5")
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    text, vision = saved["text_config"], saved["vision_config"]
    assert saved["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and saved["model_type"] == "qwen3_5_moe"
    assert (text["model_type"], text["full_attention_interval"], text["layer_types"]) == \
        ("qwen3_5_moe_text", 2, ["linear_attention", "full_attention"])
    assert text["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                       "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    assert (vision["depth"], vision["num_heads"], vision["deepstack_visual_indexes"]) == (1, 2, [])
    assert [saved[k] for k in TOKEN_KEYS] == [256, 257, 258, 259] and text["vocab_size"] == 256
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    assert info["sharpen"]["score_std"] == pytest.approx(1.5, rel=0.35)
    assert info["vision_config"] == {"depth": 1, "hidden_size": 32, "num_heads": 2}

    w = load_file(os.path.join(path, "model.safetensors"))
    lm = "model.language_model.layers."
    assert w[lm + "1.self_attn.q_proj.weight"].shape == (4 * 64 * 2, 64)  # per head: q, then its gate
    assert {lm + f"0.linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")} <= set(w)
    assert {lm + f"{i}.mlp.experts.{e}.{p}.weight" for i in (0, 1) for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")} <= set(w)
    assert {"lm_head.weight", "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.linear_fc2.weight"} <= set(w)
    assert not any("deepstack" in k or "blocks.1." in k for k in w)

    mc = ModelConfig(path)
    h = mc.hf_text_config
    assert type(mc.hf_config).__name__ == "Qwen3_5MoeConfig" and mc.is_multimodal and mc.model_is_mrope
    assert (h.full_attention_layer_ids, h.linear_layer_ids, mc.head_dim, mc.get_num_kv_heads(1)) == ([1], [0], 64, 2)
    assert (h.rope_scaling["mrope_section"], h.partial_rotary_factor, h.rope_parameters["rope_theta"]) == \
        ([4, 2, 2], 0.25, 10000.0)
    assert mc.hf_config.vision_config.deepstack_visual_indexes == []  # SGLang's default would be [8, 16, 24]
    assert not mc.is_hybrid_swa and not mc.has_attention_sinks
    geo = ModelGeometry.from_hf_config(path)
    assert [(l.layer_id, l.num_kv_heads, l.head_dim_k) for l in geo.layers] == [(1, 2, 64)]
    assert geo.linear_layer_ids == (0,)


def test_qwen3_5_folder_has_the_processor_sglang_loads(tiny_family):
    """SGLang loads a processor for a multimodal model even with --skip-tokenizer-init: the tokenizer
    manager's ``get_processor`` (AutoProcessor) and the Qwen-VL multimodal processor it picks for the
    architecture accept the folder offline, the vision tokens at the config's ids."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.utils.hf_transformers.processor import get_processor

    path, _ = tiny_family("qwen3_5")
    mc = ModelConfig(path)
    proc = get_processor(path, use_fast=True, model_name=path)  # tokenizer_manager._get_processor_wrapper's call
    assert type(proc).__name__ == "Qwen3VLProcessor"
    got = (proc.vision_start_token_id, proc.vision_end_token_id, proc.image_token_id, proc.video_token_id)
    assert got == tuple(getattr(mc.hf_config, k) for k in TOKEN_KEYS)
    import_processors("sglang.srt.multimodal.processors")
    args = SimpleNamespace(model_impl="auto", keep_mm_feature_on_device=False, mm_feature_transport="cpu",
                           disable_fast_image_processor=False, skip_tokenizer_init=True, mm_process_config={})
    mm = get_mm_processor(mc.hf_config, args, proc, "default", model_config=mc)
    try:
        assert type(mm).__name__ == "QwenVLImageProcessor"
        assert (mm.mm_tokens.image_token, mm.mm_tokens.video_token) == \
            ("<|vision_start|><|image_pad|><|vision_end|>", "<|video_pad|>")
    finally:
        mm.io_executor.shutdown()
        mm.cpu_executor.shutdown()


def test_qwen3_5_text_positions_make_mrope_1d_rope(monkeypatch):
    """A text-only request gives M-RoPE's T/H/W sections one position (SGLang's
    ``_compute_mrope_positions``: ``[p, p, p]``; transformers expands 1-D position ids to three equal
    rows): SGLang's interleaved MRotaryEmbedding then equals its 1-D RotaryEmbedding bit for bit and
    transformers' M-RoPE to fp32 rounding; positions that differ per section would not."""
    import sglang.srt.layers.rotary_embedding.base as rope_base
    import sglang.srt.layers.rotary_embedding.mrope as mrope
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding, apply_rotary_pos_emb

    for mod in (rope_base, mrope):
        monkeypatch.setattr(mod, "get_server_args", lambda: SimpleNamespace(rl_on_policy_target=None))
    monkeypatch.setattr(rope_base, "_is_cpu", True)  # else the constructor looks for a CUDA/vLLM fallback kernel
    tc = families.model_config("qwen3_5", **TINY_FAMILY["qwen3_5"]).get_text_config()
    rp = tc.rope_parameters
    d, rot, heads, kv, t = tc.head_dim, int(tc.head_dim * rp["partial_rotary_factor"]), 4, 2, 37
    m = mrope.MRotaryEmbedding(d, rot, 512, rp["rope_theta"], True, torch.float32, mrope_section=rp["mrope_section"],
                               mrope_interleaved=rp["mrope_interleaved"])
    plain = rope_base.RotaryEmbedding(d, rot, 512, rp["rope_theta"], True, torch.float32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(t, heads * d, generator=gen), torch.randn(t, kv * d, generator=gen)
    pos = torch.arange(t)
    q3, k3 = m.forward_native(pos[None].repeat(3, 1), q.clone(), k.clone())
    q1, k1 = plain.forward_native(pos, q.clone(), k.clone())
    assert torch.equal(q3, q1) and torch.equal(k3, k1) and not torch.equal(q1, q)
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(tc)(q, pos[None])
    qh, kh = apply_rotary_pos_emb(q.view(1, t, heads, d).transpose(1, 2), k.view(1, t, kv, d).transpose(1, 2), cos, sin)
    assert torch.allclose(qh[0].transpose(0, 1).reshape(t, -1), q1, atol=1e-5)
    assert torch.allclose(kh[0].transpose(0, 1).reshape(t, -1), k1, atol=1e-5)
    qd, _ = m.forward_native(torch.stack([pos, 2 * pos, 3 * pos]), q.clone(), k.clone())
    assert (qd - q1).abs().max() > 0.1


def test_qwen3_5_oracle_reaches_the_language_model_in_the_wrapper(tiny_family):
    """``load_hf`` gives the wrapper's language model (transformers maps ``qwen3_5_moe`` to
    Qwen3_5MoeForCausalLM) with the wrapper's logits; on the wrapper itself the capture sees its one
    full-attention layer (the GDN layer runs as transformers computes it), and the oracle with
    covering windows equals the wrapper, quantizing windows move it."""
    from sglang_oscar.calibrate.capture import attention_override
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    path, _ = tiny_family("qwen3_5")
    wrapper = families.causal_lm_class("qwen3_5").from_pretrained(path, dtype=torch.float32).eval()
    lm = checkpoints.load_hf(path, "cpu", torch.float32, fp32_head=False)
    assert type(wrapper).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert type(lm).__name__ == "Qwen3_5MoeForCausalLM"
    seq = checkpoints.random_prompt(48, 7, vocab=256)
    ids = torch.tensor([seq])
    with torch.no_grad():
        assert torch.equal(wrapper(input_ids=ids, use_cache=False).logits, lm(input_ids=ids, use_cache=False).logits)
    seen = []
    with torch.no_grad(), attention_override(wrapper, lambda call: seen.append(call.layer_id)):
        wrapper(input_ids=ids, use_cache=False)
    assert seen == [1]
    ident = RotationSet.data_free(geometry_of(wrapper.config), "identity")
    plain = oracle.teacher_forced_logprobs(wrapper, [seq])[0]
    full = oracle.teacher_forced_logprobs(wrapper, [seq], rotation=ident, config=OscarConfig(sink_tokens=len(seq)),
                                          hp_dtype=torch.float32)[0]
    quant = oracle.teacher_forced_logprobs(wrapper, [seq], rotation=ident,
                                           config=OscarConfig(sink_tokens=4, recent_tokens=8))[0]
    same, q = client.abs_diff_stats(plain, full), client.abs_diff_stats(plain, quant)
    assert len(plain) == 47 and same["max"] < 1e-5  # fp32 windows: nothing quantized, the same attention
    assert q["mean"] > 1e-2
