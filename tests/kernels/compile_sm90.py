"""Compile every kernel variant for sm_90 without a GPU (``python tests/kernels/compile_sm90.py``).

Runs the wrappers inside ``kernels.compile_check.compile_only`` with CPU tensors: the GPU
launch parameters (block sizes, warps, stages, the inline-PTX code conversion) are compiled by
Triton down to a cubin with the wheel's ptxas. Prints one line per compiled kernel; exits
non-zero on the first failure, or when a kernel needs more shared memory than an sm_90 SM gives one
program (227 KB: the launch would fail with OutOfResources). Must run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # kv_fixtures
sys.path.insert(0, os.path.dirname(HERE))  # _support (tests/)

import torch  # noqa: E402
from _support.orthogonal import random_orthogonal  # noqa: E402
from kv_fixtures import build_latent_pool, build_pool, make_config  # noqa: E402
from sglang_oscar.kernels import (  # noqa: E402
    GluonConfig,
    Int2Layout,
    TritonConfig,
    decode_attention,
    default_triton_config,
    extend_attention,
    write_kv,
)
from sglang_oscar.kernels.codes import CONVERT_ASM, CONVERT_ASM_PERM, CONVERT_BITS  # noqa: E402
from sglang_oscar.kernels.compile_check import COMPILED, compile_only  # noqa: E402
from sglang_oscar.kernels.latent import gather_latent  # noqa: E402
from sglang_oscar.kernels.latent_extend import latent_extend_attention  # noqa: E402
from sglang_oscar.kernels.latent_plan import latent_decode_attention, latent_decode_tiles  # noqa: E402
from sglang_oscar.kernels.rotate import rotate_heads  # noqa: E402
from sglang_oscar.kernels.sparse import block_sparse_attention  # noqa: E402


def _write(dk, dv, group, quantizer, sdt, hp_dtype=torch.bfloat16, **kw):
    lay = Int2Layout.create(dk, dv, group_size=group, k_clip_ratio=0.96, v_clip_ratio=0.92, quantizer=quantizer,
                            scale_dtype=sdt)
    n, h = 8, 4
    k = torch.randn(n, h, dk).to(hp_dtype)
    v = torch.randn(n, h, dv).to(hp_dtype)
    buf = lay.allocate(16, h, "cpu")
    hp_k = torch.zeros(8, h, dk, dtype=hp_dtype)
    hp_v = torch.zeros(8, h, dv, dtype=hp_dtype)
    write_kv(k, v, torch.arange(n), buf["k_codes"], buf["k_pairs"], buf["v_codes"], buf["v_pairs"], lay,
             hp_rows=torch.arange(n), hp_k=hp_k, hp_v=hp_v, **kw)
    return lay, buf, hp_k, hp_v


def _attn(kind, dk=128, dv=128, hq=32, hkv=8, group=None, quantizer="uniform", sdt="float16",
          hp_dtype=torch.bfloat16, mma=torch.float16, **kw):
    cfg = make_config(group_size=group, quantizer=quantizer, scale_dtype=sdt, sink=4, recent=8)
    pool = build_pool([20, 30], hkv, dk, dv, cfg, hp_dtype=hp_dtype, window_mode="decode" if kind == "d" else "extend")
    common = (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v, pool.hp_index,
              pool.req_to_token, pool.req_pool_indices)
    if kind == "d":
        q = torch.randn(2, hq, dk, dtype=torch.bfloat16)
        decode_attention(q, *common, pool.seq_lens, pool.layout, sink=4, recent=8, num_kv_splits=8, mma_dtype=mma,
                         **kw)
    else:
        q = torch.randn(50, hq, dk, dtype=torch.bfloat16)
        extend_attention(q, *common, torch.tensor([0, 20]), torch.tensor([0, 0]), torch.tensor([20, 30]),
                         pool.layout, sink=4, max_extend_len=30, mma_dtype=mma, **kw)


def _rotate(t, h, hr, d, out_dtype, **kw):
    x = torch.randn(t, h, d).to(torch.bfloat16)
    r = random_orthogonal(d, hr)
    rotate_heads(x, r, out_dtype, **kw)


def _latent(h, r, p, group, hp_dtype=torch.bfloat16, **kw):
    from sglang_oscar.config import OscarConfig

    cfg = OscarConfig(group_size=group, sink_tokens=4, recent_tokens=8)
    _, pool = build_latent_pool([20, 30], r, p, cfg, random_orthogonal(r), hp_dtype)
    latent_decode_attention(torch.randn(2, h, r), torch.randn(2, h, p), **pool, group_size=group, quantizer="uniform",
                            sink=4, recent=8, sm_scale=0.1, num_splits=8, **kw)
    gather_latent(pool["codes"], pool["pairs"], pool["k_pe"], pool["req_to_token"][1, :20], group_size=group,
                  quantizer="uniform")


def _latent_extend(h, block_t, block_h, **kw):
    from sglang_oscar.config import OscarConfig

    cfg = OscarConfig(group_size=128, sink_tokens=4, recent_tokens=8)
    _, pool = build_latent_pool([20, 30], 512, 64, cfg, random_orthogonal(512), torch.bfloat16)
    planes = {k: pool[k] for k in ("codes", "pairs", "k_pe", "hp_latent", "hp_pe", "hp_index", "req_to_token",
                                   "req_pool_indices")}
    latent_extend_attention(torch.randn(50, h, 512), torch.randn(50, h, 64), **planes,
                            qo_indptr=torch.tensor([0, 20, 50], dtype=torch.int32),
                            prefix_lens=torch.zeros(2, dtype=torch.int32), group_size=128, quantizer="uniform", sink=4,
                            sm_scale=0.1, max_extend_len=30, block_t=block_t, block_h=block_h, **kw)


def _block_sparse(dk, hq, hkv, block, hp_dtype=torch.bfloat16, num_splits=None):
    """MiniMax-M3 block-sparse attention over 2 blocks per kv head (one of them -1 padding)."""
    cfg = make_config(sink=4, recent=8)
    pool = build_pool([20, 30], hkv, dk, dk, cfg, hp_dtype=hp_dtype)
    blocks = torch.tensor([[[0, -1], [0, -1]]] * hkv, dtype=torch.int32)
    block_sparse_attention(torch.randn(2, hq, dk), pool.layout, (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs,
                           pool.hp_k, pool.hp_v), pool.hp_index, pool.req_to_token, pool.req_pool_indices,
                           pool.seq_lens, blocks, block_size=block, sink=4, recent=8, sm_scale=0.1, num_splits=num_splits)


CASES = [
    ("rotate q d128 gqa4 (16-row programs)", lambda: _rotate(32, 32, 8, 128, torch.float32)),
    ("rotate k d128 centred (64-row programs)", lambda: _rotate(4096, 8, 8, 128, torch.bfloat16,
                                                                sub_mean=torch.zeros(8, 128))),
    ("rotate o d512 transpose + mean", lambda: _rotate(4, 8, 2, 512, torch.bfloat16, transpose=True,
                                                       add_mean=torch.zeros(2, 512))),
    ("rotate d192 fp16", lambda: _rotate(8, 4, 4, 192, torch.float16)),
    ("write d128 uniform", lambda: _write(128, 128, None, "uniform", "float16")),
    ("write d128 one row per program", lambda: _write(128, 128, None, "uniform", "float16", rows_per_program=1)),
    ("write d192/128 lloyd grouped", lambda: _write(192, 128, 64, "lloyd-max", "bfloat16")),
    ("write d512 g128 fp32-scales", lambda: _write(512, 512, 128, "uniform", "float32")),
    ("decode bits", lambda: _attn("d", config=TritonConfig(convert=CONVERT_BITS))),
    ("decode asm", lambda: _attn("d", config=TritonConfig(convert=CONVERT_ASM))),
    ("decode asm-perm", lambda: _attn("d", config=TritonConfig(convert=CONVERT_ASM_PERM, pairs_ahead=False,
                                                               defer_sums=False))),
    ("decode asm-perm pairs ahead", lambda: _attn("d", config=TritonConfig(convert=CONVERT_ASM_PERM))),
    ("decode subnormal operands (default)", lambda: _attn("d", config=TritonConfig())),
    ("decode subnormal, sums per block", lambda: _attn("d", config=TritonConfig(defer_sums=False))),
    ("decode subnormal, one stage (batch x kv heads >= 256)", lambda: _attn(
        "d", config=TritonConfig(num_stages=1, defer_sums=False))),
    ("decode subnormal, pairs in the loop", lambda: _attn("d", config=TritonConfig(pairs_ahead=False,
                                                                                    defer_sums=False))),
    ("decode gluon engine", lambda: _attn("d", config=GluonConfig())),
    ("decode gluon engine, block_n 16, window, gqa16", lambda: _attn("d", hq=32, hkv=2, sliding_window=64,
                                                                     config=GluonConfig(block_n=16))),
    ("decode subnormal lloyd", lambda: _attn("d", quantizer="lloyd-max", config=TritonConfig())),
    ("decode asm-perm head-major lloyd g64", lambda: _attn("d", group=64, quantizer="lloyd-max",
                                                           config=TritonConfig(convert=CONVERT_ASM_PERM, num_warps=4))),
    ("decode asm lloyd g64 (fast grouped)", lambda: _attn("d", group=64, quantizer="lloyd-max",
                                                          config=TritonConfig(convert=CONVERT_ASM))),
    ("decode general g32 fp32-scales", lambda: _attn("d", group=32, sdt="float32")),
    ("decode 192/128 window cap", lambda: _attn("d", dk=192, dv=128, hq=8, hkv=8, sliding_window=16, logit_cap=30.0)),
    ("decode d64 gqa6 min_block_h 4", lambda: _attn("d", dk=64, dv=64, hq=12, hkv=2, config=dataclasses.replace(
        default_triton_config(Int2Layout.create(64, 64)), min_block_h=4))),
    ("decode d256 bf16 mma", lambda: _attn("d", dk=256, dv=256, hq=16, hkv=2, mma=torch.bfloat16)),
    ("decode d512", lambda: _attn("d", dk=512, dv=512, hq=4, hkv=1)),
    ("decode d64 fp32 ieee", lambda: _attn("d", dk=64, dv=64, hq=4, hkv=1, hp_dtype=torch.float32,
                                           mma=torch.float32)),
    ("decode d512 fp32 ieee (default: one stage)", lambda: _attn("d", dk=512, dv=512, hq=4, hkv=1,
                                                                 hp_dtype=torch.float32, mma=torch.float32)),
    ("decode d128 sinks window", lambda: _attn("d", sliding_window=16, sinks=torch.zeros(32))),
    ("latent decode + gather R512 P64 g128 h16 (DeepSeek-V3 TP 8)", lambda: _latent(16, 512, 64, 128)),
    ("latent decode bf16 block_n 32 R512 h128 (dequant engine)", lambda: _latent(128, 512, 64, 128, precision="bf16",
                                                                         block_n=32)),
    ("latent decode codes engine bf16 block_n 32", lambda: _latent(16, 512, 64, 128, precision="bf16", block_n=32,
                                                                   engine="codes")),
    ("latent decode bf16 block_h 32, 8 warps (128 heads)", lambda: _latent(128, 512, 64, 128, precision="bf16",
                                                                           block_h=32, num_warps=8)),
    ("latent decode codes engine bf16 64 x 32, 8 warps (served from 32 heads)",
     lambda: _latent(128, 512, 64, 128, precision="bf16", engine="codes", **latent_decode_tiles(128, "codes"))),
    ("latent decode tf32 R512 g64 (two pairs per quarter)", lambda: _latent(16, 512, 64, 64, precision="tf32")),
    ("latent extend bf16 R512, 1 token x 16 heads", lambda: _latent_extend(16, 1, 16, precision="bf16")),
    ("latent extend bf16 R512, 4 tokens x 16 heads, 8 warps", lambda: _latent_extend(128, 4, 16, precision="bf16",
                                                                                     num_warps=8)),
    ("latent decode over a DSA top-k, bf16 block_n 32", lambda: _latent(16, 512, 64, 128, precision="bf16", block_n=32,
                                                                        topk=torch.full((2, 2048), -1, dtype=torch.int32))),
    ("block-sparse d128 gqa8 B128 (MiniMax-M3), 2 splits + merge", lambda: _block_sparse(128, 8, 1, 128, num_splits=2)),
    ("block-sparse d64 gqa2 B16 fp32 ieee, one split", lambda: _block_sparse(64, 4, 2, 16, torch.float32, 1)),
    ("extend d128", lambda: _attn("e")),
    ("extend 192/128 lloyd window", lambda: _attn("e", dk=192, dv=128, hq=8, hkv=8, quantizer="lloyd-max",
                                                  sliding_window=16, logit_cap=20.0)),
]


#: shared memory one program may use on an H100 / H200 SM (227 KB, the limit Triton's launcher checks)
SM90_MAX_SHARED = 232448


def main(argv):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET to compile for sm_90", file=sys.stderr)
        return 2
    only = argv[1:] or None
    torch.manual_seed(0)
    with compile_only("cuda", 90):
        for name, fn in CASES:
            if only and not any(o in name for o in only):
                continue
            before = len(COMPILED)
            t0 = time.time()
            fn()
            kernels = ", ".join(c[0] for c in COMPILED[before:])
            for kname, _, _, kernel in COMPILED[before:]:
                shared = getattr(getattr(kernel, "metadata", None), "shared", 0)
                if shared > SM90_MAX_SHARED:
                    print(f"FAIL {name}: {kname} needs {shared} B of shared memory (sm_90: {SM90_MAX_SHARED})",
                          file=sys.stderr)
                    return 1
            print(f"ok  {name:40s} {time.time() - t0:5.1f}s  [{kernels}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
