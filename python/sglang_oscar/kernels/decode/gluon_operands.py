"""Operand bookkeeping of the Gluon decode loop (:mod:`.gluon_kernel`): which head dims the K columns
and V rows of the ``mma.sync`` fragments stand for, and the inline-PTX code conversions.

Pure Python, importable without Gluon, so the CPU tests check the bookkeeping against the packing
(:mod:`sglang_oscar.quant.packing`); :mod:`.gluon_stage1` explains the scheme.
"""

from __future__ import annotations

HEAD_DIM = 128
HEADS_PER_PROGRAM = 8  # the MMA's N: q heads of one kv head per program (padded, masked)


def head_blocks(group: int) -> int:
    """Programs per kv head: blocks of :data:`HEADS_PER_PROGRAM` q heads (the last one masked)."""
    return -(-group // HEADS_PER_PROGRAM)
# The operand bookkeeping, shared with tests/kernels/test_gluon_layout.py (which replays it in torch):
# the 16 outputs of a conversion are joined pairwise into [..., 8 words, b0, b1, b2, b3] (join appends
# its new axis last), then K splits the word axis into (t, half) and permutes, V permutes.
K_WORD_SPLIT = (4, 2)
K_PERM = (0, 6, 5, 4, 3, 1, 2)  # [N, t, h, b0, b1, b2, b3] -> column 8 o + 2 t + h, o = 8 b3 + 4 b2 + 2 b1 + b0
V_PERM = (5, 4, 3, 2, 1, 0)  # [N, g, b0, b1, b2, b3] -> row 8 m + g, m = 8 b3 + 4 b2 + 2 b1 + b0
P_PERM = (0, 2, 1)  # per 8x8 tile, after movmatrix.trans


def k_column_dims(head_dim: int = HEAD_DIM) -> list[int]:
    """Dim of K fed at logical reduction column ``c`` of the score MMA, for ``c`` in ``[0, 128)``.

    ``c = 8 o + 2 t + h``: thread ``t``'s words ``2t + o // 8``; ``o % 8 < 4`` the even bytes,
    else the odd ones (after ``>> 8``); ``h`` the low / high 16-bit half (bytes 0/1 vs 2/3);
    ``o % 4`` the quarter. Returns a permutation of ``range(128)``.
    """
    if head_dim != HEAD_DIM:
        raise ValueError(f"the Gluon decode loop is built for head_dim {HEAD_DIM}, not {head_dim}")
    q = head_dim // 4
    dims = []
    for c in range(head_dim):
        o, t, h = c // 8, (c // 2) % 4, c % 2
        word = 2 * t + o // 8
        byte = 2 * h + (o // 4) % 2
        dims.append(4 * word + byte + q * (o % 4))
    return dims


def v_row_dims(head_dim: int = HEAD_DIM) -> list[int]:
    """Dim of V held in row ``r`` of the value accumulator ``O^T`` (``r = 8 m + g``: word ``g``,
    byte ``m // 4`` of it, quarter ``m % 4``). Returns a permutation of ``range(128)``."""
    if head_dim != HEAD_DIM:
        raise ValueError(f"the Gluon decode loop is built for head_dim {HEAD_DIM}, not {head_dim}")
    q = head_dim // 4
    return [4 * (r % 8) + (r // 8) // 4 + q * ((r // 8) % 4) for r in range(head_dim)]


def _and_lines(sources) -> list[str]:
    # output 4 i + k: the two codes of quarter k in the 16-bit halves of source register i
    return [f"and.b32 ${4 * i + k}, {src}, 0x{(0x00030003 << (2 * k)):08X};"
            for i, src in enumerate(sources) for k in range(4)]


def _k_asm() -> str:
    # pack=2: $16 = word 2t, $17 = word 2t+1 of one key row; 16 outputs, each two fp16 subnormals
    return "\n".join(["{", ".reg .b32 a8, b8;", "shr.b32 a8, $16, 8;", "shr.b32 b8, $17, 8;",
                      *_and_lines(("$16", "a8", "$17", "b8")), "}"])


def _v_asm() -> str:
    # pack=2: $16 / $17 = word g of keys 2t / 2t+1; output m = 4 byte + quarter, low half key 2t
    return "\n".join(["{", ".reg .b32 x, y, x8, y8;", "prmt.b32 x, $16, $17, 0x5410;",
                      "prmt.b32 y, $16, $17, 0x7632;", "shr.b32 x8, x, 8;", "shr.b32 y8, y, 8;",
                      *_and_lines(("x", "x8", "y", "y8")), "}"])

