"""Per-model recipe files (``recipes/<model>/recipe.toml``): schema and strict loader.

A recipe is the *only* place where the server flags, the rotation file and the evaluation
settings of one model live. Everything that launches a server or runs an evaluation for a
model (``sglang-oscar serve``, ``sglang-oscar eval-recipe``, the ``eval_gpqa.sh`` wrappers)
reads it through :func:`load_recipe`.

The loader is strict: an unknown section or key, a value of the wrong type or a value outside
its allowed set is an error that names the file, the key and what is allowed. Nothing is
silently ignored (a misspelt key would otherwise fall back to a default without anyone
noticing).

Schema (all sections except ``[model]`` are optional; defaults in parentheses)::

    [model]
    hf_id = "Qwen/Qwen3-8B"          # str, required: exact checkpoint id (or local path)
    family = "qwen3"                 # str, required: qwen3 | qwen3_moe | llama | gemma3 | gemma4 | gpt_oss |
                                     #   glm_mla | kimi_k3 | minimax_m2 | minimax_m3 | qwen3_5
    served = true                    # bool, required: is the int2 serving path for this
                                     #   family built? false => `serve --kv int2` refuses
    notes = "..."                    # str, optional
    context_length = 131072          # int, optional (see also [serve].context_length)
    json_model_override_args = {...} # table, optional: passed as --json-model-override-args
                                     #   (JSON), identically to both arms (e.g. YaRN:
                                     #   rope_parameters, rope_scaling, max_position_embeddings)

    [geometry]                       # loaded and type-checked only (validated elsewhere)
    num_layers = 36                  # int
    num_q_heads = 32                 # int
    num_kv_heads = 8                 # int
    head_dim = 128                   # int
    head_dim_k = 192                 # int, optional (K and V head dims differ, Kimi)
    head_dim_v = 128                 # int, optional
    kv_lora_rank = 512               # int, optional (MLA)
    qk_rope_head_dim = 64            # int, optional (MLA)
    partial_rotary_dim = 64          # int, optional
    # Heterogeneous models instead (or in addition) give per-layer-type sub-tables
    # [geometry.sliding] and [geometry.full] with keys:
    #   num_q_heads, num_kv_heads, head_dim, head_dim_k, head_dim_v (ints),
    #   sliding_window (int), layers (list of global layer ids), k_eq_v (bool)

    [rotation]
    method = "oscar"                 # oscar | oscar-perhead | hadamard | identity
    path = "rot.pt"                  # str, optional: relative to the recipe's folder, or
                                     #   absolute; passed as --oscar-rotation
    calib_tokens = 20000             # int, optional
    calib_data = "..."               # str, optional
    center = false                   # bool (false): fit with key/value centering (`fit --center`;
                                     #   fitted methods only, not for soft-capped models)

    [quant]
    group_size = 128                 # int, optional: --kv-cache-quant-group-size (unset =>
                                     #   flag omitted, server default G = head_dim)
    k_clip_ratio = 0.96              # float (0.96)
    v_clip_ratio = 0.92              # float (0.92); not for MLA recipes (one latent: k_clip_ratio)
    sink_tokens = 64                 # int (64): BF16 prefix window
    recent_tokens = 256              # int (256): BF16 recent window
    quantizer = "uniform"            # uniform | lloyd-max, optional: flag passed only if set
    scale_dtype = "float32"          # float32 | float16 | bfloat16, optional: passed only if set
    fold_rotations = true            # bool (false): --oscar-fold-rotations on
    skip_layers = "sliding"          # none | sliding | full | "0,5,11" ("none"): --oscar-skip-layers

    [serve]
    tp = 1                           # int (1): --tp-size
    port = 30000                     # int (30000)
    host = "127.0.0.1"               # str ("127.0.0.1")
    mem_fraction_static = 0.85       # float, optional
    max_running_requests = 64        # int, optional
    context_length = 65536           # int, optional (overrides [model].context_length;
                                     #   giving both with different values is an error)
    extra_args = ["--trust-remote-code", "--cuda-graph-max-bs", "32"]
                                     # list of str: appended as separate argv elements (one
                                     #   element per flag and per value; flags in full,
                                     #   never abbreviated)
    env = { SOME_VAR = "1" }         # table str -> str: exported to the server process only;
                                     #   nothing else is exported. Refused: dead names
                                     #   (SGLANG_COQUANT_*) and aliases of recipe keys
                                     #   (SGLANG_OSCAR_K_CLIP_RATIO, SGLANG_LLOYD_MAX,
                                     #   SGLANG_MIXED_KV_SCALE_DTYPE, ...)

    [eval]
    tasks = ["gpqa"]                 # list of gpqa | aime25 | math500 | humaneval (["gpqa"])
    seeds = [0, 1, 2]                # list of int ([0])
    max_tokens = 32768               # int (32768)
    temperature = 1.0                # float (1.0)
    top_p = 0.95                     # float (0.95)
    top_k = 20                       # int, optional
    threads = 32                     # int (32): client concurrency
    n_examples = 48                  # int, optional: first N questions of the dataset

The recipe's own folder is where a relative ``[rotation].path`` is resolved.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_oscar.evals.recipe_checks import (DEAD_ENV_PREFIXES, FLAG_ENV_ALIASES, Checker,  # noqa: F401
                                              RecipeError, argv_item, boolean, check_table, choice, env_table,
                                              integer, list_of, mem_fraction, nonempty_str, nonneg_float,
                                              nonneg_int, port, pos_int, ratio, skip_layers, string, table, top_p)
from sglang_oscar.evals.tasks import TASKS

FAMILIES = (
    "qwen3",
    "qwen3_moe",
    "llama",
    "gemma3",  # Gemma-3: sliding + full layers of one KV geometry
    "gemma4",
    "gpt_oss",  # GPT-OSS: sliding + full layers, attention sinks
    "glm_mla",
    "kimi_k3",
    "minimax_m2",
    "minimax_m3",
    "qwen3_5",  # Qwen3.5 / Qwen3-Next hybrids (gated-DeltaNet + full attention)
)
ROTATION_METHODS = ("oscar", "oscar-perhead", "hadamard", "identity")
QUANTIZERS = ("uniform", "lloyd-max")
SCALE_DTYPES = ("float32", "float16", "bfloat16")
GEOMETRY_SUBTABLES = ("sliding", "full")

# ----------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSection:
    """``[model]``: the checkpoint and its family."""

    hf_id: str
    family: str
    served: bool
    notes: str | None = None
    context_length: int | None = None
    json_model_override_args: dict | None = None


@dataclass(frozen=True)
class LayerGeometry:
    """``[geometry.sliding]`` / ``[geometry.full]``: one layer type's shapes."""

    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    head_dim_k: int | None = None
    head_dim_v: int | None = None
    sliding_window: int | None = None
    layers: list[int] | None = None
    k_eq_v: bool | None = None


@dataclass(frozen=True)
class GeometrySection:
    """``[geometry]``: attention shapes (type-checked here, validated elsewhere)."""

    num_layers: int | None = None
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    head_dim_k: int | None = None
    head_dim_v: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    partial_rotary_dim: int | None = None
    sliding: LayerGeometry | None = None
    full: LayerGeometry | None = None


@dataclass(frozen=True)
class RotationSection:
    """``[rotation]``: how the rotation was computed and where it is."""

    method: str = "oscar"
    path: str | None = None
    calib_tokens: int | None = None
    calib_data: str | None = None
    center: bool = False


@dataclass(frozen=True)
class QuantSection:
    """``[quant]``: INT2 quantizer settings (``--oscar-*`` flags)."""

    group_size: int | None = None
    k_clip_ratio: float = 0.96
    v_clip_ratio: float = 0.92
    sink_tokens: int = 64
    recent_tokens: int = 256
    quantizer: str | None = None
    scale_dtype: str | None = None
    fold_rotations: bool = False
    skip_layers: str = "none"


@dataclass(frozen=True)
class ServeSection:
    """``[serve]``: server flags and environment."""

    tp: int = 1
    port: int = 30000
    host: str = "127.0.0.1"
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    context_length: int | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalSection:
    """``[eval]``: tasks, seeds and sampling of ``eval-recipe``."""

    tasks: list[str] = field(default_factory=lambda: ["gpqa"])
    seeds: list[int] = field(default_factory=lambda: [0])
    max_tokens: int = 32768
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int | None = None
    threads: int = 32
    n_examples: int | None = None


@dataclass(frozen=True)
class Recipe:
    """A validated recipe file (see the module docstring for the schema)."""

    path: Path  # absolute path of the recipe file
    model: ModelSection
    geometry: GeometrySection
    rotation: RotationSection
    quant: QuantSection
    serve: ServeSection
    eval: EvalSection

    @property
    def folder(self) -> Path:
        """The recipe's folder (where a relative ``[rotation].path`` is resolved)."""
        return self.path.parent

    @property
    def name(self) -> str:
        """The recipe's folder name (``recipes/<name>/recipe.toml``)."""
        return self.path.parent.name

    @property
    def rotation_path(self) -> Path | None:
        """``[rotation].path`` resolved against the recipe's folder (None when unset)."""
        if self.rotation.path is None:
            return None
        p = Path(self.rotation.path).expanduser()
        return p if p.is_absolute() else (self.folder / p)

    @property
    def context_length(self) -> int | None:
        """``[serve].context_length``, else ``[model].context_length``, else None."""
        return self.serve.context_length or self.model.context_length


# key -> (checker, required). Defaults come from the dataclasses above.
_MODEL_KEYS: dict[str, tuple[Checker, bool]] = {
    "hf_id": (nonempty_str, True),
    "family": (choice(*FAMILIES), True),
    "served": (boolean, True),
    "notes": (string, False),
    "context_length": (pos_int, False),
    "json_model_override_args": (table, False),
}
_LAYER_GEOMETRY_KEYS: dict[str, tuple[Checker, bool]] = {
    "num_q_heads": (pos_int, False),
    "num_kv_heads": (pos_int, False),
    "head_dim": (pos_int, False),
    "head_dim_k": (pos_int, False),
    "head_dim_v": (pos_int, False),
    "sliding_window": (pos_int, False),
    "layers": (list_of(nonneg_int, nonempty=True), False),
    "k_eq_v": (boolean, False),
}
_GEOMETRY_KEYS: dict[str, tuple[Checker, bool]] = {
    "num_layers": (pos_int, False),
    "num_q_heads": (pos_int, False),
    "num_kv_heads": (pos_int, False),
    "head_dim": (pos_int, False),
    "head_dim_k": (pos_int, False),
    "head_dim_v": (pos_int, False),
    "kv_lora_rank": (pos_int, False),
    "qk_rope_head_dim": (pos_int, False),
    "partial_rotary_dim": (pos_int, False),
}
_ROTATION_KEYS: dict[str, tuple[Checker, bool]] = {
    "method": (choice(*ROTATION_METHODS), False),
    "path": (nonempty_str, False),
    "calib_tokens": (pos_int, False),
    "calib_data": (string, False),
    "center": (boolean, False),
}
_QUANT_KEYS: dict[str, tuple[Checker, bool]] = {
    "group_size": (pos_int, False),
    "k_clip_ratio": (ratio, False),
    "v_clip_ratio": (ratio, False),
    "sink_tokens": (nonneg_int, False),
    "recent_tokens": (nonneg_int, False),
    "quantizer": (choice(*QUANTIZERS), False),
    "scale_dtype": (choice(*SCALE_DTYPES), False),
    "fold_rotations": (boolean, False),
    "skip_layers": (skip_layers, False),
}


_SERVE_KEYS: dict[str, tuple[Checker, bool]] = {
    "tp": (pos_int, False),
    "port": (port, False),
    "host": (nonempty_str, False),
    "mem_fraction_static": (mem_fraction, False),
    "max_running_requests": (pos_int, False),
    "context_length": (pos_int, False),
    "extra_args": (list_of(argv_item), False),
    "env": (env_table, False),
}
_EVAL_KEYS: dict[str, tuple[Checker, bool]] = {
    "tasks": (list_of(choice(*TASKS), nonempty=True), False),
    "seeds": (list_of(integer, nonempty=True), False),
    "max_tokens": (pos_int, False),
    "temperature": (nonneg_float, False),
    "top_p": (top_p, False),
    "top_k": (pos_int, False),
    "threads": (pos_int, False),
    "n_examples": (pos_int, False),
}


_SECTIONS = ("model", "geometry", "rotation", "quant", "serve", "eval")


def parse_recipe(data: dict[str, Any], path: Path) -> Recipe:
    """Validate an already-parsed TOML document (``path`` is used for messages and for
    resolving relative paths)."""
    path = Path(path).resolve()
    for section in data:
        if section not in _SECTIONS:
            raise RecipeError(
                f"{path}: unknown section [{section}]; allowed sections: "
                + ", ".join(f"[{s}]" for s in _SECTIONS)
            )
    if "model" not in data:
        raise RecipeError(f"{path}: the [model] section is required")

    model = ModelSection(**check_table(data["model"], _MODEL_KEYS, "model", path))

    geo_raw = data.get("geometry", {})
    geo_vals = check_table(geo_raw, _GEOMETRY_KEYS, "geometry", path, GEOMETRY_SUBTABLES)
    for sub in GEOMETRY_SUBTABLES:
        if sub in geo_raw:
            vals = check_table(
                geo_raw[sub], _LAYER_GEOMETRY_KEYS, f"geometry.{sub}", path
            )
            geo_vals[sub] = LayerGeometry(**vals)
    geometry = GeometrySection(**geo_vals)

    rotation = RotationSection(
        **check_table(data.get("rotation", {}), _ROTATION_KEYS, "rotation", path)
    )
    if rotation.center and rotation.method in ("hadamard", "identity"):
        raise RecipeError(
            f"{path}: [rotation].center = true needs calibration statistics, but method {rotation.method!r} is "
            "data-free (its recipe has no calibrate step): use a fitted method (oscar, oscar-perhead) or drop center"
        )
    quant_raw = data.get("quant", {})
    quant = QuantSection(**check_table(quant_raw, _QUANT_KEYS, "quant", path))
    if geometry.kv_lora_rank is not None:
        # an MLA cache holds one latent per token: the server refuses these MHA/GQA settings at launch
        mha_only = [k for k, off in (("v_clip_ratio", None), ("fold_rotations", False), ("skip_layers", "none"))
                    if k in quant_raw and quant_raw[k] != off]
        if mha_only:
            raise RecipeError(
                f"{path}: [quant].{mha_only[0]} applies to MHA/GQA K/V caches; this recipe's model caches one "
                "MLA latent per token ([geometry].kv_lora_rank), clipped by k_clip_ratio: drop the key")
    serve = ServeSection(**check_table(data.get("serve", {}), _SERVE_KEYS, "serve", path))
    ev = EvalSection(**check_table(data.get("eval", {}), _EVAL_KEYS, "eval", path))

    if (
        model.context_length is not None
        and serve.context_length is not None
        and model.context_length != serve.context_length
    ):
        raise RecipeError(
            f"{path}: [model].context_length = {model.context_length} and "
            f"[serve].context_length = {serve.context_length} disagree; set it in one place"
        )
    if quant.skip_layers not in ("none", "sliding", "full") and geometry.num_layers is not None:
        bad = [i for i in map(int, quant.skip_layers.split(",")) if i >= geometry.num_layers]
        if bad:
            raise RecipeError(
                f"{path}: [quant].skip_layers names layers {bad} beyond [geometry].num_layers = {geometry.num_layers} "
                f"(ids run 0..{geometry.num_layers - 1}); fix the ids or use sliding / full")
    ctx = serve.context_length or model.context_length
    if ctx is not None and ev.max_tokens >= ctx and "--allow-auto-truncate" not in serve.extra_args:
        raise RecipeError(f"{path}: [eval].max_tokens = {ev.max_tokens} leaves no room for the prompt in the "
                          f"context of {ctx} tokens (every request would be refused after the model loaded); lower "
                          "max_tokens or raise the context length (e.g. YaRN through [model].json_model_override_args)")
    group_problem = _group_misfit(quant, geometry)
    if group_problem:
        raise RecipeError(f"{path}: [quant].group_size = {quant.group_size} {group_problem}; pick a divisor or "
                          "drop the key (one group per row)")
    if len(set(ev.seeds)) != len(ev.seeds):
        raise RecipeError(f"{path}: [eval].seeds has duplicates: {ev.seeds}")
    if len(set(ev.tasks)) != len(ev.tasks):
        raise RecipeError(f"{path}: [eval].tasks has duplicates: {ev.tasks}")

    return Recipe(
        path=path,
        model=model,
        geometry=geometry,
        rotation=rotation,
        quant=quant,
        serve=serve,
        eval=ev,
    )


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate ``path``; raises :class:`RecipeError` (a ``ValueError``)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from None
    return parse_recipe(data, path)


def _group_misfit(quant: QuantSection, geometry: GeometrySection) -> str | None:
    """What ``[quant].group_size`` does not divide among the recipe's own ``[geometry]`` row widths
    (the MLA latent's kv_lora_rank, else every head_dim of K, V and each layer kind but the one
    ``skip_layers`` keeps BF16), or ``None``;
    the server would refuse the launch for it."""
    g = quant.group_size
    if not g or quant.skip_layers not in ("none", "sliding", "full"):
        return None  # layer ids: which kind stays BF16 is the launch check's to judge
    if geometry.kv_lora_rank is not None:
        rank = geometry.kv_lora_rank
        return None if rank % g == 0 else f"does not divide [geometry].kv_lora_rank {rank}"
    kinds = [("geometry", geometry), ("geometry.sliding", geometry.sliding), ("geometry.full", geometry.full)]
    for where, sec in kinds:
        if where == f"geometry.{quant.skip_layers}":  # that kind stays BF16: no INT2 groups
            continue
        for key in ("head_dim", "head_dim_k", "head_dim_v"):
            d = getattr(sec, key, None) if sec is not None else None
            if d and d % g:
                return f"does not divide [{where}].{key} {d}"
    return None
