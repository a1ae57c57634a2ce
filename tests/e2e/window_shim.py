"""Check b's BF16 baseline of a sliding-window family reads the window the INT2 path reads.

A sliding layer's query at position ``p`` sees key ``j`` iff ``p - j < W`` (``W`` the HF config's
``sliding_window``; transformers, SGLang's extend kernels and the INT2 path all apply it). SGLang
0.5.16's Triton backend *decodes* over ``min(seq_len, sliding_window_size)`` keys, ``W - 1``
(``update_sliding_window_buffer``, ``triton_backend.py:2014``), one fewer. Check b compares
greedy tokens of ``int2`` with windows covering everything against BF16, so its BF16 server
``<family>-bf16-hf-window`` loads this harness-only plugin (entry point ``oscar_e2e_window``,
installed beside :mod:`.fp32_shim`'s; active only with :data:`WINDOW_ENV` set): an AFTER hook on
``TritonAttnBackend.__init__`` widens that backend's window to ``W`` keys. Its extend kernel masks
by the layer's own ``sliding_window_size`` on positions relative to the window start
(``extend_attention.py:387-393``), so the one extra prefix key is masked there; SGLang's sliding
pool frees only positions older than the ``W`` keys up to the query (``free_swa_out_of_window_slots``;
docs/design.md), which the INT2 decode reads too, so the widened decode never reads a freed slot. Check a keeps the
unpatched ``<family>-bf16``. The server also loads :mod:`.fp32_shim`'s entry point (same folder),
whose hooks change nothing for bf16 tensors.

:func:`.fp32_shim.write_fp32_shim` copies this file next to the plugin folder's dist-info as the
top-level module ``oscar_e2e_window_shim``; it imports nothing of the harness.
"""

from __future__ import annotations

import os

WINDOW_ENV = "OSCAR_E2E_HF_WINDOW"
WINDOW_SHIM_ENTRY = "oscar_e2e_window"
WINDOW_SHIM_MODULE = "oscar_e2e_window_shim"
WINDOW_SHIM_TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"


def _decode_reads_w_keys(result, self, *args, **kwargs):
    """AFTER hook of ``TritonAttnBackend.__init__``: SGLang's own backend class (not a subclass,
    such as the INT2 backend) with a sliding window reads ``W = sliding_window_size + 1`` keys."""
    if type(self).__name__ == "TritonAttnBackend" and (self.sliding_window_size or 0) > 0:
        self.sliding_window_size += 1
    return result


def hf_window_register() -> None:
    """SGLang plugin entry point ``oscar_e2e_window``: with ``OSCAR_E2E_HF_WINDOW=1`` in the
    server's environment, registers :func:`_decode_reads_w_keys`; otherwise does nothing."""
    if os.environ.get(WINDOW_ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is _decode_reads_w_keys for _, h, _ in HookRegistry._hooks.get(WINDOW_SHIM_TARGET, ())):
        HookRegistry.register(WINDOW_SHIM_TARGET, _decode_reads_w_keys, HookType.AFTER)
