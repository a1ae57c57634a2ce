"""Writing ``.safetensors`` files: atomically, with the permissions of the user's umask."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file


def _umask() -> int:
    """The process umask: from /proc on Linux (read-only), else set-and-restore."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous CPU tensors) to ``path`` with ``metadata`` (string values).

    The file is written next to ``path`` and renamed over it when complete, so a killed run never
    leaves a truncated file behind, and it gets the mode a plain ``open()`` would give it (``0o666``
    minus the umask; ``safetensors`` alone writes ``0o600``, which hides rotation and statistics
    files from the other users of a shared model directory). Parent folders must exist.

    Raises:
        OSError: the folder is missing (``FileNotFoundError``) or not writable (``PermissionError``);
            safetensors' own errors for bad tensors.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):  # safetensors reports these as its own error type
        raise FileNotFoundError(f"cannot write {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"cannot write {path}: folder {folder} is not writable")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
