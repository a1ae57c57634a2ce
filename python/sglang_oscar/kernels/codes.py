"""Small Triton helpers shared by the INT2 kernels: rounding, code unpacking, levels.

Everything here is ``@triton.jit`` and runs both compiled and under ``TRITON_INTERPRET=1``.

* :func:`round_to` rounds fp32 to fp32/fp16/bf16 with round-to-nearest-even. BF16 rounding is
  done with integer ops because triton 3.6's interpreter truncates fp32 -> bf16 casts (the
  compiled path rounds to nearest even); the integer form gives the same bits everywhere.
* :func:`to_f32` converts any float tile to fp32 (the interpreter mangles bf16 -> fp16 casts, so
  every conversion goes through fp32).
* :func:`code_operand` turns packed bytes into an MMA operand of value ``1 + c/4`` (or
  ``1 + b0/2`` for bit 0 of the code), exactly, without an int->float conversion instruction:
  the code bits are placed in the top mantissa bits of ``1.0`` and the word is bit-cast. The
  offset ``1`` is removed in the epilogue (``decode.py`` docstring), so MMA operands stay small
  (no ``1024 + c`` operands, which lose precision in tensor-core accumulation). ``CONVERT`` 5/6
  (decode token-major only) instead read the bits in place as fp16 subnormals ``c * 2^(2K-24)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# CONVERT modes of code_operand (configs.TritonConfig.convert names 1, 2, 3 or 5; 4 and 6 are the
# interpreter's emulations of 3 and 5, chosen by configs.effective_convert).
CONVERT_BITS = 1  # mantissa bit trick in plain Triton: the portable mode (non-fp16 operands, interpreter)
CONVERT_ASM = 2  # packed PTX (prmt + lop3 on 32-bit words); CUDA only, never under the interpreter
# packed PTX without byte permutes: each group of 4 consecutive K elements comes out in the order
# (0, 2, 1, 3); the kernels compensate by permuting q's K index / the V tile's token order the
# same way (decode INT2 programs only). CUDA only; CONVERT_PERM_EMULATED is the same permutation
# done with reshapes, for the interpreter tests of that bookkeeping.
CONVERT_ASM_PERM = 3
CONVERT_PERM_EMULATED = 4
# decode token-major INT2 fast path only: the code bits stay where they are and the word is read as
# fp16 *subnormals*, operand = c * 2^(2K-24) for quarter K (one AND per two codes, one shift per
# word for its odd bytes; no 1.0 offset to remove). Same (0, 2, 1, 3) order as CONVERT_ASM_PERM;
# the kernel pre-scales q by 2^-2K and folds 2^24 into the epilogue. CONVERT_SUBNORMAL_EMULATED
# computes the same values with integer ops and perm4 (interpreter, any operand dtype). GPU decode
# default for head_dim 65-128 (configs.default_triton_config); extend defaults to CONVERT_ASM.
CONVERT_SUBNORMAL = 5
CONVERT_SUBNORMAL_EMULATED = 6


@triton.jit
def round_to(x, DT: tl.constexpr):
    """Round an fp32 tile to ``DT`` (fp32 / fp16 / bf16), round-to-nearest-even; NaN stays NaN."""
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        r = b + 0x7FFF + ((b >> 16) & 1)
        r = tl.where(x != x, 0x7FC00000, r)  # NaN stays NaN (the sum overflows for NaN patterns near 0x7FFFFFFF)
        return (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DT == tl.float16:
        return x.to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def to_f32(x):
    """Any float tile -> fp32 (exact)."""
    return x.to(tl.float32)


@triton.jit
def to_operand(x, OP: tl.constexpr):
    """Float tile (any dtype) -> MMA operand dtype ``OP``, through fp32, RNE."""
    return round_to(x.to(tl.float32), OP)


@triton.jit
def level_of(c, l0, l1, l2, l3):
    """fp32 level of integer codes ``c`` (0..3) from the four fp32 levels (exact table lookup)."""
    return tl.where(c == 0, l0, tl.where(c == 1, l1, tl.where(c == 2, l2, l3)))


def _asm_source(shift: int, bit0: bool) -> str:
    # pack=4: four uint8 elements arrive in one 32-bit register ($2, element 0 in the low byte);
    # the four fp16 results leave two per 32-bit register ($0 = elements 0, 1; $1 = 2, 3; lower
    # element in the low half). Each byte is handled on its own (bits that spill across bytes in
    # the shift are masked off), so the result is elementwise whatever register layout Triton picks.
    # value = 1.0 + c/4 (code bits at fp16 mantissa bits 8-9) or, with bit0, 1.0 + b0/2 (bit 0
    # of the code at mantissa bit 9).
    if bit0:
        shift_op = "shl.b32 t, $2, 1;" if shift == 0 else f"shr.b32 t, $2, {shift - 1};"
        mask = "0x02000200"
    else:
        shift_op = f"shr.b32 t, $2, {shift};"
        mask = "0x03000300"
    return (
        "{\n.reg .b32 t, a, c;\n"
        f"{shift_op}\n"
        "prmt.b32 a, t, t, 0x1000;\n"
        "prmt.b32 c, t, t, 0x3020;\n"
        f"lop3.b32 $0, a, {mask}, 0x3C003C00, 0xEA;\n"
        f"lop3.b32 $1, c, {mask}, 0x3C003C00, 0xEA;\n"
        "}"
    )


def _asm_perm_source(shift: int, bit0: bool) -> str:
    # No prmt: the low fp16 lane of $0 takes byte 0, its high lane byte 2 (shift left so the
    # code lands on mantissa bits 8-9 / 24-25); $1 takes bytes 1 and 3 (shift right). Output
    # element order is therefore (e0, e2, e1, e3).
    if bit0:
        lo = f"shl.b32 a, $2, {9 - shift};"
        hi = "shl.b32 c, $2, 1;" if shift == 0 else f"shr.b32 c, $2, {shift - 1};"
        mask = "0x02000200"
    else:
        lo = f"shl.b32 a, $2, {8 - shift};"
        hi = f"shr.b32 c, $2, {shift};"
        mask = "0x03000300"
    return (
        "{\n.reg .b32 a, c;\n"
        f"{lo}\n{hi}\n"
        f"lop3.b32 $0, a, {mask}, 0x3C003C00, 0xEA;\n"
        f"lop3.b32 $1, c, {mask}, 0x3C003C00, 0xEA;\n"
        "}"
    )


def _asm_subnormal_source(shift: int, bit0: bool) -> str:
    # $0: bytes 0 and 2 (fp16 lanes low/high), $1: bytes 1 and 3; the code bits of quarter K sit
    # at bits 2K..2K+1 of each byte and are kept in place: an fp16 with exponent 0 and mantissa
    # m is the subnormal m * 2^-24, so lane value = c * 2^(2K-24) (bit 0 only with bit0).
    mask = (0x00010001 if bit0 else 0x00030003) << shift
    return (
        "{\n.reg .b32 t;\n"
        f"and.b32 $0, $2, {mask:#010x};\n"
        "shr.b32 t, $2, 8;\n"
        f"and.b32 $1, t, {mask:#010x};\n"
        "}"
    )


_ASM_C0 = tl.constexpr(_asm_source(0, False))
_ASM_C1 = tl.constexpr(_asm_source(2, False))
_ASM_C2 = tl.constexpr(_asm_source(4, False))
_ASM_C3 = tl.constexpr(_asm_source(6, False))
_ASM_B0 = tl.constexpr(_asm_source(0, True))
_ASM_B1 = tl.constexpr(_asm_source(2, True))
_ASM_B2 = tl.constexpr(_asm_source(4, True))
_ASM_B3 = tl.constexpr(_asm_source(6, True))
_ASMP_C0 = tl.constexpr(_asm_perm_source(0, False))
_ASMP_C1 = tl.constexpr(_asm_perm_source(2, False))
_ASMP_C2 = tl.constexpr(_asm_perm_source(4, False))
_ASMP_C3 = tl.constexpr(_asm_perm_source(6, False))
_ASMP_B0 = tl.constexpr(_asm_perm_source(0, True))
_ASMP_B1 = tl.constexpr(_asm_perm_source(2, True))
_ASMP_B2 = tl.constexpr(_asm_perm_source(4, True))
_ASMP_B3 = tl.constexpr(_asm_perm_source(6, True))


_ASMS_C0 = tl.constexpr(_asm_subnormal_source(0, False))
_ASMS_C1 = tl.constexpr(_asm_subnormal_source(2, False))
_ASMS_C2 = tl.constexpr(_asm_subnormal_source(4, False))
_ASMS_C3 = tl.constexpr(_asm_subnormal_source(6, False))
_ASMS_B0 = tl.constexpr(_asm_subnormal_source(0, True))
_ASMS_B1 = tl.constexpr(_asm_subnormal_source(2, True))
_ASMS_B2 = tl.constexpr(_asm_subnormal_source(4, True))
_ASMS_B3 = tl.constexpr(_asm_subnormal_source(6, True))


@triton.jit
def _asm_call(b, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(
        asm=ASM, constraints="=r,=r,r", args=[b], dtype=tl.float16, is_pure=True, pack=4
    )


@triton.jit
def _asm_select(b, K: tl.constexpr, BIT0: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr,
                C3: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    """The packed conversion of quarter ``K`` from one family of asm sources (codes / bit 0)."""
    if BIT0:
        if K == 0:
            r = _asm_call(b, B0)
        elif K == 1:
            r = _asm_call(b, B1)
        elif K == 2:
            r = _asm_call(b, B2)
        else:
            r = _asm_call(b, B3)
    else:
        if K == 0:
            r = _asm_call(b, C0)
        elif K == 1:
            r = _asm_call(b, C1)
        elif K == 2:
            r = _asm_call(b, C2)
        else:
            r = _asm_call(b, C3)
    return r


@triton.jit
def _asm_operand(b, K: tl.constexpr, BIT0: tl.constexpr):
    return _asm_select(b, K, BIT0, _ASM_C0, _ASM_C1, _ASM_C2, _ASM_C3, _ASM_B0, _ASM_B1, _ASM_B2, _ASM_B3)


@triton.jit
def _asm_perm_operand(b, K: tl.constexpr, BIT0: tl.constexpr):
    return _asm_select(b, K, BIT0, _ASMP_C0, _ASMP_C1, _ASMP_C2, _ASMP_C3, _ASMP_B0, _ASMP_B1, _ASMP_B2, _ASMP_B3)


@triton.jit
def _asm_subnormal_operand(b, K: tl.constexpr, BIT0: tl.constexpr):
    return _asm_select(b, K, BIT0, _ASMS_C0, _ASMS_C1, _ASMS_C2, _ASMS_C3, _ASMS_B0, _ASMS_B1, _ASMS_B2, _ASMS_B3)


@triton.jit
def _code_subnormal(b, K: tl.constexpr, OP: tl.constexpr, BIT0: tl.constexpr):
    """``c * 2^(2K-24)`` (or ``(c & 1) * 2^(2K-24)``) in ``OP``, exactly, by integer ops (emulation)."""
    w = b.to(tl.int32) & ((1 if BIT0 else 3) << (2 * K))
    return round_to(w.to(tl.float32) * 5.9604644775390625e-08, OP)  # 2^-24


@triton.jit
def perm4(x, KAXIS: tl.constexpr):
    """Reorder every group of 4 consecutive elements along ``KAXIS`` (0 or 1) of a 2-D tile as (0, 2, 1, 3)."""
    A: tl.constexpr = x.shape[0]
    B: tl.constexpr = x.shape[1]
    if KAXIS == 1:
        y = tl.permute(tl.reshape(x, [A, B // 4, 2, 2]), [0, 1, 3, 2])
    else:
        y = tl.permute(tl.reshape(x, [A // 4, 2, 2, B]), [0, 2, 1, 3])
    return tl.reshape(y, [A, B])


@triton.jit
def perm4_index(j):
    """Index map of :func:`perm4` (an involution): 4u+1 <-> 4u+2."""
    r = j & 3
    return tl.where((r == 1) | (r == 2), j ^ 3, j)


@triton.jit
def code_operand(b, K: tl.constexpr, OP: tl.constexpr, BIT0: tl.constexpr, CONVERT: tl.constexpr,
                 KAXIS: tl.constexpr = 0):
    """Packed bytes ``b`` (uint8) -> operand of quarter ``K`` in dtype ``OP``.

    Returns ``1 + c/4`` where ``c = (b >> 2K) & 3`` (``BIT0`` False), or ``1 + (c & 1)/2``
    (``BIT0`` True). Exact in fp16, bf16 and fp32. With ``CONVERT`` 3/4 the elements of every
    group of 4 along the MMA's K axis (``KAXIS`` of the tile) come out in the order (0, 2, 1, 3).
    ``CONVERT`` 5/6 (decode token-major fast path only) return ``c * 2^(2K-24)`` (``(c & 1) *
    2^(2K-24)``), fp16 subnormals, in the same permuted order.
    """
    if CONVERT == 3:
        return _asm_perm_operand(b, K, BIT0)
    elif CONVERT == 4:
        return perm4(_code_bits(b, K, OP, BIT0), KAXIS)
    elif CONVERT == 5:
        return _asm_subnormal_operand(b, K, BIT0)
    elif CONVERT == 6:
        return perm4(_code_subnormal(b, K, OP, BIT0), KAXIS)
    elif CONVERT == 2 and OP == tl.float16:
        return _asm_operand(b, K, BIT0)
    else:
        return _code_bits(b, K, OP, BIT0)


@triton.jit
def _code_bits(b, K: tl.constexpr, OP: tl.constexpr, BIT0: tl.constexpr):
    w = b.to(tl.int32)
    if OP == tl.float32:
        if BIT0:
            r = ((w << (22 - 2 * K)) & (1 << 22)) | 0x3F800000
        else:
            r = ((w << (21 - 2 * K)) & (3 << 21)) | 0x3F800000
        return r.to(tl.float32, bitcast=True)
    elif OP == tl.float16:
        if BIT0:
            r = ((w << (9 - 2 * K)) & 0x200) | 0x3C00
        else:
            r = ((w << (8 - 2 * K)) & 0x300) | 0x3C00
        return r.to(tl.int16).to(tl.float16, bitcast=True)
    else:
        if BIT0:
            r = ((w << (6 - 2 * K)) & 0x40) | 0x3F80
        else:
            if K < 3:
                r = ((w << (5 - 2 * K)) & 0x60) | 0x3F80
            else:
                r = ((w >> 1) & 0x60) | 0x3F80
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
