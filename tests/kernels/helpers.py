"""Shared test data and tolerances for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LR = 1e-3
# fp32 states vs the torch reference: 1e-6 relative, plus an absolute floor of a millionth of one
# update (1e-6 * lr) for elements near zero, where one rounding is a large relative error.
STATE_TOL = dict(rtol=1e-6, atol=1e-6 * LR)
# 10 steps against torch.optim: 1e-5 relative (the bound), the same floor scaled by 10.
OPTIM_TOL = dict(rtol=1e-5, atol=1e-5 * LR)
# Sums of squares accumulated in a different order than torch's.
NORM_TOL = dict(rtol=1e-5, atol=0.0)


@dataclass(frozen=True)
class AdamCase:
    """One point of the fused Adam grid."""

    numel: int
    grad_dtype: torch.dtype
    out_dtype: torch.dtype | None
    weight_decay: float
    adamw: bool
    step: int
    grad_scale: float = 1.0
    clip_coef: float = 1.0

    def hparams(self) -> dict[str, object]:
        return dict(lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=self.weight_decay, step=self.step,
                    adamw=self.adamw, grad_scale=self.grad_scale, clip_coef=self.clip_coef)


def adam_state(case: AdamCase) -> dict[str, torch.Tensor | None]:
    """Master, a scaled grad, moments as after a few steps (step 1 starts from zeros), out."""
    numel = case.numel
    warm = case.step > 1
    return {
        "master": torch.randn(numel),
        "grad": (torch.randn(numel) * case.grad_scale).to(case.grad_dtype),  # as a loss-scaled grad
        "exp_avg": torch.randn(numel) * 0.1 if warm else torch.zeros(numel),
        "exp_avg_sq": torch.rand(numel) * 0.01 if warm else torch.zeros(numel),
        "out": torch.full((numel,), 7.0, dtype=case.out_dtype) if case.out_dtype is not None else None,
    }


def clone_state(state: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {name: (t.clone() if t is not None else None) for name, t in state.items()}


def run_adam(fused_adam_, state: dict[str, torch.Tensor | None], case: AdamCase) -> None:
    fused_adam_(state["master"], state["grad"], state["exp_avg"], state["exp_avg_sq"], out=state["out"],
                **case.hparams())


def rank_major(units: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The rank-major layout built the plain way: rank r's chunk of every unit, rank by rank."""
    pieces = [unit.reshape(world_size, -1)[rank] for rank in range(world_size) for unit in units]
    return torch.cat([piece.float() for piece in pieces]) if pieces else torch.zeros(0)
