"""Which torch optimizers may step over flat fp32 shards, checked before any step.

[Note: element-wise optimizers]
hf_zero rebuilds a passed (or callable-built) torch optimizer over this rank's flat 1-D fp32
shards. That is exact only for an element-wise optimizer: one whose update of an element reads
only that element's parameter, gradient and state (SGD, Adam, AdamW, Adagrad, RMSprop, Lion...).
An optimizer that reads a parameter's shape or its whole tensor (Adafactor's factored second
moment, LAMB/LARS trust ratios, Muon's orthogonalised 2-D update, GaLore, Shampoo, L-BFGS's
history over every parameter) would run, on a flat shard, a different algorithm with no error.
So :func:`check_flat_shard_optimizer` runs at ``hf_zero.initialize`` (and so at Trainer /
Accelerator preparation) and lets through:

- the torch classes in :data:`ELEMENTWISE_TORCH_OPTIMIZERS` and hf_zero's own ZeroAdam;
- a class that declares itself element-wise with a class attribute
  ``hf_zero_elementwise = True`` (or through :func:`declare_elementwise`);
- any other class not known to be shape-aware when the config sets
  ``zero_allow_untested_optimizer: true``, as DeepSpeed lets a client optimizer through ZeRO
  with that key (transformers sets it when its Trainer builds the optimizer for DeepSpeed;
  hf_zero's Trainer path leaves it to the config); a warning names the class.

A class whose name is in :data:`SHAPE_AWARE_OPTIMIZER_NAMES`, or from a package in
:data:`SHAPE_AWARE_OPTIMIZER_MODULES` (anywhere in its MRO), is refused
even with that key: the key cannot make a flat-shard step of it correct.
"""

from __future__ import annotations

import enum
import logging

import torch

logger = logging.getLogger("hf_zero")

# Element-wise update rules in torch.optim (amsgrad, foreach, fused and maximize variants
# included: none of them couples elements). Rprop is element-wise (a sign rule per element).
ELEMENTWISE_TORCH_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)

# Class names (torch, transformers, bitsandbytes, timm, apex, DeepSpeed spellings) whose update
# reads a whole tensor, its shape, or every parameter at once.
SHAPE_AWARE_OPTIMIZER_NAMES: frozenset[str] = frozenset({
    "Adafactor", "Muon", "MuonWithAuxAdam", "SingleDeviceMuon", "Lamb", "LAMB", "FusedLamb", "FusedLAMB",
    "Lars", "LARS", "FusedLARS", "Shampoo", "DistributedShampoo", "GaLoreAdamW", "GaLoreAdamW8bit",
    "GaLoreAdafactor", "LBFGS", "SparseAdam", "Adam8bit", "AdamW8bit", "PagedAdamW8bit", "PagedAdam8bit",
    "LAMB8bit", "LARS8bit", "Lion8bit", "PagedLion8bit", "AdEMAMix8bit", "PagedAdEMAMix8bit",
    "Apollo", "SOAP", "Sophia", "AdamMini", "Adam_mini", "NovoGrad",
})
# 8-bit optimizers quantise their state in blocks of a tensor: on a flat shard the blocks differ.
# bitsandbytes names its 8-bit classes like torch's (AdamW with optim_bits=8, as the Trainer's
# --optim adamw_bnb_8bit builds it), so its whole package is refused by module.
SHAPE_AWARE_OPTIMIZER_MODULES: tuple[str, ...] = ("bitsandbytes.", "torchao.")

ALTERNATIVES = (
    "use an element-wise optimizer (torch.optim.AdamW, Adam, SGD, or the config's "
    "\"optimizer\": {\"type\": \"AdamW\"}), or train without hf_zero (plain DDP) to keep this optimizer"
)


# Shape-aware classes hf_zero steps whole, one owner rank per parameter ([Note: whole-parameter
# step] in hf_zero.engine.optim.whole_param_step): exact classes only, a subclass may read more.
WHOLE_PARAM_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name) for name in ("Adafactor", "Muon") if hasattr(torch.optim, name)
)
# The same by (module, qualified name), for classes not imported here: transformers' Adafactor
# (the Trainer's --optim adafactor) scales each parameter's update by that parameter's RMS;
# hf_zero's Muon with auxiliary AdamW ([Note: Muon with auxiliary AdamW]).
WHOLE_PARAM_OPTIMIZER_NAMES: frozenset[tuple[str, str]] = frozenset({
    ("transformers.optimization", "Adafactor"), ("hf_zero.engine.optim.muon", "MuonWithAuxAdamW")})


class OptimizerKind(enum.Enum):
    """How hf_zero may step an optimizer class over flat shards."""

    ELEMENTWISE = "element-wise"          # known or declared: the flat-shard step is exact
    WHOLE_PARAM = "whole-parameter"       # shape-aware, stepped whole by an owner rank
    SHAPE_AWARE = "shape-aware"           # known to need whole tensors: refused
    UNTESTED = "untested"                 # unknown: refused unless zero_allow_untested_optimizer


def declare_elementwise(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Declare a custom optimizer class element-wise (usable as a class decorator): its update
    of each element reads only that element's parameter, gradient and state."""
    cls.hf_zero_elementwise = True  # type: ignore[attr-defined]
    return cls


def classify_optimizer(cls: type) -> OptimizerKind:
    if cls in WHOLE_PARAM_OPTIMIZERS or (cls.__module__, cls.__qualname__) in WHOLE_PARAM_OPTIMIZER_NAMES:
        return OptimizerKind.WHOLE_PARAM
    if any(c.__name__ in SHAPE_AWARE_OPTIMIZER_NAMES or c.__module__.startswith(SHAPE_AWARE_OPTIMIZER_MODULES)
           for c in cls.__mro__):
        return OptimizerKind.SHAPE_AWARE
    if getattr(cls, "hf_zero_elementwise", False) or issubclass(cls, ELEMENTWISE_TORCH_OPTIMIZERS):
        return OptimizerKind.ELEMENTWISE
    return OptimizerKind.UNTESTED


def check_flat_shard_optimizer(cls: type, allow_untested: bool, stage: int) -> OptimizerKind:
    """Refuse ``cls`` before any step when a flat-shard step of it would not be the optimizer
    the user chose (see [Note: element-wise optimizers]). Stage 0 steps one flat tensor per
    group too (the whole group), so it is checked the same way."""
    kind = classify_optimizer(cls)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if kind in (OptimizerKind.ELEMENTWISE, OptimizerKind.WHOLE_PARAM):
        return kind
    if kind is OptimizerKind.SHAPE_AWARE:
        raise ValueError(
            f"{name} is a shape-aware optimizer (its update reads whole parameter tensors or their "
            f"shapes), and hf_zero ZeRO stage {stage} steps optimizers over flat 1-D shards, which "
            f"would silently run a different algorithm; {ALTERNATIVES}. "
            "zero_allow_untested_optimizer does not lift this (see docs/optimizers.md)")
    if not allow_untested:
        raise ValueError(
            f"{name} is not a known element-wise optimizer, and hf_zero steps optimizers over flat "
            "1-D shards of the parameters. If each element's update reads only that element's "
            "parameter, gradient and state, set \"zero_allow_untested_optimizer\": true in the "
            "config (as DeepSpeed asks) or give the class hf_zero_elementwise = True; otherwise "
            f"{ALTERNATIVES} (see docs/optimizers.md)")
    logger.warning(
        "hf_zero: %s is stepped over flat 1-D shards (zero_allow_untested_optimizer is true); "
        "this is exact only if its update is element-wise (see docs/optimizers.md)", name)
    return kind
