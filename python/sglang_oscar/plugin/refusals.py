"""SGLang features the INT2 cache does not support (yet), and the launch-time check.

Each rule names the ``ServerArgs`` field, the flag a user typed, and what to do instead. The
check runs in an AFTER hook on ``ServerArgs.__post_init__`` (CLI, ``sglang serve`` and the
offline ``Engine`` all pass there), so an int2 launch stops before any weights load.
Source of the list: the SGLang 0.5.16 features that read or write KV rows outside the INT2 path
(speculative decoding, PD transfer, host caches, context/pipeline parallelism, other backends).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Refusal:
    field: str  # ServerArgs field
    flag: str  # what the user typed
    unsupported: Callable[[Any], bool]  # value -> refused?
    advice: str


def _truthy(value) -> bool:
    return bool(value)


def _not_triton(value) -> bool:
    return value is not None and value != "triton"


REFUSALS = (
    Refusal("speculative_algorithm", "--speculative-algorithm", _truthy,
            "speculative decoding writes and moves KV rows outside the INT2 write path; serve without it"),
    Refusal("disaggregation_mode", "--disaggregation-mode", lambda v: v not in (None, "null"),
            "PD disaggregation transfers BF16 KV layouts; serve prefill and decode together"),
    Refusal("enable_hierarchical_cache", "--enable-hierarchical-cache", _truthy,
            "the host KV cache assumes BF16 head layouts; drop the flag"),
    Refusal("hicache_storage_backend", "--hicache-storage-backend", _truthy, "drop the flag"),
    Refusal("enable_lmcache", "--enable-lmcache", _truthy, "LMCache copies BF16 KV rows; drop the flag"),
    Refusal("enable_flexkv", "--enable-flexkv", _truthy, "drop the flag"),
    Refusal("enable_hisparse", "--enable-hisparse", _truthy, "drop the flag"),
    Refusal("radix_cache_backend", "--radix-cache-backend", _truthy, "use the default radix cache"),
    Refusal("enable_unified_memory", "--enable-unified-memory", _truthy, "the unified pool bypasses the INT2 pool; drop the flag"),
    Refusal("enable_page_major_kv_layout", "--enable-page-major-kv-layout", _truthy, "drop the flag"),
    Refusal("prefill_only_disable_kv_cache", "--prefill-only-disable-kv-cache", _truthy, "there is no KV cache to quantize; use --kv-cache-dtype auto"),
    Refusal("enable_dp_attention", "--enable-dp-attention", _truthy, "use plain tensor parallelism (--tp-size)"),
    Refusal("enable_two_batch_overlap", "--enable-two-batch-overlap", _truthy, "drop the flag"),
    Refusal("enable_pdmux", "--enable-pdmux", _truthy, "drop the flag"),
    Refusal("dcp_size", "--dcp-size", lambda v: v not in (None, 1), "decode context parallelism uses masked BF16 writes; use --dcp-size 1"),
    Refusal("attn_cp_size", "--attn-cp-size", lambda v: v not in (None, 1),
            "context parallelism writes KV through SGLang's BF16 path; use --attn-cp-size 1"),
    Refusal("enable_prefill_cp", "--enable-prefill-cp", _truthy, "drop the flag"),
    Refusal("pp_size", "--pp-size", lambda v: v not in (None, 1), "use tensor parallelism (--tp-size) instead of pipeline parallelism"),
    Refusal("enable_deterministic_inference", "--enable-deterministic-inference", _truthy, "drop the flag"),
    Refusal("enable_torch_compile", "--enable-torch-compile", _truthy, "drop the flag"),
    Refusal("enable_mixed_chunk", "--enable-mixed-chunk", _truthy,
            "mixed batches run decode tokens through the extend path, which reads their recent window in INT2; drop the flag"),
    Refusal("dllm_algorithm", "--dllm-algorithm", _truthy,
            "diffusion LMs attend bidirectionally, the INT2 kernels are causal; serve them with --kv-cache-dtype auto"),
    Refusal("page_size", "--page-size", lambda v: v not in (None, 1), "the INT2 pool is token-granular; use --page-size 1"),
    Refusal("attention_backend", "--attention-backend", _not_triton, "use --attention-backend triton (or leave it unset)"),
    Refusal("prefill_attention_backend", "--prefill-attention-backend", _not_triton, "use triton (or leave it unset)"),
    Refusal("decode_attention_backend", "--decode-attention-backend", _not_triton, "use triton (or leave it unset)"),
)


def refusal_messages(server_args) -> list[str]:
    """Messages for every unsupported setting of an int2 launch (empty list if none).

    Args:
        server_args: a ``ServerArgs`` (or any object with its field names).
    """
    out = []
    for r in REFUSALS:
        value = getattr(server_args, r.field, None)
        if r.unsupported(value):
            out.append(f"--kv-cache-dtype int2 does not support {r.flag} {value!r}: {r.advice}")
    return out
