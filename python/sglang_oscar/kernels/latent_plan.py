"""Decode attention of MLA layers over the packed INT2 latent: plan once per batch, run once per layer.

:class:`LatentDecodePlan` is the latent twin of :class:`~.decode.plan.DecodePlan`: it checks the
batch's tables and one layer's planes, resolves the split count, the grid and the kernel
constants, and takes its stage-1 workspace from a :class:`~.decode.plan.DecodeWorkspace`;
:meth:`LatentDecodePlan.run` launches stage 1 (:mod:`.latent`, or :mod:`.latent_codes`) and the
MHA decode merge for one layer. Everything a plan resolves depends on host constants only (batch
size, heads, the planes' shapes), so a plan built before a CUDA-graph capture stays valid for
every replay of that batch size. :func:`latent_decode_attention` is the one-shot form.
"""

from __future__ import annotations

import torch
import triton

from ..quant.int2 import codebook
from .codes import LOG2E
from .compile_check import launch as _launch
from .decode.merge import launch_merge, merge_launch
from .decode.plan import DecodeWorkspace
from .latent import (PRECISIONS, _latent_decode_stage1, check_dot_options, check_latent_planes, check_latent_width,
                     check_pow2)
from .layout import next_pow2
from .validate import INDEX_DTYPES, check_tensor

#: the per-layer planes a plan runs over, in :meth:`LatentDecodePlan.run`'s order
#: (:meth:`~sglang_oscar.pool.latent_pool.OscarMLATokenToKVPool.latent_buffers`' keys)
PLANES = ("codes", "pairs", "k_pe", "hp_latent", "hp_pe")


def latent_num_splits(batch: int, num_heads: int, *, block_h: int = 16, num_sms: int = 132,
                      max_splits: int = 32) -> int:
    """Splits of each request's positions: enough programs (``batch x ceil(H / block_h) x splits``)
    for about two waves over ``num_sms`` SMs, at most ``max_splits`` (empty splits cost one early
    exit). Depends on the batch shape only, so a CUDA graph captured for a batch size replays the
    right count."""
    programs = batch * -(-num_heads // block_h)
    return max(1, min(max_splits, -(-2 * num_sms // max(programs, 1))))


def latent_decode_tiles(num_heads: int, engine: str) -> dict:
    """The served decode tiles (``block_n``, ``block_h``, ``num_warps``) of a :class:`LatentDecodePlan`.

    Args:
        num_heads: q heads per rank (DeepSeek-V3: 128 / TP); engine: ``"codes"`` or ``"dequant"``.

    Returns:
        ``dict(block_n=64, block_h=32, num_warps=8)`` for the codes engine with at least 32 heads,
        else ``dict(block_n=32, block_h=16, num_warps=4)``.

    From 32 heads on the absorbed decode is bound by its MMAs, not by the 272 bytes per token it
    reads, and 32-row tiles feed the tensor cores better than 16-row ones: on the H200 at 128 heads
    the codes engine at 64 x 32 x 8 warps takes 0.80-0.90x SGLang's BF16 Triton MLA time at 4K x
    batch 8-32 (32 x 16 x 4: 1.02-1.19x) and 0.22x at 128K x batch 1 (0.29x); at 16 heads a
    32-row tile is half empty and 32 x 16 x 4 stays faster (docs/benchmarks_mla.md).
    """
    if engine == "codes" and num_heads >= 32:
        return dict(block_n=64, block_h=32, num_warps=8)
    return dict(block_n=32, block_h=16, num_warps=4)


def codes_engine_applies(quantizer: str, group_size: int, rank: int) -> bool:
    """Whether the ``"codes"`` engine (:mod:`.latent_codes`) takes this latent format.

    Args:
        quantizer: the INT2 codebook's name (``"uniform"``, ``"lloyd-max"``, ...).
        group_size: elements per (scale, zero) pair along the latent; rank: ``kv_lora_rank``.

    Returns:
        ``True`` for evenly spaced levels (so ``level[c] = l0 + c * step`` folds into the products)
        and groups that hold whole quarters of the rank (one pair per quarter row), else ``False``.

    Raises:
        ValueError: an unknown quantizer (:func:`~sglang_oscar.quant.int2.codebook`).
    """
    lv = codebook(quantizer).levels
    if rank < 4 or rank % 4:
        return False
    step = lv[1] - lv[0]
    return group_size % (rank // 4) == 0 and all(abs(b - a - step) <= 1e-6 for a, b in zip(lv[1:], lv[2:]))


class LatentDecodePlan:
    """The launches of one latent decode step (every MLA layer of a model has the same geometry).

    Args:
        buffers: one layer's planes ``{name: tensor}`` for :data:`PLANES` (every layer the plan runs
            must have planes of these shapes, dtypes and strides): ``codes`` uint8 ``[S, R/4]``
            quarter-packed codes of the rotated latents, ``pairs`` ``[S, 2R/G]`` (scale, zero) per
            group, ``k_pe`` ``[S, P]`` rope keys, ``hp_latent`` ``[rows, R]`` / ``hp_pe`` ``[rows, P]``
            the BF16 sink / recent rows (rotated frame). Extra keys are ignored.
        hp_index: int ``[max_reqs, >= sink + recent]`` (``pool.windows.HPWindows.hp_index``; -1 = no row).
        req_to_token: int ``[max_reqs, ctx]`` slots; req_pool_indices, seq_lens: int ``[B]`` (the
            query sits at ``L - 1``). The plan keeps these tensors: their values may change between
            runs (CUDA-graph replays), their shapes not.
        num_heads: q heads ``H`` per layer.
        group_size, quantizer: the latent's INT2 format (``G`` divides ``R``).
        sink, recent: window sizes in tokens.
        sink_lens: optional int ``[max_reqs]`` (``HPWindows.sink_lens``): request ``r`` reads its
            first ``min(sink_lens[r], sink)`` positions from sink rows and the rest of ``[0, sink)``
            through INT2, as the MHA decode does when the sink arena ran out.
        num_splits: splits of each request's positions (default :func:`latent_num_splits`).
        num_sms: SMs for the default split count.
        block_n / block_h: tile sizes (powers of two >= 16).
        precision: the dot products' operands (:data:`~.latent.PRECISIONS`): ``"ieee"`` fp32 (the
            oracle's arithmetic), ``"tf32"`` or ``"bf16"`` tensor cores (GPU only: the Triton
            interpreter's BF16 dot is wrong).
        num_warps: warps per program, 4 or 8.
        engine: ``"dequant"`` (dequantize each tile, any group size and quantizer) or ``"codes"``
            (:mod:`.latent_codes`: uniform quantizer, ``group_size`` a multiple of ``R/4``).
        workspace: a :class:`~.decode.plan.DecodeWorkspace` to take the stage-1 views from (one
            buffer for many plans), or ``None`` (allocated here).
        topk: optional int ``[B, k]`` DSA selection (GLM-5's lightning indexer): request ``b``
            attends only to positions ``topk[b]`` (``-1`` = unused; distinct positions in
            ``[0, L)``, as a top-k is), each from its tier; the split count then divides ``k``.
            ``"dequant"`` engine only.

    Attributes:
        batch, num_heads, rank (``R``), rope_dim (``P``), num_splits, grid, o_part, lse, and the
        tables it keeps (hp_index, req_to_token, sink_lens, req_pool_indices, seq_lens, topk).

    Raises:
        ValueError: planes or tables whose shapes, dtypes or devices do not fit (``R/4`` must be a
            power of two >= 16, ``R`` a multiple of ``group_size``), ``hp_index`` narrower than
            ``sink + recent``, tile sizes not powers of two >= 16, ``num_splits < 1``, an unknown
            ``precision`` or ``"bf16"`` off the GPU, ``num_warps`` not 4 or 8, an unknown ``engine``
            or ``"codes"`` with non-uniform levels, groups that split a quarter or a ``topk``.
    """

    def __init__(self, buffers: dict, hp_index: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, *, num_heads: int, group_size: int,
                 quantizer: str, sink: int, recent: int, sink_lens: torch.Tensor | None = None,
                 num_splits: int | None = None, num_sms: int = 132, block_n: int = 16, block_h: int = 16,
                 precision: str = "ieee", num_warps: int = 4, engine: str = "dequant", workspace=None,
                 topk: torch.Tensor | None = None):
        r, p = check_latent_planes(*(buffers[k] for k in PLANES), group_size)
        dev, q = buffers["codes"].device, r // 4
        for t, name, nd in ((hp_index, "hp_index", 2), (req_to_token, "req_to_token", 2),
                            (req_pool_indices, "req_pool_indices", 1), (seq_lens, "seq_lens", 1)) + (
                () if sink_lens is None else ((sink_lens, "sink_lens", 1),)):
            check_tensor(t, name, ndim=nd, dtypes=INDEX_DTYPES, device=dev)
        bsz = req_pool_indices.shape[0]
        if seq_lens.shape != (bsz,):
            raise ValueError(f"seq_lens {tuple(seq_lens.shape)} and req_pool_indices {tuple(req_pool_indices.shape)} "
                             "must have the same length")
        if hp_index.shape[1] < sink + recent:
            raise ValueError(f"hp_index has {hp_index.shape[1]} columns, fewer than sink + recent = {sink + recent}")
        check_pow2(block_n, "block_n", 16)
        check_pow2(block_h, "block_h", 16)
        if num_splits is None:
            num_splits = latent_num_splits(bsz, num_heads, block_h=block_h, num_sms=num_sms)
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        lv = codebook(quantizer).levels
        if engine not in ("dequant", "codes"):
            raise ValueError(f"engine must be 'dequant' or 'codes', got {engine!r}")
        if topk is not None:
            check_tensor(topk, "topk", ndim=2, dtypes=INDEX_DTYPES, device=dev, shape=(bsz, None), last_contiguous=True)
            if engine != "dequant":
                raise ValueError("a DSA top-k selection (topk) runs on engine 'dequant' only")
        if engine == "codes" and not codes_engine_applies(quantizer, group_size, r):
            raise ValueError(f"engine 'codes' needs evenly spaced levels (quantizer uniform, got {quantizer!r}) and a "
                             f"group_size that is a multiple of R/4 = {q} (got {group_size}); use engine 'dequant'")
        check_dot_options(precision, num_warps, dev)
        if isinstance(workspace, DecodeWorkspace):
            self.o_part, self.lse = workspace.views(bsz, num_heads, r, num_splits)
        elif workspace is None:
            self.o_part, self.lse = DecodeWorkspace(dev).views(bsz, num_heads, r, num_splits)
        else:
            raise ValueError(f"workspace must be a DecodeWorkspace or None, got {type(workspace).__name__}")

        self.device, self.batch, self.num_heads, self.rank, self.rope_dim = dev, bsz, num_heads, r, p
        self.hp_index, self.req_to_token, self.sink_lens = hp_index, req_to_token, sink_lens
        self.req_pool_indices, self.seq_lens, self.topk = req_pool_indices, seq_lens, topk
        self.num_splits = num_splits
        self.grid = (bsz, triton.cdiv(num_heads, block_h), num_splits)
        if engine == "codes":
            from .latent_codes import _latent_decode_stage1_codes as kernel

            self._kernel, tail = kernel, (lv[0], lv[1] - lv[0])
            sparse = {}
        else:
            # the levels, then the top-k list (ignored with SPARSE off: any int tensor stands in)
            tk = seq_lens if topk is None else topk
            self._kernel = _latent_decode_stage1
            tail = (*lv, tk, tk.stride(0) if topk is not None else 0, 0 if topk is None else topk.shape[1])
            sparse = dict(SPARSE=topk is not None)
        self._plane_shapes = tuple(tuple(buffers[k].shape) for k in PLANES)
        self._strides = tuple(buffers[k].stride(0) for k in PLANES)
        o, lse = self.o_part, self.lse
        self._tables = (hp_index, hp_index.stride(0), req_to_token, req_to_token.stride(0), req_pool_indices,
                        seq_lens, seq_lens if sink_lens is None else sink_lens,
                        o, o.stride(0), o.stride(1), o.stride(2), lse, lse.stride(0), lse.stride(1))
        self._window = (sink, recent, num_splits, *tail)
        self._constexprs = dict(H=num_heads, Q=q, P=p, PP=max(16, next_pow2(p)), G=group_size, BLOCK_H=block_h,
                                BLOCK_N=block_n, HAS_SINKL=sink_lens is not None, DOT=PRECISIONS[precision],
                                num_warps=num_warps, **sparse)
        self._merge = merge_launch(bsz, num_heads, r, num_splits)

    def run(self, q_abs: torch.Tensor, q_pe: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor,
            k_pe: torch.Tensor, hp_latent: torch.Tensor, hp_pe: torch.Tensor, *, sm_scale: float,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Latent decode attention of one layer: stage 1 into the plan's workspace, then the merge.

        Args:
            q_abs: ``[B, H, R]`` rotated absorbed queries ``(q_nope W_UK) Rot`` (any float dtype,
                last dim contiguous); q_pe: ``[B, H, P]`` post-RoPE query rope part.
            codes, pairs, k_pe, hp_latent, hp_pe: the layer's planes, shaped as the plan's (their
                shapes are compared, their other properties not: the plan checked the first layer's).
            sm_scale: the layer's softmax scale (natural units).
            out: optional ``[B, H, R]`` output (any float dtype, last dim contiguous), else fp32.

        Returns:
            ``o' [B, H, R]``: the latent output in the rotated frame.

        Raises:
            ValueError: queries or planes of other shapes than the plan's.
        """
        shape = (self.batch, self.num_heads)
        if tuple(q_abs.shape) != shape + (self.rank,) or tuple(q_pe.shape) != shape + (self.rope_dim,):
            raise ValueError(f"q_abs {tuple(q_abs.shape)} / q_pe {tuple(q_pe.shape)}: this plan was built for "
                             f"{shape + (self.rank,)} / {shape + (self.rope_dim,)}")
        planes = (codes, pairs, k_pe, hp_latent, hp_pe)
        if tuple(tuple(t.shape) for t in planes) != self._plane_shapes:
            raise ValueError(f"planes {[tuple(t.shape) for t in planes]}: this plan was built for {self._plane_shapes}")
        if out is None:
            out = torch.empty(shape + (self.rank,), dtype=torch.float32, device=self.device)
        if self.batch == 0:
            return out
        s = self._strides
        _launch(self._kernel, self.grid,
                q_abs, q_abs.stride(0), q_abs.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
                codes, s[0], pairs, s[1], k_pe, s[2], hp_latent, s[3], hp_pe, s[4], *self._tables,
                sm_scale * LOG2E, *self._window, **self._constexprs)
        launch_merge(self.o_part, self.lse, out, self.num_splits, *self._merge)
        return out


def latent_decode_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor,
                            k_pe: torch.Tensor, hp_latent: torch.Tensor, hp_pe: torch.Tensor,
                            hp_index: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor, *, group_size: int, sm_scale: float,
                            out: torch.Tensor | None = None, num_splits: int = 4, **plan_kwargs) -> torch.Tensor:
    """Absorbed-MQA decode over the packed latent cache of one MLA layer, in one call: a
    :class:`LatentDecodePlan` over these planes, run once.

    Args:
        q_abs, q_pe, sm_scale, out: as :meth:`LatentDecodePlan.run` (``q_abs`` / ``q_pe`` share ``[B, H]``).
        codes, pairs, k_pe, hp_latent, hp_pe, hp_index, req_to_token, req_pool_indices, seq_lens,
        group_size, plan_kwargs: as :class:`LatentDecodePlan` (``quantizer``, ``sink``, ``recent``
            required; ``num_heads`` from ``q_abs``).
        num_splits: splits of each request's positions (default 4 here; ``None``: the plan's
            :func:`latent_num_splits`).

    Returns:
        ``o' [B, H, R]`` (``out`` or fp32): the latent output in the rotated frame.

    Raises:
        ValueError: as :class:`LatentDecodePlan` and :meth:`LatentDecodePlan.run`, and ``q_abs`` /
            ``q_pe`` that are not 3-d with a contiguous last dim on the planes' device, or a ``q_abs``
            width the kernel cannot take.
    """
    check_tensor(q_abs, "q_abs", ndim=3, device=codes.device, last_contiguous=True)
    check_latent_width(q_abs.shape[-1], group_size)
    check_tensor(q_pe, "q_pe", ndim=3, device=codes.device, last_contiguous=True)
    if tuple(q_pe.shape[:2]) != tuple(q_abs.shape[:2]):
        raise ValueError(f"q_abs {tuple(q_abs.shape)} and q_pe {tuple(q_pe.shape)} must share [B, H]")
    planes = dict(zip(PLANES, (codes, pairs, k_pe, hp_latent, hp_pe)))
    plan = LatentDecodePlan(planes, hp_index, req_to_token, req_pool_indices, seq_lens, num_heads=q_abs.shape[1],
                            group_size=group_size, num_splits=num_splits, **plan_kwargs)
    return plan.run(q_abs, q_pe, *planes.values(), sm_scale=sm_scale, out=out)


#: selected positions per split of a DSA extend token (:func:`sparse_extend_num_splits`)
SPARSE_EXTEND_SPLIT_KEYS = 512


def sparse_extend_num_splits(topk_width: int) -> int:
    """Splits of each DSA extend token's selection: one per :data:`SPARSE_EXTEND_SPLIT_KEYS` (512)
    selected positions, 1..8 (GLM-5's 2,048: 4). A function of the model's top-k width only: the
    split count sets the order in which a token's partial softmaxes are summed, so one that followed
    the chunk's token count would make a prompt's log-probs depend on its chunking (and an INT2
    code written from a later layer's input can flip on that last-bit difference)."""
    return max(1, min(8, int(topk_width) // SPARSE_EXTEND_SPLIT_KEYS))


def latent_sparse_extend_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, buffers: dict, hp_index: torch.Tensor,
                                   req_to_token: torch.Tensor, token_req: torch.Tensor, positions: torch.Tensor,
                                   topk: torch.Tensor, *, group_size: int, quantizer: str, sink: int,
                                   sm_scale: float, sink_lens: torch.Tensor | None = None, num_splits: int | None = None,
                                   out: torch.Tensor | None = None, max_rows: int = 2048,
                                   **plan_kwargs) -> torch.Tensor:
    """DSA extend (GLM-5 prefill) over the packed latent: each query token attends to its own top-k.

    One :class:`LatentDecodePlan` row per query token: token ``t`` is a length-``positions[t] + 1``
    request of request slot ``token_req[t]`` with selection ``topk[t]``, read in window mode
    ``"extend"`` (``reference.latent.latent_attention``): positions below ``sink`` from their BF16
    sink rows, every other one -- the chunk's own tokens included, written before the call -- through
    INT2, so ``recent = 0`` (the recent ring holds the request's last positions, not those before
    each chunk token). Where the selection covers every position, this is the dense extend
    (:func:`~.latent_extend.latent_extend_attention`).

    Args:
        q_abs: ``[T, H, R]`` rotated absorbed queries of the chunk's tokens; q_pe: ``[T, H, P]``.
        buffers: one layer's planes ``{name: tensor}`` for :data:`PLANES`.
        hp_index, req_to_token, sink_lens: the pool's tables (as :class:`LatentDecodePlan`).
        token_req: int ``[T]`` request slot of each token; positions: int ``[T]`` its position.
        topk: int ``[T, k]`` selected positions per token (``-1`` = unused; distinct, ``<= positions[t]``),
            as the unfused DSA indexer returns them.
        group_size, quantizer, sink: the latent's format and sink window.
        sm_scale: softmax scale (natural units); num_splits: splits of each token's list (default
            :func:`sparse_extend_num_splits` of the top-k width: a count that does not depend on
            ``T``, so a token's result does not depend on the chunk it is prefilled in); out:
            optional ``[T, H, R]``.
        max_rows: query tokens per plan: a chunk runs in slices of this many, which bounds the stage-1
            workspace (``rows x H x splits x (R + 1)`` fp32) whatever the chunk size.
        plan_kwargs: tile / precision options of :class:`LatentDecodePlan` (engine is ``"dequant"``).

    Returns:
        ``o' [T, H, R]`` (``out`` or fp32): the latent output in the rotated frame.

    Raises:
        ValueError: as :func:`latent_decode_attention`, and ``token_req`` / ``positions`` / ``topk``
            whose first dimensions differ from ``T``.
    """
    t = q_abs.shape[0]
    for name, x in (("token_req", token_req), ("positions", positions), ("topk", topk)):
        if x.dim() < 1 or x.shape[0] != t:
            raise ValueError(f"{name} {tuple(x.shape)}: one entry per query token ({t}) expected")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if out is None:
        out = torch.empty(q_abs.shape, dtype=torch.float32, device=q_abs.device)
    if num_splits is None:
        num_splits = sparse_extend_num_splits(topk.shape[-1])
    planes = [buffers[k] for k in PLANES]
    for a in range(0, t, max_rows):
        b = min(t, a + max_rows)
        latent_decode_attention(q_abs[a:b], q_pe[a:b], *planes, hp_index, req_to_token, token_req[a:b],
                                positions[a:b] + 1, group_size=group_size, sm_scale=sm_scale, out=out[a:b],
                                num_splits=num_splits, quantizer=quantizer, sink=sink, recent=0, sink_lens=sink_lens,
                                topk=topk[a:b], **plan_kwargs)
    return out
