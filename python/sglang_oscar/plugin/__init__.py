"""SGLang plugin entry point (``sglang.srt.plugins`` group, name ``oscar``).

The only part of sglang-oscar that knows SGLang hook targets. :func:`register` runs in every
SGLang process (main, scheduler/TP workers); it only records hooks, so it is cheap, and it is
idempotent. What the hooks do:

* ``ServerArgs.add_cli_args`` (AFTER): add ``int2`` to ``--kv-cache-dtype`` choices and add the
  OSCAR flags (:mod:`.flags`).
* ``ServerArgs.from_cli_args`` (AROUND): resolve the flags and their environment aliases into
  an :class:`~sglang_oscar.config.OscarConfig`, attach it as ``server_args._oscar_config`` and
  export it in ``SGLANG_OSCAR_CONFIG`` so spawned subprocesses see the same values.
* ``ServerArgs.__post_init__`` (BEFORE): with ``--kv-cache-dtype int2`` and no attention backend
  given, use ``triton`` (``dsa`` for a DSA model), and keep the DSA kernel flags as given, before
  SGLang resolves them; (AFTER): stop the launch before any weights load on an unsupported flag
  (:mod:`.refusals`), a rotation file that does not fit the model, a group size that does not
  divide head_dim, or a serving hook that failed to apply (SGLang only logs hook failures).
* the serving hooks of :mod:`.serving` (dtype, sizing, pool, allocator, radix cap, refusal of
  in-place weight updates of a folded model), the ``ATTENTION_BACKENDS["triton"]`` registry entry,
  MLA models' pools and forward-method dispatch (:mod:`.mla_serving`) and MiniMax-M3's attention
  wrapper (:mod:`.minimax_serving`).
"""

from __future__ import annotations

import logging
import os

from .flags import CONFIG_ENV, FLAGS, add_flags, config_from_env, config_to_env, resolve_config
from .refusals import (DSA_KERNEL_FLAGS, GIVEN_ATTR, is_dsa_model, loaded_model_config,
                       prefill_graph_backend, refusal_messages)
from .serving import SERVING_HOOK_TARGETS

logger = logging.getLogger("sglang_oscar")

INT2 = "int2"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
HOOK_TARGETS = (
    f"{_SERVER_ARGS}.add_cli_args",
    f"{_SERVER_ARGS}.from_cli_args",
    f"{_SERVER_ARGS}.__post_init__",
) + SERVING_HOOK_TARGETS

def register() -> None:
    """Register sglang-oscar's hooks with SGLang's ``HookRegistry`` (idempotent, cheap).

    Idempotency is checked against the registry itself, so a ``HookRegistry.reset()`` (tests)
    followed by ``register()`` registers again.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import minimax_serving as mm
    from . import mla_serving as ml
    from . import serving as sv

    for target, hook, kind in (
        (HOOK_TARGETS[0], _after_add_cli_args, HookType.AFTER),
        (HOOK_TARGETS[1], _around_from_cli_args, HookType.AROUND),
        (HOOK_TARGETS[2], _before_post_init, HookType.BEFORE),
        (HOOK_TARGETS[2], _after_post_init, HookType.AFTER),
        (SERVING_HOOK_TARGETS[0], sv.around_configure_kv_cache_dtype, HookType.AROUND),
        (SERVING_HOOK_TARGETS[1], sv.around_enable_fused_set_kv_buffer, HookType.AROUND),
        (SERVING_HOOK_TARGETS[2], sv.around_compute_cell_size, HookType.AROUND),
        (SERVING_HOOK_TARGETS[3], sv.around_resolve_memory_pool_config, HookType.AROUND),
        (SERVING_HOOK_TARGETS[4], sv.around_build_token_to_kv_pool, HookType.AROUND),
        (SERVING_HOOK_TARGETS[5], sv.around_allocator_free, HookType.AROUND),
        (SERVING_HOOK_TARGETS[6], sv.after_allocator_clear, HookType.AFTER),
        (SERVING_HOOK_TARGETS[7], sv.around_compute_max_prefix_len, HookType.AROUND),
        (SERVING_HOOK_TARGETS[8], sv.before_get_next_batch_to_run, HookType.BEFORE),
        (SERVING_HOOK_TARGETS[9], sv.after_hybrid_swa_configurator_init, HookType.AFTER),
        (SERVING_HOOK_TARGETS[10], ml.around_mla_dispatch, HookType.AROUND),
        (SERVING_HOOK_TARGETS[11], sv.after_init_next_round_input, HookType.AFTER),
        *((target, sv.around_weight_update, HookType.AROUND) for target in sv.WEIGHT_UPDATE_HOOK_TARGETS),
        (sv.DSA_HOOK_TARGETS[0], sv.around_allocator_free, HookType.AROUND),
        (sv.DSA_HOOK_TARGETS[1], sv.after_allocator_clear, HookType.AFTER),
        (sv.DSA_HOOK_TARGETS[2], sv.around_dsa_kv_cache_dtype_default, HookType.AROUND),
        (mm.MINIMAX_HOOK_TARGETS[0], mm.around_attn_backend_wrapper, HookType.AROUND),
    ):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, kind)
    sv.install_backend_factory()


def _after_add_cli_args(result, parser, *args, **kwargs):
    for action in parser._actions:
        if "--kv-cache-dtype" in action.option_strings and action.choices is not None:
            if INT2 not in action.choices:
                action.choices = list(action.choices) + [INT2]
            action.help = (action.help or "").rstrip() + " | int2: OSCAR 2-bit KV cache (sglang-oscar)."
    add_flags(parser)
    return result


def _around_from_cli_args(original_fn, cls, args, *rest, **kwargs):
    values = {f.dest: getattr(args, f.dest, None) for f in FLAGS}
    if getattr(args, "kv_cache_dtype", None) != INT2:
        given = [f.option for f in FLAGS if values[f.dest] is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: OSCAR flags apply only with --kv-cache-dtype int2; add it or drop them")
        return original_fn(cls, args, *rest, **kwargs)
    config, notes = resolve_config(values)
    for note in notes:
        logger.info("sglang-oscar: %s", note)
    # exported before ServerArgs is built: its __post_init__ (our preflight) reads it
    os.environ[CONFIG_ENV] = config_to_env(config)
    server_args = original_fn(cls, args, *rest, **kwargs)
    object.__setattr__(server_args, "_oscar_config", config)
    return server_args


def _before_post_init(server_args, *args, **kwargs):
    if getattr(server_args, "kv_cache_dtype", None) != INT2:
        return None
    # __post_init__ resolves these from the hardware: the refusals judge what the launch gave
    object.__setattr__(server_args, GIVEN_ATTR, {f: getattr(server_args, f, None) for f, _ in DSA_KERNEL_FLAGS})
    if getattr(server_args, "attention_backend", None) is None:
        # a DSA model's indexer runs only under SGLang's "dsa" backend (the OSCAR subclass for int2)
        server_args.attention_backend = "dsa" if is_dsa_model(server_args) else "triton"
    return None


def _after_post_init(result, server_args, *args, **kwargs):
    if getattr(server_args, "kv_cache_dtype", None) != INT2:
        return result
    problems = refusal_messages(server_args)
    if os.environ.get("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "").strip().lower() in ("1", "true", "yes", "on"):
        problems.append("--kv-cache-dtype int2 does not support SGLANG_ENABLE_POST_CAPTURE_KV_SIZING (the INT2 "
                        "pool is sized before CUDA-graph capture); unset it")
    if problems:
        raise ValueError("; ".join(problems))
    missing = missing_hooks()
    if missing:
        raise RuntimeError(
            f"--kv-cache-dtype int2: sglang-oscar hooks did not apply to {missing} (see the log for the "
            f"hook errors; this sglang-oscar release supports sglang==0.5.16)"
        )
    if str(getattr(server_args, "model_path", "")).lower() not in ("dummy", "none"):  # SGLang resolves no config
        preflight(server_args)
    return result


def missing_hooks() -> list[str]:
    """Hook targets not patched by SGLang's ``HookRegistry`` plus a missing backend entry."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in HOOK_TARGETS if t not in HookRegistry._patched]
    for name in ("triton", "dsa"):
        if not getattr(attention_registry.ATTENTION_BACKENDS.get(name), "_oscar", False):
            missing.append(f'ATTENTION_BACKENDS["{name}"]')
    return missing


def _traced_prefill_graph(server_args) -> bool:
    """Whether the launch captures prefill with SGLang's ``tc_piecewise`` (torch.compile) graph: asked for
    explicitly, or SGLang's default on a GPU that is not CUDA's breakable one (a CPU test build resolves
    ``tc_piecewise`` too, but captures nothing)."""
    import torch

    if prefill_graph_backend(server_args) != "tc_piecewise":
        return False
    return ("prefill", "backend") in getattr(server_args, "_cuda_graph_config_locked", ()) or torch.cuda.is_available()


def preflight(server_args) -> None:
    """Check the rotation file, group size and BF16 windows against the model's config (no weights loaded).

    Raises:
        ValueError: the message names the problem and the flag that fixes it.
    """
    from ..backend.rotations import (model_geometry, served_expanded_rotations, served_latent_rotations,
                                     served_rotation_set)

    config = oscar_config_of(server_args)
    # the context SGLang derived (ServerArgs.__post_init__ built model_config): windows past it are never
    # filled, but every running request would reserve their BF16 rows
    context = getattr(loaded_model_config(server_args), "context_len", None)
    if isinstance(context, int) and context > 0 and config.sink_tokens + config.recent_tokens > context:
        raise ValueError(f"--oscar-sink-tokens {config.sink_tokens} + --oscar-recent-tokens {config.recent_tokens} "
                         f"exceed the model's context of {context} tokens (each running request reserves that many "
                         "BF16 rows): lower them (defaults 64 / 256)")
    if config.mla_storage == "expanded" and _traced_prefill_graph(server_args):
        # SGLang's handlers never pick the MHA method under a traced prefill graph; expanded storage forces
        # it, so dynamo would trace forward_normal_prepare and its non-torch concat kernel (not validated)
        raise ValueError("--oscar-mla-storage expanded does not support the tc_piecewise prefill CUDA graph: use "
                         "SGLang's default breakable prefill graph or --disable-prefill-cuda-graph")
    # SGLang serves --json-model-override-args applied to the config: check that config, not config.json
    overridden = str(getattr(server_args, "json_model_override_args", None) or "{}").strip() not in ("", "{}")
    geometry = hf_config = None
    if not overridden:
        try:
            geometry = model_geometry(server_args.model_path)  # a local directory: just its config.json
            hf_config = server_args.model_path
        except FileNotFoundError:
            pass
    if geometry is None:
        # a hub id (or another source SGLang resolves), or an overridden config: read the config the way
        # SGLang does, whole as the backend reads it (a multimodal wrapper keeps its architectures)
        from sglang.srt.configs.model_config import ModelConfig

        try:  # the config SGLang's __post_init__ loaded, else read as it does
            hf_config = (loaded_model_config(server_args) or ModelConfig.from_server_args(server_args)).hf_config
        except Exception as exc:  # noqa: BLE001  SGLang reports an unreadable model itself
            logger.warning("sglang-oscar: could not read the model config for the int2 checks: %s", exc)
            return
        geometry = model_geometry(hf_config)
    if config.mla_storage == "expanded" or geometry.attention_kind == "mla":
        from ..rotation.geometry import _as_dict

        archs = _as_dict(hf_config).get("architectures") if hf_config is not None else None
        if config.mla_storage == "expanded":  # also refuses it for a non-MLA model, naming the flag
            served_expanded_rotations(config, geometry, log=False, architectures=archs, hf_config=hf_config)
        else:
            served_latent_rotations(config, geometry, log=False, architectures=archs, hf_config=hf_config)
        return
    served_rotation_set(config, geometry, log=False, hf_config=hf_config)
    if skip_kind(config, geometry, hf_config) != "none" and getattr(server_args, "disable_hybrid_swa_memory", False):
        # SGLang then builds one pool for every layer: the skip would silently serve every layer INT2
        raise ValueError(f"--oscar-skip-layers {config.skip_layers} keeps one layer kind in the BF16 pool of SGLang's "
                         "hybrid sliding-window memory, which --disable-hybrid-swa-memory turns off (one pool for "
                         "every layer): drop one of the two flags")
    if config.decode_engine == "gluon":
        from ..backend.rotations import int2_layers
        from ..kernels.decode.gluon_stage1 import gluon_layout_reason
        from ..kernels.layout import Int2Layout

        for dk, dv in sorted({(x.head_dim_k, x.head_dim_v) for x in int2_layers(config, geometry)}):
            reason = gluon_layout_reason(Int2Layout.from_config(config, dk, dv))
            if reason is not None:
                raise ValueError(f"--oscar-decode-engine gluon cannot decode this model's INT2 cache ({reason}; the "
                                 "Gluon kernel takes head_dim 128, one fp16 (scale, zero) pair per row, uniform "
                                 "levels); use --oscar-decode-engine auto (Gluon where it applies, else Triton)")


def skip_kind(config, geometry, hf_config) -> str:
    """The layer kind ``--oscar-skip-layers`` keeps in BF16: ``"none"``, ``"sliding"`` or ``"full"``.

    Skipped layers keep SGLang's own BF16 pool, so they must be one of the two pools SGLang builds
    for a hybrid sliding-window model (``is_hybrid_swa_model``: Gemma-4, GPT-OSS, ...); a model whose
    layers share one pool (Gemma-3, Qwen3) cannot skip some of them.

    Raises:
        ValueError: ids that are not attention layers (:func:`~sglang_oscar.config.resolve_skip_layers`),
            ids that are not exactly one kind's layers, or a skip on a single-pool model; the message
            says what to pass instead.
    """
    from ..config import parse_skip_layers, resolve_skip_layers

    spec = parse_skip_layers(config.skip_layers)
    if spec == "none":
        return "none"
    skip = resolve_skip_layers(spec, geometry)
    if not skip:  # a kind the model does not have: refused rather than silently serving every layer INT2
        raise ValueError(
            f"--oscar-skip-layers {spec}: this {geometry.model_type} model has no {spec} attention layers, so "
            "nothing would stay BF16; pass none (or the other kind on a model that mixes both)")
    from ..backend.rotations import two_kv_pools
    from ..rotation.geometry import _as_dict

    if not two_kv_pools(hf_config):
        archs = _as_dict(hf_config).get("architectures") if hf_config is not None else None
        raise ValueError(
            f"--oscar-skip-layers {config.skip_layers}: {archs} keeps all its layers in one "
            "SGLang KV pool, so none can stay BF16 while the others are INT2; pass none (or serve the model "
            "with --kv-cache-dtype auto)")
    kinds = {kind: frozenset(x.layer_id for x in geometry.layers if x.kind == kind) for kind in ("sliding", "full")}
    kind = next((k for k, ids in kinds.items() if ids and skip == ids), None)
    if kind is None:
        raise ValueError(
            f"--oscar-skip-layers {config.skip_layers}: the skipped layers must be all the sliding-window layers or "
            f"all the full-attention layers of the model (SGLang keeps them in separate pools); this "
            f"{geometry.model_type} model has {len(kinds['sliding'])} sliding and {len(kinds['full'])} full layers; "
            "pass sliding, full or none")
    return kind


def oscar_config_of(server_args):
    """The resolved :class:`~sglang_oscar.config.OscarConfig` of a ``ServerArgs``.

    From the CLI path: the attribute set by the ``from_cli_args`` hook; in subprocesses: the
    ``SGLANG_OSCAR_CONFIG`` environment; from ``sglang.Engine(...)`` (no CLI): the environment
    aliases and defaults.
    """
    config = getattr(server_args, "_oscar_config", None) or config_from_env()
    if config is None:
        config, notes = resolve_config({})
        for note in notes:
            logger.info("sglang-oscar: %s", note)
    return config
