"""Compile the kernels for a CUDA target on a machine without a GPU (no launch).

Inside ``with compile_only("cuda", 90):`` every wrapper of :mod:`.launch` compiles its kernel
launch for that target (Triton front end, TTGIR passes, LLVM, and ``ptxas`` from the Triton
wheel) instead of running it, so compile errors of the GPU path -- including the inline PTX of
the ``CONVERT_ASM`` code conversion -- show up in CPU CI. Inputs may be CPU tensors; outputs are
left unwritten. Requires ``TRITON_INTERPRET`` unset (the interpreter has no compiler).
"""

from __future__ import annotations

import contextlib
import time

import torch

_TARGET = None
COMPILED: list = []

_DTYPE_STR = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.bool: "i1",
}


@contextlib.contextmanager
def compile_only(backend: str = "cuda", arch: int = 90, warp_size: int = 32):
    """Context manager: wrappers compile for ``GPUTarget(backend, arch, warp_size)`` instead of launching."""
    global _TARGET
    from triton.backends.compiler import GPUTarget

    prev = _TARGET
    _TARGET = GPUTarget(backend, arch, warp_size)
    try:
        yield COMPILED
    finally:
        _TARGET = prev


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (CPU interpreter)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def active() -> bool:
    """Whether a :func:`compile_only` block is open (wrappers compile for its target instead of launching)."""
    return _TARGET is not None


def compile_launch(kernel, args: tuple, kwargs: dict):
    """Compile ``kernel[grid](*args, **kwargs)`` for the active target; returns the compiled kernel."""
    import triton
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg") if k in kwargs}
    names = kernel.arg_names
    bound = dict(zip(names, args))
    bound.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, kernel.params)):
        v = bound[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = v
        elif v is None:
            signature[name] = "constexpr"
            constexprs[name] = None
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _DTYPE_STR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0 and v != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"cannot describe argument {name}={v!r} for offline compile")
    t0 = time.time()
    source = ASTSource
    if type(kernel).__name__ == "GluonJITFunction":  # Gluon kernels compile from their own AST source
        from triton.experimental.gluon._runtime import GluonASTSource as source
    compiled = triton.compile(source(kernel, signature, constexprs, attrs), target=_TARGET, options=options)
    COMPILED.append((kernel.__name__, dict((k, v) for k, v in constexprs.items() if not hasattr(v, "data_ptr")),
                     time.time() - t0, compiled))
    return compiled


def row_args(*tensors) -> tuple:
    """``(t, t.stride(0), t.stride(1))`` for each tensor, flattened: how the attention kernels take
    a buffer of rows ``[rows, heads, ...]`` (or ``q``) -- its pointer and its row and head strides."""
    return tuple(x for t in tensors for x in (t, t.stride(0), t.stride(1)))


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, or an offline compile inside :func:`compile_only`.

    Raises:
        ValueError: the first tensor argument is on the CPU and the kernel is compiled, not
            interpreted (``TRITON_INTERPRET`` was not set when the kernels were imported; Triton would
            fail later with "0 active drivers").
    """
    if _TARGET is not None:
        return compile_launch(kernel, args, kwargs)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and first.device.type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise ValueError(f"{getattr(kernel, '__name__', 'kernel')}: the tensors are on the CPU; the Triton kernels "
                         "need CUDA tensors (or TRITON_INTERPRET=1 to run them in Triton's CPU interpreter, small "
                         "shapes only)")
    return kernel[grid](*args, **kwargs)


def cuobjdump(cubin: bytes, flag: str = "-sass") -> str:
    """Output of the Triton wheel's ``cuobjdump <flag>`` on a cubin (``-sass``: the SASS listing,
    ``-res-usage``: registers / stack / shared memory per kernel).

    Raises:
        subprocess.CalledProcessError: ``cuobjdump`` failed.
    """
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass_loops(sass: str) -> list:
    """``(start, end, opcode Counter)`` of every backward-branch loop in a SASS listing
    (:func:`cuobjdump` ``-sass``); predicates are stripped, so ``@P0 LDG.E`` counts as ``LDG``."""
    import collections
    import re

    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    out = []
    for a, text in ins:
        if "BRA" in text:
            t = re.search(r"0x([0-9a-f]+)", text.split("BRA")[1])
            if t and int(t.group(1), 16) < a:
                lo = int(t.group(1), 16)
                body = [x for b, x in ins if lo <= b <= a]
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
                out.append((lo, a, ops))
    return out
