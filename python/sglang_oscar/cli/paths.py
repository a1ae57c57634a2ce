"""Output paths of the verbs: checked before any work is done."""

from __future__ import annotations

import os
import tempfile

from ..errors import CLIError


def check_writable(path: str, flag: str) -> None:
    """Make sure a file can be written at ``path``: its folder exists (created, as the verbs would
    create it) and a file can be created in it. Run before the work, so that a long calibration or
    fit is not lost to an output path that only the final write would find unusable.

    Raises:
        CLIError: naming ``flag``, the path and the reason.
    """
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path} is a directory: pass the path of the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CLIError(f"{flag} {path} cannot be written: {existing} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".sglang-oscar-write-check-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise CLIError(f"{flag} {path} cannot be written (folder {folder}: {exc.strerror or exc}): pass a path in a "
                       "folder you can write to") from None
