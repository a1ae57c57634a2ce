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


def two_kv_pools(hf_config) -> bool:
    """Whether SGLang serves the model with its hybrid sliding-window pools (``is_hybrid_swa_model``:
    Gemma-4, GPT-OSS, ...: a sliding and a full pool), the only models where one layer kind can stay
    BF16 (``--oscar-skip-layers``); ``False`` for an unknown config."""
    if hf_config is None:
        return False
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import is_hybrid_swa_model

    from ..rotation.geometry import _as_dict

    cfg = _as_dict(hf_config)
    return bool(is_hybrid_swa_model(cfg.get("architectures") or [], SimpleNamespace(**(cfg.get("text_config") or cfg))))


def _kv_shared_layers(hf_config) -> int:
    """``num_kv_shared_layers`` of a (text) config (Gemma-3n / Gemma-4 small models), 0 if absent or
    ``hf_config`` is ``None``; an unreadable config raises (the caller read its geometry from it)."""
    if hf_config is None:
        return 0
    from ..rotation.geometry import _as_dict

    cfg = _as_dict(hf_config)
    cfg = cfg.get("text_config", cfg) or cfg
    return int(cfg.get("num_kv_shared_layers") or 0)


def _kv_shared_refusal(geometry: ModelGeometry, hf_config) -> str | None:
    """The launch refusal of a model with KV-shared layers (read from ``hf_config``), or ``None``."""
    shared = _kv_shared_layers(hf_config)
    if not shared:
        return None
    return (f"--kv-cache-dtype int2 does not support KV-shared layers yet ({geometry.model_type!r}: the last {shared} "
            "layers read another layer's cache, num_kv_shared_layers); use --kv-cache-dtype auto")


def _layout_problem(config: OscarConfig, layers) -> str | None:
    """Why the INT2 kernels cannot take one of ``layers``' (head_dim K, head_dim V) pairs under ``config``
    (:meth:`Int2Layout.from_config`), or ``None``."""
    from ..kernels.layout import Int2Layout

    for dk, dv in sorted({(layer.head_dim_k, layer.head_dim_v) for layer in layers}):
        try:
            Int2Layout.from_config(config, dk, dv)
        except ValueError as exc:
            return str(exc)
    return None


#: keys of a fitted file's ``model_fingerprint`` that make another network than the one served (refused; read
#: from ``text_config`` when not at the top, so a multimodal wrapper and its text model agree); a differing
#: ``model_type`` (wrapper vs text model), vocabulary (an extended-vocabulary fine-tune) or name is logged
NETWORK_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size")


def check_recorded_model(rs, hf_config, path: str) -> None:
    """Refuse a fitted rotation file (``sglang-oscar fit`` records its model as ``model_fingerprint``,
    :func:`sglang_oscar.calibrate.model.config_fingerprint`) whose recorded network differs from the
    served one in :data:`NETWORK_KEYS`: a file of another model with the same attention geometry
    (Qwen3-4B's on Qwen3-8B: 36 layers x 8 kv heads x 128 both) would pass every shape check and serve
    another model's statistics. Data-free files without means, files without a fingerprint and an
    unknown ``hf_config`` (object, dict or model directory) pass; a vocabulary or name difference is
    logged.

    Raises:
        ValueError: naming the differing keys and the fix.
    """
    have = rs.metadata.get("model_fingerprint")
    fitted = rs.metadata.get("method") not in ("hadamard", "identity") or getattr(rs, "centered", False)
    if not have or not fitted or hf_config is None:
        return
    from ..calibrate.model import config_fingerprint, fingerprint_mismatches
    from ..rotation.geometry import _as_dict

    want = config_fingerprint(_as_dict(hf_config))
    bad = fingerprint_mismatches({k: v for k, v in have.items() if k in NETWORK_KEYS}, want)
    if bad:
        raise ValueError(f"--oscar-rotation {path} was fitted for another model ({'; '.join(bad)}; recorded vs "
                         "served) with the same attention geometry: its rotations come from that model's "
                         "statistics. Fit one for this model (recipes/<model>/compute_rotation.sh), or drop the "
                         "flag to use the data-free Hadamard rotation")
    other = fingerprint_mismatches(have, want)
    if other:
        logger.warning("sglang-oscar: --oscar-rotation %s records another model type, name or vocabulary (%s; "
                       "recorded vs served): serving it, the network's sizes match", path, "; ".join(other))


def _log_data_free(log: bool, kind: str) -> None:
    if log:
        logger.info("sglang-oscar: no --oscar-rotation given; using the data-free %s rotation (fit one with "
                    "recipes/<model>/compute_rotation.sh for better accuracy)", kind)


def int2_layers(config: OscarConfig, geometry: ModelGeometry) -> list:
    """The attention layers cached in INT2: all but those ``--oscar-skip-layers`` keeps in SGLang's
    BF16 pool (only these have an INT2 layout, so only they constrain the group size and kernels)."""
    from ..config import resolve_skip_layers

    skip = resolve_skip_layers(config.skip_layers, geometry)
    return [layer for layer in geometry.layers if layer.layer_id not in skip]


def centering_conflict(geometry: ModelGeometry, hf_config=None, *, keys: bool = True) -> str | None:
    """Why centred K/V rotations cannot serve this model, or ``None``: attention-sink logits (the
    sink logit is not shifted with the keys, so the key probabilities would not sum as the model's),
    or with ``keys`` an attention-logit soft cap (the key mean shifts every score before the cap).
    ``hf_config``: the model's config (object, dict or directory), needed for the soft cap."""
    sinks = [layer.layer_id for layer in geometry.layers if layer.has_sinks]
    if sinks:
        return (f"this model's layers {sinks[:4]}{'...' if len(sinks) > 4 else ''} have attention-sink logits, "
                "which the centering does not commute with (the sink logit is not shifted, the key "
                "probabilities sum to less than 1)")
    cap = attention_logit_softcap(hf_config) if (keys and hf_config is not None) else None
    if cap:
        return (f"this model caps its attention logits (attn_logit_softcapping {cap:g}), and the key mean shifts "
                "the scores before the cap")
    return None


def check_centering(rs: RotationSet, geometry: ModelGeometry, hf_config=None) -> None:
    """Raise ``ValueError`` ("centres ... but <reason>: refit ...") for a file with key/value means
    (``--center``) that :func:`centering_conflict` rules out for this model."""
    if not (rs.k_mean or rs.v_mean):
        return
    why = centering_conflict(geometry, hf_config, keys=bool(rs.k_mean))
    if why:
        what = {(True, True): "the keys/values (k_mean / v_mean)", (True, False): "the keys (k_mean)",
                (False, True): "the values (v_mean)"}[bool(rs.k_mean), bool(rs.v_mean)]
        raise ValueError(f"centres {what} but {why}: refit the rotation without --center (or "
                         "[rotation].center = false)")


def served_rotation_set(config: OscarConfig, geometry: ModelGeometry, *, log: bool = True,
                        hf_config=None) -> RotationSet:
    """The validated rotation set for ``config`` (file) or the data-free Hadamard set.

    Args:
        hf_config: the model's HF config (object, dict or model directory), if known: KV-shared layers,
            and key means on a model that soft-caps its attention logits, are read from it.

    Raises:
        ValueError: MLA / non-MHA model, KV-shared layers, a group size not dividing the head_dim of an
            INT2 layer (:func:`int2_layers`), missing file, malformed file, a file made for another
            geometry (layer ids, kv heads, head_dim; layers kept BF16 by ``--oscar-skip-layers`` need no
            entry), or means the model rules out (:func:`check_centering`: attention sinks, soft caps).
            Every message says what to change.
    """
    if geometry.attention_kind != "mha":
        raise ValueError(
            f"served_rotation_set takes an MHA/GQA geometry; {geometry.model_type!r} uses MLA attention "
            f"(latent c_kv): its rotations come from served_latent_rotations"
        )
    shared = _kv_shared_refusal(geometry, hf_config)
    if shared:
        raise ValueError(shared)
    from ..config import resolve_skip_layers

    skip = resolve_skip_layers(config.skip_layers, geometry)  # BF16 layers need no entry (docs/format.md)
    quantized = int2_layers(config, geometry)
    dims = sorted({d for layer in quantized for d in (layer.head_dim_k, layer.head_dim_v)})
    try:
        config.check_head_dims(*dims)
    except ValueError as exc:
        common = math.gcd(*dims)
        which = " (INT2 layers)" if skip else ""
        raise ValueError(f"--kv-cache-quant-group-size {config.group_size} does not fit this model: {exc}; the "
                         f"model's head_dims{which} are {dims}: pick a common divisor (e.g. {common}) or leave it "
                         "unset for one group per row") from None
    problem = _layout_problem(config, quantized)
    if problem:
        raise ValueError(f"--kv-cache-dtype int2 cannot serve this model: {problem}; use --kv-cache-dtype auto")
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
        rs.validate(geometry, skip_layers=skip, skip_hint=two_kv_pools(hf_config))
    except ValueError as exc:
        raise ValueError(f"--oscar-rotation {config.rotation_path} does not fit this model: {exc}") from None
    check_recorded_model(rs, hf_config, config.rotation_path)
    try:
        check_centering(rs, geometry, hf_config)
    except ValueError as exc:
        raise ValueError(f"--oscar-rotation {config.rotation_path} {exc}") from None
    if log:
        logger.info("sglang-oscar: rotation %s (%s, %d layers)", config.rotation_path,
                    "per kv head" if rs.per_head else "per layer", len(rs.layer_ids))
    return rs


# Architectures whose MLA layers SGLang 0.5.16 runs through DeepseekV2AttentionMLA, at most one per
# decoder layer: what the dispatch hook and the latent backend are written and tested for
# (Kimi-Linear's MLA layers are that class, its KDA layers keep SGLang's state pool).
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM", "KimiLinearForCausalLM")


def unserved_reason(geometry: ModelGeometry, architectures=None, hf_config=None) -> str | None:
    """Why ``--kv-cache-dtype int2`` would refuse this model whatever the rotation file, or ``None``:
    an MLA architecture outside :data:`MLA_ARCHITECTURES`, or (MHA/GQA) KV-shared layers (read from
    ``hf_config``, when given) or a head_dim the INT2 kernels do not take. For the validate verbs,
    whose "ok" is about the file."""
    if geometry.attention_kind == "mla":
        try:
            check_latent_model(geometry, architectures)
        except ValueError as exc:
            return str(exc)
        return None
    shared = _kv_shared_refusal(geometry, hf_config)
    if shared:
        return shared
    problem = _layout_problem(OscarConfig(), geometry.layers)
    if problem:
        return f"--kv-cache-dtype int2 cannot serve {geometry.model_type!r}: {problem}; serve it with --kv-cache-dtype auto"
    return None


def check_latent_model(geometry: ModelGeometry, architectures=None) -> None:
    """Raise ``ValueError`` when the config's ``architectures`` name an MLA model outside
    :data:`MLA_ARCHITECTURES` (whose latent cache the INT2 pool does not serve), naming the fix."""
    other = [a for a in (architectures or ()) if a not in MLA_ARCHITECTURES]
    if other:
        raise ValueError(f"--kv-cache-dtype int2 serves the MLA latent cache of {', '.join(MLA_ARCHITECTURES)}; "
                         f"{other[0]} ({geometry.model_type!r}) is not among them yet; serve it with "
                         "--kv-cache-dtype auto")


def served_latent_rotations(config: OscarConfig, geometry: ModelGeometry, *, log: bool = True,
                            architectures=None, hf_config=None) -> LatentRotationSet:
    """The validated latent rotations of an MLA model (``--oscar-rotation`` file, else the data-free
    block Hadamard, :meth:`LatentRotationSet.data_free`), after the checks of what the latent pool serves.

    Args:
        architectures: the config's ``architectures`` (when known): MLA models outside
            :data:`MLA_ARCHITECTURES` are refused.
        hf_config: the model's HF config (object, dict or model directory), if known: a file fitted for
            another network is refused (:func:`check_recorded_model`).

    Raises:
        ValueError: an MLA architecture outside :data:`MLA_ARCHITECTURES` (LongCat-Flash, Ring / Ling
            hybrids, Kimi-K2.5's multimodal wrapper, ...), an MHA-only setting (``SGLANG_OSCAR_V_ROTATION_PATH``, ``--oscar-skip-layers``,
            ``--oscar-fold-rotations on``, ``--oscar-decode-engine gluon``, ``--oscar-rotate-engine
            torch``, a V clip ratio), a ``kv_lora_rank`` the kernels do not take or a group size that does
            not divide it, a missing or
            unreadable file, an MHA rotation file, or a file fitted for another model (layers, rank; a
            hybrid's file must cover its MLA layers only).
            Every message says what to change.
    """
    from ..config import latent_group_size
    from ..rotation.latent import LatentRotationSet, check_served_rank

    name = geometry.model_type
    check_latent_model(geometry, architectures)
    for given, flag in ((config.rotation_v_path, "SGLANG_OSCAR_V_ROTATION_PATH"),
                        (config.skip_layers not in (None, "none"), "--oscar-skip-layers"),
                        (config.fold_rotations, "--oscar-fold-rotations on"),
                        (config.decode_engine == "gluon", "--oscar-decode-engine gluon"),
                        (config.rotate_engine != "triton", f"--oscar-rotate-engine {config.rotate_engine}"),
                        (config.v_clip_ratio != DEFAULT_V_CLIP, "--oscar-v-clip-ratio")):
        if given:
            raise ValueError(f"{flag} applies to MHA/GQA models; {name!r} caches one MLA latent per token "
                             "(one rotation per layer, one decode kernel, K's clip ratio): drop the "
                             + ("variable" if flag.startswith("SGLANG_") else "flag"))
    rank = int(geometry.kv_lora_rank)
    try:
        check_served_rank(rank, name)
    except RotationError as exc:
        try:  # DeepSeek-V2/V3 can still cache per-head K/V in INT2
            check_expanded_model(geometry, architectures)
            alt = " (or --oscar-mla-storage expanded: per-head K/V in the INT2 MHA pool)"
        except ValueError:
            alt = ""
        raise ValueError(f"--kv-cache-dtype int2 cannot serve the latent cache: {exc}{alt}") from None
    try:
        latent_group_size(config, rank)
    except ValueError as exc:
        raise ValueError(f"--kv-cache-dtype int2 cannot serve {name!r}'s latent cache "
                         f"(--kv-cache-quant-group-size): {exc}") from None
    if config.rotation_path is None:
        rs = LatentRotationSet.served_data_free(geometry)
        _log_data_free(log, "block-Hadamard latent")
        return rs
    try:
        rs = LatentRotationSet.load(config.rotation_path)
        rs.validate(geometry)
    except FileNotFoundError as exc:
        raise ValueError(f"--oscar-rotation: {exc}; pass an existing latent rotation file, or drop the flag to use "
                         "the data-free block-Hadamard rotation") from None
    except RotationError as exc:
        if _fits_expanded(config.rotation_path, geometry):
            try:
                check_expanded_model(geometry, architectures)
                fix = "pass --oscar-mla-storage expanded, or a latent rotation file"
            except ValueError:  # a model the expanded storage does not serve: only the latent file helps
                fix = ("this model is served with the latent only: pass a latent rotation file (`sglang-oscar fit`, or "
                       "`hadamard --mla-storage latent`), or drop the flag")
            raise ValueError(f"--oscar-rotation {config.rotation_path} holds per-head K/V rotations of this model's "
                             "expanded MLA storage, but the server caches the latent (--oscar-mla-storage latent, the "
                             f"default): {fix}") from None
        raise ValueError(f"--oscar-rotation {config.rotation_path} does not fit this MLA model: {exc}; an MLA model "
                         "takes a latent rotation file (`sglang-oscar fit` on its calibration, or `hadamard`)") from None
    check_recorded_model(rs, hf_config, config.rotation_path)
    if log:
        logger.info("sglang-oscar: latent rotation %s (%d layers, kv_lora_rank %d)", config.rotation_path,
                    len(rs.layer_ids), geometry.kv_lora_rank)
    return rs


def _fits_expanded(path: str, geometry: ModelGeometry) -> bool:
    """Whether ``path`` is a K/V rotation file that fits ``geometry``'s expanded-MHA storage."""
    try:
        RotationSet.from_paths(path).validate(geometry.expanded())
    except (RotationError, ValueError, OSError):
        return False
    return True


# What --oscar-mla-storage expanded serves: SGLang's DeepseekV2AttentionMLA layers whose non-absorbed
# forward (forward_normal_prepare / _core) computes per-head K/V from kv_b_proj. Not DSA models (their
# indexer runs only under SGLang's dsa backend over a latent pool) nor Kimi-Linear (its MLA layers live
# in SGLang's hybrid linear-attention pool, which the expanded pool is not wired into).
EXPANDED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class LatentOnlyError(ValueError):
    """An MLA model that only the latent storage serves (Kimi-Linear, DSA): the fix is the latent storage."""


def check_expanded_model(geometry: ModelGeometry, architectures=None) -> None:
    """Raise ``ValueError`` unless ``--oscar-mla-storage expanded`` serves the model of ``geometry``
    (an MLA model of :data:`EXPANDED_ARCHITECTURES`, neither a linear-attention hybrid nor DSA),
    naming the fix; :class:`LatentOnlyError` when the latent storage serves the model instead.
    ``architectures``: the config's, when known."""
    name, flag = geometry.model_type, "--oscar-mla-storage expanded"
    if geometry.attention_kind != "mla":
        raise ValueError(f"{flag} applies to MLA models (DeepSeek-V2/V3); {name!r} is an MHA/GQA model, whose INT2 "
                         "cache holds per-head K/V rows already: drop the flag")
    archs = list(architectures or ())
    unserved = [a for a in archs if a not in EXPANDED_ARCHITECTURES and a not in MLA_ARCHITECTURES]
    if unserved:  # first: the latent storage, which the branches below advise, refuses it too
        raise ValueError(f"{flag} serves {', '.join(EXPANDED_ARCHITECTURES)}; {unserved[0]} ({name!r}) is not among "
                         "them, nor among the latent storage's: serve it with --kv-cache-dtype auto")
    if "KimiLinearForCausalLM" in archs or geometry.linear_layer_ids:
        raise LatentOnlyError(f"{flag} does not serve Kimi-Linear ({name!r}): its MLA layers share SGLang's "
                              "hybrid linear-attention pool with the KDA state, which only the latent pool joins; "
                              "use --oscar-mla-storage latent (the default)")
    if geometry.index_topk is not None or "GlmMoeDsaForCausalLM" in archs:
        raise LatentOnlyError(f"{flag} does not serve DSA sparse attention ({name!r}, index_topk "
                              f"{geometry.index_topk}: GLM-5): its indexer runs only under SGLang's dsa backend over "
                              "the latent; use --oscar-mla-storage latent (the default)")


def served_expanded_rotations(config: OscarConfig, geometry: ModelGeometry, *, log: bool = True,
                              architectures=None, hf_config=None) -> RotationSet:
    """The validated K/V rotations of an MLA model served with ``--oscar-mla-storage expanded`` (a file
    of :meth:`ModelGeometry.expanded`'s geometry, else its data-free Hadamard set), after the checks of
    what the expanded pool serves.

    Expanded storage caches per head ``K = [k_nope | k_pe]`` (``qk_nope_head_dim + qk_rope_head_dim``,
    DeepSeek-V3: 192) and ``V`` (``v_head_dim``, 128) in the INT2 MHA pool: one "kv head" per query
    head, rotated like an MHA layer's (``R_k [D_k, D_k]``, ``R_v [D_v, D_v]`` per layer or per head).

    Args:
        config: the server's :class:`~sglang_oscar.config.OscarConfig` (``mla_storage`` is not read:
            callers call this for expanded storage only).
        geometry: the model's geometry as :func:`model_geometry` reads it (the MLA one).
        architectures: the config's ``architectures`` when known.
        hf_config: the HF config (object, dict or directory), for :func:`served_rotation_set`'s checks.

    Returns:
        A :class:`RotationSet` over ``geometry.expanded()``'s layers.

    Raises:
        ValueError: a model that is not MLA, an architecture outside :data:`EXPANDED_ARCHITECTURES`
            (Kimi-Linear and DSA models named, with the fix), a config without the per-head sizes,
            ``--oscar-skip-layers``, ``--oscar-fold-rotations on``, ``--oscar-decode-engine gluon``, a
            group size that does not divide both head dims, an MLA latent rotation file, or a file that
            does not fit the expanded geometry (:func:`served_rotation_set`). Every message names the
            flag and the fix.
    """
    flag = "--oscar-mla-storage expanded"
    check_expanded_model(geometry, architectures)
    try:
        expanded = geometry.expanded()
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}; use --oscar-mla-storage latent (the default)") from None
    for given, what in ((config.skip_layers not in (None, "none"), "--oscar-skip-layers"),
                        (config.fold_rotations, "--oscar-fold-rotations on"),
                        (config.decode_engine == "gluon", "--oscar-decode-engine gluon")):
        if given:
            why = {"--oscar-skip-layers": "SGLang keeps every MLA layer in one pool, so none can stay BF16",
                   "--oscar-fold-rotations on": "the value rotation is not folded into kv_b_proj / o_proj",
                   "--oscar-decode-engine gluon": "the Gluon kernel takes head_dim 128, not K "
                                                  f"{expanded.layers[0].head_dim_k}"}[what]
            raise ValueError(f"{what} does not apply with {flag} ({why}): drop the flag")
    dk, dv = expanded.layers[0].head_dim_k, expanded.layers[0].head_dim_v
    g = config.group_size
    if g is not None and (dk % g or dv % g):
        raise ValueError(f"--kv-cache-quant-group-size {g} does not fit {flag}: groups must divide both the K rows "
                         f"({dk} = qk_nope_head_dim + qk_rope_head_dim) and the V rows ({dv}); pass "
                         f"--kv-cache-quant-group-size {math.gcd(dk, dv)} (or a divisor of it), or leave it unset "
                         "for one group per row")
    from ..rotation.latent import is_latent_rotation_file

    if config.rotation_path is not None and is_latent_rotation_file(config.rotation_path):
        raise ValueError(f"--oscar-rotation {config.rotation_path} is an MLA latent rotation file, but {flag} caches "
                         f"per-head K ({dk}) / V ({dv}) rows: pass a K/V file of the expanded geometry (`sglang-oscar "
                         "hadamard --config CONFIG.json --mla-storage expanded --out FILE.safetensors`), or drop "
                         f"{flag} to serve the latent cache with this file")
    try:
        rs = served_rotation_set(config, expanded, log=False, hf_config=hf_config)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc} (expanded storage takes per-head K [{dk}] / V [{dv}] rotations: "
                         "`sglang-oscar hadamard --config CONFIG.json --mla-storage expanded --out FILE.safetensors`)"
                         ) from None
    if log:
        if config.rotation_path is None:
            _log_data_free(True, "Hadamard (expanded MLA K/V)")
        else:
            logger.info("sglang-oscar: rotation %s for expanded MLA storage (%s, %d layers, K %d / V %d)",
                        config.rotation_path, "per head" if rs.per_head else "per layer", len(rs.layer_ids), dk, dv)
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
