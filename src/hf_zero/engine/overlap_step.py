"""The offloaded optimizer step, started per group while the backward is still running.

[Note: overlapped offload step]
With ``offload_optimizer`` (cpu or nvme) the Adam step runs on the host. Once a group's fp32
gradient shard is final (its bucket has been reduce-scattered at the accumulation boundary: see
``UnitProtocol.on_grads_final``), nothing that is still to come in this backward can change it, so
its step can start at once on a worker thread and overlap the backward of the units before it
(on a GPU machine the host is otherwise idle then). ``ZeroOptimizer.step`` then only waits for the
worker, steps the groups it never got, reports the global gradient norm and all-gathers.

This is exact only when no group's update depends on the others' gradients:
- gradient clipping needs the global norm first, so ``gradient_clipping > 0`` steps after the
  backward, as without overlap;
- fp16 needs the overflow check over every gradient before any step (a skipped step must skip
  every group), so fp16 does too;
- the worker checks each gradient shard for inf/nan before stepping it and leaves a non-finite
  group unchanged; ``step`` then raises the same error as the non-overlapped step.
Requires hf_zero's Adam/AdamW (the config's optimizer section), which steps one shard at a time.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hf_zero.engine.flat_group import FlatParamGroup
from hf_zero.engine.optimizer import ZeroAdam


def can_overlap(inner: torch.optim.Optimizer, gradient_clipping: float, fp16: bool, nvme: bool) -> bool:
    """Whether [Note: overlapped offload step] applies to this optimizer set-up."""
    return (isinstance(inner, ZeroAdam) or nvme) and gradient_clipping <= 0 and not fp16


class OverlappedOffloadStep:
    """Runs each group's host step on one worker thread as soon as its gradients are final."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer  # the ZeroOptimizer whose groups this steps
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-offload-step")
        self.futures: dict[int, Future] = {}
        self.first_submit_s: float | None = None  # when this step's first group went to the worker
        self.last_first_submit_s: float | None = None  # the same, for the last completed step
        self.overlapped_groups = 0  # groups of the last step started before ``step`` was called

    @property
    def submitted(self) -> bool:
        return bool(self.futures)

    def submit(self, groups: list[FlatParamGroup]) -> None:
        """Start the step of ``groups`` (their gradient shards are final)."""
        if self.first_submit_s is None and groups:
            self.first_submit_s = time.perf_counter()
        for group in groups:
            if id(group) in self.futures:
                raise RuntimeError(
                    f"{group.label}: a second backward reached the accumulation boundary before "
                    "engine.step(); with offload_optimizer the step starts during the boundary's "
                    "backward, so call engine.step() after each boundary backward (or set "
                    "gradient_accumulation_steps to accumulate)")
            self.futures[id(group)] = self.pool.submit(self.step_group, group)

    def step_group(self, group: FlatParamGroup) -> tuple[float, bool]:
        """Check and step one group; returns its squared gradient norm and whether it had an
        inf/nan (then it is left unchanged)."""
        from hf_zero.kernels import nonfinite_and_sqnorm

        found, sqnorm = nonfinite_and_sqnorm([group.grad_shard])
        if bool(found):
            return float(sqnorm), True
        self.optimizer.step_group_unscaled(group)
        return float(sqnorm), False

    def wait(self) -> dict[int, tuple[float, bool]]:
        """Results of every submitted group (``id(group)`` keys); re-raises a worker's error."""
        self.overlapped_groups = len(self.futures)
        try:
            return {key: future.result() for key, future in self.futures.items()}
        finally:
            self.futures.clear()
            self.last_first_submit_s, self.first_submit_s = self.first_submit_s, None
