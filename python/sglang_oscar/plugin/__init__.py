"""SGLang plugin entry point (``sglang.srt.plugins`` group, name ``oscar``).

The only part of sglang-oscar that knows SGLang hook targets. :func:`register` runs in every
SGLang process (main, scheduler/TP workers); it only records hooks, so it is cheap, and it is
idempotent. What the hooks do:

* ``ServerArgs.add_cli_args`` (AFTER): add ``int2`` to ``--kv-cache-dtype`` choices and add the
  OSCAR flags (:mod:`.flags`).
* ``ServerArgs.from_cli_args`` (AROUND): resolve the flags and their environment aliases into
  an :class:`~sglang_oscar.config.OscarConfig`, attach it as ``server_args._oscar_config`` and
  export it in ``SGLANG_OSCAR_CONFIG`` so spawned subprocesses see the same values.
* ``ServerArgs.__post_init__`` (AFTER): with ``--kv-cache-dtype int2``, stop the launch before
  any weights load on an unsupported flag (:mod:`.refusals`), or if the INT2 serving path is
  not available (see :data:`SERVING_READY`).
"""

from __future__ import annotations

import logging
import os

from .flags import CONFIG_ENV, FLAGS, add_flags, config_from_env, config_to_env, resolve_config
from .refusals import REFUSALS, refusal_messages

logger = logging.getLogger("sglang_oscar")

INT2 = "int2"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
HOOK_TARGETS = (
    f"{_SERVER_ARGS}.add_cli_args",
    f"{_SERVER_ARGS}.from_cli_args",
    f"{_SERVER_ARGS}.__post_init__",
)
# The INT2 memory pool and attention backend are wired in by the SGLang-plugin issue; until
# then an int2 launch must stop with a clear message rather than fail deep inside SGLang.
SERVING_READY = False

def register() -> None:
    """Register sglang-oscar's hooks with SGLang's ``HookRegistry`` (idempotent, cheap).

    Idempotency is checked against the registry itself, so a ``HookRegistry.reset()`` (tests)
    followed by ``register()`` registers again.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in (
        (HOOK_TARGETS[0], _after_add_cli_args, HookType.AFTER),
        (HOOK_TARGETS[1], _around_from_cli_args, HookType.AROUND),
        (HOOK_TARGETS[2], _after_post_init, HookType.AFTER),
    ):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, kind)


def _after_add_cli_args(result, parser, *args, **kwargs):
    for action in parser._actions:
        if "--kv-cache-dtype" in action.option_strings and action.choices is not None:
            if INT2 not in action.choices:
                action.choices = list(action.choices) + [INT2]
            action.help = (action.help or "") + " 'int2': OSCAR 2-bit KV cache (sglang-oscar)."
    add_flags(parser)
    return result


def _around_from_cli_args(original_fn, cls, args, *rest, **kwargs):
    values = {f.dest: getattr(args, f.dest, None) for f in FLAGS}
    if getattr(args, "kv_cache_dtype", None) != INT2:
        given = [f.option for f in FLAGS if values[f.dest] is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --kv-cache-dtype int2; add it or drop these flags")
        return original_fn(cls, args, *rest, **kwargs)
    server_args = original_fn(cls, args, *rest, **kwargs)
    config, notes = resolve_config(values)
    for note in notes:
        logger.info("sglang-oscar: %s", note)
    object.__setattr__(server_args, "_oscar_config", config)
    os.environ[CONFIG_ENV] = config_to_env(config)
    return server_args


def _after_post_init(result, server_args, *args, **kwargs):
    if getattr(server_args, "kv_cache_dtype", None) != INT2:
        return result
    if getattr(server_args, "model_path", None) in ("dummy", "none"):
        return result
    problems = refusal_messages(server_args)
    if problems:
        raise ValueError("; ".join(problems))
    if not SERVING_READY:
        raise ValueError(
            "--kv-cache-dtype int2: this sglang-oscar build has the INT2 format, rotations and "
            "calibration tools but not yet the SGLang INT2 pool/attention backend; serve with "
            "--kv-cache-dtype auto (BF16) for now"
        )
    return result


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
