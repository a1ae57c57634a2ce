"""Tiny seeded checkpoints of the device checks and their rotation files.

The ``transformers`` families of :mod:`.families` (:data:`~.config.MODEL_FAMILIES`), randomly
initialised from a seed, then *sharpened* (:func:`sharpen`) so that attention and logits react
to KV-cache errors, saved as bf16 safetensors (a multimodal family with its processor,
:func:`write_processor`). Rotation files come from the package's own calibrate / fit path on
seeded random token sequences.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from .config import LINEAR_FAMILIES, MULTIMODAL_FAMILIES, SINK_FAMILIES, SWA_FAMILIES, VOCAB
from .families import causal_lm_class, model_config  # noqa: F401  (model_config: the tests' entry)


def _rows_std(t) -> float:
    return float(t.float().std())


def _scale_norm(norm, factor: float) -> None:
    """Scale an RMSNorm's output by ``factor``: its weight, or ``1 + weight`` for Gemma-3 style
    norms (``Gemma3RMSNorm`` multiplies by ``1 + weight``; found by probing the module)."""
    import torch

    w = norm.weight
    saved = w.detach().clone()
    w.zero_()
    offset = float(norm(torch.ones(1, w.shape[-1], dtype=torch.float32, device=w.device)).float().mean())
    w.copy_(saved)
    if abs(offset) < 1e-6:
        w.mul_(factor)  # the plain case, exactly as before
    else:
        w.copy_((saved + offset) * factor - offset)


def sharpen(model, logit_std: float, score_std: float, seed: int) -> dict[str, float]:
    """Make a random model's outputs less uniform, in place: scale the lm_head so logits have std
    ``logit_std`` and the q/k path so pre-softmax attention scores have std ~``score_std`` (random
    initialisations give near-uniform attention, which would hide KV-quantization effects).
    Measured on a seeded random prompt; returns the measured stds after scaling. A multimodal
    wrapper (Qwen3.5) is sharpened through its language model's attention and ``lm_head``."""
    import torch

    from sglang_oscar.calibrate.capture import attention_override

    gen = torch.Generator().manual_seed(seed + 17)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (1, 256), generator=gen).to(next(model.parameters()).device)
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
                if hasattr(mod, "kv_a_proj_with_mqa"):  # MLA: the query alone carries the gain (k is the latent)
                    (mod.q_b_proj if getattr(mod, "q_b_proj", None) is not None else mod.q_proj).weight.mul_(gain)
                elif getattr(mod, "q_norm", None) is not None:  # Qwen3, Gemma: per-head RMSNorm weights scale q and k
                    _scale_norm(mod.q_norm, math.sqrt(gain))
                    _scale_norm(mod.k_norm, math.sqrt(gain))
                else:
                    mod.q_proj.weight.mul_(math.sqrt(gain))
                    mod.k_proj.weight.mul_(math.sqrt(gain))
                    for proj in (mod.q_proj, mod.k_proj):
                        if getattr(proj, "bias", None) is not None:
                            proj.bias.mul_(math.sqrt(gain))
        _, l0 = measure()
        if model.lm_head.weight is model.get_input_embeddings().weight:  # tied (Gemma): scale the final norm
            _scale_norm(model.get_decoder().norm, logit_std / max(l0, 1e-6))
        else:
            model.lm_head.weight.mul_(logit_std / max(l0, 1e-6))
        s1, l1 = measure()
    return {"score_std": s1, "logit_std": l1}


def init_sinks(model, seed: int, mean: float = 3.0, std: float = 1.5) -> int:
    """Seeded attention-sink logits ``N(mean, std)`` for every module with a ``sinks`` parameter
    (GPT-OSS; transformers initialises them near 0, where ``exp(sink)`` is lost among the keys):
    large enough that the sink takes a visible share of short rows and little of long ones.
    Returns the number of modules set."""
    import torch

    gen = torch.Generator().manual_seed(seed + 29)
    n = 0
    with torch.no_grad():
        for _, mod in model.named_modules():
            p = getattr(mod, "sinks", None)
            if isinstance(p, torch.nn.Parameter):
                p.copy_((torch.randn(p.shape, generator=gen) * std + mean).to(p.dtype))
                n += 1
    return n


def build_checkpoint(name: str, path: str, *, seed: int = 0, args: argparse.Namespace | None = None,
                     logit_std: float = 0.5, score_std: float = 1.5, device: str = "cpu", **over) -> dict[str, Any]:
    """Build, sharpen (:func:`sharpen`) and ``save_pretrained`` (bf16 safetensors) one tiny seeded
    model into ``path``. Idempotent: an existing checkpoint with the same recipe is kept.

    Returns:
        ``{"path", "name", "config": {...sizes}, "sharpen": {...}, "reused": bool}``.
    """
    import torch

    cfg = model_config(name, args, **over)
    text = cfg.get_text_config()  # the config itself but for a multimodal wrapper
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "max_position_embeddings", "intermediate_size")
    if name in SWA_FAMILIES:
        keys += ("sliding_window", "layer_types") + (("global_head_dim", "num_global_key_value_heads",
                                                      "attention_k_eq_v") if name == "gemma4" else ())
    if name in ("gpt_oss", "minimax_m2"):
        keys += ("num_local_experts", "num_experts_per_tok")
    if name == "minimax_m2":
        keys += ("rotary_dim", "use_qk_norm", "qk_norm_type", "scoring_func", "use_routing_bias", "rope_parameters")
    if name in LINEAR_FAMILIES:
        keys += ("layer_types", "full_attention_interval", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")
    if name in MULTIMODAL_FAMILIES:
        keys += ("rope_parameters",)
    recipe = {"name": name, "seed": seed, "logit_std": logit_std, "score_std": score_std,
              "config": {k: getattr(text, k) for k in keys}}
    if name in MULTIMODAL_FAMILIES:
        recipe["vision_config"] = {k: getattr(cfg.vision_config, k) for k in ("depth", "hidden_size", "num_heads")}
    marker = os.path.join(path, "oscar_e2e.json")
    if os.path.exists(marker):
        with open(marker) as f:
            old = json.load(f)
        if {k: old.get(k) for k in recipe} == recipe:
            return {**old, "path": path, "reused": True}
    torch.manual_seed(seed)
    model = causal_lm_class(name)(cfg).to(device=device, dtype=torch.float32).eval()
    if name in SINK_FAMILIES:
        init_sinks(model, seed)
    stats = sharpen(model, logit_std, score_std, seed)
    model = model.to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if name in MULTIMODAL_FAMILIES:
        write_processor(path, cfg)
    info = {**recipe, "sharpen": stats}
    with open(marker, "w") as f:
        json.dump(info, f, indent=2)
    return {**info, "path": path, "reused": False}


def write_processor(path: str, cfg) -> None:
    """Save a Qwen3-VL processor for the Qwen3.5 wrapper config ``cfg`` into ``path``. SGLang 0.5.16
    loads one for every multimodal model, ``--skip-tokenizer-init`` included
    (``srt/managers/tokenizer_manager.py:361-380``: ``get_processor`` -> ``AutoProcessor``), and has no
    flag that turns multimodality off (``--enable-multimodal`` only turns it on). Built offline: a
    word-level tokenizer over the model's vocabulary plus the vision tokens at the config's ids
    (:data:`~.families.QWEN3_5_VISION_TOKENS`), Qwen2-VL image and Qwen3-VL video processors with the
    vision tower's patch sizes. The servers never tokenize (input_ids requests)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    from .families import QWEN3_5_VISION_TOKENS

    vocab = cfg.get_text_config().vocab_size
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [token for _, token in QWEN3_5_VISION_TOKENS]
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1",
                                           eos_token="t2", additional_special_tokens=specials)
    ids = dict(zip(specials, tokenizer.convert_tokens_to_ids(specials)))
    want = {token: getattr(cfg, key) for key, token in QWEN3_5_VISION_TOKENS}
    if ids != want:  # pragma: no cover - the tokenizer appends added tokens after the vocabulary
        raise AssertionError(f"vision token ids {ids} differ from the config's {want}")
    v = cfg.vision_config
    sizes = dict(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size)
    tf.Qwen3VLProcessor(image_processor=tf.Qwen2VLImageProcessor(**sizes), tokenizer=tokenizer,
                        video_processor=tf.Qwen3VLVideoProcessor(**sizes)).save_pretrained(path)


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
    logits (:class:`FP32Head`) unless ``fp32_head`` is False. In float64 MoE experts run eagerly:
    transformers' default ``grouped_mm`` (``torch._grouped_mm``) takes no float64. A Qwen3.5 wrapper
    loads as its language model (``Qwen3_5MoeForCausalLM``, transformers' mapping for
    ``qwen3_5_moe``): the same weights and logits for text-only input, its config the text config."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16, **kw).to(device).eval()
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
    * ``mismatch``: a valid identity file for another geometry (one layer fewer -- hybrids: as many
      -- and twice the kv heads),
    * ``onedim`` (models with more than one layer geometry, Gemma-4): an identity file giving every
      layer the sliding layers' kv heads and head_dim,
    * ``centred`` (models with attention sinks, GPT-OSS): the identity file with key/value means,
      which the launch must refuse (centering does not commute with the sink logit),
    * ``linear`` (linear-attention hybrids, Qwen3-Next): an identity file for every layer, as if
      the Gated-DeltaNet layers attended, which the launch must refuse.

    The fitted files are never centred (``center=False``): SGLang refuses centred files for
    models with attention sinks (``backend/rotations.py``).
    """
    import dataclasses

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
        rs = fit_rotations(stats, method, geometry=geometry, fingerprint=fp, center=False,
                           min_tokens=DEFAULT_MIN_TOKENS if min_tokens is None else min_tokens)
        if rs.k_mean or rs.v_mean:  # pragma: no cover - center=False
            raise AssertionError(f"{key}: a centred rotation file")
        out[key] = os.path.join(out_dir, f"rot_{key}.safetensors")
        rs.save(out[key])
    ident = RotationSet.data_free(geometry, "identity")
    out["identity"] = os.path.join(out_dir, "rot_identity.safetensors")
    ident.save(out["identity"])
    cfg = dict(model.config.to_dict())
    # one layer fewer (a hybrid keeps its layers: with one fewer it may have no attention layer)
    cfg["num_hidden_layers"] = cfg["num_hidden_layers"] - (0 if geometry.linear_layer_ids else 1) or 1
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
    if len({(l.num_kv_heads, l.head_dim_k, l.head_dim_v) for l in geometry.layers}) > 1:
        # Gemma-4: a valid identity file with the sliding layers' geometry for every layer
        cfg = model.config.to_dict()
        cfg.update(global_head_dim=cfg["head_dim"], num_global_key_value_heads=cfg["num_key_value_heads"])
        out["onedim"] = os.path.join(out_dir, "rot_onedim.safetensors")
        RotationSet.data_free(ModelGeometry.from_hf_config(cfg), "identity").save(out["onedim"])
    if any(l.has_sinks for l in geometry.layers):
        gen = torch.Generator().manual_seed(seed + 5)
        means = {l.layer_id: torch.randn(l.num_kv_heads, l.head_dim_k, generator=gen) for l in geometry.layers}
        out["centred"] = os.path.join(out_dir, "rot_centred.safetensors")
        dataclasses.replace(ident, k_mean=means, v_mean={i: m.clone() for i, m in means.items()}).save(out["centred"])
    if geometry.linear_layer_ids:
        cfg = model.config.to_dict()
        cfg.update(layer_types=["full_attention"] * cfg["num_hidden_layers"], full_attention_interval=1)
        out["linear"] = os.path.join(out_dir, "rot_linear.safetensors")
        RotationSet.data_free(ModelGeometry.from_hf_config(cfg), "identity").save(out["linear"])
    return out


#: the identity rotation file's name (:func:`write_identity_rotation`)
IDENTITY_ROTATION = "identity-rotation.safetensors"


def write_identity_rotation(model: str, out: str, *, expanded: bool = False) -> str:
    """Write the identity rotation file of ``model``'s config to ``out/IDENTITY_ROTATION`` (not beside
    the weights: SGLang's loader reads every ``*.safetensors`` there); returns its path. Per-head K / V
    for an MHA model or, with ``expanded``, an MLA model's expanded geometry; the latent one for an
    MLA model otherwise (the user's ``sglang-oscar hadamard --method identity``). Served with
    ``--oscar-rotation``, every BF16 window row is the model's own.

    Raises:
        RuntimeError: the command failed (its message is on stderr)."""
    from sglang_oscar.cli.main import main as oscar_cli
    from sglang_oscar.rotation import ModelGeometry

    config = os.path.join(model, "config.json")
    mla = ModelGeometry.from_hf_config(config).attention_kind == "mla"
    storage = ["--mla-storage", "expanded" if expanded else "latent"] if mla else []
    path = os.path.join(out, IDENTITY_ROTATION)
    if oscar_cli(["hadamard", "--config", config, "--method", "identity", "--out", path, *storage]) != 0:
        raise RuntimeError(f"sglang-oscar hadamard --method identity failed for {config}")
    return path
