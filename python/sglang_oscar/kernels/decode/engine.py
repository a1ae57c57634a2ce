"""Which stage-1 engine a decode call runs: the config a plan is given, or the default one."""

from __future__ import annotations

from typing import Callable

import torch

from ..compile_check import active as compiling_offline
from ..configs import GluonConfig, TritonConfig, default_triton_config
from ..layout import Int2Layout


def decode_config(config, layout: Int2Layout, pairs: int, gluon_scope: Callable[[], str | None],
                  mma_dtype: torch.dtype = torch.float16):
    """The :class:`TritonConfig` or :class:`GluonConfig` a decode plan runs.

    Args:
        config: ``None`` (auto: :class:`GluonConfig` where ``gluon_scope()`` accepts the call and
            this is not an offline compile, else :func:`default_triton_config`), the type
            :class:`TritonConfig` or :class:`GluonConfig` (that engine's default config), or an
            instance (run as given).
        layout, pairs, mma_dtype: the plan's layout, requests x kv heads and MMA operand dtype (the
            Triton defaults depend on them).
        gluon_scope: returns ``None`` when the Gluon kernel can run the call, else the reason
            (:func:`.gluon_stage1.gluon_decode_supported`); called only when Gluon is asked or auto.

    Raises:
        ValueError: a Gluon config for a call outside the Gluon scope (the reason is in the
            message), or ``config`` of another type.
    """
    if isinstance(config, TritonConfig):
        return config
    if config is TritonConfig:
        return default_triton_config(layout, pairs=pairs, mma_dtype=mma_dtype)
    if config is None:
        # an offline compile (compile_check.compile_only, CPU tensors) compiles the Triton kernel
        # unless it names the Gluon one
        if not compiling_offline() and gluon_scope() is None:
            return GluonConfig()
        return default_triton_config(layout, pairs=pairs, mma_dtype=mma_dtype)
    if config is GluonConfig:
        config = GluonConfig()
    if not isinstance(config, GluonConfig):
        raise ValueError(f"config must be None, TritonConfig or GluonConfig (the type or an instance), "
                         f"got {config!r}")
    why = gluon_scope()
    if why is not None:
        raise ValueError(f"GluonConfig (the Gluon engine) cannot run this decode call: {why}; use TritonConfig "
                         "or config=None (auto), which cover every layout")
    return config
