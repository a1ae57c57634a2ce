"""Memory plan of the served INT2 cache: bytes per token, BF16 window budget, request bound.

SGLang sizes ``max_total_num_tokens = budget // cell_size``. With INT2 the cell size is the
packed bytes per token (:func:`int2_cell_size`); the BF16 windows are extra memory per running
request (a recent ring of ``recent`` rows) plus a shared sink arena
(``SINK_ROWS_PER_REQUEST`` x ``sink`` rows per request slot). :func:`plan_windows` bounds
``max_running_requests`` so the windows take at most ``WINDOW_BUDGET_SHARE`` of the KV budget,
and the rest of the budget goes to INT2 tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import OscarConfig, latent_group_size
from ..kernels.layout import Int2Layout
from ..quant.bits import bytes_per_token_per_head, mla_latent_bytes_per_token

# Sink-arena rows per request slot, in units of ``sink``: room for the running requests' sinks
# plus prefixes kept by the radix cache (each distinct cached sequence start holds ``sink`` rows).
SINK_ROWS_PER_REQUEST = 4
# Largest share of the KV budget the BF16 windows may take when bounding max_running_requests.
WINDOW_BUDGET_SHARE = 0.25
# max_running_requests when the user gives none (SGLang's own default is 2048+, far more than
# the windows of a long-context INT2 server can hold).
DEFAULT_MAX_RUNNING_REQUESTS = 256


def int2_cell_size(config: OscarConfig, num_kv_heads: int, head_dim: int, v_head_dim: int, num_layers: int) -> int:
    """INT2 bytes per token over ``num_layers`` layers and ``num_kv_heads`` local kv heads (K + V).

    Equals what :class:`~.int2_pool.OscarMHATokenToKVPool` allocates per slot. For D = G = 128
    with fp16 pairs: 36 + 36 = 72 bytes per kv head and layer (BF16: 512).

    Raises:
        ValueError: unsupported head_dim / group size combination.
    """
    Int2Layout.from_config(config, head_dim, v_head_dim)  # the kernels must support the geometry
    return num_layers * num_kv_heads * bytes_per_token_per_head(head_dim, v_head_dim, config.group_size,
                                                                config.scale_dtype)


def latent_layout(config: OscarConfig, kv_lora_rank: int) -> Int2Layout:
    """The INT2 layout of an MLA latent row: one "kv head" of width ``kv_lora_rank`` with K's clip
    ratio, groups of :func:`~sglang_oscar.config.latent_group_size` along the rank.

    Raises:
        ValueError: a group size that does not divide the rank, or a rank the kernels do not take.
    """
    return Int2Layout.create(kv_lora_rank, group_size=latent_group_size(config, kv_lora_rank),
                             k_clip_ratio=config.k_clip_ratio, quantizer=config.quantizer,
                             scale_dtype=config.scale_dtype, attention=False)


def latent_cell_size(config: OscarConfig, kv_lora_rank: int, rope_dim: int, num_layers: int,
                     hp_dtype: torch.dtype) -> int:
    """INT2 bytes per token of an MLA latent cache over ``num_layers`` layers: codes + (scale, zero)
    pairs of the ``kv_lora_rank``-wide latent (:func:`latent_layout`), plus ``k_pe`` (``rope_dim``
    elements in ``hp_dtype``): :func:`~sglang_oscar.quant.bits.mla_latent_bytes_per_token` per layer.

    Equals what :class:`~.latent_pool.OscarMLATokenToKVPool` allocates per slot: R = 512, P = 64,
    G = 128, fp16 pairs: 128 + 16 + 128 = 272 bytes per layer (BF16 MLA: 1,152).

    Raises:
        ValueError: ``group_size`` does not divide the rank.
    """
    layout = latent_layout(config, kv_lora_rank)  # the kernels must support the geometry
    return num_layers * mla_latent_bytes_per_token(kv_lora_rank, rope_dim, layout.k.group_size, config.scale_dtype,
                                                   str(hp_dtype).removeprefix("torch."))


def hp_row_bytes(num_kv_heads: int, head_dim: int, v_head_dim: int, num_layers: int, hp_dtype: torch.dtype) -> int:
    """Bytes of one BF16 window row (one token, all local layers and kv heads, K + V)."""
    return num_layers * num_kv_heads * (head_dim + v_head_dim) * torch.tensor([], dtype=hp_dtype).element_size()


def sink_rows_for(config: OscarConfig, max_reqs: int) -> int:
    """Rows of the sink arena for ``max_reqs`` request slots."""
    return config.sink_tokens * SINK_ROWS_PER_REQUEST * max_reqs


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """Outcome of :func:`plan_windows` (all sizes in bytes unless noted)."""

    max_running_requests: int
    window_bytes: int
    int2_budget: int
    per_request_bytes: int
    reduced_from: int | None  # the user's --max-running-requests when it had to shrink


def plan_windows(config: OscarConfig, available_bytes: int, row_bytes: int, requested: int | None) -> WindowPlan:
    """Split a KV budget between the BF16 windows and the INT2 tokens.

    Args:
        available_bytes: SGLang's KV budget (after weights and the static memory fraction).
        row_bytes: :func:`hp_row_bytes`.
        requested: the user's ``--max-running-requests`` (``None`` = default).

    Raises:
        ValueError: not even one request's windows fit; names the flags that fix it.
    """
    per_req = row_bytes * (config.recent_tokens + SINK_ROWS_PER_REQUEST * config.sink_tokens)
    want = requested if requested is not None else DEFAULT_MAX_RUNNING_REQUESTS
    if per_req == 0:
        return WindowPlan(want, 0, available_bytes, 0, None)
    cap = int(WINDOW_BUDGET_SHARE * available_bytes) // per_req
    if cap < 1:
        raise ValueError(
            f"--kv-cache-dtype int2: the BF16 windows of one request need {per_req / 2**20:.1f} MiB but the KV "
            f"budget is {available_bytes / 2**20:.1f} MiB; raise --mem-fraction-static or lower "
            f"--oscar-sink-tokens / --oscar-recent-tokens"
        )
    reqs = min(want, cap)
    # +1: SGLang's request slot 0 is reserved (ReqToTokenPool allocates size + 1 rows).
    window = per_req * (reqs + 1)
    return WindowPlan(reqs, window, available_bytes - window, per_req,
                      requested if requested is not None and reqs < requested else None)
