"""The oracle of the packed MLA latent cache: absorbed-MQA attention over INT2 latents.

MLA layers (DeepSeek-V2/V3, GLM-5 ``glm_moe_dsa``, Kimi-K2.5, the MLA layers of Kimi-Linear)
cache per token and layer one latent ``c_kv`` (``R = kv_lora_rank`` = 512, after
``kv_a_layernorm``) and a RoPE part ``k_pe`` (``P = qk_rope_head_dim`` = 64), shared by every head.
This module defines what the packed latent pool and its decode/extend kernels must compute.

SGLang 0.5.16's absorbed path (what this oracle mirrors; paths under ``sglang/srt/``):

* ``kv_b_proj.weight`` ``[H (N + V), R]`` is split per head into ``w_kc [H, N, R]`` and
  ``w_vc [H, R, V]`` (``models/deepseek_common/deepseek_weight_loader.py:630-653``: unflatten to
  ``[H, N + V, R]``, split at ``N = qk_nope_head_dim``, ``w_vc`` transposed); :func:`split_kv_b_proj`.
* ``q_nope_out = bmm(q_nope [H, T, N], w_kc) -> [T, H, R]``
  (``models/deepseek_common/attention_forward_methods/forward_mla.py:534``), RoPE on ``q_pe``
  and ``k_pe`` (``:561``; skipped for Kimi-Linear, ``models/kimi_linear.py:448`` ``skip_rope=True``).
* One MQA over the latent: ``q = [q_nope_out | q_pe]``, ``k = [c_kv | k_pe]``, ``v = c_kv``
  (``forward_mla.py:795-796``, ``:802-809``) on ``RadixAttention(H, R + P, scaling,
  num_kv_heads=1, v_head_dim=R)`` (``models/deepseek_v2.py:1729-1738``); the pool row is
  ``[c_kv | k_pe]``, ``R + P`` elements (``mem_cache/memory_pool.py:3837-3841``, buffer
  ``[slots, 1, R + P]`` at ``:3862-3868``). DSA layers pass the indexer's ``topk_indices``.
* ``scaling = (N + P)^-0.5`` (``models/deepseek_v2.py:1605``), times ``mscale^2`` with
  ``mscale = 0.1 mscale_all_dim ln(factor) + 1`` under YaRN rope scaling (``:1723-1724``,
  ``configs/model_config.py:1881-1900``; :func:`..rotation.geometry.mla_softmax_scale`).
* ``o_latent [T, H, R]`` (``forward_mla.py:822``) -> ``bmm(o_latent [H, T, R], w_vc) -> [T, H, V]``
  (``:968``, ``:978-984``).

Algebra (per head ``h``, row vectors, ``W_UK = w_kc[h]`` ``[N, R]``, ``W_UV = w_vc[h]`` ``[R, V]``).
Non-absorbed MLA expands ``k_nope = c W_UK^T`` and ``v = c W_UV``; absorbed:

    q_nope . k_nope = q_nope . (c W_UK^T) = (q_nope W_UK) . c = q_abs . c
    score_j = (q_abs . c_j + q_pe . k_pe_j) * scaling
    o = sum_j p_j v_j = (sum_j p_j c_j) W_UV = o_latent W_UV

With the layer's orthogonal latent rotation ``Rot`` (``[R, R]``, :class:`..rotation.latent.LatentRotationSet`,
``c' = c Rot`` is what is cached): ``q_abs . c = (q_abs Rot) . (c Rot)`` because ``Rot Rot^T = I``,
so the query is rotated like the latent (``q_abs' = q_abs Rot``), and ``o_latent = (sum_j p_j c'_j) Rot^T``
(the latent output is counter-rotated before ``W_UV``). ``k_pe`` is never rotated or quantized.

Tiers (as the MHA pool, :mod:`.attention` step 3, :mod:`.masks`): every latent is stored as INT2
codes of ``bf16(c Rot)`` (:func:`sglang_oscar.quant.quantize_rows`, groups of ``G`` along the
rank, K's clip ratio -- the calibration's ``latent_fake_quant`` uses the same) and the sink/recent
window tokens keep the full BF16 row ``[bf16(c Rot) | k_pe]``; ``window_mode`` ``"decode"`` /
``"extend"`` / ``"none"`` pick the tier per (query, key). ``k_pe`` is BF16 in both tiers. The
attention math is fp32 (every concatenation of a dequantized latent with ``k_pe`` is fp32 here;
a kernel concatenates in BF16 or wider, never cast down to an FP8 checkpoint's weight dtype).

``cache="bf16"`` is the fake-quant pool the upstream shipped: the middle tier holds
``bf16(deq(quant(bf16(c Rot))) Rot^T)`` in the model frame, the windows ``bf16(c)``, and the query
is not rotated. It computes the same function as ``cache="int2"`` up to BF16 rounding of the
stored latents (tested to rel. L2 < 5e-3).

DSA (GLM-5 sparse attention): ``topk_indices [Tq, k]`` int, absolute token positions of the
request (``-1`` = unused slot, as SGLang's indexer pads; ``sglang/kernels/ops/attention/dsa/
transform_index.py:59-64`` maps them through the page table and keeps ``-1``), restrict each query
to the selected keys; the indexer itself is SGLang's, its own key buffer untouched.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import OscarConfig, latent_group_size
from ..quant.int2 import QuantizedRows, dequantize_rows, quantize_rows
from .attention import attend
from .masks import selection_mask

CACHE_KINDS = ("int2", "bf16")
OUTPUTS = ("v", "latent", "latent_rotated")


def split_kv_b_proj(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight`` -> ``(w_kc [H, N, R], w_vc [H, R, V])`` in SGLang's convention.

    Args:
        weight: ``[H * (N + V), R]`` (``nn.Linear`` layout: output rows, latent columns), per head
            the ``N`` k_nope rows then the ``V`` value rows (``deepseek_weight_loader.py:630-632``).

    Returns:
        fp32 ``w_kc`` with ``q_abs = q_nope @ w_kc[h]`` and fp32 ``w_vc`` with ``o = o_latent @ w_vc[h]``.

    Raises:
        ValueError: the weight does not have ``H * (N + V)`` rows.
    """
    if weight.dim() != 2 or weight.shape[0] != num_heads * (qk_nope_head_dim + v_head_dim):
        raise ValueError(f"kv_b_proj weight {tuple(weight.shape)} is not [{num_heads} * ({qk_nope_head_dim} + "
                         f"{v_head_dim}), kv_lora_rank]")
    w = weight.float().view(num_heads, qk_nope_head_dim + v_head_dim, weight.shape[1])
    return w[:, :qk_nope_head_dim].contiguous(), w[:, qk_nope_head_dim:].transpose(1, 2).contiguous()


@dataclasses.dataclass
class LatentCache:
    """One layer's latent cache for ``T`` tokens.

    Attributes:
        cache: ``"int2"`` (packed pool, rotated frame) or ``"bf16"`` (fake-quant pool, model frame).
        ckv_hp: window tier of the latent, ``[T, R]`` in the HP dtype (``c Rot`` for int2, ``c`` for bf16).
        kpe: ``[T, P]`` ``k_pe`` in the HP dtype (both tiers; never rotated or quantized).
        ckv_low: middle tier, fp32 ``[T, R]``: ``deq(quant(ckv_hp))`` (int2) or
            ``bf16(deq(...) Rot^T)`` as fp32 (bf16).
        quant: :class:`QuantizedRows` of the rotated latents as a pool stores them (codes
            ``uint8 [T, 1, R/4]``, pairs ``[T, 1, 2R/G]``: one "kv head"), the bytes a kernel must read.
        rotation: fp32 ``[R, R]`` used (identity when none was given).
    """

    cache: str
    ckv_hp: torch.Tensor
    kpe: torch.Tensor
    ckv_low: torch.Tensor
    quant: QuantizedRows
    rotation: torch.Tensor


def build_latent_cache(c_kv: torch.Tensor, k_pe: torch.Tensor, rotation: torch.Tensor | None, config: OscarConfig,
                       *, cache: str = "int2", hp_dtype: torch.dtype = torch.bfloat16) -> LatentCache:
    """Rotate, round to HP and quantize the latents of one layer.

    Args:
        c_kv: ``[T, R]`` latents after ``kv_a_layernorm``, any float dtype.
        k_pe: ``[T, P]`` post-RoPE key rope part.
        rotation: ``[R, R]`` orthogonal (``LatentRotationSet.matrix(layer_id)``) or ``None`` (identity).
        config: group size (along the rank; :func:`~sglang_oscar.config.latent_group_size`), K clip
            ratio, quantizer, scale dtype.
        cache: ``"int2"`` or ``"bf16"`` (module docstring).
        hp_dtype: the window tier's dtype (``torch.float32`` for exactness tests).

    Raises:
        ValueError: shapes, an unknown ``cache``, or a group size that does not divide ``R``.
    """
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS}, got {cache!r}")
    if c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.shape[0] != k_pe.shape[0]:
        raise ValueError(f"c_kv {tuple(c_kv.shape)} and k_pe {tuple(k_pe.shape)} must be [T, R] and [T, P] with equal T")
    r = c_kv.shape[-1]
    group = latent_group_size(config, r)
    rot = torch.eye(r, device=c_kv.device) if rotation is None else rotation.to(device=c_kv.device, dtype=torch.float32)
    if tuple(rot.shape) != (r, r):
        raise ValueError(f"latent rotation {tuple(rot.shape)} does not match kv_lora_rank {r}")
    rotated = (c_kv.float() @ rot).to(hp_dtype)
    # one "kv head" per token: the same [slots, 1, ...] row layout as the MHA pool's
    quant = quantize_rows(rotated.unsqueeze(1), **{**config.quant_kwargs("k"), "group_size": group})
    deq = dequantize_rows(quant)[:, 0]
    if cache == "int2":
        return LatentCache(cache, rotated, k_pe.to(hp_dtype), deq, quant, rot)
    # fake-quant pool: what SGLang's unmodified MLA attention would read from a BF16 buffer
    low = (deq @ rot.T).to(torch.bfloat16).float()
    return LatentCache(cache, c_kv.to(hp_dtype), k_pe.to(hp_dtype), low, quant, rot)


def topk_key_mask(topk_indices: torch.Tensor, q_positions: torch.Tensor, seq_len: int):
    """A :func:`.attention.attend` ``key_mask`` from DSA top-k selections.

    Args:
        topk_indices: int ``[Tq, k]`` absolute key positions per query (``-1`` = unused; a
            position selected twice counts once).
        q_positions: int ``[Tq]`` the queries' positions (row ``i`` of ``topk_indices`` belongs to
            ``q_positions[i]``).
        seq_len: ``T``.

    Returns:
        ``(pos [Tq'], T) -> bool [Tq', T]`` (looked up by position, so chunked callers agree).

    Raises:
        ValueError: shape mismatch, or an index outside ``[-1, pos]`` (a causal indexer never
            selects a later token; a wrong index must fail loudly, not be masked away).
    """
    if topk_indices.dim() != 2 or topk_indices.shape[0] != q_positions.numel():
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)} must be [Tq={q_positions.numel()}, k]")
    idx = topk_indices.long().to(q_positions.device)
    if idx.numel() and (int(idx.min()) < -1 or bool((idx > q_positions.view(-1, 1)).any())):
        raise ValueError("topk_indices must lie in [-1, query position] (-1 = unused)")
    sel = torch.zeros(idx.shape[0], seq_len + 1, dtype=torch.bool, device=idx.device)
    sel.scatter_(1, torch.where(idx < 0, seq_len, idx), True)  # -1 lands in a dropped extra column
    return selection_mask(sel[:, :seq_len], q_positions, "topk_indices")


def latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    rotation: torch.Tensor | None,
    config: OscarConfig,
    *,
    softmax_scale: float,
    q_positions: torch.Tensor | None = None,
    window_mode: str = "decode",
    cache: str = "int2",
    topk_indices: torch.Tensor | None = None,
    hp_dtype: torch.dtype = torch.bfloat16,
    latent_cache: LatentCache | None = None,
    output: str = "v",
) -> torch.Tensor:
    """Absorbed-MQA attention of one MLA layer over a packed (or fake-quant) latent cache.

    Args:
        q_nope: ``[Tq, H, N]`` query nope part; q_pe: ``[Tq, H, P]`` post-RoPE query rope part.
        c_kv: ``[T, R]`` latents of the whole sequence (post ``kv_a_layernorm``); k_pe: ``[T, P]``.
        w_kc: ``[H, N, R]``, w_vc: ``[H, R, V]`` (:func:`split_kv_b_proj`).
        rotation: ``[R, R]`` latent rotation of the layer, or ``None`` (identity).
        config: windows (``sink_tokens``, ``recent_tokens``) and quantizer settings.
        softmax_scale: the model's scaling, YaRN ``mscale^2`` included (SGLang's
            ``self.scaling``; :func:`..rotation.geometry.mla_softmax_scale`).
        q_positions: int ``[Tq]`` absolute positions (default: the last ``Tq``).
        window_mode: ``"decode"``, ``"extend"`` (the chunk reads INT2 latents of itself too) or
            ``"none"`` (every key from the window tier: the unquantized model).
        cache: ``"int2"`` or ``"bf16"`` (fake quant).
        topk_indices: optional DSA selection ``[Tq, k]`` (:func:`topk_key_mask`).
        hp_dtype: dtype of the window tier.
        latent_cache: a prebuilt :func:`build_latent_cache` (same ``cache``) to reuse.
        output: ``"v"`` -> ``[Tq, H, V]`` after ``W_UV``; ``"latent"`` -> ``o_latent [Tq, H, R]``
            (model frame); ``"latent_rotated"`` -> ``o_latent Rot`` (what an int2 kernel produces
            before the counter-rotation; for ``cache="bf16"`` the model frame).

    Returns:
        fp32 as chosen by ``output``.

    Raises:
        ValueError: inconsistent shapes or settings.
    """
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    if q_nope.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be [Tq, H, *]")
    tq, h, n = q_nope.shape
    t, r = c_kv.shape
    if tuple(w_kc.shape) != (h, n, r) or w_vc.dim() != 3 or tuple(w_vc.shape[:2]) != (h, r):
        raise ValueError(f"w_kc {tuple(w_kc.shape)} / w_vc {tuple(w_vc.shape)} must be [{h}, {n}, {r}] / [{h}, {r}, V]")
    if q_pe.shape[-1] != k_pe.shape[-1]:
        raise ValueError(f"q_pe rope dim {q_pe.shape[-1]} != k_pe rope dim {k_pe.shape[-1]}")
    if q_positions is None:
        q_positions = torch.arange(t - tq, t, device=q_nope.device)
    if q_positions.numel() != tq or (tq and (int(q_positions.min()) < 0 or int(q_positions.max()) >= t)):
        raise ValueError(f"q_positions must be {tq} positions in [0, {t})")
    lc = latent_cache if latent_cache is not None else build_latent_cache(c_kv, k_pe, rotation, config, cache=cache,
                                                                         hp_dtype=hp_dtype)
    if lc.cache != cache:
        raise ValueError(f"latent_cache was built for cache={lc.cache!r}, not {cache!r}")
    # absorb W_UK into the query (forward_mla.py:534), then rotate it like the cached latent
    q_abs = torch.einsum("thn,hnr->thr", q_nope.float(), w_kc.float())
    if cache == "int2":
        q_abs = q_abs @ lc.rotation
    q = torch.cat([q_abs, q_pe.float()], dim=-1)  # [Tq, H, R + P]
    kpe = lc.kpe.float()
    k_hp = torch.cat([lc.ckv_hp.float(), kpe], dim=-1).unsqueeze(1)  # [T, 1, R + P]: MQA, one kv head
    k_low = torch.cat([lc.ckv_low, kpe], dim=-1).unsqueeze(1)
    key_mask = None if topk_indices is None else topk_key_mask(topk_indices, q_positions, t)
    o = attend(q, q_positions, k_hp, lc.ckv_hp.float().unsqueeze(1), k_low, lc.ckv_low.unsqueeze(1),
               sink=config.sink_tokens, recent=config.recent_tokens, sm_scale=softmax_scale,
               window_mode=window_mode, key_mask=key_mask)  # [Tq, H, R], the cache's frame
    if output == "latent_rotated":
        return o
    if cache == "int2":
        o = o @ lc.rotation.T  # counter-rotate: o_latent = o' Rot^T
    if output == "latent":
        return o
    return torch.einsum("thr,hrv->thv", o, w_vc.float())


def expand_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head K and V of non-absorbed MLA (what expanded-MHA storage caches), fp32.

    ``K_h = [c W_UK^T | k_pe]`` (head_dim ``N + P``, e.g. 192) and ``V_h = c W_UV`` (``V``, e.g. 128):
    SGLang's non-absorbed path (``kv_b_proj`` then concatenation with the shared ``k_pe``).

    Args:
        c_kv: ``[T, R]``; k_pe: ``[T, P]``; w_kc: ``[H, N, R]``; w_vc: ``[H, R, V]``.

    Returns:
        ``(k [T, H, N + P], v [T, H, V])`` fp32.
    """
    c = c_kv.float()
    k_nope = torch.einsum("tr,hnr->thn", c, w_kc.float())
    v = torch.einsum("tr,hrv->thv", c, w_vc.float())
    k = torch.cat([k_nope, k_pe.float().unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1)
    return k, v
