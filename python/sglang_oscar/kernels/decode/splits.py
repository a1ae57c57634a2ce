"""How a decode step is cut into programs: INT2 / HP split counts and the split floor."""

from __future__ import annotations

import math

import torch

from ..attention import plan_head_blocks
from .gluon_operands import head_blocks as gluon_head_blocks


_SM_COUNT: dict = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


#: programs per step (requests x head programs) for which the Gluon engine offers one resident wave
#: (:func:`choose_num_splits`)
ONE_WAVE_PROGRAMS = (256, 512)


def default_min_split_keys(engine: str, programs: int) -> int:
    """Default ``min_split_keys`` (of a config): the positions an INT2 split covers at least.

    Gluon: 128 up to 16 programs per step (batch 1-2 of an 8-kv-head model), 256 above: short
    steps then run fewer, longer splits instead of many nearly empty ones, while long steps are
    unaffected (docs/kernels.md#split-policy). Triton: 0 (not timed; every split gets an equal share).
    """
    if engine != "gluon":
        return 0
    return 128 if programs <= 16 else 256


def _head_programs(config, num_q_heads: int, num_kv_heads: int, blocks_per_kv: int | None = None) -> int:
    """Stage-1 programs per request and split: kv heads x head blocks as the config's engine forms them
    (Triton: :func:`plan_head_blocks` of ``config``, or ``blocks_per_kv`` when the caller has it;
    Gluon: blocks of 8 q heads)."""
    if config.engine == "gluon":
        return num_kv_heads * gluon_head_blocks(num_q_heads // num_kv_heads)
    return num_kv_heads * (blocks_per_kv or plan_head_blocks(num_q_heads, num_kv_heads, config.min_block_h,
                                                             config.max_block_h)[2])


def _split_keys(config, programs: int) -> int:
    """``config.min_split_keys``, or :func:`default_min_split_keys` for ``programs`` per step."""
    if config.min_split_keys is None:
        return default_min_split_keys(config.engine, programs)
    return config.min_split_keys


def choose_num_splits(batch: int, head_programs: int, *, device=None, max_seq_len: int | None = None,
                      block_n: int = 64, waves: float | None = None, max_splits: int = 256,
                      min_split_tokens: int = 64, engine: str = "triton") -> int:
    """INT2 splits per (request, head block): ``ceil(waves x SMs / (batch x head_programs))``.

    ``waves`` (programs per SM the grid offers) defaults, when ``batch x head_programs <= 16``
    (batch 1-2 of an 8-kv-head model), to 8 for the Triton engine (one wave of ~1,000 programs; more
    splits measured slower) and, for the Gluon engine (168-register programs, 12 per SM), to 11 up
    to 8 programs and 12 up to 16; from :data:`ONE_WAVE_PROGRAMS` (256-511 programs: batch 32 of an
    8-kv-head model) the Gluon engine takes 11 (one resident wave: 6 splits); otherwise 32 (several
    full waves). Each choice was the fastest or within noise of it where measured
    (docs/kernels.md#split-policy). With ``max_seq_len`` (a *static* bound such as the server's
    context length) a split keeps at least ``min_split_tokens`` keys. Depends only on host
    constants, never on per-step lengths, so a CUDA graph captured for a batch size stays valid.

    Args:
        batch: requests in the step; head_programs: programs per request (kv heads x head blocks
            of the engine: :func:`plan_head_blocks` for Triton, blocks of 8 q heads for Gluon).
        device: where the kernel runs (its SM count; 4 for CPU / the interpreter).
        max_seq_len, block_n, waves, max_splits, min_split_tokens: see above.
        engine: ``"triton"`` or ``"gluon"`` (the config's ``engine``), for the default ``waves``.

    Returns:
        The number of INT2 splits, in ``[1, max_splits]``.
    """
    sms = _sm_count(torch.device(device) if device is not None else torch.device("cpu"))
    programs = max(1, batch * head_programs)
    if waves is None:
        if engine != "gluon":
            waves = 8.0 if programs <= 16 else 32.0
        elif programs <= 8:
            waves = 11.0
        elif programs <= 16:
            waves = 12.0
        elif ONE_WAVE_PROGRAMS[0] <= programs < ONE_WAVE_PROGRAMS[1]:
            waves = 11.0
        else:
            waves = 32.0
    ns = math.ceil(waves * sms / programs)
    if max_seq_len is not None:
        ns = min(ns, max(1, math.ceil(max_seq_len / max(min_split_tokens, block_n))))
    return int(max(1, min(max_splits, ns)))


def default_num_kv_splits(config, bsz: int, num_q_heads: int, num_kv_heads: int, *, device=None,
                          max_seq_len: int | None = None, blocks_per_kv: int | None = None,
                          sliding_window: int | None = None) -> int:
    """The INT2 split count a :class:`.plan.DecodePlan` uses when ``num_kv_splits`` is ``None``:
    :func:`choose_num_splits` over ``kv heads x head blocks`` programs per request, head blocks as
    ``config``'s engine forms them (a :class:`~..configs.TritonConfig`: :func:`plan_head_blocks`; a
    :class:`~..configs.GluonConfig`: blocks of 8 q heads). ``blocks_per_kv``: the Triton plan's
    blocks when the caller has them. Callers sizing a workspace ahead of the call (benchmarks,
    CUDA-graph buffers) use this to match the plan's own choice (``plan.config`` is the config).
    ``sliding_window``: a sliding layer's INT2 keys lie inside its window, so the window bounds the
    keys as ``max_seq_len`` does (splits sized for the context would be empty programs plus merge
    work), and :func:`sliding_split_caps` may cap the count."""
    programs = _head_programs(config, num_q_heads, num_kv_heads, blocks_per_kv)
    if sliding_window:
        max_seq_len = min(max_seq_len or sliding_window, sliding_window)
    # with a static bound, no more splits than the split floor can ever fill
    ns = choose_num_splits(bsz, programs, device=device, max_seq_len=max_seq_len, block_n=config.block_n,
                           engine=config.engine, min_split_tokens=max(64, _split_keys(config, bsz * programs)))
    caps = sliding_split_caps(bsz * programs, sliding_window or 0)
    return min(ns, caps[1]) if caps else ns


#: HP positions per default HP split (:func:`decode_num_hp_splits`)
HP_SPLIT_POSITIONS = 48

#: (HP, INT2) split caps of a sliding layer's plan above 16 head programs per step
#: (:func:`sliding_split_caps`)
SLIDING_WIDE_SPLITS = (2, 8)


#: widest sliding window the caps apply to (the one measured: Gemma-3/4's 1,024)
SLIDING_CAP_MAX_WINDOW = 1024


def sliding_split_caps(programs: int, window: int) -> tuple[int, int] | None:
    """Caps on a sliding layer's (HP, INT2) default split counts, or ``None`` (no cap).

    A window of at most :data:`SLIDING_CAP_MAX_WINDOW` keys (Gemma-4: 1,024, of which 576 BF16)
    leaves each default split program a single block; above 16 head programs per step (``batch x
    head programs``: batch >= 3 of an 8-kv-head model) the default 8 HP + 16 INT2 splits make
    thousands of such programs, each a chain of dependent loads, and fewer, longer ones are faster:
    Gemma-4's sliding layer at batch 16, 32K (docs/benchmarks.md#hybrid-sliding-window-layers-gemma-4-shapes):
    2 + 8 splits 77.3 us against 86.7 us. Up to 16 programs the defaults stay (batch 1: 33.5 us
    against 36.7 us capped); wider windows keep them (not measured)."""
    return SLIDING_WIDE_SPLITS if programs > 16 and 0 < window <= SLIDING_CAP_MAX_WINDOW else None


def decode_num_hp_splits(sink: int, recent: int, *, programs: int = 0, sliding_window: int | None = None) -> int:
    """Default HP splits: one per :data:`HP_SPLIT_POSITIONS` (48) HP positions, 1..8 (a BF16 position
    costs several INT2 ones, so HP splits are kept short to not be the long pole at short contexts:
    7 splits for the default 64 + 256; the Gluon engine's HP loop is also slower per key than its
    INT2 loop). ``programs`` (head programs per step) and ``sliding_window``: a sliding layer's count
    is capped by :func:`sliding_split_caps`."""
    ns = int(max(1, min(8, math.ceil((sink + recent) / HP_SPLIT_POSITIONS))))
    caps = sliding_split_caps(programs, sliding_window or 0)
    return min(ns, caps[0]) if caps else ns
