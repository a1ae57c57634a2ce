"""Oracle's own sensitivity to last-ulp fp32 differences in K/V (check c, --c-fp32 setting).

For each family: build the tiny checkpoint as tests/e2e/run.py prepare() does (seed 0, harness
defaults logit_std 0.5, score_std tests.e2e.config.score_std_of), fit the rotation files (make_rotation_files on the bf16
model with fp32 head, defaults), load the checkpoint in fp32, and compute teacher-forced prompt
log-probs with the oracle (rotation ``--rotation``, default 'layer', OscarConfig(sink 16, recent 32), hp_dtype fp32: pure
prefill = extend windows, exactly as check c's c_oracle_fp32_layer). Then repeat with the K and V
rows entering build_cache multiplied by (1 + eps * N(0,1)) and report |d logprob| and the INT2
code flips. A control with every key in HP (sink_tokens >= T, no INT2 read) gives the continuous
amplification of the same perturbation.

Run from the repository root (CPU, ~5 min for the figures in docs/serving_hybrid.md):
  PYTHONPATH=python:. TRITON_INTERPRET=1 python scripts/oracle_ulp_sensitivity.py \
      --families qwen3,gemma3,gemma4 --lens 256,1024,1800 --noise-seeds 5 --control --scale32
With ``--decode N`` also check c's decode positions: the oracle's own greedy continuation of N
tokens (fp32 pairs), teacher-forced with decode windows, base against perturbed, per seed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

import sglang_oscar.reference.attention as refattn
from sglang_oscar.config import OscarConfig
from sglang_oscar.quant.packing import unpack_quarter
from sglang_oscar.rotation import RotationSet
from tests.e2e.checkpoints import build_checkpoint, load_hf, make_rotation_files, random_prompt
from tests.e2e.config import C_RECENT, C_SINK, SWA_FAMILIES, c_prompt_lens, parse_args, score_std_of
from tests.e2e.oracle import greedy_paths, teacher_forced_logprobs

_ORIG_BUILD = refattn.build_cache


class Perturb:
    """Replaces reference.attention.build_cache (looked up by oracle_handler at each call):
    multiplies k, v by (1 + eps N(0,1)) (seeded per call) and records K/V codes in call order."""

    def __init__(self):
        self.eps = 0.0
        self.seed = 0
        self.record: list | None = None
        self.calls = 0
        self.raw: list | None = None

    def __call__(self, k, v, rk, rv, config, hp_dtype=torch.bfloat16, k_mean=None, v_mean=None, **kw):
        if self.eps:
            g = torch.Generator().manual_seed(self.seed * 1000003 + self.calls)
            k = k * (1 + self.eps * torch.randn(k.shape, generator=g, dtype=torch.float32).to(k.dtype))
            if v is not None:
                v = v * (1 + self.eps * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype))
        self.calls += 1
        if self.raw is not None:
            self.raw.append((k.double(), None if v is None else v.double()))
        kv = _ORIG_BUILD(k, v, rk, rv, config, hp_dtype, k_mean=k_mean, v_mean=v_mean, **kw)
        if self.record is not None:
            self.record.append((unpack_quarter(kv.k_quant.codes), unpack_quarter(kv.v_quant.codes),
                                kv.k_quant.pairs.float(), kv.v_quant.pairs.float()))
        return kv


PERT = Perturb()
refattn.build_cache = PERT


def run_oracle(model, seq, rs, cfg, eps, seed, record, prompt_len=None):
    PERT.eps, PERT.seed, PERT.calls = eps, seed, 0
    PERT.record = [] if record else None
    lp = teacher_forced_logprobs(model, [seq], rotation=rs, config=cfg, hp_dtype=torch.float32,
                                 prompt_lens=None if prompt_len is None else [prompt_len])[0]
    rec, PERT.record = PERT.record, None
    return torch.tensor(lp, dtype=torch.float64), rec


@contextlib.contextmanager
def rope_tables_moved(model, frac: float, seed: int):
    """Every rotary module's ``*inv_freq`` buffers (not the ``original_`` copies) with a random
    ``frac`` of the entries in (0, 1) moved one ulp up or down; restored on exit."""
    g = torch.Generator().manual_seed(seed)
    saved = []
    for mod in model.modules():
        for name, buf in mod.named_buffers(recurse=False):
            if name.endswith("inv_freq") and not name.startswith("original") and "_original_" not in name:
                pick = (torch.rand(buf.shape, generator=g) < frac) & (buf > 0) & (buf < 1)
                up = torch.rand(buf.shape, generator=g) < 0.5
                moved = torch.nextafter(buf, torch.where(up, torch.full_like(buf, 2.0), torch.zeros_like(buf)))
                saved.append((buf, buf.clone()))
                buf.copy_(torch.where(pick, moved, buf))
    try:
        yield
    finally:
        for buf, old in saved:
            buf.copy_(old)


def flips(a, b):
    """Fraction of K / V codes that differ; fraction of rows (token x kv-head) with any flip; scale/zero pairs changed."""
    out = {}
    for j, name in ((0, "k"), (1, "v")):
        n = d = rows = rows_d = pairs_d = pairs_n = 0
        for x, y in zip(a, b):
            cx, cy = x[j], y[j]
            n += cx.numel()
            diff = cx != cy
            d += int(diff.sum())
            rows += diff.shape[0] * diff.shape[1]
            rows_d += int(diff.any(-1).sum())
            px, py = x[2 + j], y[2 + j]
            pairs_n += px.numel()
            pairs_d += int((px != py).sum())
        per_layer = [[int((x[j] != y[j]).sum()), int((x[2 + j] != y[2 + j]).sum())] for x, y in zip(a, b)]
        out[name] = {"per_layer_codes_pairs_changed": per_layer, "code_flip_frac": d / n, "codes_flipped": d, "codes": n, "rows_with_flip_frac": rows_d / rows,
                     "scale_zero_changed_frac": pairs_d / pairs_n}
    return out


def stats(a, b):
    d = (a - b).abs()
    return {"mean": float(d.mean()), "max": float(d.max()), "p99": float(d.quantile(0.99)), "n": int(d.numel())}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="qwen3,gemma3,gemma4")
    p.add_argument("--lens", default="256,1024")
    p.add_argument("--eps", default="1e-7,1e-6")
    p.add_argument("--noise-seeds", type=int, default=1)
    p.add_argument("--control", action="store_true", help="also the all-HP control (no INT2 read)")
    p.add_argument("--scale32", action="store_true",
                   help="also a diagnostic with scale_dtype float32 (no fp16 rounding of scale/zero)")
    p.add_argument("--decode", type=int, default=0,
                   help="also the decode positions of check c: the oracle's own greedy continuation of N tokens "
                        "(fp32 pairs, as check c's fp32 criterion), teacher-forced with decode windows, per seed")
    p.add_argument("--rotation", default="layer", choices=("layer", "head"),
                   help="check c's per-layer or per-kv-head fitted rotation file")
    p.add_argument("--rope-ulp", type=float, default=0.0,
                   help="with --decode: also move this fraction of the RoPE inv_freq entries by one ulp (up or "
                        "down at random, per seed), as GPU-computed tables may differ from transformers' CPU ones")
    p.add_argument("--fp64", action="store_true",
                   help="with --decode: also the checkpoint loaded in fp64 (HP tier and pairs fp32) against fp32, "
                        "the oracle's move under fp32 arithmetic alone, and the K/V relative difference per layer")
    p.add_argument("--checkpoint", help="use this tiny checkpoint folder (e.g. the one a device run served) and the "
                   "rotation files of --rotdir instead of building both (needs --families with one family)")
    p.add_argument("--rotdir", help="folder with rot_layer / rot_head.safetensors for --checkpoint")
    p.add_argument("--score-std", type=float, default=None,
                   help="build the checkpoint with this attention-score std (the harness's --score-std, default 1.5)")
    p.add_argument("--logit-std", type=float, default=None, help="the same for the harness's --logit-std (0.5)")
    p.add_argument("--work", default="/tmp/oracle_ulp/work")
    p.add_argument("--out", default="/tmp/oracle_ulp/results.json")
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    hargs = parse_args(["--out", "/tmp/oracle_ulp/e2e_out", "--families", a.families,
                        *(["--score-std", str(a.score_std)] if a.score_std is not None else []),
                        *(["--logit-std", str(a.logit_std)] if a.logit_std is not None else [])])
    lens = [int(x) for x in a.lens.split(",")]
    epss = [float(x) for x in a.eps.split(",")]
    results = json.load(open(a.out)) if os.path.exists(a.out) else {}
    cfg = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT)
    print("config:", cfg, flush=True)
    for fam in a.families.split(","):
        t0 = time.time()
        try:
            if a.checkpoint:
                path, rotdir, info = a.checkpoint, a.rotdir, {"sharpen": "from --checkpoint"}
            else:
                path = os.path.join(a.work, f"tiny-{fam}")
                info = build_checkpoint(fam, path, seed=hargs.seed, args=hargs, logit_std=hargs.logit_std,
                                        score_std=score_std_of(hargs, fam), device="cpu")
                rotdir = os.path.join(a.work, f"rot-{fam}")
            rot_layer = os.path.join(rotdir, "rot_layer.safetensors")
            if not os.path.exists(rot_layer):
                mb = load_hf(path, "cpu", fp32_head=hargs.fp32_lm_head)  # bf16, as prepare()
                make_rotation_files(mb, path, rotdir)
                del mb
            rs = RotationSet.load(os.path.join(rotdir, f"rot_{a.rotation}.safetensors"))
            q32 = load_hf(path, "cpu", dtype=torch.float32, fp32_head=hargs.fp32_lm_head)
            print(f"[{fam}] checkpoint+rotations {time.time() - t0:.0f}s sharpen={info.get('sharpen')}", flush=True)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            results[fam] = {"error": f"{type(exc).__name__}: {exc}"}
            json.dump(results, open(a.out, "w"), indent=1)
            continue
        # check c's prompt seeds: seed*31 + 44 + index in c_prompt_lens (gemma: 256, 1024, 1800; qwen3: 1024, 1800)
        harness_lens = c_prompt_lens(hargs, fam)
        for L in lens:
            idx = harness_lens.index(L) if L in harness_lens else 0
            pseed = hargs.seed * 31 + 44 + idx
            seq = random_prompt(L, pseed, q32.config.vocab_size)
            key = f"{fam}:{L}" + ("" if a.rotation == "layer" else f":{a.rotation}")
            r = results.setdefault(key, {"prompt_seed": pseed, "in_check_c": L in harness_lens})
            t1 = time.time()
            base, rec0 = run_oracle(q32, seq, rs, cfg, 0.0, 0, True)
            # the official handler path unpatched: our wrapper must be a no-op at eps 0
            refattn.build_cache = _ORIG_BUILD
            off = torch.tensor(teacher_forced_logprobs(q32, [seq], rotation=rs, config=cfg, hp_dtype=torch.float32)[0],
                               dtype=torch.float64)
            refattn.build_cache = PERT
            r["wrapper_vs_official_maxdiff"] = float((off - base).abs().max())
            plain = torch.tensor(teacher_forced_logprobs(q32, [seq])[0], dtype=torch.float64)
            r["int2_effect_oracle_vs_hf_fp32"] = stats(base, plain)
            r["t_oracle_s"] = (time.time() - t1) / 3
            print(f"[{key}] base done ({time.time() - t1:.0f}s for 3 passes); int2 effect mean "
                  f"{r['int2_effect_oracle_vs_hf_fp32']['mean']:.4g}; wrapper==official "
                  f"{r['wrapper_vs_official_maxdiff']:.2g}", flush=True)
            for eps in epss:
                for s in range(a.noise_seeds):
                    pert, rec = run_oracle(q32, seq, rs, cfg, eps, 1 + s, True)
                    e = {"dlogprob": stats(pert, base), "flips": flips(rec0, rec)}
                    r[f"eps={eps:g}:seed={1 + s}"] = e
                    print(f"[{key}] eps {eps:g} seed {1 + s}: mean {e['dlogprob']['mean']:.3g} max "
                          f"{e['dlogprob']['max']:.3g} | K flips {e['flips']['k']['code_flip_frac']:.3g} "
                          f"({e['flips']['k']['codes_flipped']}) V flips {e['flips']['v']['code_flip_frac']:.3g} "
                          f"({e['flips']['v']['codes_flipped']}) | K pairs changed "
                          f"{e['flips']['k']['scale_zero_changed_frac']:.3g} | per layer K [codes, pairs] "
                          f"{e['flips']['k']['per_layer_codes_pairs_changed']}", flush=True)
                    json.dump(results, open(a.out, "w"), indent=1)
            if a.control:
                hp_cfg = OscarConfig(sink_tokens=L + 1, recent_tokens=C_RECENT)  # extend: every key HP
                cb, _ = run_oracle(q32, seq, rs, hp_cfg, 0.0, 0, False)
                r["control_allhp_vs_hf_fp32"] = stats(cb, plain)
                for eps in epss:
                    cp, _ = run_oracle(q32, seq, rs, hp_cfg, eps, 1, False)
                    r[f"control_allhp_eps={eps:g}"] = stats(cp, cb)
                    print(f"[{key}] control all-HP eps {eps:g}: mean {r[f'control_allhp_eps={eps:g}']['mean']:.3g} "
                          f"max {r[f'control_allhp_eps={eps:g}']['max']:.3g}", flush=True)
            if a.decode:
                c32 = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT, scale_dtype="float32")
                with torch.no_grad():
                    greedy = greedy_paths(q32, [seq], a.decode, rotation=rs, config=c32)[0]
                seqd = list(seq) + greedy["tokens"]
                bd, _ = run_oracle(q32, seqd, rs, c32, 0.0, 0, False, prompt_len=L)

                def moved(lp, name: str, label: str, **extra) -> None:
                    """Record and print how far log-probs ``lp`` are from the base run ``bd``."""
                    e = {"prefill": stats(lp[:L - 1], bd[:L - 1]), "decode": stats(lp[L - 1:], bd[L - 1:]), **extra}
                    r[f"decode{a.decode}_scale32_{name}"] = e
                    print(f"[{key}] decode {a.decode}, fp32 pairs, {label}: prefill mean {e['prefill']['mean']:.3g} | "
                          f"decode mean {e['decode']['mean']:.3g} max {e['decode']['max']:.3g}"
                          + "".join(f" | {k} {v}" for k, v in extra.items()), flush=True)

                for eps in epss:
                    for s in range(a.noise_seeds):
                        pd, _ = run_oracle(q32, seqd, rs, c32, eps, 1 + s, False, prompt_len=L)
                        moved(pd, f"eps={eps:g}:seed={1 + s}", f"eps {eps:g} seed {1 + s}")
                if a.rope_ulp:
                    for s in range(a.noise_seeds):
                        with rope_tables_moved(q32, a.rope_ulp, 1 + s):
                            pr, _ = run_oracle(q32, seqd, rs, c32, 0.0, 0, False, prompt_len=L)
                        moved(pr, f"rope_ulp={a.rope_ulp:g}:seed={1 + s}",
                              f"inv_freq {a.rope_ulp:g} of entries +-1 ulp seed {1 + s}")
                if a.fp64:
                    q64 = load_hf(path, "cpu", dtype=torch.float64, fp32_head=hargs.fp32_lm_head)
                    PERT.raw = []
                    run_oracle(q32, seqd, rs, c32, 0.0, 0, False, prompt_len=L)
                    raw32, PERT.raw = PERT.raw, []
                    p64, _ = run_oracle(q64, seqd, rs, c32, 0.0, 0, False, prompt_len=L)
                    raw64, PERT.raw = PERT.raw, None
                    rel = [[float((x[j] - y[j]).norm() / y[j].norm()) for j in (0, 1) if y[j] is not None]
                           for x, y in zip(raw32, raw64)]
                    moved(p64, "fp32_vs_fp64_model", "fp32 vs fp64 model", kv_rel_l2_fp32_vs_fp64_per_layer=rel)
                    del q64
                json.dump(results, open(a.out, "w"), indent=1)
            if a.scale32:
                c32 = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT, scale_dtype="float32")
                b32, r32 = run_oracle(q32, seq, rs, c32, 0.0, 0, True)
                for eps in epss:
                    p32, rr = run_oracle(q32, seq, rs, c32, eps, 1, True)
                    e = {"dlogprob": stats(p32, b32), "flips": flips(r32, rr)}
                    r[f"scale32_eps={eps:g}"] = e
                    print(f"[{key}] scale fp32 diag eps {eps:g}: mean {e['dlogprob']['mean']:.3g} max "
                          f"{e['dlogprob']['max']:.3g} | K flips {e['flips']['k']['codes_flipped']} V flips "
                          f"{e['flips']['v']['codes_flipped']}", flush=True)
            json.dump(results, open(a.out, "w"), indent=1)
        del q32
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
