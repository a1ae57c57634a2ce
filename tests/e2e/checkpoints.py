"""Tiny seeded checkpoints of the device checks and their rotation files.

Four ``transformers`` families (:data:`~.config.MODEL_FAMILIES`), head_dim 128, randomly
initialised from a seed, then *sharpened* (:func:`sharpen`) so that attention and logits react
to KV-cache errors, saved as bf16 safetensors. Rotation files come from the package's own
calibrate / fit path on seeded random token sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from .config import MODEL_FAMILIES, VOCAB


def model_config(name: str, args: argparse.Namespace | None = None, **over):
    """``transformers`` config of one tiny model: ``qwen3`` (GQA 8/2), ``moe`` (Qwen3-MoE, 8 experts,
    top-2), ``llama`` (GQA 8/2), ``long`` (Qwen3, many kv heads, 40K positions: attention dominates
    its decode step at 32K). head_dim 128, bf16. ``over`` overrides config fields (tests use it to
    shrink the models)."""
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


def _rows_std(t) -> float:
    return float(t.float().std())


def sharpen(model, logit_std: float, score_std: float, seed: int) -> dict[str, float]:
    """Make a random model's outputs less uniform, in place: scale the lm_head so logits have std
    ``logit_std`` and the q/k path so pre-softmax attention scores have std ~``score_std`` (random
    initialisations give near-uniform attention, which would hide KV-quantization effects).
    Measured on a seeded random prompt; returns the measured stds after scaling."""
    import torch

    from sglang_oscar.calibrate.capture import attention_override

    gen = torch.Generator().manual_seed(seed + 17)
    ids = torch.randint(3, model.config.vocab_size, (1, 256), generator=gen).to(next(model.parameters()).device)
    scores: list[float] = []

    def observe(call):
        q, k = call.query.float(), call.key.float()
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(g, dim=1)) * call.scaling
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        scores.append(float(s[..., mask].std()))
        return None

    def measure():
        scores.clear()
        with torch.no_grad(), attention_override(model, observe):
            logits = model(input_ids=ids, use_cache=False).logits
        return sum(scores) / len(scores), _rows_std(logits)

    with torch.no_grad():
        s0, _ = measure()
        gain = max(score_std / max(s0, 1e-6), 1e-3)
        for name, mod in model.named_modules():
            if name.endswith("self_attn"):
                if getattr(mod, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm weights scale q and k
                    mod.q_norm.weight.mul_(math.sqrt(gain))
                    mod.k_norm.weight.mul_(math.sqrt(gain))
                else:
                    mod.q_proj.weight.mul_(math.sqrt(gain))
                    mod.k_proj.weight.mul_(math.sqrt(gain))
                    for proj in (mod.q_proj, mod.k_proj):
                        if getattr(proj, "bias", None) is not None:
                            proj.bias.mul_(math.sqrt(gain))
        _, l0 = measure()
        model.lm_head.weight.mul_(logit_std / max(l0, 1e-6))
        s1, l1 = measure()
    return {"score_std": s1, "logit_std": l1}


def build_checkpoint(name: str, path: str, *, seed: int = 0, args: argparse.Namespace | None = None,
                     logit_std: float = 0.5, score_std: float = 1.5, device: str = "cpu", **over) -> dict[str, Any]:
    """Build, sharpen (:func:`sharpen`) and ``save_pretrained`` (bf16 safetensors) one tiny seeded
    model into ``path``. Idempotent: an existing checkpoint with the same recipe is kept.

    Returns:
        ``{"path", "name", "config": {...sizes}, "sharpen": {...}, "reused": bool}``.
    """
    import torch
    import transformers as tf

    cfg = model_config(name, args, **over)
    recipe = {"name": name, "seed": seed, "logit_std": logit_std, "score_std": score_std,
              "config": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                      "num_key_value_heads", "head_dim", "vocab_size",
                                                      "max_position_embeddings", "intermediate_size")}}
    marker = os.path.join(path, "oscar_e2e.json")
    if os.path.exists(marker):
        with open(marker) as f:
            old = json.load(f)
        if {k: old.get(k) for k in recipe} == recipe:
            return {**old, "path": path, "reused": True}
    torch.manual_seed(seed)
    cls = {"qwen3": tf.Qwen3ForCausalLM, "long": tf.Qwen3ForCausalLM, "moe": tf.Qwen3MoeForCausalLM,
           "llama": tf.LlamaForCausalLM}[name]
    model = cls(cfg).to(device=device, dtype=torch.float32).eval()
    stats = sharpen(model, logit_std, score_std, seed)
    model = model.to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    info = {**recipe, "sharpen": stats}
    with open(marker, "w") as f:
        json.dump(info, f, indent=2)
    return {**info, "path": path, "reused": False}


class FP32Head:
    """``--enable-fp32-lm-head`` for a ``transformers`` model: logits = float32(hidden) @ float32(W)^T,
    as SGLang's ``LogitsProcessor`` computes them with that flag (BF16 logits tie at this scale)."""

    @staticmethod
    def install(model) -> None:
        import torch

        head = model.lm_head

        class _Head(torch.nn.Module):
            def __init__(self, weight):
                super().__init__()
                self.register_buffer("w32", weight.detach().float(), persistent=False)
                self.weight = weight  # what HF code that inspects lm_head.weight sees

            def forward(self, x):
                return x.float() @ self.w32.T

        model.lm_head = _Head(head.weight)


def load_hf(path: str, device: str, dtype=None, fp32_head: bool = True):
    """The saved checkpoint as a ``transformers`` model (eval, ``dtype`` default bf16), with float32
    logits (:class:`FP32Head`) unless ``fp32_head`` is False."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16).to(device).eval()
    if fp32_head:
        FP32Head.install(model)
    return model


def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """Seeded random token ids in ``[3, vocab)`` (0-2 are pad/bos/eos)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def calibrate_random(model, out_path: str, *, model_id: str, seqs: int = 8, seq_len: int = 1024, seed: int = 1):
    """Calibration statistics of ``model`` over seeded random token sequences (the package's own
    :func:`sglang_oscar.calibrate.run.calibrate_model`). Returns the statistics."""
    import hashlib

    from sglang_oscar.calibrate.prompts import PromptSet, sequence_hash
    from sglang_oscar.calibrate.run import calibrate_model

    sequences = [random_prompt(seq_len, seed * 1000 + i, model.config.vocab_size) for i in range(seqs)]
    h = hashlib.sha256()
    for s in sequences:
        h.update(json.dumps(s).encode())
    meta = {"source": f"random tokens (seed {seed})", "kind": "random", "sha256": h.hexdigest(),
            "tokens_sha256": h.hexdigest(), "budget": seqs * seq_len, "tokens": seqs * seq_len, "seed": seed,
            "seq_len": seq_len, "pack": False, "num_sequences": seqs, "num_documents": seqs,
            "documents_used": seqs, "sequence_sha256": [sequence_hash(s) for s in sequences]}
    return calibrate_model(model, PromptSet(sequences, meta), out_path, model_id=model_id, restart=True,
                           progress=False)


def make_rotation_files(model, model_path: str, out_dir: str, *, seed: int = 1, seqs: int = 8,
                        seq_len: int = 1024, min_tokens: int | None = None) -> dict[str, str]:
    """Rotation files for ``model`` (saved at ``model_path``):

    * ``layer``: fitted per layer (``sglang-oscar fit --method oscar``),
    * ``head``: fitted per kv head (``--method oscar-perhead``, format_version 2),
    * ``identity``: data-free identity (exactness checks),
    * ``mismatch``: a valid identity file for another geometry (one layer fewer, twice the kv heads).
    """
    from sglang_oscar.calibrate.fit import DEFAULT_MIN_TOKENS, fit_rotations
    from sglang_oscar.calibrate.model import config_fingerprint, geometry_of
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.geometry import ModelGeometry

    os.makedirs(out_dir, exist_ok=True)
    stats = calibrate_random(model, os.path.join(out_dir, "stats.safetensors"), model_id=model_path, seqs=seqs,
                             seq_len=seq_len, seed=seed)
    geometry = geometry_of(model.config)
    fp = config_fingerprint(model.config, model_path)
    out = {}
    for key, method in (("layer", "oscar"), ("head", "oscar-perhead")):
        rs = fit_rotations(stats, method, geometry=geometry, fingerprint=fp,
                           min_tokens=DEFAULT_MIN_TOKENS if min_tokens is None else min_tokens)
        out[key] = os.path.join(out_dir, f"rot_{key}.safetensors")
        rs.save(out[key])
    ident = RotationSet.data_free(geometry, "identity")
    out["identity"] = os.path.join(out_dir, "rot_identity.safetensors")
    ident.save(out["identity"])
    cfg = dict(model.config.to_dict())
    cfg["num_hidden_layers"] = max(1, cfg["num_hidden_layers"] - 1)
    cfg["num_key_value_heads"] = cfg["num_key_value_heads"] * 2
    cfg["num_attention_heads"] = max(cfg["num_attention_heads"], cfg["num_key_value_heads"])
    cfg.pop("layer_types", None)
    other = ModelGeometry.from_hf_config(cfg)
    import torch

    mism = RotationSet({l.layer_id: torch.eye(l.head_dim_k).repeat(l.num_kv_heads, 1, 1) for l in other.layers},
                       {l.layer_id: torch.eye(l.head_dim_v).repeat(l.num_kv_heads, 1, 1) for l in other.layers},
                       {"method": "identity", "model_type": other.model_type, "geometry": other.to_dict()})
    out["mismatch"] = os.path.join(out_dir, "rot_mismatch.safetensors")
    mism.save(out["mismatch"])
    return out
