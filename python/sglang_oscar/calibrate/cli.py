"""Verbs ``calibrate``, ``fit``, ``error``, ``ppl``, ``quality``, ``validate-rotation``, ``validate-latent`` and ``recipe-cmd``.

Every verb accepts ``--recipe recipes/<model>/recipe.toml``: it supplies the model id,
calibration data and budget, rotation method and paths, and the served quantizer settings;
explicit flags override it. ``error`` and ``ppl`` never default to the recipe's calibration data
(they need held-out ``--prompts``), and with ``--recipe`` the recipe's rotation file must exist.
``recipe-cmd`` prints the exact argv of one step for a recipe (one element per line), which is
what ``recipes/<model>/compute_rotation.sh`` executes.

Statistics and rotations record the fingerprint of their model (:func:`.model.config_fingerprint`);
``fit``, ``error``, ``ppl`` and the validate verbs refuse them for another model of the same
geometry unless ``--allow-other-model`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from ..cli.arg_types import ortho_tol, positive_int
from ..cli.paths import check_writable
from ..constants import DEFAULT_ORTHO_TOL
from . import FIT_METHODS
from .verb_inputs import (check_group_fits, documents_of, load_model_of, oscar_config_of, prompt_set_of, read_config,
                          recipe_of, recipe_rotation, report_unserved, require_held_out, rotations_from_specs,
                          warn_not_held_out, write_json)

DEFAULT_ERROR_TOKENS = 8192
DEFAULT_PPL_TOKENS = 16384


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the calibration verbs (``calibrate``, ``fit``, ``error``, ``ppl``, ``quality``,
    ``validate-rotation``, ``validate-latent``, ``recipe-cmd``) on the CLI's subparsers."""
    p = sub.add_parser("calibrate", help="capture Q/K/V statistics of a transformers model (fp64, resumable)")
    _model_args(p)
    _prompt_args(p, tokens=None, seed=0)
    p.add_argument("--out", help="statistics .safetensors (default with --recipe: <recipe folder>/calib/stats.safetensors)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences per forward (equal lengths only)")
    p.add_argument("--checkpoint-every", type=positive_int, default=32, help="sequences between checkpoints (default 32)")
    p.add_argument("--restart", action="store_true", help="discard an existing checkpoint and start over")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("fit", help="statistics -> validated rotation file")
    p.add_argument("--recipe", help="recipe.toml (method, output path)")
    p.add_argument("--stats", help="statistics file from `sglang-oscar calibrate`")
    p.add_argument("--method", choices=list(FIT_METHODS), default=None,
                   help="default: the recipe's method, else oscar (perhead-kv: upstream's raw K/V per-head fit)")
    p.add_argument("--out", help="rotation .safetensors (default with --recipe: [rotation].path)")
    p.add_argument("--config", help="model config.json, model dir or Hub id: check the statistics against it (required "
                                    "for data-free methods without --stats); copied next to --out as <out>.config.json")
    p.add_argument("--trust-remote-code", action="store_true", help="when --config is a Hub id of a remote-code model")
    p.add_argument("--min-tokens", type=positive_int, default=None,
                   help="minimum tokens per layer for fitted methods, > 0 (default 4096)")
    p.add_argument("--latent-block", type=int, default=None,
                   help="MLA: Hadamard block of latent rotations, a power of two dividing kv_lora_rank (default: the "
                        "recipe's group size, else 128 or the whole latent when kv_lora_rank is narrower, as served)")
    p.add_argument("--upstream-dir", help="MLA: also write the upstream layer_<id>.pt directory")
    p.add_argument("--center", action="store_true",
                   help="MHA/GQA: also store the per-kv-head key and value means; the cache then holds (x - mean) R "
                        "(needs --stats; not for soft-capped models)")
    _allow_other_model_arg(p)
    p.set_defaults(func=_fit)

    p = sub.add_parser("error", help="attention-output error (dB) of INT2 with naive/Hadamard/fitted rotations")
    _model_args(p)
    _prompt_args(p, tokens=DEFAULT_ERROR_TOKENS, seed=1)
    p.add_argument("--rotation", action="append", default=[], metavar="[NAME=]PATH", help="rotation file to compare (repeatable)")
    p.add_argument("--no-baselines", action="store_true", help="omit naive/Hadamard/bf16 rows")
    _quant_args(p)
    _allow_other_model_arg(p)
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=_error)

    p = sub.add_parser("ppl", help="teacher-forced perplexity, BF16 vs fake-quant INT2 KV through the oracle")
    _model_args(p)
    _prompt_args(p, tokens=DEFAULT_PPL_TOKENS, seed=0)
    p.add_argument("--rotation", help="rotation file (default: the recipe's, which must exist; without a recipe the "
                                      "data-free --method)")
    p.add_argument("--method", choices=["hadamard", "identity"], default="hadamard",
                   help="data-free rotation when neither --rotation nor --recipe is given")
    _quant_args(p)
    _allow_other_model_arg(p)
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=_ppl)

    p = sub.add_parser("quality", help="held-out perplexity and attention error of BF16, naive INT2, KIVI, Hadamard and "
                                       "OSCAR caches on one checkpoint (docs/quality.md)")
    p.add_argument("--model", required=True, help="checkpoint directory (scripts/train_small_lm.py output)")
    p.add_argument("--calib", help="calibration documents, JSONL (default: MODEL/calib.jsonl)")
    p.add_argument("--heldout", help="evaluation documents, JSONL, disjoint from --calib (default: MODEL/heldout.jsonl)")
    p.add_argument("--out-dir", required=True, help="writes quality.json and quality.md here")
    p.add_argument("--work-dir", help="statistics and fitted rotations (default: --out-dir)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--calib-tokens", type=positive_int, default=32768, help="calibration tokens (default 32768)")
    p.add_argument("--eval-tokens", type=positive_int, default=32768, help="held-out tokens (default 32768)")
    p.add_argument("--max-seq-per-file", type=int, default=1,
                   help="at most this many --seq-len sequences per file (JSONL record) for the calibration and the "
                        "evaluation sets, taken round robin over the files in a seeded order; files shorter than "
                        "--seq-len are packed together (default 1; 0: pack all documents in a seeded order and use "
                        "the first tokens)")
    p.add_argument("--sink", type=int, default=64, help="BF16 sink of the +win rows (default 64)")
    p.add_argument("--recent", type=int, default=256, help="BF16 recent window of the +win rows (default 256)")
    p.add_argument("--group-size", type=positive_int, default=None, help="OSCAR-format group size (default: head_dim)")
    p.add_argument("--k-clip", type=float, default=0.96)
    p.add_argument("--v-clip", type=float, default=0.92)
    p.add_argument("--scale-dtype", choices=["float32", "float16", "bfloat16"], default="float16")
    p.add_argument("--kivi-residual", type=int, default=128, help="KIVI full-precision residual (default 128)")
    p.add_argument("--kivi-group", type=int, action="append", default=None,
                   help="KIVI key group size in tokens, repeatable (default 128 and 32)")
    p.add_argument("--min-tokens", type=positive_int, default=4096, help="minimum calibration tokens per layer (default 4096)")
    p.add_argument("--variants", help="comma-separated row names to compute (default all)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    p.add_argument("--device", help="cuda | cuda:N | cpu (default: cuda if available)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bars (default: on a terminal)")
    p.set_defaults(func=_quality)

    p = sub.add_parser("validate-rotation",
                       help="check a rotation file (K/V or MLA latent, by its content) against a model config")
    p.add_argument("rotation")
    p.add_argument("--config", required=True, help="HF config.json (or a local model directory)")
    p.add_argument("--ortho-tol", type=ortho_tol, default=DEFAULT_ORTHO_TOL)
    _allow_other_model_arg(p)
    p.set_defaults(func=_validate_rotation)

    p = sub.add_parser("validate-latent", help="check an MLA latent rotation file against a model config")
    p.add_argument("rotation")
    p.add_argument("--config", required=True, help="HF config.json (or a local model directory)")
    p.add_argument("--ortho-tol", type=ortho_tol, default=DEFAULT_ORTHO_TOL)
    _allow_other_model_arg(p)
    p.set_defaults(func=_validate_latent)

    p = sub.add_parser("recipe-cmd", help="print the exact sglang-oscar argv of one step of a recipe")
    p.add_argument("--recipe", required=True)
    p.add_argument("--step", required=True, choices=["calibrate", "fit", "validate", "error", "ppl"])
    p.add_argument("--model", help="local model path (default: the recipe's hf_id)")
    p.add_argument("--data", help="calibration prompts (default: the recipe's calib_data); held-out prompts for error/ppl (required)")
    p.add_argument("--out-dir", help="folder for statistics and rotation (default: the recipe's folder)")
    p.add_argument("--prog", default="sglang-oscar", help="program name to print first")
    p.add_argument("--shell", action="store_true", help="print one shell-quoted line instead of one argument per line")
    p.set_defaults(func=_recipe_cmd)


# ----------------------------------------------------------------------------- shared flags
def _allow_other_model_arg(p) -> None:
    p.add_argument("--allow-other-model", action="store_true",
                   help="accept statistics/rotations whose recorded model fingerprint (model_type, sizes, name) differs "
                        "from this model's; the geometry must still match")


def _model_args(p) -> None:
    p.add_argument("--recipe", help="recipe.toml supplying defaults")
    p.add_argument("--model", help="model directory or hub id (default: the recipe's hf_id)")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32")
    p.add_argument("--device", help="cuda | cuda:N | cpu (default: cuda if available)")
    p.add_argument("--device-map", help="e.g. auto: spread the model over the GPUs of this host (accelerate); default "
                                        "auto when more than one GPU is visible")
    p.add_argument("--trust-remote-code", action="store_true")


def _prompt_args(p, tokens: int | None, seed: int) -> None:
    p.add_argument("--prompts", "--data", dest="prompts",
                   help="text file, JSONL with a text field, task:<name>, or a datasets name NAME[:CONFIG[:SPLIT]]")
    p.add_argument("--tokens", type=positive_int, default=tokens,
                   help=f"token budget, > 0 (default {tokens or 'recipe calib_tokens, else 30000'})")
    p.add_argument("--seed", type=int, default=seed, help=f"sampling seed (default {seed})")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--text-field", default="text", help="JSONL/dataset text field (default text)")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="pack documents into seq-len blocks (default: yes for text/datasets, no for JSONL/tasks)")


def _quant_args(p) -> None:
    p.add_argument("--group-size", type=positive_int, default=None)
    p.add_argument("--k-clip", type=float, default=None)
    p.add_argument("--v-clip", type=float, default=None)
    p.add_argument("--sink", type=int, default=None, help="BF16 sink tokens (default: recipe, else 64)")
    p.add_argument("--recent", type=int, default=None, help="BF16 recent tokens (default: recipe, else 256)")
    p.add_argument("--quantizer", choices=["uniform", "lloyd-max"], default=None)
    p.add_argument("--scale-dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--window-mode", choices=["decode", "extend"], default="decode",
                   help="decode: every position as if decoded (default); extend: as served for prefill")


# ----------------------------------------------------------------------------- verbs
def _calibrate(args) -> int:
    from . import CalibrationError
    from .model import config_dict
    from .recipes import default_paths, stats_config_path
    from .run import calibrate_model, summary

    recipe = recipe_of(args)
    out = args.out or (default_paths(recipe)["stats"] if recipe else None)
    if not out:
        raise CalibrationError("--out is required (or --recipe)")
    check_writable(out, "--out")  # before hours of forward passes
    docs = documents_of(args, recipe.rotation.calib_data if recipe else None)
    model_path, model, tok = load_model_of(args, recipe)
    prompts = prompt_set_of(args, tok, recipe, docs)
    st = calibrate_model(model, prompts, out, model_id=model_path, batch_size=args.batch_size,
                         checkpoint_every=args.checkpoint_every, restart=args.restart, progress=args.progress)
    cfg_path = stats_config_path(out)
    with open(cfg_path, "w") as f:
        json.dump(config_dict(model.config), f, indent=2, sort_keys=True)
    print(json.dumps({"out": out, "config": cfg_path, **summary(st)}))
    return 0


def _fit(args) -> int:
    from . import CalibrationError
    from .fit import DEFAULT_MIN_TOKENS, fit_rotations
    from .model import config_fingerprint, geometry_of
    from .oracle import settings
    from ..rotation.latent import DEFAULT_LATENT_BLOCK, served_latent_block
    from .recipes import check_geometry, default_paths, oscar_config, rotation_config_path, rotation_kind
    from .stats import CalibrationStats

    recipe = recipe_of(args)
    method = args.method or (recipe.rotation.method if recipe else "oscar")
    out = args.out or (default_paths(recipe)["rotation"] if recipe else None)
    if not out:
        raise CalibrationError("--out is required (or --recipe)")
    cfg = geometry = fingerprint = None
    if args.config:
        cfg, name = read_config(args.config, hub=True, trust_remote_code=args.trust_remote_code)
        geometry = geometry_of(cfg)
        fingerprint = config_fingerprint(cfg, name)
    if args.stats and os.path.exists(out) and os.path.exists(args.stats) and os.path.samefile(out, args.stats):
        raise CalibrationError(f"--out {out} is the statistics file itself (--stats): writing the rotation there would "
                               "destroy the statistics; pass another --out")
    if args.stats:
        stats = CalibrationStats.load(args.stats)
    elif args.center or (recipe is not None and recipe.rotation.center):
        raise CalibrationError("--center (or the recipe's [rotation].center) needs --stats: the key and value means "
                               "come from the calibration statistics (create them with `sglang-oscar calibrate`)")
    elif method in ("hadamard", "identity") and geometry is not None:
        # The config's own fingerprint: the geometry's model_type is a multimodal wrapper's text model
        # (Gemma-3-it, MiniMax-M3 VL), which fit would refuse as "another model" than this config.
        stats = CalibrationStats(geometry, {"path": args.config, "model": {"id": name, "fingerprint": fingerprint}})
    else:
        raise CalibrationError("--stats is required (data-free methods may give --config instead)")
    geo = geometry or stats.geometry
    if recipe is not None:
        check_geometry(recipe, geo, cfg or stats.meta.get("model", {}).get("config"))
        kind = "latent" if geo.attention_kind == "mla" else "kv"
        if kind != rotation_kind(recipe):
            raise CalibrationError(
                f"{recipe.path}: the recipe describes a {rotation_kind(recipe)} rotation but the model's attention is "
                f"{geo.attention_kind.upper()} ({kind} rotations): fix [geometry] (kv_lora_rank marks MLA models)"
            )
    if args.latent_block is not None and geo.attention_kind != "mla":
        raise CalibrationError("--latent-block applies to MLA latent rotations only")
    if args.upstream_dir and geo.attention_kind != "mla":  # before anything is written
        raise CalibrationError("--upstream-dir applies to MLA latent rotations only")
    if args.latent_block is not None:
        block = args.latent_block
    else:  # the recipe's group size, else the server's data-free rule (128, or the whole latent when narrower)
        block = (recipe.quant.group_size if recipe is not None else None) or (
            served_latent_block(int(geo.kv_lora_rank)) if geo.attention_kind == "mla" else DEFAULT_LATENT_BLOCK)
    check_writable(out, "--out")
    if args.upstream_dir:
        check_writable(os.path.join(args.upstream_dir, "layer_0.pt"), "--upstream-dir")
    min_tokens = args.min_tokens if args.min_tokens is not None else DEFAULT_MIN_TOKENS
    rs = fit_rotations(stats, method, min_tokens=min_tokens, latent_block=block, geometry=geometry,
                       fingerprint=fingerprint, allow_other_model=args.allow_other_model,
                       center=args.center or bool(recipe is not None and recipe.rotation.center))
    if recipe is not None:
        rs.metadata["recipe"] = str(recipe.path)
        rs.metadata["quantizer"] = settings(oscar_config(recipe))
    rs.save(out)
    written = {"out": out}
    if cfg is not None:  # a local copy, so that `validate-rotation` never needs the Hub
        written["config"] = rotation_config_path(out)
        with open(written["config"], "w") as f:
            json.dump({**cfg, "_name_or_path": name}, f, indent=2, sort_keys=True, default=str)
    if args.upstream_dir:
        rs.save_upstream_dir(args.upstream_dir)
    print(json.dumps({**written, "method": method, "layers": len(rs.layer_ids), "model_type": stats.geometry.model_type,
                      "kind": "latent" if hasattr(rs, "save_upstream_dir") else f"kv_v{rs.format_version}",
                      "centered": bool(getattr(rs, "centered", False))}))
    return 0


def _error(args) -> int:
    from .error import format_report, functional_error

    recipe = recipe_of(args)
    require_held_out(args, recipe, "error")
    if args.out:
        check_writable(args.out, "--out")
    specs = list(args.rotation) or ([recipe_rotation(recipe)] if recipe is not None else [])
    rotations = rotations_from_specs(specs)
    cfg = oscar_config_of(args, recipe)
    check_group_fits(cfg, rotations)
    docs = documents_of(args)
    _, model, tok = load_model_of(args, recipe)
    prompts = prompt_set_of(args, tok, recipe, docs)
    warn_not_held_out(rotations, prompts)
    rep = functional_error(model, prompts, rotations, cfg, window_mode=args.window_mode,
                           include_baselines=not args.no_baselines, allow_other_model=args.allow_other_model)
    write_json(args.out, rep)
    print(format_report(rep))
    return 0


def _ppl(args) -> int:
    from ..rotation import RotationSet
    from ..rotation.latent import LatentRotationSet
    from .fit import load_rotation_any
    from .model import geometry_of
    from .ppl import format_report, perplexity

    recipe = recipe_of(args)
    require_held_out(args, recipe, "ppl")
    if args.out:
        check_writable(args.out, "--out")
    path = args.rotation or (recipe_rotation(recipe) if recipe is not None else None)
    cfg = oscar_config_of(args, recipe)
    if path:
        rotation = load_rotation_any(path)
        check_group_fits(cfg, {os.path.basename(path): rotation})
    docs = documents_of(args)
    _, model, tok = load_model_of(args, recipe)
    if not path:
        geometry = geometry_of(model.config)
        rotation = (LatentRotationSet.served_data_free(geometry, args.method) if geometry.attention_kind == "mla"
                    else RotationSet.data_free(geometry, args.method))
    prompts = prompt_set_of(args, tok, recipe, docs)
    warn_not_held_out({os.path.basename(path) if path else args.method: rotation}, prompts)
    rep = perplexity(model, prompts, rotation, cfg, window_mode=args.window_mode, allow_other_model=args.allow_other_model)
    write_json(args.out, rep)
    print(format_report(rep))
    return 0


def _quality(args) -> int:
    from .quality import QualitySettings, format_markdown, run_quality

    settings = QualitySettings(seq_len=args.seq_len, sink=args.sink, recent=args.recent, group_size=args.group_size,
                               k_clip=args.k_clip, v_clip=args.v_clip, scale_dtype=args.scale_dtype,
                               kivi_residual=args.kivi_residual, kivi_groups=tuple(args.kivi_group or (128, 32)),
                               min_tokens=args.min_tokens)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    rep = run_quality(args.model, out_dir=args.out_dir, calib_path=args.calib, heldout_path=args.heldout,
                      work_dir=args.work_dir, settings=settings, calib_tokens=args.calib_tokens,
                      eval_tokens=args.eval_tokens, dtype=args.dtype, device=args.device, progress=args.progress,
                      variants=variants, max_seq_per_file=args.max_seq_per_file)
    print(format_markdown(rep))
    print(json.dumps(rep["outputs"]))
    return 0


def _validate_any(args, latent_only: bool) -> int:
    from ..rotation.latent import LatentRotationSet
    from ..rotation.rotation_set import orthogonality_error
    from .fit import check_rotation, load_rotation_any
    from .model import config_fingerprint, geometry_of

    cfg, name = read_config(args.config)
    geometry = geometry_of(cfg)
    rs = LatentRotationSet.load(args.rotation) if latent_only else load_rotation_any(args.rotation)
    check_rotation(rs, geometry, config_fingerprint(cfg, name), allow_other_model=args.allow_other_model,
                   ortho_tol=args.ortho_tol, hf_config=cfg)
    report = {"path": args.rotation, "ok": True, "model_type": geometry.model_type, "layers": len(rs.layer_ids),
              "method": rs.metadata.get("method")}
    if isinstance(rs, LatentRotationSet):
        mats = list(rs.r.values())
        report.update(kind="latent", kv_lora_rank=geometry.kv_lora_rank)
    else:
        mats = list(rs.k.values()) + list(rs.v.values())
        report.update(kind="kv", format_version=rs.format_version,
                      centered={"k": bool(rs.k_mean), "v": bool(rs.v_mean)})
    report_unserved(report, geometry, cfg)
    report["max_orthogonality_error"] = max(orthogonality_error(t) for t in mats)
    print(json.dumps(report))
    return 0


def _validate_rotation(args) -> int:
    return _validate_any(args, latent_only=False)


def _validate_latent(args) -> int:
    return _validate_any(args, latent_only=True)


def _recipe_cmd(args) -> int:
    from .recipes import load, step_command

    recipe = load(args.recipe)
    cmd = step_command(recipe, args.step, model=args.model, data=args.data, out_dir=args.out_dir, prog=args.prog)
    if args.shell:
        print(shlex.join(cmd) if cmd else "")
    else:
        for a in cmd:
            print(a)
    sys.stdout.flush()
    return 0
