"""``OscarConfig``: every knob of the OSCAR INT2 cache, validated once.

Built from SGLang flags (``plugin``), their environment-variable aliases, or a recipe. The
other parts receive an ``OscarConfig`` and never read flags or the environment themselves.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING

from .quant.int2 import check_clip_ratio, check_quantizer, resolve_group_size, scale_torch_dtype

if TYPE_CHECKING:  # geometry imports quant/packing only, but the config stays import-light
    from .rotation.geometry import ModelGeometry

DEFAULT_K_CLIP = 0.96
DEFAULT_V_CLIP = 0.92
DEFAULT_SINK = 64
DEFAULT_RECENT = 256
DECODE_ENGINES = ("auto", "triton", "gluon")
ROTATE_ENGINES = ("triton", "torch")
SKIP_LAYER_KINDS = ("none", "sliding", "full")
MLA_STORAGES = ("latent", "expanded")


@dataclasses.dataclass(frozen=True)
class OscarConfig:
    """Settings of the OSCAR INT2 KV cache.

    Attributes:
        group_size: elements per (scale, zero) group along head_dim; ``None`` = one per row.
        k_clip_ratio, v_clip_ratio: per-row magnitude clip ratios in ``[0, 1]`` (0 = off).
        sink_tokens: first tokens of every request kept in BF16.
        recent_tokens: last tokens of every request kept in BF16.
        quantizer: ``"uniform"`` or ``"lloyd-max"``.
        scale_dtype: ``"float32" | "float16" | "bfloat16"`` storage of (scale, zero).
        rotation_path: rotation file/directory, or ``None`` for the data-free Hadamard rotation;
            with ``rotation_v_path`` set, the upstream K ``.pt`` file.
        rotation_v_path: the upstream V ``.pt`` file paired with ``rotation_path`` (set by the
            ``SGLANG_OSCAR_K/V_ROTATION_PATH`` aliases), else ``None``.
        decode_engine: decode attention's stage-1 kernel: ``"auto"`` (the Gluon kernel where it
            applies, else Triton; ``kernels.decode.engine.decode_config``), ``"triton"`` or ``"gluon"``
            (refused with the reason for a model it cannot run).
        rotate_engine: how the backend rotates q, the new K/V rows and the output each step:
            ``"triton"`` (default: q, K and V in one launch, ``kernels.rotate.rotate_qkv``, the
            output in a second, ``rotate_heads``) or ``"torch"`` (einsum in fp32, several small
            kernels per product; same fp32 arithmetic up to the summation order). The einsum's
            small launches dominate a batch-1 step: on the H200 the Triton kernels take a Qwen3-8B
            layer's four rotations from 38-62 us to 9-15 us per step (docs/benchmarks.md#rotations).
        skip_layers: which attention layers keep SGLang's BF16 cache instead of INT2
            (``--oscar-skip-layers``): ``"none"`` (default, every layer INT2), ``"sliding"`` (the
            sliding-window layers), ``"full"`` (the full-attention layers) or comma-separated
            global layer ids; stored normalised (:func:`parse_skip_layers`), resolved against a
            model by :func:`resolve_skip_layers`.
        fold_rotations: fold each layer's value rotation and value mean into the ``qkv_proj`` /
            ``o_proj`` weights at load (``--oscar-fold-rotations on|off``,
            :func:`sglang_oscar.backend.fold.fold_value_rotations`; Gemma-4's layers fold ``o_proj``
            only); layers that cannot be folded exactly keep the run-time rotation and the log says
            why. ``False`` keeps the unfolded path (for checking). Booleans or ``"on"/"off"/"true"/"false"/"1"/"0"`` strings.
        mla_storage: what an MLA model (DeepSeek-V2/V3) caches (``--oscar-mla-storage``): ``"latent"``
            (default: the INT2 latent ``c_kv`` + BF16 ``k_pe``, one row per token and layer) or
            ``"expanded"`` (per head K ``[k_nope | k_pe]`` and V as INT2 MHA rows, attended by the MHA
            backend; DeepSeek-V3 at group 64: 12,800 bytes per token and layer, 47x the default latent's 272
            at TP 1, 5.9x per rank at TP 8, docs/design_mla.md#mla-latent-cache).
            Ignored by MHA/GQA models' pools (the launch check refuses ``"expanded"`` for them).
    """

    group_size: int | None = None
    k_clip_ratio: float = DEFAULT_K_CLIP
    v_clip_ratio: float = DEFAULT_V_CLIP
    sink_tokens: int = DEFAULT_SINK
    recent_tokens: int = DEFAULT_RECENT
    quantizer: str = "uniform"
    scale_dtype: str = "float16"
    rotation_path: str | None = None
    rotation_v_path: str | None = None
    decode_engine: str = "auto"
    rotate_engine: str = "triton"
    skip_layers: str = "none"
    fold_rotations: bool = False
    mla_storage: str = "latent"

    def __post_init__(self):
        object.__setattr__(self, "skip_layers", parse_skip_layers(self.skip_layers))
        object.__setattr__(self, "fold_rotations", parse_switch(self.fold_rotations, "fold_rotations"))
        if self.decode_engine not in DECODE_ENGINES:
            raise ValueError(f"decode_engine must be one of {DECODE_ENGINES}, got {self.decode_engine!r}")
        if self.mla_storage not in MLA_STORAGES:
            raise ValueError(f"mla_storage must be one of {MLA_STORAGES}, got {self.mla_storage!r}")
        if self.rotate_engine not in ROTATE_ENGINES:
            raise ValueError(f"rotate_engine must be one of {ROTATE_ENGINES}, got {self.rotate_engine!r}")
        for name in ("k_clip_ratio", "v_clip_ratio"):  # stored as plain floats (JSON, repr)
            object.__setattr__(self, name, check_clip_ratio(getattr(self, name), name))
        check_quantizer(self.quantizer)
        if not isinstance(self.scale_dtype, str):
            raise ValueError(f"scale_dtype must be a dtype name ('float32', 'float16', 'bfloat16'), got {self.scale_dtype!r}")
        scale_torch_dtype(self.scale_dtype)
        if self.rotation_v_path is not None and self.rotation_path is None:
            raise ValueError("rotation_v_path is set without rotation_path (the K file)")
        for name in ("sink_tokens", "recent_tokens"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {val!r}")
            object.__setattr__(self, name, int(val))
        if self.group_size is not None and (isinstance(self.group_size, bool)
                                            or not isinstance(self.group_size, numbers.Integral) or self.group_size <= 0):
            raise ValueError(f"group_size must be a positive integer or unset, got {self.group_size!r}")
        if self.group_size is not None:
            object.__setattr__(self, "group_size", int(self.group_size))

    def check_head_dims(self, *head_dims: int) -> None:
        """Raise ``ValueError`` unless every head_dim is a multiple of 4 divisible by ``group_size``."""
        for d in head_dims:
            resolve_group_size(d, self.group_size)

    def quant_kwargs(self, which: str) -> dict:
        """Keyword arguments of :func:`sglang_oscar.quant.quantize_rows` for ``"k"`` or ``"v"``."""
        return dict(
            group_size=self.group_size,
            clip_ratio=self.k_clip_ratio if which == "k" else self.v_clip_ratio,
            quantizer=self.quantizer,
            scale_dtype=self.scale_dtype,
        )


# Latent group size when --kv-cache-quant-group-size is not given: 128 values per (scale, zero)
# pair, the granularity of the MHA default (one pair per 128-wide head row) and the spec's MLA default.
LATENT_DEFAULT_GROUP = 128


def latent_group_size(config: OscarConfig, kv_lora_rank: int) -> int:
    """The MLA latent's group size: ``config.group_size``, else :data:`LATENT_DEFAULT_GROUP` (the
    whole rank when 128 does not divide it).

    Raises:
        ValueError: a ``config.group_size`` that does not divide ``kv_lora_rank`` (the latent row is
            cut into groups along the rank, not along a head_dim); the message lists the divisors that fit.
    """
    if not config.group_size:
        return LATENT_DEFAULT_GROUP if kv_lora_rank % LATENT_DEFAULT_GROUP == 0 else kv_lora_rank
    if kv_lora_rank % config.group_size:
        fits = [g for g in (128, 64, 32, 16) if kv_lora_rank % g == 0] or [kv_lora_rank]
        raise ValueError(f"group size {config.group_size} does not divide kv_lora_rank {kv_lora_rank} (the MLA "
                         f"latent row is grouped along the rank): pick {' or '.join(map(str, fits[:3]))}, or leave "
                         "it unset")
    return config.group_size


_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def parse_switch(value, name: str) -> bool:
    """A boolean setting from a bool or an ``on/off``-style string (flags, environment, JSON).

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _ON + _OFF:
        return value.strip().lower() in _ON
    raise ValueError(f"{name} must be on or off (true/false, 1/0), got {value!r}")


def parse_skip_layers(spec) -> str:
    """Normalise an ``--oscar-skip-layers`` value: ``"none"``, ``"sliding"``, ``"full"``, or
    ascending unique layer ids joined by commas (``" 5, 3,5"`` -> ``"3,5"``).

    Args:
        spec: the flag / recipe / environment value (str; an iterable of ints is accepted too).

    Raises:
        ValueError: anything else (empty, negative or non-integer ids, a kind mixed with ids).
    """
    if not isinstance(spec, str):
        try:
            ids = list(spec)
        except TypeError:
            ids = None
        if ids is None or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"skip_layers must be 'sliding', 'full', 'none' or comma-separated layer ids, got {spec!r}")
        spec = ",".join(str(int(i)) for i in ids) or "none"
    text = spec.strip().lower()
    if text in SKIP_LAYER_KINDS:
        return text
    parts = [p.strip() for p in text.split(",")]
    if not text or not all(p.isdigit() for p in parts):
        raise ValueError(
            f"--oscar-skip-layers must be one of {', '.join(SKIP_LAYER_KINDS)} or comma-separated global layer ids "
            f"(e.g. 0,5,11), got {spec!r}")
    return ",".join(str(i) for i in sorted({int(p) for p in parts}))


def resolve_skip_layers(spec, geometry: ModelGeometry) -> frozenset[int]:
    """The global ids of the attention layers that stay BF16 for ``--oscar-skip-layers spec``.

    ``"none"`` -> no layer; ``"sliding"`` / ``"full"`` -> every layer of that kind (no layer if
    the model has none of that kind); ids -> those layers, each of which must be an attention
    layer of ``geometry``.

    Args:
        spec: a value :func:`parse_skip_layers` accepts (e.g. ``OscarConfig.skip_layers``).
        geometry: the model's :class:`~sglang_oscar.rotation.geometry.ModelGeometry`.

    Returns:
        frozenset of global layer ids.

    Raises:
        ValueError: a malformed spec, or ids that are not attention layers of the model (the
            message names them, the model's attention layers and the fix).
    """
    spec = parse_skip_layers(spec)
    if spec == "none":
        return frozenset()
    if spec in ("sliding", "full"):
        return frozenset(layer.layer_id for layer in geometry.layers if layer.kind == spec)
    ids = [int(i) for i in spec.split(",")]
    have = set(geometry.layer_ids)
    bad = [i for i in ids if i not in have]
    if bad:
        attn = geometry.layer_ids
        contiguous = attn == list(range(attn[0], attn[-1] + 1))
        span = f"{attn[0]}..{attn[-1]}" if contiguous else ", ".join(map(str, attn))
        kinds = {k: sum(1 for x in geometry.layers if x.kind == k) for k in ("sliding", "full")}
        mix = f"; {kinds['sliding']} sliding, {kinds['full']} full" if kinds["sliding"] else ""
        non_attn = [i for i in bad if 0 <= i < geometry.num_hidden_layers]
        why = (f" (layers {non_attn} have no KV cache: linear-attention/recurrent layers)" if non_attn else "")
        raise ValueError(
            f"--oscar-skip-layers names layers {bad} that do not exist as attention layers of this "
            f"{geometry.model_type} model{why}: its attention layers are {span} "
            f"({len(attn)} of {geometry.num_hidden_layers} layers{mix}). Fix: list ids from that range, "
            "or pass sliding, full or none.")
    return frozenset(ids)
