"""The OSCAR server flags, their upstream environment-variable aliases, and config resolution.

Pure argparse/env logic (no SGLang import), so it is testable anywhere. Precedence for each
setting: the flag if given, else its upstream environment alias (with a logged note), else the
default of :class:`sglang_oscar.config.OscarConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Callable

from ..config import OscarConfig
from ..quant.int2 import scale_torch_dtype

# Environment variable carrying the resolved config to SGLang's spawned subprocesses.
CONFIG_ENV = "SGLANG_OSCAR_CONFIG"


@dataclasses.dataclass(frozen=True)
class Flag:
    """One ``--oscar-*`` launch flag: its argparse dest and option, the :class:`OscarConfig` field it sets,
    its parser, help text and the upstream environment alias that may set it instead."""

    dest: str  # argparse dest (namespace attribute)
    option: str  # CLI option
    field: str  # OscarConfig field
    type: Callable[[str], Any]
    help: str
    env: str | None = None  # upstream alias
    choices: tuple | None = None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
# Upstream dtype spellings (SGLANG_MIXED_KV_SCALE_DTYPE) -> ours.
_DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32"}


def _lloyd_max_env(value: str) -> str:
    v = value.strip().lower()
    if v in _TRUE:
        return "lloyd-max"
    if v in _FALSE:
        return "uniform"
    raise ValueError(f"expected one of {_TRUE + _FALSE}")


def _dtype_env(value: str) -> str:
    v = value.strip().lower()
    if v not in _DTYPE_NAMES:
        raise ValueError(f"expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[v]


_ENV_PARSERS = {"SGLANG_LLOYD_MAX": _lloyd_max_env, "SGLANG_MIXED_KV_SCALE_DTYPE": _dtype_env}


FLAGS = (
    Flag("kv_cache_quant_group_size", "--kv-cache-quant-group-size", "group_size", int,
         "INT2 KV cache: elements per (scale, zero) group along head_dim (default: one group per head row; "
         "MLA latents: 128)."),
    Flag("oscar_rotation", "--oscar-rotation", "rotation_path", str,
         "INT2 KV cache: OSCAR rotation file or directory (from `sglang-oscar fit`). Without it the "
         "data-free Hadamard rotation for the model's geometry is used.", env="SGLANG_OSCAR_K_ROTATION_PATH"),
    Flag("oscar_k_clip_ratio", "--oscar-k-clip-ratio", "k_clip_ratio", float,
         "INT2 KV cache: per-row K magnitude clip ratio in [0, 1] (0 = off; default 0.96).", env="SGLANG_OSCAR_K_CLIP_RATIO"),
    Flag("oscar_v_clip_ratio", "--oscar-v-clip-ratio", "v_clip_ratio", float,
         "INT2 KV cache: per-row V magnitude clip ratio in [0, 1] (0 = off; default 0.92).", env="SGLANG_OSCAR_V_CLIP_RATIO"),
    Flag("oscar_sink_tokens", "--oscar-sink-tokens", "sink_tokens", int,
         "INT2 KV cache: first tokens of each request kept in BF16 (default 64).", env="SGLANG_MIXED_KV_PREFIX_TOKENS"),
    Flag("oscar_recent_tokens", "--oscar-recent-tokens", "recent_tokens", int,
         "INT2 KV cache: last tokens of each request kept in BF16 (default 256).", env="SGLANG_MIXED_KV_RECENT_TOKENS"),
    Flag("oscar_quantizer", "--oscar-quantizer", "quantizer", str,
         "INT2 KV cache: quantizer codebook (default uniform).", env="SGLANG_LLOYD_MAX", choices=("uniform", "lloyd-max")),
    Flag("oscar_scale_dtype", "--oscar-scale-dtype", "scale_dtype", str,
         "INT2 KV cache: dtype of the per-group (scale, zero) pairs (default float16).",
         env="SGLANG_MIXED_KV_SCALE_DTYPE", choices=("float32", "float16", "bfloat16")),
    Flag("oscar_decode_engine", "--oscar-decode-engine", "decode_engine", str,
         "INT2 KV cache: decode-attention kernel: auto (default: the Gluon kernel where it applies -- "
         "head_dim 128, uniform levels, one fp16 (scale, zero) pair per row, no logit cap -- else Triton), "
         "triton, or gluon (a model it cannot run fails at its first decode step, CUDA-graph capture "
         "included, with the reason).",
         choices=("auto", "triton", "gluon")),
    Flag("oscar_rotate_engine", "--oscar-rotate-engine", "rotate_engine", str,
         "INT2 KV cache: how q, the new K/V rows and the attention output are rotated each step: triton "
         "(default: q, K and V in one kernel, the output in a second) or torch (fp32 einsum, several small kernels per product; same "
         "fp32 arithmetic up to the summation order).",
         choices=("triton", "torch")),
    Flag("oscar_fold_rotations", "--oscar-fold-rotations", "fold_rotations", str,
         "INT2 KV cache: on folds each layer's value rotation and value mean into qkv_proj / o_proj at "
         "load, so the served step skips the V rotation and the output counter-rotation (Gemma-4, whose "
         "v_norm sits between them, folds o_proj only and skips the output counter-rotation); layers that "
         "cannot be folded exactly (quantized or fused weights, other attention classes) keep the run-time "
         "rotation and the log says why. Folded weights cannot be updated in place: with it on, "
         "update_weights_from_disk / _tensor / _distributed / _ipc (and init_weights_update_group) are "
         "refused. off (default) keeps the unfolded path, for checking.",
         choices=("on", "off")),
    Flag("oscar_skip_layers", "--oscar-skip-layers", "skip_layers", str,
         "INT2 KV cache: layers that keep SGLang's BF16 cache and attention: none (default), sliding or full "
         "(every layer of that kind of a hybrid sliding-window model, e.g. Gemma-4, GPT-OSS), or "
         "comma-separated global layer ids that make up exactly one kind."),
    Flag("oscar_mla_storage", "--oscar-mla-storage", "mla_storage", str,
         "INT2 KV cache of MLA models (DeepSeek-V2/V3): latent (default: the INT2 latent c_kv + BF16 k_pe, "
         "one row per token and layer, read by absorbed MLA attention) or expanded (per head K = [k_nope | k_pe] "
         "and V as INT2 MHA rows under SGLang's non-absorbed MHA forward: DeepSeek-V3 12,800 bytes per token "
         "and layer at group 64 against the latent's 272; takes a K/V rotation file of the expanded geometry, "
         "`sglang-oscar hadamard --mla-storage expanded`).",
         choices=("latent", "expanded")),
)
K_ROTATION_ENV = "SGLANG_OSCAR_K_ROTATION_PATH"
V_ROTATION_ENV = "SGLANG_OSCAR_V_ROTATION_PATH"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add the OSCAR flags to an argparse parser (defaults ``None`` so "not given" is visible)."""
    group = parser.add_argument_group("OSCAR INT2 KV cache (sglang-oscar)")
    existing = {s for a in parser._actions for s in a.option_strings}
    for f in FLAGS:
        if f.option in existing:
            continue
        group.add_argument(f.option, dest=f.dest, type=f.type, default=None, choices=f.choices, help=f.help)


def resolve_config(values: dict[str, Any], environ: dict[str, str] | None = None) -> tuple[OscarConfig, list[str]]:
    """Build the :class:`OscarConfig` from parsed flag values and the environment.

    Args:
        values: ``{flag dest: value or None}``.
        environ: environment (default ``os.environ``).

    Returns:
        ``(config, notes)``; ``notes`` are log lines about aliases used or overridden.

    Raises:
        ValueError: invalid values (from :class:`OscarConfig`) or a malformed alias, naming it.
    """
    env = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {}
    notes: list[str] = []
    given: list[str] = []  # where each value came from, for the error of an invalid combination
    for f in FLAGS:
        val = values.get(f.dest)
        env_val = env.get(f.env) if f.env else None
        if val is not None:
            if env_val is not None:
                notes.append(f"{f.option} overrides environment alias {f.env}={env_val!r}")
            kwargs[f.field] = val
            given.append(f"{f.option} {val}")
            continue
        if env_val is None or env_val == "":
            continue
        try:
            kwargs[f.field] = _ENV_PARSERS.get(f.env, f.type)(env_val)
        except ValueError as exc:
            raise ValueError(f"environment variable {f.env}={env_val!r} is not a valid {f.option} value: {exc}") from None
        notes.append(f"using environment alias {f.env}={env_val!r} for {f.option}")
        given.append(f"{f.env}={env_val} (alias of {f.option})")
    if values.get("oscar_rotation") is not None and env.get(V_ROTATION_ENV):
        notes.append(f"--oscar-rotation overrides environment alias {V_ROTATION_ENV}={env[V_ROTATION_ENV]!r} (the "
                     "flag's file holds K and V)")
    if values.get("oscar_rotation") is None:
        k_path, v_path = env.get(K_ROTATION_ENV) or None, env.get(V_ROTATION_ENV) or None
        if k_path and k_path.endswith(".pt"):
            if not v_path:
                raise ValueError(
                    f"{K_ROTATION_ENV} is a .pt file but {V_ROTATION_ENV} is not set: the upstream aliases name the K "
                    "and V .pt files of an MHA/GQA model and need both; or convert them with `sglang-oscar convert --k "
                    "K.pt --v V.pt --out FILE` and pass --oscar-rotation FILE (an MLA model takes one latent rotation "
                    ".safetensors file from `sglang-oscar fit`: pass it with --oscar-rotation)"
                )
            kwargs["rotation_path"], kwargs["rotation_v_path"] = k_path, v_path
        elif v_path:
            raise ValueError(
                f"{V_ROTATION_ENV} is set but {K_ROTATION_ENV} is not an upstream K .pt file"
                f" ({k_path!r}): set both to the K and V .pt files, or only {K_ROTATION_ENV} (or --oscar-rotation) "
                "to a rotation file or directory"
            )
    try:
        config = OscarConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{exc} (INT2 settings given: {'; '.join(given) or 'none'})") from None
    if config.group_size is not None:
        # 2 code bits per element plus one (scale, zero) pair per group (docs/format.md)
        bits = 2 + 16 * scale_torch_dtype(config.scale_dtype).itemsize / config.group_size
        if bits >= 16:
            raise ValueError(
                f"--kv-cache-quant-group-size {config.group_size} with {config.scale_dtype} (scale, zero) pairs costs "
                f"{bits:g} bits per cached element, no less than BF16's 16: the INT2 cache would not be smaller; "
                f"pick a larger group, e.g. 64 or 128 (or leave it unset) (INT2 settings given: {'; '.join(given)})")
    return config, notes


def config_to_env(config: OscarConfig) -> str:
    """Serialise a config for :data:`CONFIG_ENV`."""
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def config_from_env(environ: dict[str, str] | None = None) -> OscarConfig | None:
    """The config carried in :data:`CONFIG_ENV`, or ``None`` if unset.

    Raises:
        ValueError: the variable is not a JSON object of :class:`OscarConfig` fields (it is written
            by the ``--kv-cache-dtype int2`` launch for its subprocesses; unset it to start clean),
            or a field's value is invalid (``OscarConfig``'s own checks).
    """
    env = os.environ if environ is None else environ
    raw = env.get(CONFIG_ENV)
    if not raw:
        return None
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{CONFIG_ENV} is not valid JSON ({e}); it is set by the --kv-cache-dtype int2 launch "
                         f"for its subprocesses: unset it (or pass the --oscar-* flags instead)") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{CONFIG_ENV} must be a JSON object of OscarConfig fields, got {type(fields).__name__}; "
                         "unset it (or pass the --oscar-* flags instead)")
    try:
        return OscarConfig(**fields)
    except TypeError as e:  # unknown field names
        raise ValueError(f"{CONFIG_ENV}: {e}; unset it (or pass the --oscar-* flags instead)") from None
