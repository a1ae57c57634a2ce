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
tensor-parallel sharding in this path, so every kv head is seen.

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

    def rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H_q, D], k [T, H_kv, D], v [T, H_kv, D_v])`` of batch row ``b``."""
        return self.query[b].transpose(0, 1), self.key[b].transpose(0, 1), self.value[b].transpose(0, 1)


def eager_attention(module, query, key, value, attention_mask, scaling, softcap=None, dropout: float = 0.0, **_):
    """Generic eager attention (GQA repeat, optional softcap, bool or additive mask).

    Returns ``([B, T, H_q, D_v], probs)`` like the transformers eager functions.
    """
    g = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    s = torch.matmul(query, k.transpose(2, 3)) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is not None:
        m = attention_mask[..., : k.shape[-2]]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    elif query.shape[2] > 1:
        t_q, t_k = query.shape[2], k.shape[2]
        causal = torch.ones(t_q, t_k, dtype=torch.bool, device=s.device).tril(t_k - t_q)
        s = s.masked_fill(~causal, float("-inf"))
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(p, v).transpose(1, 2).contiguous(), p


def _dispatch(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    if _HANDLERS:
        layer_id = getattr(module, "layer_idx", None)
        if layer_id is None:
            raise CalibrationError(
                f"unsupported architecture: attention module {type(module).__name__} has no layer_idx, "
                "so its calls cannot be mapped to layers"
            )
        call = AttentionCall(module, int(layer_id), query, key, value, attention_mask, float(scaling),
                             kwargs.get("sliding_window"), softcap)
        out = _HANDLERS[-1](call)
        if out is not None:
            return out, None
    if softcap:
        return eager_attention(module, query, key, value, attention_mask, scaling, softcap)
    kwargs.pop("softcap", None)
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
