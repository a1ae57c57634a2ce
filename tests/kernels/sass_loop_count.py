#!/usr/bin/env python
"""Static cost of the decode stage-1 kernel: compile it for sm_90 on a machine without a GPU and
count the SASS instructions of its loops (the INT2 loop is the last one), plus registers, spill
stack and shared memory.

    python tests/kernels/sass_loop_count.py '{}' '{"convert": 3, "pairs_ahead": false}'   # TritonConfig fields as JSON

(``{}`` = ``TritonConfig()``, the head_dim-128 default; run with TRITON_INTERPRET unset.)

Uses ``kernels.compile_check.compile_only`` with the small CPU pool of tests/kernels/compile_sm90.py
(32 q / 8 kv heads, head_dim 128) and the Triton wheel's ``cuobjdump``.
"""

from __future__ import annotations

import json
import sys

import compile_sm90
from sglang_oscar.kernels import TritonConfig
from sglang_oscar.kernels.compile_check import COMPILED, compile_only, cuobjdump
from sglang_oscar.kernels.compile_check import sass_loops as loops


def main(argv=None) -> int:
    fields = [json.loads(a) for a in (argv if argv is not None else sys.argv[1:])] or [{}]
    for tn in fields:
        COMPILED.clear()
        with compile_only("cuda", 90):
            compile_sm90._attn("d", config=TritonConfig(**tn))
        k = next(c[3] for c in COMPILED if c[0] == "_decode_stage1")
        res = cuobjdump(k.asm["cubin"], "-res-usage")
        sass = cuobjdump(k.asm["cubin"], "-sass")
        usage = " ".join(x.strip() for x in res.splitlines() if "REG" in x)
        print(f"{json.dumps(tn)}: {usage} shared {k.metadata.shared}")
        for lo, hi, ops in loops(sass):
            print(f"  loop {lo:#x}-{hi:#x}: {sum(ops.values())} instructions; {ops.most_common()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
