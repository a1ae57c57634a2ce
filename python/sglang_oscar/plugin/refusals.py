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
    """One unsupported launch setting: the ``ServerArgs`` field, the flag as typed, the test of a value and
    what to do instead."""

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
    Refusal("kv_canary", "--kv-canary", lambda v: v not in (None, "none"),
            "SGLang's canary attaches to its own pool classes only (no attacher for the INT2 pools); drop the flag"),
    Refusal("quantization_param_path", "--quantization-param-path", _truthy,
            "the file holds FP8 KV-cache scales, which an INT2 cache does not read; drop the flag"),
    Refusal("use_ray", "--use-ray", _truthy,
            "the INT2 settings reach scheduler processes through the environment, which Ray actors do not inherit "
            "(they would serve plugin defaults); launch without --use-ray"),
    Refusal("page_size", "--page-size", lambda v: v not in (None, 1), "the INT2 pool is token-granular; use --page-size 1"),
    Refusal("attention_backend", "--attention-backend", _not_triton, "use --attention-backend triton (or leave it unset)"),
    Refusal("prefill_attention_backend", "--prefill-attention-backend", _not_triton, "use triton (or leave it unset)"),
    Refusal("decode_attention_backend", "--decode-attention-backend", _not_triton, "use triton (or leave it unset)"),
)


# DSA models (GLM-5, DeepSeek-V3.2): SGLang sets page size 64 and the "dsa" backend for them (its
# indexer kernels need both); the INT2 latent pool takes that page size and the OSCAR "dsa" backend.
DSA_REFUSALS = (
    Refusal("page_size", "--page-size", lambda v: v not in (None, 64),
            "a DSA model runs with SGLang's DSA page size 64; drop --page-size"),
    Refusal("attention_backend", "--attention-backend", lambda v: v not in (None, "dsa"),
            "a DSA model's indexer runs only under the dsa backend; pass --attention-backend dsa (int2 picks it "
            "itself only when --model-path is a local directory)"),
    Refusal("prefill_attention_backend", "--prefill-attention-backend", lambda v: v not in (None, "dsa"),
            "use dsa (or leave it unset)"),
    Refusal("decode_attention_backend", "--decode-attention-backend", lambda v: v not in (None, "dsa"),
            "use dsa (or leave it unset)"),
)


# SGLang's DSA kernel choices, which its __post_init__ resolves from the hardware: the int2 backend runs
# its own sparse kernels over the INT2 latent and needs SGLang's own pick for the indexer's metadata, so
# any value the launch gave (stashed under GIVEN_ATTR before that resolution) is refused.
DSA_KERNEL_FLAGS = (("dsa_prefill_backend", "--dsa-prefill-backend"), ("dsa_decode_backend", "--dsa-decode-backend"))
GIVEN_ATTR = "_oscar_given"


def is_dsa_model(server_args) -> bool:
    """Whether the launch's model uses DSA sparse attention: SGLang's test (``is_deepseek_dsa``, an
    architecture of its DSA list with ``index_topk`` set) on a local directory's ``config.json``, or
    on the config SGLang loaded (``server_args.model_config``, once its ``__post_init__`` built it:
    a Hub id); ``False`` when neither is known."""
    cfg = model_config_dict(server_args)
    if cfg is None:
        return False
    from sglang.srt.configs.model_config import is_deepseek_dsa

    return bool(is_deepseek_dsa(cfg))


def refusal_messages(server_args) -> list[str]:
    """Messages for every unsupported setting of an int2 launch (empty list if none).

    Args:
        server_args: a ``ServerArgs`` (or any object with its field names).
    """
    out = []
    dsa = is_dsa_model(server_args)
    by_field = {r.field: r for r in DSA_REFUSALS} if dsa else {}
    for r in REFUSALS:
        r = by_field.get(r.field, r)
        value = getattr(server_args, r.field, None)
        if r.unsupported(value):
            out.append(f"--kv-cache-dtype int2 does not support {r.flag} {value!r}: {r.advice}")
    given = getattr(server_args, GIVEN_ATTR, {}) if dsa else {}
    for field, flag in DSA_KERNEL_FLAGS:
        if given.get(field) is not None:
            out.append(f"--kv-cache-dtype int2 does not support {flag} {given[field]!r}: the INT2 latent's sparse "
                       "prefill and decode run in sglang-oscar's kernels (SGLang picks its DSA metadata path "
                       "itself); drop the flag")
    out.extend(model_refusal_messages(server_args))
    if prefill_graph_backend(server_args) == "full":
        # the whole extend forward in one graph: the INT2 windows' per-forward tables and the extend
        # plan are built in Python before each forward (init_forward_metadata), which a replay skips
        out.append("--kv-cache-dtype int2 does not support a full-graph prefill capture (CUDA-graph prefill backend "
                   "'full', from --cuda-graph-backend-prefill or --cuda-graph-config): the INT2 cache's per-forward "
                   "tables are built outside the graph; use the default breakable prefill graph or "
                   "--disable-prefill-cuda-graph")
    return out


def prefill_graph_backend(server_args) -> str | None:
    """The prefill CUDA-graph backend SGLang resolved in ``ServerArgs.__post_init__``
    (``cuda_graph_config.prefill.backend``: ``full``, ``breakable``, ``tc_piecewise`` or ``disabled``;
    ``srt/model_executor/cuda_graph_config.py``), or ``None`` before it resolved one."""
    prefill = getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None)
    return getattr(prefill, "backend", None)


# MiniMax M2.x / M3 checkpoints: their routed experts take ``intermediate_size`` (not
# ``moe_intermediate_size``) as the per-expert width (SGLang 0.5.16 ``srt/models/minimax_m2.py:519``,
# ``minimax_m3.py:318``), so SGLang's own launch check, which reads ``moe_intermediate_size``
# (``srt/model_executor/model_runner_components/moe_ep_setup.py:131-149``), does not see them.
_MINIMAX_MOE_ARCHS = ("MiniMaxM2ForCausalLM", "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")


def gemma4_text_message(config: dict) -> str | None:
    """Why SGLang 0.5.16 would build a text-only Gemma-4 checkpoint wrong, with the fix, or ``None``.

    SGLang remaps Gemma-4's head sizes (base keys = full layers, ``swa_*`` = sliding) for the
    multimodal ``gemma4`` config only (``srt/utils/hf_transformers/config.py:159-185``); a
    ``gemma4_text`` config (``Gemma4ForCausalLM``, what ``save_pretrained`` of a text-only fine-tune
    writes) keeps the sliding layers' ``head_dim`` / ``num_key_value_heads`` in its base keys, so
    its full layers would be built with them and fail to load ``q_proj`` after the weights started
    loading. A served config whose base keys already equal ``global_*`` (the remap passed through
    ``--json-model-override-args``) is fine.
    """
    if config.get("model_type") != "gemma4_text":
        return None
    g_dim, g_kv = config.get("global_head_dim"), config.get("num_global_key_value_heads")
    dim, kv = config.get("head_dim"), config.get("num_key_value_heads")
    if g_dim in (None, dim) and g_kv in (None, kv):
        return None
    import json

    remap = json.dumps(gemma4_head_remap(config), separators=(",", ":"))
    return ("--kv-cache-dtype int2 refuses this text-only Gemma-4 checkpoint as configured: its config "
            "(model_type gemma4_text) keeps the sliding layers' head_dim "
            f"{dim} / {kv} kv heads in its base keys, which SGLang 0.5.16 reads as the full layers' (it remaps "
            f"them from global_head_dim {g_dim} / num_global_key_value_heads {g_kv} for the multimodal gemma4 "
            "config only), so the full layers would be built wrong and fail to load; pass the remap (merged "
            f"into any --json-model-override-args already given): --json-model-override-args '{remap}'")


def gemma4_head_remap(text_config: dict) -> dict:
    """The head-size keys SGLang 0.5.16 rewrites in a multimodal Gemma-4 config
    (``srt/utils/hf_transformers/config.py:159-185``: base keys = full layers, ``swa_*`` = sliding), for
    a ``gemma4_text`` config (a dict of its keys) to pass as ``--json-model-override-args``."""
    dim, kv = text_config.get("head_dim"), text_config.get("num_key_value_heads")
    return {"head_dim": text_config.get("global_head_dim") or dim,
            "num_key_value_heads": text_config.get("num_global_key_value_heads") or kv,
            "swa_head_dim": dim, "swa_v_head_dim": dim, "swa_num_key_value_heads": kv}


def _local_config(model_path) -> dict | None:
    """``config.json`` of a local model directory as a dict, or ``None`` (a Hub id, unreadable)."""
    import json
    import os

    if not isinstance(model_path, (str, os.PathLike)):
        return None
    path = os.path.join(os.fspath(model_path), "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def loaded_model_config(server_args):
    """The ``ModelConfig`` SGLang built in ``ServerArgs.__post_init__`` (``get_model_config`` stores it
    as ``server_args.model_config``), or ``None`` before that (or for a stand-in without one)."""
    return getattr(server_args, "__dict__", {}).get("model_config")


def model_config_dict(server_args) -> dict | None:
    """The launch's model config as a dict: the one SGLang loaded (``server_args.model_config``, built
    by ``ServerArgs.__post_init__``'s ``get_model_config``, ``--json-model-override-args`` applied;
    ``PretrainedConfig.to_dict``), else a local directory's ``config.json`` (before ``__post_init__``),
    else ``None``."""
    hf = getattr(loaded_model_config(server_args), "hf_config", None)
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else None
    if isinstance(cfg, dict):
        return cfg
    return _local_config(getattr(server_args, "model_path", None))


def minimax_tp_message(config: dict, tp_size: int, ep_size: int = 1, moe_dp_size: int = 1) -> str | None:
    """Why a MiniMax M2.x / M3 block-FP8 checkpoint cannot run at this TP / EP split, or ``None``.

    Rule (from the shapes): each routed expert's gate/up projection has ``intermediate_size``
    outputs (1536 for MiniMax-M2 / M2.5 / M2.7), split over the MoE tensor-parallel ranks
    ``moe_tp = tp_size / ep_size / moe_dp_size`` (SGLang's split, ``moe_ep_setup.py:127``); with
    block-FP8 weights (``quantization_config.weight_block_size = [block_n, block_k]``, 128 x 128)
    every rank's slice must be whole blocks: ``(intermediate_size / moe_tp) % block_n == 0``, the
    check SGLang runs on the expert weights when the model is built
    (``srt/layers/quantization/fp8_utils.py:1974-2010`` ``validate_fp8_block_shape``), i.e. after the
    scheduler has started. For 1536: ``moe_tp`` 1, 2, 3, 4, 6 or 12; TP 8 without expert
    parallelism gives 192-wide slices and fails. Attention is not the constraint: its 48 query and
    8 kv heads x 128 split evenly over TP 8.

    Args:
        config: the HF ``config.json`` dict (multimodal configs through ``text_config``).
        tp_size, ep_size, moe_dp_size: the launch's ``--tp``, ``--ep`` and ``--moe-dp-size``.
    """
    if not set(config.get("architectures") or ()) & set(_MINIMAX_MOE_ARCHS):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    width = text.get("intermediate_size")
    if not block or not width:
        return None  # BF16 weights or no expert width: nothing to align
    block_n, width = int(block[0]), int(width)
    tp, ep, dp = int(tp_size or 1), int(ep_size or 1), int(moe_dp_size or 1)
    moe_tp = tp // ep // dp if ep * dp and tp % (ep * dp) == 0 else None
    if moe_tp and width % moe_tp == 0 and (width // moe_tp) % block_n == 0:
        return None
    def fits(t: int, e: int) -> bool:
        m = t // e // dp if t % (e * dp) == 0 else 0
        return bool(m) and width % m == 0 and (width // m) % block_n == 0 and _attention_splits(text, t)

    pure_tp = [t for t in range(1, 65) if fits(t, 1)]
    eps = [e for e in range(2, tp + 1) if fits(tp, e)]
    got = f"{width}/{moe_tp} = {width / moe_tp:g}" if moe_tp else f"--tp {tp} is not a multiple of --ep {ep} x --moe-dp-size {dp}"
    with_ep = f"; with --tp {tp} add --ep {' / '.join(map(str, eps))}" if eps else ""
    return (f"--tp {tp} does not fit this MiniMax checkpoint: each rank gets a slice of its block-FP8 experts "
            f"({width} wide, {block_n}x{block[1]} blocks) of intermediate_size / (tp / ep / moe_dp) = {got}, "
            f"which must be a multiple of {block_n}. Use --tp {' / '.join(map(str, pure_tp))} without expert "
            f"parallelism{with_ep} (expert parallelism keeps each expert whole)")


def _attention_splits(text: dict, tp: int) -> bool:
    """Whether SGLang can split this config's attention over ``tp`` ranks: query heads divide
    evenly, kv heads divide or replicate evenly (``srt/models/minimax_m2.py:728-741``)."""
    q = int(text.get("num_attention_heads") or 1)
    kv = int(text.get("num_key_value_heads") or q)
    return q % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)


def minimax_m3_messages(config: dict, environ=None, hip: bool | None = None) -> list[str]:
    """What an int2 launch of MiniMax-M3 cannot honour, each naming the fix (empty for other models).

    The INT2 path serves M3's sparse layers with SGLang's indexer and an INT2 block-sparse main
    attention (:mod:`sglang_oscar.backend.minimax_backend`); it cannot run:

    * ``SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE``: SGLang's dense-sparse decode reads BF16 main rows
      through trtllm (``srt/layers/attention/minimax_sparse_backend.py:368-402``); the int2 backend would
      silently ignore it;
    * ROCm: M3's fused norm + RoPE + cache kernel writes BF16 main rows straight into the cache
      (``srt/models/minimax_m3.py:939-992``);
    * a ``sparse_block_size`` outside 16..128 (powers of two): the INT2 kernel's
      (``kernels/sparse.py`` ``BLOCK_SIZES``).

    Args:
        config: the HF ``config.json`` dict; environ: the environment (default ``os.environ``);
        hip: running on ROCm (default ``torch.version.hip is not None``).
    """
    import os

    if not set(config.get("architectures") or ()) & set(_MINIMAX_MOE_ARCHS[1:]):
        return []
    environ = os.environ if environ is None else environ
    if hip is None:
        import torch

        hip = getattr(torch.version, "hip", None) is not None
    out = []
    env = "SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE"
    if str(environ.get(env, "")).strip().lower() in ("1", "true", "yes", "on"):
        out.append(f"--kv-cache-dtype int2 does not serve MiniMax-M3 with {env}=1 (its dense sparse decode reads BF16 "
                   f"main K/V rows; the INT2 sparse decode replaces it): unset {env}")
    if hip:
        out.append("--kv-cache-dtype int2 does not serve MiniMax-M3 on ROCm (its fused norm+RoPE+cache kernel writes "
                   "BF16 main K/V rows into the cache); serve it with --kv-cache-dtype auto")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    sparse = text.get("sparse_attention_config") or config.get("sparse_attention_config") or {}
    block = sparse.get("sparse_block_size") if isinstance(sparse, dict) else None
    from ..kernels.sparse import BLOCK_SIZES

    if block is not None and int(block) not in BLOCK_SIZES:
        out.append(f"--kv-cache-dtype int2 does not serve MiniMax-M3 with sparse_block_size {block} (the INT2 "
                   f"block-sparse attention takes {', '.join(map(str, BLOCK_SIZES[:-1]))} or {BLOCK_SIZES[-1]}); "
                   "serve it with --kv-cache-dtype auto")
    return out


def model_refusal_messages(server_args) -> list[str]:
    """Refusals that depend on the model's config (:func:`model_config_dict`: a local directory's, or
    the one SGLang loaded for a Hub id), checked before any weights load: what the INT2 path
    cannot honour for MiniMax-M3 (:func:`minimax_m3_messages`), MiniMax's block-FP8 TP split
    (:func:`minimax_tp_message`)."""
    cfg = model_config_dict(server_args)
    if cfg is None:
        return []
    out = minimax_m3_messages(cfg)
    gemma4 = gemma4_text_message(cfg)
    if gemma4:
        out.append(gemma4)
    if set(cfg.get("architectures") or ()) & set(_MINIMAX_MOE_ARCHS[1:]) and \
            prefill_graph_backend(server_args) == "breakable":
        # RadixAttention calls the backend of a layer with index queries directly inside a breakable
        # graph segment (srt/layers/radix_attention.py:171-175), not eagerly between segments
        out.append("--kv-cache-dtype int2 does not support MiniMax-M3 under the breakable prefill CUDA graph "
                   "(SGLang's default on CUDA): its sparse layers' attention is recorded inside a graph segment, so "
                   "replays would reuse the captured INT2 window tables; pass --disable-prefill-cuda-graph")
    msg = minimax_tp_message(cfg, getattr(server_args, "tp_size", 1) or 1, getattr(server_args, "ep_size", 1) or 1,
                             getattr(server_args, "moe_dp_size", 1) or 1)
    return out + ([msg] if msg else [])
