"""MLA latent rotations: one orthogonal ``[kv_lora_rank, kv_lora_rank]`` matrix per layer.

MLA models (DeepSeek-V2 style, GLM-5.x) cache the compressed latent ``c_kv`` (``kv_lora_rank``
wide, after ``kv_a_layernorm``) plus a small RoPE part ``k_pe`` that is never quantized. The
latent is rotated as ``c R``, quantized to INT2 in groups and counter-rotated ``R^T`` after
dequantization (spec §3.5, §6.1).

Fitted recipe ``Rcov P Hblock`` (spec §3.5): ``Sigma = c^T c / N`` (float64),
``Sigma = U diag(lambda) U^T`` (``eigh``, ascending), ``P`` = the eigenvalue-sorted bit-reversal
permutation (:func:`.hadamard.eig_bitrev_permutation`, applied in the eigenbasis, i.e. *before*
the Hadamard), ``Hblock`` = block-diagonal Hadamard with blocks of the quantization group size.
So ``R = U P Hblock``. (The MHA composition is ``U H P``, see :mod:`.fit`.)

File format (safetensors): tensors ``latent.<layer_id>`` float32 ``[R, R]`` and optional
``latent_eigvals.<layer_id>`` ``[R]``; metadata key ``"oscar"`` (JSON) with
``format = "latent"``, ``format_version = 1``, ``method``, ``model_type``, ``geometry``,
``calibration`` provenance -- the same metadata style as :class:`.rotation_set.RotationSet`.
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
from .geometry import ModelGeometry
from .fit import rotation_from_covariance
from .hadamard import block_hadamard, default_hadamard, eig_bitrev_permutation, is_power_of_two
from .rotation_set import DEFAULT_ORTHO_TOL, METADATA_KEY, RotationError, orthogonality_error

LATENT_FORMAT = "latent"
LATENT_FORMAT_VERSION = 1
LATENT_METHODS = ("oscar", "hadamard", "identity")
DEFAULT_LATENT_BLOCK = 128


def latent_hadamard(rank: int, block: int | None = DEFAULT_LATENT_BLOCK) -> torch.Tensor:
    """Block Hadamard ``[rank, rank]`` with power-of-two blocks of ``block`` (float64).

    ``block=None`` means one block as large as possible: :func:`.hadamard.default_hadamard`
    (the full Hadamard for a power-of-two ``rank``).

    Raises:
        ValueError: ``block`` is not a power of two dividing ``rank`` (a file recording a block
            it does not use would misdescribe itself, so there is no silent fallback).
    """
    if block is None:
        return default_hadamard(rank)
    if not is_power_of_two(block) or rank % block:
        raise ValueError(
            f"latent Hadamard block {block!r} must be a power of two dividing kv_lora_rank {rank} "
            f"(e.g. {', '.join(str(b) for b in (32, 64, 128) if rank % b == 0) or 'a power of two'})"
        )
    return block_hadamard(rank, block)


def covariance_eigenbasis(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, eigvals)`` of a symmetric PSD matrix: ``Sigma = U diag(eigvals) U^T``, ascending.

    Reuses :func:`.fit.rotation_from_covariance` (its shape/finiteness checks, symmetrisation
    and ``eigh``), which returns ``R = U H P``; ``U`` is recovered exactly as ``R P^T H^T``
    (``H`` and ``P`` are orthogonal and rebuilt from the same functions), so every fitted
    composition shares one eigendecomposition code path.

    Args:
        sigma: ``[D, D]`` second-moment matrix.

    Returns:
        float64 ``[D, D]`` eigenvectors (columns) and ``[D]`` ascending eigenvalues.

    Raises:
        ValueError: non-square or non-finite input.
    """
    r, eigvals = rotation_from_covariance(sigma)
    d = r.shape[0]
    u = r @ eig_bitrev_permutation(eigvals).T @ default_hadamard(d, device=r.device).T
    return u, eigvals


def latent_rotation_from_covariance(sigma: torch.Tensor, block: int | None = DEFAULT_LATENT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``R = U P Hblock`` of one latent second moment (spec §3.5).

    Args:
        sigma: ``[R, R]`` symmetric PSD matrix (symmetrised here).
        block: Hadamard block (the quantization group size; default 128; ``None`` = full).

    Returns:
        ``(R, eigvals)``: float64 ``[R, R]`` orthogonal and ``[R]`` ascending eigenvalues.

    Raises:
        ValueError: non-square or non-finite input, or an invalid ``block``.
    """
    hblock = latent_hadamard(sigma.shape[-1], block)  # validate the block before the eigendecomposition
    u, eigvals = covariance_eigenbasis(sigma)
    return u @ eig_bitrev_permutation(eigvals) @ hblock.to(u.device), eigvals


@dataclasses.dataclass
class LatentRotationSet:
    """Latent rotations of an MLA model.

    Attributes:
        r: ``{global layer id: float32 [R, R]}``.
        metadata: JSON-serialisable dict (module docstring).
        eigvals: optional ``{layer id: [R]}``.
        source: where it was loaded from, or ``"<memory>"``.
    """

    r: dict[int, torch.Tensor]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    eigvals: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self):
        self.r = {int(i): t.to(torch.float32).contiguous() for i, t in self.r.items()}
        for i, t in self.r.items():
            if t.dim() != 2 or t.shape[0] != t.shape[1]:
                raise RotationError(f"{self.source}: latent rotation of layer {i} must be [R, R], got {tuple(t.shape)}")

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.r)

    def matrix(self, layer_id: int) -> torch.Tensor:
        """The float32 ``[R, R]`` rotation of global layer ``layer_id``.

        Raises:
            KeyError: no rotation for that layer.
        """
        if layer_id not in self.r:
            raise KeyError(f"{self.source}: no latent rotation for layer {layer_id}")
        return self.r[layer_id]

    def validate(self, geometry: ModelGeometry, ortho_tol: float = DEFAULT_ORTHO_TOL) -> None:
        """Check against an MLA geometry: exactly its attention layers, ``[kv_lora_rank]^2``
        shapes, finite entries, ``max |R R^T - I| <= ortho_tol``.

        Raises:
            RotationError: naming the file, the layer and the fix.
        """
        if geometry.attention_kind != "mla":
            raise RotationError(
                f"{self.source}: latent rotations apply to MLA models only; model_type "
                f"{geometry.model_type!r} uses {geometry.attention_kind.upper()} attention (use per-head K/V rotations)"
            )
        want = set(geometry.layer_ids)
        have = set(self.r)
        if want != have:
            missing, extra = sorted(want - have), sorted(have - want)
            linear = [i for i in extra if i in set(geometry.linear_layer_ids)]
            raise RotationError(
                f"{self.source}: latent rotations cover {len(have)} layers but the model "
                f"({geometry.model_type}) has {len(want)} MLA layers"
                + (f"; missing {missing[:8]}" if missing else "")
                + (f"; unexpected {extra[:8]}" if extra else "")
                + (f" (layers {linear[:8]} are linear-attention layers: they have no latent cache)" if linear else "")
                + ". The file was fitted for another model: refit it with `sglang-oscar fit`."
            )
        rank = geometry.kv_lora_rank
        for i in sorted(want):
            t = self.r[i]
            if tuple(t.shape) != (rank, rank):
                raise RotationError(
                    f"{self.source}: layer {i} latent rotation has shape {tuple(t.shape)}, expected "
                    f"({rank}, {rank}) for kv_lora_rank {rank}: the file belongs to another model"
                )
            if not torch.isfinite(t).all():
                raise RotationError(f"{self.source}: layer {i} latent rotation contains NaN/Inf: refit it")
            err = orthogonality_error(t)
            if err > ortho_tol:
                raise RotationError(
                    f"{self.source}: layer {i} latent rotation is not orthogonal (max |R R^T - I| = "
                    f"{err:.3g} > {ortho_tol:g}): refit it"
                )

    def save(self, path: str) -> None:
        """Write a ``.safetensors`` file (module docstring). Creates parent folders."""
        if not path.endswith(".safetensors"):
            raise RotationError(f"latent rotation files are written as .safetensors, got {path!r}")
        tensors = {f"latent.{i}": t.detach().float().contiguous().cpu() for i, t in self.r.items()}
        tensors.update({f"latent_eigvals.{i}": t.detach().float().contiguous().cpu() for i, t in self.eigvals.items()})
        meta = dict(self.metadata)
        meta.update(format=LATENT_FORMAT, format_version=LATENT_FORMAT_VERSION)
        meta.setdefault("created_by", f"sglang-oscar {__version__}")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_safetensors(tensors, path, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})

    def save_upstream_dir(self, directory: str) -> None:
        """Write the upstream directory convention: ``layer_<id>.pt`` raw fp32 ``[R, R]`` tensors (spec §3.1)."""
        os.makedirs(directory, exist_ok=True)
        for i, t in self.r.items():
            torch.save(t.detach().float().contiguous().cpu(), os.path.join(directory, f"layer_{i}.pt"))

    @classmethod
    def load(cls, path: str) -> LatentRotationSet:
        """Load a latent rotation ``.safetensors`` file (or the one ``*.safetensors`` file of a directory).

        Raises:
            FileNotFoundError: missing path. RotationError: not a latent rotation file (unreadable,
            metadata that is not a latent-format JSON object, unexpected tensors), or a directory
            without exactly one ``*.safetensors`` file.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"latent rotation file {path} does not exist; create one with `sglang-oscar fit`")
        if os.path.isdir(path):
            return cls.load(_directory_file(path))
        if path.endswith(".pt"):
            raise RotationError(f"{path} is a PyTorch .pt file, as in upstream's per-layer latent folder (layer_<id>.pt, "
                                "which `sglang-oscar fit --upstream-dir` writes for the original OSCAR server); this "
                                f"server reads {UPSTREAM_FIX}")
        try:
            with safe_open(path, framework="pt") as f:
                meta_raw = (f.metadata() or {}).get(METADATA_KEY)
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:
            raise RotationError(f"{path} is not a readable safetensors file: {exc}") from exc
        try:
            meta = json.loads(meta_raw) if meta_raw else {}
        except json.JSONDecodeError as exc:
            raise RotationError(f"{path}: '{METADATA_KEY}' metadata is not valid JSON ({exc}): the file is corrupt; "
                                "refit it") from None
        if not isinstance(meta, dict):
            raise RotationError(f"{path}: '{METADATA_KEY}' metadata must be a JSON object, got {type(meta).__name__}: "
                                "not an sglang-oscar latent rotation file")
        if meta.get("format") != LATENT_FORMAT:
            if meta.get("format") is None and any(n.startswith(("k.", "v.")) for n in tensors):
                raise RotationError(
                    f"{path} is a K/V rotation file (per-head K/V rotations, model_type {meta.get('model_type')!r}), not "
                    "an sglang-oscar latent rotation file: check it with `sglang-oscar validate-rotation FILE --config CONFIG` "
                    "(MHA/GQA models) or `sglang-oscar validate FILE --config CONFIG --mla-storage expanded` (an MLA "
                    "model's expanded storage); the latent cache takes the latent file `sglang-oscar fit` writes from "
                    "the model's statistics"
                )
            raise RotationError(f"{path} is not an sglang-oscar latent rotation file (metadata format {meta.get('format')!r})")
        if meta.get("format_version") != LATENT_FORMAT_VERSION:
            raise RotationError(f"{path}: unknown latent format_version {meta.get('format_version')!r}")
        r, eig = {}, {}
        for name, t in tensors.items():
            prefix, _, lid = name.rpartition(".")
            if not lid.isdigit() or prefix not in ("latent", "latent_eigvals"):
                raise RotationError(f"{path}: unexpected tensor {name!r}")
            (r if prefix == "latent" else eig)[int(lid)] = t
        return cls(r, meta, eig, source=path)

    @classmethod
    def served_data_free(cls, geometry: ModelGeometry, method: str = "hadamard") -> LatentRotationSet:
        """What a server uses without ``--oscar-rotation`` (and what the offline ``error`` / ``ppl``
        baselines measure): :meth:`data_free` with blocks of :data:`DEFAULT_LATENT_BLOCK`, or the whole
        latent when ``kv_lora_rank`` is narrower (64)."""
        return cls.data_free(geometry, method, served_latent_block(int(geometry.kv_lora_rank or 0)) or None)

    @classmethod
    def data_free(cls, geometry: ModelGeometry, method: str = "hadamard", block: int | None = DEFAULT_LATENT_BLOCK) -> LatentRotationSet:
        """``"hadamard"`` (block Hadamard of ``block``) or ``"identity"``, one matrix per MLA layer.

        Raises:
            RotationError: unknown method, a non-MLA model, or a ``block`` that is not a power of
                two dividing ``kv_lora_rank``.
        """
        if method not in ("hadamard", "identity"):
            raise RotationError(f"data-free latent method must be 'hadamard' or 'identity', got {method!r}")
        if geometry.attention_kind != "mla":
            raise RotationError(f"model_type {geometry.model_type!r} is not an MLA model; latent rotations do not apply")
        rank = int(geometry.kv_lora_rank)
        try:
            m = latent_hadamard(rank, block) if method == "hadamard" else torch.eye(rank, dtype=torch.float64)
        except ValueError as exc:
            raise RotationError(str(exc)) from None
        meta = {"method": method, "model_type": geometry.model_type, "geometry": geometry.to_dict()}
        if method == "hadamard":
            meta["hadamard_block"] = block
        return cls({i: m.float() for i in geometry.layer_ids}, meta)


def latent_rank_supported(r: int) -> bool:
    """Whether the INT2 latent kernels take ``kv_lora_rank`` ``r``: ``r / 4`` (one byte of codes per
    four values) a power of two of at least 16, i.e. ``r`` = 64, 128, 256, 512, ..."""
    return r > 0 and r % 64 == 0 and (r // 4) & (r // 4 - 1) == 0


def check_served_rank(kv_lora_rank: int, model: str) -> None:
    """Raise :class:`RotationError` when no INT2 latent cache can serve ``kv_lora_rank`` (so no latent
    rotation for it would be used), naming the served widths and the fix."""
    if not latent_rank_supported(kv_lora_rank):
        raise RotationError(f"{model!r} has kv_lora_rank {kv_lora_rank}, not a width the INT2 latent kernels take "
                            "(64, 128, 256, 512, ...: a quarter of it a power of two, at least 16); serve the model "
                            "with --kv-cache-dtype auto")


def served_latent_block(kv_lora_rank: int) -> int:
    """Hadamard block of the latent rotation a server uses without ``--oscar-rotation`` (and ``fit``'s
    default without a recipe): :data:`DEFAULT_LATENT_BLOCK`, or the whole latent when narrower."""
    return min(DEFAULT_LATENT_BLOCK, kv_lora_rank)


UPSTREAM_FIX = ("one latent rotation .safetensors file: refit it from the calibration statistics with `sglang-oscar "
                "fit`, or pass the file an earlier `fit --upstream-dir` run wrote with --out")


def _directory_file(path: str) -> str:
    """The one ``*.safetensors`` file of directory ``path``.

    Raises:
        RotationError: none, or several (the first four named)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files and glob.glob(os.path.join(path, "layer_*.pt")):
        raise RotationError(f"{path} is upstream's per-layer latent folder (layer_<id>.pt, which `sglang-oscar fit "
                            f"--upstream-dir` writes for the original OSCAR server); this server reads {UPSTREAM_FIX}")
    if len(files) != 1:
        names = [os.path.basename(f) for f in files[:4]] + (["..."] if len(files) > 4 else [])
        held = f"{len(files)} .safetensors files {names}" if files else "no .safetensors file"
        raise RotationError(f"{path} is a directory holding {held}: pass the latent rotation file itself "
                            "(written by `sglang-oscar fit`)")
    return files[0]


def is_latent_rotation_file(path: str) -> bool:
    """True if ``path`` is a safetensors file with latent-format metadata (or a directory holding
    exactly one such file, as :meth:`LatentRotationSet.load` reads it)."""
    if os.path.isdir(path):
        try:
            path = _directory_file(path)
        except RotationError:
            return False
    if not (os.path.isfile(path) and path.endswith(".safetensors")):
        return False
    try:
        with safe_open(path, framework="pt") as f:
            meta_raw = (f.metadata() or {}).get(METADATA_KEY)
    except Exception:
        return False
    try:
        meta = json.loads(meta_raw) if meta_raw else None
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("format") == LATENT_FORMAT
