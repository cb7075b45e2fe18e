"""Whether a process of this machine is still running: how leftovers of crashed runs (staging
folders of interrupted saves, NVMe folders of killed runs) are told from live ones."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (signal 0 checks, sends nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
