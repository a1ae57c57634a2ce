"""Accuracy of 2-bit KV caches on a trained LM: OSCAR vs Hadamard vs naive INT2 vs KIVI (``sglang-oscar quality``).

For one checkpoint (``scripts/train_small_lm.py`` writes one with disjoint ``calib.jsonl`` /
``heldout.jsonl``), every cache variant is scored on the same held-out sequences by

* **teacher-forced perplexity** (:func:`.ppl.perplexity`: every attention layer's output is
  replaced by the variant's fake-quantized cache, all layers at once, ``window_mode="decode"``:
  every position is scored as if it were decoded), and
* **attention functional error** (:func:`.error.functional_error`: per layer, the variant's output
  on the model's own captured Q/K/V against exact fp32 attention,
  ``10 log10(sum ||o - o_exact||^2 / sum ||o_exact||^2)`` over all layers, tokens and heads).

Variants (:func:`build_variants`):

* ``bf16``: the model's own attention (perplexity), BF16-rounded cache rows (error floor);
  ``bf16-oracle``: the same cache through the reference oracle (checks the harness);
* ``naive-int2``: per-token symmetric INT2, no rotation, no windows
  (:func:`..quant.baselines.naive_symmetric_int2`);
* ``kivi-g<G>``: KIVI-style per-channel K / per-token V asymmetric 2-bit with its full-precision
  residual (:mod:`..quant.baselines`), one row per key group size;
* ``hadamard[+lm][+win]``: the OSCAR INT2 format (clip, groups, quantizer) with the data-free
  Hadamard rotation, uniform or Lloyd-Max (``+lm``), without / with the BF16 sink + recent windows;
* ``oscar-layer[+lm][+win]`` / ``oscar-head[+lm][+win]``: rotations fitted on the calibration
  documents (:func:`.run.calibrate_model` + :func:`.fit.fit_rotations` ``oscar`` /
  ``oscar-perhead``), uniform or Lloyd-Max (``+lm``), without / with windows;
* ``kvcov-head[+win]``: upstream's per-head recipe (:func:`.fit.fit_rotations` ``perhead-kv``:
  eigenvectors of each kv head's raw K / V second moment in descending order times the Hadamard,
  no permutation), uniform, without / with windows. Descending order puts the dominant direction
  on the Hadamard's all-ones row, so a row's component along it becomes a constant, which the
  per-row zero point absorbs (exactly without clipping; nearly with the symmetric clip, whose
  threshold moves with the offset);
* ``<rotation>+c[+win]`` (``hadamard``, ``oscar-layer``, ``oscar-head``, ``kvcov-head``; uniform):
  the same rotation with key / value centering (:func:`.fit.fit_rotations` ``center=True``: the
  calibration documents' per-kv-head means of the post-RoPE keys and of the values are subtracted
  before the rotation; the key mean only shifts each query's scores by a constant, the value mean
  is added back to the output). The means are per-layer constants: no bits per element.

Sequences (:func:`.quality_data.select_prompt_set`): calibration sequences come from ``calib.jsonl`` (train
split), evaluation sequences from ``heldout.jsonl`` (held-out split), each chosen by
:func:`.prompts.build_per_document_prompt_set`: documents (one per file) in a seeded order, at
most ``max_seq_per_file`` sequences per file, round robin, shorter files packed together. The
report records how many distinct files each set covers. ``max_seq_per_file=0`` selects by
packing instead (all documents packed in a seeded order and the first tokens used), under which a
few long files can supply the whole set.

Every row carries its true bits per KV element at the evaluation length and at 128K tokens
(:func:`..quant.bits.bits_per_element`, :func:`..quant.baselines.kivi_bits_per_element`,
:func:`..quant.baselines.naive_bits_per_element`) and the share of (query, key) reads that went
through INT2 (counted for full causal attention; sliding-window layers are not modelled in that share). Calibration and evaluation must be disjoint: :func:`.quality_data.check_disjoint` refuses any
shared token sequence (by :func:`.prompts.sequence_hash`), any shared document, and documents
whose recorded split is not ``train`` (calibration) / ``heldout`` (evaluation).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Callable

import torch

from ..config import OscarConfig
from ..quant.baselines import (check_kivi_residual, kivi_bits_per_element, kivi_hp_masks, kivi_quantize_keys,
                               kivi_quantize_values, naive_bits_per_element, naive_symmetric_int2)
from ..quant.bits import bits_per_element
from ..reference.attention import attend
from ..rotation import RotationSet
from . import CalibrationError
from .capture import AttentionCall
from .oracle import OutputFn, RotationCache, check_dense, low_reads
from .quality_data import check_disjoint, read_records, select_prompt_set  # noqa: F401  (re-exported)

LONG_CONTEXT = 131072
HP_DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class QualitySettings:
    """Knobs of the quality table.

    Attributes:
        seq_len: tokens per evaluation / calibration sequence.
        sink, recent: BF16 windows of the ``+win`` OSCAR-format variants.
        group_size, k_clip, v_clip, scale_dtype: the OSCAR INT2 format (:class:`..config.OscarConfig`).
        kivi_residual: KIVI's full-precision residual ``R`` (tokens).
        kivi_groups: KIVI key group sizes (tokens), one row each; the value group (along
            head_dim) is ``min(G, head_dim)``.
        min_tokens: minimum calibration tokens per layer for the fitted rotations.
        window_mode: ``"decode"`` only (every position scored as if decoded).
    """

    seq_len: int = 2048
    sink: int = 64
    recent: int = 256
    group_size: int | None = None
    k_clip: float = 0.96
    v_clip: float = 0.92
    scale_dtype: str = "float16"
    kivi_residual: int = 128
    kivi_groups: tuple[int, ...] = (128, 32)
    min_tokens: int = 4096
    window_mode: str = "decode"

    def oscar_config(self, windows: bool, quantizer: str = "uniform") -> OscarConfig:
        """The :class:`OscarConfig` of an OSCAR-format variant (with or without BF16 windows)."""
        return OscarConfig(group_size=self.group_size, k_clip_ratio=self.k_clip, v_clip_ratio=self.v_clip,
                           sink_tokens=self.sink if windows else 0, recent_tokens=self.recent if windows else 0,
                           quantizer=quantizer, scale_dtype=self.scale_dtype)


@dataclasses.dataclass
class Variant:
    """One row of the table.

    Attributes:
        name: row name (``bf16``, ``naive-int2``, ``kivi-g128``, ``oscar-head+lm+win``, ...).
        rotation, quantizer, windows: what the row is (for the table).
        output: the fake-quant attention output (:data:`.oracle.OutputFn`); ``None`` for ``bf16``
            (perplexity of the model's own attention).
        ppl_rotation, ppl_config: what :func:`.ppl.perplexity` gets (a rotation set for
            OSCAR-format rows, which then go through the oracle unchanged; ``None`` with ``output``).
        bits: ``context_len -> bits per KV element``.
        int2_reads: ``T -> (query, key) pairs of a length-T sequence whose key is read from INT2``.
    """

    name: str
    rotation: str
    quantizer: str
    windows: str
    output: OutputFn | None
    ppl_rotation: RotationSet | None
    ppl_config: OscarConfig
    bits: Callable[[int], float]
    int2_reads: Callable[[int], int]


# ----------------------------------------------------------------------------- output functions
def _hp_rows(x: torch.Tensor) -> torch.Tensor:
    """Cache rows as the BF16 tier stores them (fp32 values of the HP-dtype rounding)."""
    return x.to(HP_DTYPE).float()


def naive_output(call: AttentionCall, b: int) -> torch.Tensor:
    """Attention output ``[T, H_q, D_v]`` (fp32, decode mode) of batch row ``b`` over a naive INT2
    cache: every key and value row (BF16-rounded) per-token symmetric INT2, no rotation, no windows.

    Raises:
        CalibrationError: sparse attention that drops keys.
    """
    check_dense(call)
    q, k, v = call.rows(b)
    kh, vh = _hp_rows(k), _hp_rows(v)
    pos = torch.arange(q.shape[0], device=q.device)
    return attend(q.float(), pos, kh, vh, naive_symmetric_int2(kh), naive_symmetric_int2(vh), sink=0, recent=0,
                  sm_scale=call.scaling, sliding_window=call.sliding_window, logit_cap=call.softcap, window_mode="decode")


def kivi_output(residual: int, key_group: int, value_group: int | None = None, scale_dtype: str = "float16") -> OutputFn:
    """Output function of a KIVI-style cache (decode mode: the query at ``i`` reads the cache of
    ``i + 1`` tokens, :func:`..quant.baselines.kivi_hp_masks`).

    Args:
        residual: full-precision residual ``R`` (a multiple of ``key_group``).
        key_group: tokens per per-channel key group.
        value_group: elements per per-token value group (``None``: ``min(key_group, D_v)``).
        scale_dtype: storage dtype of KIVI's (scale, min) pairs.

    Returns:
        ``fn(call, b) -> fp32 [T, H_q, D_v]``.

    Raises:
        ValueError: residual not a multiple of ``key_group``.
    """
    check_kivi_residual(residual, key_group)

    def fn(call: AttentionCall, b: int) -> torch.Tensor:
        check_dense(call)
        q, k, v = call.rows(b)
        kh, vh = _hp_rows(k), _hp_rows(v)
        gv = value_group or min(key_group, vh.shape[-1])
        pos = torch.arange(q.shape[0], device=q.device)
        return attend(q.float(), pos, kh, vh, kivi_quantize_keys(kh, key_group, scale_dtype),
                      kivi_quantize_values(vh, gv, scale_dtype), sink=0, recent=0, sm_scale=call.scaling,
                      sliding_window=call.sliding_window, logit_cap=call.softcap,
                      hp_masks=lambda p, t: kivi_hp_masks(p, t, residual))

    fn.__name__ = f"kivi_g{key_group}_r{residual}"
    return fn


def oscar_output(rotation: RotationSet, config: OscarConfig, window_mode: str = "decode", quantize: bool = True) -> OutputFn:
    """Output function of the OSCAR INT2 cache with ``rotation`` and ``config`` (the oracle,
    :meth:`.oracle.RotationCache.mha`); ``quantize=False`` reads every row from the BF16 tier."""
    cache = RotationCache(rotation)

    def fn(call: AttentionCall, b: int) -> torch.Tensor:
        return cache.mha(call, b, config, window_mode, quantize=quantize)

    return fn


# ----------------------------------------------------------------------------- read counts
def _visible_pairs(t: int) -> int:
    return t * (t + 1) // 2


def _window_reads(config: OscarConfig) -> Callable[[int], int]:
    return lambda t: low_reads(t, config, "decode", None)


def kivi_int2_key_reads(t: int, residual: int) -> int:
    """(query, key) pairs of a length-``t`` sequence whose key a KIVI cache reads from INT2 in
    decode mode: ``sum_{i < t} floor((i + 1) / R) * R``."""
    if residual <= 0:
        return _visible_pairs(t)
    return sum(((i + 1) // residual) * residual for i in range(t))


# ----------------------------------------------------------------------------- variants
def _mean_over_layers(geometry, per_dim: Callable[[int], float]) -> float:
    vals = [0.5 * (per_dim(lg.head_dim_k) + per_dim(lg.head_dim_v)) for lg in geometry.layers]
    return sum(vals) / len(vals)


def build_variants(geometry, rotations: dict[str, RotationSet], settings: QualitySettings) -> list[Variant]:
    """The rows of the table (module docstring) for a model of ``geometry``.

    Args:
        geometry: the model's :class:`..rotation.geometry.ModelGeometry` (MHA/GQA).
        rotations: fitted sets ``{"oscar": per-layer set, "oscar-perhead": per-head set,
            "perhead-kv": per-head K/V-covariance set}`` and their centred versions under the same
            names + ``"+c"`` (``"hadamard+c"`` too); any may be missing (its rows are then left out).
        settings: :class:`QualitySettings`.

    Raises:
        CalibrationError: an MLA model, or a window mode other than decode.
        ValueError: bad KIVI residual/group sizes.
    """
    if geometry.attention_kind != "mha":
        raise CalibrationError(f"the quality table covers MHA/GQA models; {geometry.model_type} uses MLA attention")
    if settings.window_mode != "decode":
        raise CalibrationError("the quality table scores window_mode 'decode' only")
    s = settings
    identity = RotationSet.data_free(geometry, "identity")
    hadamard = RotationSet.data_free(geometry, "hadamard")
    no_win = s.oscar_config(windows=False)
    all_reads = _visible_pairs
    rows = [
        Variant("bf16", "none", "-", "all BF16", None, None, no_win, lambda L: 16.0, lambda t: 0),
        Variant("bf16-oracle", "none", "-", "all BF16 (oracle)", oscar_output(identity, no_win, quantize=False), None,
                no_win, lambda L: 16.0, lambda t: 0),
        Variant("naive-int2", "none", "symmetric per token", "none", naive_output, None, no_win,
                lambda L: _mean_over_layers(geometry, naive_bits_per_element), all_reads),
    ]
    r = s.kivi_residual
    for g in s.kivi_groups:
        def kbits(L, g=g):
            return _mean_over_layers(geometry, lambda d: kivi_bits_per_element(
                L, d, residual=r, key_group=g, value_group=min(g, d)))
        rows.append(Variant(f"kivi-g{g}", "none", f"KIVI K/channel (G={g} tokens), V/token", f"residual {r}",
                            kivi_output(r, g, None, s.scale_dtype), None, OscarConfig(sink_tokens=0, recent_tokens=r),
                            kbits, lambda t: kivi_int2_key_reads(t, r)))

    def fmt_bits(windows: bool):
        sink, recent = (s.sink, s.recent) if windows else (0, 0)
        return lambda L: _mean_over_layers(geometry, lambda d: bits_per_element(
            d, s.group_size, s.scale_dtype, context_len=L, sink=sink, recent=recent))

    def fmt_rows(prefix: str, label: str, rs: RotationSet, quantizers: tuple[str, ...]):
        for qz in quantizers:
            for win in (False, True):
                cfg = s.oscar_config(win, qz)
                name = prefix + ("+lm" if qz == "lloyd-max" else "") + ("+win" if win else "")
                rows.append(Variant(name, label, qz, f"sink {s.sink} + recent {s.recent}" if win else "none",
                                    oscar_output(rs, cfg), rs, cfg, fmt_bits(win),
                                    _window_reads(cfg) if win else all_reads))

    fmt_rows("hadamard", "Hadamard (data-free)", hadamard, ("uniform", "lloyd-max"))
    if "oscar" in rotations:
        fmt_rows("oscar-layer", "OSCAR per layer", rotations["oscar"], ("uniform", "lloyd-max"))
    if "oscar-perhead" in rotations:
        fmt_rows("oscar-head", "OSCAR per kv head", rotations["oscar-perhead"], ("uniform", "lloyd-max"))
    if "perhead-kv" in rotations:
        fmt_rows("kvcov-head", "K/V covariance per kv head (upstream per-head recipe)", rotations["perhead-kv"],
                 ("uniform",))
    for prefix, key, label in CENTRED_ROWS:
        if key in rotations:
            fmt_rows(prefix, label, rotations[key], ("uniform",))
    return rows


#: centred rows of the table: (row prefix, rotation name in ``build_variants``' ``rotations``, label)
CENTRED_ROWS = (("hadamard+c", "hadamard+c", "Hadamard + calibrated K/V means"),
                ("oscar-layer+c", "oscar+c", "OSCAR per layer + K/V means"),
                ("oscar-head+c", "oscar-perhead+c", "OSCAR per kv head + K/V means"),
                ("kvcov-head+c", "perhead-kv+c", "K/V covariance per kv head, centred, + K/V means"))


# ----------------------------------------------------------------------------- the table
def quality_report(
    model,
    calib,
    heldout,
    settings: QualitySettings = QualitySettings(),
    *,
    work_dir: str,
    calib_records: list[dict] | None = None,
    heldout_records: list[dict] | None = None,
    progress: bool | None = None,
    variants: list[str] | None = None,
) -> dict[str, Any]:
    """Calibrate and fit OSCAR rotations on ``calib``, then score every variant on ``heldout``.

    Args:
        model: a loaded MHA/GQA causal LM (eval mode).
        calib, heldout: :class:`.prompts.PromptSet` (disjoint, :func:`check_disjoint`).
        settings: :class:`QualitySettings`.
        work_dir: folder for ``stats.safetensors`` and the fitted ``rot_<method>[_centred].safetensors``
            (centred sets are not fitted for models with soft-capped attention logits or attention sinks).
        calib_records, heldout_records: the documents behind the prompt sets (split checks).
        progress: tqdm bars (``None``: on a terminal).
        variants: row names to keep (default all).

    Returns:
        ``{"rows": [...], "error": functional_error report, "bf16_ppl", "disjoint", "settings", ...}``;
        each row: ``name, rotation, quantizer, windows, bits_eval, bits_128k, error_db, ppl, nll,
        ppl_rel_change, int2_read_fraction``.

    Raises:
        CalibrationError: overlapping data, an MLA model, too little calibration data, nothing quantized.
    """
    from .error import functional_error
    from .fit import fit_rotations
    from .model import geometry_of
    from .ppl import perplexity
    from .run import calibrate_model

    disjoint = check_disjoint(calib, heldout, calib_records, heldout_records)
    geometry = geometry_of(model.config)
    if geometry.attention_kind != "mha":
        raise CalibrationError(f"the quality table covers MHA/GQA models; {geometry.model_type} uses MLA attention")
    os.makedirs(work_dir, exist_ok=True)
    stats = calibrate_model(model, calib, os.path.join(work_dir, "stats.safetensors"), restart=True, progress=progress)
    rotations = {}
    for method in ("oscar", "oscar-perhead", "perhead-kv"):
        rs = fit_rotations(stats, method, min_tokens=settings.min_tokens)
        rs.save(os.path.join(work_dir, f"rot_{method}.safetensors"))
        rotations[method] = rs
    from ..backend.rotations import centering_conflict

    # soft-capped logits or attention sinks: fit_rotations refuses centring, so no centred rows
    why = centering_conflict(geometry, model.config)
    if why:
        _log(f"quality: {why}: centred rows left out")
    for method in () if why else ("hadamard", "oscar", "oscar-perhead", "perhead-kv"):
        rs = fit_rotations(stats, method, min_tokens=settings.min_tokens, center=True)
        rs.save(os.path.join(work_dir, f"rot_{method}_centred.safetensors"))
        rotations[f"{method}+c"] = rs
    rows = build_variants(geometry, rotations, settings)
    if variants is not None:
        unknown = sorted(set(variants) - {v.name for v in rows})
        if unknown:
            raise CalibrationError(f"unknown variants {unknown}; choose from {[v.name for v in rows]}")
        rows = [v for v in rows if v.name in variants or v.name in ("bf16", "bf16-oracle")]
    files = heldout.meta.get("files")
    _log(f"quality: {len(rows)} variants, {len(heldout.sequences)} held-out sequences ({heldout.num_tokens} tokens"
         + (f", {files} files)" if files is not None else ")"))
    err = functional_error(model, heldout, {}, settings.oscar_config(True), window_mode="decode", include_baselines=False,
                           outputs={v.name: (v.output or oscar_output(RotationSet.data_free(geometry, "identity"),
                                                                      settings.oscar_config(False), quantize=False))
                                    for v in rows}, progress=progress)
    lengths = [len(s) for s in heldout.sequences if len(s) >= 2]
    eval_len = max(lengths)
    out_rows, bf16_ppls = [], []
    for v in rows:
        if v.name == "bf16":
            continue
        rep = perplexity(model, heldout, v.ppl_rotation, v.ppl_config, window_mode="decode", progress=progress,
                         output_fn=None if v.ppl_rotation is not None else v.output, output_name=v.name)
        bf16_ppls.append(rep["bf16"]["ppl"])
        out_rows.append(_row(v, err, eval_len, lengths, rep["int2"]["nll"], rep["int2"]["ppl"], rep["bf16"]["ppl"]))
        _log(f"quality: {v.name:>20}  err {out_rows[-1]['error_db']:8.2f} dB  ppl {rep['int2']['ppl']:.4f}")
    bf16_ppl = bf16_ppls[0]
    bf16_nll = math.log(bf16_ppl)
    bf16 = next(v for v in rows if v.name == "bf16")
    out_rows.insert(0, _row(bf16, err, eval_len, lengths, bf16_nll, bf16_ppl, bf16_ppl))
    return {
        "model_type": geometry.model_type,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "settings": {**dataclasses.asdict(settings), "kivi_groups": list(settings.kivi_groups)},
        "eval_len": eval_len,
        "tokens_scored": sum(t - 1 for t in lengths),
        "sequences": len(lengths),
        "bf16_ppl": bf16_ppl,
        "bf16_ppl_spread": max(bf16_ppls) - min(bf16_ppls),
        "rows": out_rows,
        "error": {k: err[k] for k in ("overall_db", "layers", "tokens", "sequences")},
        "disjoint": disjoint,
        "heldout_files": heldout.meta.get("files"),
        "calib_files": calib.meta.get("files"),
        "calibration": {"prompts": {k: v for k, v in calib.meta.items() if k != "sequence_sha256"},
                        "tokens_per_layer_min": min(stats.tokens_per_layer(1).values())},
        "heldout": {k: v for k, v in heldout.meta.items() if k != "sequence_sha256"},
        "rotations": {m: os.path.join(work_dir, f"rot_{m}.safetensors") for m in rotations},
        "spectrum": {str(lid): row for lid, row in stats.spectrum().items()},
        "head_dim": max(lg.head_dim_k for lg in geometry.layers),
        "head_dim_v": max(lg.head_dim_v for lg in geometry.layers),
    }


def _row(v: Variant, err: dict, eval_len: int, lengths: list[int], nll: float, ppl: float, bf16_ppl: float) -> dict:
    total = sum(_visible_pairs(t) for t in lengths)
    return {
        "name": v.name,
        "rotation": v.rotation,
        "quantizer": v.quantizer,
        "windows": v.windows,
        "bits_eval": v.bits(eval_len),
        "bits_128k": v.bits(LONG_CONTEXT),
        "error_db": err["overall_db"][v.name],
        "nll": nll,
        "ppl": ppl,
        "ppl_rel_change": ppl / bf16_ppl - 1.0,
        "int2_read_fraction": sum(v.int2_reads(t) for t in lengths) / max(total, 1),
    }


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def format_markdown(rep: dict[str, Any]) -> str:
    """The report as a markdown table (one row per variant) with a short header."""
    s = rep["settings"]
    hf, cf = rep.get("heldout_files"), rep.get("calib_files")
    held_from = f" from {hf} held-out files" if hf is not None else " (packed held-out documents)"
    calib_from = f" from {cf} train files" if cf is not None else ""
    lines = [
        f"Held-out teacher-forced perplexity and attention error, {rep['model_type']} ({rep['dtype']}), "
        f"{rep['sequences']} sequences x {rep['eval_len']} tokens ({rep['tokens_scored']} scored){held_from}, "
        f"window_mode decode; "
        f"OSCAR format: group {s['group_size'] or 'head_dim'}, clip K {s['k_clip']} / V {s['v_clip']}, "
        f"{s['scale_dtype']} scale/zero; calibration {rep['calibration']['prompts']['tokens']} tokens{calib_from} "
        f"(disjoint from evaluation: {rep['disjoint']['shared_sequences']} shared sequences).",
        "",
        f"| variant | rotation | quantizer | BF16 windows | bits/elem @{rep['eval_len']} | bits/elem @128K | "
        "INT2 reads | attn err (dB) | ppl | Δppl |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rep["rows"]:
        lines.append(
            f"| {r['name']} | {r['rotation']} | {r['quantizer']} | {r['windows']} | {r['bits_eval']:.3f} | "
            f"{r['bits_128k']:.3f} | {100 * r['int2_read_fraction']:.1f}% | {r['error_db']:.2f} | {r['ppl']:.4f} | "
            f"{100 * r['ppl_rel_change']:+.2f}% |"
        )
    spec = rep.get("spectrum")
    if spec:
        lines += [
            "",
            f"Spectral concentration of the calibration statistics per layer (mean over kv heads; top-1 = "
            f"largest eigenvalue / trace, eff. dim = trace^2 / sum of squared eigenvalues, out of head_dim "
            f"{rep.get('head_dim', '?')} for Q and K, {rep.get('head_dim_v', rep.get('head_dim', '?'))} for V; "
            f"Q = the query covariance OSCAR's K rotation is fitted on):",
            "",
            "| layer | Q top-1 | Q eff. dim | K top-1 | K eff. dim | V top-1 | V eff. dim |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for lid in sorted(spec, key=int):
            r = spec[lid]
            lines.append(f"| {lid} | {r['q_top1']:.3f} | {r['q_eff_dim']:.1f} | {r['k_top1']:.3f} | {r['k_eff_dim']:.1f} | "
                         f"{r['v_top1']:.3f} | {r['v_eff_dim']:.1f} |")
    return "\n".join(lines) + "\n"


def run_quality(
    model_path: str,
    *,
    out_dir: str,
    calib_path: str | None = None,
    heldout_path: str | None = None,
    work_dir: str | None = None,
    settings: QualitySettings = QualitySettings(),
    calib_tokens: int = 32768,
    eval_tokens: int = 32768,
    dtype: str = "auto",
    device: str | None = None,
    progress: bool | None = None,
    variants: list[str] | None = None,
    max_seq_per_file: int = 1,
) -> dict[str, Any]:
    """Load a checkpoint and its ``calib.jsonl`` / ``heldout.jsonl``, build the table, write
    ``quality.json`` and ``quality.md`` to ``out_dir``.

    Args:
        model_path: checkpoint directory (model + tokenizer).
        calib_path, heldout_path: JSONL documents (default: ``calib.jsonl`` / ``heldout.jsonl`` in
            ``model_path``); cut into ``settings.seq_len``-token sequences (seed 0 / 1) by
            :func:`select_prompt_set`.
        work_dir: statistics and fitted rotations (default ``out_dir``).
        calib_tokens, eval_tokens: token budgets.
        max_seq_per_file: at most this many sequences per file for both sets (``0``: the earlier
            packed selection; :func:`select_prompt_set`).
        dtype, device: as :func:`.model.load_model` (``auto``: bf16 on a GPU, fp32 on a CPU).

    Returns:
        The report (:func:`quality_report`) with ``model`` and ``outputs`` added.

    Raises:
        CalibrationError, FileNotFoundError: missing checkpoint directory, missing/overlapping data,
            unsupported model.
    """
    from .model import check_model_path, load_model

    needs_dir = not (calib_path and heldout_path)  # the default calib.jsonl / heldout.jsonl live in the checkpoint
    if needs_dir and not os.path.exists(os.path.expanduser(model_path)):
        raise FileNotFoundError(
            f"model directory {model_path} does not exist (pass a local checkpoint directory holding the model, its "
            "tokenizer and calib.jsonl / heldout.jsonl, as scripts/train_small_lm.py writes, or --calib and --heldout)")
    # ~ expanded; an existing path is local, so a file is refused here (NotADirectoryError)
    model_path = check_model_path(model_path)
    calib_path = calib_path or os.path.join(model_path, "calib.jsonl")
    heldout_path = heldout_path or os.path.join(model_path, "heldout.jsonl")
    for p in (calib_path, heldout_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} does not exist (scripts/train_small_lm.py writes calib.jsonl and heldout.jsonl)")
    model, tok = load_model(model_path, dtype=dtype, device=device)
    sets, recs = {}, {}
    for key, path, budget, seed in (("calib", calib_path, calib_tokens, 0), ("heldout", heldout_path, eval_tokens, 1)):
        sets[key], recs[key] = select_prompt_set(tok, path, budget=budget, seq_len=settings.seq_len, seed=seed,
                                                 max_seq_per_file=max_seq_per_file)
    rep = quality_report(model, sets["calib"], sets["heldout"], settings, work_dir=work_dir or out_dir,
                         calib_records=recs["calib"], heldout_records=recs["heldout"], progress=progress,
                         variants=variants)
    rep["model"] = model_path
    os.makedirs(out_dir, exist_ok=True)
    rep["outputs"] = {"json": os.path.join(out_dir, "quality.json"), "markdown": os.path.join(out_dir, "quality.md")}
    with open(rep["outputs"]["json"], "w") as f:
        json.dump(rep, f, indent=2, sort_keys=True, default=str)
    with open(rep["outputs"]["markdown"], "w") as f:
        f.write(format_markdown(rep))
    return rep
