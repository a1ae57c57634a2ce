"""Recipes (``rotation/<model>/recipe.toml``) as seen by calibration.

The recipe schema and its strict loader live in :mod:`sglang_oscar.evals.recipe` (one loader);
this module derives what calibration needs from a loaded recipe:

* :func:`oscar_config`: the served quantizer settings as an :class:`OscarConfig`;
* :func:`default_paths`: where ``calibrate`` / ``fit`` read and write for a recipe
  (``<folder>/calib/stats.safetensors``, its ``stats.config.json``, the rotation file at
  ``[rotation].path`` or ``<folder>/rotation.safetensors``);
* :func:`geometry_mismatches` / :func:`check_geometry`: a recipe's ``[geometry]`` against a
  model's :class:`ModelGeometry` (layer count, heads, head dims, sliding windows);
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
    from ..config import OscarConfig

    q = recipe.quant
    kw: dict[str, Any] = dict(group_size=q.group_size, k_clip_ratio=q.k_clip_ratio, v_clip_ratio=q.v_clip_ratio,
                              sink_tokens=q.sink_tokens, recent_tokens=q.recent_tokens)
    if q.quantizer:
        kw["quantizer"] = q.quantizer
    if q.scale_dtype:
        kw["scale_dtype"] = q.scale_dtype
    return OscarConfig(**kw)


def default_paths(recipe, out_dir: str | None = None) -> dict[str, str]:
    base = Path(out_dir) if out_dir else recipe.folder
    stats = base / "calib" / "stats.safetensors"
    rot = recipe.rotation_path
    if rot is None or out_dir:
        name = Path(recipe.rotation.path).name if recipe.rotation.path else "rotation.safetensors"
        rot = base / name
    return {"stats": str(stats), "config": stats_config_path(str(stats)), "rotation": str(rot)}


def stats_config_path(stats_path: str) -> str:
    """The model config written next to a statistics file (``stats.safetensors`` -> ``stats.config.json``)."""
    root, ext = os.path.splitext(stats_path)
    return (root if ext else stats_path) + ".config.json"


def _layer_set(geometry: ModelGeometry, sliding: bool) -> list:
    return [lg for lg in geometry.layers if (lg.sliding_window is not None) == sliding]


def geometry_mismatches(recipe, geometry: ModelGeometry) -> list[str]:
    """Differences between a recipe's ``[geometry]`` and a model's geometry (empty = consistent)."""
    g = recipe.geometry
    bad: list[str] = []

    def cmp(what: str, want, have) -> None:
        if want is not None and want != have:
            bad.append(f"{what}: recipe {want}, model {have}")

    cmp("num_layers", g.num_layers, geometry.num_hidden_layers)
    cmp("num_q_heads", g.num_q_heads, geometry.num_q_heads)
    if geometry.attention_kind == "mla":
        cmp("kv_lora_rank", g.kv_lora_rank, geometry.kv_lora_rank)
        cmp("qk_rope_head_dim", g.qk_rope_head_dim, geometry.qk_rope_head_dim)
        return bad
    if g.kv_lora_rank is not None:
        bad.append(f"kv_lora_rank: recipe {g.kv_lora_rank}, but the model is not MLA")
    subs = {"sliding": g.sliding, "full": g.full}
    if g.sliding is None and g.full is None:
        layers = list(geometry.layers)
        cmp("num_kv_heads", g.num_kv_heads, sorted({x.num_kv_heads for x in layers})[0] if len({x.num_kv_heads for x in layers}) == 1 else sorted({x.num_kv_heads for x in layers}))
        dk = {x.head_dim_k for x in layers}
        dv = {x.head_dim_v for x in layers}
        cmp("head_dim_k", g.head_dim_k or g.head_dim, dk.pop() if len(dk) == 1 else sorted(dk))
        cmp("head_dim_v", g.head_dim_v or g.head_dim, dv.pop() if len(dv) == 1 else sorted(dv))
        return bad
    for name, sub in subs.items():
        if sub is None:
            continue
        layers = _layer_set(geometry, name == "sliding")
        if not layers:
            bad.append(f"[geometry.{name}]: the model has no {name} attention layers")
            continue
        ids = [x.layer_id for x in layers]
        cmp(f"{name}.layers", sub.layers, ids)
        for attr, vals in (("num_kv_heads", {x.num_kv_heads for x in layers}),
                           ("head_dim_k", {x.head_dim_k for x in layers}),
                           ("head_dim_v", {x.head_dim_v for x in layers})):
            want = getattr(sub, attr, None)
            if attr != "num_kv_heads":
                want = want or sub.head_dim
            cmp(f"{name}.{attr}", want, vals.pop() if len(vals) == 1 else sorted(vals))
        if name == "sliding":
            ws = {x.sliding_window for x in layers}
            cmp("sliding.sliding_window", sub.sliding_window, ws.pop() if len(ws) == 1 else sorted(ws))
    return bad


def check_geometry(recipe, geometry: ModelGeometry) -> None:
    """Raise :class:`CalibrationError` if the model does not match the recipe's geometry."""
    bad = geometry_mismatches(recipe, geometry)
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

    ``calibrate`` is skipped for data-free methods (hadamard, identity); their ``fit`` reads the
    model config instead of statistics.
    """
    if step not in STEPS:
        raise CalibrationError(f"unknown step {step!r}; choose from {', '.join(STEPS)}")
    paths = {k: _rel(v) for k, v in default_paths(recipe, out_dir).items()}
    rp = _rel(str(recipe.path))
    model = model or recipe.model.hf_id
    method = recipe.rotation.method
    data_free = method in DATA_FREE
    if step == "calibrate":
        if data_free:
            return []
        cmd = [prog, "calibrate", "--recipe", rp, "--model", model, "--out", paths["stats"]]
        if data:
            cmd += ["--prompts", data]
        return cmd
    if step == "fit":
        cmd = [prog, "fit", "--recipe", rp, "--method", method, "--out", paths["rotation"]]
        return cmd + (["--config", model] if data_free else ["--stats", paths["stats"]])
    if step == "validate":
        config = model if data_free else paths["config"]
        mla = recipe.geometry.kv_lora_rank is not None and recipe.geometry.head_dim_k is None
        return [prog, "validate-latent" if mla else "validate", paths["rotation"], "--config", config]
    cmd = [prog, step, "--recipe", rp, "--model", model, "--rotation", paths["rotation"]]
    if data:
        cmd += ["--prompts", data]
    return cmd
