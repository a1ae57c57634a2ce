"""sglang-oscar: 2-bit (INT2) KV cache for SGLang with OSCAR rotations."""

__version__ = "0.1.0"
