"""Joining (or not) a process group: the only place hf_zero calls ``init_process_group``."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("hf_zero")

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_created: dict[str, Any] = {}  # the default group hf_zero created, and the timeout it gave it


def hf_zero_timeout_s() -> float | None:
    """The collective timeout hf_zero gave the current default group, or None (not set by hf_zero)."""
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return _created.get("timeout_s") if group is not None and _created.get("group") is group else None


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def default_device() -> torch.device:
    """The device a rank computes on: its local CUDA device if there is one, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def ensure_process_group(device: torch.device, timeout_s: float | None = None) -> bool:
    """Join the default process group if a launcher asked for one.

    Returns True when a process group is in use. With no launcher environment at all (a
    notebook, a plain ``python train.py``) hf_zero runs as world size 1 with no process group, so
    nothing else is needed. A partial environment is an error: guessing would hang.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    present = [k for k in _LAUNCHER_ENV if k in os.environ]
    if not present:
        return False
    missing = [k for k in _LAUNCHER_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"hf_zero found launcher variables {present} but not {missing}; start the script "
            "with torchrun / accelerate launch, set all four, or unset them to run as one process"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group(backend=default_backend(device), **kwargs)
    _created.update(group=dist.group.WORLD, timeout_s=timeout_s)
    logger.info(
        "hf_zero: joined process group rank %d of %d (%s)",
        dist.get_rank(), dist.get_world_size(), dist.get_backend(),
    )
    return True
