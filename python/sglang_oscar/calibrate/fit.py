"""Statistics -> rotation file (``sglang-oscar fit``).

Methods (MHA/GQA models, :class:`..rotation.RotationSet`):

* ``oscar``: per layer, ``R_k`` from the head-mean query covariance ``mean_h C_h`` and ``R_v``
  from the head-mean score-weighted value covariance ``mean_h S_h``, composition ``U H P``
  (:func:`..rotation.fit.rotations_from_covariances`); format_version 1.
* ``oscar-perhead``: one ``R_k``/``R_v`` per (layer, kv head) from ``C_h``/``S_h`` (query-aware,
  ``U H P``); format_version 2. This project's per-head method: the OSCAR objectives of
  ``oscar`` applied per kv head (what upstream's later "OSCAR-2" fitter does for K, spec §3.4 [L]).
* ``perhead-kv``: upstream's PR-era per-head method (spec §3.4, ``fit_perhead_rotation.py``,
  objective ``cov_eig_hadamard_perhead``): per (layer, kv head) the raw second moments
  ``K_h^T K_h / T`` and ``V_h^T V_h / T`` (``k_sum``/``v_sum``), eigenvectors sorted by
  **descending** eigenvalue times the normalised Hadamard, no permutation: ``R = U_desc H``;
  format_version 2.
* ``hadamard`` / ``identity``: data-free (:meth:`RotationSet.data_free`).

``center=True`` (MHA/GQA, any method; needs pass-1 statistics with first moments) adds the
per-kv-head means of the post-RoPE keys and of the values (``RotationSet.k_mean`` / ``v_mean``):
the cache stores ``(x - mean) R``, which removes each row's static offset from the range the INT2
step has to cover. ``perhead-kv`` then diagonalises the centred second moments
``K_h^T K_h / T - mu mu^T``; ``oscar``'s objectives are unchanged (the query covariance does not
depend on the keys' mean; the score-weighted value moment stays uncentred).

MLA models (:class:`..rotation.latent.LatentRotationSet`): ``oscar`` = ``U P Hblock`` of the
latent second moment (spec §3.5), ``hadamard`` (block Hadamard), ``identity``.

Fitted methods refuse statistics with fewer than ``min_tokens`` tokens in any layer (spec
lesson 26: a 12-token dump produced a loadable but useless rotation). Every set is validated
against the statistics' geometry before it is written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..rotation import RotationSet, rotations_from_covariances
from ..rotation.geometry import ModelGeometry
from ..rotation.hadamard import default_hadamard
from ..rotation.latent import (DEFAULT_LATENT_BLOCK, LatentRotationSet, check_served_rank, covariance_eigenbasis,
                               latent_hadamard, latent_rotation_from_covariance)
from ..rotation.rotation_set import RotationError
from . import FIT_METHODS, CalibrationError
from .stats import CalibrationStats

FITTED_METHODS = ("oscar", "oscar-perhead", "perhead-kv")
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
        "sequence_sha256": prompts.get("sequence_sha256"),
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
    fingerprint: dict[str, Any] | None = None,
    allow_other_model: bool = False,
    center: bool = False,
) -> RotationSet | LatentRotationSet:
    """Fit a validated rotation set from statistics.

    Args:
        stats: complete statistics (:meth:`CalibrationStats.load`).
        method: one of :data:`FIT_METHODS`.
        min_tokens: minimum tokens per layer for fitted methods.
        latent_block: Hadamard block of latent rotations (the latent quantization group size;
            a power of two dividing ``kv_lora_rank``, ``None`` = full Hadamard).
        geometry: the target model's geometry; statistics of another geometry are refused.
        fingerprint: the target model's :func:`.model.config_fingerprint`; statistics of another
            model (same geometry) are refused unless ``allow_other_model``.
        center: add the key / value centering means (module docstring).

    The rotation's metadata records ``model_fingerprint``: ``fingerprint`` if given, else the
    statistics' (``error``/``ppl``/``validate-rotation`` compare it with the model they use).

    Raises:
        CalibrationError: unknown method, incomplete/too small/foreign statistics, invalid latent block,
            ``center`` for an MLA model, for a model with an attention-logit soft cap, or with statistics
            that have no first moments.
        RotationError: the fitted set does not validate.
    """
    if method not in FIT_METHODS:
        raise CalibrationError(f"unknown method {method!r}; choose from {', '.join(FIT_METHODS)}")
    fitted = method in FITTED_METHODS
    if center and stats.geometry.attention_kind == "mla":
        raise CalibrationError("--center applies to MHA/GQA K/V rotations; MLA latents are not centred")
    if center:
        from ..backend.rotations import centering_conflict

        why = centering_conflict(stats.geometry, stats.meta.get("model", {}).get("config") or {})
        if why:
            raise CalibrationError(f"--center: {why}, so a centred rotation would change the model's attention (the "
                                   "server refuses such a file): fit without --center")
    if geometry is not None:
        stats.check_model(geometry, fingerprint=fingerprint, allow_other_model=allow_other_model)
    geo = stats.geometry
    if fitted or center:
        stats.check_complete()
        check_min_tokens(stats, min_tokens)
    means = {lid: stats.means(lid) for lid in geo.layer_ids} if center else {}
    k_mean = {lid: m[0].float() for lid, m in means.items()}
    v_mean = {lid: m[1].float() for lid, m in means.items()}
    # layers whose cached V is their cached K read V from K's codes: V takes K's mean (and below K's rotation)
    shared = [layer.layer_id for layer in geo.layers if layer.k_eq_v]
    for lid in shared:
        if lid in k_mean:
            v_mean[lid] = k_mean[lid]
    meta_common = {"method": method, "model_type": geo.model_type, "geometry": geo.to_dict(),
                   "model_fingerprint": fingerprint or stats.fingerprint}
    if fitted or center:
        meta_common["calibration"] = _provenance(stats)
    if center:
        meta_common["centered"] = True

    if geo.attention_kind == "mla":
        if method in ("oscar-perhead", "perhead-kv"):
            raise CalibrationError(f"{method} does not apply to MLA latents (one latent per layer); use oscar")
        check_served_latent_rank(geo)
        try:
            latent_hadamard(int(geo.kv_lora_rank), latent_block)
        except ValueError as exc:
            raise CalibrationError(f"--latent-block: {exc}") from None
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
        if center:  # replace() re-runs the checks of __post_init__ on the means
            rs = dataclasses.replace(rs, k_mean=k_mean, v_mean=v_mean)
        rs.validate(geo)
        return rs
    k, v, ke, ve = {}, {}, {}, {}
    if method == "perhead-kv":
        for lid in geo.layer_ids:
            n = stats.tokens_per_layer(1)[lid]
            kc, vc = stats.sums["k_sum"][lid] / n, stats.sums["v_sum"][lid] / n
            if center:
                mk, mv = means[lid]
                kc = kc - mk[:, :, None] * mk[:, None, :]
                vc = vc - mv[:, :, None] * mv[:, None, :]
            k[lid], ke[lid] = perhead_kv_rotations(kc)
            v[lid], ve[lid] = perhead_kv_rotations(vc)
        meta = {**meta_common, "objective": "cov_eig_hadamard_perhead", "composition": "u_desc_h",
                "source_grouping": "per_kv_head"}
    else:
        per_head = method == "oscar-perhead"
        for lid in geo.layer_ids:
            k[lid], ke[lid] = rotations_from_covariances(stats.query_covariance(lid), per_head)
            v[lid], ve[lid] = rotations_from_covariances(stats.value_covariance(lid), per_head)
        meta = {**meta_common, "objective": "qqt_sst", "composition": "r_h_pbr",
                "source_grouping": "per_kv_head" if per_head else "layer"}
    for lid in shared:
        v[lid], ve[lid] = k[lid], ke[lid]
    rs = RotationSet(k, v, meta, {i: t.float() for i, t in ke.items()}, {i: t.float() for i, t in ve.items()},
                     k_mean=k_mean, v_mean=v_mean)
    rs.validate(geo)
    return rs


def perhead_kv_rotations(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's PR-era per-head rotations (method ``perhead-kv``, spec §3.4).

    Args:
        cov: float64 ``[H_kv, D, D]`` raw K (or V) second moments of one layer.

    Returns:
        ``(R, eigvals)``: float64 ``[H_kv, D, D]`` with ``R[h] = U_desc[h] H`` (eigenvectors of
        ``cov[h]`` in descending eigenvalue order, times the normalised Hadamard of size ``D``,
        block Hadamard for non-power-of-two ``D``; no permutation) and ``[H_kv, D]`` eigenvalues
        in descending order.
    """
    rs, eigs = [], []
    for c in cov:
        u, lam = covariance_eigenbasis(c)
        rs.append(u.flip(-1) @ default_hadamard(u.shape[0], device=u.device))
        eigs.append(lam.flip(-1))
    return torch.stack(rs), torch.stack(eigs)


def load_rotation_any(path: str) -> RotationSet | LatentRotationSet:
    """Load a K/V rotation set or a latent rotation set, whichever ``path`` holds."""
    from ..rotation.latent import is_latent_rotation_file

    if is_latent_rotation_file(path):
        return LatentRotationSet.load(path)
    return RotationSet.load(path)


def check_served_latent_rank(geometry: ModelGeometry) -> None:
    """Raise :class:`CalibrationError` for an MLA ``geometry`` whose ``kv_lora_rank`` no INT2 latent
    cache serves: a latent rotation (or its statistics) for it would never be used."""
    try:
        check_served_rank(int(geometry.kv_lora_rank), geometry.model_type)
    except RotationError as exc:
        raise CalibrationError(f"{exc} (no latent rotation for it is served)") from None


def check_rotation(rs: RotationSet | LatentRotationSet, geometry: ModelGeometry, fingerprint: dict[str, Any] | None = None,
                   *, allow_other_model: bool = False, name: str | None = None, ortho_tol: float | None = None,
                   hf_config=None) -> None:
    """Check that a rotation set belongs to a model: its kind (latent for MLA, K/V otherwise),
    geometry (:meth:`validate`), key/value means the server would refuse for it
    (:func:`~sglang_oscar.backend.rotations.check_centering`; soft caps read from ``hf_config``) and,
    for fitted rotations, the model fingerprint it records (``model_fingerprint``) against
    ``fingerprint``. Data-free rotations (hadamard, identity) depend on the geometry only, so their
    fingerprint is not compared.

    Raises:
        CalibrationError: wrong kind, geometry, centering, or (unless ``allow_other_model``) another model.
    """
    from .model import check_same_model

    what = f"rotation {name!r} ({rs.source})" if name else f"rotation {rs.source}"
    latent = isinstance(rs, LatentRotationSet)
    if (geometry.attention_kind == "mla") != latent:
        raise CalibrationError(
            f"{what} is a {'latent' if latent else 'K/V'} rotation set but the model ({geometry.model_type}) uses "
            f"{geometry.attention_kind.upper()} attention"
            + (": MLA models get latent rotations (`sglang-oscar fit` writes them for MLA statistics)" if not latent else "")
        )
    if latent:
        check_served_latent_rank(geometry)
    try:
        rs.validate(geometry, **({"ortho_tol": ortho_tol} if ortho_tol is not None else {}))
    except ValueError as exc:
        raise CalibrationError(f"{what} does not fit this model: {exc}") from None
    if not latent:
        from ..backend.rotations import check_centering

        try:
            check_centering(rs, geometry, hf_config)
        except ValueError as exc:
            raise CalibrationError(f"{what} {exc}") from None
    if rs.metadata.get("method") not in ("hadamard", "identity") or getattr(rs, "centered", False):
        # fitted sets, and data-free rotations with calibrated means, belong to one model
        check_same_model(rs.metadata.get("model_fingerprint"), fingerprint, what,
                         f"the model ({(fingerprint or {}).get('name') or geometry.model_type})", allow_other_model)
