"""The step of a shape-aware optimizer: each parameter stepped whole, by the rank that owns it.

[Note: whole-parameter step]
Shape-aware optimizers (torch.optim.Adafactor's factored second moment, Muon's orthogonalised
2-D update) cannot step a flat 1-D shard (see [Note: element-wise optimizers]). For those,
each trainable parameter gets one owner rank for the whole run, assigned largest first to the
rank with the fewest elements so far (as Megatron's distributed optimizer and DeepSpeed's Muon
balance theirs). The owner keeps a full-shape fp32 master of it and the real torch optimizer
over those masters, so the optimizer state is still split across ranks, by parameter instead
of by element. At the step, after the gradients are reduced and the global norm is taken from
the shards exactly as on the flat path (so clipping is unchanged), each group's reduced
gradient shards are all-gathered, the owners step their parameters whole, and the new values
are summed over ranks (each element is written by exactly one owner, zeros elsewhere); every
rank copies its shard range into its flat fp32 master, and the usual refresh of the compute
shard and all-gather of updated parameters follow. The traffic is one gather of the gradient
and one all-reduce of the parameters per group, above the flat path's.

Checkpoints keep the flat masters as on the flat path, and the optimizer state by parameter
name, each owner writing the state of its parameters into its rank file; a load writes the
flat masters, copies them into the owners' masters, and gives each owner the state saved under
its parameters' names, wherever they were saved, so a run resumes at another world size or stage
(see hf_zero.checkpoint.whole_state).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hf_zero.comm import Communicator
from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.partition import ParamSlot
from hf_zero.transfer import to_compute


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """An owner rank for each size: largest first, to the least loaded rank (ties: lowest rank)."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


class WholeParamStep:
    """Owner masters, the real optimizer over them, and the step described in
    [Note: whole-parameter step]."""

    def __init__(self, groups: list[FlatParamGroup], comm: Communicator, hyper: list[dict[str, Any]],
                 device: torch.device, *,
                 build_inner: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> None:
        """``build_inner``: the real optimizer (the user's class) over the param groups of the
        owners' masters, which exist only once this object has made them: a factory, called here,
        rather than an optimizer built before."""
        self.groups = groups
        self.comm = comm
        self.device = device
        slots = [(group, slot) for group in groups for slot in group.layout.slots]
        sharded = any(g.layout.world_size > 1 for g in groups)
        world = comm.world_size if sharded else 1  # stage 0: every rank has everything, steps everything
        owners = assign_owners([slot.numel for _, slot in slots], world)
        self.owned: dict[int, list[tuple[ParamSlot, torch.Tensor]]] = {id(g): [] for g in groups}
        self.param_groups: list[dict[str, Any]] = [dict(h, params=[]) for h in hyper]
        for group in groups:
            full = self._gather(group, group.master_state.tensor, "whole_param_master")
            for (g, slot), owner in zip(slots, owners, strict=True):
                if g is group and (owner == comm.rank or world == 1):
                    master = slot.view_in(full).clone()
                    self.owned[id(group)].append((slot, master))
                    self.param_groups[group.kind.param_group_index]["params"].append(master)
        # A rank that owns nothing in a group still keeps the group (its hyperparameters are
        # what schedulers read); torch refuses only an optimizer with no group at all.
        self.inner: torch.optim.Optimizer = build_inner(self.param_groups)

    def owned_masters(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, full-shape master) for every parameter this rank steps, in layout
        order: what checkpoints save the optimizer state of, by name, so that a load at another
        world size (other owners) finds each parameter's state."""
        return [(slot.name, master) for group in self.groups for slot, master in self.owned[id(group)]]

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy every group's flat fp32 master into the owners' full-shape masters, after a
        checkpoint load wrote the flat masters. A collective: every rank calls it, in the same order."""
        for group in self.groups:
            full = self._gather(group, group.master_state.tensor, "whole_param_master")
            for slot, master in self.owned[id(group)]:
                master.copy_(slot.view_in(full))

    def _gather(self, group: FlatParamGroup, shard: torch.Tensor | None, label: str) -> torch.Tensor:
        """The whole padded fp32 flat buffer of ``group`` from every rank's shard of it."""
        if shard is None:
            shard = torch.zeros(group.layout.shard_numel, dtype=torch.float32, device=self.device)
        shard = to_compute(shard, self.device).float()
        if group.layout.world_size == 1:
            return shard
        full = torch.empty(group.layout.padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather_into(full, shard, label=label)
        return full

    @torch.no_grad()
    def step(self, factor: float) -> None:
        """Step every owned parameter whole with its reduced gradient times ``factor`` (clip
        coefficient over loss scale), then write every rank's master shard."""
        for group in self.groups:
            full_grad = self._gather(group, group.grads.shard, "whole_param_grad")
            used = dict(zip((slot.name for slot in group.layout.slots), group.params_used))
            for slot, master in self.owned[id(group)]:
                # A parameter no rank used is not stepped ([Note: parameters no rank used]).
                master.grad = slot.view_in(full_grad) * factor if used[slot.name] else None
        self.inner.step()
        for group in self.groups:
            if not group.used_in_step:
                continue
            updated = torch.zeros(group.layout.padded_numel, dtype=torch.float32, device=self.device)
            for slot, master in self.owned[id(group)]:
                slot.view_in(updated).copy_(master)
            if group.layout.world_size > 1:
                self.comm.all_reduce_(updated, label="whole_param_update")
            lo, hi = group.shard_range
            own = group.master_state
            own.write(updated[lo:hi].to(own.tensor.device) if own.tensor is not None else updated[lo:hi])
        for masters in self.owned.values():
            for _, master in masters:
                master.grad = None

