"""The rotation set a server uses, checked against the model before any weights load.

:func:`served_rotation_set` is called twice: by the ``ServerArgs`` hook in the launching process
(so a wrong file stops the launch before weights load, with a message naming the problem) and by
the attention backend in each scheduler process, which then slices it for its tensor-parallel
rank (:func:`rank_rotations`).
"""

from __future__ import annotations

import logging
import math

import torch

from ..config import DEFAULT_V_CLIP, OscarConfig
from ..rotation import RotationSet
from ..rotation.rotation_set import RotationError
from ..rotation.geometry import ModelGeometry, attention_logit_softcap
from ..rotation.latent import LatentRotationSet

logger = logging.getLogger("sglang_oscar")


def model_geometry(hf_config) -> ModelGeometry:
    """:class:`ModelGeometry` of a HF config (object, dict or model directory)."""
    return ModelGeometry.from_hf_config(hf_config)


def _kv_shared_layers(hf_config) -> int:
    """``num_kv_shared_layers`` of a (text) config (Gemma-3n / Gemma-4 small models), 0 if absent."""
    if hf_config is None:
        return 0
    from ..rotation.geometry import _as_dict

    try:
        cfg = _as_dict(hf_config)
    except (TypeError, ValueError, OSError):
        return 0
    cfg = cfg.get("text_config", cfg) or cfg
    return int(cfg.get("num_kv_shared_layers") or 0)


def _log_data_free(log: bool, kind: str) -> None:
    if log:
        logger.info("sglang-oscar: no --oscar-rotation given; using the data-free %s rotation (fit one with "
                    "recipes/<model>/compute_rotation.sh for better accuracy)", kind)


def served_rotation_set(config: OscarConfig, geometry: ModelGeometry, *, log: bool = True,
                        hf_config=None) -> RotationSet:
    """The validated rotation set for ``config`` (file) or the data-free Hadamard set.

    Args:
        hf_config: the model's HF config (object, dict or model directory), if known: a file with key
            means (``k_mean``) is refused for a model that soft-caps its attention logits.

    Raises:
        ValueError: MLA / non-MHA model, group size not dividing a head_dim, missing file,
            malformed file, a file made for another geometry (layer ids, kv heads, head_dim), or key
            centering on a soft-capped model. Every message says what to change.
    """
    if geometry.attention_kind != "mha":
        raise ValueError(
            f"served_rotation_set takes an MHA/GQA geometry; {geometry.model_type!r} uses MLA attention "
            f"(latent c_kv): its rotations come from served_latent_rotations"
        )
    shared = _kv_shared_layers(hf_config)
    if shared:
        raise ValueError(
            f"--kv-cache-dtype int2 does not support KV-shared layers yet ({geometry.model_type!r}: the last {shared} "
            f"layers read another layer's cache, num_kv_shared_layers); use --kv-cache-dtype auto"
        )
    dims = sorted({d for layer in geometry.layers for d in (layer.head_dim_k, layer.head_dim_v)})
    try:
        config.check_head_dims(*dims)
    except ValueError as exc:
        common = math.gcd(*dims)
        raise ValueError(f"--kv-cache-quant-group-size {config.group_size} does not fit this model: {exc}; the "
                         f"model's head_dims are {dims}: pick a common divisor (e.g. {common}) or leave it unset "
                         "for one group per row") from None
    from ..kernels.layout import Int2Layout

    for dk, dv in sorted({(layer.head_dim_k, layer.head_dim_v) for layer in geometry.layers}):
        try:
            Int2Layout.from_config(config, dk, dv)
        except ValueError as exc:
            raise ValueError(f"--kv-cache-dtype int2 cannot serve this model: {exc}; use --kv-cache-dtype auto") from None
    if config.rotation_path is None:
        rs = RotationSet.data_free(geometry)
        _log_data_free(log, "Hadamard")
        return rs
    try:
        rs = RotationSet.from_paths(config.rotation_path, config.rotation_v_path)
    except FileNotFoundError as exc:
        raise ValueError(f"--oscar-rotation (or its environment alias SGLANG_OSCAR_K_ROTATION_PATH): {exc}; pass an "
                         f"existing rotation file or directory, or drop the flag / unset the variable to use the "
                         f"data-free Hadamard rotation") from None
    except RotationError as exc:  # unreadable / truncated / not a rotation file, a directory without one
        from ..rotation.latent import is_latent_rotation_file

        if is_latent_rotation_file(config.rotation_path):
            raise ValueError(f"--oscar-rotation {config.rotation_path} is an MLA latent rotation file, but "
                             f"{geometry.model_type!r} is an MHA/GQA model: pass a K/V rotation file fitted for it "
                             "(`sglang-oscar fit`), or drop the flag to use the data-free Hadamard rotation") from None
        raise ValueError(f"--oscar-rotation {config.rotation_path}: {exc}; pass a rotation file written by "
                         f"`sglang-oscar fit` / `hadamard` / `convert` (check it with `sglang-oscar validate`), "
                         f"or drop the flag to use the data-free Hadamard rotation") from None
    try:
        rs.validate(geometry)
    except ValueError as exc:
        raise ValueError(f"--oscar-rotation {config.rotation_path} does not fit this model: {exc}") from None
    sinks = [layer.layer_id for layer in geometry.layers if layer.has_sinks]
    if sinks and (rs.k_mean or rs.v_mean):
        raise ValueError(f"--oscar-rotation {config.rotation_path} centres the keys/values (k_mean / v_mean) but this "
                         f"model's layers {sinks[:4]}{'...' if len(sinks) > 4 else ''} have attention-sink logits, "
                         "which the centering does not commute with (the sink logit is not shifted, the key "
                         "probabilities sum to less than 1): refit the rotation without --center")
    cap = attention_logit_softcap(hf_config) if (hf_config is not None and rs.k_mean) else None
    if cap:
        raise ValueError(f"--oscar-rotation {config.rotation_path} centres the keys (k_mean) but this model caps its "
                         f"attention logits (attn_logit_softcapping {cap:g}), and the key mean shifts the scores "
                         "before the cap: refit the rotation without --center (or [rotation].center = false)")
    if log:
        logger.info("sglang-oscar: rotation %s (%s, %d layers)", config.rotation_path,
                    "per kv head" if rs.per_head else "per layer", len(rs.layer_ids))
    return rs


# Architectures whose MLA layers SGLang 0.5.16 runs through DeepseekV2AttentionMLA, at most one per
# decoder layer: what the dispatch hook and the latent backend are written and tested for
# (Kimi-Linear's MLA layers are that class, its KDA layers keep SGLang's state pool).
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM", "KimiLinearForCausalLM")


def served_latent_rotations(config: OscarConfig, geometry: ModelGeometry, *, log: bool = True,
                            architectures=None) -> LatentRotationSet:
    """The validated latent rotations of an MLA model (``--oscar-rotation`` file, else the data-free
    block Hadamard, :meth:`LatentRotationSet.data_free`), after the checks of what the latent pool serves.

    Args:
        architectures: the config's ``architectures`` (when known): MLA models outside
            :data:`MLA_ARCHITECTURES` are refused.

    Raises:
        ValueError: an MLA architecture outside :data:`MLA_ARCHITECTURES` (LongCat-Flash, Ring / Ling
            hybrids, Kimi-K2.5's multimodal wrapper, ...), an MHA-only flag (``--oscar-rotation-v``, ``--oscar-skip-layers``,
            ``--oscar-fold-rotations on``, ``--oscar-decode-engine gluon``, ``--oscar-rotate-engine
            torch``, a V clip ratio), a group size that does not fit ``kv_lora_rank``, a missing or
            unreadable file, an MHA rotation file, or a file fitted for another model (layers, rank; a
            hybrid's file must cover its MLA layers only).
            Every message says what to change.
    """
    from ..kernels.latent import check_latent_width
    from ..config import latent_group_size
    from ..rotation.latent import LatentRotationSet

    name = geometry.model_type
    other = [a for a in (architectures or ()) if a not in MLA_ARCHITECTURES]
    if other:
        raise ValueError(f"--kv-cache-dtype int2 serves the MLA latent cache of {', '.join(MLA_ARCHITECTURES)}; "
                         f"{other[0]} ({name!r}) is not among them yet; serve it with --kv-cache-dtype auto")
    for given, flag in ((config.rotation_v_path, "--oscar-rotation-v"), (config.skip_layers not in (None, "none"),
                        "--oscar-skip-layers"), (config.fold_rotations, "--oscar-fold-rotations on"),
                        (config.decode_engine == "gluon", "--oscar-decode-engine gluon"),
                        (config.rotate_engine != "triton", f"--oscar-rotate-engine {config.rotate_engine}"),
                        (config.v_clip_ratio != DEFAULT_V_CLIP, "--oscar-v-clip-ratio")):
        if given:
            raise ValueError(f"{flag} applies to MHA/GQA models; {name!r} caches one MLA latent per token "
                             "(one rotation per layer, one decode kernel, K's clip ratio): drop the flag")
    try:
        check_latent_width(int(geometry.kv_lora_rank), latent_group_size(config, int(geometry.kv_lora_rank)))
    except ValueError as exc:
        raise ValueError(f"--kv-cache-dtype int2 cannot serve {name!r}'s latent cache: {exc}; pick "
                         "--kv-cache-quant-group-size 128 (or 64, 32)") from None
    if config.rotation_path is None:
        rs = LatentRotationSet.data_free(geometry)
        _log_data_free(log, "block-Hadamard latent")
        return rs
    try:
        rs = LatentRotationSet.load(config.rotation_path)
        rs.validate(geometry)
    except FileNotFoundError as exc:
        raise ValueError(f"--oscar-rotation: {exc}; pass an existing latent rotation file, or drop the flag to use "
                         "the data-free block-Hadamard rotation") from None
    except RotationError as exc:
        raise ValueError(f"--oscar-rotation {config.rotation_path} does not fit this MLA model: {exc}; an MLA model "
                         "takes a latent rotation file (`sglang-oscar fit` on its calibration, or `hadamard`)") from None
    if log:
        logger.info("sglang-oscar: latent rotation %s (%d layers, kv_lora_rank %d)", config.rotation_path,
                    len(rs.layer_ids), geometry.kv_lora_rank)
    return rs


def rank_rotations(rs: RotationSet, geometry: ModelGeometry, tp_rank: int, tp_size: int, device,
                   layer_ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per global layer id: fp32 ``(R_k, R_v)`` of shape ``[H_kv_local, D, D]`` on ``device``.

    Per-head sets are sliced with SGLang's kv-head sharding (:meth:`RotationSet.for_tp_rank`);
    per-layer matrices are broadcast to the local heads.
    """
    heads = {layer.layer_id: layer.num_kv_heads for layer in geometry.layers}
    local = rs.for_tp_rank(tp_rank, tp_size, heads)
    out = {}
    for lid in layer_ids:
        h_total = heads[lid]
        h_local = max(1, h_total // tp_size)
        rk = local.matrices(lid, "k", h_local if local.per_head else None)
        rv = local.matrices(lid, "v", h_local if local.per_head else None)
        if rk.dim() == 2:
            rk = rk.unsqueeze(0).expand(h_local, *rk.shape)
            rv = rv.unsqueeze(0).expand(h_local, *rv.shape)
        out[lid] = (rk.to(device=device, dtype=torch.float32).contiguous(),
                    rv.to(device=device, dtype=torch.float32).contiguous())
    return out


def rank_means(rs: RotationSet, geometry: ModelGeometry, tp_rank: int, tp_size: int, device,
               layer_ids) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per global layer id: the centering means ``(mean_k, mean_v)`` of this rank's kv heads, fp32
    ``[H_kv_local, D]`` on ``device``, ``None`` for a side the set does not centre
    (:attr:`RotationSet.k_mean`; sliced like per-head rotations, :meth:`RotationSet.for_tp_rank`).

    Raises:
        RotationError: head counts that do not split over ``tp_size`` (:meth:`RotationSet.for_tp_rank`).
        KeyError: a layer id the set does not cover.
    """
    heads = {layer.layer_id: layer.num_kv_heads for layer in geometry.layers}
    local = rs.for_tp_rank(tp_rank, tp_size, heads)
    out = {}
    for lid in layer_ids:
        pair = []
        for which in ("k", "v"):
            m = local.mean(lid, which)
            pair.append(None if m is None else m.to(device=device, dtype=torch.float32).contiguous())
        out[lid] = (pair[0], pair[1])
    return out
