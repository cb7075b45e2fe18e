"""Which torch optimizers may run over flat fp32 shards.

[Note: element-wise optimizers]
hf_zero steps the user's optimizer over this rank's flat 1-D fp32 shard of each param group:
a slice that cuts across parameters and through the middle of them. That is exact for an
optimizer whose update of each element reads only that element's gradient and state (Adam,
AdamW, SGD with momentum, Adagrad, RMSprop, Lion, ...): the shards together do what the whole
parameters would. It is silently different for an optimizer that reads a parameter's shape or
the whole tensor: Adafactor factors its second moment over rows and columns, Muon
orthogonalises each 2-D weight, LAMB/LARS scale by each parameter's norm, Shampoo and SOAP
precondition by shape, GaLore projects each matrix. So:

- known element-wise classes (``ELEMENTWISE``, plus any optimizer whose class or instance sets
  ``hf_zero_elementwise = True``) run over the shards;
- known shape-aware ones (``SHAPE_AWARE``, matched by class name so optimizers from other
  packages are caught too) are refused before any step, whatever the config says, with the
  alternatives;
- anything else is DeepSpeed's "untested optimizer": refused unless
  ``zero_allow_untested_optimizer`` is true (the Trainer sets it when it builds the optimizer,
  as transformers does for DeepSpeed), and then run over the shards with a warning that it must
  be element-wise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("hf_zero")

ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)
# Element-wise optimizers from other packages, by class name (lion-pytorch, bitsandbytes' 32-bit
# variants, torchao's AdamW): no import needed to recognise them.
ELEMENTWISE_NAMES = frozenset({"Lion", "Lion32bit", "AdamW32bit", "Adam32bit", "PagedAdamW32bit", "PagedLion32bit"})
# Class name -> why flat shards change its result.
SHAPE_AWARE = {
    "Adafactor": "factors its second moment over each parameter's rows and columns",
    "Muon": "orthogonalises each 2-D weight matrix as a whole",
    "LAMB": "scales each parameter's update by that parameter's norm (trust ratio)",
    "Lamb": "scales each parameter's update by that parameter's norm (trust ratio)",
    "FusedLamb": "scales each parameter's update by that parameter's norm (trust ratio)",
    "LARS": "scales each parameter's update by that parameter's norm (trust ratio)",
    "Shampoo": "preconditions each parameter by matrices built from its shape",
    "DistributedShampoo": "preconditions each parameter by matrices built from its shape",
    "SOAP": "preconditions each parameter by matrices built from its shape",
    "GaLoreAdamW": "projects each weight matrix onto a low-rank subspace",
    "GaLoreAdamW8bit": "projects each weight matrix onto a low-rank subspace",
    "GaLoreAdafactor": "projects each weight matrix onto a low-rank subspace",
    "LBFGS": "takes a closure and searches along the whole parameter vector",
    "SparseAdam": "steps sparse gradients, which flat shards do not hold",
}
ALTERNATIVES = ("use an element-wise optimizer (an \"optimizer\" section with AdamW, or torch.optim.AdamW / "
                "SGD / Adagrad passed in), or train this optimizer with DDP or FSDP2, which keep parameters whole")


class UnsupportedOptimizerError(ValueError):
    """An optimizer whose result over flat shards would differ from its result on whole parameters."""


def _declared_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "hf_zero_elementwise", False))


def refuse_shape_aware(optimizer: torch.optim.Optimizer) -> None:
    """A known shape-aware optimizer is an error: see [Note: element-wise optimizers]."""
    cls = type(optimizer)
    shape_aware = next((c.__name__ for c in cls.__mro__ if c.__name__ in SHAPE_AWARE), None)
    if shape_aware is not None:
        raise UnsupportedOptimizerError(
            f"hf_zero cannot run {cls.__module__}.{cls.__qualname__}: ZeRO steps flat 1-D shards that cut through "
            f"parameters, and {shape_aware} {SHAPE_AWARE[shape_aware]}, so its result would silently differ. "
            f"Instead, {ALTERNATIVES}")


def check_optimizer(optimizer: torch.optim.Optimizer, allow_untested: bool, rank: int = 0) -> None:
    """Refuse ``optimizer`` or let it run over flat shards: see [Note: element-wise optimizers]."""
    refuse_shape_aware(optimizer)
    cls = type(optimizer)
    if isinstance(optimizer, ELEMENTWISE) or any(c.__name__ in ELEMENTWISE_NAMES for c in cls.__mro__) \
            or _declared_elementwise(optimizer):
        return
    if not allow_untested:
        raise UnsupportedOptimizerError(
            f"{cls.__module__}.{cls.__qualname__} is not an optimizer hf_zero knows to be element-wise; ZeRO steps "
            "it over flat 1-D shards that cut through parameters, which is correct only if each element's update "
            "reads that element alone. If it is, set \"zero_allow_untested_optimizer\": true in the config (as "
            "DeepSpeed asks) or hf_zero_elementwise = True on the optimizer class; otherwise " + ALTERNATIVES)
    if rank == 0:
        logger.warning(
            "hf_zero: %s.%s runs over flat 1-D shards (zero_allow_untested_optimizer): correct only if its update "
            "is element-wise", cls.__module__, cls.__qualname__)
