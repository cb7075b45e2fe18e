"""What every engine runner provides to the worker's timed loop."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

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


class TorchLoopRunner(Runner):
    """The plain torch loop the torch engines share (DDP, FSDP2, the no-comm floor):
    ``forward_module`` runs the loss under ``autocast()``, then clip over ``model``'s parameters,
    ``optimizer.step()``, ``zero_grad(set_to_none=True)``. Subclasses set the three attributes
    and ``workload``; ``local`` maps a parameter/state tensor to the part this rank holds."""

    model: torch.nn.Module
    forward_module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    local: Callable[[torch.Tensor], torch.Tensor] = staticmethod(lambda t: t)
    tally_names = ("module.parameters", "param.grad", "optimizer.state")

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            loss = self.forward_module(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.workload.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state(self) -> StorageTally:
        tally = StorageTally()
        params = list(self.model.parameters())
        names = self.tally_names
        tally.add("params", names[0], (self.local(p) for p in params))
        tally.add("grads", names[1], (self.local(p.grad) for p in params if p.grad is not None))
        tally.add("optim", names[2], (self.local(v) for s in self.optimizer.state.values()
                                      for v in s.values() if isinstance(v, torch.Tensor)))
        return tally
