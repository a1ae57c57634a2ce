"""CPU-sized versions of the harness models for the CPU tests (same families, head_dim a multiple
of 4, GQA 4/2): ``checkpoints.build_checkpoint(name, path, **TINY)``."""

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512)

# The sliding-window families (gemma3, gemma4) at CPU size: window 16, so 96-token sequences cross it;
# 2 layers: one sliding, one full (gemma4: its full layer 1 kv head x head_dim 64, K shared as V).
TINY_SWA = dict(TINY, sliding_window=16)

# gpt_oss at CPU size: TINY_SWA (2 layers: sliding, full; sinks); qwen3_next and qwen3_5 (its vision
# tower as served, families.QWEN3_5_VISION): 2 layers (Gated-DeltaNet, full attention), small linear
# heads, 4 experts. head_dim 64, the smallest the launch preflight accepts (the tests run it on their
# rotation files).
TINY_LINEAR = dict(TINY, head_dim=64, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=2, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)
TINY_FAMILY = {"gpt_oss": dict(TINY_SWA, head_dim=64, num_local_experts=4), "qwen3_next": TINY_LINEAR,
               "qwen3_5": TINY_LINEAR,
               "minimax_m2": dict(TINY, head_dim=64, num_local_experts=4)}  # RoPE on 32 of 64 dims
