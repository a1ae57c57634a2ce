"""Which part of a fitted rotation helps: K and V rotations ablated separately (issue 7 diagnostic).

For a checkpoint and its calibration statistics (``sglang-oscar quality`` writes both: the model
directory and ``<work-dir>/stats.safetensors``), every listed (K rotation, V rotation) pair is
built per kv head from the statistics and scored by :func:`sglang_oscar.calibrate.error.functional_error`
(attention-output error in dB against exact attention, per layer and overall; the OSCAR INT2
format at group = head_dim with the given BF16 sink / recent windows) on the held-out sequences
that ``quality`` scores (``heldout.jsonl``, seed 1, at most one sequence per file).

A rotation is ``had`` (the normalised Hadamard) or ``<source>_<order>_<perm>``:

* source: ``qqt`` (the GQA query second moment, OSCAR's K objective), ``ktk`` (raw K second
  moment), ``sst`` (score-weighted V second moment, OSCAR's V objective), ``vtv`` (raw V);
* order: ``asc`` (eigenvectors in ascending eigenvalue order, OSCAR's ``U``) or ``desc``;
* perm: ``P`` (times OSCAR's eigenvalue-sorted bit-reversal permutation) or ``N`` (none).

A pair may end in ``+c`` (centre K and V: the calibration means of the post-RoPE keys and of the
values are subtracted before the rotation, :func:`sglang_oscar.calibrate.fit.fit_rotations`
``center=True``), ``+ck`` (K only) or ``+cv`` (V only), e.g. ``had:had+c``.

``qqt_asc_P`` / ``sst_asc_P`` is OSCAR's ``U H P`` (spec 3.4), ``ktk_desc_N`` / ``vtv_desc_N``
upstream's per-head recipe (``fit --method perhead-kv``). With one (scale, zero) pair per row,
``desc`` puts the dominant direction on the Hadamard's all-ones row 0 (power-of-two head_dim;
the block Hadamard of e.g. 192 has non-zeros only in its first block there), so a row's
component along it becomes a constant, which the zero point absorbs (exactly without clipping;
nearly with the symmetric clip, whose threshold moves with the offset); ``asc`` puts it on the
last row, a +-1 pattern that widens the row's range. ``P`` permutes coordinates after the Hadamard, which changes
nothing at group = head_dim (the format this script scores): ``*_P`` and ``*_N`` score alike.

With ``--k-detail`` the K side is broken down per pair, relative to Hadamard: the energy of the
keys' quantization error (back in the model's frame), the energy of the score error it causes,
``(q . e_k)^2`` over every (query, key) pair of a GQA group, and the mean squared range of the
rotated rows (what sets the INT2 step). A rotation can lower the first and the third and still
raise the second when its error lines up with the query's directions.

With ``--o-proj`` the same error is also measured after the layer's output projection
(``||(o_INT2 - o) W_o^T||^2 / ||o W_o^T||^2``: the attention block's contribution to the residual
stream, which weighs each output direction by how much the model uses it). With ``--ppl`` every
pair's teacher-forced perplexity is computed too
(:func:`sglang_oscar.calibrate.ppl.perplexity`, ``window_mode="decode"``, the same windows), as
``quality``'s rows are.

    python scripts/rotation_ablation.py --model CKPT --stats WORK/stats.safetensors \\
        [--sink 64 --recent 256 --seq-len 2048 --eval-tokens 32768 --device cuda] [--o-proj] [--ppl] \\
        [--pairs had:had,qqt_desc_N:sst_desc_N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang_oscar.calibrate.error import functional_error  # noqa: E402
from sglang_oscar.calibrate.model import input_device  # noqa: E402
from sglang_oscar.calibrate.oracle import RotationCache, mha_output, oracle_capture  # noqa: E402
from sglang_oscar.calibrate.ppl import perplexity  # noqa: E402
from sglang_oscar.calibrate.quality import select_prompt_set  # noqa: E402
from sglang_oscar.calibrate.stats import CalibrationStats  # noqa: E402
from sglang_oscar.quant.int2 import fake_quantize  # noqa: E402
from sglang_oscar.config import OscarConfig  # noqa: E402
from sglang_oscar.rotation import RotationSet  # noqa: E402
from sglang_oscar.rotation.hadamard import default_hadamard, eig_bitrev_permutation  # noqa: E402
from sglang_oscar.rotation.latent import covariance_eigenbasis  # noqa: E402

PAIRS = [("had", "had"), ("qqt_asc_P", "sst_asc_P"), ("qqt_asc_P", "had"), ("had", "sst_asc_P"),
         ("ktk_desc_N", "had"), ("had", "vtv_desc_N"), ("ktk_desc_N", "vtv_desc_N"),
         ("ktk_asc_N", "had"), ("had", "vtv_asc_N"), ("qqt_desc_N", "had"), ("had", "sst_desc_N"),
         ("ktk_desc_P", "had")]
SOURCES = {"qqt": "k", "ktk": "k", "sst": "v", "vtv": "v"}


def composed(cov: torch.Tensor, order: str, perm: bool) -> torch.Tensor:
    """``U H`` or ``U H P`` of one second moment.

    Args:
        cov: ``[D, D]`` symmetric PSD matrix (any float dtype; symmetrised, computed in float64).
        order: ``"asc"`` (``U`` = eigenvectors in ascending eigenvalue order) or ``"desc"``.
        perm: append OSCAR's eigenvalue-sorted bit-reversal permutation ``P``.

    Returns:
        float64 ``[D, D]`` orthogonal rotation.

    Raises:
        ValueError: ``order`` is neither ``"asc"`` nor ``"desc"``.
    """
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
    u, lam = covariance_eigenbasis(cov)  # the fitter's eigh: symmetrised, float64, canonical signs
    if order == "desc":
        u = u.flip(-1)
    r = u @ default_hadamard(cov.shape[0])
    if perm:
        r = r @ eig_bitrev_permutation(lam)
    return r


def parse_kind(kind: str, side: str) -> tuple[str, str, bool] | None:
    """``None`` for ``had``, else ``(source, order, perm)``; ``ValueError`` names a bad spelling."""
    if kind == "had":
        return None
    parts = kind.split("_")
    if len(parts) != 3 or parts[0] not in SOURCES or parts[1] not in ("asc", "desc") or parts[2] not in ("P", "N"):
        raise ValueError(f"rotation {kind!r}: expected 'had' or <qqt|ktk|sst|vtv>_<asc|desc>_<P|N>")
    if SOURCES[parts[0]] != side:
        raise ValueError(f"rotation {kind!r} is a {SOURCES[parts[0]].upper()} objective, given for {side.upper()}")
    return parts[0], parts[1], parts[2] == "P"


CENTER_SUFFIXES = {"": (False, False), "+c": (True, True), "+ck": (True, False), "+cv": (False, True)}


def split_center(kind_v: str) -> tuple[str, bool, bool]:
    """``"sst_desc_N+c"`` -> ``("sst_desc_N", True, True)``: the V rotation name and whether K / V are centred."""
    base, plus, suffix = kind_v.partition("+")
    if plus and "+" + suffix not in CENTER_SUFFIXES:
        raise ValueError(f"pair suffix {'+' + suffix!r}: expected one of +c, +ck, +cv")
    return (base, *CENTER_SUFFIXES["+" + suffix if plus else ""])


def build(stats: CalibrationStats, kind_k: str, kind_v: str) -> RotationSet:
    """Per-kv-head rotation set for one (K, V) pair.

    Args:
        stats: complete MHA/GQA calibration statistics (both passes: ``sst`` needs pass 2; a centred
            pair needs the first moments).
        kind_k, kind_v: rotation names (module docstring): a K objective or ``had`` for K, a V
            objective or ``had`` for V, optionally followed by ``+c`` / ``+ck`` / ``+cv``.

    Returns:
        :class:`RotationSet` with float64 ``[H_kv, D_k, D_k]`` K and ``[H_kv, D_v, D_v]`` V matrices
        per layer (saved as fp32 if written).

    Raises:
        ValueError: a misspelled rotation or an objective given for the other side.
        CalibrationError: statistics without the second pass (``sst``).
    """
    geo = stats.geometry
    kind_v, center_k, center_v = split_center(kind_v)
    spec_k, spec_v = parse_kind(kind_k, "k"), parse_kind(kind_v, "v")
    k, v, km, vm = {}, {}, {}, {}
    for lid in geo.layer_ids:
        n = stats.tokens_per_layer(1)[lid]
        src = {"qqt": lambda: stats.query_covariance(lid), "ktk": lambda: stats.sums["k_sum"][lid] / n,
               "sst": lambda: stats.value_covariance(lid), "vtv": lambda: stats.sums["v_sum"][lid] / n}

        def one(spec, raw):
            base = src[raw]()
            if spec is None:
                d = base.shape[-1]
                return default_hadamard(d).expand(base.shape[0], d, d).clone()
            return torch.stack([composed(c, spec[1], spec[2]) for c in src[spec[0]]()])

        k[lid], v[lid] = one(spec_k, "ktk"), one(spec_v, "vtv")
        if center_k or center_v:
            mk, mv = stats.means(lid)
            if center_k:
                km[lid] = mk.float()
            if center_v:
                vm[lid] = mv.float()
    return RotationSet(k, v, {"method": "ablation"}, k_mean=km, v_mean=vm)


def run_captured(model, prompts, on_attention) -> None:
    """Run ``model`` over every held-out sequence with ``on_attention`` seeing each attention call
    (:func:`sglang_oscar.calibrate.oracle.oracle_capture`; the model keeps its own attention)."""
    device = input_device(model)
    with oracle_capture(model, False, on_attention, None):
        for seq in prompts.sequences:
            model(input_ids=torch.tensor([seq], device=device), use_cache=False)


def o_proj_error(model, prompts, rots: dict[str, RotationSet], cfg: OscarConfig) -> dict[str, Any]:
    """Attention-output error after each layer's ``o_proj`` (dB, per layer and overall).

    Every layer sees the model's own inputs (as in ``functional_error``); the exact output and each
    rotation's INT2 output ``[T, H_q, D_v]`` (fp32) are flattened to ``[T, H_q * D_v]`` (heads
    concatenated, the order in which Llama/Qwen3-style attention feeds ``o_proj``) and multiplied
    by ``o_proj.weight^T`` (fp32; the bias cancels in the error and is left out of the reference
    too) before ``10 log10(sum ||e||^2 / sum ||o W^T||^2)``.

    Args:
        model: loaded MHA/GQA causal LM whose attention modules have an ``o_proj`` applied to the
            plain concatenation of the heads (no output gate).
        prompts: held-out :class:`~sglang_oscar.calibrate.prompts.PromptSet`.
        rots: ``{name: RotationSet}``.
        cfg: windows and quantizer (decode window mode).

    Returns:
        ``{"layers": {str(layer): {name: dB}}, "overall_db": {name: dB},
        "reference_energy": {str(layer): sum ||o W^T||^2}}`` (float64 sums over tokens).

    Raises:
        ValueError: an attention module without ``o_proj``.
    """
    caches = {name: RotationCache(rs) for name, rs in rots.items()}
    num: dict[int, dict[str, float]] = {}
    den: dict[int, float] = {}

    def on_attention(call):
        lid = call.layer_id
        if not hasattr(call.module, "o_proj"):
            raise ValueError(f"layer {lid}: {type(call.module).__name__} has no o_proj; --o-proj needs "
                             "Llama/Qwen3-style attention")
        w = call.module.o_proj.weight.float()
        num.setdefault(lid, dict.fromkeys(rots, 0.0))
        for b in range(call.query.shape[0]):
            exact = mha_output(call, b, None, None, cfg, "decode")
            ref = exact.reshape(exact.shape[0], -1) @ w.T
            den[lid] = den.get(lid, 0.0) + float(ref.double().pow(2).sum())
            for name, c in caches.items():
                out = c.mha(call, b, cfg, "decode")
                num[lid][name] += float(((out - exact).reshape(exact.shape[0], -1) @ w.T).double().pow(2).sum())
        return None

    run_captured(model, prompts, on_attention)

    def db(n, d):
        return 10 * math.log10(max(n, 1e-30) / d)

    return {"layers": {str(lid): {m: db(num[lid][m], den[lid]) for m in rots} for lid in sorted(num)},
            "overall_db": {m: db(sum(num[lid][m] for lid in num), sum(den.values())) for m in rots},
            "reference_energy": {str(lid): den[lid] for lid in sorted(den)}}


def key_error_detail(model, prompts, rots: dict[str, RotationSet], cfg: OscarConfig) -> dict[str, dict[str, float]]:
    """Where each set's K quantization error lands (all positions quantized, no windows).

    For every attention call (layer x sequence) and kv head: ``y = bf16((k - mean) R)`` (``k`` ``[T, D]``
    post-RoPE keys, ``mean`` the set's key mean or 0, ``R`` the set's K rotation, per layer ``[D, D]`` or per kv head
    ``[H_kv, D, D]``; rounded to BF16 as the cache's rows are), ``e = (deq(quant(y)) - y) R^T``
    with ``cfg``'s group size, K clip, scale dtype and quantizer, and the kv head's group of
    queries ``q`` ``[T, G, D]`` (query head ``j`` reads kv head ``j // G``).

    Args:
        model: loaded MHA/GQA causal LM; prompts: held-out sequences; rots: ``{name: RotationSet}``;
        cfg: the INT2 format (windows are ignored).

    Returns:
        ``{name: {"key_mse", "score_err", "range_sq"}}``, float64 sums over attention calls of:
        ``sum ||e||^2`` over tokens and kv heads; the mean of ``(q_t . e_s)^2`` over every query
        ``t``, key ``s`` (all ``T^2`` pairs: no causal mask, no softmax scale) and query head; the
        mean of ``(max(y) - min(y))^2`` over rows. Only ratios between sets are meaningful.
    """
    out = {name: {"key_mse": 0.0, "score_err": 0.0, "range_sq": 0.0} for name in rots}
    caches = {name: RotationCache(rs) for name, rs in rots.items()}

    def on_attention(call):
        lid = call.layer_id
        for b in range(call.query.shape[0]):
            q, k, _ = call.rows(b)
            t, hq, d = q.shape
            hkv = k.shape[1]
            qg = q.double().reshape(t, hkv, hq // hkv, d)
            for name, c in caches.items():
                r = c.get(lid, "k", k.device)
                r = r if r.dim() == 3 else r.expand(hkv, d, d)
                mk = c.mean(lid, "k", k.device)
                kc = k.float() if mk is None else k.float() - mk
                y = torch.einsum("thd,hde->the", kc, r).to(torch.bfloat16).float()
                yh = fake_quantize(y, group_size=cfg.group_size, clip_ratio=cfg.k_clip_ratio,
                                   quantizer=cfg.quantizer, scale_dtype=cfg.scale_dtype)
                e = torch.einsum("the,hde->thd", yh - y, r).double()
                o = out[name]
                o["key_mse"] += float(e.pow(2).sum())
                # sum_{t,s} (q_t . e_s)^2 = sum_t q_t^T (sum_s e_s e_s^T) q_t: no [T, T] score tensor
                m = torch.einsum("shd,she->hde", e, e)
                o["score_err"] += float(torch.einsum("tkgd,kde,tkge->", qg, m, qg)) / (t * t * hq)
                o["range_sq"] += float((y.amax(-1) - y.amin(-1)).double().pow(2).mean())
        return None

    run_captured(model, prompts, on_attention)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="local checkpoint directory with heldout.jsonl "
                    "(scripts/train_small_lm.py writes one)")
    ap.add_argument("--stats", required=True, help="calibration statistics of that model: sglang-oscar quality's "
                    "<work-dir>/stats.safetensors (or that directory)")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pairs", default=None, help="comma-separated K:V pairs, e.g. 'had:had,qqt_desc_N:sst_desc_N' "
                    "(default: the built-in list)")
    ap.add_argument("--o-proj", action="store_true", help="also the error after each layer's o_proj")
    ap.add_argument("--k-detail", action="store_true", help="also where each K rotation's error lands "
                    "(key error, score error, row range; relative to Hadamard)")
    ap.add_argument("--ppl", action="store_true", help="also the teacher-forced perplexity of every pair")
    ap.add_argument("--allow-other-model", action="store_true",
                    help="accept statistics recorded for another model of the same geometry")
    args = ap.parse_args(argv)
    pairs = PAIRS if args.pairs is None else [tuple(p.split(":")) for p in args.pairs.split(",")]
    bad = [":".join(p) for p in pairs if len(p) != 2]
    if bad:
        ap.error(f"--pairs entries must be K:V (e.g. had:sst_desc_N), got {bad}")
    for a, b in pairs:
        try:
            parse_kind(a, "k"), parse_kind(split_center(b)[0], "v")
        except ValueError as exc:
            ap.error(f"--pairs: {exc}")
    if args.sink < 0 or args.recent < 0 or args.seq_len < 2 or args.eval_tokens < args.seq_len:
        ap.error("--sink and --recent must be >= 0, --seq-len >= 2 and --eval-tokens >= --seq-len")
    if args.sink + args.recent >= args.seq_len:
        ap.error(f"--sink {args.sink} + --recent {args.recent} cover every key of a --seq-len {args.seq_len} sequence: "
                 "nothing would be quantized; use a longer --seq-len or smaller windows")
    heldout = os.path.join(args.model, "heldout.jsonl")
    if not os.path.isfile(heldout):
        ap.error(f"--model {args.model}: no {heldout}; pass a local checkpoint directory written by "
                 "scripts/train_small_lm.py (it holds heldout.jsonl)")
    stats_path = os.path.join(args.stats, "stats.safetensors") if os.path.isdir(args.stats) else args.stats
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sglang_oscar.calibrate import CalibrationError
    from sglang_oscar.calibrate.model import config_fingerprint, geometry_of

    try:
        stats = CalibrationStats.load(stats_path)
        config = AutoConfig.from_pretrained(args.model)
        stats.check_model(geometry_of(config), what=f"--model {args.model}",
                          fingerprint=config_fingerprint(config, args.model), allow_other_model=args.allow_other_model)
        rots = {f"K:{a} V:{b}": build(stats, a, b) for a, b in pairs}
    except (CalibrationError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(args.model)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    ps = select_prompt_set(tok, heldout, budget=args.eval_tokens, seq_len=args.seq_len, seed=1)[0]
    cfg = OscarConfig(sink_tokens=args.sink, recent_tokens=args.recent)
    rep = functional_error(model, ps, rots, cfg, progress=False, allow_other_model=True)
    print(f"attention error (dB), sink {args.sink} / recent {args.recent}, {len(ps.sequences)} sequences x "
          f"{args.seq_len} tokens; per layer {list(rep['layers'])}")
    for m in rep["methods"]:
        print(f"{m:32s} overall {rep['overall_db'][m]:7.2f} dB  layers "
              + " ".join(f"{rep['layers'][lid][m]:6.1f}" for lid in rep["layers"]))
    if args.o_proj:
        rep_o = o_proj_error(model, ps, rots, cfg)
        print("after o_proj:")
        for m in rots:
            print(f"{m:32s} o_proj  {rep_o['overall_db'][m]:7.2f} dB  layers "
                  + " ".join(f"{rep_o['layers'][lid][m]:6.1f}" for lid in rep_o["layers"]))
    if args.k_detail:
        det = key_error_detail(model, ps, {"hadamard": RotationSet.data_free(stats.geometry, "hadamard"), **rots}, cfg)
        base = det.pop("hadamard")
        print("K error vs Hadamard (dB; all positions quantized): key error / score error (q . e_k)^2 / row range^2")
        for m, v in det.items():
            print(f"{m:32s} k_detail " + " ".join(f"{10 * math.log10(v[x] / base[x]):+6.2f}"
                                                  for x in ("key_mse", "score_err", "range_sq")))
    if args.ppl:
        for name, rs in rots.items():
            r = perplexity(model, ps, rs, cfg, window_mode="decode", progress=False, allow_other_model=True)
            print(f"{name:32s} ppl {r['int2']['ppl']:.4f}  bf16 {r['bf16']['ppl']:.4f}  "
                  f"change {100 * (r['int2']['ppl'] / r['bf16']['ppl'] - 1):+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
