"""Served-path tests: the INT2 pool and the OSCAR backend's forward paths on CPU.

Kernels run under the Triton interpreter (set here before any kernel module is imported when
there is no CUDA device).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def hooked():
    """The plugin registered and SGLang's hooks applied (every target patched); the plugin module."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    import sglang_oscar.plugin as plugin

    plugin.register()
    HookRegistry.apply_hooks()
    assert plugin.missing_hooks() == []
    return plugin
