"""Prefill without attention, so a benchmark can fill a server's whole KV pool in GEMM time.

``bench_full_pool`` measures decode with the pool full of long requests (39 x 128K tokens for
int2 on Qwen3-8B); their prefill, mostly causal-attention FLOPs, would take ~13 minutes, longer
than a device call. Servers started with ``OSCAR_BENCH_FAST_FILL=1`` load this benchmark-only
SGLang plugin (entry point ``oscar_bench_fill``; :func:`write_fill_shim` installs it), whose hooks
make every extend (prefill) attention write zeros instead of attending:

* SGLang's Triton backend (BF16 / FP8 servers, and any layer the INT2 backend hands back to it):
  an AFTER hook of ``TritonAttnBackend.__init__`` replaces the instance's ``extend_attention_fwd``
  and ``extend_attention_fwd_unified`` kernels (``o``: their 4th / 2nd positional argument) by a
  fill with zeros; ``forward_extend`` still writes K / V to the pool before calling them.
* The INT2 backend: an AROUND hook of ``ExtendPlan.run`` returns zeros of the plan's output shape
  and dtype (and an LSE of zeros if the plan returns one); ``forward_extend`` still rotates,
  quantizes and writes K / V before it.

So every prompt token's K / V rows are computed by the model's projections and written in the
format's layout, and the decode steps, which the hooks leave alone, read a pool of the same size
and layout as after a real prefill. Only the values differ (the layers see zeros from attention),
which the decode kernels' time does not depend on for a dense model. Not for MoE models: their
routing, and so a step's expert reads, depends on the values.

:func:`write_fill_shim` copies this file into the shim folder as the top-level module
``oscar_bench_fill_shim``; it imports nothing of the benchmarks. The first zero fill of a process
creates the file ``$OSCAR_BENCH_FILL_MARKER`` (if set), so the benchmark can tell that the hooks
are active (SGLang logs plugin loading before its logging is configured).
"""

from __future__ import annotations

import os

FILL_ENV = "OSCAR_BENCH_FAST_FILL"
MARKER_ENV = "OSCAR_BENCH_FILL_MARKER"
FILL_ENTRY = "oscar_bench_fill"
FILL_MODULE = "oscar_bench_fill_shim"
SGLANG_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"
INT2_TARGET = "sglang_oscar.kernels.extend.ExtendPlan.run"


_marked = False


def _mark() -> None:
    """Create ``$OSCAR_BENCH_FILL_MARKER`` once per process: a zero fill ran."""
    global _marked
    if not _marked and os.environ.get(MARKER_ENV):
        open(os.environ[MARKER_ENV], "a").close()
    _marked = True


def _zero_fill(out_index: int):
    """A stand-in for an SGLang extend kernel: fills its output (positional ``out_index``) with zeros."""

    def kernel(*args, **kwargs):
        args[out_index].zero_()
        _mark()

    return kernel


def sglang_extend_writes_zeros(result, self, *args, **kwargs):
    """AFTER hook of ``TritonAttnBackend.__init__``: its extend kernels become zero fills
    (``extend_attention_fwd(q, k, v, o, ...)``, ``extend_attention_fwd_unified(q, o, ...)``)."""
    self.extend_attention_fwd = _zero_fill(3)
    self.extend_attention_fwd_unified = _zero_fill(1)
    return result


def int2_extend_writes_zeros(original_fn, self, q, *buffers, out=None, **kwargs):
    """AROUND hook of ``ExtendPlan.run``: zeros ``[N, H_q, D_v]`` in the plan's ``out_dtype`` (``out``
    zeroed in place if given), plus an fp32 LSE of zeros ``[N, H_q]`` if the plan returns one; the
    kernel does not run."""
    import torch

    _mark()
    out = torch.zeros(self.out_shape, dtype=self.out_dtype, device=q.device) if out is None else out.zero_()
    if self.return_lse:
        return out, torch.zeros(self.out_shape[:2], dtype=torch.float32, device=q.device)
    return out


def fill_register() -> None:
    """SGLang plugin entry point ``oscar_bench_fill``: with ``OSCAR_BENCH_FAST_FILL=1`` in the
    server's environment registers both hooks (once); otherwise does nothing."""
    if os.environ.get(FILL_ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in ((SGLANG_TARGET, sglang_extend_writes_zeros, HookType.AFTER),
                               (INT2_TARGET, int2_extend_writes_zeros, HookType.AROUND)):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, kind)


def write_fill_shim(path: str) -> str:
    """This file as ``path/oscar_bench_fill_shim.py`` and a dist-info that makes :func:`fill_register`
    a ``sglang.srt.plugins`` entry point of any process with ``path`` on its PYTHONPATH
    (``serving_launcher.write_plugin_folder``). Returns ``path``."""
    from sglang_oscar.serving_launcher import write_plugin_folder

    return write_plugin_folder(path, FILL_ENTRY, {FILL_MODULE: __file__}, {FILL_ENTRY: f"{FILL_MODULE}:fill_register"})
