"""Launch configurations of the attention kernels: :class:`TritonConfig` and :class:`GluonConfig`.

The engine is the type: a decode plan given a :class:`GluonConfig` runs the Gluon stage 1, one given
a :class:`TritonConfig` the Triton one (extend has only the Triton kernel). Both are frozen and
validated on construction. :func:`default_triton_config` is what the GPU (or the interpreter) runs
for a layout and a decode batch; :func:`effective_convert` maps a config's code conversion to the
one a launch can run (the interpreter's emulations, the fallback for non-fp16 operands). Timings
behind the defaults: docs/benchmarks.md; what each field does in the kernels: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch

from .codes import (
    CONVERT_ASM,
    CONVERT_ASM_PERM,
    CONVERT_BITS,
    CONVERT_PERM_EMULATED,
    CONVERT_SUBNORMAL,
    CONVERT_SUBNORMAL_EMULATED,
)
from .compile_check import interpreting
from .layout import Int2Layout, next_pow2

#: the conversions a :class:`TritonConfig` may name (the emulations 4 / 6 are how the interpreter
#: runs 3 / 5, not choices)
CONVERTS = (CONVERT_BITS, CONVERT_ASM, CONVERT_ASM_PERM, CONVERT_SUBNORMAL)

# Smallest padded quarter (head_dim / 4, rounded up to a power of two) of K and V at which the
# permuting conversions (CONVERT_ASM_PERM, CONVERT_SUBNORMAL) are used: they assume the GPU's register
# order of a code tile's bytes, which differs at head_dim 64 (docs/kernels.md#permuting-conversions).
PERMUTE_MIN_QUARTER = 32

# GPU decode, head_dim 65-128: from this many (request, kv head) pairs per step the INT2 loop runs
# with one pipeline stage (more resident programs, which a grid of several waves uses better than
# the async-copy pipeline; docs/kernels.md#decode-defaults). A host constant of the batch size.
STAGES1_MIN_PAIRS = 256

#: largest ``min_split_keys`` (2^24 positions): keeps the kernels' int32 split arithmetic exact
MAX_MIN_SPLIT_KEYS = 1 << 24

#: register cap of the Gluon decode kernel (12 one-warp programs per SM)
GLUON_MAXNREG = 168


def _check_int(name: str, value, lo: int, hi: int | None = None, pow2: bool = False, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an int")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}={value} must be in [{lo}, {hi if hi is not None else 'inf'}]")
    if pow2 and value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")


def _check_common(cfg) -> None:
    _check_int("maxnreg", cfg.maxnreg, 24, 255, none_ok=True)
    _check_int("min_split_keys", cfg.min_split_keys, 0, MAX_MIN_SPLIT_KEYS, none_ok=True)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Launch configuration of the Triton attention kernels (decode stage 1 and extend).

    The defaults are the GPU decode configuration for K and V head_dim 65-128 below
    :data:`STAGES1_MIN_PAIRS` pairs; :func:`default_triton_config` gives the one for any layout,
    batch and platform. Fields other than those it picks are for comparing variants (tests, sweeps).

    Attributes:
        block_n: keys per inner iteration (power of two); block_m: queries per extend program.
        num_warps, num_stages: Triton launch options (``num_stages`` >= 1).
        convert: code -> MMA operand conversion (:data:`CONVERTS`): ``CONVERT_SUBNORMAL`` 5 (codes read
            in place as fp16 subnormals; decode token-major tiles, fp16 operands), ``CONVERT_ASM_PERM``
            3 (packed PTX without byte permutes; decode), ``CONVERT_ASM`` 2 (packed PTX), ``CONVERT_BITS``
            1 (the portable mantissa bit trick). A launch runs the nearest mode it can
            (:func:`effective_convert`): 5 -> 3 -> 2 -> 1, the interpreter's emulations for 3 / 5.
        min_block_h: decode q-head tile rows are padded to at least this (the MMA's M).
        max_block_h: a kv head's q heads are split into blocks of at most this many (a divisor of
            the group), so a program never straddles two kv heads.
        pairs_ahead: decode token-major loop: load each block's (scale, zero) pairs one iteration
            early by hand (Triton's pipeliner stages only loads that feed an MMA).
        defer_sums: decode token-major loop: keep the softmax denominator and the zero-point
            correction as per-position partial sums, reduced once after the loop.
        maxnreg: register cap per thread given to ``ptxas`` (``None`` = none), 24-255.
        min_split_keys: decode: an INT2 split covers at least this many positions (``None`` =
            :func:`.decode.splits.default_min_split_keys`), 0 to :data:`MAX_MIN_SPLIT_KEYS`.

    Raises:
        ValueError: a field outside its range (named in the message).
    """

    block_n: int = 32
    num_warps: int = 1
    num_stages: int = 2
    convert: int = CONVERT_SUBNORMAL
    min_block_h: int = 8
    max_block_h: int = 64
    pairs_ahead: bool = True
    defer_sums: bool = True
    maxnreg: int | None = None
    min_split_keys: int | None = None
    block_m: int = 64

    #: the stage-1 engine this config selects (the split policy and logs name it)
    engine: ClassVar[str] = "triton"

    def __post_init__(self):
        for name in ("block_n", "block_m", "num_warps", "min_block_h"):
            _check_int(f"TritonConfig {name}", getattr(self, name), 1, 1024, pow2=True)
        _check_int("TritonConfig num_stages", self.num_stages, 1, 8)
        _check_int("TritonConfig max_block_h", self.max_block_h, 1, 1024)
        if self.convert not in CONVERTS:
            raise ValueError(f"TritonConfig convert={self.convert!r} must be one of {CONVERTS} "
                             "(bits, asm, asm-perm, subnormal; codes.CONVERT_*)")
        for name in ("pairs_ahead", "defer_sums"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TritonConfig {name}={getattr(self, name)!r} must be True or False")
        _check_common(self)

    def launch_options(self) -> dict:
        """Extra Triton launch options (``maxnreg`` when set; the interpreter takes none)."""
        return {} if self.maxnreg is None or interpreting() else {"maxnreg": self.maxnreg}


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """Launch configuration of the Gluon decode stage 1 (:mod:`.decode.gluon_stage1`).

    Scope (checked when a plan is built, ``ValueError`` with the reason outside it): CUDA sm_80+,
    K and V head_dim 128, one fp16 (scale, zero) pair per row, uniform levels, fp16 operands, bf16 /
    fp16 HP rows, no logit cap. The merge is the Triton one either way.

    Attributes:
        block_n: keys per INT2 iteration, 16 or 32 (64 spills registers).
        maxnreg: register cap per thread (default :data:`GLUON_MAXNREG`: 12 one-warp programs per
            SM, which the split policy offers); ``None`` = no cap.
        min_split_keys: as :class:`TritonConfig` (the default differs by engine).

    Raises:
        ValueError: a field outside its range.
    """

    block_n: int = 32
    maxnreg: int | None = GLUON_MAXNREG
    min_split_keys: int | None = None

    engine: ClassVar[str] = "gluon"

    def __post_init__(self):
        if self.block_n not in (16, 32) or isinstance(self.block_n, bool):
            raise ValueError(f"GluonConfig block_n={self.block_n!r} must be 16 or 32 (64 spills registers)")
        _check_common(self)


def _permutable_head_dim(head_dim: int) -> bool:
    """``head_dim``'s padded quarter has at least :data:`PERMUTE_MIN_QUARTER` codes (false <= 64)."""
    return next_pow2(max(1, head_dim // 4)) >= PERMUTE_MIN_QUARTER


def permuting_ok(layout: Int2Layout) -> bool:
    """Whether decode may use a permuting conversion for ``layout``: every quarter of a K and a V row
    inside one group and padded quarters of at least :data:`PERMUTE_MIN_QUARTER` codes. Applies under
    the interpreter too, so CPU tests take the path the GPU takes."""
    return (layout.k.quarter_aligned and layout.v.quarter_aligned
            and _permutable_head_dim(layout.k.head_dim) and _permutable_head_dim(layout.v.head_dim))


def default_triton_config(layout: Int2Layout, *, extend: bool = False, pairs: int | None = None,
                          mma_dtype: torch.dtype = torch.float16, windowed: bool = False,
                          capped: bool = False) -> TritonConfig:
    """The :class:`TritonConfig` the kernels run for ``layout`` on this platform (memoized).

    GPU decode, K and V head_dim 65-128 (timed and GPU-tested at 128): the dataclass defaults --
    one warp, 32 keys per iteration, ``CONVERT_SUBNORMAL``, pairs one block ahead, q heads padded to
    8 -- with ``num_stages`` 1 and no deferred sums from :data:`STAGES1_MIN_PAIRS` ``pairs``. Larger
    heads: ``CONVERT_ASM_PERM``, no pair prefetch, 32 keys over 4 warps up to head_dim 256, above it
    64 keys over ``head_dim / 64`` warps rounded up to a power of two, at most 8 (timed at 256 and
    512, GPU-tested at 192-512). K or V head_dim <= 64 (no permuting conversion,
    :func:`permuting_ok`) and extend: ``CONVERT_ASM`` without the prefetch. Extend takes 64 queries,
    4 warps (8 where K and V quarters pad to different widths, e.g. K 192 / V 128: 4 warps read
    illegal addresses there on the H200, ``tests/kernels/extend_matrix.py``), one pipeline stage and
    128 keys per tile where those fit the sm_90 registers (no local-memory stack,
    ``tests/kernels/test_compile.py``): uniform quantizer, one group per row, fp16 operands, K and V
    head_dim 64, or 128 without a sliding window or logit cap (attention
    sinks, known only at run time, cost 16 bytes of stack there), and one-group Lloyd-Max at 128
    without a window or cap (a 24-byte stack, still faster than 64 keys); else 64 keys (an 8K chunk of one
    Qwen3-8B layer after 0 / 8K cached tokens: 3.23 / 9.22 ms with 128 keys, 3.81 / 11.00 with 64,
    4.28 / 12.29 with 64 and two stages, on the H200: docs/benchmarks_extend.md; head_dim 64
    unmeasured). The interpreter runs the same conversions and prefetch / deferred-sum choices (so
    CPU tests exercise the GPU's bookkeeping) with 16-key tiles, 4 warps and no head padding.
    fp32 MMA operands (``--dtype float32`` servers, the exact tests) above head_dim 256 decode with
    one pipeline stage: two stages of 64-key fp32 tiles at head_dim 512 need 281 KB of shared
    memory, more than an H200 SM has.

    Args:
        layout: the call's :class:`Int2Layout`; extend: the extend kernel's config;
        pairs: decode requests x kv heads of the step (``None`` = few); mma_dtype: the MMA operand dtype;
        windowed, capped: (extend) the launch has a sliding window / a logit cap.
    """
    hi = max(layout.k.head_dim, layout.v.head_dim)
    lo = min(layout.k.head_dim, layout.v.head_dim)
    many = pairs is not None and pairs >= STAGES1_MIN_PAIRS
    # the extend kernel's 128-key tiles fit the registers only on the plain one-group uniform path
    # (sm_90 stack bytes at head_dim 128 with 128 / 64 keys: Lloyd-Max 24 / 8, four groups 712 / 256,
    # window 40 / 0, cap 16 / 0, bf16 operands 88 / 0; head_dim 80 or 112: 112 / 0-8). One-group
    # Lloyd-Max at 128 takes them anyway: with its 24-byte spill its H200 attention still takes 16-17%
    # less time than at 64 keys (docs/benchmarks_extend.md)
    plain = (extend and layout.k.num_groups == 1 and layout.v.num_groups == 1 and mma_dtype == torch.float16
             and hi == lo and not (hi == 128 and (windowed or capped)))
    wide = plain and (hi == 128 or (hi == 64 and layout.quantizer == "uniform"))
    # K and V quarters of different padded widths (K 192 / V 128: 64 / 32): 64 x 64 extend tiles over 4
    # warps read illegal addresses there on the H200 (tests/kernels/extend_matrix.py); 8 warps do not
    mixed = layout.k.quarter_p2 != layout.v.quarter_p2
    return _default_triton(hi, lo, extend, many, interpreting(), mma_dtype == torch.float32, wide, mixed)


@functools.lru_cache(maxsize=64)
def _default_triton(hi: int, lo: int, extend: bool, many: bool, interp: bool, fp32: bool,
                    wide: bool = False, mixed: bool = False) -> TritonConfig:
    small = not _permutable_head_dim(lo)
    # decode with K and V head_dim in 65-128: the timed fast path (prefetch, stages by pairs, deferred sums)
    fast = not extend and not small and hi <= 128
    if extend or small:
        convert = CONVERT_ASM
    else:
        convert = CONVERT_SUBNORMAL if hi <= 128 else CONVERT_ASM_PERM
    many = fast and many
    defer = fast and not many
    if interp:
        return TritonConfig(block_n=16, block_m=16, num_warps=4, num_stages=1, min_block_h=1, convert=convert,
                            pairs_ahead=fast, defer_sums=defer)
    if extend:
        # 128-key tiles pay the per-tile work (row max and sum, the rescale of four accumulators, loop
        # overhead) half as often per key; default_triton_config says where they fit the registers
        return TritonConfig(block_n=128 if wide else 64, block_m=64, num_warps=8 if mixed else 4, num_stages=1,
                            min_block_h=16, convert=convert, pairs_ahead=False, defer_sums=False)
    one_stage = many or (fp32 and hi > 256)  # two fp32 stages at head_dim 512 need 281 KB of shared memory
    # head_dim 129-256: 32-key tiles over 4 warps; above, 64 keys over ~head_dim / 64 warps (Gemma-4's
    # layers, 32K: the sliding 256 step -18% / -20% at batch 1 / 16 against 64 keys over 2 warps, whose
    # two-stage tiles leave one program per SM; the full 512 step -20% / -18% against 4 warps)
    block_n, warps = (32, 1) if hi <= 128 else (32, 4) if hi <= 256 else (64, min(8, next_pow2(-(-hi // 64))))
    return TritonConfig(block_n=block_n, num_warps=warps,
                        num_stages=1 if one_stage else 2, min_block_h=8, convert=convert, pairs_ahead=fast,
                        defer_sums=defer)


def effective_convert(convert: int, op: torch.dtype, permuting_ok: bool, subnormal_ok: bool = False) -> int:
    """The conversion a launch runs for a config's ``convert`` (:data:`CONVERTS`): its emulation under
    the interpreter (``CONVERT_PERM_EMULATED`` 4 for 3, ``CONVERT_SUBNORMAL_EMULATED`` 6 for 5, the bit
    trick for 2), else the nearest mode that applies: 5 needs ``subnormal_ok`` (the decode token-major
    path) and fp16 operands, 3 ``permuting_ok`` and fp16 operands, 2 fp16 operands; ``CONVERT_BITS`` 1
    runs everywhere.

    Args:
        convert: one of :data:`CONVERTS`; op: the MMA operand dtype; permuting_ok: :func:`permuting_ok`
            of the layout (``False`` for extend); subnormal_ok: the launch takes the decode
            token-major fast path.
    """
    interp = interpreting()
    if convert == CONVERT_SUBNORMAL:
        if permuting_ok and subnormal_ok and (interp or op == torch.float16):
            return CONVERT_SUBNORMAL_EMULATED if interp else CONVERT_SUBNORMAL
        # fp32 / bf16 operands on the GPU or another path: the route CONVERT_ASM_PERM takes
        convert = CONVERT_ASM_PERM
    if convert == CONVERT_ASM_PERM:
        if permuting_ok and interp:
            return CONVERT_PERM_EMULATED
        if permuting_ok and op == torch.float16:
            return CONVERT_ASM_PERM
        convert = CONVERT_ASM
    if convert == CONVERT_ASM and (interp or op != torch.float16):
        return CONVERT_BITS
    return convert
