"""The model families of the device checks: ``transformers`` configs of the tiny checkpoints and
what the servers of a sliding-window family need.

``qwen3``, ``moe``, ``llama``, ``long``: head_dim 128, GQA (``long``: attention-heavy, check g).
``gemma3`` (Gemma3ForCausalLM: SGLang 0.5.16 serves it from one pool whose layers mix sliding and
full attention), ``gemma4`` (Gemma4ForCausalLM: SGLang's hybrid SWA memory, its sliding layers
with their own kv heads / head_dim, full layers with K shared as V) and ``gpt_oss``
(GptOssForCausalLM: hybrid SWA memory, sliding and full layers of one geometry, learned
attention-sink logits, MoE) have a sliding window of :data:`~.config.SWA_WINDOW` keys, small
enough that the test prompts cross it. ``qwen3_next`` (Qwen3NextForCausalLM) is a
linear-attention hybrid: Gated-DeltaNet layers (SGLang's mamba pool, not quantized) and
full-attention layers (the INT2 KV pool). ``qwen3_5`` is the same hybrid saved as Qwen3.5's
multimodal wrapper (Qwen3_5MoeForConditionalGeneration, a one-block vision tower), the only form
SGLang 0.5.16 serves Qwen3.5 in (``srt/models/qwen3_5.py``).
"""

from __future__ import annotations

import argparse
import json

from .config import GEMMA_FAMILIES, LINEAR_FAMILIES, MODEL_FAMILIES, SWA_WINDOW, VOCAB

# Every ``period``-th layer (and the last one) is full attention, the others slide.
_FULL_PERIOD = {"gemma3": 4, "gemma4": 3, "gpt_oss": 2}
# qwen3_next: layer i is full attention iff (i + 1) % interval == 0, else Gated-DeltaNet. SGLang
# 0.5.16 reads only ``full_attention_interval`` (``srt/configs/qwen3_next.py:264``, default none:
# AttributeError), which transformers 5.12 consumes into ``layer_types`` and does not save, so
# :func:`model_config` sets it on the config again (saved to config.json).
QWEN3_NEXT_INTERVAL = 2
# qwen3_5's vision tower: one block, 2 heads (SGLang shards them over check h's TP 2) x 16, no deepstack
# mergers (transformers' Qwen3.5 tower has none; SGLang's Qwen3VLVisionConfig would default to three).
# Text-only requests never run it; SGLang builds and loads it.
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, num_position_embeddings=16,
                      patch_size=16, temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[])
# Qwen3.5's vision tokens, given the ids vocab_size + i: outside the model's vocabulary, so no random
# prompt holds one; the processor's tokenizer (checkpoints.write_processor) has them at the same ids.
QWEN3_5_VISION_TOKENS = (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                         ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))


def layer_types(name: str, n_layers: int) -> list[str]:
    """``layer_types`` of a sliding-window family: layer ``i`` is full iff ``(i + 1) % period == 0``
    or it is the last layer (gemma3 4 layers: S S S F; gemma4 6 layers: S S F S S F; gpt_oss 4
    layers: S F S F, as GptOssConfig's default)."""
    p = _FULL_PERIOD[name]
    return ["full_attention" if (i + 1) % p == 0 or i == n_layers - 1 else "sliding_attention" for i in range(n_layers)]


def model_config(name: str, args: argparse.Namespace | None = None, **over):
    """``transformers`` config of one tiny model: ``qwen3`` (GQA 8/2), ``moe`` (Qwen3-MoE, 8 experts,
    top-2), ``llama`` (GQA 8/2), ``long`` (Qwen3, many kv heads, 40K positions: attention dominates
    its decode step at 32K), ``gemma3`` (4 layers, 3 sliding + 1 full, GQA 8/2), ``gemma4`` (6
    layers, 4 sliding with 2 kv heads x 128 + 2 full with 1 kv head x ``global_head_dim`` 256 and
    K shared as V, no per-layer input embeddings, no KV-shared layers), ``gpt_oss`` (4 layers S F S
    F, GQA 8/2 x head_dim 64, 4 experts top-2, attention biases, YaRN RoPE as GPT-OSS), ``qwen3_next``
    (4 layers: Gated-DeltaNet, full, GDN, full; GQA 8/2 x 128 with output gate, 2/4 linear heads x
    128, 8 experts top-2 plus a shared expert), ``qwen3_5`` (qwen3_next's text geometry with
    interleaved M-RoPE, in Qwen3.5's multimodal wrapper), ``minimax_m2`` (GQA 8/2 x 128, RoPE on 64 of 128
    dims, q/k RMSNorm across heads, 8 experts top-2, sigmoid routing). head_dim 128 (sliding layers; gpt_oss 64), bf16,
    tied embeddings for the Gemma families (SGLang's Gemma3ForCausalLM reads no ``lm_head``).
    ``over`` overrides config fields (tests use it to shrink the models)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=16384,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if name == "long":
        a = args or argparse.Namespace(long_layers=8, long_heads=128, long_kv_heads=32, long_hidden=256)
        common.update(num_hidden_layers=a.long_layers, num_attention_heads=a.long_heads,
                      num_key_value_heads=a.long_kv_heads, hidden_size=a.long_hidden, intermediate_size=256,
                      max_position_embeddings=40960)
    if name in GEMMA_FAMILIES:
        return _swa_config(name, {**common, "num_hidden_layers": 6 if name == "gemma4" else 4,
                                  "tie_word_embeddings": True, **over})
    if name == "gpt_oss":
        return _gpt_oss_config({**common, "head_dim": 64, **over})
    if name == "qwen3_next":
        return _qwen3_next_config({**common, **over})
    if name == "qwen3_5":
        return _qwen3_5_config({**common, **over})
    if name == "minimax_m2":
        return _minimax_m2_config({**common, **over})
    common.update(over)
    rope = common.pop("rope_theta")
    if name in ("qwen3", "long"):
        cfg = tf.Qwen3Config(**common)
    elif name == "moe":
        cfg = tf.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                                decoder_sparse_step=1, norm_topk_prob=True)
    elif name == "llama":
        cfg = tf.LlamaConfig(**common, attention_bias=False)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODEL_FAMILIES)}")
    # transformers 5 keeps RoPE settings in rope_parameters; older versions in rope_theta
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {**(cfg.rope_parameters or {}), "rope_type": "default", "rope_theta": rope}
    else:
        cfg.rope_theta = rope
    return cfg


def _swa_config(name: str, kw: dict):
    """Gemma3TextConfig / Gemma4TextConfig from the common fields (RoPE per layer type: the
    transformers defaults, sliding theta 10K; Gemma-4 full layers proportional RoPE, 1/4 rotary)."""
    import transformers as tf

    kw.pop("rope_theta")
    kw.setdefault("sliding_window", SWA_WINDOW)
    kw.setdefault("layer_types", layer_types(name, kw["num_hidden_layers"]))
    kw.setdefault("final_logit_softcapping", None)
    if name == "gemma3":
        kw.setdefault("query_pre_attn_scalar", kw["head_dim"])  # softmax scale 1/sqrt(head_dim)
        kw.setdefault("attn_logit_softcapping", None)
        return tf.Gemma3TextConfig(**kw)
    kw.setdefault("global_head_dim", 2 * kw["head_dim"])
    kw.setdefault("num_global_key_value_heads", 1)
    kw.setdefault("attention_k_eq_v", True)
    kw.setdefault("hidden_size_per_layer_input", 0)  # no per-layer input embeddings
    kw.setdefault("vocab_size_per_layer_input", kw["vocab_size"])
    kw.setdefault("num_kv_shared_layers", 0)
    return tf.Gemma4TextConfig(**kw)


def _gpt_oss_config(kw: dict):
    """GptOssConfig from the common fields: head_dim 64 (GPT-OSS's; the INT2 kernels take 64..512),
    MoE with ``intermediate_size`` per expert, YaRN RoPE with GPT-OSS's parameters but a factor
    that matches ``max_position_embeddings`` (theta 150K, original 4096 positions), and
    ``swiglu_limit`` 7.0 written to config.json: transformers hard-codes the clamp
    (``GptOssExperts.limit``) and its config has no such field, while SGLang 0.5.16 reads
    ``config.swiglu_limit`` (``srt/models/gpt_oss.py:205``, AttributeError without it)."""
    import transformers as tf

    kw = dict(kw)
    kw.pop("rope_theta")
    kw.setdefault("sliding_window", SWA_WINDOW)
    kw.setdefault("layer_types", layer_types("gpt_oss", kw["num_hidden_layers"]))
    kw.setdefault("num_local_experts", 4)
    kw.setdefault("num_experts_per_tok", 2)
    kw.setdefault("attention_bias", True)
    orig = 4096 if kw["max_position_embeddings"] >= 4096 else kw["max_position_embeddings"]
    kw.setdefault("rope_parameters", {"rope_type": "yarn", "rope_theta": 150000.0, "factor":
                                      max(1.0, kw["max_position_embeddings"] / orig), "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": orig})
    kw.setdefault("swiglu_limit", 7.0)
    return tf.GptOssConfig(**kw)


def _qwen3_next_config(kw: dict):
    """Qwen3NextConfig from the common fields: full attention every :data:`QWEN3_NEXT_INTERVAL`-th
    layer (``full_attention_interval`` kept on the config, see there), the others Gated-DeltaNet
    (2 key / 4 value heads x 128, conv kernel 4), 8 experts top-2 of ``moe_intermediate_size`` 128
    plus a shared expert, partial RoPE (1/4 of head_dim), theta 10K (SGLang's Qwen3NextConfig
    reads ``rope_theta``, default 10K, not ``rope_parameters``)."""
    import transformers as tf

    kw, theta, interval = _hybrid_text(kw)
    kw.setdefault("decoder_sparse_step", 1)
    kw.setdefault("norm_topk_prob", True)
    cfg = tf.Qwen3NextConfig(**kw)
    cfg.rope_parameters = {**(cfg.rope_parameters or {}), "rope_type": "default", "rope_theta": theta}
    cfg.rope_theta = theta
    cfg.full_attention_interval = interval
    return cfg


def _hybrid_text(kw: dict) -> tuple[dict, float, int]:
    """The text fields the linear hybrids share (:func:`_qwen3_next_config`, :func:`_qwen3_5_config`):
    ``layer_types`` from the interval, Gated-DeltaNet 2 key / 4 value heads x 128 (conv kernel 4), 8
    experts top-2 of 128 plus a shared expert of 128; returns them with the RoPE theta and the interval."""
    kw = dict(kw)
    theta = kw.pop("rope_theta")
    interval = kw.pop("full_attention_interval", QWEN3_NEXT_INTERVAL)
    n = kw["num_hidden_layers"]
    kw.setdefault("layer_types", ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)])
    for key, value in (("linear_key_head_dim", 128), ("linear_value_head_dim", 128), ("linear_num_key_heads", 2),
                       ("linear_num_value_heads", 4), ("linear_conv_kernel_dim", 4), ("num_experts", 8),
                       ("num_experts_per_tok", 2), ("moe_intermediate_size", 128),
                       ("shared_expert_intermediate_size", 128)):
        kw.setdefault(key, value)
    return kw, theta, interval


def _qwen3_5_config(kw: dict):
    """Qwen3_5MoeConfig, the multimodal wrapper SGLang 0.5.16 serves Qwen3.5 through (``srt/models/
    qwen3_5.py`` EntryClass), around a ``qwen3_5_moe_text`` config of :func:`_qwen3_next_config`'s
    geometry. RoPE as Qwen3.5's: partial (1/4 of head_dim), interleaved M-RoPE over the T/H/W sections
    (near-equal thirds of the rotary pairs, as Qwen3.5's 11/11/10 of 32; 6/5/5 of 16 here); a
    text-only request gives the three sections the same position, which is 1-D RoPE in both SGLang
    and transformers. The text config
    keeps ``full_attention_interval`` (SGLang's ``Qwen3NextConfig.layers_block_type`` reads it, no
    default; transformers consumes it into ``layer_types``). Vision tower: :data:`QWEN3_5_VISION`;
    vision token ids: :data:`QWEN3_5_VISION_TOKENS`."""
    import transformers as tf

    text, theta, interval = _hybrid_text(kw)
    pairs = int(text["head_dim"] * 0.25) // 2
    hw = pairs * 11 // 32
    text.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.25,
                                        "mrope_section": [pairs - 2 * hw, hw, hw], "mrope_interleaved": True})
    text["full_attention_interval"] = interval
    vision = {**QWEN3_5_VISION, "out_hidden_size": text["hidden_size"]}
    tokens = {key: text["vocab_size"] + i for i, (key, _) in enumerate(QWEN3_5_VISION_TOKENS)}
    return tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                               **tokens)


def _minimax_m2_config(kw: dict):
    """MiniMaxM2Config from the common fields: partial RoPE on the first half of head_dim (MiniMax-M2:
    64 of 128), RMSNorm of q and k across all heads (``q_norm`` over ``H_q x head_dim``), 8 experts
    top-2 (each of ``intermediate_size``, MiniMax's per-expert width) with sigmoid routing and a
    score-correction bias. Five fields
    SGLang 0.5.16 reads and transformers' config lacks are set on it (saved to config.json, as the
    released checkpoints carry them): ``rotary_dim`` (``srt/models/minimax_m2.py:755``, default the
    full head_dim), ``use_qk_norm`` (``:760``, default False: no norms), ``qk_norm_type``
    ``per_layer``, ``scoring_func`` ``sigmoid`` (``:527``, required) and ``use_routing_bias``
    (``:503``, default False: the bias would not load)."""
    import transformers as tf

    kw = dict(kw)
    theta = kw.pop("rope_theta")
    kw.setdefault("num_local_experts", 8)
    kw.setdefault("num_experts_per_tok", 2)
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5})
    rotary = int(kw["head_dim"] * kw["rope_parameters"].get("partial_rotary_factor", 1.0))
    for key, value in (("rotary_dim", rotary), ("use_qk_norm", True), ("qk_norm_type", "per_layer"),
                       ("scoring_func", "sigmoid"), ("use_routing_bias", True)):
        kw.setdefault(key, value)
    return tf.MiniMaxM2Config(**kw)


def causal_lm_class(name: str):
    import transformers as tf

    return {"qwen3": tf.Qwen3ForCausalLM, "long": tf.Qwen3ForCausalLM, "moe": tf.Qwen3MoeForCausalLM,
            "llama": tf.LlamaForCausalLM, "gemma3": tf.Gemma3ForCausalLM, "gemma4": tf.Gemma4ForCausalLM,
            "gpt_oss": tf.GptOssForCausalLM, "qwen3_next": tf.Qwen3NextForCausalLM,
            "qwen3_5": tf.Qwen3_5MoeForConditionalGeneration, "minimax_m2": tf.MiniMaxM2ForCausalLM}[name]


# Recurrent-state slots per running request of a linear-attention server that shares the GPU:
# SGLang needs max_running x (3 + up to 2 ping-pong) slots (kv_cache_configurator.py:101-104).
STATE_SLOTS_PER_REQUEST = 8


def sglang_override_args(name: str, *, max_running: int | None = None) -> list[str]:
    """Extra server flags a family needs. ``gemma4``: ``--json-model-override-args`` with the
    remap SGLang 0.5.16 applies to Gemma-4 *multimodal* configs only (``model_type`` ``gemma4``,
    ``srt/utils/hf_transformers/config.py:159-185``: base keys = full layers, ``swa_*`` = sliding);
    a transformers-saved Gemma4ForCausalLM (``gemma4_text``) is not remapped, so SGLang would build
    its full layers with the sliding head_dim and kv heads (and fail to load ``q_proj``).
    ``qwen3_next`` / ``qwen3_5`` with ``max_running`` (a server started beside others on one GPU):
    ``--max-mamba-cache-size`` of :data:`STATE_SLOTS_PER_REQUEST` per request. Without it SGLang
    gives the state pool a share of all memory free when it profiles, which servers starting at
    the same time take from each other ("Not enough GPU memory for hybrid ... state cache")."""
    if name in LINEAR_FAMILIES and max_running:
        return ["--max-mamba-cache-size", str(STATE_SLOTS_PER_REQUEST * max_running)]
    if name != "gemma4":
        return []
    return ["--json-model-override-args", json.dumps(sglang_override_for(name, model_config(name)),
                                                      separators=(",", ":"))]


def sizing_group_size(name: str) -> int:
    """``--kv-cache-quant-group-size`` of check f's sizing servers: 128, or the family's smallest
    head_dim when that is smaller (gpt_oss: 64), since a group never spans two rows."""
    cfg = model_config(name).get_text_config()
    dims = [cfg.head_dim] + ([cfg.global_head_dim] if getattr(cfg, "global_head_dim", None) else [])
    return min([128] + dims)


def sglang_override_for(name: str, cfg) -> dict:
    """The remap of :func:`sglang_override_args` for a given (possibly shrunk) gemma4 config
    (:func:`sglang_oscar.plugin.refusals.gemma4_head_remap`, which the launch check names too)."""
    from sglang_oscar.plugin.refusals import gemma4_head_remap

    return gemma4_head_remap(cfg.to_dict()) if name == "gemma4" else {}
