"""Functional error report (``sglang-oscar error``): does a calibration work?

On held-out prompts the model runs unchanged (BF16/fp32 attention); at every attention layer
the captured post-RoPE Q/K/V are also sent through the reference oracle with each candidate
rotation, and the attention output is compared with exact fp32 attention:

``err_db(layer, method) = 10 log10( sum ||o_INT2 - o||^2 / sum ||o||^2 )`` over the layer's
tokens and heads (the terms of :func:`..reference.relative_error_db`), and ``overall`` the same
ratio summed over all layers. Lower is better; a fitted rotation should beat Hadamard, which
should beat ``naive`` (identity rotation, same INT2 format and windows). ``bf16`` is the floor
(rotated BF16 cache, nothing quantized), which is also every method's figure (output functions
included) at the layers that ``skip_layers`` keeps in SGLang's BF16 cache.

MLA models: the latent ``c_kv`` is quantized through each latent rotation (``naive`` identity,
``hadamard`` block Hadamard, fitted ``U P Hblock``), see :mod:`.oracle`.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from ..config import OscarConfig
from ..reference.attention import WINDOW_MODES
from ..rotation import RotationSet
from ..rotation.latent import LatentRotationSet
from . import CalibrationError
from .fit import check_rotation
from .model import config_fingerprint, geometry_of, input_device
from .oracle import (OutputFn, RotationCache, check_window_mode, energies, low_reads, mha_output, mla_output,
                     oracle_capture, settings, skipped_layers)
from .prompts import PromptSet


def _db(num: float, den: float) -> float:
    """``10 log10(num / den)`` (error energy over signal energy, floored at -300 dB); NaN if ``den <= 0``."""
    if den <= 0:
        return float("nan")
    return 10.0 * math.log10(max(num / den, 1e-30))


def functional_error(
    model,
    prompts: PromptSet,
    rotations: dict[str, RotationSet | LatentRotationSet],
    config: OscarConfig,
    *,
    window_mode: str = "decode",
    include_baselines: bool = True,
    progress: bool | None = None,
    allow_other_model: bool = False,
    outputs: dict[str, OutputFn] | None = None,
) -> dict[str, Any]:
    """Per-layer and overall attention-output error (dB) of INT2 with each rotation.

    Args:
        model: loaded causal LM.
        prompts: held-out sequences.
        rotations: ``{name: rotation set}`` (fitted sets; validated against the model here).
        config: windows and quantizer settings (as served).
        window_mode: ``"decode"`` (every position as if decoded) or ``"extend"``.
        include_baselines: add ``naive`` (identity), ``hadamard`` and the ``bf16`` floor.
        allow_other_model: accept fitted rotations whose recorded model fingerprint differs from
            ``model``'s (same geometry; :func:`.fit.check_rotation`).
        outputs: further methods given as output functions ``{name: fn(call, b)}``
            (:data:`.oracle.OutputFn`, MHA/GQA models only), compared like the rotations; e.g.
            caches that are not the OSCAR format or rotations with their own settings. ``config``'s
            windows still decide the "nothing quantized" check and the reported INT2 read share.

    Returns:
        ``{"methods", "overall_db", "layers": {layer: {method: dB}}, "tokens", "quantized_reads", ...}``.

    Raises:
        CalibrationError: rotations for another model, nothing quantized (all keys in windows),
        sparse attention that drops keys (:func:`.oracle.check_dense`), ``outputs`` on an MLA model
        or with a name that is already a method.
    """
    from tqdm.auto import tqdm

    check_window_mode(window_mode)
    geometry = geometry_of(model.config)
    fingerprint = config_fingerprint(model.config)
    mla = geometry.attention_kind == "mla"
    outputs = dict(outputs or {})
    if outputs and mla:
        raise CalibrationError("output functions apply to MHA/GQA models only")
    sets: dict[str, Any] = {}
    floor_name = "bf16" if include_baselines and not mla else None  # the BF16-cache floor method
    if include_baselines:
        if mla:
            sets["naive"] = LatentRotationSet.served_data_free(geometry, "identity")
            sets["hadamard"] = LatentRotationSet.served_data_free(geometry, "hadamard")
        else:
            sets["naive"] = RotationSet.data_free(geometry, "identity")
            sets["hadamard"] = RotationSet.data_free(geometry, "hadamard")
    for name, rs in rotations.items():
        if name == floor_name:
            raise CalibrationError(f"rotation name {name!r} is already a method of this report; name it otherwise")
        check_rotation(rs, geometry, fingerprint, allow_other_model=allow_other_model, name=name)
        sets[name] = rs
    caches = {name: RotationCache(rs) for name, rs in sets.items()}
    skip = skipped_layers(config, geometry, model)
    floor = None if mla else caches.get("naive") or RotationCache(RotationSet.data_free(geometry, "identity"))
    methods = ([floor_name] if floor_name else []) + list(sets)
    clash = sorted(set(outputs) & set(methods))
    if clash:
        raise CalibrationError(f"output function names {clash} are already methods of this report")
    methods += list(outputs)
    num = {lid: dict.fromkeys(methods, 0.0) for lid in geometry.layer_ids}
    den = dict.fromkeys(geometry.layer_ids, 0.0)
    reads = {"low": 0, "total": 0}
    latents: dict[int, torch.Tensor] = {}

    def on_attention(call):
        lid = call.layer_id
        if lid not in num:
            raise CalibrationError(f"layer {lid} is not an attention layer of the geometry")
        b_size, _, t, _ = call.query.shape
        for b in range(b_size):
            if mla:
                c = latents[lid][b]
                exact = mla_output(call, b, None, None, config, window_mode)
            else:
                exact = mha_output(call, b, None, None, config, window_mode)
            den[lid] += float(exact.double().pow(2).sum())
            for name in methods:
                if name == floor_name or lid in skip:
                    # a skipped layer keeps SGLang's BF16 cache whatever the method: the BF16 floor
                    out = floor.mha(call, b, config, window_mode, quantize=False)
                elif name in outputs:
                    out = outputs[name](call, b)
                elif mla:
                    out = mla_output(call, b, c, caches[name].get(lid, "latent", exact.device), config, window_mode)
                else:
                    out = caches[name].mha(call, b, config, window_mode)
                num[lid][name] += energies(out, exact)[0]
            reads["low"] += 0 if lid in skip else low_reads(t, config, window_mode, call.sliding_window)
            reads["total"] += low_reads(t, OscarConfig(sink_tokens=0, recent_tokens=0), "extend", call.sliding_window)
        return None

    def on_latent(lid, _m, c):
        latents[lid] = c

    device = input_device(model)
    bar = tqdm(total=len(prompts.sequences), desc="error", unit="seq",
               disable=(not sys.stderr.isatty()) if progress is None else not progress)
    with oracle_capture(model, mla, on_attention, on_latent):
        for seq in prompts.sequences:
            model(input_ids=torch.tensor([seq], device=device), use_cache=False)
            bar.update(1)
    bar.close()
    if reads["low"] == 0:
        raise CalibrationError(
            f"nothing was quantized: every key of the {prompts.num_tokens} held-out tokens fell inside the BF16 windows "
            f"(sink {config.sink_tokens}, recent {config.recent_tokens}, window_mode {window_mode}); use longer "
            "sequences or smaller windows"
        )
    layers = {lid: {m: _db(num[lid][m], den[lid]) for m in methods} for lid in geometry.layer_ids}
    overall = {m: _db(sum(num[lid][m] for lid in num), sum(den.values())) for m in methods}
    return {
        "model_type": geometry.model_type,
        "attention": geometry.attention_kind,
        "methods": methods,
        "overall_db": overall,
        "layers": {str(k): v for k, v in layers.items()},
        "window_mode": window_mode,
        "settings": settings(config),
        "tokens": prompts.num_tokens,
        "sequences": len(prompts.sequences),
        "quantized_read_fraction": reads["low"] / max(reads["total"], 1),
        "skipped_layers": sorted(skip),
        "prompts": prompts.meta,
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report as a table: one row per layer and ``overall``, one column per method (dB)."""
    methods = rep["methods"]
    lines = [
        f"attention-output error vs exact attention, dB (lower is better); {rep['tokens']} held-out tokens, "
        f"window_mode {rep['window_mode']}, {100 * rep['quantized_read_fraction']:.1f}% of key reads in INT2",
        f"{'layer':>8} " + " ".join(f"{m:>12}" for m in methods),
    ]
    skipped = {str(i) for i in rep.get("skipped_layers", ())}
    for lid, row in rep["layers"].items():
        lines.append(f"{lid:>8} " + " ".join(f"{row[m]:>12.2f}" for m in methods) + ("  (BF16: skip_layers)" if lid in skipped else ""))
    lines.append(f"{'overall':>8} " + " ".join(f"{rep['overall_db'][m]:>12.2f}" for m in methods))
    return "\n".join(lines)


__all__ = ["functional_error", "format_report", "WINDOW_MODES"]
