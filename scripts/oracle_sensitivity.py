"""How much the INT2 oracle's log-probs move when the model's K/V change at BF16 rounding level.

Builds the e2e harness's tiny Qwen3 (``scripts/gpu_e2e.py``, same seed and scaling), fits its
per-layer OSCAR rotation on random tokens, and compares teacher-forced log-probs of the oracle
(window mode "extend") on the checkpoint loaded in bf16 vs fp32 -- the K/V then differ only by
BF16-level rounding, as SGLang's kernels differ from transformers'. Prints the mean |delta
log-prob| of that pair, of the plain (unquantized) bf16/fp32 pair, and the INT2 effect.

Usage (CPU is fine): python scripts/oracle_sensitivity.py [--out /tmp/sens] [--seqs 2] [--len 300]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_e2e as E  # noqa: E402


def main(argv=None) -> int:
    import torch

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/oracle_sensitivity")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--len", type=int, default=300)
    a = ap.parse_args(argv)
    args = E.parse_args(["--out", a.out])
    ckpt = os.path.join(a.out, "qwen3")
    E.build_checkpoint("qwen3", ckpt, seed=args.seed, args=args)
    m16 = E.load_hf(ckpt, "cpu")
    rot = E.make_rotation_files(m16, ckpt, os.path.join(a.out, "rot"), seqs=4, seq_len=512, min_tokens=1000)
    rs = RotationSet.load(rot["layer"])
    cfg = OscarConfig(sink_tokens=E.C_SINK, recent_tokens=E.C_RECENT)
    seqs = [E.random_prompt(a.len, 7 + i) for i in range(a.seqs)]
    m32 = E.load_hf(ckpt, "cpu", dtype=torch.float32)
    o16 = E.teacher_forced_logprobs(m16, seqs, rotation=rs, config=cfg)
    o32 = E.teacher_forced_logprobs(m32, seqs, rotation=rs, config=cfg)
    p16 = E.teacher_forced_logprobs(m16, seqs)
    p32 = E.teacher_forced_logprobs(m32, seqs)

    def mad(x, y):
        d = [abs(p - q) for s, t in zip(x, y) for p, q in zip(s, t)]
        return sum(d) / len(d)

    print(f"oracle, bf16-loaded vs fp32-loaded model: mean |dlogprob| {mad(o16, o32):.4f}")
    print(f"plain model, bf16 vs fp32:                mean |dlogprob| {mad(p16, p32):.4f}")
    print(f"INT2 effect (oracle vs plain, bf16):      mean |dlogprob| {mad(o16, p16):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
