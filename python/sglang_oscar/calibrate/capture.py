"""Capture of post-RoPE Q/K/V (and MLA latents) from a ``transformers`` model.

transformers 5.x routes every attention layer of the supported decoders through
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` and calls the
function with ``(module, query, key, value, attention_mask, scaling=..., sliding_window=...,
softcap=..., ...)``, where ``query`` is ``[B, H_q, T, D_k]`` and ``key``/``value`` are
``[B, H_kv, T, D]`` *after* RoPE (and after QK-norm), exactly as attention consumes them.

:func:`attention_override` registers one function under :data:`IMPL_NAME` (with the SDPA mask
builder, so causal and sliding-window masks are built as for SDPA), switches the model to it
and routes every call to a handler. The handler sees an :class:`AttentionCall` and returns
``None`` (observe only: the model's own attention runs) or the attention output
``[B, T, H_q, D_v]`` (replace). All heads of a layer are in one call -- there is no
tensor-parallel sharding in this path, so every kv head is seen. Observe-only calls run SDPA
(or, with a logit softcap or attention sinks, the model's own ``eager_attention_forward``) on the
model's mask.

Attention sinks: GPT-OSS passes its learned per-head sink logits as ``s_aux=module.sinks``
(transformers 5.12 ``GptOssAttention.forward``); SDPA would drop them silently, so such calls
run the model's eager attention (which adds the sinks to the softmax denominator), and the call
carries them (``AttentionCall.sinks``) for handlers that replace attention.

Sparse attention: under a custom implementation DSA models (GLM-5.x, DeepSeek-V3.2) pass their
top-k key selection as ``indices=`` instead of folding it into the mask; it is folded here
(:func:`fold_topk_indices`), so observe-only calls compute the model's sparse attention, and
the call records how many visible keys the selection drops (``AttentionCall.sparse_dropped``);
the oracle refuses such calls. Block-sparse ``block_indices`` (MiniMax-M3) are refused outright.

MLA models (``kv_a_layernorm``): :func:`latent_hooks` adds forward hooks on the latent norm and
hands the compressed latent ``c_kv [B, T, kv_lora_rank]`` (post-norm, before the up-projection)
to a callback, keyed by the global layer id.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import torch

from . import CalibrationError

IMPL_NAME = "sglang_oscar_capture"

_HANDLERS: list[Callable[["AttentionCall"], torch.Tensor | None]] = []
_REGISTERED = False


@dataclasses.dataclass
class AttentionCall:
    """One attention call of one layer.

    Attributes:
        module: the attention module (``layer_idx``, projections).
        layer_id: global layer id (``module.layer_idx``).
        query: ``[B, H_q, T, D_k]`` post-RoPE; key: ``[B, H_kv, T, D_k]``; value: ``[B, H_kv, T, D_v]``.
        attention_mask: as built for SDPA (bool ``[B, 1, T, T]``) or ``None``.
        scaling: softmax scale; sliding_window: keys visible iff ``i - j < window``; softcap: logit cap.
        sparse_dropped: (query, key) pairs that a sparse-attention key selection (DSA top-k
            ``indices``, folded into ``attention_mask``) removes from the causally visible ones;
            0 for dense attention. The reference oracle computes dense attention only.
        sinks: learned attention-sink logits ``[H_q]`` (GPT-OSS's ``s_aux``), else ``None``: one
            extra logit per query head in the softmax denominator, no value row.
    """

    module: torch.nn.Module
    layer_id: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    sliding_window: int | None
    softcap: float | None
    sparse_dropped: int = 0
    sinks: torch.Tensor | None = None

    def rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H_q, D], k [T, H_kv, D], v [T, H_kv, D_v])`` of batch row ``b``."""
        return self.query[b].transpose(0, 1), self.key[b].transpose(0, 1), self.value[b].transpose(0, 1)


# Keyword arguments through which sparse-attention models hand their key selection to kernels
# that implement it; transformers' eager/SDPA paths get the selection folded into the mask
# instead, but under a custom attention implementation the models pass these.
TOPK_INDICES_KWARG = "indices"  # DeepSeek Sparse Attention (GLM-5.x GlmMoeDsa, DeepSeek-V3.2): [B, S, topk]
BLOCK_INDICES_KWARG = "block_indices"  # MiniMax-M3 block-sparse (MSA) selection
SINKS_KWARG = "s_aux"  # GPT-OSS learned attention-sink logits [H_q] (transformers 5.12)


def _visible(attention_mask: torch.Tensor | None, t_q: int, t_k: int, device) -> torch.Tensor:
    """Bool ``[B or 1, 1, T_q, T_k]``: keys a query may attend to under ``attention_mask``
    (bool: True = attend; additive float: finite-and-not-minimal = attend; ``None``: causal)."""
    if attention_mask is None:
        return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(t_k - t_q)[None, None]
    m = attention_mask[..., :t_k]
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2


def fold_topk_indices(attention_mask: torch.Tensor | None, indices: torch.Tensor, t_q: int, t_k: int
                      ) -> tuple[torch.Tensor, int]:
    """Fold DSA top-k key indices into the attention mask, as transformers does for eager/SDPA.

    Args:
        attention_mask: the mask the model passes (bool, additive float, or ``None`` = causal).
        indices: int ``[B, T_q, topk]`` selected key positions per query.

    Returns:
        ``(mask, dropped)``: a bool mask ``[B, 1, T_q, T_k]`` (visible and selected) and the number
        of (query, key) pairs that the selection removes from the visible ones (0: the sparse
        attention equals dense attention, e.g. sequences no longer than ``index_topk``).
    """
    visible = _visible(attention_mask, t_q, t_k, indices.device)
    b = indices.shape[0]
    selected = torch.zeros(b, t_q, t_k, dtype=torch.bool, device=indices.device)
    selected.scatter_(-1, indices.long().clamp(0, t_k - 1), True)
    selected = selected.unsqueeze(1)
    dropped = int((visible & ~selected).sum())
    return visible & selected, dropped


def _eager_with_softcap(module, query, key, value, attention_mask, scaling, softcap, dropout, **kwargs):
    """The model's own eager attention (``eager_attention_forward`` of its modeling module; SDPA
    has no logit softcap and no attention sinks), with the mask given to it in the additive form
    it expects."""
    import sys

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise CalibrationError(
            f"unsupported architecture: {type(module).__name__} uses a logit softcap or attention sinks but its "
            "modeling module has no eager_attention_forward to compute it"
        )
    visible = _visible(attention_mask, query.shape[2], key.shape[2], query.device)
    additive = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~visible, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, additive, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)


def _dispatch(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    softcap = kwargs.pop("softcap", None)
    if kwargs.pop(BLOCK_INDICES_KWARG, None) is not None:
        raise CalibrationError(
            f"unsupported architecture: {type(module).__name__} uses block-sparse attention (MiniMax-M3 MSA "
            "block_indices), which the capture path cannot reproduce (the model would silently run dense attention); "
            "sparse attention is not supported by calibrate/error/ppl yet"
        )
    indices = kwargs.pop(TOPK_INDICES_KWARG, None)
    sinks = kwargs.get(SINKS_KWARG)
    dropped = 0
    if indices is not None:
        attention_mask, dropped = fold_topk_indices(attention_mask, indices, query.shape[2], key.shape[2])
    if _HANDLERS:
        layer_id = getattr(module, "layer_idx", None)
        if layer_id is None:
            raise CalibrationError(
                f"unsupported architecture: attention module {type(module).__name__} has no layer_idx, "
                "so its calls cannot be mapped to layers"
            )
        call = AttentionCall(module, int(layer_id), query, key, value, attention_mask, float(scaling),
                             kwargs.get("sliding_window"), softcap, dropped, sinks)
        out = _HANDLERS[-1](call)
        if out is not None:
            return out, None
    if softcap or sinks is not None:
        return _eager_with_softcap(module, query, key, value, attention_mask, scaling, softcap, dropout, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> None:
    """Register :data:`IMPL_NAME` in transformers' attention and mask interfaces (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL_NAME, _dispatch)
    AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)
    _REGISTERED = True


@contextlib.contextmanager
def attention_override(model, handler: Callable[[AttentionCall], torch.Tensor | None]) -> Iterator[None]:
    """Route every attention call of ``model`` to ``handler`` inside the ``with`` block.

    Raises:
        CalibrationError: the model does not dispatch through transformers' AttentionInterface.
    """
    register()
    prev = model.config._attn_implementation
    model.set_attn_implementation(IMPL_NAME)
    if model.config._attn_implementation != IMPL_NAME:
        raise CalibrationError(
            f"unsupported architecture {type(model).__name__}: its attention does not dispatch through "
            "transformers' AttentionInterface, so post-RoPE Q/K/V cannot be captured"
        )
    _HANDLERS.append(handler)
    try:
        yield
    finally:
        _HANDLERS.pop()
        try:
            model.set_attn_implementation(prev or "sdpa")
        except Exception:  # restoring is best effort (e.g. prev was a kernel no longer available)
            model.set_attn_implementation("sdpa")


def mla_attention_modules(model) -> dict[int, torch.nn.Module]:
    """``{layer id: attention module}`` of the MLA layers (modules with ``kv_a_layernorm``)."""
    out = {}
    for _, m in model.named_modules():
        if hasattr(m, "kv_a_layernorm") and hasattr(m, "kv_b_proj") and getattr(m, "layer_idx", None) is not None:
            out[int(m.layer_idx)] = m
    return out


@contextlib.contextmanager
def latent_hooks(model, callback: Callable[[int, torch.nn.Module, torch.Tensor], Any]) -> Iterator[dict[int, torch.nn.Module]]:
    """Call ``callback(layer_id, attention_module, c_kv [B, T, R])`` for every MLA layer forward.

    Raises:
        CalibrationError: the model has no MLA layers with ``kv_a_layernorm``.
    """
    mods = mla_attention_modules(model)
    if not mods:
        raise CalibrationError(
            f"unsupported architecture {type(model).__name__}: an MLA config (kv_lora_rank) but no attention "
            "module with kv_a_layernorm / kv_b_proj to capture the latent from"
        )
    handles = []
    for lid, attn in mods.items():
        def hook(_mod, _inp, out, lid=lid, attn=attn):
            callback(lid, attn, out)
        handles.append(attn.kv_a_layernorm.register_forward_hook(hook))
    try:
        yield mods
    finally:
        for h in handles:
            h.remove()
