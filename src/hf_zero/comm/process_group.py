"""Joining (or not) a process group: the only place hf_zero calls ``init_process_group``."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from hf_zero.execution import bind_device, rank_device

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
    return rank_device()


def ensure_process_group(device: torch.device, timeout_s: float | None = None) -> bool:
    """Join the default process group if a launcher asked for one, and bind the calling thread
    to ``device`` either way ([Note: the launching thread's device] in hf_zero.execution): a
    script that created the group itself (without ``torch.cuda.set_device``) gets it set here.

    Returns True when a process group is in use. With no launcher environment at all (a
    notebook, a plain ``python train.py``) hf_zero runs as world size 1 with no process group, so
    nothing else is needed. A partial environment is an error: guessing would hang.
    """
    bind_device(device)
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
    kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda":
        # NCCL's communicator is made now, on this device, not lazily inside the first
        # collective (which may be a backward hook). torch's default error handling (3,
        # SkipCleanUp) tears the process down from the watchdog thread on a failed or timed-out
        # collective; 2 (CleanUpOnly) aborts the communicators and raises in the rank's wait, where
        # hf_zero names the rank, collective, unit and step ([Note: collective errors] in
        # collectives.py). A user's own setting wins.
        kwargs["device_id"] = device
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    dist.init_process_group(backend=default_backend(device), **kwargs)
    _created.update(group=dist.group.WORLD, timeout_s=timeout_s)
    logger.info(
        "hf_zero: joined process group rank %d of %d (%s)",
        dist.get_rank(), dist.get_world_size(), dist.get_backend(),
    )
    return True


# [Note: leaving a gloo group]
# A gloo worker thread drops its last reference to a finished collective after the waiting
# rank has moved on. When that reference keeps a Python tensor alive, the drop needs the GIL; if
# the main thread is finalizing the interpreter by then, the worker thread is killed while it
# waits for the GIL, and the process aborts ("terminate called without an active exception",
# SIGABRT) after all its work is done. Measured on torch 2.13: 7 of 12 runs of a bare
# init / all_reduce / exit script, 2 of 10 runs of a two-step hf_zero engine script; an
# unmodified Trainer script never destroys its group, so any run could end this way. The hook
# below runs before finalization: it destroys every group, drops hf_zero's own references so
# the groups' destructors join their threads, and hands the GIL away for a moment so a worker
# still holding a finished collective can release it. Everything it does is local (no
# collective): a rank leaving early on an error does not wait for its peers. NCCL groups are
# left to torch, whose destructor aborts the communicator.
# A script that destroys the group itself (Accelerate's ``end_training``) meets the same worker
# differently: the group object lives on in whatever still references it (a DDP reducer, an
# engine) and its destructor joins the worker threads while the GIL is held, so a worker waiting
# for the GIL deadlocks the rank after its work is done (seen once in a DDP run of an unmodified
# Accelerate script; torch issue 56297). ``destroy_process_group`` therefore also hands the GIL
# away for a moment once the groups are destroyed, before any such reference can be dropped.
_EXIT_GRACE_S = 0.05
_exit_hook: dict[str, bool] = {}


def leave_gloo_groups_at_exit(release_own_references: Callable[[], None],
                              host_groups: Callable[[], list[Any]] = list) -> None:
    """Register (once per process) the exit hook of [Note: leaving a gloo group], and let gloo
    workers finish after a script's own ``destroy_process_group``. ``host_groups``: the gloo
    groups hf_zero made beside a default group of another backend ([Note: the host group] in
    collectives.py), which the hook destroys too."""
    if not _exit_hook:
        atexit.register(_leave_gloo_groups, release_own_references, host_groups)
        let_gloo_workers_finish_after_destroy()
        _exit_hook["registered"] = True


def let_gloo_workers_finish_after_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` hand the GIL away for a moment after
    destroying gloo groups ([Note: leaving a gloo group]). Idempotent."""
    if not getattr(dist.destroy_process_group, "_hf_zero_lets_workers_finish", False):
        dist.destroy_process_group = _letting_gloo_workers_finish(dist.destroy_process_group)


def _letting_gloo_workers_finish(destroy: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        destroy(*args, **kwargs)
        if gloo:
            time.sleep(_EXIT_GRACE_S)  # releases the GIL

    destroy_process_group._hf_zero_lets_workers_finish = True  # type: ignore[attr-defined]
    return destroy_process_group


def _leave_gloo_groups(release_own_references: Callable[[], None], host_groups: Callable[[], list[Any]]) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() != "gloo":  # NCCL is left to torch; hf_zero's own gloo groups are not
        made = host_groups()
        if not made:
            return
        for group in made:
            dist.destroy_process_group(group)
    else:
        dist.destroy_process_group()  # every group, the ones made by new_group included
    release_own_references()
    gc.collect()
    time.sleep(_EXIT_GRACE_S)  # releases the GIL
