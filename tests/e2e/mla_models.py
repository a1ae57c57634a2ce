"""The tiny models of the MLA device check (:mod:`.mla_check`): a seeded, sharpened DeepSeek-V3 and
GLM-5 built by transformers, and the configs of Kimi-Linear and MiniMax-M3 that SGLang serves with
dummy weights (transformers has no model class of theirs that SGLang's code loads)."""

from __future__ import annotations

import json
import os

from .checkpoints import sharpen

VOCAB = 2048
LOGIT_STD, SCORE_STD = 0.5, 1.5  # checkpoints.sharpen, as the main harness's checkpoints


def build_model(path: str) -> dict:
    """Save a seeded random bf16 DeepseekV3ForCausalLM with DeepSeek-V3's latent geometry to ``path``,
    sharpened as the harness's checkpoints (:func:`.checkpoints.sharpen`: logit std 0.5, attention
    score std 1.5), so the INT2 effect on log-probs is of the size the MHA families show."""
    from transformers import DeepseekV3ForCausalLM

    return _save_sharpened(DeepseekV3ForCausalLM, deepseek_v3_config(), path, ("qk_nope_head_dim", "v_head_dim"))


def deepseek_v3_config():
    """The tiny DeepSeek-V3 config of :func:`build_model` (DeepSeek-V3's latent geometry, 4 layers)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=512,
                            q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                            first_k_dense_replace=4, max_position_embeddings=8192, tie_word_embeddings=False,
                            initializer_range=0.08, rope_scaling=None, architectures=["DeepseekV3ForCausalLM"],
                            bos_token_id=1, eos_token_id=2)


def _save_sharpened(model_cls, cfg, path: str, keys: tuple) -> dict:
    """Seed, build, sharpen and save a model of ``cfg`` in bf16; its geometry (and ``keys``) for the report.
    Sets the fields SGLang 0.5.16's deepseek_v2.py reads that transformers' configs do not keep
    (saved to config.json, as released DeepSeek-V3 / GLM-5 checkpoints carry them)."""
    import torch

    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("rope_theta", 10000.0),
                       ("moe_layer_freq", 1), ("num_nextn_predict_layers", 0)):
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    stats = sharpen(model, LOGIT_STD, SCORE_STD, seed=0)
    model.to(torch.bfloat16).save_pretrained(path)
    return {**{k: getattr(cfg, k) for k in ("num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                                            "qk_rope_head_dim", *keys)}, "sharpen": stats}


def build_kimi_linear(path: str) -> dict:
    """Save the config of a tiny Kimi-Linear (module docstring) to ``path``; its servers load dummy weights."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    cfg = KimiLinearConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True,
                           num_experts=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                           max_position_embeddings=8192,  # the default 2048 refuses the load's longest prompts
                           # KDA's value heads take v_head_dim: its head_dim must match it (Kimi-Linear: 128)
                           linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 8,
                                               "head_dim": 128, "short_conv_kernel_size": 4},
                           architectures=["KimiLinearForCausalLM"], dtype="bfloat16")
    cfg.save_pretrained(path)  # dtype: without it SGLang serves fp16, and its KDA conv kernel wants bf16 state
    return {"num_hidden_layers": 4, "mla_layers": [1, 3], "kda_layers": [0, 2], "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "weights": "dummy"}


GLM5_TOPK = 256  # the indexer's top-k of the glm5 family: every prompt is longer, so the selection bites
# glm5_dense: GLM-5's own top-k, above every prompt, so the indexer keeps every position and a chunk
# boundary cannot change the selection (SGLang's sparse path moves with chunking on glm5 by itself)
GLM5_DENSE_TOPK = 2048


def build_glm5(path: str, topk: int = GLM5_TOPK) -> dict:
    """Save a seeded random bf16 GlmMoeDsaForCausalLM (GLM-5: DSA sparse attention) with DeepSeek-V3's
    latent geometry and a lightning indexer (``index_head_dim`` 128, 32 heads, ``index_topk`` ``topk``,
    served with SGLang's torch top-k, the one that takes a top-k other than 2048) to ``path``, sharpened
    as :func:`build_model`."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg = GlmMoeDsaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=512,
                          q_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                          n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                          first_k_dense_replace=4, max_position_embeddings=8192, tie_word_embeddings=False,
                          index_topk=topk, index_head_dim=128, index_n_heads=32,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          architectures=["GlmMoeDsaForCausalLM"], bos_token_id=1, eos_token_id=2)
    return _save_sharpened(GlmMoeDsaForCausalLM, cfg, path, ("index_topk", "index_head_dim"))


# minimax_m3: 8 blocks of 16 keys per kv head (128 of 400-1500 positions) so the selection bites;
# minimax_m3_dense: 32 blocks of 64 (2048 keys, above every prompt and its answer), so every block
# is selected and a chunk boundary or a cached prefix cannot change the selection
M3_SPARSE, M3_DENSE = (16, 8), (64, 32)  # (sparse_block_size, sparse_topk_blocks)


def build_minimax_m3(path: str, block_topk: tuple[int, int] = M3_SPARSE) -> dict:
    """Save the ``config.json`` of a tiny MiniMax-M3 in SGLang's format to ``path`` (its servers load
    dummy weights: transformers' MiniMax-M3 names and selection differ from SGLang's). Layers 1 and 3
    are sparse (layer 3 without an index value), 0 and 2 dense; GQA 8/2 x 128 with RoPE on 64 dims and
    per-head Gemma q/k norms as MiniMax; 4 index heads of 128 (two per kv head, so SGLang unions their
    block lists); dense MLPs (``moe_layer_freq`` 0: see :mod:`.mla_check`'s docstring on MoE tiles). AutoConfig
    reads it as ``MiniMaxM2Config`` and keeps ``sparse_attention_config``, which SGLang's
    ``is_minimax_sparse`` / ``get_minimax_sparse_layer_ids`` read (``srt/configs/model_config.py:136-162``)."""
    block, topk = block_topk
    sparse = {"sparse_attention_freq": [0, 1, 0, 1], "sparse_num_index_heads": 4, "sparse_index_dim": 128,
              "sparse_block_size": block, "sparse_topk_blocks": topk, "sparse_init_block": 1, "sparse_local_block": 2,
              "sparse_disable_index_value": [0, 0, 0, 1], "sparse_score_type": "max"}
    cfg = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m2", "vocab_size": VOCAB,
           "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 128, "rotary_dim": 64, "qk_norm_type": "per_head", "use_gemma_norm": True, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "rope_theta": 10000.0, "intermediate_size": 256,
           "dense_intermediate_size": 1024, "moe_layer_freq": [0, 0, 0, 0], "num_local_experts": 4,
           "num_experts_per_tok": 2, "scoring_func": "sigmoid", "n_shared_experts": None, "swiglu_alpha": 1.702,
           "swiglu_limit": 7.0, "num_mtp_modules": 0, "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "bfloat16", "sparse_attention_config": sparse}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return {"num_hidden_layers": 4, "dense_layers": [0, 2], "sparse_layers": [1, 3], "block_size": block,
            "topk_blocks": topk, "weights": "dummy"}
