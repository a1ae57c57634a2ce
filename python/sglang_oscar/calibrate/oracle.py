"""Per-layer attention through the reference oracle, for captured ``transformers`` calls.

MHA/GQA layers go through :func:`..reference.oscar_attention` (rotate, BF16 HP tier, INT2
quantize, windows, counter-rotate). MLA layers quantize the *latent*: ``c_low =
deq(quant(c R)) R^T`` (INT2 groups of the configured group size, K clip ratio), the keys and
values read in INT2 are ``kv_b_proj(c_low)`` (``k_pe`` is never quantized), the HP tier holds
the model's own keys/values, and :func:`..reference.attend` applies the same windows.

The oracle computes dense attention: calls whose sparse (DSA top-k) key selection drops visible
keys are refused (:func:`check_dense`). Shared plumbing of ``error`` and ``ppl``:
:func:`check_window_mode`, :func:`settings`, :func:`oracle_capture`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from ..config import OscarConfig, latent_group_size
from ..quant.int2 import dequantize_rows, quantize_rows
from ..reference.attention import attend, hp_window_mask, oscar_attention, plain_attention
from . import CalibrationError
from .capture import AttentionCall, attention_override, latent_hooks

OutputFn = Callable[[AttentionCall, int], torch.Tensor]
"""An attention-output function for the fake-quant harness: ``fn(call, b)`` returns the fp32 output
``[T, H_q, D_v]`` of batch row ``b`` of an MHA/GQA attention call (e.g. a baseline cache that is not the
OSCAR format, ``sglang_oscar.calibrate.quality``). Used by ``ppl`` (``output_fn``) and ``error`` (``outputs``)."""


class RotationCache:
    """Rotation matrices of one set moved to each device once."""

    def __init__(self, rotation_set):
        self.rs = rotation_set
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, layer_id: int, which: str, device) -> torch.Tensor:
        """Float32 rotation of ``layer_id`` on ``device``: ``which`` is ``"k"``/``"v"`` (K/V set,
        ``[D, D]`` or ``[H_kv, D, D]``) or ``"latent"`` (latent set, ``[R, R]``); cached."""
        key = (layer_id, which, str(device))
        if key not in self._cache:
            if which == "latent":
                t = self.rs.matrix(layer_id)
            else:
                t = self.rs.matrices(layer_id, which)
            self._cache[key] = t.to(device=device, dtype=torch.float32)
        return self._cache[key]

    def mean(self, layer_id: int, which: str, device) -> torch.Tensor | None:
        """Float32 ``[H_kv, D]`` centering mean of ``layer_id`` (``which`` ``"k"``/``"v"``) on
        ``device``, ``None`` when the set does not centre that side; cached."""
        key = (layer_id, f"{which}_mean", str(device))
        if key not in self._cache:
            m = self.rs.mean(layer_id, which)
            self._cache[key] = None if m is None else m.to(device=device, dtype=torch.float32)
        return self._cache[key]

    def mha(self, call: AttentionCall, b: int, config: OscarConfig, window_mode: str,
            quantize: bool = True) -> torch.Tensor:
        """:func:`mha_output` of batch row ``b`` with this set's rotations and centering means.

        Raises:
            CalibrationError: sparse attention dropping keys. ValueError: key means on a soft-capped call.
        """
        lid, dev = call.layer_id, call.query.device
        return mha_output(call, b, self.get(lid, "k", dev), self.get(lid, "v", dev), config, window_mode,
                          quantize=quantize, k_mean=self.mean(lid, "k", dev), v_mean=self.mean(lid, "v", dev))


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


def check_window_mode(window_mode: str) -> None:
    """Raise :class:`CalibrationError` unless ``window_mode`` is ``"decode"`` or ``"extend"``."""
    if window_mode not in ("decode", "extend"):
        raise CalibrationError(f"window_mode must be 'decode' or 'extend', got {window_mode!r}")


def settings(config: OscarConfig) -> dict[str, Any]:
    """The served quantizer settings of ``config`` as reported by ``error`` and ``ppl``."""
    return {"group_size": config.group_size, "k_clip_ratio": config.k_clip_ratio, "v_clip_ratio": config.v_clip_ratio,
            "sink_tokens": config.sink_tokens, "recent_tokens": config.recent_tokens,
            "quantizer": config.quantizer, "scale_dtype": config.scale_dtype, "skip_layers": config.skip_layers}


def skipped_layers(config: OscarConfig, geometry, model) -> frozenset[int]:
    """Global ids of the attention layers ``config.skip_layers`` keeps in SGLang's BF16 cache, by the
    served rule (:func:`sglang_oscar.plugin.skip_kind`: all the sliding or all the full layers of a
    model SGLang serves with its hybrid sliding-window pool): ``error`` and ``ppl`` give them the
    BF16 path, so their figures describe the served configuration.

    Raises:
        CalibrationError: a skip the server refuses (ids that are not attention layers, not exactly
            one layer kind, a model with one KV pool, MLA), with the server's message.
    """
    from ..plugin import skip_kind

    if config.skip_layers in (None, "none"):
        return frozenset()
    hf = model.config.to_dict()
    hf["architectures"] = hf.get("architectures") or [type(model).__name__]  # unset on a model built from a config
    try:
        kind = skip_kind(config, geometry, hf)  # accepted skips are exactly all the layers of one kind
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    return frozenset(layer.layer_id for layer in geometry.layers if layer.kind == kind)


@contextlib.contextmanager
def oracle_capture(model, mla: bool, on_attention, on_latent) -> Iterator[None]:
    """:func:`.capture.attention_override` with ``on_attention`` and, for MLA models, also
    :func:`.capture.latent_hooks` with ``on_latent`` (the latent of a layer is captured before its
    attention call), inside ``torch.inference_mode``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(attention_override(model, on_attention))
        if mla:
            stack.enter_context(latent_hooks(model, on_latent))
        yield


def check_dense(call: AttentionCall) -> None:
    """Refuse a call whose sparse key selection (DSA top-k) drops visible keys: the oracle
    computes dense attention, so its error and perplexity would describe another model.

    Raises:
        CalibrationError: naming the layer, the dropped pairs and the workaround.
    """
    if call.sparse_dropped:
        topk = getattr(getattr(call.module, "config", None), "index_topk", None)
        raise CalibrationError(
            f"layer {call.layer_id}: sparse DSA attention (top-k key selection{f', index_topk {topk}' if topk else ''}) "
            f"drops {call.sparse_dropped} visible (query, key) pairs of this sequence, and sparse attention is not "
            "supported by the oracle yet (it would compare dense attention). Use sequences no longer than the "
            "model's index_topk (--seq-len), where sparse and dense attention agree."
        )


def low_reads(t: int, config: OscarConfig, window_mode: str, sliding_window: int | None) -> int:
    """Number of (query, key) pairs of a length-``t`` sequence whose key is read from INT2."""
    if window_mode == "none":
        return 0
    return _low_reads_cpu(t, config.sink_tokens, config.recent_tokens, window_mode, sliding_window)


def mha_output(call: AttentionCall, b: int, rk: torch.Tensor | None, rv: torch.Tensor | None, config: OscarConfig,
               window_mode: str, quantize: bool = True, k_mean: torch.Tensor | None = None,
               v_mean: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle output ``[T, H_q, D_v]`` (fp32) of batch row ``b``; ``rk=None`` -> exact fp32 attention.
    ``k_mean`` / ``v_mean``: optional ``[H_kv, D]`` centering (:func:`..reference.oscar_attention`).
    The call's attention sinks (GPT-OSS) join every head's softmax denominator, as in the model.

    Raises:
        CalibrationError: the call's sparse attention drops keys (:func:`check_dense`).
        ValueError: ``k_mean`` on a call with a logit soft cap (:func:`..reference.oscar_attention`).
    """
    check_dense(call)
    q, k, v = call.rows(b)
    pos = torch.arange(q.shape[0], device=q.device)
    if rk is None:
        return plain_attention(q, k, v, q_positions=pos, sliding_window=call.sliding_window,
                               logit_cap=call.softcap, sm_scale=call.scaling, sinks=call.sinks)
    return oscar_attention(q, k, v, rk, rv, config, q_positions=pos, sliding_window=call.sliding_window,
                           logit_cap=call.softcap, sm_scale=call.scaling, quantize=quantize, window_mode=window_mode,
                           k_mean=k_mean, v_mean=v_mean, sinks=call.sinks)


def latent_fake_quant(c: torch.Tensor, r: torch.Tensor, config: OscarConfig, hp_dtype=torch.bfloat16) -> torch.Tensor:
    """``deq(quant(c R)) R^T`` of latents (INT2 groups of ``config``, K clip ratio).

    Args:
        c: ``[T, R]`` latents, any float dtype.
        r: float32 ``[R, R]`` orthogonal rotation on ``c``'s device (``RotationCache.get(..., "latent", ...)``).
        hp_dtype: dtype the rotated latent is rounded to before quantization (the BF16 tier).

    Returns:
        fp32 ``[T, R]``.
    """
    rot = (c.float() @ r).to(hp_dtype)
    # the served latent's groups (128 when --kv-cache-quant-group-size is unset), as reference.latent's
    qr = quantize_rows(rot.unsqueeze(1), **{**config.quant_kwargs("k"), "group_size": latent_group_size(config, c.shape[-1])})
    return dequantize_rows(qr)[:, 0] @ r.T


def mla_output(call: AttentionCall, b: int, c: torch.Tensor | None, r: torch.Tensor | None, config: OscarConfig,
               window_mode: str, quantize: bool = True) -> torch.Tensor:
    """Oracle output ``[T, H, D_v]`` (fp32) of an MLA layer; ``r=None`` -> exact fp32 attention.

    Args:
        c: the layer's latent ``[T, kv_lora_rank]`` for batch row ``b`` (post ``kv_a_layernorm``).

    Raises:
        CalibrationError: the call's sparse attention drops keys (:func:`check_dense`).
    """
    check_dense(call)
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
