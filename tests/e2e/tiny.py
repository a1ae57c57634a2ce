"""CPU-sized versions of the harness models for the CPU tests (same families, head_dim a multiple
of 4, GQA 4/2): ``checkpoints.build_checkpoint(name, path, **TINY)``."""

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512)

# The sliding-window families (gemma3, gemma4) at CPU size: window 16, so 96-token sequences cross it;
# 2 layers: one sliding, one full (gemma4: its full layer 1 kv head x head_dim 64, K shared as V).
TINY_SWA = dict(TINY, sliding_window=16)
