"""CPU-sized versions of the harness models for the CPU tests (same families, head_dim a multiple
of 4, GQA 4/2): ``checkpoints.build_checkpoint(name, path, **TINY)``."""

TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512)
