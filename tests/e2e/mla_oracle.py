"""The MLA oracle at model level: a ``transformers`` DeepSeek-V3 whose attention layers read the
INT2 latent cache of :func:`sglang_oscar.reference.latent.latent_attention` or, with
``storage="expanded"``, the INT2 MHA cache of per-head K ``[k_nope | k_pe]`` and V
(:func:`sglang_oscar.reference.latent.expand_latent`, then :func:`sglang_oscar.reference.oscar_attention`).

:func:`install` replaces ``DeepseekV3Attention.forward`` (and GLM-5's ``GlmMoeDsaAttention.forward``,
the same MLA with a DSA indexer, patched only for prompts within its ``index_topk``, where the
selection is every position) of every layer by the same projections,
``kv_a_layernorm`` and RoPE as transformers computes them, followed by the oracle's absorbed
attention over the rotated, quantized latents (``kv_b_proj`` split as SGLang splits it,
``reference.latent.split_kv_b_proj``). Prefill only (one sequence, no KV cache object): the
prompt log-probs of one forward are what a served prefill returns. ``window_mode="none"``
reads every key from the window tier, i.e. the unquantized model: it must equal the unpatched
model (the patch's own test).
"""

from __future__ import annotations

import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.reference.attention import oscar_attention
from sglang_oscar.reference.latent import expand_latent, latent_attention, split_kv_b_proj


def install(model, config: OscarConfig, rotations: dict | None, *, window_mode: str = "extend",
            hp_dtype: torch.dtype = torch.float32, storage: str = "latent") -> int:
    """Patch every ``DeepseekV3Attention`` or ``GlmMoeDsaAttention`` of ``model`` (returns how many).

    Args:
        config: windows and INT2 format of the cache.
        rotations: latent storage: ``{layer id: [R, R]}`` (``LatentRotationSet.r``); expanded storage:
            ``{layer id: (R_k [N + P, N + P], R_v [V, V])}``; ``None`` = identity.
        window_mode: the oracle's tier rule (``"extend"``: a served prefill; ``"none"``: no quantization).
        hp_dtype: dtype of the window tier.
        storage: ``"latent"`` or ``"expanded"`` (``--oscar-mla-storage``).

    Raises:
        ValueError: an unknown ``storage``; from a patched GLM-5 layer, a prompt longer than its
            ``index_topk`` (the indexer would select, the oracle attends densely).
    """
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    if storage not in ("latent", "expanded"):
        raise ValueError(f"storage must be 'latent' or 'expanded', got {storage!r}")
    make = _oracle_forward if storage == "latent" else _expanded_forward
    n = 0
    for module in model.modules():
        if isinstance(module, (hf.DeepseekV3Attention, glm.GlmMoeDsaAttention)):
            rot = None if rotations is None else rotations[module.layer_idx]
            forward = make(module, config, rot, window_mode, hp_dtype)
            module.forward = _dense_dsa(module, forward) if isinstance(module, glm.GlmMoeDsaAttention) else forward
            n += 1
    return n


def _dense_dsa(attn, forward):
    """GLM-5's attention returns its top-k selection for the layers that share it; every layer being
    patched, none reads it. Dense only: the selection is every position while ``T <= index_topk``."""
    def dense(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        t, topk = hidden_states.shape[1], attn.config.index_topk
        if t > topk:
            raise ValueError(f"the MLA oracle attends densely: {t} positions exceed GLM-5's index_topk {topk}, "
                             "where its indexer selects; use prompts of at most index_topk tokens")
        out, weights = forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        return out, weights, None

    return dense


def latent_inputs(attn, hidden_states, position_embeddings) -> dict:
    """What SGLang's absorbed path feeds the cache and the attention for one sequence, from a
    transformers ``DeepseekV3Attention`` (its projections, ``kv_a_layernorm`` and RoPE):
    ``q_nope [T, H, N]``, ``q_pe [T, H, P]`` (post-RoPE), ``c_kv [T, R]``, ``k_pe [T, P]``,
    ``w_kc [H, N, R]``, ``w_vc [H, R, V]`` (:func:`split_kv_b_proj`)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    heads = attn.config.num_attention_heads
    n_nope, rope, v_dim, rank = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    bsz, t = hidden_states.shape[:-1]
    if bsz != 1:
        raise ValueError("the MLA oracle takes one sequence")
    if attn.q_lora_rank is None:
        q = attn.q_proj(hidden_states)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(hidden_states)))
    q = q.view(bsz, t, heads, n_nope + rope).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [n_nope, rope], dim=-1)
    c_kv, k_pe = torch.split(attn.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    c_kv = attn.kv_a_layernorm(c_kv)
    k_pe = k_pe.view(bsz, 1, t, rope)
    cos, sin = position_embeddings
    # GLM-5's config has no rope_interleave: its attention always interleaves
    rotary = hf.apply_rotary_pos_emb_interleave if getattr(attn.config, "rope_interleave", True) else hf.apply_rotary_pos_emb
    q_pe, k_pe = rotary(q_pe, k_pe, cos, sin)
    w_kc, w_vc = split_kv_b_proj(attn.kv_b_proj.weight, heads, n_nope, v_dim)
    return dict(q_nope=q_nope[0].transpose(0, 1), q_pe=q_pe[0].transpose(0, 1), c_kv=c_kv[0], k_pe=k_pe[0, 0],
                w_kc=w_kc, w_vc=w_vc)


@torch.no_grad()
def capture_latent_inputs(model, ids: list[int], layer: int = 0) -> dict:
    """:func:`latent_inputs` of decoder layer ``layer`` of a transformers DeepSeek-V3 on prompt ``ids``
    (fp32 of the model's dtype; the model's own forward runs once to reach the layer's input)."""
    seen = {}

    def grab(module, args, kwargs):
        seen.update(hidden=kwargs.get("hidden_states", args[0] if args else None),
                    rope=kwargs.get("position_embeddings"))

    handle = model.model.layers[layer].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        handle.remove()
    return latent_inputs(model.model.layers[layer].self_attn, seen["hidden"], seen["rope"])


def _oracle_forward(attn, config, rot, window_mode, hp_dtype):
    heads, v_dim = attn.config.num_attention_heads, attn.v_head_dim

    def forward(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        x = latent_inputs(attn, hidden_states, position_embeddings)
        o = latent_attention(x["q_nope"], x["q_pe"], x["c_kv"], x["k_pe"], x["w_kc"], x["w_vc"], rot, config,
                             softmax_scale=attn.scaling, window_mode=window_mode, hp_dtype=hp_dtype)
        return attn.o_proj(o.to(hidden_states.dtype).reshape(1, -1, heads * v_dim)), None

    return forward


def _interleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., P]`` as ``[evens | odds]`` -> pairs ``(x0, x1), (x2, x3), ...`` interleaved (P even)."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)


def _expanded_forward(attn, config, rot_kv, window_mode, hp_dtype):
    heads, v_dim = attn.config.num_attention_heads, attn.v_head_dim
    dk = attn.qk_nope_head_dim + attn.qk_rope_head_dim

    def forward(hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        x = latent_inputs(attn, hidden_states, position_embeddings)
        q_pe, k_pe = x["q_pe"], x["k_pe"]
        if getattr(attn.config, "rope_interleave", True):
            # transformers returns the rotated pairs as [evens | odds]; SGLang's GPT-J RoPE keeps them
            # interleaved, and expanded storage rotates and quantizes k_pe's columns in that order
            q_pe, k_pe = _interleave(q_pe), _interleave(k_pe)
        k, v = expand_latent(x["c_kv"], k_pe, x["w_kc"], x["w_vc"])
        # the server's kv_b_proj output is in the model dtype before it is rotated and quantized
        k, v = k.to(hidden_states.dtype).float(), v.to(hidden_states.dtype).float()
        q = torch.cat([x["q_nope"], q_pe], dim=-1).float()
        eye = lambda d: torch.eye(d, device=q.device)  # noqa: E731
        rk, rv = (eye(dk), eye(v_dim)) if rot_kv is None else (rot_kv[0].float(), rot_kv[1].float())
        o = oscar_attention(q, k, v, rk, rv, config, sm_scale=attn.scaling, quantize=window_mode != "none",
                            window_mode="extend" if window_mode == "none" else window_mode, hp_dtype=hp_dtype)
        return attn.o_proj(o.to(hidden_states.dtype).reshape(1, -1, heads * v_dim)), None

    return forward


@torch.no_grad()
def prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """fp32 log-prob of each prompt token given the ones before it, ``[len(ids) - 1]`` (SGLang's
    ``input_token_logprobs`` without the first position)."""
    x = torch.tensor([ids], device=next(model.parameters()).device)
    logits = model(x).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0]
