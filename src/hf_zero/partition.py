"""Units and flat layouts: how a model is cut and how each piece is laid out in memory.

Everything here is pure arithmetic over the model's structure and the world size: no process
group, no tensor data. The layouts computed here are what checkpoints record, so they must be a
deterministic function of (model, world size, config).

[Note: units]
A *unit* is the granularity of communication. Under stage 3 a unit's full parameters exist only
around its forward and its backward; under stage 2 a unit's gradients are reduce-scattered as
soon as its backward is done. Units are chosen, in order of precedence, from
``zero_optimization.wrap_modules`` (class names), ``model._no_split_modules`` (the classes
Transformers never splits across devices: GPT2Block, LlamaDecoderLayer, ...), the children of the
largest ``nn.ModuleList`` (the layer stack, for models that leave ``_no_split_modules`` empty),
and finally the model as a single unit. Parameters not inside any unit form the *root unit*,
which is the model itself. A parameter belongs to exactly one unit, by object identity, so tied
weights are stored once; a parameter reachable from two different units moves to the root unit,
whose full parameters are live for the whole forward and backward.

[Note: edge units]
Outside the blocks, a causal LM holds its largest tensors: the input embedding and the output
projection are each vocab x hidden (at Llama-3 shapes 525M elements). Left in the root, they
would be gathered for the whole forward and backward although one module at each end uses
them, with the full gradient of the head held as well, and together they would exhaust
``stage3_max_live_parameters`` (refusing every prefetch and every reuse). So the modules
Transformers names through ``get_input_embeddings()`` and ``get_output_embeddings()`` become
units of their own, first and last in the unit order, which is where they run. Code inside the
model's forward that reads ``lm_head.weight`` without calling the module (TRL's fused LM head,
Liger's fused linear cross-entropy, custom losses) gathers the head on that read
([Note: parameters read without their module] in hooks.py). A tied pair is one tensor reachable
from both modules: it stays in the root (stored once). Embeddings inside a block, or a model
that is one unit, are left as they are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

logger = logging.getLogger("hf_zero")

# [Note: alignment in flat buffers]
# Every parameter view and every shard of a flat buffer starts on a 16-byte boundary, for every
# compute dtype (the shards of stage-3 persistent groups where their length allows it, below):
# cuBLAS picks its fast kernels, and inductor copies an input that is not 16-byte aligned, while
# NCCL and the Triton kernels' aligned variant ([Note: aligned variant] in
# kernels/triton_common.py) move 16 bytes at a time. The layout is a pure function of the model
# and the world size (checkpoints record it), not of the dtype, so offsets are counted in
# elements of the narrowest compute dtype: 8 elements are 16 bytes of bf16/fp16 and 32 bytes of
# fp32. A parameter's offset is rounded up to a multiple of PARAM_ALIGNMENT elements (the gap is
# padding, zero like the tail), and the padded length to a multiple of world_size *
# SHARD_ALIGNMENT elements, so the shards stay equal and each starts aligned too. Flat buffers
# themselves start aligned (torch allocates at 64 bytes on CPU, 512 on CUDA). The price is at
# most 7 elements per parameter and 8 x world_size - 1 per group. Checkpoints saved with the
# earlier layout (parameters back to back, padding to world_size x 4) still load: the loader
# maps every slot by name ([Note: resharding by name] in checkpoint/reshard.py).
#
# Stage-3 persistent groups (parameters under stage3_param_persistence_threshold) are padded to a
# multiple of world_size only (PERSISTENT_SHARD_ALIGNMENT). Their full buffer is what every rank
# holds and computes with, for good, so its padding is paid on every rank; their shards, a few
# elements per rank at scale, are read only by the optimizer step and the all-gather after it,
# never by a forward. Padded to world_size x 8, a Llama layer's two 4096-element norms took
# 32768 elements on each of 4096 ranks: 5% of a rank's fp32 states at Llama-3-8B shapes cut to 2
# layers (9% at 32 layers), against at most world_size - 1 elements per group now (none at these
# shapes). Their parameter views keep PARAM_ALIGNMENT; their shards are aligned where the length
# allows it (8192 elements at world 1024 or less), else the kernels take their unaligned variant
# ([Note: aligned variant] in kernels/triton_common.py) for those few elements. A checkpoint
# moves between the two layouts as between any two (mapped by name).
ALIGNMENT_BYTES = 16
PARAM_ALIGNMENT = ALIGNMENT_BYTES // 2  # elements of the narrowest (2-byte) compute dtype
SHARD_ALIGNMENT = ALIGNMENT_BYTES // 2
PERSISTENT_SHARD_ALIGNMENT = 1  # stage-3 persistent groups: see above

ROOT_UNIT_NAME = "<root>"


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside a flat buffer."""

    name: str  # fully qualified name in the model (first name, for a tied weight)
    shape: tuple[int, ...]
    offset: int  # in elements, from the start of the flat buffer
    numel: int

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's elements of ``flat``, in the parameter's shape (a view)."""
        return flat[self.offset : self.offset + self.numel].view(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    """A flat 1-D buffer holding several parameters in order, each starting on an aligned offset
    and the whole padded so that it splits in ``world_size`` equal aligned shards (see [Note:
    alignment in flat buffers]). Rank r owns elements [r * shard_numel, (r + 1) * shard_numel)."""

    slots: tuple[ParamSlot, ...]
    numel: int  # sum of the parameters' numel: the real data
    padded_numel: int  # the last parameter's end rounded up to a multiple of world_size * shard alignment
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def to_dict(self) -> dict:
        return {
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "world_size": self.world_size,
            "slots": [
                {"name": s.name, "shape": list(s.shape), "offset": s.offset, "numel": s.numel}
                for s in self.slots
            ],
        }


def round_up(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


def padded_length(numel: int, world_size: int, alignment: int | None = None) -> int:
    """``numel`` rounded up to a multiple of ``world_size * alignment`` (``SHARD_ALIGNMENT`` by
    default; at least one chunk, so an empty group still has a well-formed, tiny layout)."""
    chunk = world_size * (SHARD_ALIGNMENT if alignment is None else alignment)
    return max(chunk, round_up(numel, chunk))


def build_flat_layout(
    named_params: Sequence[tuple[str, nn.Parameter]], world_size: int, persistent: bool = False
) -> FlatLayout:
    """Lay the parameters out in the given order, each at an offset that is a multiple of
    ``PARAM_ALIGNMENT`` elements, and pad the whole to a multiple of ``world_size`` times
    ``SHARD_ALIGNMENT``, or ``PERSISTENT_SHARD_ALIGNMENT`` for a stage-3 persistent group
    (``persistent``), see [Note: alignment in flat buffers]."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    slots: list[ParamSlot] = []
    end = 0
    for name, param in named_params:
        offset = round_up(end, PARAM_ALIGNMENT)
        slots.append(ParamSlot(name, tuple(param.shape), offset, param.numel()))
        end = offset + param.numel()
    numel = sum(slot.numel for slot in slots)
    alignment = PERSISTENT_SHARD_ALIGNMENT if persistent else None
    return FlatLayout(tuple(slots), numel, padded_length(end, world_size, alignment), world_size)


@dataclass
class UnitSpec:
    """One unit: a module and the parameters it owns (see [Note: units])."""

    name: str  # module fully-qualified name, or ROOT_UNIT_NAME
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


@dataclass
class UnitPlan:
    """The units of a model, root last, and which rule chose them."""

    units: list[UnitSpec]
    rule: str

    @property
    def root(self) -> UnitSpec:
        return self.units[-1]


def _class_names(names: Iterable[str] | None) -> set[str]:
    return set(names) if names else set()


def _modules_of_classes(model: nn.Module, class_names: set[str]) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose class is named in ``class_names`` (a unit never nests a unit)."""
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or type(module).__name__ not in class_names:
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        chosen.append((name, module))
    return chosen


def _largest_module_list(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            numel = sum(p.numel() for p in module.parameters())
            if best is None or numel > best[0]:
                best = (numel, name, module)
    if best is None or best[0] == 0:
        return []
    _, list_name, module_list = best
    return [(f"{list_name}.{i}", child) for i, child in enumerate(module_list)]


def choose_unit_modules(
    model: nn.Module, wrap_modules: Sequence[str] | None = None
) -> tuple[list[tuple[str, nn.Module]], str]:
    """The modules that become units (root excluded) and a sentence naming the rule used."""
    if wrap_modules:
        found = _modules_of_classes(model, _class_names(wrap_modules))
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise ValueError(
                f"zero_optimization.wrap_modules={list(wrap_modules)} matches no module of "
                f"{type(model).__name__}; module classes present: {present}"
            )
        return found, f"zero_optimization.wrap_modules {sorted(set(wrap_modules))}"
    no_split = _class_names(getattr(model, "_no_split_modules", None))
    found = _modules_of_classes(model, no_split) if no_split else []
    if found:
        return found, f"model._no_split_modules {sorted(no_split)}"
    found = _largest_module_list(model)
    if found:
        return found, "children of the largest nn.ModuleList (model._no_split_modules is empty)"
    return [], "the whole model as one unit (no _no_split_modules and no nn.ModuleList)"


def _accessor_module(model: nn.Module, getter: str) -> nn.Module | None:
    """What ``model.<getter>()`` returns (Transformers' embedding accessors), if it is a module
    other than the model; models without embeddings return None or raise."""
    accessor = getattr(model, getter, None)
    try:
        module = accessor() if accessor is not None else None
    except (AttributeError, NotImplementedError):
        return None
    return module if isinstance(module, nn.Module) and module is not model else None


def _with_edge_units(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``blocks`` with the input embedding first and the output projection last, each when it can
    be a unit: see [Note: edge units]."""
    if not blocks:
        return blocks
    embedding = _edge_module(model, "get_input_embeddings", blocks)
    output = _edge_module(model, "get_output_embeddings", blocks)
    if embedding is not None and output is not None and any(
            p is q for p in embedding[1].parameters() for q in output[1].parameters()):
        return blocks  # tied: the one tensor stays in the root
    return ([embedding] if embedding else []) + blocks + ([output] if output else [])


def _edge_module(model: nn.Module, getter: str, blocks: list[tuple[str, nn.Module]]) -> tuple[str, nn.Module] | None:
    """``model.<getter>()`` with its name, unless it has no parameters or lies inside a block."""
    module = _accessor_module(model, getter)
    if module is None or not any(True for _ in module.parameters()):
        return None
    name = next((n for n, m in model.named_modules() if m is module), None)
    if name is None or any(m is module or name.startswith(prefix + ".") for prefix, m in blocks):
        return None
    return name, module


def plan_units(model: nn.Module, wrap_modules: Sequence[str] | None = None) -> UnitPlan:
    """Cut ``model`` into units and assign every parameter to exactly one of them."""
    unit_modules, rule = choose_unit_modules(model, wrap_modules)
    unit_modules = _with_edge_units(model, unit_modules)
    owners: dict[int, set[int]] = {}  # id(param) -> indices of the units that reach it
    for index, (_, module) in enumerate(unit_modules):
        for param in module.parameters():
            owners.setdefault(id(param), set()).add(index)

    units = [UnitSpec(name, module) for name, module in unit_modules]
    root = UnitSpec(ROOT_UNIT_NAME, model)
    seen: set[int] = set()
    # named_parameters() gives each tied parameter once, under its first name.
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        holders = owners.get(id(param), set())
        target = units[next(iter(holders))] if len(holders) == 1 else root
        target.params.append((name, param))
    units = [u for u in units if u.params]
    units.append(root)
    return UnitPlan(units, rule)


KEEP_GATHERED = "_hf_zero_keep_gathered"


def is_persistent(param: torch.Tensor, shards_params: bool, persistence_threshold: int) -> bool:
    """When parameters are sharded (``shards_params``: stage 3), those at or below the threshold
    stay gathered (DeepSpeed's ``stage3_param_persistence_threshold``): gathering many tiny
    tensors costs more in latency than it saves in memory. A parameter marked ``KEEP_GATHERED`` stays gathered whatever its size
    (a PEFT adapter: see ``initialize._keep_adapters_gathered``)."""
    return shards_params and (param.numel() <= persistence_threshold or getattr(param, KEEP_GATHERED, False))
