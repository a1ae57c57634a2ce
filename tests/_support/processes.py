"""Process checks of the tests that start servers and sandboxes."""

from __future__ import annotations


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (read from Linux ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
