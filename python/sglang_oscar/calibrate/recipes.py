"""Recipes (``recipes/<model>/recipe.toml``) as seen by calibration.

The recipe schema and its strict loader live in :mod:`sglang_oscar.evals.recipe` (one loader);
this module derives what calibration needs from a loaded recipe:

* :func:`oscar_config`: the served quantizer settings as an :class:`OscarConfig`;
* :func:`default_paths`: where ``calibrate`` / ``fit`` read and write for a recipe
  (``<folder>/calib/stats.safetensors``, its ``stats.config.json``, the rotation file at
  ``[rotation].path`` or ``<folder>/rotation.safetensors``, and for data-free methods the
  config copy next to it);
* :func:`geometry_mismatches` / :func:`check_geometry`: a recipe's ``[geometry]`` against a
  model's :class:`ModelGeometry` and config (every key the recipe gives is compared);
* :func:`rotation_kind`, :func:`is_data_free`, :func:`trust_remote_code`: derived facts;
* :func:`step_command`: the exact ``sglang-oscar`` argv of a step (``sglang-oscar recipe-cmd``,
  used by ``compute_rotation.sh``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from . import CalibrationError

if TYPE_CHECKING:  # torch-free at import time: recipe-cmd runs in shell wrappers
    from ..config import OscarConfig
    from ..rotation.geometry import ModelGeometry

STEPS = ("calibrate", "fit", "validate", "error", "ppl")
DATA_FREE = ("hadamard", "identity")


def load(path: str | os.PathLike):
    """Load a recipe with the project's strict loader (``evals.recipe.load_recipe``)."""
    from ..evals.recipe import load_recipe

    return load_recipe(path)


def oscar_config(recipe) -> OscarConfig:
    """The recipe's ``[quant]`` section as the served :class:`OscarConfig` (group size, clip
    ratios, windows, quantizer, scale dtype, skipped layers)."""
    from ..config import OscarConfig

    q = recipe.quant
    kw: dict[str, Any] = dict(group_size=q.group_size, k_clip_ratio=q.k_clip_ratio, v_clip_ratio=q.v_clip_ratio,
                              sink_tokens=q.sink_tokens, recent_tokens=q.recent_tokens)
    if q.quantizer:
        kw["quantizer"] = q.quantizer
    if q.scale_dtype:
        kw["scale_dtype"] = q.scale_dtype
    if q.skip_layers != "none":
        kw["skip_layers"] = q.skip_layers
    return OscarConfig(**kw)


def is_data_free(recipe) -> bool:
    """True for rotation methods that need no calibration data (``hadamard``, ``identity``)."""
    return recipe.rotation.method in DATA_FREE


def rotation_kind(recipe) -> str:
    """``"latent"`` for MLA recipes (``[geometry].kv_lora_rank``: ``fit`` writes a latent rotation
    file), else ``"kv"`` (per-layer or per-head K/V rotations)."""
    return "latent" if recipe.geometry.kv_lora_rank is not None else "kv"


def trust_remote_code(recipe) -> bool:
    """True when the recipe's server flags include ``--trust-remote-code``: the checkpoint's code is
    not in transformers, so calibration and config reads need it too."""
    return "--trust-remote-code" in recipe.serve.extra_args


def default_paths(recipe, out_dir: str | None = None) -> dict[str, str]:
    """Where the steps of ``recipe`` read and write.

    Args:
        out_dir: folder replacing the recipe's own folder (``compute_rotation.sh --out-dir``).

    Returns:
        ``{"stats": <base>/calib/stats.safetensors, "config": the model config that ``validate``
        reads, "rotation": [rotation].path (relative to the recipe folder) or
        <base>/rotation.safetensors}``. ``config`` is ``calib/stats.config.json`` (written by
        ``calibrate``), or for data-free methods the copy ``<rotation stem>.config.json`` that
        ``fit --config`` writes (:func:`rotation_config_path`).
    """
    base = Path(out_dir) if out_dir else recipe.folder
    stats = base / "calib" / "stats.safetensors"
    rot = recipe.rotation_path
    if rot is None or out_dir:
        name = Path(recipe.rotation.path).name if recipe.rotation.path else "rotation.safetensors"
        rot = base / name
    config = rotation_config_path(str(rot)) if is_data_free(recipe) else stats_config_path(str(stats))
    return {"stats": str(stats), "config": config, "rotation": str(rot)}


def stats_config_path(stats_path: str) -> str:
    """The model config written next to a statistics file (``stats.safetensors`` -> ``stats.config.json``)."""
    root, ext = os.path.splitext(stats_path)
    return (root if ext else stats_path) + ".config.json"


def rotation_config_path(rotation_path: str) -> str:
    """The model config ``fit --config`` copies next to a rotation file (``rot.safetensors`` ->
    ``rot.config.json``), so that ``validate`` reads a local file even when the model is a Hub id."""
    return stats_config_path(rotation_path)


def _one(values: set):
    """The single element of ``values``, or the sorted list when the layers disagree."""
    return next(iter(values)) if len(values) == 1 else sorted(values)


def _layer_set(geometry: ModelGeometry, sliding: bool) -> list:
    return [lg for lg in geometry.layers if (lg.sliding_window is not None) == sliding]


def _partial_rotary_dim(config: dict[str, Any], head_dim) -> Any:
    """Rotary dims of a config: ``rope_parameters.partial_rotary_factor`` / ``partial_rotary_factor``
    times the head dim, else ``rotary_dim``, else the whole head dim; ``None`` when it differs per
    layer type (``rope_parameters`` keyed by layer type) or the head dim is not uniform."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        return None
    factor = (rope or {}).get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = factor if factor is not None else config.get("partial_rotary_factor")
    if not isinstance(head_dim, int):
        return None
    if factor is not None:
        return int(head_dim * factor)
    return int(config.get("rotary_dim") or head_dim)


# Keys of [geometry] / [geometry.<sub>] that describe an MHA/GQA cache; on an MLA model (which
# caches the latent) they are refused rather than ignored. Recipes and fitted rotations cover the
# latent only: expanded-MHA storage of MLA weights (upstream's PR-era Kimi-K3 path, spec §6.3; the
# server's --oscar-mla-storage expanded) takes `sglang-oscar hadamard --mla-storage expanded`.
_MHA_ONLY_KEYS = ("num_kv_heads", "head_dim", "head_dim_k", "head_dim_v", "partial_rotary_dim")


def geometry_mismatches(recipe, geometry: ModelGeometry, config: dict[str, Any] | None = None) -> list[str]:
    """Differences between a recipe's ``[geometry]`` and a model (empty = consistent).

    Every key the recipe gives is compared; none is ignored:

    * top level: ``num_layers`` (all decoder layers), ``num_q_heads``; MHA/GQA: ``num_kv_heads``,
      ``head_dim`` / ``head_dim_k`` / ``head_dim_v`` over *all* attention layers (also when
      sub-tables exist), ``partial_rotary_dim`` (needs ``config``); MLA: ``kv_lora_rank``,
      ``qk_rope_head_dim`` -- MHA keys and sub-tables on an MLA model are mismatches;
    * ``[geometry.sliding]`` / ``[geometry.full]``: ``layers``, ``num_q_heads``, ``num_kv_heads``,
      ``head_dim``/``head_dim_k``/``head_dim_v``, ``sliding_window`` (sliding only; on ``full``
      it is a mismatch), ``k_eq_v`` (the config's ``attention_k_eq_v``, needs ``config``; true
      also requires equal K and V head dims).

    Args:
        config: the model's HF config as a dict, for the keys the geometry does not carry
            (``partial_rotary_dim``, ``k_eq_v``); without it those keys are reported as unchecked.
    """
    g = recipe.geometry
    bad: list[str] = []

    def cmp(what: str, want, have) -> None:
        if want is not None and want != have:
            bad.append(f"{what}: recipe {want}, model {have}")

    cmp("num_layers", g.num_layers, geometry.num_hidden_layers)
    cmp("num_q_heads", g.num_q_heads, geometry.num_q_heads)
    subs = {"sliding": g.sliding, "full": g.full}
    if geometry.attention_kind == "mla":
        cmp("kv_lora_rank", g.kv_lora_rank, geometry.kv_lora_rank)
        cmp("qk_rope_head_dim", g.qk_rope_head_dim, geometry.qk_rope_head_dim)
        for key in _MHA_ONLY_KEYS:
            if getattr(g, key) is not None:
                bad.append(f"{key} = {getattr(g, key)}: the model is MLA (kv_lora_rank {geometry.kv_lora_rank}) and "
                           "recipes cover the latent, not per-head K/V (expanded-MHA storage is not supported in "
                           "recipes: its rotation file comes from `sglang-oscar hadamard --mla-storage expanded`); "
                           "remove the key")
        for name, sub in subs.items():
            if sub is not None:
                bad.append(f"[geometry.{name}]: the model is MLA; per-layer-type K/V geometry does not apply")
        return bad
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        if getattr(g, key) is not None:
            bad.append(f"{key}: recipe {getattr(g, key)}, but the model is not MLA")

    def cmp_layers(prefix: str, holder, layers: list) -> None:
        cmp(f"{prefix}num_kv_heads", holder.num_kv_heads, _one({x.num_kv_heads for x in layers}))
        cmp(f"{prefix}head_dim_k", holder.head_dim_k or holder.head_dim, _one({x.head_dim_k for x in layers}))
        cmp(f"{prefix}head_dim_v", holder.head_dim_v or holder.head_dim, _one({x.head_dim_v for x in layers}))
        if holder.head_dim is not None and (holder.head_dim_k or holder.head_dim_v):
            for attr in ("head_dim_k", "head_dim_v"):
                cmp(f"{prefix}{attr} vs {prefix}head_dim", getattr(holder, attr), holder.head_dim)

    cmp_layers("", g, list(geometry.layers))
    if g.partial_rotary_dim is not None:
        if config is None:
            bad.append("partial_rotary_dim: cannot be checked without the model config")
        else:
            rot = _partial_rotary_dim(config, _one({x.head_dim_k for x in geometry.layers}))
            if rot is None:
                bad.append("partial_rotary_dim: the model's rotary dims differ per layer type; give it per layer type "
                           "(not supported) or remove it")
            else:
                cmp("partial_rotary_dim", g.partial_rotary_dim, rot)
    for name, sub in subs.items():
        if sub is None:
            continue
        layers = _layer_set(geometry, name == "sliding")
        if not layers:
            bad.append(f"[geometry.{name}]: the model has no {name} attention layers")
            continue
        cmp(f"{name}.layers", sub.layers, [x.layer_id for x in layers])
        cmp(f"{name}.num_q_heads", sub.num_q_heads, geometry.num_q_heads)
        cmp_layers(f"{name}.", sub, layers)
        if name == "sliding":
            cmp("sliding.sliding_window", sub.sliding_window, _one({x.sliding_window for x in layers}))
        elif sub.sliding_window is not None:
            bad.append(f"full.sliding_window = {sub.sliding_window}: full attention layers have no sliding window")
        if sub.k_eq_v is not None:
            if config is None:
                bad.append(f"{name}.k_eq_v: cannot be checked without the model config")
            else:
                text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
                shares = bool(text.get("attention_k_eq_v", False)) and name == "full"
                cmp(f"{name}.k_eq_v", sub.k_eq_v, shares)
                if sub.k_eq_v:
                    cmp(f"{name}.k_eq_v head dims (K vs V)", _one({x.head_dim_k for x in layers}),
                        _one({x.head_dim_v for x in layers}))
    return bad


def check_geometry(recipe, geometry: ModelGeometry, config: dict[str, Any] | None = None) -> None:
    """Raise :class:`CalibrationError` if the model does not match the recipe's geometry
    (:func:`geometry_mismatches`; ``config``: the model's HF config dict)."""
    bad = geometry_mismatches(recipe, geometry, config)
    if bad:
        raise CalibrationError(
            f"{recipe.path}: the model ({geometry.model_type}) does not match the recipe's [geometry]: "
            + "; ".join(bad) + ". Wrong checkpoint, or a wrong recipe."
        )


def _rel(path: str) -> str:
    """``path`` relative to the current directory when it lies below it (readable printed commands)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def step_command(recipe, step: str, *, model: str | None = None, data: str | None = None,
                 out_dir: str | None = None, prog: str = "sglang-oscar") -> list[str]:
    """The argv (``prog`` first) that runs ``step`` for ``recipe``; ``[]`` for a step the recipe skips.

    * ``calibrate`` is skipped for data-free methods (hadamard, identity); their ``fit`` reads the
      model config (``--config MODEL``, a local directory or a Hub id) instead of statistics and
      copies it next to the rotation (:func:`rotation_config_path`).
    * ``validate`` is ``validate-rotation``, which reads the file and validates it as what it is
      (a K/V or a latent rotation set) against a *local* config: ``calib/stats.config.json`` or
      the copy written by ``fit``.
    * ``error`` and ``ppl`` need held-out prompts (``data``); the recipe's ``calib_data`` is not
      used for them.
    * ``--trust-remote-code`` is added to the steps that load the model or its config when the
      recipe's server flags carry it (:func:`trust_remote_code`).

    Raises:
        CalibrationError: an unknown step, or ``error``/``ppl`` without ``data``.
    """
    if step not in STEPS:
        raise CalibrationError(f"unknown step {step!r}; choose from {', '.join(STEPS)}")
    paths = {k: _rel(v) for k, v in default_paths(recipe, out_dir).items()}
    rp = _rel(str(recipe.path))
    model = model or recipe.model.hf_id
    method = recipe.rotation.method
    data_free = is_data_free(recipe)
    remote = ["--trust-remote-code"] if trust_remote_code(recipe) else []
    if step == "calibrate":
        if data_free:
            return []
        cmd = [prog, "calibrate", "--recipe", rp, "--model", model, "--out", paths["stats"], *remote]
        if data:
            cmd += ["--prompts", data]
        return cmd
    if step == "fit":
        cmd = [prog, "fit", "--recipe", rp, "--method", method, "--out", paths["rotation"]]
        cmd += ["--center"] if recipe.rotation.center else []
        return cmd + (["--config", model, *remote] if data_free else ["--stats", paths["stats"]])
    if step == "validate":
        return [prog, "validate-rotation", paths["rotation"], "--config", paths["config"]]
    if not data:
        raise CalibrationError(
            f"the {step} step needs held-out prompts (--data): the recipe's calib_data "
            f"({recipe.rotation.calib_data!r}) was used for calibration, so it does not show whether the calibration works"
        )
    return [prog, step, "--recipe", rp, "--model", model, "--rotation", paths["rotation"], "--prompts", data, *remote]
