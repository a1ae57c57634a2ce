"""Gluon decode stage 1: the HP and INT2 splits of decode attention with explicit register layouts.

The Triton stage-1 kernel (:mod:`.triton_stage1`) spends about a sixth of its instructions moving the
converted code tiles between the register layout they are loaded in and the layout the tensor
cores read (shared-memory round trips and warp shuffles, ``tests/kernels/sass_loop_count.py``). This
kernel is written in Gluon (``triton.experimental.gluon``), where every tensor's distribution over
lanes and registers is chosen explicitly, and loads the packed codes so that each thread already
holds the words whose codes it feeds to ``mma.sync`` (m16n8k16): no layout change anywhere in the
loop. It computes what :func:`.decode._decode_stage1` computes (same grid, the same split ranges
for the same ``min_split_keys`` -- whose default differs by engine, :func:`.splits.default_min_split_keys`
-- partial outputs and base-2 log-sum-exp, HP splits included), so the merge (stage 2) is shared.

Scope (:func:`gluon_decode_supported`): CUDA sm_80+ (not under ``TRITON_INTERPRET``), K and V
head_dim 128, one (scale, zero) pair per row in fp16, uniform levels, fp16 MMA operands, bf16 or
fp16 HP rows, no logit cap, code / pair buffers readable as 32-bit words; sliding window and
per-request sink lengths are supported. One warp per program, ``BLOCK_N`` keys per iteration.
Keys past a split's range read slot 0 (masked afterwards), so the pool needs a slot 0 (SGLang
keeps it as padding).

How the operands line up (head_dim 128: a K or V row is 32 bytes = 8 words; byte ``j`` holds
the codes of dims ``j, j+32, j+64, j+96`` at bits 0-1, 2-3, 4-5, 6-7, :mod:`sglang_oscar.quant`):

* **Code conversion.** ``w & (3 << 2k | 3 << 16+2k)`` leaves two fp16 *subnormals* in a 32-bit
  register, of value ``c * 2^(2k-24)`` (``k`` = the quarter); ``w >> 8`` does the same for the odd
  bytes. One AND per two codes, one shift per word, no int->float conversion; q carries
  ``2^(8-2k)`` so every product is ``q c 2^-16`` (the Triton kernel's ``CONVERT=5`` operands).
* **K (scores, S^T = codes q^T).** The A operand ``[BLOCK_N, 128]`` of ``mma.sync`` gives thread
  ``(g, t)`` (``lane = 4 g + t``) rows ``g, g+8, ...`` and, per row, 32 of the 128 reduction
  positions. Those are made the 32 codes of words ``2t, 2t+1`` of the row (one 8-byte load when
  the byte strides are multiples of 16, as Triton specialises them; two 4-byte loads otherwise,
  e.g. 36-byte code + pair rows, the benchmarks' ``rows`` layout): the reduction order is free, so the
  logical column ``c`` is *defined* as the dim those codes belong to (:func:`k_column_dims`) and q
  is loaded in the same order.
* **V (values, O^T = codes^T P^T).** The A operand ``[128, BLOCK_N]`` gives thread ``(g, t)`` 16
  output rows and, per 16 keys, keys ``2t, 2t+1, 2t+8, 2t+9``: the 16 codes of word ``g`` of each
  of those keys (one 4-byte load per key). Two keys' bytes are paired with one ``prmt`` so a
  register holds the same dim of keys ``2t`` and ``2t+1``. Output row ``r`` is dim
  :func:`v_row_dims` ``[r]``; the epilogue stores through that map and undoes ``2^(2k-24)``.
* **P.** The score accumulator (rows = keys) is the transpose of the B operand the value MMA
  needs (rows = keys along the reduction); one ``movmatrix.trans`` per 8x8 tile moves it.

Numerics follow :mod:`.tiles`' token-major path: per block a fresh MMA, folded into the running
accumulator with an fp32 FMA (tensor cores truncate when they accumulate, and the zero-point
correction would amplify it; docs/benchmarks.md, "accumulation fix"); ``P`` is scaled by
``v_scale / ref`` (``ref`` = running max of the V scales) so the fp16 operand stays in ``[0, 1]``.
"""


from __future__ import annotations

import functools

import torch

from ..compile_check import active as _compiling_offline
from ..compile_check import interpreting as _interpreting
from ..compile_check import launch as _launch
from ..compile_check import row_args
from ..validate import needs_idx64
from .gluon_kernel import HAVE_GLUON
from .gluon_operands import HEAD_DIM, head_blocks

if HAVE_GLUON:
    from .gluon_kernel import _gluon_decode_stage1



_CAPABILITY: dict = {}


def _capability(device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def _words_viewable(t: torch.Tensor) -> bool:
    """Whether ``t.view(torch.int32)`` works: last dim contiguous, its bytes, the other strides and the
    storage offset all multiples of 4 bytes (memoized on those numbers: this runs on every call)."""
    return _viewable(t.stride(), t.storage_offset(), t.shape[-1], t.element_size())


@functools.lru_cache(maxsize=256)
def _viewable(strides: tuple, offset: int, last: int, es: int) -> bool:
    return (strides[-1] == 1 and (last * es) % 4 == 0 and (offset * es) % 4 == 0
            and all((st * es) % 4 == 0 for st in strides[:-1]))


def gluon_layout_reason(layout) -> str | None:
    """``None`` when the Gluon engine handles INT2 rows of ``layout`` (``Int2Layout``), else why not:
    the part of :func:`gluon_decode_supported` a server can check before loading weights."""
    if layout.k.head_dim != HEAD_DIM or layout.v.head_dim != HEAD_DIM:
        return f"head_dim {layout.k.head_dim}/{layout.v.head_dim} (built for {HEAD_DIM})"
    if layout.k.num_groups != 1 or layout.v.num_groups != 1:
        return "more than one (scale, zero) group per row"
    if layout.lloyd:
        return "Lloyd-Max levels"
    if layout.scale_dtype != torch.float16:
        return f"scale dtype {layout.scale_dtype}"
    return None


def gluon_decode_supported(layout, q: torch.Tensor, mma_dtype: torch.dtype, has_cap: bool,
                           hp_dtype: torch.dtype | None = None, buffers: tuple = ()) -> str | None:
    """``None`` when :func:`launch_gluon_decode` handles this decode call, else the reason it does not.

    Args:
        layout: the call's ``Int2Layout``; q: ``[B, H_q, D_k]`` or the device it is on (the device decides);
        mma_dtype: the resolved MMA operand dtype; has_cap: a logit cap is set;
        hp_dtype: dtype of the HP rows (bf16 / fp16 supported; ``None`` = not checked);
        buffers: the code and pair buffers, which the kernel reads as 32-bit words.
    """
    if not HAVE_GLUON:
        return "triton has no Gluon"
    if _interpreting():
        return "TRITON_INTERPRET is set (Gluon kernels do not run under the interpreter)"
    if not _compiling_offline():  # an offline sm_90 compile (compile_check.compile_only) takes CPU tensors
        device = q.device if isinstance(q, torch.Tensor) else torch.device(q)
        if device.type != "cuda":
            return "not a CUDA device"
        if _capability(device) < (8, 0):
            return "needs sm_80+ (mma.sync m16n8k16, movmatrix)"
    reason = gluon_layout_reason(layout)
    if reason is not None:
        return reason
    if mma_dtype != torch.float16:
        return f"MMA operands {mma_dtype}"
    if hp_dtype is not None and hp_dtype not in (torch.bfloat16, torch.float16):
        return f"HP rows in {hp_dtype} (bf16 or fp16)"
    if has_cap:
        return "logit cap"
    for t in buffers:
        if not _words_viewable(t):
            return (f"a code / pair buffer (shape {tuple(t.shape)}, strides {t.stride()}, offset "
                    f"{t.storage_offset()}) cannot be read as 32-bit words")
    return None


def launch_gluon_decode(q, k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v, hp_index, req_to_token, req_pool_indices,
                        seq_lens, sink_lens, o_part, lse, *, qscale: float, sink: int, recent: int, sliding_window,
                        num_hp_splits: int, num_kv_splits: int, block_n: int, min_chunk: int = 0,
                        maxnreg: int | None = None) -> None:
    """Launch stage 1 of decode attention: ``num_hp_splits`` HP splits then ``num_kv_splits`` INT2 splits.

    Arguments as in :class:`.plan.DecodePlan` (which checked them, and :func:`gluon_decode_supported`
    returned ``None``):
    ``q [B, H_q, 128]``, the INT2 buffers (uint8 codes ``[S, H_kv, 32]``, fp16 pairs
    ``[S, H_kv, 2]``), the HP buffers ``[R, H_kv, 128]`` (bf16 / fp16) and ``hp_index``, the index
    tensors, the stage-1 workspace ``o_part [B, H_q, splits, 128]`` / ``lse [B, H_q, splits]``
    (fp32) it writes into, ``qscale`` (softmax scale x log2 e), ``min_chunk`` (an INT2 split
    covers at least this many positions, a multiple of ``block_n``: :func:`.tiles.int2_split_range`),
    ``maxnreg`` (register cap given to ptxas; ``None`` = none). The grid depends only on host
    constants (CUDA graphs).

    Raises:
        ValueError: a code or pair buffer whose rows cannot be read as 32-bit words (callers check
            :func:`gluon_decode_supported` first, which names that case).
    """
    bsz, hq, _ = q.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    bpk = head_blocks(group)
    try:  # read as int32 words through byte pointers (the strides below are in bytes)
        kc, vc = k_codes.view(torch.int32).view(torch.uint8), v_codes.view(torch.int32).view(torch.uint8)
        kp, vp = k_pairs.view(torch.int32).view(torch.uint8), v_pairs.view(torch.int32).view(torch.uint8)
    except RuntimeError as e:
        raise ValueError(f"the Gluon engine reads codes and pairs as 32-bit words; these buffers cannot be viewed "
                         f"so ({e}); allocate them with Int2Layout.allocate") from e
    _launch(_gluon_decode_stage1, (bsz, hkv * bpk, num_hp_splits + num_kv_splits),
        *row_args(q, kc, kp, vc, vp, hp_k, hp_v), hp_index, hp_index.stride(0),
        req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens,
        req_to_token if sink_lens is None else sink_lens,
        o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse, lse.stride(0), lse.stride(1),
        qscale, sink, recent, sliding_window or 0, num_hp_splits, num_kv_splits,
        min_chunk,
        GROUP=group, BLOCKS_PER_KV=bpk, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, HAS_SINKL=sink_lens is not None, IDX64=needs_idx64(kc, kp, vc, vp),
        HP_BLOCK=16,
        num_warps=1, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )

