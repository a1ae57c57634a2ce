"""Rotation sets: K and V rotations per layer or per (layer, kv head), their files and checks.

File format (safetensors, docs/format.md):

* tensors ``k.<layer_id>`` and ``v.<layer_id>``: float32 ``[D, D]`` (format_version 1, one
  matrix per layer) or ``[H_kv, D, D]`` (format_version 2, one per global kv head), keyed by
  **global** layer id; optional ``k_eigvals.<layer_id>`` / ``v_eigvals.<layer_id>``;
* optional centering (every layer or none, for K and for V separately): ``k_mean.<layer_id>`` /
  ``v_mean.<layer_id>``, float32 ``[H_kv, D]`` per-kv-head means of the post-RoPE keys / the values
  in the model's frame. A centred cache stores ``(x - mean) R``; the key mean shifts every score
  of a query by the same ``q . mean`` (softmax is unchanged; refused with a logit cap), the value
  mean is added back to the attention output (``sum_j p_j = 1``).
* metadata key ``"oscar"``: JSON with ``format_version``, ``model_type``, ``geometry``,
  ``method``, ``quantizer`` settings and ``calibration`` provenance.

Rows are rotated as ``x R`` (right multiplication); ``R`` is orthogonal so
``(q R)(k R)^T = q k^T``.

Upstream ``.pt`` files (``torch.save`` dicts with ``layers[id]["rotation"]``, one file for K
and one for V) load through :meth:`RotationSet.from_upstream_pt` with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import torch
from safetensors import safe_open

from .. import __version__
from ..fileio import save_safetensors
from ..constants import DEFAULT_ORTHO_TOL
from .geometry import ModelGeometry
from .hadamard import default_hadamard

FORMAT_VERSIONS = (1, 2)
METADATA_KEY = "oscar"
METHODS = ("oscar", "oscar-perhead", "hadamard", "identity")


class RotationError(ValueError):
    """A rotation file or set that cannot be used; the message names the file, layer and fix."""


@dataclasses.dataclass
class RotationSet:
    """K and V rotations of a model.

    Attributes:
        k, v: ``{global layer id: float32 [D, D] or [H_kv, D, D]}``.
        metadata: JSON-serialisable dict (see module docstring); ``format_version`` is derived.
        k_eigvals, v_eigvals: optional ``{layer id: [D] or [H_kv, D]}`` eigenvalues.
        k_mean, v_mean: optional centering, ``{layer id: float32 [H_kv, D]}`` in the model's frame
            (module docstring); empty = not centred.
        source: where it was loaded from (for error messages), or ``"<memory>"``.
    """

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    k_eigvals: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    v_eigvals: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    source: str = "<memory>"
    k_mean: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    v_mean: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for which, store in (("K", self.k), ("V", self.v)):
            for i, t in store.items():
                if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or t.shape[-1] != t.shape[-2] or t.numel() == 0:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise RotationError(f"{self.source}: layer {i} {which} rotation must be a non-empty [D, D] or [H_kv, D, D] tensor, got {shape}")
        self.k = {int(i): t.to(torch.float32).contiguous() for i, t in self.k.items()}
        self.v = {int(i): t.to(torch.float32).contiguous() for i, t in self.v.items()}
        if sorted(self.k) != sorted(self.v):
            raise RotationError(
                f"{self.source}: K rotations cover layers {_ids(self.k)} but V rotations cover {_ids(self.v)}; "
                "K and V files must come from the same fit"
            )
        self.format_version  # validates uniform dimensionality
        for which, store, rots in (("K", self.k_mean, self.k), ("V", self.v_mean, self.v)):
            if store and sorted(store) != sorted(rots):
                raise RotationError(
                    f"{self.source}: {which} means cover layers {_ids(store)} but the rotations cover {_ids(rots)}; "
                    "centering applies to every layer or to none: refit the file"
                )
            for i, t in store.items():
                d = rots[int(i)].shape[-1]
                if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[-1] != d or t.shape[0] < 1:
                    shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise RotationError(f"{self.source}: layer {i} {which} mean must be [H_kv, {d}] (per kv head), got {shape}")
                r = rots[int(i)]
                if r.dim() == 3 and r.shape[0] != t.shape[0]:
                    raise RotationError(f"{self.source}: layer {i} has {r.shape[0]} per-head {which} rotations but "
                                        f"{t.shape[0]} {which} means: refit the file")
        self.k_mean = {int(i): t.to(torch.float32).contiguous() for i, t in self.k_mean.items()}
        self.v_mean = {int(i): t.to(torch.float32).contiguous() for i, t in self.v_mean.items()}

    # ------------------------------------------------------------------ properties
    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.k)

    @property
    def per_head(self) -> bool:
        return self.format_version == 2

    @property
    def format_version(self) -> int:
        """1 if every matrix is ``[D, D]``, 2 if every one is ``[H, D, D]``.

        Raises:
            RotationError: mixed or other dimensionalities.
        """
        dims = {t.dim() for t in list(self.k.values()) + list(self.v.values())}
        if dims == {2} or not dims:
            return 1
        if dims == {3}:
            return 2
        raise RotationError(
            f"{self.source}: rotations must be all [D, D] (per layer) or all [H_kv, D, D] "
            f"(per kv head); found tensors with {sorted(dims)} dims. Refit the file with one method."
        )

    def head_dims(self, layer_id: int) -> tuple[int, int]:
        """``(D_k, D_v)`` of a layer."""
        return self.k[layer_id].shape[-1], self.v[layer_id].shape[-1]

    # ------------------------------------------------------------------ access
    def matrices(self, layer_id: int, which: str, num_kv_heads: int | None = None) -> torch.Tensor:
        """Rotation(s) of one layer, expanded per kv head.

        Args:
            layer_id: global layer id.
            which: ``"k"`` or ``"v"``.
            num_kv_heads: if given, return ``[num_kv_heads, D, D]`` (a per-layer matrix is
                broadcast); otherwise the stored tensor.

        Raises:
            KeyError: unknown layer. RotationError: head count mismatch.
        """
        store = self.k if which == "k" else self.v
        if layer_id not in store:
            raise KeyError(f"{self.source}: no {which.upper()} rotation for layer {layer_id}")
        r = store[layer_id]
        if num_kv_heads is None:
            return r
        if r.dim() == 2:
            return r.unsqueeze(0).expand(num_kv_heads, *r.shape)
        if r.shape[0] != num_kv_heads:
            raise RotationError(
                f"{self.source}: layer {layer_id} has {r.shape[0]} per-head {which.upper()} rotations "
                f"but {num_kv_heads} kv heads were requested"
            )
        return r

    @property
    def centered(self) -> bool:
        """Whether K or V rows are centred before rotation (``k_mean`` / ``v_mean`` present)."""
        return bool(self.k_mean or self.v_mean)

    def mean(self, layer_id: int, which: str) -> torch.Tensor | None:
        """Float32 ``[H_kv, D]`` centering mean of one layer (``which`` ``"k"``/``"v"``), or ``None``
        when that side is not centred.

        Raises:
            KeyError: unknown layer of a centred side. ValueError: ``which`` is not ``"k"`` or ``"v"``.
        """
        if which not in ("k", "v"):
            raise ValueError(f"which must be 'k' or 'v', got {which!r}")
        store = self.k_mean if which == "k" else self.v_mean
        if not store:
            return None
        if layer_id not in store:
            raise KeyError(f"{self.source}: no {which.upper()} mean for layer {layer_id}")
        return store[layer_id]

    def for_tp_rank(self, tp_rank: int, tp_size: int, num_kv_heads: int | dict[int, int]) -> RotationSet:
        """The rotations a tensor-parallel rank needs.

        Per-layer matrices are TP-invariant. Per-head matrices and the centering means (always per
        kv head, ``[H_kv, D]``) are sliced to the rank's kv heads with SGLang's sharding: with
        ``H_kv >= tp_size`` rank ``r`` owns heads ``[r*H_kv/tp, (r+1)*H_kv/tp)``; with ``H_kv < tp_size`` kv heads are replicated and
        rank ``r`` owns head ``r * H_kv // tp_size``.

        Args:
            num_kv_heads: total kv heads, one int or ``{layer id: heads}``.

        Raises:
            RotationError: head counts that do not divide or replicate evenly.
        """
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise RotationError(f"invalid tensor-parallel rank {tp_rank} of {tp_size}")
        if (not self.per_head and not self.centered) or tp_size == 1:
            return self

        def heads_of(layer_id: int) -> int:
            return num_kv_heads[layer_id] if isinstance(num_kv_heads, dict) else num_kv_heads

        def sl(store: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            out = {}
            for i, r in store.items():
                h = heads_of(i)
                if r.shape[0] != h:
                    raise RotationError(f"{self.source}: layer {i} has {r.shape[0]} heads, model has {h}")
                if h >= tp_size:
                    if h % tp_size:
                        raise RotationError(f"{h} kv heads cannot be split over tp_size={tp_size}")
                    n = h // tp_size
                    out[i] = r[tp_rank * n : (tp_rank + 1) * n]
                else:
                    if tp_size % h:
                        raise RotationError(f"tp_size={tp_size} is not a multiple of {h} kv heads")
                    idx = tp_rank * h // tp_size
                    out[i] = r[idx : idx + 1]
            return out

        # per-layer matrices stay whole; per-head matrices and the (always per-head) means are sliced
        k, v = (sl(self.k), sl(self.v)) if self.per_head else (self.k, self.v)
        return dataclasses.replace(self, k=k, v=v, k_eigvals={}, v_eigvals={}, k_mean=sl(self.k_mean),
                                   v_mean=sl(self.v_mean))

    # ------------------------------------------------------------------ checks
    def validate(self, geometry: ModelGeometry, ortho_tol: float = DEFAULT_ORTHO_TOL, *,
                 skip_layers=frozenset(), skip_hint: bool = False) -> None:
        """Check this set against a model's attention geometry (the launch preflight).

        Checks, over the layers that are quantized (the model's attention layers minus
        ``skip_layers``): every such layer has K and V rotations, and no layer outside the model
        does; per layer, in layer order, K ``[D_k, D_k]`` / ``[H_kv, D_k, D_k]`` and V likewise
        with ``D_v`` and the layer's total kv heads (each layer its own geometry: Gemma-4's
        sliding layers 256, its full layers 512); centering means ``[H_kv, D]``; for layers
        whose cached V is their cached K (``k_eq_v``) ``R_v = R_k`` and ``mean_v = mean_k``
        (V is read from K's codes); finite entries; ``max |R R^T - I| <= ortho_tol``. Skipped
        layers keep BF16 and need no rotation (an entry for one is ignored).

        Args:
            geometry: the model's :class:`ModelGeometry`.
            ortho_tol: orthogonality tolerance.
            skip_layers: global ids of BF16 layers (:func:`sglang_oscar.config.resolve_skip_layers`).
            skip_hint: the model can keep one layer kind BF16 (SGLang's two hybrid sliding-window pools):
                a file missing exactly one kind's layers names ``--oscar-skip-layers``.

        Raises:
            RotationError: naming the file, the first bad layer, expected vs found, and the fix.
            ValueError: ``ortho_tol`` not a finite number in ``(0, 1]``.
        """
        if not (0.0 < float(ortho_tol) <= 1.0):
            raise ValueError(f"orthogonality tolerance must be in (0, 1], got {ortho_tol!r}")
        if geometry.attention_kind != "mha":
            raise RotationError(
                f"{self.source}: model_type {geometry.model_type!r} uses {geometry.attention_kind.upper()} "
                "attention; K/V rotation files apply to MHA/GQA models only. MLA models use latent rotations "
                "(`sglang-oscar fit` writes them from MLA statistics; see docs/calibration.md)"
            )
        skip = frozenset(int(i) for i in skip_layers)
        layers = [layer for layer in geometry.layers if layer.layer_id not in skip]
        want = [layer.layer_id for layer in layers]
        fix = ("Write a data-free file for this model with `sglang-oscar hadamard --config CONFIG.json --out "
               "FILE.safetensors`, or recalibrate and refit it (`sglang-oscar calibrate`, then `fit`) for this model.")
        # Hybrids (Qwen3.5 / Qwen3-Next GDN, Kimi KDA): a rotation for a linear-attention layer means
        # the file was fitted on a model (or a config read) where that layer attends. Said first and
        # by name: "unexpected [0, 1, 2]" alone reads like an off-by-one, not like the wrong model.
        linear = sorted(set(self.k) & set(geometry.linear_layer_ids))
        if linear:
            missing = sorted(set(want) - set(self.k))
            raise RotationError(
                f"{self.source}: has rotations for layers {_ids(linear)}, which are linear-attention layers of "
                f"this {geometry.model_type} model: they have no KV cache (SGLang keeps their recurrent state in "
                f"its mamba pool), so no rotation applies to them. Its {len(geometry.layer_ids)} full-attention "
                f"layers are {_ids(geometry.layer_ids)}"
                + (f"; the file misses full-attention layers {_ids(missing)}" if missing else "")
                + ". The file was fitted for another model or with a config that lost the layer kinds. " + fix
            )
        for which, store in (("K", self.k), ("V", self.v)):
            missing = sorted(set(want) - set(store))
            extra = sorted(set(store) - set(geometry.layer_ids))
            # a file of the other kind only (a hybrid's full layers, say): perhaps one kind was meant to stay BF16
            kind = next((k for k in ("sliding", "full") if skip_hint and missing and not extra and sorted(
                x.layer_id for x in layers if x.kind == k) == missing and len(missing) < len(want)), None)
            if missing or extra:
                raise RotationError(
                    f"{self.source}: {which} rotations cover layers {_ids(store)} but the model "
                    f"({geometry.model_type}, {len(geometry.layer_ids)} attention layers) quantizes {_ids(want)}"
                    + (f" ({len(skip)} skipped)" if skip else "")
                    + (f"; missing {'full-attention layers ' if geometry.linear_layer_ids else ''}{_ids(missing)}"
                       if missing else "")
                    + (f"; unexpected {_ids(extra)}" if extra else "")
                    + (f". It misses exactly the {kind} layers: if they are meant to stay BF16, pass "
                       f"--oscar-skip-layers {kind} (recipe [quant].skip_layers); otherwise this file was fitted "
                       "for another model. " if kind else ". This file was fitted for another model. ") + fix
                )
        groups = [g for g in geometry.groups() if set(g.layer_ids) - skip]
        shapes_note = ""
        if len({(g.head_dim_k, g.head_dim_v, g.num_kv_heads) for g in groups}) > 1:
            shapes_note = (" This model has more than one layer geometry (" + "; ".join(
                f"{g.kind} layers {_ids(g.layer_ids)}: {g.num_kv_heads} kv heads x head_dim {g.head_dim_k}"
                for g in groups) + "), so its file needs each layer's own head_dim.")
        for layer in layers:
            for which, store, d in (("K", self.k, layer.head_dim_k), ("V", self.v, layer.head_dim_v)):
                r = store[layer.layer_id]
                ok_shapes = [(d, d), (layer.num_kv_heads, d, d)]
                if tuple(r.shape) not in ok_shapes:
                    raise RotationError(
                        f"{self.source}: layer {layer.layer_id} ({layer.kind}) {which} rotation has shape "
                        f"{tuple(r.shape)}, expected {ok_shapes[0]} (per layer) or {ok_shapes[1]} (per kv head) for "
                        f"head_dim {d} and {layer.num_kv_heads} kv heads. The file belongs to another model or "
                        f"geometry.{shapes_note} {fix}"
                    )
            for which, store, d in (("K", self.k_mean, layer.head_dim_k), ("V", self.v_mean, layer.head_dim_v)):
                m = store.get(layer.layer_id)
                if m is not None and tuple(m.shape) != (layer.num_kv_heads, d):
                    raise RotationError(
                        f"{self.source}: layer {layer.layer_id} {which} mean has shape {tuple(m.shape)}, expected "
                        f"({layer.num_kv_heads}, {d}) for {layer.num_kv_heads} kv heads of head_dim {d}: the file "
                        f"belongs to another model. {fix}"
                    )
            if layer.k_eq_v:
                # one stored tensor: V is read from K's rotated (and centred) codes
                i = layer.layer_id
                km, vm = self.k_mean.get(i), self.v_mean.get(i)
                same_mean = (km is None and vm is None) or (km is not None and vm is not None and torch.equal(km, vm))
                if not torch.equal(self.k[i], self.v[i]) or not same_mean:
                    raise RotationError(
                        f"{self.source}: layer {i} caches V as its K rows (K shared as V), so V is read from K's "
                        "codes and needs the K rotation and mean (R_v = R_k, mean_v = mean_k), but this file's "
                        f"V {'rotation' if not torch.equal(self.k[i], self.v[i]) else 'mean'} differs. Refit with "
                        "the model's geometry (fit uses R_k for such layers) or write a data-free file with "
                        "`sglang-oscar hadamard --config CONFIG.json --out FILE.safetensors`."
                    )
        self.check_matrices(ortho_tol)

    def check_matrices(self, ortho_tol: float = DEFAULT_ORTHO_TOL) -> None:
        """Model-independent checks (run before every save): head_dim a multiple of 4, finite, orthogonal;
        finite centering means.

        Raises:
            RotationError: naming the layer and the problem.
        """
        for which, store in (("K", self.k), ("V", self.v)):
            for i, r in sorted(store.items()):
                d = r.shape[-1]
                if d % 4:
                    raise RotationError(f"{self.source}: layer {i} {which} rotation has head_dim {d}, not a multiple of 4 (INT2 packing needs it)")
                if not torch.isfinite(r).all():
                    raise RotationError(f"{self.source}: layer {i} {which} rotation contains NaN/Inf: refit it")
                err = orthogonality_error(r)
                if err > ortho_tol:
                    raise RotationError(
                        f"{self.source}: layer {i} {which} rotation is not orthogonal (max |R R^T - I| = "
                        f"{err:.3g} > {ortho_tol:g}); q.k is only preserved by orthogonal rotations: refit it"
                    )
        for which, store in (("K", self.k_mean), ("V", self.v_mean)):
            for i, m in sorted(store.items()):
                if not torch.isfinite(m).all():
                    raise RotationError(f"{self.source}: layer {i} {which} mean contains NaN/Inf: refit it")

    # ------------------------------------------------------------------ I/O
    def save(self, path: str) -> None:
        """Write a ``.safetensors`` file (see module docstring). Creates parent folders."""
        if not path.endswith(".safetensors"):
            raise RotationError(f"rotation files are written as .safetensors, got {path!r}")
        self.check_matrices()
        tensors = {}
        for prefix, store in (("k", self.k), ("v", self.v), ("k_eigvals", self.k_eigvals), ("v_eigvals", self.v_eigvals),
                              ("k_mean", self.k_mean), ("v_mean", self.v_mean)):
            for i, t in store.items():
                tensors[f"{prefix}.{int(i)}"] = t.detach().to(torch.float32).cpu().clone().contiguous()
        meta = dict(self.metadata)
        meta["format_version"] = self.format_version
        meta.setdefault("created_by", f"sglang-oscar {__version__}")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_safetensors(tensors, path, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})

    @classmethod
    def load(cls, path: str) -> RotationSet:
        """Load a rotation file or directory.

        ``path`` may be a ``.safetensors`` file, or a directory holding exactly one
        ``*.safetensors`` file, or exactly one upstream ``k_rotation_*.pt`` and one
        ``v_rotation_*.pt``.

        Raises:
            FileNotFoundError: missing path. RotationError: ambiguous directory, unreadable or
            malformed file, unknown format version.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"rotation path {path} does not exist; create one with `sglang-oscar fit` or "
                "`sglang-oscar hadamard --config CONFIG.json --out FILE`"
            )
        if os.path.isdir(path):
            st = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            ks = sorted(glob.glob(os.path.join(path, "k_rotation_*.pt")))
            vs = sorted(glob.glob(os.path.join(path, "v_rotation_*.pt")))
            if len(st) == 1:
                return cls.load(st[0])
            if len(st) > 1:
                raise RotationError(f"{path} holds several rotation files {[os.path.basename(s) for s in st]}: pass one file explicitly")
            if len(ks) == 1 and len(vs) == 1:
                return cls.from_upstream_pt(ks[0], vs[0])
            if ks or vs:
                raise RotationError(
                    f"{path} holds K files {[os.path.basename(s) for s in ks]} and V files "
                    f"{[os.path.basename(s) for s in vs]}: need exactly one of each; pass the files explicitly "
                    "to RotationSet.from_upstream_pt or convert them with `sglang-oscar convert`"
                )
            raise RotationError(f"{path} contains no rotation file (*.safetensors or k_rotation_*.pt + v_rotation_*.pt)")
        if path.endswith(".pt"):
            raise RotationError(
                f"{path} is an upstream .pt file, which holds K or V only: pass the directory holding "
                "both k_rotation_*.pt and v_rotation_*.pt"
            )
        try:
            with safe_open(path, framework="pt") as f:
                meta_raw = (f.metadata() or {}).get(METADATA_KEY)
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # safetensors raises its own error types
            raise RotationError(f"{path} is not a readable safetensors rotation file: {exc}") from exc
        if meta_raw is None:
            raise RotationError(f"{path} has no '{METADATA_KEY}' metadata: not an sglang-oscar rotation file")
        try:
            meta = json.loads(meta_raw)
        except json.JSONDecodeError as exc:
            raise RotationError(f"{path}: '{METADATA_KEY}' metadata is not valid JSON ({exc}): the file is corrupt; refit it") from None
        if not isinstance(meta, dict):
            raise RotationError(f"{path}: '{METADATA_KEY}' metadata must be a JSON object, got {type(meta).__name__}")
        if meta.get("format") == "latent":  # rotation.latent.LATENT_FORMAT (that module imports this one)
            raise RotationError(
                f"{path} is an MLA latent rotation file (one [kv_lora_rank, kv_lora_rank] matrix per layer, model_type "
                f"{meta.get('model_type')!r}), not a K/V rotation set: it applies to MLA models only. Check it with "
                "`sglang-oscar validate-rotation FILE --config CONFIG` (or `sglang-oscar validate FILE --config CONFIG "
                "--mla-storage latent` with an MLA config); an MHA/GQA model needs a K/V rotation file (`sglang-oscar "
                "fit` from its statistics, or `sglang-oscar hadamard --config CONFIG`)"
            )
        version = meta.get("format_version")
        if version not in FORMAT_VERSIONS:
            raise RotationError(f"{path}: unknown format_version {version!r} (this sglang-oscar reads {FORMAT_VERSIONS}); upgrade sglang-oscar or refit")
        stores: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "k_eigvals": {}, "v_eigvals": {}, "k_mean": {},
                                                      "v_mean": {}}
        for name, t in tensors.items():
            prefix, _, lid = name.rpartition(".")
            if prefix not in stores or not lid.isdigit():
                raise RotationError(f"{path}: unexpected tensor {name!r}")
            stores[prefix][int(lid)] = t
        if sorted(stores["k"]) != sorted(stores["v"]):
            raise RotationError(f"{path}: K layers {_ids(stores['k'])} differ from V layers {_ids(stores['v'])}")
        rs = cls(stores["k"], stores["v"], meta, stores["k_eigvals"], stores["v_eigvals"], source=path,
                 k_mean=stores["k_mean"], v_mean=stores["v_mean"])
        if rs.format_version != version:
            raise RotationError(f"{path}: metadata says format_version {version} but tensors are version {rs.format_version}")
        return rs

    @classmethod
    def from_paths(cls, path: str, v_path: str | None = None) -> RotationSet:
        """:meth:`load` ``path``, or with ``v_path`` the upstream pair (``path`` = K ``.pt``).

        Raises:
            FileNotFoundError, RotationError: as :meth:`load` / :meth:`from_upstream_pt`.
        """
        if v_path is None:
            return cls.load(path)
        return cls.from_upstream_pt(path, v_path)

    @classmethod
    def from_upstream_pt(cls, k_path: str, v_path: str) -> RotationSet:
        """Read an upstream pair of ``torch.save`` files (``layers[id]["rotation"]``).

        Raises:
            FileNotFoundError: a path that is not a file.
            RotationError: a ``.safetensors`` path (an sglang-oscar file, no conversion needed), a
                file ``torch.load`` cannot read, or one without a ``layers`` dict or a ``rotation`` entry.
        """
        stores = []
        metas = []
        for p in (k_path, v_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"rotation file {p} does not exist")
            if str(p).endswith(".safetensors"):
                raise RotationError(f"{p} is a safetensors file, not an upstream OSCAR .pt file: an sglang-oscar "
                                    "rotation file holds K and V and needs no conversion (pass it alone, as "
                                    "--oscar-rotation FILE without a separate V file, or check it with "
                                    "`sglang-oscar validate`)")
            try:
                obj = torch.load(p, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise RotationError(
                    f"{p} could not be read by torch.load(weights_only=True) ({type(exc).__name__}: {exc}); expected "
                    "an upstream OSCAR rotation file: a torch.save dict with a 'layers' dict of tensors"
                ) from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
                raise RotationError(f"{p} has no 'layers' dict: not an upstream OSCAR rotation file")
            store = {}
            for key, entry in obj["layers"].items():
                if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
                    raise RotationError(f"{p}: layer {key} has no 'rotation' tensor")
                try:
                    store[int(key)] = entry["rotation"]
                except (TypeError, ValueError):
                    raise RotationError(f"{p}: layer key {key!r} is not an integer global layer id") from None
            if not store:
                raise RotationError(f"{p} holds no layers (its 'layers' dict is empty): an upstream rotation file "
                                    "has one 'rotation' tensor per attention layer; refit or re-export it")
            stores.append(store)
            metas.append({k: obj[k] for k in ("format_version", "objective", "source_grouping") if k in obj})
        meta = {"method": "upstream", "upstream": {"k": {"path": k_path, **metas[0]}, "v": {"path": v_path, **metas[1]}}}
        return cls(stores[0], stores[1], meta, source=f"{k_path} + {v_path}")

    # ------------------------------------------------------------------ builders
    @classmethod
    def data_free(cls, geometry: ModelGeometry, method: str = "hadamard") -> RotationSet:
        """Rotation set that needs no data: ``"hadamard"`` (normalised Hadamard, block-Hadamard
        for non-power-of-two D) or ``"identity"``, one matrix per layer.

        Raises:
            RotationError: unknown method or an MLA model.
        """
        if method not in ("hadamard", "identity"):
            raise RotationError(f"data-free method must be 'hadamard' or 'identity', got {method!r}")
        if geometry.attention_kind != "mha":
            raise RotationError(f"model_type {geometry.model_type!r} uses MLA attention; per-head K/V rotations do not apply")

        for layer in geometry.layers:
            for d in (layer.head_dim_k, layer.head_dim_v):
                if d % 4:
                    raise RotationError(f"layer {layer.layer_id} has head_dim {d}, not a multiple of 4: INT2 packing cannot store it")

        def mat(d: int) -> torch.Tensor:
            return (default_hadamard(d) if method == "hadamard" else torch.eye(d, dtype=torch.float64)).float()

        k = {layer.layer_id: mat(layer.head_dim_k) for layer in geometry.layers}
        v = {layer.layer_id: mat(layer.head_dim_v) for layer in geometry.layers}
        meta = {"method": method, "model_type": geometry.model_type, "geometry": geometry.to_dict()}
        return cls(k, v, meta)


def orthogonality_error(r: torch.Tensor) -> float:
    """``max |R R^T - I|`` over the last two dims of ``r`` (``[D, D]`` or ``[..., D, D]``)."""
    r64 = r.double()
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return float((r64 @ r64.transpose(-1, -2) - eye).abs().max())


def _ids(ids) -> str:
    """Layer ids for a message: the list when short, else its shape (a range, a stride, or runs), so a
    hybrid's every-6th full layers do not read as one contiguous range."""
    ids = sorted(ids)
    if len(ids) <= 8:
        return str(ids)
    n = len(ids)
    steps = {b - a for a, b in zip(ids, ids[1:])}
    if steps == {1}:
        return f"[{ids[0]}..{ids[-1]}] ({n} layers)"
    if len(steps) == 1:
        step = steps.pop()
        return f"[{ids[0]}, {ids[1]}, ..., {ids[-1]}] ({n} layers, every {step})"
    runs, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}..{a}" if a > start else str(a))
            start = b
    shown = ", ".join(runs[:6]) + (", ..." if len(runs) > 6 else "")
    return f"[{shown}] ({n} layers)"
