#!/usr/bin/env python
"""Gluon kernels compile for sm_90 on a machine without a GPU: a minimal check (issue 3 groundwork).

Gluon (``triton.experimental.gluon``, explicit blocked / MMA / shared layouts) does not run under
``TRITON_INTERPRET=1``, but ``triton.compile`` takes a Gluon source for a ``GPUTarget`` and
produces a cubin whose SASS the Triton wheel's ``cuobjdump`` lists, as
``tests/kernels/sass_loop_count.py`` does for the Triton kernels. A Gluon decode loop can therefore be
developed against static instruction counts on the CPU box and tested against the oracle on the
GPU only.

    python tests/kernels/gluon_compile_check.py     # prints the artefacts and the SASS instruction count
    python tests/kernels/gluon_compile_check.py --decode [--block-n 32]   # decode loop (JSON)
    python tests/kernels/gluon_compile_check.py --decode --order   # + the INT2 loop's opcode order as letters

``--decode`` compiles ``kernels.decode.gluon_kernel._gluon_decode_stage1`` (32 q / 8 kv heads, head_dim 128)
and prints one JSON line: registers, spill stack, shared memory, and the opcode counts of each
backward-branch loop (the HP-tier loop, then the INT2 key loop).
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from sglang_oscar.kernels import GluonConfig
from sglang_oscar.kernels.compile_check import cuobjdump, sass_loops


@gluon.jit
def scale2(x_ptr, y_ptr, n, BLOCK: gl.constexpr):
    """``y = 2 x`` over ``n`` fp32 elements, 4 per thread in one warp's blocked layout."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    gl.store(y_ptr + offs, gl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def decode_loop_stats(block_n: int = 32) -> dict:
    """Compile the Gluon decode kernel for sm_90 through the real launch path (``decode_attention``
    with ``GluonConfig(block_n=block_n)`` inside ``compile_check.compile_only``, on the small CPU pool of
    tests/kernels/compile_sm90.py: 32 q / 8 kv heads, head_dim 128, so Triton specialises the
    strides as it would on the GPU) and return its resource use and loop opcodes."""
    import re

    import compile_sm90

    from sglang_oscar.kernels.compile_check import COMPILED, compile_only

    with compile_only("cuda", 90):
        before = len(COMPILED)
        compile_sm90._attn("d", config=GluonConfig(block_n=block_n))
        k = next(c[3] for c in COMPILED[before:] if c[0] == "_gluon_decode_stage1")
    usage = cuobjdump(k.asm["cubin"], "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    sass = cuobjdump(k.asm["cubin"], "-sass")
    found = sass_loops(sass)
    loops = [dict(ops) for _, _, ops in found]
    return {"block_n": block_n, "registers": int(m.group(1)), "stack": int(m.group(2)),
            "shared": int(k.metadata.shared), "loops": loops,
            "loop_instructions": [sum(x.values()) for x in loops],
            "int2_loop_order": loop_order(sass, *found[-1][:2]) if found else ""}


#: one letter per opcode in :func:`loop_order` (others are left out)
ORDER_LETTERS = {"HMMA": "H", "SHFL": "S", "MUFU": "E", "LDS": "l", "LDGSTS": "g", "FMNMX": "x", "LOP3": "o",
                 "MOVM": "m", "LDG": "G"}


def loop_order(sass: str, lo: int, hi: int) -> str:
    """The issue order of a loop's key opcodes as letters (:data:`ORDER_LETTERS`: H = HMMA, S = SHFL,
    E = MUFU, l = LDS, g = LDGSTS, x = FMNMX, o = LOP3, m = MOVM, G = LDG), for reading how ptxas
    interleaved the dependency chains of an iteration."""
    import re

    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and lo <= int(m.group(1), 16) <= hi:
            op = re.sub(r"^@!?U?P\w+\s+", "", m.group(2)).split()[0].split(".")[0]
            out.append(ORDER_LETTERS.get(op, ""))
    return "".join(out)


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", action="store_true", help="compile the Gluon decode loop, print JSON stats")
    ap.add_argument("--block-n", type=int, default=32, choices=(16, 32))
    ap.add_argument("--order", action="store_true", help="with --decode: print the INT2 loop's opcode order "
                    "(loop_order letters) after the JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter has no compiler", file=sys.stderr)
        return 2
    if args.decode:
        stats = decode_loop_stats(args.block_n)
        order = stats.pop("int2_loop_order")
        print(json.dumps(stats))
        if args.order:
            print(order)
        return 0
    src = GluonASTSource(scale2, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    sass = cuobjdump(k.asm["cubin"], "-sass")
    count = sum(1 for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line)
    print(f"triton {triton.__version__}: artefacts {sorted(k.asm)}; {count} SASS instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
