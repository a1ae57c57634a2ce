"""Served accuracy of a trained checkpoint: int2 and BF16 servers against the PyTorch oracle and model.

Serves the checkpoint written by ``scripts/train_small_lm.py`` twice -- BF16 and
``--kv-cache-dtype int2 --oscar-rotation ROT`` (an OSCAR per-layer rotation fitted here on the
checkpoint's ``calib.jsonl`` unless ``--rotation`` is given) -- and compares on held-out text:

* teacher-forced held-out perplexity from the int2 server's prompt log-probs vs the PyTorch
  number (the same model with the reference oracle as its attention, window mode "extend", which
  is what a served prefill reads: the sink in BF16, everything else through INT2), and the
  per-position mean |delta log-prob| between them;
* the same for the BF16 server vs the plain PyTorch model (the noise floor of serving);
* greedy continuations of ``--prompts`` held-out prompts: int2 vs BF16 token agreement.

The held-out sequences (seed 1), the greedy prompts (seed 2) and the calibration sequences
(``calib.jsonl``, the train split, seed 0) are each chosen from many files: at most
``--max-seq-per-file`` sequences per file, round robin over the files in a seeded order, shorter
files packed together (``sglang_oscar.calibrate.quality.select_prompt_set``; ``0`` restores the
earlier packing of all documents). The JSON and the table record how many files each set covers.

Usage (GPU box with sglang 0.5.16 + this plugin; ``source device/env.sh`` sets that up; the
servers run through the e2e harness's :class:`~.servers.Server`):
    python -m tests.e2e.served_quality --model CKPT --out DIR [--rotation FILE] [--seqs 8] [--seq-len 1024]
Writes ``served_quality.json`` and ``served_quality.md`` to ``--out``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from .checkpoints import load_hf
from .client import generate_payload, parse_generation
from .oracle import teacher_forced_logprobs
from .servers import Server, ServerSpec


def _prompt_set(tok, path: str, budget: int, seq_len: int, seed: int, max_seq_per_file: int = 1):
    from sglang_oscar.calibrate.quality import select_prompt_set

    return select_prompt_set(tok, path, budget=budget, seq_len=seq_len, seed=seed, max_seq_per_file=max_seq_per_file)[0]


def _files(ps, n: int | None = None):
    """Distinct files behind the first ``n`` sequences of a prompt set (``None`` without source tracking)."""
    src = ps.meta.get("sources")
    if src is None:
        return None
    return len({name for seq in src[:n] for name, _, _ in seq})


def _mean_abs(a, b) -> float:
    d = [abs(x - y) for s, t in zip(a, b) for x, y in zip(s, t)]
    return sum(d) / max(len(d), 1)


def _ppl(lps) -> float:
    flat = [x for s in lps for x in s]
    return math.exp(-sum(flat) / max(len(flat), 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.served_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/served_quality"))
    ap.add_argument("--rotation", default=None, help="rotation file (default: fit OSCAR per layer on calib.jsonl)")
    counts = {"--seqs": 8, "--seq-len": 1024, "--calib-tokens": 32768, "--prompts": 20, "--prompt-len": 512,
              "--new-tokens": 32, "--sink": 64, "--recent": 256, "--base-port": 32000}
    for flag, default in counts.items():
        ap.add_argument(flag, type=int, default=default, help=f"(default {default})")
    ap.add_argument("--max-seq-per-file", type=int, default=1,
                    help="at most this many sequences (and greedy prompts) per file, round robin over the files in a "
                         "seeded order; shorter files are packed together (default 1; 0: pack all documents in a "
                         "seeded order, the selection before this option)")
    ap.add_argument("--mem-fraction", type=float, default=0.35)
    ap.add_argument("--no-server", action="store_true", help="PyTorch side only (CPU tests)")
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()

    from sglang_oscar.calibrate.fit import fit_rotations
    from sglang_oscar.calibrate.model import load_model
    from sglang_oscar.calibrate.run import calibrate_model
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    import torch

    _, tok = load_model(args.model, device="cpu")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # fp32 LM head on both sides (the servers get --enable-fp32-lm-head)
    model = load_hf(args.model, device, fp32_head=True)
    heldout = _prompt_set(tok, os.path.join(args.model, "heldout.jsonl"), args.seqs * args.seq_len, args.seq_len, 1,
                          args.max_seq_per_file)
    seqs = [list(s) for s in heldout.sequences][: args.seqs]
    calib_files = None
    if args.rotation is None:
        calib = _prompt_set(tok, os.path.join(args.model, "calib.jsonl"), args.calib_tokens, args.seq_len, 0,
                            args.max_seq_per_file)
        calib_files = _files(calib)
        stats = calibrate_model(model, calib, os.path.join(args.out, "stats.safetensors"), restart=True, progress=False)
        rs = fit_rotations(stats, "oscar", min_tokens=min(4096, args.calib_tokens // 2))
        args.rotation = os.path.join(args.out, "rot_oscar.safetensors")
        rs.save(args.rotation)
    rs = RotationSet.load(args.rotation)
    cfg = OscarConfig(sink_tokens=args.sink, recent_tokens=args.recent)
    ref_bf16 = teacher_forced_logprobs(model, seqs)
    ref_int2 = teacher_forced_logprobs(model, seqs, rotation=rs, config=cfg)
    rep = {"model": args.model, "rotation": args.rotation, "sink": args.sink, "recent": args.recent,
           "sequences": len(seqs), "seq_len": args.seq_len, "max_seq_per_file": args.max_seq_per_file,
           "heldout_files": _files(heldout, args.seqs), "calib_files": calib_files,
           "heldout_sources": heldout.meta.get("sources", [])[: args.seqs],
           "pytorch": {"bf16_ppl": _ppl(ref_bf16), "int2_oracle_ppl": _ppl(ref_int2),
                       "int2_effect_mean_abs_dlogprob": _mean_abs(ref_int2, ref_bf16)}}
    print(json.dumps(rep["pytorch"]), flush=True)
    if not args.no_server:
        common = ["--enable-fp32-lm-head", "--disable-prefill-cuda-graph", "--oscar-sink-tokens"]
        specs = [
            ServerSpec("served-bf16", "trained", ["--enable-fp32-lm-head", "--disable-prefill-cuda-graph"], "q",
                         mem_fraction=args.mem_fraction, pool_tokens=65536, port=args.base_port),
            ServerSpec("served-int2", "trained", ["--kv-cache-dtype", "int2", "--oscar-rotation", args.rotation,
                                                    *common, str(args.sink), "--oscar-recent-tokens", str(args.recent)],
                         "q", mem_fraction=args.mem_fraction, pool_tokens=65536, port=args.base_port + 10),
        ]
        servers = [Server(s, args.model, args.out, sys.executable) for s in specs]
        try:
            for s in servers:
                s.start()
            for s in servers:
                if not s.wait_healthy(300):
                    raise RuntimeError(f"{s.spec.name}: {s.error}")
            served = {}
            for s in servers:
                lps = []
                for q in seqs:
                    g = parse_generation(s.generate(generate_payload(q, 1, input_logprobs=True, top_logprobs=0)))
                    lps.append(g["input_logprobs"])
                served[s.spec.name] = lps
            prompt_set = _prompt_set(tok, os.path.join(args.model, "heldout.jsonl"), args.prompts * args.prompt_len,
                                     args.prompt_len, 2, args.max_seq_per_file)
            prompts = [q[: args.prompt_len] for q in prompt_set.sequences][: args.prompts]
            outs = {s.spec.name: [parse_generation(s.generate(generate_payload(p, args.new_tokens, top_logprobs=0)))
                                  ["tokens"] for p in prompts] for s in servers}
        finally:
            for s in servers:
                s.stop()
        a, b = outs["served-int2"], outs["served-bf16"]
        pos = [x == y for u, v in zip(a, b) for x, y in zip(u, v)]
        prefix = []
        for u, v in zip(a, b):
            n = 0
            while n < min(len(u), len(v)) and u[n] == v[n]:
                n += 1
            prefix.append(n)
        int2_ppl, bf16_ppl = _ppl(served["served-int2"]), _ppl(served["served-bf16"])
        rep["served"] = {
            "int2_ppl": int2_ppl, "bf16_ppl": bf16_ppl,
            "int2_vs_oracle_ppl_rel": int2_ppl / rep["pytorch"]["int2_oracle_ppl"] - 1,
            "bf16_vs_pytorch_ppl_rel": bf16_ppl / rep["pytorch"]["bf16_ppl"] - 1,
            "int2_vs_oracle_mean_abs_dlogprob": _mean_abs(served["served-int2"], ref_int2),
            "bf16_vs_pytorch_mean_abs_dlogprob": _mean_abs(served["served-bf16"], ref_bf16),
            "greedy_prompts": len(prompts), "greedy_prompt_files": _files(prompt_set, args.prompts),
            "greedy_new_tokens": args.new_tokens,
            "greedy_token_agreement": sum(pos) / max(len(pos), 1),
            "greedy_identical": sum(n == args.new_tokens for n in prefix),
            "greedy_mean_common_prefix": sum(prefix) / max(len(prefix), 1),
        }
    rep["wall_s"] = time.time() - t0
    with open(os.path.join(args.out, "served_quality.json"), "w") as f:
        json.dump(rep, f, indent=2)
    p = rep["pytorch"]
    hf = f" from {rep['heldout_files']} held-out files" if rep["heldout_files"] is not None else ""
    lines = [f"Served accuracy: {args.model}, {len(seqs)} held-out sequences x {args.seq_len} tokens{hf}, "
             f"sink {args.sink} / recent {args.recent}, rotation {os.path.basename(args.rotation)}", "",
             "| quantity | value |", "|---|---:|",
             f"| PyTorch BF16 ppl | {p['bf16_ppl']:.4f} |",
             f"| PyTorch oracle INT2 ppl (window mode extend) | {p['int2_oracle_ppl']:.4f} |",
             f"| INT2 effect, mean abs dlogprob (oracle vs BF16) | {p['int2_effect_mean_abs_dlogprob']:.4f} |"]
    if "served" in rep:
        s = rep["served"]
        gf = f" from {s['greedy_prompt_files']} files" if s["greedy_prompt_files"] is not None else ""
        lines += [f"| served BF16 ppl (rel. to PyTorch) | {s['bf16_ppl']:.4f} ({100 * s['bf16_vs_pytorch_ppl_rel']:+.2f}%) |",
                  f"| served int2 ppl (rel. to the oracle) | {s['int2_ppl']:.4f} ({100 * s['int2_vs_oracle_ppl_rel']:+.2f}%) |",
                  f"| mean abs dlogprob served BF16 vs PyTorch | {s['bf16_vs_pytorch_mean_abs_dlogprob']:.4f} |",
                  f"| mean abs dlogprob served int2 vs oracle | {s['int2_vs_oracle_mean_abs_dlogprob']:.4f} |",
                  f"| greedy int2 vs BF16: token agreement ({s['greedy_prompts']} prompts{gf} x "
                  f"{s['greedy_new_tokens']}) | {100 * s['greedy_token_agreement']:.1f}% |",
                  f"| greedy: identical continuations / mean common prefix | {s['greedy_identical']} / "
                  f"{s['greedy_mean_common_prefix']:.1f} tokens |"]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "served_quality.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
