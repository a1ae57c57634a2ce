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
# "minimax_m3_sparse": MiniMax-M3's MSA layers (transformers 5.12 ``minimax_m3_vl``) cache every
# token like full attention; the sparse block selection only changes which rows are read.
_FULL = {"full_attention", "attention", "global_attention", "global", "minimax_m3_sparse"}
_SLIDING = {"sliding_attention", "sliding_window", "local_attention", "chunked_attention", "local"}
_LINEAR = {"linear_attention", "mamba", "gated_deltanet", "kda", "conv"}


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """One attention layer, as the INT2 pool and backend need it.

    Attributes:
        layer_id: global layer index.
        num_kv_heads: total kv heads (before TP sharding).
        head_dim_k, head_dim_v: elements per cached K / V row.
        sliding_window: keys attended including the query's own position (HF ``sliding_window``;
            SGLang's ``sliding_window_size`` is this minus one, ``reference/masks.py``), or
            ``None`` for full attention.
        has_sinks: the layer has learned attention-sink logits (GPT-OSS ``sinks``), which the
            backend adds to the softmax denominator.
        v_shares_k_proj: V is computed from K's projection (Gemma-4 ``attention_k_eq_v``: no
            ``v_proj`` weights). Says nothing about the cache: see ``k_eq_v``.
        k_eq_v: the cached V is the cached K bit for bit, so the cache stores one tensor and V is
            read from K's codes (rotation ``R_v = R_k``). ``False`` for every config SGLang 0.5.16
            serves: Gemma-4's ``attention_k_eq_v`` layers cache ``v_norm(x W_k)`` next to
            ``RoPE(k_norm(x W_k))`` (``reference/attention.py`` cites the lines), which differ.
            (A recipe's ``[geometry.full] k_eq_v`` records the config's ``attention_k_eq_v``, i.e.
            this class's ``v_shares_k_proj``.)
        index_num_heads, index_head_dim: MiniMax-M3 sparse (MSA) layers: the index branch's query
            heads and width; its single index kv head is cached by SGLang in BF16 in a side pool
            (``MiniMaxSparseKVPool.index_kv_pool`` / ``index_k_pool``), never in the INT2 rows.
            ``None`` for dense layers.
        index_has_value: the index branch also caches an index V row (``False`` where the
            config's ``sparse_disable_index_value`` flags the layer: K-only side pool).
    """

    layer_id: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    sliding_window: int | None = None
    has_sinks: bool = False
    v_shares_k_proj: bool = False
    k_eq_v: bool = False
    index_num_heads: int | None = None
    index_head_dim: int | None = None
    index_has_value: bool = False

    @property
    def is_sparse(self) -> bool:
        """A MiniMax-M3 sparse layer (has an index branch)."""
        return self.index_head_dim is not None

    @property
    def kind(self) -> str:
        """``"sliding"`` (a sliding window is set) or ``"full"``."""
        return "full" if self.sliding_window is None else "sliding"

    @property
    def group_key(self) -> tuple[str, int, int, int, bool]:
        """``(kind, num_kv_heads, head_dim_k, head_dim_v, k_eq_v)``: layers with equal keys share
        one INT2 pool (same row layout; the window is the backend's and the allocator's)."""
        return (self.kind, self.num_kv_heads, self.head_dim_k, self.head_dim_v, self.k_eq_v)


@dataclasses.dataclass(frozen=True)
class GeometryGroup:
    """Layers sharing one cache geometry (:attr:`LayerGeometry.group_key`): one INT2 pool.

    Attributes:
        kind: ``"sliding"`` or ``"full"``.
        num_kv_heads, head_dim_k, head_dim_v, k_eq_v: as in :class:`LayerGeometry`.
        sliding_windows: the distinct windows of the group's layers (empty for full layers).
        layer_ids: global ids of the group's layers, ascending.
    """

    kind: str
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    k_eq_v: bool
    sliding_windows: tuple[int, ...]
    layer_ids: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int, int, int, bool]:
        return (self.kind, self.num_kv_heads, self.head_dim_k, self.head_dim_v, self.k_eq_v)

    def describe(self) -> str:
        """One line for logs and errors, e.g. ``sliding (window 1024): 40 layers x 8 kv heads x D 256/256``."""
        win = f" (window {'/'.join(map(str, self.sliding_windows))})" if self.sliding_windows else ""
        kv = ", K shared as V" if self.k_eq_v else ""
        return (f"{self.kind}{win}: {len(self.layer_ids)} layers x {self.num_kv_heads} kv heads x "
                f"D {self.head_dim_k}/{self.head_dim_v}{kv}")


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
        qk_nope_head_dim, v_head_dim: MLA per-head sizes of the up-projection ``kv_b_proj``
            (``w_kc [H, N, R]``, ``w_vc [H, R, V]``; expanded-MHA storage caches K ``N + P`` and V
            ``V`` per head); ``None`` for MHA or when the config omits them.
        index_topk, index_head_dim: GLM-5 / DeepSeek-V3.2 sparse attention (DSA): tokens the
            lightning indexer selects per query and its key width (SGLang keeps the indexer's key
            buffer itself; the INT2 latent is read for the selected tokens only); ``None`` for
            dense models. Not part of :meth:`cache_shapes` (calibration statistics do not depend on them).
        linear_layer_ids: global ids of the linear-attention (GDN / KDA / mamba) layers, which have
            no KV cache (SGLang keeps their recurrent state in its mamba pool); empty for models
            without them. Not part of :meth:`cache_shapes` (they follow from the layer ids).
    """

    model_type: str
    num_hidden_layers: int
    num_q_heads: int
    layers: tuple[LayerGeometry, ...]
    attention_kind: str = "mha"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    index_topk: int | None = None
    index_head_dim: int | None = None
    linear_layer_ids: tuple[int, ...] = ()

    @property
    def layer_ids(self) -> list[int]:
        return [layer.layer_id for layer in self.layers]

    def pool_index(self, layer_id: int) -> int:
        """Index of an attention layer in a pool that holds only the attention layers.

        SGLang 0.5.16's ``HybridLinearKVPool`` gives its inner KV pool one buffer per full-attention
        layer, in ascending global id (``full_attention_layer_id_mapping = {id: i for i, id in
        enumerate(full_attention_layer_ids)}``, ``srt/mem_cache/memory_pool.py:3593-3595``); for a
        model without linear layers this is the layer id itself.

        Raises:
            KeyError: not an attention layer (the message says when it is a linear-attention layer).
        """
        for i, layer in enumerate(self.layers):
            if layer.layer_id == layer_id:
                return i
        if layer_id in self.linear_layer_ids:
            raise KeyError(f"layer {layer_id} of this {self.model_type} model is a linear-attention layer: it has no KV cache")
        raise KeyError(f"layer {layer_id} is not an attention layer of this {self.model_type} model")

    def layer(self, layer_id: int) -> LayerGeometry:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        if layer_id in self.linear_layer_ids:
            raise KeyError(f"layer {layer_id} of this {self.model_type} model is a linear-attention layer: it has no KV cache")
        raise KeyError(f"layer {layer_id} is not an attention layer of this {self.model_type} model")

    def groups(self) -> tuple[GeometryGroup, ...]:
        """Layers grouped by cache geometry (:attr:`LayerGeometry.group_key`), one INT2 pool each,
        ordered by their first layer. A uniform model has one group; Gemma-4-12B two (sliding
        8 x 256, full 1 x 512)."""
        by_key: dict[tuple, list[LayerGeometry]] = {}
        for layer in self.layers:
            by_key.setdefault(layer.group_key, []).append(layer)
        return tuple(
            GeometryGroup(*key, tuple(sorted({x.sliding_window for x in ls if x.sliding_window is not None})),
                          tuple(x.layer_id for x in ls))
            for key, ls in by_key.items()
        )

    def group_of(self, layer_id: int) -> GeometryGroup:
        """The :class:`GeometryGroup` holding ``layer_id``.

        Raises:
            KeyError: not an attention layer of this model.
        """
        key = self.layer(layer_id).group_key
        return next(g for g in self.groups() if g.key == key)

    @property
    def has_sliding(self) -> bool:
        return any(layer.kind == "sliding" for layer in self.layers)

    def expanded(self) -> ModelGeometry:
        """The MHA geometry of expanded-MHA storage of an MLA model (``--oscar-mla-storage expanded``):
        the same layer ids, ``num_q_heads`` kv heads, K ``qk_nope_head_dim + qk_rope_head_dim``
        (DeepSeek-V3: 192) and V ``v_head_dim`` (128) per head.

        Raises:
            ValueError: not an MLA geometry, or the config lacked the per-head sizes.
        """
        if self.attention_kind != "mla":
            raise ValueError(f"model_type {self.model_type!r} is not an MLA model: it has no expanded storage")
        if not self.qk_nope_head_dim or not self.v_head_dim:
            raise ValueError(f"model_type {self.model_type!r}: the config has no qk_nope_head_dim / v_head_dim")
        dk, dv = self.qk_nope_head_dim + (self.qk_rope_head_dim or 0), self.v_head_dim
        check_head_dim(dk)
        check_head_dim(dv)
        return ModelGeometry(self.model_type, self.num_hidden_layers, self.num_q_heads,
                             tuple(LayerGeometry(x.layer_id, self.num_q_heads, dk, dv) for x in self.layers),
                             linear_layer_ids=self.linear_layer_ids)

    def cache_shapes(self) -> tuple:
        """What calibration statistics depend on: model-level sizes and per layer (id, kv heads,
        head dims, window); the flags added later (sinks, K/V sharing) are left out so files
        written before them still match."""
        return (self.model_type, self.num_hidden_layers, self.num_q_heads, self.attention_kind, self.kv_lora_rank,
                self.qk_rope_head_dim,
                tuple((x.layer_id, x.num_kv_heads, x.head_dim_k, x.head_dim_v, x.sliding_window) for x in self.layers))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelGeometry:
        d = dict(d)
        d["layers"] = tuple(LayerGeometry(**x) for x in d["layers"])
        d["linear_layer_ids"] = tuple(d.get("linear_layer_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf_config(cls, config) -> ModelGeometry:
        """Geometry from a HF config: ``PretrainedConfig``, dict, ``config.json`` path or model dir.

        Handles MHA/GQA decoders (Llama, Qwen2/3, Qwen3-MoE, Mistral, MiniMax), sliding/full
        layer mixes (Gemma-3/4, GPT-OSS: ``layer_types``, ``sliding_window``), hybrids with
        linear-attention layers (skipped; their ids in ``linear_layer_ids``; Qwen3-Next / Qwen3.5
        from ``full_attention_interval`` as SGLang serves them, :func:`_types_from_full_attention_interval`),
        MiniMax-M2 / M3 (GQA; M3's sparse layers carry their index branch,
        :func:`_minimax_sparse_layers`), and MLA configs (``kv_lora_rank``; attention_kind
        ``"mla"``). Multimodal configs are read through their ``text_config``.

        MLA: every MLA layer is one latent "kv head" of ``kv_lora_rank`` (``num_key_value_heads``
        is ignored: the heads share the latent). DeepSeek-V2/V3/V3.2 and GLM-5 (``glm_moe_dsa``,
        whose ``layer_types`` say ``deepseek_sparse_attention``) have an MLA layer everywhere;
        Kimi-K2.5 (``kimi_k25``) is read through its DeepSeek-V3 ``text_config``; Kimi-Linear
        (``kimi_linear``) and its successors list their KDA linear-attention layers in
        ``linear_attn_config["kda_layers"]``, **1-based** (SGLang 0.5.16
        ``srt/configs/kimi_linear.py:139-143``: layer ``i`` is KDA iff ``i + 1`` is listed), the
        MLA layers in ``full_attn_layers`` (1-based too); only the MLA layers are returned.

        Gemma-4 (HF names: base keys for the sliding layers, ``global_*`` for the full ones):
        full layers get ``global_head_dim`` and, when set, ``num_global_key_value_heads`` -- as
        SGLang 0.5.16 remaps them (``sglang/srt/utils/hf_transformers/config.py:159-185``: base =
        full, ``swa_*`` = sliding; transformers uses the global kv heads only with
        ``attention_k_eq_v``, which every released config sets together); ``attention_k_eq_v``
        marks the full layers ``v_shares_k_proj`` (not ``k_eq_v``: their cached V differs from K).
        A config in SGLang's names (the served ``model_config.hf_config``: ``swa_head_dim`` /
        ``swa_num_key_value_heads`` set) is read in those: sliding layers from ``swa_*``, full
        layers from the base keys.
        Attention sinks: every layer of ``gpt_oss`` (SGLang ``model_config.py``
        ``_detect_attention_sinks``: GPT-OSS always creates them, ``models/gpt_oss.py:391``), and
        MiMo-V2's ``add_swa_attention_sink_bias`` / ``add_full_attention_sink_bias`` per kind.

        Raises:
            ValueError: the config has no attention layers, lacks head counts, holds a count that is not
                a positive integer (named), or is an MLA model type without ``kv_lora_rank``.
            FileNotFoundError: a path that does not exist.
        """
        cfg = _as_dict(config)
        if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
            cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
        model_type = str(cfg.get("model_type", "unknown"))
        for key in ("num_hidden_layers", "num_attention_heads"):
            if cfg.get(key) is None:
                raise ValueError(f"config of model_type {model_type!r} has no {key!r}: not a decoder LM config")
        n_layers = _count(cfg, "num_hidden_layers", model_type)
        n_q = _count(cfg, "num_attention_heads", model_type)
        n_kv = _count(cfg, "num_key_value_heads", model_type, default=n_q)
        if cfg.get("head_dim") is None and cfg.get("hidden_size") is None:
            raise ValueError(f"config of model_type {model_type!r} has neither head_dim nor hidden_size")
        head_dim = (_count(cfg, "head_dim", model_type) if cfg.get("head_dim") is not None
                    else _count(cfg, "hidden_size", model_type) // n_q)

        types = cfg.get("layer_types")
        if model_type in _INTERVAL_HYBRIDS:
            types = _types_from_full_attention_interval(cfg, n_layers, model_type)
        if cfg.get("linear_attn_config"):
            types = _types_from_linear_attn_config(cfg["linear_attn_config"], n_layers, model_type)
        if cfg.get("kv_lora_rank"):
            return _mla_geometry(cfg, model_type, n_layers, n_q, types)
        if model_type in _MLA_MODEL_TYPES:
            raise ValueError(f"config of model_type {model_type!r} sets no kv_lora_rank: SGLang serves this model as "
                             "MLA (one latent of kv_lora_rank values per token), so its config.json needs it (512 in the "
                             "released DeepSeek-V3, GLM-5 and Kimi configs)")
        if n_q % n_kv:
            raise ValueError(f"config of model_type {model_type!r}: {n_q} attention heads are not a multiple of {n_kv} kv heads")
        if not types:
            # No per-layer list: a set sliding_window (Mistral-style) applies to every layer.
            every_sliding = cfg.get("sliding_window") and cfg.get("use_sliding_window") is not False
            types = ["sliding_attention" if every_sliding else "full_attention"] * n_layers
        if len(types) != n_layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
        sliding_window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            sliding_window = None
        if sliding_window is not None and any(t in _SLIDING for t in types):
            sliding_window = _count(cfg, "sliding_window", model_type)

        global_dim = _count(cfg, "global_head_dim", model_type, default=head_dim)
        global_kv = _count(cfg, "num_global_key_value_heads", model_type, default=n_kv)
        if n_q % global_kv:
            raise ValueError(f"config of model_type {model_type!r}: {n_q} attention heads are not a multiple of "
                             f"num_global_key_value_heads {global_kv}")
        v_dim = int(cfg.get("v_head_dim") or head_dim)
        # SGLang's own config objects name the kinds the other way (base = full, swa_* = sliding)
        sglang_names = cfg.get("swa_head_dim") is not None or cfg.get("swa_num_key_value_heads") is not None
        if sglang_names:
            swa_dim = int(cfg.get("swa_head_dim") or head_dim)
            slid = (int(cfg.get("swa_num_key_value_heads") or n_kv), swa_dim, int(cfg.get("swa_v_head_dim") or swa_dim))
        else:
            slid = (n_kv, int(head_dim), v_dim)
        sinks_everywhere = model_type == "gpt_oss"
        sinks_sliding = sinks_everywhere or bool(cfg.get("add_swa_attention_sink_bias"))
        sinks_full = sinks_everywhere or bool(cfg.get("add_full_attention_sink_bias"))
        index = _minimax_sparse_layers(cfg, n_layers, model_type)
        layers = []
        for i, t in enumerate(types):
            if t in _LINEAR:
                continue
            if t in _SLIDING and sliding_window:
                layers.append(LayerGeometry(i, *slid, int(sliding_window), has_sinks=sinks_sliding))
            elif t in _FULL or t in _SLIDING:
                is_global = t in _FULL and "global_head_dim" in cfg and not sglang_names
                d = int(global_dim if is_global else head_dim)
                kv = int(global_kv if is_global else n_kv)
                layers.append(LayerGeometry(i, kv, d, d if is_global else int(cfg.get("v_head_dim") or d),
                                            has_sinks=sinks_full,
                                            v_shares_k_proj=bool(t in _FULL and cfg.get("attention_k_eq_v")),
                                            **index.get(i, {})))
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
        linear = tuple(i for i, t in enumerate(types) if t in _LINEAR)
        return cls(model_type, n_layers, n_q, tuple(layers), linear_layer_ids=linear)


# Model types SGLang 0.5.16 always serves as MLA (``srt/configs/model_config.py``: their architectures
# set AttentionArch.MLA and read kv_lora_rank unconditionally).
_MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_linear"}

# Hybrids whose SGLang 0.5.16 config derives the layer kinds from ``full_attention_interval``
# alone (``srt/configs/qwen3_next.py:260-285``; Qwen3.5's text configs subclass it,
# ``srt/configs/qwen3_5.py:15``): the served layout, whatever ``layer_types`` says.
_INTERVAL_HYBRIDS = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"}


def _types_from_full_attention_interval(cfg: dict[str, Any], n_layers: int, model_type: str) -> list[str]:
    """``layer_types`` of a Qwen3-Next / Qwen3.5 hybrid as SGLang serves it: layer ``i`` is full
    attention iff ``(i + 1) % full_attention_interval == 0``, else gated-DeltaNet linear attention.

    SGLang's ``Qwen3NextConfig`` ignores ``layer_types`` (it reads ``full_attention_interval``);
    transformers 5.12 builds ``layer_types`` from the same interval when the config has none
    (``qwen3_5_moe/configuration_qwen3_5_moe.py:114-119``, default 4). A config whose list
    disagrees with its interval would be served with another layout than transformers runs, so
    it is refused rather than guessed.

    Raises:
        ValueError: no interval and no ``layer_types``, a non-positive interval, or a
            ``layer_types`` list that disagrees with the interval.
    """
    listed = cfg.get("layer_types")
    interval = cfg.get("full_attention_interval")
    if interval is None:
        if not listed:
            raise ValueError(f"model_type {model_type!r}: the config has neither full_attention_interval nor layer_types")
        return list(listed)  # transformers filled the list from its default interval
    if isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0:
        raise ValueError(f"model_type {model_type!r}: full_attention_interval must be a positive integer, got "
                         f"{interval!r}")
    served = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if listed and [t in _FULL for t in listed] != [t in _FULL for t in served]:
        bad = [i for i, (a, b) in enumerate(zip(listed, served)) if (a in _FULL) != (b in _FULL)] or [min(len(listed), n_layers)]
        raise ValueError(f"model_type {model_type!r}: layer_types disagrees with full_attention_interval {interval} "
                         f"(first at layer {bad[0]}); SGLang serves the interval's layout, so fix the config")
    return served


def _minimax_sparse_layers(cfg: dict[str, Any], n_layers: int, model_type: str) -> dict[int, dict[str, Any]]:
    """Index-branch fields of the sparse (MSA) layers of a MiniMax-M3 config, by global layer id.

    SGLang 0.5.16 reads ``sparse_attention_config``: layer ``i`` is sparse iff
    ``sparse_attention_freq[i] != 0`` and caches no index V iff ``sparse_disable_index_value[i] != 0``
    (``srt/configs/model_config.py:158-169``); the index branch has ``sparse_num_index_heads``
    query heads and one kv head of ``sparse_index_dim`` (``srt/models/minimax_m3.py:510-511``,
    ``:555-563``: ``total_num_kv_heads=1``, ``v_head_size=0`` when the value is disabled).

    Raises:
        ValueError: per-layer lists of the wrong length or missing head counts.
    """
    sc = cfg.get("sparse_attention_config")
    if not isinstance(sc, dict) or sc.get("sparse_attention_freq") is None:
        # transformers 5.12's flattened form (``minimax_m3_vl/configuration_minimax_m3_vl.py``):
        # ``layer_types`` "minimax_m3_sparse", ``index_n_heads`` / ``index_head_dim``, and no index
        # value path at all (its docstring: the checkpoint disables it on every sparse layer)
        types = cfg.get("layer_types") or []
        if "minimax_m3_sparse" not in types:
            return {}
        sc = {"sparse_attention_freq": [int(t == "minimax_m3_sparse") for t in types],
              "sparse_disable_index_value": [1] * len(types),
              "sparse_num_index_heads": cfg.get("index_n_heads"), "sparse_index_dim": cfg.get("index_head_dim")}
    freq = sc["sparse_attention_freq"]
    no_value = sc.get("sparse_disable_index_value") or [0] * n_layers
    for name, lst in (("sparse_attention_freq", freq), ("sparse_disable_index_value", no_value)):
        if len(lst) != n_layers:
            raise ValueError(f"model_type {model_type!r}: sparse_attention_config {name} has {len(lst)} entries but "
                             f"num_hidden_layers is {n_layers}")
    try:
        heads, dim = int(sc["sparse_num_index_heads"]), int(sc["sparse_index_dim"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"model_type {model_type!r}: the sparse attention config lacks its index head count or "
                         f"width ({exc})") from None
    return {i: {"index_num_heads": heads, "index_head_dim": dim, "index_has_value": not no_value[i]}
            for i, f in enumerate(freq) if f}


def _count(cfg: dict[str, Any], key: str, model_type: str, *, default: int | None = None) -> int:
    """A positive integer config value (``default`` when absent or null), naming the key when it is
    not one: a 0 is refused rather than read as "unset", a string or float is not truncated.

    Raises:
        ValueError: not a positive integer (or absent without a default).
    """
    val = cfg.get(key)
    if val is None and default is not None:
        return default
    if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
        raise ValueError(f"config of model_type {model_type!r}: {key} must be a positive integer, got {val!r}")
    return val


def _optional_int(cfg: dict[str, Any], key: str) -> int | None:
    val = cfg.get(key)
    return None if val is None else int(val)


def _types_from_linear_attn_config(lac: dict[str, Any], n_layers: int, model_type: str) -> list[str]:
    """``layer_types`` of a Kimi-Linear-style hybrid from its 1-based ``kda_layers`` /
    ``full_attn_layers`` (SGLang's rule: ``kda_layers`` decides, ``srt/configs/kimi_linear.py:139-143``).

    Raises:
        ValueError: neither list, ids outside ``1..num_hidden_layers``, or lists that disagree.
    """
    kda, full = lac.get("kda_layers"), lac.get("full_attn_layers")
    if kda is None and full is None:
        raise ValueError(f"model_type {model_type!r}: linear_attn_config has neither kda_layers nor full_attn_layers")
    for name, ids in (("kda_layers", kda), ("full_attn_layers", full)):
        if ids is not None and any(not 1 <= int(i) <= n_layers for i in ids):
            raise ValueError(f"model_type {model_type!r}: linear_attn_config {name} {list(ids)} has ids outside "
                             f"1..{n_layers} (they are 1-based)")
    linear = {int(i) - 1 for i in kda} if kda is not None else set(range(n_layers)) - {int(i) - 1 for i in full}
    if kda is not None and full is not None and set(range(n_layers)) - linear != {int(i) - 1 for i in full}:
        raise ValueError(f"model_type {model_type!r}: linear_attn_config kda_layers and full_attn_layers do not "
                         f"partition the {n_layers} layers")
    return ["linear_attention" if i in linear else "full_attention" for i in range(n_layers)]


def _mla_geometry(cfg: dict[str, Any], model_type: str, n_layers: int, n_q: int, types) -> ModelGeometry:
    """:class:`ModelGeometry` of an MLA config: one latent row (``kv_lora_rank``) per MLA layer."""
    rank = int(cfg["kv_lora_rank"])
    check_head_dim(rank)
    types = types or ["full_attention"] * n_layers
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}")
    layers = tuple(LayerGeometry(i, 1, rank, rank) for i, t in enumerate(types) if t not in _LINEAR)
    if not layers:
        raise ValueError(f"model_type {model_type!r} has no attention layers")
    return ModelGeometry(model_type, n_layers, n_q, layers, "mla", rank, int(cfg.get("qk_rope_head_dim") or 0),
                         linear_layer_ids=tuple(i for i, t in enumerate(types) if t in _LINEAR),
                         qk_nope_head_dim=_optional_int(cfg, "qk_nope_head_dim"),
                         v_head_dim=_optional_int(cfg, "v_head_dim"),
                         index_topk=_optional_int(cfg, "index_topk"),
                         index_head_dim=_optional_int(cfg, "index_head_dim") if cfg.get("index_topk") else None)


def mla_softmax_scale(config) -> float:
    """The softmax scale SGLang 0.5.16 uses for an MLA config (``DeepseekV2AttentionMLA.scaling``).

    ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5`` (``srt/models/deepseek_v2.py:1584``, ``:1605``),
    times ``mscale^2`` when YaRN rope scaling applies (``:1723-1724``): ``mscale = 1`` for
    ``factor <= 1``, else ``0.1 * mscale_all_dim * ln(factor) + 1`` (``srt/configs/model_config.py:1881-1900``,
    ``srt/layers/rotary_embedding/yarn.py:59-62``); the rope dict is ``rope_parameters`` unless its
    ``rope_type`` is ``"default"``, else ``rope_scaling`` (``deepseek_v2.py:2061-2068``), and
    ``apply_yarn_scaling`` / ``apply_scale`` false turn the factor off. Kimi-Linear's MLA layers
    skip RoPE (``srt/models/kimi_linear.py:448``) and with it the factor.

    Args:
        config: HF config (dict, path or ``PretrainedConfig``; multimodal through ``text_config``).

    Raises:
        ValueError: not an MLA config.
    """
    import math

    cfg = _as_dict(config)
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    if not cfg.get("kv_lora_rank") or cfg.get("qk_nope_head_dim") is None:
        raise ValueError(f"model_type {cfg.get('model_type')!r} is not an MLA config (kv_lora_rank, qk_nope_head_dim)")
    scale = (int(cfg["qk_nope_head_dim"]) + int(cfg.get("qk_rope_head_dim") or 0)) ** -0.5
    if cfg.get("model_type") == "kimi_linear":
        return scale
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict) or rope.get("rope_type", "default") == "default":
        rope = cfg.get("rope_scaling") if isinstance(cfg.get("rope_scaling"), dict) else None
    if not rope or not rope.get("apply_yarn_scaling", True) or not rope.get("apply_scale", True):
        return scale
    factor = float(rope.get("factor", 1.0))
    mscale = 1.0 if factor <= 1 else 0.1 * float(rope.get("mscale_all_dim") or 0.0) * math.log(factor) + 1.0
    return scale * mscale * mscale


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
            out = {**config, **AutoConfig.for_model(model_type, **kwargs).to_dict()}
            if isinstance(config.get("text_config"), dict) and isinstance(out.get("text_config"), dict):
                # keep text keys the config class consumed (MiniMax-M3's sparse_attention_config,
                # which SGLang reads as it stands in config.json); transformers' values win
                out["text_config"] = {**config["text_config"], **out["text_config"]}
            return out
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
