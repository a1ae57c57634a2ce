"""Verbs ``calibrate``, ``fit``, ``error``, ``ppl``, ``validate-latent`` and ``recipe-cmd``.

Every verb accepts ``--recipe rotation/<model>/recipe.toml``: it supplies the model id,
calibration data and budget, rotation method and paths, and the served quantizer settings;
explicit flags override it. ``recipe-cmd`` prints the exact argv of one step for a recipe (one
element per line), which is what ``rotation/<model>/compute_rotation.sh`` executes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings

DEFAULT_ERROR_TOKENS = 8192
DEFAULT_PPL_TOKENS = 16384


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="capture Q/K/V statistics of a transformers model (fp64, resumable)")
    _model_args(p)
    _prompt_args(p, tokens=None, seed=0)
    p.add_argument("--out", help="statistics .safetensors (default with --recipe: <recipe folder>/calib/stats.safetensors)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward (equal lengths only)")
    p.add_argument("--checkpoint-every", type=int, default=32, help="sequences between checkpoints (default 32)")
    p.add_argument("--restart", action="store_true", help="discard an existing checkpoint and start over")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("fit", help="statistics -> validated rotation file")
    p.add_argument("--recipe", help="recipe.toml (method, output path)")
    p.add_argument("--stats", help="statistics file from `sglang-oscar calibrate`")
    p.add_argument("--method", choices=["oscar", "oscar-perhead", "hadamard", "identity"], default=None,
                   help="default: the recipe's method, else oscar")
    p.add_argument("--out", help="rotation .safetensors (default with --recipe: [rotation].path)")
    p.add_argument("--config", help="model config.json / model dir: check the statistics against it (required for "
                                    "data-free methods without --stats)")
    p.add_argument("--min-tokens", type=int, default=None, help="minimum tokens per layer for fitted methods (default 4096)")
    p.add_argument("--latent-block", type=int, default=None, help="MLA: Hadamard block of latent rotations (default: group size or 128)")
    p.add_argument("--upstream-dir", help="MLA: also write the upstream layer_<id>.pt directory")
    p.set_defaults(func=_fit)

    p = sub.add_parser("error", help="attention-output error (dB) of INT2 with naive/Hadamard/fitted rotations")
    _model_args(p)
    _prompt_args(p, tokens=DEFAULT_ERROR_TOKENS, seed=1)
    p.add_argument("--rotation", action="append", default=[], metavar="[NAME=]PATH", help="rotation file to compare (repeatable)")
    p.add_argument("--no-baselines", action="store_true", help="omit naive/Hadamard/bf16 rows")
    _quant_args(p)
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=_error)

    p = sub.add_parser("ppl", help="teacher-forced perplexity, BF16 vs fake-quant INT2 KV through the oracle")
    _model_args(p)
    _prompt_args(p, tokens=DEFAULT_PPL_TOKENS, seed=0)
    p.add_argument("--rotation", help="rotation file (default: the recipe's, else data-free --method)")
    p.add_argument("--method", choices=["hadamard", "identity"], default="hadamard", help="data-free rotation when no file is given")
    _quant_args(p)
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(func=_ppl)

    p = sub.add_parser("validate-latent", help="check an MLA latent rotation file against a model config")
    p.add_argument("rotation")
    p.add_argument("--config", required=True, help="HF config.json (or a model directory)")
    p.add_argument("--ortho-tol", type=float, default=1e-3)
    p.set_defaults(func=_validate_latent)

    p = sub.add_parser("recipe-cmd", help="print the exact sglang-oscar argv of one step of a recipe")
    p.add_argument("--recipe", required=True)
    p.add_argument("--step", required=True, choices=["calibrate", "fit", "validate", "error", "ppl"])
    p.add_argument("--model", help="local model path (default: the recipe's hf_id)")
    p.add_argument("--data", help="calibration/eval prompts (default: the recipe's calib_data)")
    p.add_argument("--out-dir", help="folder for statistics and rotation (default: the recipe's folder)")
    p.add_argument("--prog", default="sglang-oscar", help="program name to print first")
    p.add_argument("--shell", action="store_true", help="print one shell-quoted line instead of one argument per line")
    p.set_defaults(func=_recipe_cmd)


# ----------------------------------------------------------------------------- shared flags
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
    p.add_argument("--tokens", type=int, default=tokens, help=f"token budget (default {tokens or 'recipe calib_tokens, else 30000'})")
    p.add_argument("--seed", type=int, default=seed, help=f"sampling seed (default {seed})")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--text-field", default="text", help="JSONL/dataset text field (default text)")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="pack documents into seq-len blocks (default: yes for text/datasets, no for JSONL/tasks)")


def _quant_args(p) -> None:
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--k-clip", type=float, default=None)
    p.add_argument("--v-clip", type=float, default=None)
    p.add_argument("--sink", type=int, default=None, help="BF16 sink tokens (default: recipe, else 64)")
    p.add_argument("--recent", type=int, default=None, help="BF16 recent tokens (default: recipe, else 256)")
    p.add_argument("--quantizer", choices=["uniform", "lloyd-max"], default=None)
    p.add_argument("--scale-dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p.add_argument("--window-mode", choices=["decode", "extend"], default="decode",
                   help="decode: every position as if decoded (default); extend: as served for prefill")


# ----------------------------------------------------------------------------- helpers
def _recipe(args):
    if not getattr(args, "recipe", None):
        return None
    from .recipes import load

    return load(args.recipe)


def _load(args, recipe):
    import torch

    from . import CalibrationError
    from .model import load_model

    model_path = args.model or (recipe.model.hf_id if recipe else None)
    if not model_path:
        raise CalibrationError("--model is required (or --recipe)")
    device_map = args.device_map
    if device_map is None and torch.cuda.device_count() > 1 and not args.device:
        device_map = "auto"
    model, tok = load_model(model_path, dtype=args.dtype, device=args.device, device_map=device_map,
                            trust_remote_code=args.trust_remote_code)
    if recipe is not None:
        from .model import geometry_of
        from .recipes import check_geometry

        check_geometry(recipe, geometry_of(model.config))
    return model_path, model, tok


def _prompts(args, tok, recipe, default_source: str | None = None):
    from . import CalibrationError
    from .prompts import DEFAULT_BUDGET, build_prompt_set

    source = args.prompts or default_source
    if not source:
        raise CalibrationError("--prompts is required (a text/JSONL file, task:<name>, or a datasets name)")
    budget = args.tokens or (recipe.rotation.calib_tokens if recipe and recipe.rotation.calib_tokens else DEFAULT_BUDGET)
    return build_prompt_set(tok, source, budget=budget, seed=args.seed, seq_len=args.seq_len, pack=args.pack,
                            text_field=args.text_field)


def _config(args, recipe):
    from ..config import OscarConfig
    from .recipes import oscar_config

    base = oscar_config(recipe) if recipe else OscarConfig()
    over = {k: v for k, v in dict(group_size=args.group_size, k_clip_ratio=args.k_clip, v_clip_ratio=args.v_clip,
                                  sink_tokens=args.sink, recent_tokens=args.recent, quantizer=args.quantizer,
                                  scale_dtype=args.scale_dtype).items() if v is not None}
    import dataclasses

    return dataclasses.replace(base, **over)


def _write_json(path: str | None, obj) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)


# ----------------------------------------------------------------------------- verbs
def _calibrate(args) -> int:
    from . import CalibrationError
    from .model import config_dict
    from .recipes import default_paths, stats_config_path
    from .run import calibrate_model, summary

    recipe = _recipe(args)
    out = args.out or (default_paths(recipe)["stats"] if recipe else None)
    if not out:
        raise CalibrationError("--out is required (or --recipe)")
    model_path, model, tok = _load(args, recipe)
    prompts = _prompts(args, tok, recipe, recipe.rotation.calib_data if recipe else None)
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
    from .model import geometry_of
    from .recipes import check_geometry, default_paths
    from .stats import CalibrationStats

    recipe = _recipe(args)
    method = args.method or (recipe.rotation.method if recipe else "oscar")
    out = args.out or (default_paths(recipe)["rotation"] if recipe else None)
    if not out:
        raise CalibrationError("--out is required (or --recipe)")
    geometry = None
    if args.config:
        if os.path.exists(args.config):
            cfg = _read_config(args.config)
        else:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(args.config).to_dict()
        geometry = geometry_of(cfg)
    block = args.latent_block or (recipe.quant.group_size if recipe and recipe.quant.group_size else None) or 128
    if args.stats:
        stats = CalibrationStats.load(args.stats)
    elif method in ("hadamard", "identity") and geometry is not None:
        from .stats import CalibrationStats as _S

        stats = _S(geometry, {"path": None})
    else:
        raise CalibrationError("--stats is required (data-free methods may give --config instead)")
    if recipe is not None:
        check_geometry(recipe, geometry or stats.geometry)
    min_tokens = args.min_tokens if args.min_tokens is not None else DEFAULT_MIN_TOKENS
    rs = fit_rotations(stats, method, min_tokens=min_tokens, latent_block=block, geometry=geometry)
    if recipe is not None:
        rs.metadata["recipe"] = str(recipe.path)
        q = recipe.quant
        rs.metadata["quantizer"] = {"group_size": q.group_size, "k_clip_ratio": q.k_clip_ratio, "v_clip_ratio": q.v_clip_ratio,
                                    "sink_tokens": q.sink_tokens, "recent_tokens": q.recent_tokens,
                                    "quantizer": q.quantizer, "scale_dtype": q.scale_dtype}
    rs.save(out)
    if args.upstream_dir:
        if not hasattr(rs, "save_upstream_dir"):
            raise CalibrationError("--upstream-dir applies to MLA latent rotations only")
        rs.save_upstream_dir(args.upstream_dir)
    print(json.dumps({"out": out, "method": method, "layers": len(rs.layer_ids), "model_type": stats.geometry.model_type,
                      "kind": "latent" if hasattr(rs, "save_upstream_dir") else f"kv_v{rs.format_version}"}))
    return 0


def _rotations_from_args(specs: list[str]) -> dict:
    from .fit import load_rotation_any

    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = "", spec
        rs = load_rotation_any(path)
        name = name or rs.metadata.get("method") or "fitted"
        if name in ("naive", "hadamard", "bf16") or name in out:
            name = f"{name}:{os.path.basename(path)}"
        out[name] = rs
    return out


def _warn_not_held_out(rotations: dict, prompts) -> None:
    for name, rs in rotations.items():
        cal = rs.metadata.get("calibration", {})
        if cal.get("tokens_sha256") and cal.get("tokens_sha256") == prompts.meta.get("tokens_sha256"):
            warnings.warn(f"rotation {name!r} was calibrated on exactly these token sequences: the error is not held-out", stacklevel=2)


def _error(args) -> int:
    from .error import format_report, functional_error
    from .recipes import default_paths

    recipe = _recipe(args)
    specs = list(args.rotation)
    if not specs and recipe is not None and os.path.exists(default_paths(recipe)["rotation"]):
        specs = [default_paths(recipe)["rotation"]]
    rotations = _rotations_from_args(specs)
    _, model, tok = _load(args, recipe)
    prompts = _prompts(args, tok, recipe, recipe.rotation.calib_data if recipe else None)
    _warn_not_held_out(rotations, prompts)
    rep = functional_error(model, prompts, rotations, _config(args, recipe), window_mode=args.window_mode,
                           include_baselines=not args.no_baselines)
    _write_json(args.out, rep)
    print(format_report(rep))
    return 0


def _ppl(args) -> int:
    from ..rotation import RotationSet
    from ..rotation.latent import LatentRotationSet
    from .fit import load_rotation_any
    from .model import geometry_of
    from .ppl import format_report, perplexity
    from .recipes import default_paths

    recipe = _recipe(args)
    path = args.rotation
    if path is None and recipe is not None and os.path.exists(default_paths(recipe)["rotation"]):
        path = default_paths(recipe)["rotation"]
    _, model, tok = _load(args, recipe)
    cfg = _config(args, recipe)
    if path:
        rotation = load_rotation_any(path)
    else:
        geometry = geometry_of(model.config)
        rotation = (LatentRotationSet.data_free(geometry, args.method, cfg.group_size) if geometry.attention_kind == "mla"
                    else RotationSet.data_free(geometry, args.method))
    prompts = _prompts(args, tok, recipe, recipe.rotation.calib_data if recipe else None)
    rep = perplexity(model, prompts, rotation, cfg, window_mode=args.window_mode)
    _write_json(args.out, rep)
    print(format_report(rep))
    return 0


def _validate_latent(args) -> int:
    from ..rotation.latent import LatentRotationSet
    from ..rotation.rotation_set import orthogonality_error
    from .model import geometry_of

    geometry = geometry_of(_read_config(args.config))
    rs = LatentRotationSet.load(args.rotation)
    rs.validate(geometry, ortho_tol=args.ortho_tol)
    print(json.dumps({"path": args.rotation, "ok": True, "model_type": geometry.model_type, "layers": len(rs.layer_ids),
                      "kv_lora_rank": geometry.kv_lora_rank, "method": rs.metadata.get("method"),
                      "max_orthogonality_error": max(orthogonality_error(t) for t in rs.r.values())}))
    return 0


def _read_config(path: str) -> dict:
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(p):
        raise FileNotFoundError(f"model config {p} does not exist")
    with open(p) as f:
        return json.load(f)


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
