"""Verbs of the foundation: ``hadamard``, ``validate``, ``convert``, ``bpe``, ``demo``."""

from __future__ import annotations

import argparse
import json

from ..constants import DEFAULT_ORTHO_TOL
from .arg_types import ortho_tol, positive_int
from .paths import check_writable


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the core verbs (``hadamard``, ``validate``, ``convert``, ``bpe``, ``demo``) on the CLI's
    subparsers."""
    p = sub.add_parser("hadamard", help="write the data-free Hadamard rotation for a model config")
    p.add_argument("--config", required=True, help="HF config.json (or a model directory holding one)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--method", default="hadamard", choices=["hadamard", "identity"])
    _mla_storage_arg(p)
    p.set_defaults(func=_hadamard)

    p = sub.add_parser("validate", help="check a rotation file against a model config")
    p.add_argument("rotation", help="rotation .safetensors file, or a directory")
    p.add_argument("--config", required=True, help="HF config.json (or a model directory holding one)")
    p.add_argument("--ortho-tol", type=ortho_tol, default=DEFAULT_ORTHO_TOL, help=f"max |R R^T - I| accepted (default {DEFAULT_ORTHO_TOL:g})")
    _mla_storage_arg(p)
    p.set_defaults(func=_validate)

    p = sub.add_parser("convert", help="convert upstream k_rotation_*.pt + v_rotation_*.pt files to .safetensors")
    p.add_argument("--k", required=True, help="upstream K rotation .pt")
    p.add_argument("--v", required=True, help="upstream V rotation .pt")
    p.add_argument("--config", help="HF config.json to validate against and record")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.set_defaults(func=_convert)

    p = sub.add_parser("bpe", help="bits per KV element of the INT2 cache at a context length")
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--group-size", type=positive_int, default=None, help="default: one group per row")
    p.add_argument("--scale-dtype", default="float16", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the (scale, zero) pairs (default float16)")
    p.add_argument("--context", type=int, default=131072, help="tokens in the cache (default 131072)")
    p.add_argument("--sink", type=int, default=64, help="BF16 sink tokens (default 64)")
    p.add_argument("--recent", type=int, default=256, help="BF16 recent tokens (default 256)")
    p.set_defaults(func=_bpe)

    p = sub.add_parser("demo", help="CPU demo: naive vs Hadamard vs OSCAR INT2 on synthetic attention data")
    p.add_argument("--context", type=int, default=4096, help="tokens of synthetic context (default 4096)")
    p.add_argument("--group-size", type=positive_int, default=None,
                   help="INT2 group size along head_dim (default: one group per row of 128)")
    p.add_argument("--seed", type=int, default=0,
                   help="data seed: rotations are fitted on draw seed+1 and scored on draw seed+2 (default 0)")
    p.set_defaults(func=_demo)


def _mla_storage_arg(p) -> None:
    p.add_argument("--mla-storage", choices=["latent", "expanded"], default=None,
                   help="MLA configs only: the server's --oscar-mla-storage. expanded: per-head K / V rotations of "
                        "the expanded geometry (DeepSeek-V3: K 192, V 128, one kv head per query head); latent: the "
                        "latent rotation file (also written by `fit --method hadamard`)")


def _file_geometry(args):
    """``(geometry, latent)``: the geometry a rotation file of ``args.config`` covers under ``--mla-storage``
    (the MHA geometry, an MLA model's expanded one, or its latent one with ``latent`` true).

    Raises:
        CLIError: ``--mla-storage`` for a config that is not MLA, or an MLA config without it, or
            ``expanded`` for a model that storage does not serve (Kimi-Linear, DSA, other architectures).
    """
    from ..errors import CLIError
    from ..rotation import ModelGeometry

    geometry = ModelGeometry.from_hf_config(args.config)
    mla = geometry.attention_kind == "mla"
    if args.mla_storage is not None and not mla:
        raise CLIError(f"--mla-storage applies to MLA configs; {geometry.model_type!r} is an MHA/GQA model: drop it")
    if mla and args.mla_storage is None:
        raise CLIError(f"{geometry.model_type!r} is an MLA model: pass --mla-storage expanded for the per-head K/V "
                       "rotations of --oscar-mla-storage expanded, or --mla-storage latent for a latent rotation file "
                       "(the default --oscar-mla-storage latent)")
    if args.mla_storage == "expanded":
        from ..backend.rotations import LatentOnlyError, check_expanded_model
        from ..rotation.geometry import _as_dict

        try:  # a file the server would refuse for this model is not written
            check_expanded_model(geometry, _as_dict(args.config).get("architectures"))
        except ValueError as exc:
            here = " (here: --mla-storage latent)" if isinstance(exc, LatentOnlyError) else ""
            raise CLIError(f"--mla-storage expanded: {exc}{here}") from None
        return geometry.expanded(), False
    return geometry, mla


def _hadamard(args) -> int:
    from ..rotation import RotationSet
    from ..rotation.latent import LatentRotationSet

    geometry, latent = _file_geometry(args)
    check_writable(args.out, "--out")
    # a latent file holds what the server uses without one: blocks of 128, or the whole latent when narrower
    rs = LatentRotationSet.served_data_free(geometry, args.method) if latent else RotationSet.data_free(geometry, args.method)
    rs.validate(geometry)
    if args.mla_storage == "expanded":  # provenance only: the launch check reads the shapes
        rs.metadata["mla_storage"] = "expanded"
    rs.save(args.out)
    if latent:
        print(f"wrote {args.method} latent rotations for {len(geometry.layers)} MLA layers of {geometry.model_type} "
              f"to {args.out} (kv_lora_rank {geometry.kv_lora_rank})")
        return 0
    # one matrix per layer at that layer's head_dim: a two-geometry model (Gemma-4: sliding 256,
    # full 512) gets both sizes; the summary names each geometry group so the user can see it
    groups = "; ".join(g.describe() for g in geometry.groups())
    print(f"wrote {args.method} rotations for {len(geometry.layers)} layers of {geometry.model_type} to {args.out} "
          f"({groups}{'; expanded MLA storage' if args.mla_storage == 'expanded' else ''})")
    return 0


def _validate(args) -> int:
    from ..rotation import ModelGeometry, RotationSet, orthogonality_error
    from ..rotation.latent import LatentRotationSet

    geometry, latent = _file_geometry(args)
    rs = (LatentRotationSet if latent else RotationSet).load(args.rotation)
    rs.validate(geometry, ortho_tol=args.ortho_tol)
    if not latent:
        from ..backend.rotations import check_centering
        from ..errors import CLIError

        try:  # the server refuses such means for this model
            check_centering(rs, geometry, args.config)
        except ValueError as exc:
            raise CLIError(f"{args.rotation} {exc}") from None
    mats = list(rs.r.values()) if latent else list(rs.k.values()) + list(rs.v.values())
    worst = max(orthogonality_error(t) for t in mats)
    report = {
        "path": args.rotation,
        "ok": True,
        "model_type": geometry.model_type,
        "layers": len(rs.layer_ids),
        "format_version": getattr(rs, "format_version", None),
        "method": rs.metadata.get("method"),
        "max_orthogonality_error": worst,
    }
    from ..calibrate.verb_inputs import report_unserved

    # an expanded file's geometry is MHA; the model's own (MLA) is what the server judges
    report_unserved(report, geometry if not args.mla_storage else ModelGeometry.from_hf_config(args.config),
                    args.config)
    print(json.dumps(report))
    return 0


def _convert(args) -> int:
    from ..rotation import ModelGeometry, RotationSet

    rs = RotationSet.from_upstream_pt(args.k, args.v)
    check_writable(args.out, "--out")
    if args.config:
        geometry = ModelGeometry.from_hf_config(args.config)
        rs.validate(geometry)
        rs.metadata.update(model_type=geometry.model_type, geometry=geometry.to_dict())
    rs.save(args.out)
    print(f"wrote {len(rs.layer_ids)} layers (format_version {rs.format_version}) to {args.out}")
    return 0


def _bpe(args) -> int:
    from ..quant import bits_per_element, quant_bits_per_element

    total = bits_per_element(args.head_dim, args.group_size, args.scale_dtype, args.context, args.sink, args.recent)
    upstream = bits_per_element(args.head_dim, args.group_size, args.scale_dtype, args.context, args.sink, args.recent,
                                hp_also_quantized=False)
    q = quant_bits_per_element(args.head_dim, args.group_size, args.scale_dtype)
    print(f"bits/element at {args.context} tokens: {total:.4f} (INT2 tier {q:.4f} + BF16 window copies; "
          f"compression vs BF16 {16.0 / total:.2f}x; the original's accounting, windows replacing INT2: {upstream:.4f})")
    return 0


def _demo(args) -> int:
    from ..demo import main

    print(main(seq_len=args.context, group_size=args.group_size, seed=args.seed))
    return 0
