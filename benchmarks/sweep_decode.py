#!/usr/bin/env python
"""Config sweep of the INT2 decode kernel: launch configs x number of splits, one device call.

For each (context, batch) point of the Qwen3-8B layer geometry of ``bench_decode.py`` (32 q / 8 kv
heads, head_dim 128, sink 64 + recent 256, fp16 scales), times every config of ``--grid`` (default
:data:`DEFAULT_GRID`, the variants worth re-timing: the engines' defaults and the
:class:`TritonConfig` / :class:`GluonConfig` fields the defaults were picked from) at every split
count given by ``--waves`` (INT2 splits = ceil(waves x SMs / (batch x kv heads)), so ``waves`` is
the number of one-warp programs per SM the grid offers), with the same CUDA-graph cold-L2 timing as
``bench_decode.py``. Every variant's output is compared with the Triton engine's default config
(rel. L2; ``WRONG`` above ``--tol``) before it is timed. Prints one table per point (time in us;
best first) and writes JSON. Also prints, per Triton config, the compiled kernel's registers /
spill bytes / shared memory and the resulting warps per SM.

    python -m benchmarks.sweep_decode --out $OUT/sweep.md --json $OUT/sweep.json
    python -m benchmarks.sweep_decode --grid '["triton", {"engine": "triton", "convert": 3}]'
    python -m benchmarks.sweep_decode --profile '{"engine": "triton", "block_n": 16}' --waves 24 \\
        --contexts 131072 --batches 1          # one variant, for ncu
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch

try:  # python -m benchmarks.<name> (a package), or python benchmarks/<name>.py (its folder on the path)
    from . import bench_decode as bd
except ImportError:
    import bench_decode as bd
from sglang_oscar.kernels import DecodeWorkspace, GluonConfig, TritonConfig
from sglang_oscar.kernels.codes import CONVERT_ASM, CONVERT_ASM_PERM

DEFAULT_GRID = [
    None,  # auto: the Gluon engine where it applies (kernels/decode/gluon_stage1.py)
    GluonConfig(maxnreg=None),  # no register cap: 172 registers, 11 programs per SM
    GluonConfig(block_n=16),
    # the Triton engine: its defaults for the point (num_stages and defer_sums follow the batch), then
    # variants of the fields its defaults were chosen from (TritonConfig's defaults otherwise)
    TritonConfig,
    TritonConfig(num_stages=1, defer_sums=False),  # 168 registers, 4 KB shared memory: 12 programs per SM
    TritonConfig(defer_sums=False),
    TritonConfig(pairs_ahead=False, defer_sums=False),
    TritonConfig(convert=CONVERT_ASM_PERM),
    TritonConfig(convert=CONVERT_ASM_PERM, pairs_ahead=False, defer_sums=False),  # the larger heads' default
    TritonConfig(convert=CONVERT_ASM, block_n=64),
    TritonConfig(min_block_h=16),
    TritonConfig(block_n=64, num_warps=2),
    TritonConfig(maxnreg=168),
    TritonConfig(block_n=16, num_stages=3),
]


def splits_for(waves: float, batch: int, sms: int, ctx: int, block_n: int) -> int:
    ns = math.ceil(waves * sms / (batch * bd.HKV))
    return int(max(1, min(ns, math.ceil(ctx / block_n))))


def compiled_stage1() -> dict:
    """``id -> CompiledKernel`` of every compiled stage-1 variant (Triton's in-process cache)."""
    from sglang_oscar.kernels.decode.triton_stage1 import _decode_stage1

    try:
        return {id(k): k for cache in _decode_stage1.device_caches.values() for k in cache[0].values()}
    except Exception:  # noqa: BLE001  (interpreter: no compiled kernels)
        return {}


def resources(kernels) -> list:
    """Registers / spill bytes / shared memory and the warps per SM they allow."""
    out = []
    for k in kernels:
        try:
            k._init_handles()
            w = k.metadata.num_warps
            regs = max(k.n_regs, 1)
            # registers: allocated per thread in steps of 8, per warp from one of the 4 scheduler
            # partitions' 16K registers (ncu's "Block Limit Registers": 194 -> 8 one-warp programs)
            per_partition = 16384 // (((regs + 7) // 8) * 8 * 32)
            by_regs = (4 * per_partition // w) * w
            # shared memory: at the largest carveout (228 KB + 1 KB per block); the driver may pick a
            # smaller one (ncu showed 8 blocks of 18.5 KB)
            by_smem = (233472 // max(k.metadata.shared + 1024, 1)) * w
            out.append({"regs": k.n_regs, "spills": k.n_spills, "shared": k.metadata.shared,
                        "warps_per_sm": min(by_regs, by_smem, 64, 32 * w)})  # <= 32 resident blocks per SM
        except Exception as e:  # noqa: BLE001
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--waves", default="2,8,16,32")
    ap.add_argument("--grid", default=None, help="JSON list of configs (default: DEFAULT_GRID): null / \"auto\", "
                    "\"triton\" / \"gluon\" (that engine's defaults) or {\"engine\": ..., field: value} "
                    "(bench_decode.parse_config)")
    ap.add_argument("--pool-layout", default="random", choices=bd.POOL_LAYOUTS,
                    help="slot ids and pool storage of the benchmark case (bench_decode.apply_pool_layout)")
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--profile", default=None, help="JSON config (as in --grid): run only it (for ncu), 20 launches")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script (TRITON_INTERPRET=1, tiny shapes)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if smoke:
        bd.HQ, bd.HKV = 4, 2
        device, sms = torch.device("cpu"), 4
        args.contexts, args.batches, args.waves = "400", "1,2", "1,2"
        args.grid = args.grid or json.dumps([None, {"engine": "triton", "convert": 3, "block_n": 32}])
    elif not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    layout = bd.bench_layout()
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    waves = [float(x) for x in args.waves.split(",")]

    if args.profile:
        cfg = bd.parse_config(json.loads(args.profile))
        case = bd.Case(batches[0], contexts[0], device, layout, with_bf16=False)
        bd.apply_pool_layout(case, args.pool_layout)
        ns = splits_for(waves[0], batches[0], sms, contexts[0], case.plan_int2(cfg, num_kv_splits=1).config.block_n)
        ws = DecodeWorkspace(device)
        for _ in range(20):
            case.run_int2(cfg, num_kv_splits=ns, workspace=ws)
        if not smoke:
            torch.cuda.synchronize()
        print(f"[profile] {bd.config_label(cfg)} splits={ns} resources={resources(compiled_stage1().values())}")
        return 0

    grid = [bd.parse_config(e) for e in json.loads(args.grid)] if args.grid else DEFAULT_GRID
    results, lines, res = [], [], {}
    t_start = time.time()
    for ctx in contexts:
        for b in batches:
            t0 = time.time()
            case = bd.Case(b, ctx, device, layout, with_bf16=False)
            bd.apply_pool_layout(case, args.pool_layout)
            ref_ns = splits_for(8, b, sms, ctx, 64)
            # the reference: the Triton engine (the grid's entries include the default Gluon pipeline)
            ref = case.run_int2(TritonConfig, num_kv_splits=ref_ns).float()
            point = {"ctx": ctx, "batch": b, "bytes": case.int2_bytes(), "runs": []}
            for cfg in grid:
                label = bd.config_label(cfg)
                bn = case.plan_int2(cfg, num_kv_splits=1).config.block_n
                before = set(compiled_stage1())
                seen = set()
                for w in waves:
                    ns = splits_for(w, b, sms, ctx, bn)
                    if ns in seen:
                        continue
                    seen.add(ns)
                    run = {"config": label, "waves": w, "splits": ns}
                    try:
                        ws = DecodeWorkspace(device)
                        out = torch.empty(b, bd.HQ, bd.D, dtype=torch.bfloat16, device=device)
                        o = case.run_int2(cfg, num_kv_splits=ns, workspace=ws, out=out).float()
                        err = float((o - ref).norm() / ref.norm().clamp_min(1e-30))
                        run["rel_err"] = err
                        if not math.isfinite(err) or err > args.tol:
                            run["status"] = f"WRONG {err:.1e}"
                        else:
                            run["ms"] = bd.bench(lambda c=case, t=cfg, n=ns, w=ws, o=out: c.run_int2(
                                t, num_kv_splits=n, workspace=w, out=o), smoke)
                            run["tbps"] = point["bytes"] / (run["ms"] * 1e-3) / 1e12
                    except Exception as e:  # noqa: BLE001
                        run["status"] = f"FAIL {type(e).__name__}: {str(e)[:160]}"
                        traceback.print_exc()
                    point["runs"].append(run)
                if label not in res:
                    ks = compiled_stage1()
                    res[label] = resources([ks[i] for i in ks if i not in before])
            ok = sorted([r for r in point["runs"] if "ms" in r], key=lambda r: r["ms"])
            lines.append(f"\n### ctx {ctx} x batch {b} ({time.time() - t0:.0f} s)\n")
            lines.append("| us | TB/s | splits | waves | rel err | config |\n|---:|---:|---:|---:|---:|---|")
            for r in ok[:12]:
                lines.append(f"| {r['ms'] * 1e3:.1f} | {r['tbps']:.2f} | {r['splits']} | {r['waves']:g} | "
                             f"{r['rel_err']:.1e} | `{r['config']}` |")
            bad = [r for r in point["runs"] if "status" in r]
            for r in bad:
                lines.append(f"| - | - | {r['splits']} | {r['waves']:g} | - | `{r['config']}` {r['status']} |")
            dflt = [r for r in point["runs"] if r["config"] == "auto" and "ms" in r]
            if dflt and ok:
                lines.append(f"\nbest {ok[0]['ms'] * 1e3:.1f} us vs the default config at 8 waves "
                             f"{min(r['ms'] for r in dflt if r['waves'] == 8) * 1e3 if any(r['waves'] == 8 for r in dflt) else float('nan'):.1f} us")
            print("\n".join(lines[-(len(ok[:12]) + len(bad) + 4):]), flush=True)
            results.append(point)
            case = ref = None
            if not smoke:
                torch.cuda.empty_cache()
    lines.append("\n### compiled stage-1 variants (registers / spill bytes / shared memory / warps per SM)\n")
    for key, r in res.items():
        lines.append(f"* `{key}`: {r}")
    lines.append(f"\nsweep time {time.time() - t_start:.0f} s; pool layout {args.pool_layout}; device "
                 f"{'cpu (interpreter)' if smoke else torch.cuda.get_device_name(0)}, "
                 f"torch {torch.__version__}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"points": results, "resources": res}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
