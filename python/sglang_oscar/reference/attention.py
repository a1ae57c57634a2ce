"""The oracle: attention of one layer over an OSCAR INT2 cache, in plain PyTorch.

This module *defines* correct behaviour; every Triton kernel and the SGLang path are tested
against it. Definition (docs/design.md):

1. Rotate: ``k' = k R_k``, ``v' = v R_v``, ``q' = q R_k`` (per layer, or per kv head with each
   query head using its kv head's matrix). Rotated K/V rows are rounded to the HP dtype
   (BF16): that is what the BF16 tier stores.
2. Quantize every rotated row from its HP value (:func:`sglang_oscar.quant.quantize_rows` with
   the K or V clip ratio), so writing a row directly and flushing it later give the same bytes.
3. Which keys a query reads in HP (``window_mode``); all other keys are dequantized INT2:

   * ``"decode"``: for a query at absolute position ``i`` (it sees keys ``0..i``), key ``j``
     is HP iff ``j < sink`` or ``j > i - recent`` (the ``recent`` newest positions, ``i``
     included). This is what a decode step reads.
   * ``"extend"``: key ``j`` is HP iff ``j < sink``; the tokens of a prefill/extend batch
     attend to the quantize-dequantized K/V of the prefix *and of the batch itself*. This is
     what prefill/extend reads, so the result of a position does not depend on how the prompt
     was split into chunks or how much of it came from the prefix cache.
   * ``"none"``: every key HP (the rotated BF16 model).
4. Attend in fp32: scores ``q'.k'^T * sm_scale``, optional logit cap ``cap * tanh(s / cap)``,
   causal mask, optional sliding window (key ``j`` visible iff ``i - j < sliding_window``; the
   convention and SGLang's off-by-one in its Triton decode are in :mod:`.masks`), softmax with
   optional attention-sink logits in the denominator (below), weighted sum of the V rows (HP or
   dequantized as in 3).
5. Counter-rotate the output: ``o = o' R_v^T`` (or leave it in the rotated frame).

Attention sinks (GPT-OSS's learned per-head ``sinks``, the ``sinks`` argument of SGLang's
backends): one logit ``s_h`` per *query* head in natural-log units, taken as is -- not multiplied
by ``sm_scale``, not soft-capped, not rotated -- and added to the softmax denominator only:
``p_j = exp(x_j) / (sum_{visible l} exp(x_l) + exp(s_h))``, no value row. That is what SGLang
0.5.16's Triton kernels do after the scaled, capped scores: decode stage 2
(``sglang/kernels/ops/attention/decode_attention.py:797-799``: ``e_sum += exp(sink[head] - e_max)``)
and extend (``extend_attention.py:629-631`` and ``:1134-1137``: ``deno += exp(sink[head] - e_max)``),
with ``sink_ptr + cur_head`` indexing query heads.

K shared as V (``k_eq_v``): a layer whose cached V is its cached K bit for bit stores one tensor;
V is read from K's quantized rows, so the value rotation and mean are the key's (``R_v = R_k``,
``mean_v = mean_k``), V's codes are K's (K's clip ratio) and the output is counter-rotated with
``R_k^T``. Gemma-4's ``attention_k_eq_v`` full layers are *not* such layers in SGLang 0.5.16:
V comes from the same projection as K, but K is ``RoPE(k_norm(x W_k))`` (scaled RMSNorm, partial
RoPE) and V is ``v_norm(x W_k)`` (RMSNorm without scale, no RoPE)
(``sglang/srt/models/gemma4_causal.py:1256-1265`` and ``:1330`` load ``k_proj`` into both the K
and V shards, ``:349-351`` define ``v_norm`` without scale, ``:432-474`` normalise K with ``k_norm``
and V with ``v_norm``, ``:492`` ropes K only, ``:500-506`` pass both to the backend; the same in
transformers ``modeling_gemma4.py:1257-1265``), so they store both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ..config import OscarConfig
from ..quant.int2 import QuantizedRows, dequantize_rows, quantize_rows
from ..rotation.fit import gqa_group
from .masks import WINDOW_MODES, hp_window_mask, visible_mask

QUERY_CHUNK = 256


def _expand_rotation(r: torch.Tensor, num_heads: int, num_kv_heads: int | None = None) -> torch.Tensor:
    """``[D, D]`` or ``[H_kv, D, D]`` -> fp32 ``[num_heads, D, D]``; per-head sets repeat over GQA groups."""
    r = r.float()
    if r.dim() == 2:
        return r.unsqueeze(0).expand(num_heads, *r.shape)
    if r.dim() != 3 or (num_kv_heads is not None and r.shape[0] != num_kv_heads):
        raise ValueError(f"rotation of shape {tuple(r.shape)} does not match {num_kv_heads} kv heads")
    try:
        group = gqa_group(num_heads, r.shape[0])
    except ValueError:
        raise ValueError(f"per-head rotation of shape {tuple(r.shape)} does not fit {num_heads} heads") from None
    return r.repeat_interleave(group, dim=0)


def rotate_rows(
    x: torch.Tensor, rotation: torch.Tensor, transpose: bool = False, num_kv_heads: int | None = None
) -> torch.Tensor:
    """Rotate rows ``x [T, H, D]`` by ``x R`` (or ``x R^T``) in fp32.

    Args:
        x: ``[T, H, D]`` any float dtype.
        rotation: ``[D, D]`` (shared) or ``[H_kv, D, D]`` with ``H % H_kv == 0`` (head ``h``
            uses matrix ``h // (H / H_kv)``, the GQA mapping).
        transpose: multiply by ``R^T`` (the counter-rotation).
        num_kv_heads: if given, a per-head ``rotation`` must have exactly this many matrices.

    Returns:
        fp32 ``[T, H, D]``.

    Raises:
        ValueError: shape mismatch.
    """
    if x.dim() != 3:
        raise ValueError(f"rows must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    if rotation.shape[-1] != x.shape[-1] or rotation.shape[-2] != x.shape[-1]:
        raise ValueError(f"rotation {tuple(rotation.shape)} does not match head_dim {x.shape[-1]}")
    r = _expand_rotation(rotation, x.shape[1], num_kv_heads)
    if transpose:
        r = r.transpose(-1, -2)
    return torch.einsum("thd,hde->the", x.float(), r)


@dataclasses.dataclass
class ReferenceCache:
    """Contents of an OSCAR cache for one layer and one sequence of ``T`` tokens.

    Attributes:
        k_hp, v_hp: rotated rows in the HP dtype, ``[T, H_kv, D_k]`` / ``[T, H_kv, D_v]``.
        k_quant, v_quant: :class:`QuantizedRows` of every position (codes ``[T, H_kv, D/4]``,
            pairs ``[T, H_kv, 2*D/G]``) -- the bytes kernels must reproduce.
        k_deq, v_deq: fp32 dequantized rows.
    """

    k_hp: torch.Tensor
    v_hp: torch.Tensor
    k_quant: QuantizedRows
    v_quant: QuantizedRows
    k_deq: torch.Tensor
    v_deq: torch.Tensor


def center_rows(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``x - mean`` in fp32 (``x`` unchanged, as fp32, when ``mean`` is ``None``).

    Args:
        x: ``[T, H_kv, D]`` rows, any float dtype.
        mean: ``[H_kv, D]`` per-kv-head mean (``RotationSet.k_mean`` / ``v_mean``) or ``None``.

    Raises:
        ValueError: ``mean`` is not ``[H_kv, D]`` for ``x``.
    """
    if mean is None:
        return x.float()
    if tuple(mean.shape) != tuple(x.shape[1:]):
        raise ValueError(f"mean of shape {tuple(mean.shape)} does not match rows [T, H_kv, D] = {tuple(x.shape)}")
    return x.float() - mean.to(device=x.device, dtype=torch.float32)


def build_cache(
    k: torch.Tensor,
    v: torch.Tensor | None,
    rotation_k: torch.Tensor,
    rotation_v: torch.Tensor | None,
    config: OscarConfig,
    hp_dtype: torch.dtype = torch.bfloat16,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
    *,
    k_eq_v: bool = False,
) -> ReferenceCache:
    """Centre (optional), rotate, round to HP and quantize the K/V rows of one layer:
    ``bf16((x - mean) R)`` in both tiers.

    Args:
        k: ``[T, H_kv, D_k]`` post-RoPE keys; v: ``[T, H_kv, D_v]`` values (``None`` with ``k_eq_v``).
        rotation_k, rotation_v: ``[D, D]`` or ``[H_kv, D, D]`` (``rotation_v`` unused with ``k_eq_v``).
        config: quantizer settings (group size, clip ratios, quantizer, scale dtype).
        hp_dtype: dtype of the BF16 tier.
        k_mean, v_mean: optional ``[H_kv, D_k]`` / ``[H_kv, D_v]`` centering means (model frame).
        k_eq_v: the layer caches one tensor for K and V (module docstring): the V fields of the
            result *are* the K fields (same HP rows, same codes, quantized with K's clip ratio).

    Raises:
        ValueError: shapes, group size or settings that the format does not support.
    """
    if k_eq_v:
        if k.dim() != 3:
            raise ValueError(f"k {tuple(k.shape)} must be [T, H_kv, D]")
        if v is not None:
            raise ValueError("k_eq_v caches V as K's rows: pass v=None (oscar_attention checks a given v equals k)")
        config.check_head_dims(k.shape[-1])
        k_hp = rotate_rows(center_rows(k, k_mean), rotation_k, num_kv_heads=k.shape[1]).to(hp_dtype)
        kq = quantize_rows(k_hp, **config.quant_kwargs("k"))
        k_deq = dequantize_rows(kq)
        return ReferenceCache(k_hp, k_hp, kq, kq, k_deq, k_deq)
    if v is None or rotation_v is None:
        raise ValueError("v and rotation_v are required unless k_eq_v")
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, H_kv, D] with equal T and H_kv")
    config.check_head_dims(k.shape[-1], v.shape[-1])
    k_hp = rotate_rows(center_rows(k, k_mean), rotation_k, num_kv_heads=k.shape[1]).to(hp_dtype)
    v_hp = rotate_rows(center_rows(v, v_mean), rotation_v, num_kv_heads=v.shape[1]).to(hp_dtype)
    kq = quantize_rows(k_hp, **config.quant_kwargs("k"))
    vq = quantize_rows(v_hp, **config.quant_kwargs("v"))
    return ReferenceCache(k_hp, v_hp, kq, vq, dequantize_rows(kq), dequantize_rows(vq))


def attend(
    q_rot: torch.Tensor,
    q_positions: torch.Tensor,
    k_hp: torch.Tensor,
    v_hp: torch.Tensor,
    k_low: torch.Tensor | None,
    v_low: torch.Tensor | None,
    *,
    sink: int,
    recent: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    window_mode: str = "decode",
    hp_masks: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    sinks: torch.Tensor | None = None,
    key_mask: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of rotated queries over a two-tier cache (fp32 math).

    Args:
        q_rot: ``[Tq, H_q, D_k]`` rotated queries; q_positions: int ``[Tq]`` absolute positions.
        k_hp, v_hp: ``[T, H_kv, D]`` HP rows (rotated frame).
        k_low, v_low: ``[T, H_kv, D]`` low-precision (dequantized) rows, or ``None`` to read
            every key in HP.
        sink, recent: HP window sizes (tokens).
        sm_scale: softmax scale.
        sliding_window: keys visible to query ``i`` satisfy ``i - j < sliding_window`` (HF
            semantics: the window counts the query's own position; SGLang's
            ``sliding_window_size`` is this minus one with an inclusive compare; its Triton
            decode reads one key fewer, see :mod:`.masks`). Applies to both tiers.
        logit_cap: ``cap * tanh(s / cap)`` if set.
        window_mode: ``"decode"``, ``"extend"`` or ``"none"`` (:func:`hp_window_mask`; only
            used when ``k_low``/``v_low`` are given).
        hp_masks: optional ``(q_positions [Tq'], T) -> (hp_k, hp_v)`` bool ``[Tq', T]`` masks of the
            keys and values read from HP; replaces the sink/recent rule (``sink``, ``recent``,
            ``window_mode``) for caches whose K and V windows differ (the KIVI baseline,
            :func:`..quant.baselines.kivi_hp_masks`). Called once per query chunk.
        sinks: optional attention-sink logits, float ``[H_q]`` (one per query head, natural-log
            units, used as given: no ``sm_scale``, no cap): ``exp(sinks[h])`` joins the softmax
            denominator of head ``h``, with no value row (module docstring).
        key_mask: optional ``(q_positions [Tq'], T) -> bool [Tq', T]`` or ``[H_kv, Tq', T]``:
            keys a query may attend at all, ANDed with the causal/sliding visibility. ``[Tq', T]``
            is shared by every head (GLM-5's DSA top-k, :func:`.latent.topk_key_mask`);
            ``[H_kv, Tq', T]`` is one mask per kv head, applied to that kv head's GQA group of
            query heads ``h * H_q/H_kv .. (h+1) * H_q/H_kv - 1`` (MiniMax-M3's per-kv-head block
            selection, :func:`.sparse.block_topk_key_mask`). Called once per query chunk; every
            (head, query) must keep at least one visible key.

    Returns:
        fp32 ``[Tq, H_q, D_v]`` in the rotated V frame.

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, ``sliding_window < 1``, ``sinks`` not ``[H_q]``,
            a ``key_mask`` of another shape, or one that leaves a (head, query) without a key.
    """
    tq, hq, _ = q_rot.shape
    t, hkv, _ = k_hp.shape
    g = gqa_group(hq, hkv)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (keys attended, the query's own included), got {sliding_window}")
    if sinks is not None:
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must be one logit per query head, [{hq}], got {tuple(sinks.shape)}")
        sink_logits = sinks.to(device=q_rot.device, dtype=torch.float32).view(hq, 1, 1)
    if tq == 0:
        return q_rot.new_zeros(0, hq, v_hp.shape[-1], dtype=torch.float32)
    outs = []
    for start in range(0, tq, QUERY_CHUNK):
        qs = q_rot[start : start + QUERY_CHUNK].float()
        pos = q_positions[start : start + QUERY_CHUNK]
        visible = visible_mask(pos, t, sliding_window)
        if key_mask is not None:
            km = key_mask(pos, t).to(device=visible.device, dtype=torch.bool)
            if tuple(km.shape) == (pos.numel(), t):
                visible = visible & km
            elif tuple(km.shape) == (hkv, pos.numel(), t):
                # per-kv-head selection: query head h reads kv head h // g (gqa_group), so it takes that row
                visible = (visible.unsqueeze(0) & km).repeat_interleave(g, dim=0)
            else:
                raise ValueError(f"key_mask returned {tuple(km.shape)}, expected [{pos.numel()}, {t}] (shared) "
                                 f"or [{hkv}, {pos.numel()}, {t}] (per kv head)")
            if not bool(visible.any(dim=-1).all()):
                # softmax over no key is NaN: a selection must keep at least one key per query
                raise ValueError("key_mask leaves a query with no visible key")
        kh = k_hp.float().repeat_interleave(g, dim=1)
        vh = v_hp.float().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,thd->hqt", qs, kh)
        if hp_masks is not None:
            hp_k, hp = hp_masks(pos, t)
        else:
            hp = hp_k = hp_window_mask(pos, t, sink, recent, window_mode)
        if k_low is not None:
            s_low = torch.einsum("qhd,thd->hqt", qs, k_low.float().repeat_interleave(g, dim=1))
            s = torch.where(hp_k.unsqueeze(0), s, s_low)
        s = s * sm_scale
        if logit_cap is not None and logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        s = s.masked_fill(~(visible if visible.dim() == 3 else visible.unsqueeze(0)), float("-inf"))
        if sinks is not None:
            # the sink is one more softmax entry per head whose probability is dropped: it only
            # enlarges the denominator (it has no value row)
            sink_col = sink_logits.expand(hq, s.shape[1], 1)
            p = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :t]
        else:
            p = torch.softmax(s, dim=-1)
        if v_low is not None:
            vl = v_low.float().repeat_interleave(g, dim=1)
            o = torch.einsum("hqt,thd->qhd", p * hp.unsqueeze(0), vh) + torch.einsum(
                "hqt,thd->qhd", p * (~hp).unsqueeze(0), vl
            )
        else:
            o = torch.einsum("hqt,thd->qhd", p, vh)
        outs.append(o)
    return torch.cat(outs, dim=0)


def oscar_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    rotation_k: torch.Tensor,
    rotation_v: torch.Tensor | None,
    config: OscarConfig,
    *,
    q_positions: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sm_scale: float | None = None,
    quantize: bool = True,
    window_mode: str = "decode",
    counter_rotate: bool = True,
    hp_dtype: torch.dtype = torch.bfloat16,
    cache: ReferenceCache | None = None,
    k_mean: torch.Tensor | None = None,
    v_mean: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_eq_v: bool = False,
) -> torch.Tensor:
    """Attention output of one layer with an OSCAR INT2 cache (the oracle).

    With centering (``k_mean`` / ``v_mean``) both tiers hold ``(x - mean) R``: every score of a
    query drops by the same ``q . k_mean``, which the softmax ignores (so a logit cap, which does
    not, is refused), and ``v_mean`` is added back to the output (the probabilities sum to 1).
    Attention sinks break both (the sink logit is not shifted; the key probabilities sum to less
    than 1), so means with ``sinks`` are refused.

    Args:
        q: ``[Tq, H_q, D_k]`` post-RoPE queries at ``q_positions``.
        k: ``[T, H_kv, D_k]`` post-RoPE keys of the whole sequence; v: ``[T, H_kv, D_v]``
            (with ``k_eq_v``: ``None`` or equal to ``k``).
        rotation_k, rotation_v: ``[D, D]`` per layer or ``[H_kv, D, D]`` per kv head (with
            ``k_eq_v``: ``rotation_v`` ``None`` or equal to ``rotation_k``).
        config: windows and quantizer settings.
        q_positions: int64 ``[Tq]`` absolute positions of the queries (default: the last
            ``Tq`` positions, ``T - Tq .. T - 1``; decode is ``Tq = 1``).
        sliding_window, logit_cap, sm_scale: as in :func:`attend`; ``sm_scale`` defaults to
            ``1/sqrt(D_k)``.
        quantize: ``False`` reads every key from the HP tier (the rotated BF16 model).
        window_mode: ``"decode"`` (per-query recent window; decode steps) or ``"extend"``
            (only the sink in HP; prefill/extend batches). See the module docstring.
        counter_rotate: return ``o R_v^T`` (model frame) instead of the rotated frame.
        hp_dtype: dtype of the HP tier (``torch.float32`` for exactness tests).
        cache: a prebuilt :func:`build_cache` result to reuse (built with the same means).
        k_mean, v_mean: optional ``[H_kv, D_k]`` / ``[H_kv, D_v]`` centering means (model frame;
            with ``k_eq_v``: ``v_mean`` ``None`` or equal to ``k_mean``).
        sinks: optional float ``[H_q]`` attention-sink logits (:func:`attend`).
        k_eq_v: the layer caches V as its K rows (module docstring): one stored tensor, V read
            from K's codes, the output counter-rotated with ``R_k^T`` and ``k_mean`` added back.

    Returns:
        fp32 ``[Tq, H_q, D_v]``.

    Raises:
        ValueError: inconsistent shapes or settings; ``k_mean`` with a logit cap; a mean with sinks; with
            ``k_eq_v``, a ``v``, ``rotation_v`` or ``v_mean`` that differs from K's.
    """
    if k_mean is not None and logit_cap:
        raise ValueError("key centering (k_mean) shifts the scores by q . k_mean, which a logit cap does not "
                         "ignore: use a rotation set without k_mean for soft-capped models")
    if sinks is not None and (k_mean is not None or v_mean is not None):
        # k_mean shifts the scores by q . k_mean but not the sink logit (the softmax changes); with a
        # sink the probabilities sum to less than 1, so adding v_mean back whole would be wrong too
        raise ValueError("centering (k_mean / v_mean) does not commute with attention sinks (the sink logit is "
                         "not shifted by q . k_mean, and the key probabilities no longer sum to 1): use a rotation "
                         "set without means for models with sinks")
    if k_eq_v:
        # one stored tensor: V is K's rows, in K's frame, with K's mean
        if v is not None and not torch.equal(v, k):
            raise ValueError("k_eq_v: the cached V is the cached K, but the v passed differs from k; a layer whose "
                             "V differs from K (other norm or RoPE, e.g. Gemma-4's attention_k_eq_v layers) stores "
                             "both: k_eq_v=False")
        if rotation_v is not None and not torch.equal(rotation_v.float(), rotation_k.float()):
            raise ValueError("k_eq_v: V is read from K's rotated codes, so the V rotation must equal the K rotation "
                             "(R_v = R_k); pass rotation_v=None or the K rotation")
        if v_mean is not None and (k_mean is None or not torch.equal(v_mean.float(), k_mean.float())):
            raise ValueError("k_eq_v: V is read from K's centred rows, so v_mean must equal k_mean (or be None)")
        v, rotation_v, v_mean = k, rotation_k, k_mean
    if q.dim() != 3:
        raise ValueError(f"q must be [Tq, H_q, D], got {tuple(q.shape)}")
    t = k.shape[0]
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim {q.shape[-1]} != k head_dim {k.shape[-1]}")
    if q_positions is None:
        q_positions = torch.arange(t - q.shape[0], t, device=q.device)
    if q_positions.numel() != q.shape[0] or (q_positions.numel() and (int(q_positions.min()) < 0 or int(q_positions.max()) >= t)):
        raise ValueError(f"q_positions must be {q.shape[0]} positions in [0, {t})")
    if cache is None:
        if k_eq_v:
            cache = build_cache(k, None, rotation_k, None, config, hp_dtype, k_mean=k_mean, k_eq_v=True)
        else:
            cache = build_cache(k, v, rotation_k, rotation_v, config, hp_dtype, k_mean=k_mean, v_mean=v_mean)
    q_rot = rotate_rows(q, rotation_k, num_kv_heads=k.shape[1])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    o = attend(
        q_rot,
        q_positions,
        cache.k_hp,
        cache.v_hp,
        cache.k_deq if quantize else None,
        cache.v_deq if quantize else None,
        sink=config.sink_tokens,
        recent=config.recent_tokens,
        sm_scale=scale,
        sliding_window=sliding_window,
        logit_cap=logit_cap,
        window_mode=window_mode,
        sinks=sinks,
    )
    if v_mean is not None:
        if tuple(v_mean.shape) != tuple(v.shape[1:]):
            raise ValueError(f"v_mean of shape {tuple(v_mean.shape)} does not match values {tuple(v.shape)}")
        mv = v_mean.to(device=v.device, dtype=torch.float32).unsqueeze(0)  # [1, H_kv, D_v]
        if not counter_rotate:
            mv = rotate_rows(mv, rotation_v, num_kv_heads=k.shape[1])
        o_mean = mv[0].repeat_interleave(q.shape[1] // k.shape[1], dim=0)  # [H_q, D_v]
    else:
        o_mean = None
    if counter_rotate:
        o = rotate_rows(o, rotation_v, transpose=True, num_kv_heads=k.shape[1])
    return o if o_mean is None else o + o_mean


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sm_scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unrotated, unquantized causal attention in fp32 (the BF16 model's answer).

    Args:
        q: ``[Tq, H_q, D]``; k: ``[T, H_kv, D]``; v: ``[T, H_kv, D_v]``; other arguments as in
            :func:`oscar_attention`.

    Returns:
        fp32 ``[Tq, H_q, D_v]``.

    Raises:
        ValueError: as :func:`attend`.
    """
    t = k.shape[0]
    if q_positions is None:
        q_positions = torch.arange(t - q.shape[0], t, device=q.device)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return attend(q.float(), q_positions, k.float(), v.float(), None, None, sink=0, recent=0, sm_scale=scale,
                  sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks)


def relative_error_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Functional error in dB: ``10 log10(||approx - exact||^2 / ||exact||^2)`` (lower is better)."""
    num = (approx.double() - exact.double()).pow(2).sum()
    den = exact.double().pow(2).sum().clamp_min(1e-300)
    return float(10.0 * torch.log10(num / den).clamp_min(-300.0))
