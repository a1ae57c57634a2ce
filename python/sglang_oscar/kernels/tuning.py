"""Launch knobs of the attention kernels (:class:`AttnTuning`) and their per-platform defaults.

:meth:`AttnTuning.resolved` fills unset knobs for a layout, the decode batch's (request, kv head)
pairs and the platform (GPU or ``TRITON_INTERPRET``); :func:`effective_convert` maps a requested code
conversion to the one a launch can run. Timings behind the defaults: docs/benchmarks.md; what each
knob does in the kernels: docs/kernels.md.
"""

from __future__ import annotations

import torch

from .codes import (
    CONVERT_ARITH,
    CONVERT_ASM,
    CONVERT_ASM_PERM,
    CONVERT_BITS,
    CONVERT_PERM_EMULATED,
    CONVERT_SUBNORMAL,
    CONVERT_SUBNORMAL_EMULATED,
)
from .compile_check import interpreting
from .layout import Int2Layout, next_pow2


# Smallest padded quarter (head_dim / 4, rounded up to a power of two) of K and V at which the
# permuting conversions (``CONVERT_ASM_PERM`` 3, ``CONVERT_SUBNORMAL`` 5) are used: they assume the
# GPU's register order of a code tile's bytes, which differs at head_dim 64 (measured wrong there;
# docs/kernels.md#permuting-conversions).
PERMUTE_MIN_QUARTER = 32

# GPU decode, head_dim 65-128: from this many (request, kv head) pairs per step the INT2 loop runs
# with ``num_stages`` 1 (fewer registers and less shared memory, so more resident programs, which a
# large grid uses better than the async-copy pipeline; docs/kernels.md#decode-defaults). Keyed on
# pairs, a host constant of the batch size (CUDA-graph safe).
STAGES1_MIN_PAIRS = 256


def _permutable_head_dim(head_dim: int) -> bool:
    """``head_dim``'s padded quarter (:attr:`TensorLayout.quarter_p2`) has at least
    :data:`PERMUTE_MIN_QUARTER` codes (false for head_dim <= 64)."""
    return next_pow2(max(1, head_dim // 4)) >= PERMUTE_MIN_QUARTER


def permuting_ok(layout: Int2Layout) -> bool:
    """Whether the decode kernel may use a permuting conversion for ``layout``: every quarter of a
    K and a V row inside one group (:attr:`TensorLayout.quarter_aligned`) and padded quarters of at
    least :data:`PERMUTE_MIN_QUARTER` codes. Applies under the interpreter too, so CPU tests take
    the path the GPU takes."""
    return (layout.k.quarter_aligned and layout.v.quarter_aligned
            and _permutable_head_dim(layout.k.head_dim) and _permutable_head_dim(layout.v.head_dim))


def _int_knob(name: str, value) -> int:
    """``value`` as an int (ints and integral strings / floats), else ``ValueError`` naming the knob."""
    try:
        iv = int(value)
    except (TypeError, ValueError):
        iv = None
    if iv is None or isinstance(value, bool) or (isinstance(value, float) and value != iv):
        raise ValueError(f"tuning {name}={value!r} must be an integer")
    return iv


def _gluon_knobs(names) -> str:
    """The verb phrase of the Gluon-only-knob refusals, singular or plural by ``names``."""
    return "is a Gluon-engine knob" if len(names) == 1 else "are Gluon-engine knobs"


class AttnTuning:
    """Launch knobs of the attention kernels (defaults depend on CUDA vs interpreter).

    Attributes:
        block_n: keys per inner iteration; block_m: queries per extend program.
        num_warps, num_stages: Triton launch options.
        convert: code -> operand conversion: ``CONVERT_ARITH`` 0 (shift/convert/fma),
            ``CONVERT_BITS`` 1 (mantissa bit trick in Triton), ``CONVERT_ASM`` 2 (packed PTX,
            fp16 operands), ``CONVERT_ASM_PERM`` 3 (packed PTX without byte permutes, decode INT2
            fast path only; the kernel permutes q / the V token order to match). Under the
            interpreter 2 runs as 1 and 3 as its emulation (4); where 3 is not applicable it
            runs as 2 (extend, general path, non-fp16 operands as 1). ``CONVERT_SUBNORMAL`` 5
            (GPU decode default when K and V head_dim are both in 65-128; token-major fast path,
            fp16 operands; never where :func:`permuting_ok` is false): the code bits are read
            in place as fp16 subnormals ``c * 2^(2K-24)`` (one AND per two codes); 6 is its
            emulation (interpreter); fp32/bf16 operands on the GPU and the other paths run 5 as 3.
        min_block_h: rows of the decode query tile are padded to at least this (MMA M).
        max_block_h: a kv head's q heads are split into blocks of at most this many heads
            (a divisor of the group), so a program never straddles two kv heads.
        token_major: decode INT2 tiles with the token axis as the MMA's M dimension
            (``S^T = codes @ q^T``); used only with one (scale, zero) group per K and V row,
            otherwise ignored.
        pairs_ahead: decode token-major INT2 loop: load each block's (scale, zero) pairs one
            iteration early by hand (Triton's pipeliner stages only the code tiles, which feed
            MMAs; the pair loads were synchronous). ``None`` = on for decode when K and V head_dim
            are both in 65-128.
        defer_sums: decode token-major INT2 loop: keep the softmax denominator and the V zero-point
            correction as ``[block_n, M]`` tiles of per-position partial sums, summed once after
            the loop, instead of reducing them across lanes every block (sm_90 SASS: 691 -> 668
            warp-instructions per 32 keys, 194 -> 202 registers). ``None`` = on at K and V
            head_dim 65-128 where ``pairs_ahead`` is on and the loop keeps 2 pipeline stages (with 1
            stage the extra registers cost the occupancy that stage count is for: 168 -> 194).
        maxnreg: register cap per thread given to ``ptxas`` (Triton's ``maxnreg`` launch
            option; ``None`` = no cap). Fewer registers let more warps share an SM (65,536
            registers per SM, 16K per scheduler partition, allocated per warp in steps of 256:
            255 or 194 -> 8 warps, 168 -> 12, 128 -> 16, 96 -> 20, 64 -> 32) at the risk of spills.
        engine: decode stage 1: ``"triton"`` (:mod:`.decode.triton_stage1`, every layout) or ``"gluon"``
            (:mod:`.decode.gluon_stage1`: explicit register layouts, no layout changes in the INT2 loop;
            CUDA sm_80+, head_dim 128, one fp16 pair group per row, uniform levels, fp16 operands,
            bf16 / fp16 HP rows, no logit cap -- naming ``"gluon"`` for a call outside that scope
            raises ``ValueError`` with the reason). ``None`` = ``"gluon"`` where it applies, else
            ``"triton"`` (so the interpreter and every other layout run Triton); a tuning that names
            any Triton-only knob (:attr:`TRITON_ONLY`: ``convert``, ``num_stages``, ...) with
            ``engine`` unset runs Triton, so the knobs it names take effect (with ``engine="gluon"``
            naming one is refused: the Gluon engine has none of them). The merge is Triton
            either way; with ``"gluon"`` the INT2 splits run ``block_n`` keys per iteration (16 or
            32) and ``maxnreg`` defaults to 168 (12 one-warp programs per SM; the split policy
            offers 11-12 per SM at batch 1-2, :func:`choose_num_splits`).
        async_stages: Gluon engine only: ``0`` = the next block's code and pair words are loaded
            into registers one block ahead; ``n`` in 2-4 = they go through a ring of ``n``
            shared-memory stages by ``cp.async``, ``n - 1`` blocks ahead, no registers held while
            in flight (2.3 KB per stage at ``block_n`` 32). ``None`` = :data:`GLUON_ASYNC_STAGES`
            (2). Naming it (0 included) with ``engine`` unset selects the Gluon engine
            (``ValueError`` where it cannot run); with ``engine="triton"`` it is refused.
        async_slots: Gluon engine only, with ``async_stages`` 2-4: the slot ids of each block also
            reach shared memory by ``cp.async``, ``2 async_stages - 1`` blocks ahead, so the INT2
            loop waits on no global load (``False``: they are loaded one block ahead of their
            words' copy, and that load is waited on in the loop). ``None`` = on whenever
            ``async_stages`` is 2-4 (docs/kernels.md#gluon-pipeline). Same engine rules as
            ``async_stages``; ``True`` with ``async_stages`` 0 is refused.
        min_split_keys: decode, both engines: an INT2 split covers at least this many positions
            (rounded up to ``block_n``), so at a step shorter than ``splits x min_split_keys`` the
            last splits are empty and exit at once (:func:`.tiles.int2_split_range`): the split
            count stays a host constant (CUDA graphs) while short steps run fewer, longer splits.
            ``None`` = :func:`default_min_split_keys` (Gluon: 128 / 256 keys; Triton: 0).

    Note: :meth:`as_dict` of a *resolved* tuning names every knob, Triton-only ones included, so
    passed back as a tuning it selects the Triton engine; pass ``None`` or ``{}`` for the default.
    """

    KNOBS = ("block_n", "block_m", "num_warps", "num_stages", "convert", "min_block_h", "max_block_h",
             "token_major", "maxnreg", "pairs_ahead", "defer_sums", "engine", "async_stages", "async_slots",
             "min_split_keys")
    #: knobs only the Gluon engine has: naming one (any value, 0 / False included: those are Gluon
    #: choices too) with ``engine`` unset selects Gluon; with ``engine="triton"`` it is refused
    GLUON_ONLY = ("async_stages", "async_slots")
    #: knobs only the Triton engine has: naming one (with ``engine`` unset) selects Triton; with
    #: ``engine="gluon"`` it is refused
    TRITON_ONLY = ("block_m", "num_warps", "num_stages", "convert", "min_block_h", "max_block_h", "token_major",
                   "pairs_ahead", "defer_sums")
    #: largest ``min_split_keys`` (2^24 positions): keeps the kernels' int32 split arithmetic exact
    MAX_MIN_SPLIT_KEYS = 1 << 24
    __slots__ = KNOBS + ("explicit",)

    def __init__(self, block_n=None, block_m=None, num_warps=None, num_stages=None, convert=None,
                 min_block_h=None, max_block_h=None, token_major=None, maxnreg=None, pairs_ahead=None,
                 defer_sums=None, engine=None, async_stages=None, async_slots=None, min_split_keys=None):
        #: the knobs given a value here (resolved() keeps this set; decode_engine reads it)
        self.explicit = frozenset(k for k, v in locals().items() if k in self.KNOBS and v is not None)
        self.block_n = block_n
        self.block_m = block_m
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.convert = None if convert is None else int(convert)
        self.min_block_h = min_block_h
        self.max_block_h = max_block_h or 64
        self.token_major = True if token_major is None else bool(token_major)
        self.maxnreg = None if maxnreg is None else int(maxnreg)
        self.pairs_ahead = None if pairs_ahead is None else bool(pairs_ahead)
        self.defer_sums = None if defer_sums is None else bool(defer_sums)
        if engine not in (None, "triton", "gluon"):
            raise ValueError(f"tuning engine={engine!r} must be 'triton' or 'gluon'")
        self.engine = engine
        self.async_stages = None if async_stages is None else _int_knob("async_stages", async_stages)
        if self.async_stages not in (None, 0, 2, 3, 4):
            raise ValueError(f"tuning async_stages={async_stages} must be 0 (registers) or 2-4 (shared-memory stages)")
        if async_slots is not None and not isinstance(async_slots, bool):
            raise ValueError(f"tuning async_slots={async_slots!r} must be true or false")
        self.async_slots = async_slots
        self.min_split_keys = None if min_split_keys is None else _int_knob("min_split_keys", min_split_keys)
        if self.min_split_keys is not None and not 0 <= self.min_split_keys <= self.MAX_MIN_SPLIT_KEYS:
            raise ValueError(f"tuning min_split_keys={min_split_keys} must be in [0, {self.MAX_MIN_SPLIT_KEYS}] "
                             "(positions per INT2 split)")
        if async_slots and self.async_stages == 0:
            raise ValueError("tuning async_slots=True needs async_stages 2-4 (the slot ids share the cp.async "
                             "pipeline); drop async_slots or set async_stages")
        gluon_named = [k for k in self.GLUON_ONLY if k in self.explicit]
        if gluon_named and engine == "triton":
            raise ValueError(f"tuning {' and '.join(gluon_named)} {_gluon_knobs(gluon_named)}; drop it or use "
                             "engine='gluon'")

        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"tuning maxnreg={self.maxnreg} must be in [24, 255]")
        for name in ("block_n", "block_m", "min_block_h", "max_block_h", "num_warps", "num_stages"):
            if getattr(self, name) is not None:
                setattr(self, name, _int_knob(name, getattr(self, name)))
        for name in ("block_n", "block_m", "min_block_h", "num_warps"):
            val = getattr(self, name)
            if val is not None and (val < 1 or val & (val - 1)):
                raise ValueError(f"tuning {name}={val} must be a power of two")
        if self.convert not in (None, CONVERT_ARITH, CONVERT_BITS, CONVERT_ASM, CONVERT_ASM_PERM, CONVERT_PERM_EMULATED,
                                CONVERT_SUBNORMAL, CONVERT_SUBNORMAL_EMULATED):
            raise ValueError(f"tuning convert={self.convert} must be 0..6")

    def resolved(self, head_dim: int, extend: bool = False, min_head_dim: int | None = None,
                 pairs: int | None = None) -> "AttnTuning":
        """Copy with the unset knobs filled for ``head_dim`` (max of K/V), ``min_head_dim`` (min of
        K/V; default ``head_dim``), ``pairs`` (decode: requests x kv heads of the step; ``None`` =
        few) and the platform.

        GPU decode defaults (H200 sweeps, ``python -m benchmarks.sweep_decode``, docs/benchmarks.md): one
        warp per program up to head_dim 128 (no cross-warp softmax reductions), 32 keys per
        iteration, codes read as fp16 subnormals (``CONVERT_SUBNORMAL``), (scale, zero) pairs
        loaded one block ahead (``pairs_ahead``), token-major tiles, q heads padded to 8 --
        194 registers, no spills, 18.5 KB of shared memory per program, 8 programs per SM
        (the fastest of the sweep: docs/kernels.md#decode-defaults). These two apply from head_dim 65 up to 128 (timed and
        GPU-tested at 128); larger heads keep ``CONVERT_ASM_PERM`` without ``pairs_ahead``
        (GPU-tested at 192 / 256 / 512); when K or V has head_dim 64 or less (``min_head_dim``),
        where the permuting conversions are wrong on the GPU (:data:`PERMUTE_MIN_QUARTER`),
        decode takes ``CONVERT_ASM`` without ``pairs_ahead`` (GPU-tested at 64 / 64). Under the
        interpreter decode defaults to the emulations (``CONVERT_SUBNORMAL_EMULATED`` with
        ``pairs_ahead`` for 65-128, ``CONVERT_PERM_EMULATED`` above, ``CONVERT_ASM`` run as
        ``CONVERT_BITS`` when K or V is <= 64); GPU decode at head_dim 65-128 with ``pairs`` >=
        :data:`STAGES1_MIN_PAIRS` (batch 32 of an 8-kv-head model) takes ``num_stages`` 1, 2 otherwise,
        and with 2 stages and ``pairs_ahead`` the deferred sums (``defer_sums``; the interpreter follows the same rule by ``pairs``);
        extend defaults to ``CONVERT_ASM`` (run as ``CONVERT_BITS`` under the interpreter) and no
        ``pairs_ahead``.

        Note: a knob left unset takes its default even when others are set, so
        ``{"convert": 3}`` resolves to ``convert=3, pairs_ahead=True`` for decode at head_dim
        65-128; name ``pairs_ahead=False`` to turn the prefetch off.
        """
        interp = interpreting()
        t = AttnTuning(**self.as_dict())
        t.explicit = self.explicit
        # K or V of head_dim <= 64: no permuting conversion (see permuting_ok)
        small = not _permutable_head_dim(min_head_dim or head_dim)
        # decode with K and V head_dim in 65-128: the timed fast path (pairs_ahead, num_stages by
        # pairs, defer_sums)
        fast = not extend and not small and head_dim <= 128
        if t.convert is None:
            # the interpreter runs decode with the emulated permutation of the GPU default, so the
            # CPU tests exercise its bookkeeping (q column / V token permutation)
            if extend or small:
                t.convert = CONVERT_ASM
            elif head_dim <= 128:
                t.convert = CONVERT_SUBNORMAL_EMULATED if interp else CONVERT_SUBNORMAL
            else:
                t.convert = CONVERT_PERM_EMULATED if interp else CONVERT_ASM_PERM
        if t.pairs_ahead is None:
            t.pairs_ahead = fast
        many = fast and pairs is not None and pairs >= STAGES1_MIN_PAIRS

        if interp:
            t.block_n = t.block_n or 16
            t.block_m = t.block_m or 16
            t.num_warps = t.num_warps or 4
            t.num_stages = t.num_stages or 1
            t.min_block_h = t.min_block_h or 1
        elif extend:
            t.block_n = t.block_n or 64
            t.block_m = t.block_m or 64
            t.num_warps = t.num_warps or 4
            t.num_stages = t.num_stages or 2
            t.min_block_h = t.min_block_h or 16
        else:
            t.block_n = t.block_n or (32 if head_dim <= 128 else 64)
            t.block_m = t.block_m or 64
            t.num_warps = t.num_warps or max(1, head_dim // 128)
            t.num_stages = t.num_stages or (1 if many else 2)
            t.min_block_h = t.min_block_h or 8
        if t.defer_sums is None:
            # the interpreter resolves num_stages to 1 regardless, so it follows the GPU's choice:
            # an explicit num_stages, else the pairs bound
            if interp:
                staged = self.num_stages >= 2 if self.num_stages is not None else not many
            else:
                staged = t.num_stages >= 2
            t.defer_sums = fast and bool(t.pairs_ahead) and staged
        return t

    @classmethod
    def of(cls, tuning) -> "AttnTuning":
        if tuning is None:
            return cls()
        if isinstance(tuning, cls):
            return tuning
        if isinstance(tuning, dict):
            unknown = set(tuning) - set(cls.KNOBS)
            if unknown:
                raise ValueError(f"unknown tuning keys {sorted(unknown)}; allowed: {cls.KNOBS}")
            return cls(**tuning)
        raise ValueError(f"tuning must be a dict or AttnTuning, got {type(tuning).__name__}")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KNOBS}

    def launch_options(self) -> dict:
        """Extra Triton launch options (only those that are set; the interpreter ignores them)."""
        return {} if self.maxnreg is None or interpreting() else {"maxnreg": self.maxnreg}


_TUNING_CACHE: dict = {}


def _resolved_tuning(tuning, layout: Int2Layout, extend: bool, pairs: int | None = None) -> AttnTuning:
    """:meth:`AttnTuning.resolved` for ``layout``'s K/V head dims and ``pairs`` (requests x kv
    heads), memoized for ``None`` and dict tunings (hot path)."""
    hi = max(layout.k.head_dim, layout.v.head_dim)
    lo = min(layout.k.head_dim, layout.v.head_dim)
    # only the side of STAGES1_MIN_PAIRS matters to resolved(): one cache entry per side
    pairs = None if pairs is None or pairs < STAGES1_MIN_PAIRS else STAGES1_MIN_PAIRS
    if tuning is None or isinstance(tuning, dict):
        # the value's type is part of the key: True == 1 would otherwise let {"async_slots": 1} hit the
        # entry of {"async_slots": True} and skip AttnTuning's type check
        key = (None if tuning is None else tuple(sorted((k, type(v).__name__, v) for k, v in tuning.items())),
               hi, lo, extend, pairs, interpreting())
        hit = _TUNING_CACHE.get(key)
        if hit is None:
            hit = _TUNING_CACHE[key] = AttnTuning.of(tuning).resolved(hi, extend, min_head_dim=lo, pairs=pairs)
        return hit
    return AttnTuning.of(tuning).resolved(hi, extend, min_head_dim=lo, pairs=pairs)


def effective_convert(convert: int, op: torch.dtype, permuting_ok: bool, subnormal_ok: bool = False) -> int:
    """The conversion a kernel actually runs (see :class:`AttnTuning`).

    ``subnormal_ok``: the launch takes the decode token-major fast path (the only one that
    understands ``CONVERT_SUBNORMAL``'s scaling); otherwise 5/6 run as 3/4.
    """
    interp = interpreting()
    if convert in (CONVERT_SUBNORMAL, CONVERT_SUBNORMAL_EMULATED):
        if permuting_ok and subnormal_ok:
            if interp or convert == CONVERT_SUBNORMAL_EMULATED:
                return CONVERT_SUBNORMAL_EMULATED
            if op == torch.float16:
                return CONVERT_SUBNORMAL
            # fp32 / bf16 operands on the GPU: the fp16-subnormal trick does not apply; take the
            # path ``CONVERT_ASM_PERM`` takes (plain bit trick for non-fp16 operands)
        convert = CONVERT_ASM_PERM if convert == CONVERT_SUBNORMAL else CONVERT_PERM_EMULATED
    if convert in (CONVERT_ASM_PERM, CONVERT_PERM_EMULATED):
        if permuting_ok and (interp or convert == CONVERT_PERM_EMULATED):
            return CONVERT_PERM_EMULATED
        if permuting_ok and op == torch.float16:
            return CONVERT_ASM_PERM
        convert = CONVERT_ASM
    if convert == CONVERT_ASM and (interp or op != torch.float16):
        return CONVERT_BITS
    return convert
