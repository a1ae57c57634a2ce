"""SGLang's server-argument parser and ``ServerArgs`` as the OSCAR plugin extends them."""

from __future__ import annotations

import argparse


def oscar_server_parser(*, allow_abbrev: bool = True) -> argparse.ArgumentParser:
    """A fresh parser filled by ``ServerArgs.add_cli_args`` after ``sglang_oscar.plugin.register()``
    and ``HookRegistry.apply_hooks()``, so it accepts ``--kv-cache-dtype int2`` and the ``--oscar-*``
    flags. ``allow_abbrev=False`` accepts full flag names only."""
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    import sglang_oscar.plugin as plugin

    plugin.register()
    HookRegistry.apply_hooks()
    parser = argparse.ArgumentParser(allow_abbrev=allow_abbrev)
    ServerArgs.add_cli_args(parser)
    return parser


def int2_server_args(model_dir, monkeypatch, **cfg):
    """``ServerArgs(model_path=model_dir, kv_cache_dtype="int2")`` with the OSCAR settings ``cfg``
    (:class:`~sglang_oscar.config.OscarConfig` fields, passed as the plugin's config environment):
    the plugin's ``__post_init__`` hooks run its launch checks."""
    from sglang.srt.server_args import ServerArgs

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.plugin import flags

    monkeypatch.setenv(flags.CONFIG_ENV, flags.config_to_env(OscarConfig(**cfg)))
    return ServerArgs(model_path=model_dir, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda")
