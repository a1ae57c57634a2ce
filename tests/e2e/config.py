"""End-to-end device checks of the served INT2 KV cache: check letters, sizes and the command line.

Run on a CUDA machine with SGLang 0.5.16 and the plugin's entry point installed (``device/e2e.sh``
does both): ``python -m tests.e2e [--only a,b,c] [--tp2] [options]``. ``docs/serving.md``
"Device checks" explains each check; :mod:`tests.e2e` lists them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECKS: dict[str, str] = {
    "a": "plugin installed, --kv-cache-dtype auto == plugin disabled",
    "b": "int2, windows cover everything, identity rotation == BF16 (greedy)",
    "c": "int2 quantizing: served log-probs vs the oracle (prefill + decode)",
    "d": "radix hit / chunked prefill 64 / CUDA graph off: identical",
    "e": "64 concurrent mixed-length requests, strict leak checks",
    "f": "max_total_num_tokens int2 / BF16 at equal --mem-fraction-static",
    "g": "decode tok/s at 32K context, batch 1, int2 / BF16",
    "h": "--tp 2 == --tp 1 (per-head rotation, greedy)",
    "i": "bad input: launch exits non-zero before loading weights, names the problem",
}
DEFAULT_CHECKS = "abcdefgi"  # h needs --tp2 (a 2-GPU machine)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"  # SKIP: not run (the harness's --budget ran out); not a pass
BUDGET_CUT = "the harness's time budget cut the wait short"

# Tiny checkpoints. head_dim 128 everywhere (the served geometry of real models); vocab a multiple of 64.
VOCAB = 2048
MODEL_FAMILIES = {"qwen3": "qwen3", "moe": "qwen3_moe", "llama": "llama", "long": "qwen3",
                  "gemma3": "gemma3_text", "gemma4": "gemma4_text", "gpt_oss": "gpt_oss", "qwen3_next": "qwen3_next",
                  "qwen3_5": "qwen3_5_moe", "minimax_m2": "minimax_m2"}
DEFAULT_FAMILIES = "qwen3,moe,llama"  # --families
GEMMA_FAMILIES = ("gemma3", "gemma4")
SWA_FAMILIES = GEMMA_FAMILIES + ("gpt_oss",)  # sliding-window families (tests/e2e/families.py)
HYBRID_SWA_FAMILIES = ("gemma4", "gpt_oss")  # SGLang's hybrid SWA memory: a full and a sliding pool
SINK_FAMILIES = ("gpt_oss",)  # learned attention-sink logits (GPT-OSS ``sinks``)
LINEAR_FAMILIES = ("qwen3_next", "qwen3_5")  # linear-attention hybrids (Gated-DeltaNet + full attention layers)
# Families saved as a multimodal wrapper (Qwen3.5: Qwen3_5MoeForConditionalGeneration): SGLang loads a
# processor for them even with --skip-tokenizer-init, so their folders carry one (checkpoints.write_processor)
MULTIMODAL_FAMILIES = ("qwen3_5",)
MOE_MHA_FAMILIES = ("minimax_m2",)  # one MHA pool; partial RoPE and cross-head q/k norms before the cache write
# MoE families among c/d's: a BF16 rounding change can flip a near-tied expert routing, a jump that
# INT2 codes then carry on; with --c-fp32 checks b and d judge them on fp32 twins
ROUTED_FAMILIES = ("gpt_oss", "qwen3_next", "qwen3_5", "minimax_m2")
SIZED_FAMILIES = SWA_FAMILIES + LINEAR_FAMILIES + MOE_MHA_FAMILIES  # f measures a sizing pair of their own
# Families whose architecture SGLang checks --attention-backend for itself (server_args.py: Gemma-4
# :4709, GPT-OSS :4595), before the plugin's launch checks: check i's flashinfer case avoids them.
OWN_BACKEND_ASSERT = ("gemma4", "gpt_oss")
# Check i's family-specific bad rotation files: family -> (rotation file kind, case). gemma4: one
# head_dim for every layer; gpt_oss: a centred file (refused with attention sinks); qwen3_next, qwen3_5:
# a rotation for every layer, their Gated-DeltaNet layers included (tests/e2e/checkpoints.py).
FAMILY_BAD_ROTATIONS = {"gemma4": ("onedim", "bad-rotation-one-head-dim"),
                        "gpt_oss": ("centred", "bad-rotation-centred"),
                        "qwen3_next": ("linear", "bad-rotation-linear-layers"),
                        "qwen3_5": ("linear", "bad-rotation-linear-layers")}
B_ONLY_FAMILIES = ("moe", "llama")  # served by check b only; the other families by a, b, c, d, e, i
# Families of check h (--tp2): those with an int2 per-head rotation path here (check c's
# ``<family>-int2-head`` server), each compared with its own ``--tp-size 2`` twin
H_FAMILIES = ("qwen3",) + SWA_FAMILIES + LINEAR_FAMILIES + MOE_MHA_FAMILIES
SWA_WINDOW = 64  # HF sliding_window of the sliding-window families (key j visible iff pos - j < 64)

# Attention-score std of the sharpened tiny checkpoints (checkpoints.sharpen), per family where the
# default makes the oracle irreproducible at check c's tolerance: Gemma-4's oracle at 1.5 moves its
# decode log-probs by 0.019 (1,024-token prompt) between the model in fp32 and in fp64, at 1.0 by
# 0.002 with an INT2 effect of 0.21-0.25 (scripts/oracle_ulp_sensitivity.py, docs/serving_hybrid.md).
DEFAULT_SCORE_STD = 1.5
FAMILY_SCORE_STD = {"gemma4": 1.0}

# Oracle / server settings of the quantizing checks (c, d, h).
C_SINK, C_RECENT = 16, 32
# Check c's --dtype float32 servers and their oracle store (scale, zero) in fp32: a one-ulp change
# of a row's min/max flips the fp16 rounding of its pair, and on the sharpened tiny checkpoints the
# flipped codes cascade through the layers to ~0.02 mean |d logprob| (Gemma-4's oracle against
# itself with K/V perturbed by 1e-7 relative), the check's tolerance. fp32 pairs keep that floor
# near 0.004; the served default (fp16 pairs) is what the BF16 servers and the kernel tests check.
C_FP32_SCALE_DTYPE = "float32"
# Windows that cover every position of check b's sequences (prompt + generated <= B_SINK).
B_SINK, B_RECENT = 1024, 64

B_LENS = (40, 300, 900)  # check b (and a): prompt + generated <= B_SINK
D_LENS = (200, 700, 1500)  # check d
H_LENS = (100, 600, 1200)  # check h
LEAK_PATTERNS = ("memory leak detected", "Mem Leak Detected", "KV double free", "use-after-free",
                 "req_to_token_pool memory leak")
WEIGHT_LOAD_MARK = "Load weight begin"


def _checks_arg(text: str) -> list[str]:
    letters = [c.strip().lower() for c in text.replace(" ", "").split(",") if c.strip()]
    if len(letters) == 1 and len(letters[0]) > 1 and "," not in text:  # --only abc
        letters = list(letters[0])
    bad = [c for c in letters if c not in CHECKS]
    if bad or not letters:
        raise argparse.ArgumentTypeError(f"unknown check(s) {bad or text!r}; choose from {','.join(CHECKS)}")
    return sorted(set(letters))


def build_parser() -> argparse.ArgumentParser:
    checks = "\n".join(f"  {k}  {v}" for k, v in CHECKS.items())
    p = argparse.ArgumentParser(prog="python -m tests.e2e",
                                description="End-to-end device checks of the served INT2 KV cache.\n\n" + checks,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=_checks_arg, default=None, metavar="a,b,c",
                   help=f"checks to run (default {','.join(DEFAULT_CHECKS)}; h also with --tp2)")
    p.add_argument("--tp2", action="store_true", help="2-GPU machine: add check h (--tp 2 vs --tp 1)")
    p.add_argument("--families", default=DEFAULT_FAMILIES, metavar="qwen3,moe,llama",
                   help=f"model families (default {DEFAULT_FAMILIES}; also {','.join(SWA_FAMILIES)}, sliding window "
                        f"{SWA_WINDOW}, {','.join(LINEAR_FAMILIES)}, linear-attention hybrids, and "
                        f"{','.join(MOE_MHA_FAMILIES)}, partial RoPE + cross-head q/k norms): b runs on each; "
                        f"a, c, d, e, i on each but {'/'.join(B_ONLY_FAMILIES)} (on the first family if only those); "
                        "f adds a sizing pair per family after qwen3/moe/llama; g stays qwen3; h (--tp2) runs on "
                        f"each but {'/'.join(B_ONLY_FAMILIES)}, one TP 2 server per family, alone")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/oscar_e2e", help="results folder (default $OUT)")
    p.add_argument("--work", default=None,
                   help="checkpoints and rotation files (default OUT_work, next to OUT: kept out of the results)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-port", type=int, default=31000)
    p.add_argument("--start-timeout", type=float, default=420.0, help="seconds for a server to become healthy")
    p.add_argument("--fail-timeout", type=float, default=150.0, help="seconds for a bad launch (i) to exit")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--budget", type=float, default=500.0,
                   help="seconds for the whole run; checks not reached by then are reported as not run")
    # memory
    p.add_argument("--mem-fraction", type=float, default=0.4,
                   help="--mem-fraction-static of the concurrent servers (their pools are capped by --max-total-tokens)")
    p.add_argument("--pool-tokens", type=int, default=65536, help="--max-total-tokens of the concurrent servers")
    p.add_argument("--sizing-mem-fraction", type=float, default=0.5, help="--mem-fraction-static of f/g (run alone)")
    # thresholds
    p.add_argument("--a-tol", type=float, default=1e-3, help="a: max |d logprob| (plugin must not change auto)")
    p.add_argument("--c-tol", type=float, default=0.02, help="c: mean |served - oracle| logprob")
    p.add_argument("--d-tol", type=float, default=0.02, help="d: max |d logprob| of output tokens, mean for prompts")
    p.add_argument("--h-tol", type=float, default=0.25,
                   help="h: sanity bound on max |d logprob| tp1 vs tp2 (the pass criterion is identical greedy "
                        "tokens; TP=2 reduces in another order, which flips some INT2 codes: 0.087 measured)")
    p.add_argument("--memory-target", type=float, default=5.0, help="f: int2/BF16 max_total_num_tokens")
    p.add_argument("--speedup-target", type=float, default=1.5, help="g: int2/BF16 decode tok/s at --long-context")
    p.add_argument("--i-max-seconds", type=float, default=120.0, help="i: a bad launch must exit within this")
    # sizes
    p.add_argument("--greedy-tokens", type=int, default=12, help="tokens generated by the greedy comparisons")
    p.add_argument("--screen-candidates", type=int, default=12, help="seeded prompt candidates per length")
    p.add_argument("--b-lens", default=",".join(map(str, B_LENS)), help=f"a/b: prompt lengths (+ generated <= {B_SINK})")
    p.add_argument("--c-prompt-lens", default="1024,1800", help="c: prompt lengths")
    p.add_argument("--d-lens", default=",".join(map(str, D_LENS)), help="d: prompt lengths")
    p.add_argument("--h-lens", default=",".join(map(str, H_LENS)), help="h: prompt lengths")
    p.add_argument("--c-decode-tokens", type=int, default=64, help="c: generated tokens scored against the oracle")
    p.add_argument("--c-fp32", action="store_true",
                   help="c: also serve the two int2 servers of c with --dtype float32 (plus a --dtype float32 "
                        "--kv-cache-dtype auto noise-floor server) and compare them with the oracle on the model "
                        "loaded in fp32, HP tier fp32; that comparison becomes c's pass criterion (--c-tol), the "
                        "BF16 one is still measured and reported; d judges its radix hit on the fp32 layer server "
                        "(started for d too)")
    p.add_argument("--load-requests", type=int, default=64)
    p.add_argument("--load-min-len", type=int, default=100)
    p.add_argument("--load-max-len", type=int, default=8192)
    p.add_argument("--load-new-tokens", type=int, default=32)
    p.add_argument("--load-pool-tokens", type=int, default=131072, help="e: --max-total-tokens (forces queueing)")
    p.add_argument("--long-context", type=int, default=32768, help="g: prompt length")
    p.add_argument("--decode-tokens", type=int, default=256, help="g: generated tokens")
    p.add_argument("--long-layers", type=int, default=8)
    p.add_argument("--long-heads", type=int, default=128)
    p.add_argument("--long-kv-heads", type=int, default=32)
    p.add_argument("--long-hidden", type=int, default=256)
    p.add_argument("--logit-std", type=float, default=0.5,
                   help="std of the tiny models' logits (sets how strongly log-probs react to KV errors)")
    p.add_argument("--score-std", type=float, default=None,
                   help=f"std of the tiny models' attention scores (default {DEFAULT_SCORE_STD}, "
                        f"per family {FAMILY_SCORE_STD})")
    p.add_argument("--no-fp32-lm-head", dest="fp32_lm_head", action="store_false",
                   help="serve (and compute references) with BF16 logits; by default every server gets "
                        "--enable-fp32-lm-head, since BF16 logits of these tiny models tie (greedy and log-prob noise)")
    p.add_argument("--server-args", default="", help="extra sglang flags for every server (one shell-quoted string)")
    p.add_argument("--int2-args", default="",
                   help="extra sglang flags for the --kv-cache-dtype int2 servers only (one shell-quoted string), "
                        "e.g. '--oscar-rotate-engine torch' or '--oscar-decode-engine triton'")
    p.add_argument("--dry-run", action="store_true", help="print the servers and commands, start nothing")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``args.checks`` is the sorted list of check letters to run."""
    args = build_parser().parse_args(argv)
    checks = args.only if args.only is not None else list(DEFAULT_CHECKS) + (["h"] if args.tp2 else [])
    if "h" in checks and not args.tp2:
        build_parser().error("check h needs --tp2 (a machine with 2 GPUs)")
    args.checks = sorted(checks)
    fams = [f.strip().lower() for f in str(args.families).split(",") if f.strip()]
    bad = [f for f in fams if f not in MODEL_FAMILIES or f == "long"]
    if bad or not fams:
        build_parser().error(f"--families: unknown {bad or args.families!r}; choose from "
                             f"{','.join(f for f in MODEL_FAMILIES if f != 'long')}")
    args.families = list(dict.fromkeys(fams))
    if "h" in checks and not h_families(args):
        build_parser().error(f"check h runs on {','.join(H_FAMILIES)} (the b-only {'/'.join(B_ONLY_FAMILIES)} have no "
                             "per-head int2 server): add one of them to --families")
    for key in ("b_lens", "c_prompt_lens", "d_lens", "h_lens"):
        try:
            setattr(args, key, [int(x) for x in str(getattr(args, key)).split(",") if x.strip()])
        except ValueError:
            build_parser().error(f"--{key.replace('_', '-')} takes comma-separated integers")
        if not getattr(args, key) or min(getattr(args, key)) < 2:
            build_parser().error(f"--{key.replace('_', '-')} needs lengths >= 2")
    if max(args.b_lens) + args.greedy_tokens > B_SINK:
        build_parser().error(f"--b-lens + --greedy-tokens must stay <= {B_SINK} (check b quantizes nothing)")
    args.work = args.work or os.path.join(os.path.dirname(os.path.abspath(args.out)),
                                          os.path.basename(os.path.abspath(args.out)) + "_work")
    if args.load_min_len < 2 or args.load_max_len < args.load_min_len:
        build_parser().error("need 2 <= --load-min-len <= --load-max-len")
    return args


def main_families(args: argparse.Namespace) -> list[str]:
    """The families of checks a, c, d, e, i: every selected one but the b-only ones (the first
    selected family if only those); ``["qwen3"]`` by default."""
    fams = list(getattr(args, "families", None) or DEFAULT_FAMILIES.split(","))
    return [f for f in fams if f not in B_ONLY_FAMILIES] or fams[:1]


def h_families(args: argparse.Namespace) -> list[str]:
    """The families of check h: the selected ones of :data:`H_FAMILIES` (never the b-only ones),
    in ``--families`` order; ``["qwen3"]`` by default."""
    fams = list(getattr(args, "families", None) or DEFAULT_FAMILIES.split(","))
    return [f for f in fams if f in H_FAMILIES]


def c_prompt_lens(args: argparse.Namespace, family: str) -> list[int]:
    """Check c's prompt lengths for ``family``: ``--c-prompt-lens``, led by a prompt 4x the window
    for a sliding-window family (decoding then runs past the window's edge)."""
    lens = list(args.c_prompt_lens)
    return list(dict.fromkeys([4 * SWA_WINDOW] + lens)) if family in SWA_FAMILIES else lens


def score_std_of(args: argparse.Namespace, family: str) -> float:
    """The attention-score std ``family``'s tiny checkpoint is sharpened to: ``--score-std`` when given,
    else :data:`FAMILY_SCORE_STD` or :data:`DEFAULT_SCORE_STD`."""
    given = getattr(args, "score_std", None)
    return given if given is not None else FAMILY_SCORE_STD.get(family, DEFAULT_SCORE_STD)
