"""Statistics -> rotation file (``sglang-oscar fit``).

Methods (MHA/GQA models, :class:`..rotation.RotationSet`):

* ``oscar``: per layer, ``R_k`` from the head-mean query covariance ``mean_h C_h`` and ``R_v``
  from the head-mean score-weighted value covariance ``mean_h S_h``, composition ``U H P``
  (:func:`..rotation.fit.rotations_from_covariances`); format_version 1.
* ``oscar-perhead``: one ``R_k``/``R_v`` per (layer, kv head) from ``C_h``/``S_h``; format_version 2.
* ``hadamard`` / ``identity``: data-free (:meth:`RotationSet.data_free`).

MLA models (:class:`..rotation.latent.LatentRotationSet`): ``oscar`` = ``U P Hblock`` of the
latent second moment (spec §3.5), ``hadamard`` (block Hadamard), ``identity``.

Fitted methods refuse statistics with fewer than ``min_tokens`` tokens in any layer (spec
lesson 26: a 12-token dump produced a loadable but useless rotation). Every set is validated
against the statistics' geometry before it is written.
"""

from __future__ import annotations

from typing import Any

from ..rotation import RotationSet, rotations_from_covariances
from ..rotation.geometry import ModelGeometry
from ..rotation.latent import DEFAULT_LATENT_BLOCK, LatentRotationSet, latent_rotation_from_covariance
from . import CalibrationError
from .stats import CalibrationStats

FIT_METHODS = ("oscar", "oscar-perhead", "hadamard", "identity")
DEFAULT_MIN_TOKENS = 4096


def _provenance(stats: CalibrationStats) -> dict[str, Any]:
    prompts = stats.meta.get("prompts", {})
    toks = stats.tokens_per_layer(1)
    return {
        "statistics": stats.meta.get("path"),
        "model": stats.meta.get("model", {}).get("id"),
        "prompts_source": prompts.get("source"),
        "prompts_sha256": prompts.get("sha256"),
        "tokens_sha256": prompts.get("tokens_sha256"),
        "seed": prompts.get("seed"),
        "tokens_per_layer_min": min(toks.values()) if toks else 0,
        "tokens_per_layer": {str(k): v for k, v in toks.items()},
        "post_rope": True,
        "accumulator": "float64",
        "all_kv_heads": True,
    }


def check_min_tokens(stats: CalibrationStats, min_tokens: int) -> None:
    """Raise if any layer saw fewer than ``min_tokens`` tokens."""
    toks = stats.tokens_per_layer(1)
    low = {lid: n for lid, n in toks.items() if n < min_tokens}
    if low:
        lid, n = min(low.items(), key=lambda kv: kv[1])
        raise CalibrationError(
            f"statistics {stats.meta.get('path', '')} hold only {n} tokens for layer {lid} "
            f"({len(low)} of {len(toks)} layers below the minimum of {min_tokens}): tiny calibrations produce "
            "loadable but useless rotations (spec lesson 26; covariances converge around 5K tokens per layer). "
            "Calibrate with a larger --tokens budget, or lower --min-tokens explicitly."
        )


def fit_rotations(
    stats: CalibrationStats,
    method: str = "oscar",
    *,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    latent_block: int | None = DEFAULT_LATENT_BLOCK,
    geometry: ModelGeometry | None = None,
) -> RotationSet | LatentRotationSet:
    """Fit a validated rotation set from statistics.

    Args:
        stats: complete statistics (:meth:`CalibrationStats.load`).
        method: one of :data:`FIT_METHODS`.
        min_tokens: minimum tokens per layer for fitted methods.
        latent_block: Hadamard block of latent rotations (the latent quantization group size).
        geometry: the target model's geometry; statistics of another model are refused.

    Raises:
        CalibrationError: unknown method, incomplete/too small/foreign statistics.
        RotationError: the fitted set does not validate.
    """
    if method not in FIT_METHODS:
        raise CalibrationError(f"unknown method {method!r}; choose from {', '.join(FIT_METHODS)}")
    if geometry is not None:
        stats.check_model(geometry)
    geo = stats.geometry
    fitted = method in ("oscar", "oscar-perhead")
    if fitted:
        stats.check_complete()
        check_min_tokens(stats, min_tokens)
    meta_common = {"method": method, "model_type": geo.model_type, "geometry": geo.to_dict(),
                   "calibration": _provenance(stats)}

    if geo.attention_kind == "mla":
        if method == "oscar-perhead":
            raise CalibrationError("oscar-perhead does not apply to MLA latents (one latent per layer); use oscar")
        if not fitted:
            rs = LatentRotationSet.data_free(geo, method, latent_block)
            rs.metadata.update(meta_common)
        else:
            r, eig = {}, {}
            for lid in geo.layer_ids:
                r[lid], eig[lid] = latent_rotation_from_covariance(stats.latent_covariance(lid), latent_block)
            rs = LatentRotationSet(r, {**meta_common, "objective": "latent_cov", "composition": "r_p_hblock",
                                       "hadamard_block": latent_block}, eig)
        rs.validate(geo)
        return rs

    if not fitted:
        rs = RotationSet.data_free(geo, method)
        rs.metadata.update(meta_common)
        rs.validate(geo)
        return rs
    per_head = method == "oscar-perhead"
    k, v, ke, ve = {}, {}, {}, {}
    for lid in geo.layer_ids:
        k[lid], ke[lid] = rotations_from_covariances(stats.query_covariance(lid), per_head)
        v[lid], ve[lid] = rotations_from_covariances(stats.value_covariance(lid), per_head)
    meta = {**meta_common, "objective": "qqt_sst", "composition": "r_h_pbr",
            "source_grouping": "per_kv_head" if per_head else "layer"}
    rs = RotationSet(k, v, meta, {i: t.float() for i, t in ke.items()}, {i: t.float() for i, t in ve.items()})
    rs.validate(geo)
    return rs


def load_rotation_any(path: str) -> RotationSet | LatentRotationSet:
    """Load a K/V rotation set or a latent rotation set, whichever ``path`` holds."""
    from ..rotation.latent import is_latent_rotation_file

    if is_latent_rotation_file(path):
        return LatentRotationSet.load(path)
    return RotationSet.load(path)
