#!/usr/bin/env python
"""Gluon kernels compile for sm_90 on a machine without a GPU: a minimal check (issue 3 groundwork).

Gluon (``triton.experimental.gluon``, explicit blocked / MMA / shared layouts) does not run under
``TRITON_INTERPRET=1``, but ``triton.compile`` takes a Gluon source for a ``GPUTarget`` and
produces a cubin whose SASS the Triton wheel's ``cuobjdump`` lists, as
``scripts/sass_loop_count.py`` does for the Triton kernels. A Gluon decode loop can therefore be
developed against static instruction counts on the CPU box and tested against the oracle on the
GPU only.

    python scripts/gluon_compile_check.py     # prints the artefacts and the SASS instruction count
"""

from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang_oscar.kernels.compile_check import cuobjdump  # noqa: E402


@gluon.jit
def scale2(x_ptr, y_ptr, n, BLOCK: gl.constexpr):
    """``y = 2 x`` over ``n`` fp32 elements, 4 per thread in one warp's blocked layout."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    gl.store(y_ptr + offs, gl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter has no compiler", file=sys.stderr)
        return 2
    src = GluonASTSource(scale2, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    sass = cuobjdump(k.asm["cubin"], "-sass")
    count = sum(1 for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line)
    print(f"triton {triton.__version__}: artefacts {sorted(k.asm)}; {count} SASS instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
