"""Which stage-1 engine a decode call runs (Triton or Gluon) and the Gluon launch's pipeline."""

from __future__ import annotations

import torch

from ..compile_check import active as compiling_offline
from ..layout import Int2Layout
from ..tuning import AttnTuning, _gluon_knobs
from .gluon_stage1 import gluon_decode_supported


#: register cap of the Gluon decode kernel unless the tuning names one (12 one-warp programs per SM)
GLUON_MAXNREG = 168
#: cp.async stages of the Gluon decode kernel unless the tuning names ``async_stages`` (the fastest of
#: 0 / 2 / 3 stages at most points timed; docs/kernels.md#gluon-pipeline)
GLUON_ASYNC_STAGES = 2


def gluon_pipeline(tuning: "AttnTuning") -> dict:
    """``{"async_stages": n, "slot_ring": bool}`` the Gluon decode launch takes for ``tuning``:
    ``async_stages`` or :data:`GLUON_ASYNC_STAGES`; the slot ring per ``async_slots``, on by
    default whenever the words go through the ``cp.async`` ring (:class:`AttnTuning` refuses
    ``async_slots=True`` with ``async_stages`` 0)."""
    stages = GLUON_ASYNC_STAGES if tuning.async_stages is None else tuning.async_stages
    slots = bool(stages) if tuning.async_slots is None else bool(tuning.async_slots)
    return {"async_stages": stages, "slot_ring": slots}


def decode_engine(tuning: "AttnTuning", layout: Int2Layout, q: torch.Tensor, mma_dtype: torch.dtype,
                  has_cap: bool, hp_dtype: torch.dtype | None = None, buffers: tuple = ()) -> str:
    """The stage-1 engine a decode call runs: the tuning's ``engine``; with ``None``, ``"triton"`` if
    the tuning names a Triton-only knob (:attr:`AttnTuning.TRITON_ONLY`), ``"gluon"`` if it names a
    Gluon-only one (:attr:`AttnTuning.GLUON_ONLY`, any value; ``ValueError`` if the call is outside
    the Gluon scope or the tuning names knobs of both), else ``"gluon"`` where
    :func:`.gluon_stage1.gluon_decode_supported` accepts the call (a CUDA sm_80+ device, not the
    interpreter, not an offline compile) and ``block_n`` is 16 / 32, else ``"triton"``.

    Args:
        tuning: the resolved :class:`AttnTuning`; layout, q, mma_dtype, has_cap, hp_dtype, buffers:
            as :func:`.gluon_stage1.gluon_decode_supported` takes them.

    Raises:
        ValueError: ``engine="gluon"`` or a Gluon-only knob named for a call the Gluon engine cannot
            run (the reason is in the message), or Gluon-only and Triton-only knobs named together.
    """
    gluon_named = sorted(k for k in AttnTuning.GLUON_ONLY if k in tuning.explicit)
    if tuning.engine == "triton" or (tuning.engine is None
                                     and any(k in tuning.explicit for k in AttnTuning.TRITON_ONLY)):
        if gluon_named:
            named = sorted(k for k in tuning.explicit if k in AttnTuning.TRITON_ONLY)
            raise ValueError(f"tuning {', '.join(gluon_named)} {_gluon_knobs(gluon_named)}, but the tuning also names "
                             f"Triton-only knob(s) {named}, which select the Triton engine; drop one or the other")
        return "triton"  # no scope check needed (hot path)
    why = gluon_decode_supported(layout, q, mma_dtype, has_cap, hp_dtype, buffers)
    if why is None and tuning.block_n not in (16, 32):
        why = f"block_n {tuning.block_n} (16 or 32; 64 spills registers)"
    if tuning.engine == "gluon":
        triton_named = sorted(k for k in tuning.explicit if k in AttnTuning.TRITON_ONLY)
        if triton_named:
            raise ValueError(f"tuning engine='gluon' with Triton-engine knob(s) {triton_named}, which the Gluon "
                             "engine does not have; drop them or use engine='triton'")
    if tuning.engine == "gluon" or (tuning.engine is None and gluon_named):
        if why is not None:
            if tuning.engine == "gluon":
                raise ValueError(f"tuning engine='gluon' cannot run this decode call: {why}; "
                                 "use engine='triton' (or leave engine unset), which covers every layout")
            knobs = ", ".join(f"{k}={getattr(tuning, k)}" for k in gluon_named)
            raise ValueError(f"tuning {knobs} selects the Gluon engine, which cannot run this decode call: {why}; "
                             f"drop {' and '.join(gluon_named)} (the Triton engine covers every layout)")
        return "gluon"
    # an offline compile (compile_check.compile_only, CPU tensors) names the engine it compiles;
    # left unset it compiles the Triton kernel, as before the Gluon engine existed
    return "gluon" if why is None and not compiling_offline() else "triton"
