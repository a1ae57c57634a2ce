"""The servers of the MLA device check (:mod:`.mla_check`): each server's flags, what it is compared
with, the items that need it, and each family's model builder, flags, environment and command line.
"""

from __future__ import annotations

import os
import sys

from sglang_oscar.serving_launcher import pythonpath_with

from .mla_models import GLM5_DENSE_TOPK, M3_DENSE, build_glm5, build_kimi_linear, build_minimax_m3, build_model

BASE_PORT = 31200
WINDOWS = ["--oscar-sink-tokens", "16", "--oscar-recent-tokens", "32"]
SERVERS = {
    "bf16": ["--kv-cache-dtype", "auto"],
    "int2-window": ["--kv-cache-dtype", "int2", "--oscar-sink-tokens", "2048", "--oscar-recent-tokens", "32"],
    "int2": ["--kv-cache-dtype", "int2", *WINDOWS],
    "int2-chunk64": ["--kv-cache-dtype", "int2", *WINDOWS, "--chunked-prefill-size", "64"],
}
REF = {"int2-window": "bf16", "int2": "bf16", "int2-chunk64": "int2"}  # what each int2 server is compared with
# Reported servers of one family (name: (flags, compared with)), run when --servers names them: the
# default servers are those of the judged items, five at most, which fit one 600 s device call. A
# chunked prefill with every key from
# the BF16 rows, against its one-prefill twin, separates SGLang's own chunk dependence (the DSA
# indexer's discrete FP8 keys and top-k over GEMMs of another row count; MiniMax-M3's indexer, whose
# index attention output feeds the layer) from the INT2 codes' (int2-chunk64 vs int2). Sparse
# MiniMax-M3 (its int2 chunking was exact) instead reports SGLang's BF16 server chunked against
# itself: how far a rounding-level change moves this model through its block selection, the floor
# of its window item.
_WINDOW_CHUNK = {"int2-window-chunk64": ([*SERVERS["int2-window"], "--chunked-prefill-size", "64"], "int2-window")}
_BF16_CHUNK = {"bf16-chunk64": ([*SERVERS["bf16"], "--chunked-prefill-size", "64"], "bf16")}
_REPORTED = {"glm5": _WINDOW_CHUNK, "glm5_dense": _WINDOW_CHUNK, "minimax_m3": _BF16_CHUNK,
             "minimax_m3_dense": _WINDOW_CHUNK}
FAMILY_SERVERS = {f: {n: flags for n, (flags, _) in r.items()} for f, r in _REPORTED.items()}
FAMILY_REF = {f: {n: ref for n, (_, ref) in r.items()} for f, r in _REPORTED.items()}
# Opt-in servers of every family, run when --servers names them (the defaults fill one call): SGLang with
# the plugin disabled (entry-point whitelist without ours, as the main harness's check a) against the BF16
# server with it loaded; the int2 server without CUDA graphs against int2 (the main harness's check d);
# int2 at TP 2 (two GPUs) against int2 at TP 1 (the main harness's check h)
OPT_IN = {"plugin-off": (SERVERS["bf16"], "bf16"),
          "int2-eager": ([*SERVERS["int2"], "--disable-cuda-graph"], "int2"),
          "int2-tp2": ([*SERVERS["int2"], "--tp-size", "2"], "int2")}
OPT_IN_ITEMS = ("plugin", "graph", "tp")
# int2-window under the default Hadamard rotation, its BF16 rows rotated (judged as "rotated" where the
# family lists it, else run only when --servers names it, and reported); outside the serves item
HADAMARD = "int2-window-hadamard"
HADAMARD_REF = {HADAMARD: "bf16"}
# flags of a family's int2 servers only (the BF16 server refuses OSCAR flags without --kv-cache-dtype int2):
# expanded-MHA storage needs groups that divide both K 192 and V 128
EXPANDED_GROUP = 64
FAMILY_INT2_FLAGS = {"deepseek_v3_expanded": ["--oscar-mla-storage", "expanded",
                                              "--kv-cache-quant-group-size", str(EXPANDED_GROUP)]}
# flags of a family's servers without int2: SGLang's BF16 DSA decode defaults to FA3 on Hopper, which
# the device bundle drops (1.1 GB), while its FlashMLA sparse kernel (prefill's default) is bundled.
# Only at top-k 2048: SGLang's unfused top-k transform asserts that width (glm5's 256 has no BF16 path)
FAMILY_BF16_FLAGS = {"glm5_dense": ["--dsa-decode-backend", "flashmla_sparse"]}
# the servers an item needs (serves: any of the judged items'); it is judged when they all ran
NEEDS = {"window": {"int2-window", "bf16"}, "rotated": {HADAMARD, "bf16"}, "chunked": {"int2-chunk64", "int2"},
         "radix": {"int2"}, "load": {"int2"}, "oracle": {"int2"}, "plugin": {"plugin-off", "bf16"},
         "graph": {"int2-eager", "int2"}, "tp": {"int2-tp2", "int2"}, "oracle-fp32": {"int2-fp32"}}
# Opt-in --dtype float32 twins (name: (flags, compared with)) of the oracle families, run when
# --servers names them: int2-fp32 judged against the fp32 oracle as "oracle-fp32" (the BF16 server's own
# rounding, carried through the INT2 codes, moves the BF16 oracle item by about the oracle's own
# fp32-vs-BF16 move), bf16-fp32 SGLang's unquantized fp32 path against the fp32 model (the noise
# floor). GLM-5's DSA indexer keeps FP8 keys whatever --dtype says, so only the DeepSeek-V3 families.
FP32_TWINS = {"int2-fp32": ([*SERVERS["int2"], "--dtype", "float32"], "int2"),
              "bf16-fp32": ([*SERVERS["bf16"], "--dtype", "float32"], "bf16")}
FP32_FAMILIES = ("deepseek_v3", "deepseek_v3_expanded")
RADIX_SERVERS = ("int2", "bf16")  # the servers that repeat every prompt (bf16's repeats: reported)
STRICT_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
              "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1"}


FAMILIES = {  # --family: (model builder, extra server flags, judged items)
    "deepseek_v3": (build_model, [], ("serves", "window", "chunked", "radix", "load", "oracle")),
    # the same model with K [k_nope | k_pe] 192 / V 128 per head in the INT2 MHA pool
    "deepseek_v3_expanded": (build_model, [], ("serves", "window", "chunked", "radix", "load", "oracle")),
    # GLM-5 runs under SGLang's "dsa" backend (page size 64, set by SGLang); the oracle is dense (no top-k)
    "glm5": (build_glm5, ["--attention-backend", "dsa", "--dsa-topk-backend", "torch"],
             ("serves", "window", "rotated", "chunked", "radix", "load")),
    # the same model with top-k 2048 (> every prompt): chunking and radix reuse judged where the
    # selection is every position, so only the INT2 latent path can move them
    "glm5_dense": (lambda path: build_glm5(path, GLM5_DENSE_TOPK), ["--attention-backend", "dsa",
                                                                     "--dsa-topk-backend", "torch"],
                   ("serves", "window", "rotated", "chunked", "radix", "load", "oracle")),
    "kimi_linear": (build_kimi_linear, ["--load-format", "dummy", "--max-mamba-cache-size", "32"],
                    ("serves", "window", "rotated", "chunked", "radix", "load")),
    "minimax_m3": (build_minimax_m3, ["--load-format", "dummy"],
                   ("serves", "window", "rotated", "chunked", "radix", "load")),
    "minimax_m3_dense": (lambda path: build_minimax_m3(path, M3_DENSE), ["--load-format", "dummy"],
                         ("serves", "window", "rotated", "chunked", "radix", "load")),
}
# what an int2 server's log says when it built the family's INT2 pool, and its bytes/token line
# (INT2, BF16); MiniMax-M3's total counts its BF16 index keys in both
POOL_LOG = {"minimax_m3": r"MiniMax-M3 pool: INT2 main K/V", "deepseek_v3_expanded": r"INT2 MLA expanded pool"}
CAPACITY_LOG = {"minimax_m3": r"MiniMax-M3 main K/V .*total (\d+) bytes/token \(BF16: (\d+)",
                "deepseek_v3_expanded": r"MLA expanded \(.*\): (\d+) bytes/token \(BF16: (\d+)"}
DEFAULT_POOL_LOG, DEFAULT_CAPACITY_LOG = r"INT2 MLA latent pool", r"MLA latent \(.*\): (\d+) bytes/token \(BF16: (\d+)"


def server_env(family: str, work: str) -> dict[str, str]:
    """Environment of a family's servers: for a dummy-weight family the harness shims' folder first on
    PYTHONPATH and :data:`.dummy_shim.DUMMY_ENV` (scaled dummy weights); for glm5 SGLang's unfused DSA
    top-k (its torch top-k backend needs ``SGLANG_DSA_FUSE_TOPK=0``; the int2 servers use the unfused
    path anyway); else nothing extra."""
    if family.startswith("glm5"):
        return {"SGLANG_DSA_FUSE_TOPK": "0"}
    if "--load-format" not in FAMILIES[family][1]:
        return {}
    from .dummy_shim import DUMMY_ENV

    return {"PYTHONPATH": _with_shims(work, os.environ.get("PYTHONPATH", "")), DUMMY_ENV: "1"}


def _with_shims(work: str, pythonpath: str) -> str:
    """``pythonpath`` with the harness shims' folder (written under ``work``) first, once."""
    from .fp32_shim import write_fp32_shim

    return pythonpath_with(write_fp32_shim(os.path.join(work, "shims")), pythonpath)


def batch_invariant_env(work: str, env: dict[str, str]) -> dict[str, str]:
    """Environment that makes an int2 server run SGLang's batch-invariant GEMMs: the harness shims'
    folder on its PYTHONPATH (``env``'s kept) and :data:`.fp32_shim.BATCH_INVARIANT_ENV`. The
    counterpart of the MHA families' fp32 twins for models SGLang cannot serve in fp32 (GLM-5's DSA
    indexer keeps FP8 keys): a chunk's GEMMs round as the whole prompt's do, so only the INT2 path
    can make chunked prefill or a radix hit differ."""
    from .fp32_shim import BATCH_INVARIANT_ENV

    return {"PYTHONPATH": _with_shims(work, env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))),
            BATCH_INVARIANT_ENV: "1"}


def fp32_env(work: str, env: dict[str, str]) -> dict[str, str]:
    """Environment of an fp32 twin: :func:`.fp32_shim.fp32_server_env` (IEEE ``tl.dot`` on fp32, which
    SGLang's Triton attention would otherwise run in TF32; RoPE tables as the oracle's; the shim that
    routes fp32 RMSNorm / SiluAndMul / RoPE to their PyTorch paths) with the harness shims' folder
    first on ``env``'s PYTHONPATH."""
    from .fp32_shim import fp32_server_env

    return {**fp32_server_env(work),
            "PYTHONPATH": _with_shims(work, env.get("PYTHONPATH", os.environ.get("PYTHONPATH", "")))}


def server_argv(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--skip-tokenizer-init", "--mem-fraction-static", "0.15", "--cuda-graph-max-bs", "4",
            "--disable-prefill-cuda-graph", "--max-running-requests", "8", *extra]
