"""Per-layer attention through the reference oracle, for captured ``transformers`` calls.

MHA/GQA layers go through :func:`..reference.oscar_attention` (rotate, BF16 HP tier, INT2
quantize, windows, counter-rotate). MLA layers quantize the *latent*: ``c_low =
deq(quant(c R)) R^T`` (INT2 groups of the configured group size, K clip ratio), the keys and
values read in INT2 are ``kv_b_proj(c_low)`` (``k_pe`` is never quantized), the HP tier holds
the model's own keys/values, and :func:`..reference.attend` applies the same windows.
"""

from __future__ import annotations

import functools

import torch

from ..config import OscarConfig
from ..quant.int2 import dequantize_rows, quantize_rows
from ..reference.attention import attend, hp_window_mask, oscar_attention, plain_attention
from .capture import AttentionCall


class RotationCache:
    """Rotation matrices of one set moved to each device once."""

    def __init__(self, rotation_set):
        self.rs = rotation_set
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, layer_id: int, which: str, device) -> torch.Tensor:
        key = (layer_id, which, str(device))
        if key not in self._cache:
            if which == "latent":
                t = self.rs.matrix(layer_id)
            else:
                t = self.rs.matrices(layer_id, which)
            self._cache[key] = t.to(device=device, dtype=torch.float32)
        return self._cache[key]


@functools.lru_cache(maxsize=64)
def _low_reads_cpu(t: int, sink: int, recent: int, window_mode: str, sliding_window: int | None) -> int:
    pos = torch.arange(t)
    j = pos.unsqueeze(0)
    i = pos.unsqueeze(1)
    visible = j <= i
    if sliding_window is not None:
        visible &= (i - j) < sliding_window
    hp = hp_window_mask(pos, t, sink, recent, window_mode)
    return int((visible & ~hp).sum())


def low_reads(t: int, config: OscarConfig, window_mode: str, sliding_window: int | None) -> int:
    """Number of (query, key) pairs of a length-``t`` sequence whose key is read from INT2."""
    if window_mode == "none":
        return 0
    return _low_reads_cpu(t, config.sink_tokens, config.recent_tokens, window_mode, sliding_window)


def mha_output(call: AttentionCall, b: int, rk: torch.Tensor | None, rv: torch.Tensor | None, config: OscarConfig,
               window_mode: str, quantize: bool = True) -> torch.Tensor:
    """Oracle output ``[T, H_q, D_v]`` (fp32) of batch row ``b``; ``rk=None`` -> exact fp32 attention."""
    q, k, v = call.rows(b)
    pos = torch.arange(q.shape[0], device=q.device)
    if rk is None:
        return plain_attention(q, k, v, q_positions=pos, sliding_window=call.sliding_window,
                               logit_cap=call.softcap, sm_scale=call.scaling)
    return oscar_attention(q, k, v, rk, rv, config, q_positions=pos, sliding_window=call.sliding_window,
                           logit_cap=call.softcap, sm_scale=call.scaling, quantize=quantize, window_mode=window_mode)


def latent_fake_quant(c: torch.Tensor, r: torch.Tensor, config: OscarConfig, hp_dtype=torch.bfloat16) -> torch.Tensor:
    """``deq(quant(c R)) R^T`` of latents ``c [T, R]`` (fp32)."""
    rot = (c.float() @ r).to(hp_dtype)
    qr = quantize_rows(rot.unsqueeze(1), **config.quant_kwargs("k"))
    return dequantize_rows(qr)[:, 0] @ r.T


def mla_output(call: AttentionCall, b: int, c: torch.Tensor | None, r: torch.Tensor | None, config: OscarConfig,
               window_mode: str, quantize: bool = True) -> torch.Tensor:
    """Oracle output ``[T, H, D_v]`` (fp32) of an MLA layer; ``r=None`` -> exact fp32 attention.

    Args:
        c: the layer's latent ``[T, kv_lora_rank]`` for batch row ``b`` (post ``kv_a_layernorm``).
    """
    q, k, v = call.rows(b)
    pos = torch.arange(q.shape[0], device=q.device)
    if r is None or not quantize:
        return attend(q.float(), pos, k.float(), v.float(), None, None, sink=0, recent=0, sm_scale=call.scaling,
                      sliding_window=call.sliding_window, logit_cap=call.softcap)
    m = call.module
    nope, dv = int(m.qk_nope_head_dim), int(m.v_head_dim)
    c_low = latent_fake_quant(c, r, config)
    w = m.kv_b_proj.weight
    kv = m.kv_b_proj(c_low.to(w.dtype)).float().view(c.shape[0], -1, nope + dv)
    k_low = torch.cat([kv[..., :nope], k[..., nope:].float()], dim=-1)
    v_low = kv[..., nope:]
    return attend(q.float(), pos, k.float(), v.float()[..., :dv], k_low, v_low, sink=config.sink_tokens,
                  recent=config.recent_tokens, sm_scale=call.scaling, sliding_window=call.sliding_window,
                  logit_cap=call.softcap, window_mode=window_mode)


def energies(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """``(||approx - exact||^2, ||exact||^2)`` in float64 (the terms of ``relative_error_db``)."""
    return float((approx.double() - exact.double()).pow(2).sum()), float(exact.double().pow(2).sum())
