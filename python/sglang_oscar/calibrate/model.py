"""Loading a ``transformers`` causal LM for calibration, and its attention geometry."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from ..rotation.geometry import ModelGeometry
from . import CalibrationError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str | None = None) -> torch.dtype:
    """``"auto"`` -> bfloat16 on CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        on_gpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        return torch.bfloat16 if on_gpu else torch.float32
    if dtype not in _DTYPES:
        raise CalibrationError(f"dtype {dtype!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def config_dict(config) -> dict[str, Any]:
    """JSON-serialisable dict of a ``PretrainedConfig``."""
    d = config.to_dict()
    return json.loads(json.dumps(d, default=str))


def _kda_layer_types(d: dict[str, Any]) -> dict[str, Any]:
    """Add ``layer_types`` to a KDA + MLA hybrid config (Kimi-K3 / Kimi-Linear style) that has none.

    Such configs list their linear-attention layers as ``linear_attn_config.kda_layers`` (or the
    attention layers as ``full_attn_layers``), **1-based** (spec §3.6); without ``layer_types``
    every layer would be taken for an attention layer.

    Raises:
        CalibrationError: a listed layer outside ``1..num_hidden_layers``.
    """
    nested = isinstance(d.get("text_config"), dict) and "num_hidden_layers" not in d
    text = d["text_config"] if nested else d
    lac = text.get("linear_attn_config")
    if text.get("layer_types") or not isinstance(lac, dict) or "num_hidden_layers" not in text:
        return d
    n = int(text["num_hidden_layers"])
    if lac.get("kda_layers"):
        linear, listed = {int(i) for i in lac["kda_layers"]}, "kda_layers"
    elif lac.get("full_attn_layers"):
        listed = "full_attn_layers"
        linear = set(range(1, n + 1)) - {int(i) for i in lac["full_attn_layers"]}
    else:
        return d
    bad = sorted(i for i in {int(i) for i in lac[listed]} if not 1 <= i <= n)
    if bad:
        raise CalibrationError(f"linear_attn_config.{listed} holds {bad[:8]}, outside the 1-based layers 1..{n}")
    text = {**text, "layer_types": ["linear_attention" if i + 1 in linear else "full_attention" for i in range(n)]}
    return {**d, "text_config": text} if nested else text


def geometry_of(config) -> ModelGeometry:
    """:meth:`ModelGeometry.from_hf_config` with calibration-level error messages.

    KDA + MLA hybrids without ``layer_types`` get them from ``linear_attn_config``
    (:func:`_kda_layer_types`), so only their MLA layers count as attention layers.

    Raises:
        CalibrationError: no attention layers, or a config OSCAR cannot read.
    """
    d = config if isinstance(config, dict) else config_dict(config)
    d = _kda_layer_types(d)
    model_type = d.get("model_type", "unknown")
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    if "num_attention_heads" not in text:
        raise CalibrationError(
            f"model_type {model_type!r} has no attention layers (its config has no num_attention_heads): "
            "OSCAR quantizes the KV cache of attention layers only"
        )
    try:
        return ModelGeometry.from_hf_config(d)
    except ValueError as exc:
        raise CalibrationError(f"cannot read the attention layers of this {model_type!r} config: {exc}") from None


def model_id_of(model) -> str:
    """The id/path ``model`` was loaded from (``config._name_or_path``), else its class name."""
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or type(model).__name__)


_MODEL_PATH_HINT = "pass a local HF checkpoint directory or a Hub id like Qwen/Qwen3-8B"


def looks_local(path: str) -> bool:
    """Whether ``path`` names a local directory rather than a Hugging Face Hub id.

    Local: anything that exists, an absolute path, a path starting with ``./``, ``../`` or
    ``~``, ``.``/``..``, one with more than one ``/`` (a Hub id is ``name`` or
    ``namespace/name``), or ``dir/name`` whose ``dir`` is an existing local directory (e.g.
    ``runs/small_lm`` before training). Anything else (``Qwen/Qwen3-8B``, ``gpt2``) may be a Hub id.
    """
    p = str(path)
    if os.path.exists(os.path.expanduser(p)):
        return True
    return (os.path.isabs(p) or p in (".", "..") or p.startswith(("./", "../", "~", ".\\", "..\\"))
            or p.count("/") > 1 or ("/" in p and os.path.isdir(p.split("/", 1)[0])))


def check_model_path(path: str) -> str:
    """``path`` with ``~`` expanded; raise early for a local-looking path that is no directory.

    A Hub id is returned unchanged (nothing is downloaded here).

    Raises:
        FileNotFoundError: a local-looking ``path`` that does not exist.
        NotADirectoryError: a local ``path`` that is a file.
    """
    p = str(path)
    if not looks_local(p):
        return p
    full = os.path.expanduser(p)
    if not os.path.exists(full):
        raise FileNotFoundError(f"model directory {p} does not exist ({_MODEL_PATH_HINT})")
    if not os.path.isdir(full):
        raise NotADirectoryError(f"model path {p} is a file, not a model directory ({_MODEL_PATH_HINT})")
    return full


def load_model(
    path: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = None,
    device_map: str | None = None,
    trust_remote_code: bool = False,
):
    """Load ``(model, tokenizer)`` for inference.

    ``device_map="auto"`` (accelerate) spreads a big model over the GPUs of one host (layers,
    not heads: every head of a layer stays on one device). Without it the model goes to
    ``device`` (default: ``cuda`` if available, else ``cpu``).

    Raises:
        CalibrationError: a config that is not a causal LM, or no tokenizer.
        FileNotFoundError, NotADirectoryError: a local path (absolute, ``./``, ``../``, ``~``) that
            is not a directory (:func:`check_model_path`).
        ModuleNotFoundError: ``device_map`` without ``accelerate`` (the ``[calibrate]`` extra).
    """
    if device_map:
        # transformers needs accelerate for a device map; importing it first makes a missing
        # [calibrate] extra a ModuleNotFoundError the CLI names, before any weights load.
        import accelerate  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = check_model_path(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if not os.path.exists(path) and "/" not in path:
            raise FileNotFoundError(f"model {path} is neither a local directory nor a hub id ({_MODEL_PATH_HINT})") from None
        raise CalibrationError(f"cannot read the config of {path}: {exc}") from None
    geometry_of(config)  # fail early with a clear message
    torch_dtype = resolve_dtype(dtype, device)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if device_map:
        kwargs["device_map"] = device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise CalibrationError(
                f"unsupported architecture: {type(config).__name__} (model_type {config.model_type!r}) is not a "
                "causal LM in this transformers version"
            ) from None
        raise
    if not device_map:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise CalibrationError(f"cannot load a tokenizer from {path}: {exc}") from None
    return model, tokenizer


def input_device(model) -> torch.device:
    """Device of the input embeddings (first device under ``device_map``)."""
    try:
        return model.get_input_embeddings().weight.device
    except Exception:
        return next(model.parameters()).device


# ----------------------------------------------------------------------------- model fingerprint
FINGERPRINT_KEYS = ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size")


def model_name(name_or_path: str) -> str:
    """Comparable name of a model id or path: its last component, lower case.

    ``/models/Qwen3-8B`` and ``Qwen/Qwen3-8B`` both give ``qwen3-8b``; a Hugging Face cache
    snapshot ``.../models--Qwen--Qwen3-8B/snapshots/<hash>`` gives ``qwen3-8b`` too.
    """
    p = str(name_or_path).replace("\\", "/").rstrip("/")
    m = re.search(r"models--[^/]+?--([^/]+)/snapshots/[^/]+$", p)
    return (m.group(1) if m else p.rsplit("/", 1)[-1]).lower()


def config_fingerprint(config, name_or_path: str | None = None) -> dict[str, Any]:
    """What identifies a model beyond its attention geometry (spec lesson: statistics and
    rotations must come from the model they are used with).

    Keys: ``model_type``, ``hidden_size``, ``vocab_size``, ``num_hidden_layers``,
    ``intermediate_size`` (read from ``text_config`` for multimodal configs when not at the top
    level) and ``name`` (:func:`model_name` of ``name_or_path``, else of the config's
    ``_name_or_path``), each only when known.
    """
    d = config if isinstance(config, dict) else config_dict(config)
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    fp: dict[str, Any] = {}
    for key in FINGERPRINT_KEYS:
        value = d.get(key, text.get(key))
        if value is not None:
            fp[key] = value
    name = name_or_path or d.get("_name_or_path") or d.get("name_or_path")
    if name:
        fp["name"] = model_name(name)
    return fp


def _same_value(key: str, x: Any, y: Any) -> bool:
    if key == "model_type" and isinstance(x, str) and isinstance(y, str):
        # a multimodal checkpoint's config (gemma3, qwen3_5_moe) and its text model's (gemma3_text, the type
        # calibration records when it loads the language model alone) name one model
        return x.removesuffix("_text") == y.removesuffix("_text")
    return x == y


def fingerprint_mismatches(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """Keys known in both fingerprints whose values differ, as ``"key: a vs b"``; a ``model_type`` and the
    same type with a ``_text`` suffix (a multimodal wrapper and its language model) count as equal."""
    if not a or not b:
        return []
    return [f"{k}: {a[k]!r} vs {b[k]!r}" for k in sorted(set(a) & set(b)) if not _same_value(k, a[k], b[k])]


def check_same_model(have: dict[str, Any] | None, want: dict[str, Any] | None, what: str, target: str,
                     allow_other_model: bool = False) -> None:
    """Refuse ``what`` (statistics / a rotation) made for another model than ``target``.

    Both fingerprints come from :func:`config_fingerprint`; only keys known in both are compared.

    Raises:
        CalibrationError: a differing key, unless ``allow_other_model``.
    """
    bad = fingerprint_mismatches(have, want)
    if bad and not allow_other_model:
        raise CalibrationError(
            f"{what} was made for another model than {target} (same attention geometry, but "
            + "; ".join(bad)
            + "): statistics and rotations are model-specific (spec §8.5: they do not transfer even between "
            "GLM-5.2 and GLM-5.3). Calibrate this model, or pass --allow-other-model if this is intended "
            "(e.g. the same checkpoint under another name)."
        )
