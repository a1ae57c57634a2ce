"""SGLang's server-argument parser as the OSCAR plugin extends it."""

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
