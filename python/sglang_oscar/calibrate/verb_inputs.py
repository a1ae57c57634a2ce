"""What the calibration verbs read from their arguments: the recipe, the model, the prompt set, the
OSCAR settings, the rotation files and model configs, each checked before the expensive step that
uses it (a group size against the rotation files before the model loads, held-out prompts before
``error`` / ``ppl`` run)."""

from __future__ import annotations

import json
import os
import warnings


def recipe_of(args):
    """The loaded ``--recipe`` (:func:`.recipes.load`), or ``None`` when the verb got none."""
    if not getattr(args, "recipe", None):
        return None
    from .recipes import load

    return load(args.recipe)


def load_model_of(args, recipe):
    """``(model path, model, tokenizer)`` of ``--model`` (else the recipe's ``hf_id``), spread over the
    host's GPUs when several are visible and no ``--device`` is given.

    Raises:
        CalibrationError: no model named, or a model whose geometry differs from the recipe's.
    """
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
        from .model import config_dict, geometry_of
        from .recipes import check_geometry

        check_geometry(recipe, geometry_of(model.config), config_dict(model.config))
    return model_path, model, tok


def documents_of(args, default_source: str | None = None):
    """The documents of ``--prompts`` (else ``default_source``), read before the model loads so that a
    missing file or an unreachable dataset fails in seconds, not after the load.

    Raises:
        CalibrationError: no source, or one that cannot be read (:func:`.prompts.load_documents`).
    """
    from . import CalibrationError
    from .prompts import load_documents

    source = args.prompts or default_source
    if not source:
        raise CalibrationError("--prompts is required (a text/JSONL file, task:<name>, or a datasets name)")
    return load_documents(source, args.text_field)


def prompt_set_of(args, tok, recipe, documents):
    """The prompt set of a verb from its ``documents`` (:func:`documents_of`), budget ``--tokens`` (else
    the recipe's ``calib_tokens``, else 30000; never 0)."""
    from . import CalibrationError
    from .prompts import DEFAULT_BUDGET, build_prompt_set

    if args.tokens is not None:
        budget = args.tokens
    elif recipe is not None and recipe.rotation.calib_tokens is not None:
        budget = recipe.rotation.calib_tokens
    else:
        budget = DEFAULT_BUDGET
    if budget <= 0:
        raise CalibrationError(f"--tokens must be a positive token budget, got {budget}")
    return build_prompt_set(tok, documents.source, budget=budget, seed=args.seed, seq_len=args.seq_len, pack=args.pack,
                            text_field=args.text_field, documents=documents)


def oscar_config_of(args, recipe):
    """The :class:`~sglang_oscar.config.OscarConfig` of the verb: the recipe's ``[quant]`` settings (else
    the defaults), overridden by the quantizer flags given."""
    import dataclasses

    from ..config import OscarConfig
    from . import CalibrationError
    from .recipes import oscar_config

    base = oscar_config(recipe) if recipe else OscarConfig()
    over = {k: v for k, v in dict(group_size=args.group_size, k_clip_ratio=args.k_clip, v_clip_ratio=args.v_clip,
                                  sink_tokens=args.sink, recent_tokens=args.recent, quantizer=args.quantizer,
                                  scale_dtype=args.scale_dtype).items() if v is not None}
    try:
        return dataclasses.replace(base, **over)
    except ValueError as exc:  # name the flag the user typed, not the config field
        field, _, rest = str(exc).partition(" ")
        if field in over:
            raise CalibrationError(f"{_FIELD_FLAGS[field]} {rest}") from None
        raise


_FIELD_FLAGS = {"group_size": "--group-size", "k_clip_ratio": "--k-clip", "v_clip_ratio": "--v-clip",
                "sink_tokens": "--sink", "recent_tokens": "--recent", "quantizer": "--quantizer",
                "scale_dtype": "--scale-dtype"}


def check_group_fits(cfg, rotations) -> None:
    """Refuse a group size that does not fit the rows of ``rotations`` before the model loads (each
    file records its head_dims or latent rank).

    Raises:
        CalibrationError: naming the file, the size and the divisors that fit.
    """
    from ..config import latent_group_size
    from ..rotation.latent import LatentRotationSet
    from . import CalibrationError

    for name, rs in rotations.items():
        try:
            if isinstance(rs, LatentRotationSet):
                for lid in rs.layer_ids:
                    latent_group_size(cfg, rs.matrix(lid).shape[-1])
            else:
                cfg.check_head_dims(*{d for lid in rs.layer_ids for d in rs.head_dims(lid)})
        except ValueError as exc:
            raise CalibrationError(f"--group-size does not fit rotation {name!r}: {exc}") from None


def write_json(path: str | None, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` (its folder created), or nothing when ``path`` is empty."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)


def rotations_from_specs(specs: list[str]) -> dict:
    """``{name: rotation set}`` of ``--rotation [NAME=]PATH`` values: the name given, else the file's
    method (``method:basename`` where that is a baseline's or an earlier file's name).

    Raises:
        CalibrationError: two files would get one name (they would be reported as one)."""
    from . import CalibrationError
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
        if name in out:
            raise CalibrationError(f"--rotation {spec}: the name {name!r} is already taken by another file; name each "
                                   "one with NAME=PATH")
        out[name] = rs
    return out


def recipe_rotation(recipe) -> str:
    """The recipe's rotation file, which must exist (no silent data-free fallback)."""
    from . import CalibrationError
    from .recipes import default_paths

    path = default_paths(recipe)["rotation"]
    if not os.path.exists(path):
        raise CalibrationError(
            f"the rotation file of {recipe.path} does not exist: {path}. Create it with "
            f"recipes/{recipe.name}/compute_rotation.sh --model MODEL (calibrate -> fit -> validate), or "
            f"`sglang-oscar fit --recipe {recipe.path} --stats STATS`; or pass --rotation FILE"
        )
    return path


def require_held_out(args, recipe, verb: str) -> None:
    """``error``/``ppl`` need explicit held-out prompts: the recipe's calibration data is never reused."""
    from . import CalibrationError

    if args.prompts:
        return
    calib = f" (the recipe's calib_data {recipe.rotation.calib_data!r} was used for calibration)" if recipe and recipe.rotation.calib_data else ""
    raise CalibrationError(
        f"{verb} needs held-out prompts: pass --prompts with data that was not used for calibration{calib}; "
        "a text/JSONL file, task:<name> or a datasets name"
    )


def warn_not_held_out(rotations: dict, prompts) -> None:
    """Warn when held-out prompts overlap the calibration data of a fitted rotation: the count of
    identical token sequences, or else a shared prompts source."""
    from . import NotHeldOutWarning

    held = prompts.meta.get("sequence_sha256") or []
    for name, rs in rotations.items():
        cal = rs.metadata.get("calibration") or {}
        calib = set(cal.get("sequence_sha256") or [])
        same = sum(h in calib for h in held)
        if same or (cal.get("tokens_sha256") and cal.get("tokens_sha256") == prompts.meta.get("tokens_sha256")):
            same = same or len(held)
            warnings.warn(NotHeldOutWarning(
                f"{same} of {len(held)} held-out sequences were also calibration sequences of rotation {name!r}: "
                "the result is not held-out; use prompts that were not calibrated on"), stacklevel=2)
        elif cal.get("prompts_sha256") and cal.get("prompts_sha256") == prompts.meta.get("sha256"):
            warnings.warn(NotHeldOutWarning(
                f"the held-out prompts come from the same source as the calibration data of rotation {name!r} "
                f"({cal.get('prompts_source')}): no token sequence is identical, but documents may overlap"), stacklevel=2)


def read_config(path: str, *, hub: bool = False, trust_remote_code: bool = False) -> tuple[dict, str]:
    """``(config dict, model name or path)`` of a ``config.json``, a model directory, or (``hub``)
    a Hugging Face Hub id. The name is the config's ``_name_or_path`` when it records one (the
    configs ``calibrate``/``fit`` write do), else the directory or Hub id."""
    from . import CalibrationError

    if not os.path.exists(path) and (os.path.isabs(path) or path.startswith(".") or path.endswith(".json")):
        raise FileNotFoundError(f"model config {path} does not exist (a path, not a Hub id)")
    if os.path.exists(path):
        p = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(p):
            raise FileNotFoundError(f"model config {p} does not exist")
        with open(p, "rb") as f:
            raw = f.read()
        try:
            cfg = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8 text
            raise CalibrationError(f"model config {p} is not a JSON file ({exc}): pass the model's config.json or its "
                                   "checkpoint directory") from None
        if not isinstance(cfg, dict):
            raise CalibrationError(f"model config {p} holds a JSON {type(cfg).__name__}, not an object: pass the model's "
                                   "config.json or its checkpoint directory")
        return cfg, cfg.get("_name_or_path") or (path if os.path.isdir(path) else os.path.dirname(os.path.abspath(p)))
    if not hub:
        raise FileNotFoundError(
            f"model config {path} is not a local config.json or model directory (this verb reads local files only; "
            "for a Hub id, `sglang-oscar fit --config HUB_ID` writes a local copy <rotation>.config.json next to the "
            "rotation, and compute_rotation.sh validates against it)"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).to_dict(), path
    except Exception as exc:  # offline, unknown id, remote code refused, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CalibrationError(
            f"cannot read the model config of {path!r}: it is not a local path and reading it from the Hugging Face Hub "
            f"failed ({type(exc).__name__}: {first}). Pass a local checkpoint directory instead (--config LOCAL_DIR, or "
            "compute_rotation.sh --model LOCAL_DIR)"
            + ("" if trust_remote_code else "; a model whose code is not in transformers also needs --trust-remote-code")
        ) from None


def report_unserved(report: dict, geometry, config=None) -> None:
    """Add ``not_served`` to a validate verb's JSON ``report`` (and warn on stderr) when the int2
    server refuses the model whatever the file (:func:`~sglang_oscar.backend.rotations.unserved_reason`):
    the verbs' ``ok`` says the file fits the model, not that the model is served. ``config``: the
    model's config (dict, file or directory)."""
    import sys

    from ..backend.rotations import unserved_reason

    from ..rotation.geometry import _as_dict

    cfg = _as_dict(config) if config is not None else {}
    why = unserved_reason(geometry, cfg.get("architectures"), cfg or None)
    if why:
        report["not_served"] = why
        print(f"warning: the rotation fits this model, but {why}", file=sys.stderr)
