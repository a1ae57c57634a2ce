"""Helpers of the serving-harness tests: load ``scripts/gpu_e2e.py`` as a module; CPU-sized model config."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# CPU-sized versions of the harness models (same families, head_dim a multiple of 4, GQA 4/2).
TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512)


def load_harness():
    """The harness module (scripts/ is not a package), imported once."""
    if "gpu_e2e" in sys.modules:
        return sys.modules["gpu_e2e"]
    path = os.path.join(ROOT, "scripts", "gpu_e2e.py")
    spec = importlib.util.spec_from_file_location("gpu_e2e", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_e2e"] = mod
    spec.loader.exec_module(mod)
    return mod
