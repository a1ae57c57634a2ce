"""Loading a ``transformers`` causal LM for calibration, and its attention geometry."""

from __future__ import annotations

import json
import os
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


def geometry_of(config) -> ModelGeometry:
    """:meth:`ModelGeometry.from_hf_config` with calibration-level error messages.

    Raises:
        CalibrationError: no attention layers, or a config OSCAR cannot read.
    """
    d = config if isinstance(config, dict) else config_dict(config)
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
        raise CalibrationError(f"model_type {model_type!r} is not supported: {exc}") from None


def model_id_of(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or type(model).__name__)


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
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if not os.path.exists(path) and "/" not in path:
            raise FileNotFoundError(f"model {path} is neither a local directory nor a hub id") from None
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


def build_model_from_config(config):
    """``AutoModelForCausalLM.from_config`` with the unsupported-architecture error of :func:`load_model`."""
    from transformers import AutoModelForCausalLM

    geometry_of(config)
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise CalibrationError(
                f"unsupported architecture: {type(config).__name__} (model_type {config.model_type!r}) is not a causal LM"
            ) from None
        raise
