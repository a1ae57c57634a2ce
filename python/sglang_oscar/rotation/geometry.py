"""Attention geometry of a model (which layers attend, their kv heads and head dims).

Built from a Hugging Face ``config.json`` (a dict, a path, or a ``PretrainedConfig``). Layer
ids are **global** layer indices of the model, so sparse attention layers of hybrid models
(linear-attention layers skipped) keep their real ids.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from ..quant.packing import check_head_dim

# Config keys that mark layer kinds in ``layer_types`` lists (transformers >= 4.5x).
_FULL = {"full_attention", "attention", "global_attention", "global"}
_SLIDING = {"sliding_attention", "sliding_window", "local_attention", "chunked_attention", "local"}
_LINEAR = {"linear_attention", "mamba", "gated_deltanet", "kda", "conv"}


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """One attention layer: global ``layer_id``, total ``num_kv_heads`` (before TP sharding),
    ``head_dim_k``/``head_dim_v`` (elements), and ``sliding_window`` (keys attended,
    including the query's own position; ``None`` for full attention)."""

    layer_id: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    sliding_window: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of a model.

    Attributes:
        model_type: HF ``model_type``.
        num_hidden_layers: all decoder layers (attention or not).
        num_q_heads: query heads of the attention layers.
        layers: attention layers in order of ``layer_id``.
        attention_kind: ``"mha"`` (MHA/GQA, per-head K/V rows) or ``"mla"`` (latent c_kv).
        kv_lora_rank, qk_rope_head_dim: MLA latent sizes (``None`` for MHA).
    """

    model_type: str
    num_hidden_layers: int
    num_q_heads: int
    layers: tuple[LayerGeometry, ...]
    attention_kind: str = "mha"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None

    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    def layer(self, layer_id: int) -> LayerGeometry:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise KeyError(f"layer {layer_id} is not an attention layer of this {self.model_type} model")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelGeometry:
        d = dict(d)
        d["layers"] = tuple(LayerGeometry(**x) for x in d["layers"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, config) -> ModelGeometry:
        """Geometry from a HF config: ``PretrainedConfig``, dict, ``config.json`` path or model dir.

        Handles MHA/GQA decoders (Llama, Qwen2/3, Qwen3-MoE, Mistral, MiniMax), sliding/full
        layer mixes (Gemma-3/4: ``layer_types``, ``sliding_window``, Gemma-4
        ``global_head_dim`` / ``num_global_key_value_heads``), hybrids with linear-attention
        layers (skipped), and MLA configs (``kv_lora_rank``; attention_kind ``"mla"``).
        Multimodal configs are read through their ``text_config``.

        Raises:
            ValueError: the config has no attention layers or lacks head counts.
            FileNotFoundError: a path that does not exist.
        """
        cfg = _as_dict(config)
        if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        model_type = str(cfg.get("model_type", "unknown"))
        try:
            n_layers = int(cfg["num_hidden_layers"])
            n_q = int(cfg["num_attention_heads"])
        except KeyError as exc:
            raise ValueError(f"config of model_type {model_type!r} has no {exc.args[0]!r}: not a decoder LM config") from None
        n_kv = int(cfg.get("num_key_value_heads") or n_q)
        hidden = cfg.get("hidden_size")
        head_dim = cfg.get("head_dim") or (hidden // n_q if hidden else None)
        if head_dim is None:
            raise ValueError(f"config of model_type {model_type!r} has neither head_dim nor hidden_size")

        if n_kv <= 0 or n_q % n_kv:
            raise ValueError(f"config of model_type {model_type!r}: {n_q} attention heads are not a multiple of {n_kv} kv heads")
        types = cfg.get("layer_types")
        if not types:
            # No per-layer list: a set sliding_window (Mistral-style) applies to every layer.
            every_sliding = cfg.get("sliding_window") and cfg.get("use_sliding_window") is not False
            types = ["sliding_attention" if every_sliding else "full_attention"] * n_layers
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
        sliding_window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            sliding_window = None

        if cfg.get("kv_lora_rank"):
            layers = tuple(
                LayerGeometry(i, 1, int(cfg["kv_lora_rank"]), int(cfg["kv_lora_rank"]))
                for i, t in enumerate(types)
                if t not in _LINEAR
            )
            if not layers:
                raise ValueError(f"model_type {model_type!r} has no attention layers")
            return cls(model_type, n_layers, n_q, layers, "mla", int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim") or 0))

        global_dim = cfg.get("global_head_dim") or head_dim
        global_kv = cfg.get("num_global_key_value_heads") or n_kv
        layers = []
        for i, t in enumerate(types):
            if t in _LINEAR:
                continue
            if t in _SLIDING and sliding_window:
                layers.append(LayerGeometry(i, n_kv, int(head_dim), int(cfg.get("v_head_dim") or head_dim), int(sliding_window)))
            elif t in _FULL or t in _SLIDING:
                is_global = t in _FULL and "global_head_dim" in cfg
                d = int(global_dim if is_global else head_dim)
                kv = int(global_kv if is_global else n_kv)
                layers.append(LayerGeometry(i, kv, d, d if is_global else int(cfg.get("v_head_dim") or d)))
            else:
                raise ValueError(f"layer {i} has unknown layer type {t!r} in model_type {model_type!r}")
        if not layers:
            raise ValueError(f"model_type {model_type!r} has no attention layers (all {n_layers} layers are linear/recurrent)")
        for layer in layers:
            try:
                check_head_dim(layer.head_dim_k)
                check_head_dim(layer.head_dim_v)
            except ValueError as exc:
                raise ValueError(f"model_type {model_type!r} layer {layer.layer_id}: {exc}") from None
        return cls(model_type, n_layers, n_q, tuple(layers))


def _as_dict(config) -> dict[str, Any]:
    """A config as a dict, with derived keys (e.g. Gemma's ``layer_types`` from
    ``sliding_window_pattern``) filled in by the matching ``transformers`` config class when
    ``model_type`` is known to transformers."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"model config {path} does not exist (a local config.json or model directory is read; "
                "for a Hub id, download the model's config.json, or run `sglang-oscar fit --method hadamard "
                "--config HUB_ID --out FILE.safetensors`, which writes a local copy next to the rotation)")
        try:
            with open(path) as f:
                config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model config {path} is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"model config {path} must hold a JSON object, got {type(config).__name__}")
    if hasattr(config, "to_dict") and not isinstance(config, dict):
        return config.to_dict()
    if not isinstance(config, dict):
        raise TypeError(f"cannot read a model config from {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type:
        try:
            from transformers import AutoConfig

            kwargs = {k: v for k, v in config.items() if k != "model_type"}
            return {**config, **AutoConfig.for_model(model_type, **kwargs).to_dict()}
        except Exception:  # unknown to this transformers version: read the keys as they are
            return config
    return config


def attention_logit_softcap(config) -> float | None:
    """The attention-logit soft cap of a HF config (``attn_logit_softcapping``, Gemma-2 style; read
    through ``text_config`` for multimodal configs), or ``None`` when the model has none.

    Args:
        config: ``PretrainedConfig``, dict, ``config.json`` path or model directory.

    Raises:
        FileNotFoundError: a path that does not exist.
    """
    cfg = _as_dict(config)
    for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        cap = c.get("attn_logit_softcapping")
        if cap:
            return float(cap)
    return None
