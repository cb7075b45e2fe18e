"""Which parameters travel in the autocast dtype under ``torch_autocast``.

[Note: lower-precision-safe modules]
Under ``torch_autocast`` ([Note: torch_autocast] in hf_zero.config.hf_zero_config) the weights,
gradients and masters are fp32, as under DDP's --bf16. DeepSpeed's
``lower_precision_safe_modules`` names the module classes whose parameters may still go over the
wire in the autocast dtype: a stage-3 gather sends their shards in bf16 and widens what arrives
back to fp32; every stage reduces their gradients in bf16 and adds the result into the fp32
gradient shard. That halves those parameters' traffic. For a Linear it changes no forward value:
autocast rounds the weight to bf16 before the matmul anyway, and rounding twice is rounding once.
The gradient sum in bf16 is the one difference from DDP (its all-reduce is fp32).

The rule is DeepSpeed's: a module whose class is exactly one of the listed classes (a subclass
is not matched) makes its own parameters (``recurse=False``) safe; ``null`` means Linear and
Conv1d/2d/3d. One difference: a parameter another module also holds (an embedding tied to the
LM head) is safe only if every module that holds it is, so a tied embedding keeps exact fp32
lookups. Names are matched against the classes already loaded in this process, by attribute
lookup from the packages in ``sys.modules``: a config file never makes this process import a
package it had not loaded (a package's own lazy attributes, as transformers', still resolve).

Only the wire copy is rounded. The shard a rank owns stays fp32 (it is not lent to the gathered
buffer: [Note: the shard lent to the gathered buffer]), and a gather that has to be exact (a
``gathered_parameters`` block, the full state of a save or an export) is made in fp32.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch
from torch import nn

DEFAULT_SAFE_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def resolve_module_classes(names: Iterable[str] | None) -> tuple[type[nn.Module], ...]:
    """The classes ``lower_precision_safe_modules`` names (``None``: DeepSpeed's default);
    ``ValueError`` naming the entry and the fix for one that is no loaded ``nn.Module`` class."""
    if names is None:
        return DEFAULT_SAFE_MODULES
    return tuple(_resolve(name) for name in names)


def _resolve(name: str) -> type[nn.Module]:
    where = f"torch_autocast.lower_precision_safe_modules: {name!r}"
    parts = name.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise ValueError(f"{where} is not a dotted class name; write the class as Python imports it, "
                         "e.g. \"torch.nn.Linear\" or \"transformers.pytorch_utils.Conv1D\"")
    found: object = None
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        found = module
        for attribute in parts[cut:]:
            found = getattr(found, attribute, None)
            if found is None:
                break
        if found is not None:
            break
    if found is None:
        raise ValueError(f"{where} names no class loaded in this process (modules are looked up, never "
                         "imported from a config); check the spelling against the class's module, e.g. "
                         "\"torch.nn.Linear\", or leave the key null for Linear and Conv1d/2d/3d")
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(f"{where} is {type(found).__name__} {found!r}, not an nn.Module class; "
                         "list module classes such as \"torch.nn.Linear\"")
    return found


def lower_precision_params(model: nn.Module, classes: tuple[type[nn.Module], ...],
                           dtype: torch.dtype) -> dict[int, torch.dtype]:
    """Parameter id -> ``dtype`` for every parameter that only modules of exactly ``classes``
    hold ([Note: lower-precision-safe modules]); the others are absent."""
    safe: set[int] = set()
    unsafe: set[int] = set()
    for module in model.modules():
        holders = safe if type(module) in classes else unsafe
        holders.update(id(p) for p in module.parameters(recurse=False))
    return {pid: dtype for pid in safe - unsafe}


def unmatched_classes(model: nn.Module, classes: tuple[type[nn.Module], ...]) -> list[str]:
    """The listed classes no module of ``model`` is exactly an instance of (a warning's names)."""
    present = {type(m) for m in model.modules()}
    return [f"{c.__module__}.{c.__qualname__}" for c in classes if c not in present]
