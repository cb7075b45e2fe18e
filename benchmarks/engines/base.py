"""What every engine runner provides to the worker's timed loop."""

from __future__ import annotations

from typing import Any

import torch

from engines.probes import StorageTally


class Runner:
    """One engine wrapped around the workload's model, ready to train.

    The worker calls ``forward_backward`` then ``optimizer_step`` once per step (gradient
    reduction belongs to whichever of the two the engine does it in), ``model_state`` between
    them on the last step, and ``info`` once at the end.
    """

    name: str = "?"

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the causal-LM loss on ``batch``; returns the loss (detached)."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        """Clip to the workload's norm, optimizer step, gradients released/zeroed."""
        raise NotImplementedError

    def model_state(self) -> StorageTally:
        """This rank's params / master / grads / optimizer state (and engine buffers)."""
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """Settings in effect that a reader needs to interpret the figures."""
        return {}

    def engine_comm_stats(self) -> dict[str, dict[str, int]] | None:
        """The engine's own collective counters since ``reset_engine_comm_stats`` (hf_zero)."""
        return None

    def reset_engine_comm_stats(self) -> None:
        return None

    supports_profile: bool = False
    """Whether ``--profile`` traces this runner (the hf_zero engines)."""
