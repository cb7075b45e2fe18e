"""How many threads the offloaded optimizer step runs on.

[Note: host threads]
With ``offload_optimizer`` the host steps the fp32 masters and moments: a memory-bound pass
whose speed grows with the cores that run it. ``torchrun`` sets ``OMP_NUM_THREADS=1`` in every
process when it starts more than one per node, so torch's own thread count would leave a rank's
host step on one core of the many the node has. The step takes its own count instead:

    threads = max(1, round(cores of this rank * offload_optimizer.cpuadam_cores_perc))

where a rank's cores are the CPUs the process may run on (its affinity), divided among the
node's ``LOCAL_WORLD_SIZE`` ranks: a launcher that leaves the ranks unbound gives each the whole
machine. When the affinities of all local ranks fit side by side on the node (affinity x local
ranks <= the node's CPUs: ``numactl``, ``taskset`` or a launcher's per-rank binding gave each rank
cores of its own), the affinity is the rank's share as it is. (Ranks that share a cpuset that
small, which a rank cannot tell from its own affinity, would take it each: lower
``cpuadam_cores_perc`` there.) ``cpuadam_cores_perc`` is DeepSpeed's key for the share of the
cores its CPU Adam takes (default 0.8: the rest stays with the thread that queues the device's
work and with the data loader).

The count applies to the host step only, on the thread that runs it, and torch's thread count is
set back when it ends: the user's own code, the forward and the backward keep the count the
launcher or the script chose. The choice is logged once per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch

logger = logging.getLogger("hf_zero")

_LOGGED: list[int] = []


def rank_cores(affinity: int | None = None, node_cpus: int | None = None, local_world_size: int | None = None) -> int:
    """The CPUs this rank may use for itself ([Note: host threads]); the arguments default to
    this process's affinity, the machine's CPU count and ``LOCAL_WORLD_SIZE``."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if node_cpus is None:
        node_cpus = os.cpu_count() or affinity
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    local_world_size = max(1, local_world_size)
    if affinity < node_cpus and affinity * local_world_size <= node_cpus:  # cores of its own
        return max(1, affinity)
    return max(1, affinity // local_world_size)


def host_step_threads(cores_perc: float, cores: int | None = None) -> int:
    """Threads for the offloaded step: ``cores_perc`` of :func:`rank_cores`, at least one."""
    cores = rank_cores() if cores is None else cores
    return max(1, int(cores * cores_perc + 0.5))


@contextlib.contextmanager
def running_on(threads: int) -> Iterator[None]:
    """torch's intra-op thread count is ``threads`` on this thread inside the block, and what it
    was after it (``threads`` 0: left alone)."""
    previous = torch.get_num_threads() if threads > 0 else threads
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def log_choice(threads: int, cores_perc: float) -> None:
    """Once per process: what the host step runs on, and why."""
    if _LOGGED:
        return
    _LOGGED.append(threads)
    logger.info("hf_zero: the offloaded optimizer step runs on %d host thread(s): %.2f of this rank's %d core(s) "
                "(offload_optimizer.cpuadam_cores_perc; torch's own count here is %d)",
                threads, cores_perc, rank_cores(), torch.get_num_threads())
