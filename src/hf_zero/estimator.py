"""Per-rank memory for model states under ZeRO stages 0-3, with and without offload.

The figures come from the model's real flat layout (the same ``plan_units`` and
``build_flat_layout`` the engine runs, on a meta-device model when only a config is given), so
they include padding and stage-3 persistent parameters, and they equal
``engine.memory_report()`` after an optimizer step (tests/distributed/test_checkpoint.py checks
it for stages 1-3, fp32 and bf16, world sizes 2 and 3).

[Note: memory formulas]
Ψ parameters, Ψ_t of them trainable, N ranks (``gpus_per_node x nodes``), c bytes per compute
element (4 fp32, 2 bf16/fp16), Adam's two fp32 moments (8 bytes). Per rank, after a step:

============  ==========================  ================  ================  ===========
stage         compute params              gradients         fp32 master       Adam state
============  ==========================  ================  ================  ===========
0             c Ψ                         c Ψ_t + 4 Ψ_t [1]  4 Ψ_t [2]         8 Ψ_t
1, 2          c Ψ                         4 Ψ_t / N          4 Ψ_t / N [2]     8 Ψ_t / N
3             c Ψ / N + c Ψ_p (1 - 1/N)   4 Ψ_t / N          4 Ψ_t / N [2]     8 Ψ_t / N
============  ==========================  ================  ================  ===========

[1] the fp32 copy only when c = 2. [2] zero when c = 4: the fp32 master *is* the parameter
(see [Note: master aliasing] in engine/sharding/master_state.py). Ψ_p: stage-3 persistent parameters (at
or under ``stage3_param_persistence_threshold`` elements each), kept whole on every rank.
Every Ψ is padded: within a flat group each parameter starts at a multiple of 8 elements, and
the group ends at a multiple of ``N x 8`` elements, a stage-3 persistent group at a multiple of
``N`` ([Note: alignment in flat buffers] in partition.py).

So fp32 holds 16Ψ (stage 0), 4Ψ + 12Ψ/N (stages 1-2), 16Ψ/N (stage 3); bf16 holds 20Ψ,
2Ψ + 16Ψ/N and 18Ψ/N. DeepSpeed's estimators assume 16-bit compute with a separate fp32 master
and count 2Ψ of 16-bit gradients in stages 1-2 (``4Ψ + 16Ψ/N``); hf_zero reduces gradients into
a fp32 shard and frees the full 16-bit buffer after each reduction, so that 2Ψ is working memory
here, not a resident state, and with fp32 compute no master copy exists at all.

Working memory (transient, on the device, above the states), with B = ``reduce_bucket_size``,
L_t the largest unit's trainable elements (the root unit, embeddings and heads, included) and
b = min(Ψ_t, B + L_t) the largest gradient bucket: stage 1 holds the full gradients c Ψ_t until
the accumulation boundary, plus their packed bucket c min(Ψ_t, B) (with 16-bit compute and
gradient accumulation, also their fp32 sum, 4 Ψ_t, unless ``data_types.grad_accum_dtype`` keeps
the compute dtype); stage 2 holds the open bucket's full gradients, the packed bucket in flight
and the unit being differentiated, c (2 b + L_t). Stages 1-2 are upper estimates, not checked
against a run.

Stage 3 is measured (tests/distributed/test_simulated_scale.py, within 10%): see [Note: stage-3
working memory].

[Note: stage-3 working memory]
Stage 3's figure is the engine's schedule ([Note: the unit protocol] in engine/schedule/hooks.py and
[Note: reuse distance] in engine/schedule/gather_plan.py) replayed on unit sizes, c bytes per element, and its peak taken over:
- the forward: every gathered unit (the root for the whole forward, the unit running, the
  prefetched ones, those kept for their backward by ``stage3_max_reuse_distance`` within
  ``stage3_max_live_parameters``);
- each unit's backward, the root first: what is still gathered (the unit itself unless it is a
  plain ``nn.Embedding``, the prefetched next unit, the kept ones), plus every full gradient
  buffer not yet reduced (the unit's own; each earlier unit's until its bucket's reduction
  finishes, at most ``BUCKETS_IN_FLIGHT`` buckets in flight, and the root's for the whole
  backward, because its bucket is the last of the fixed order; a bucket larger than the next one
  is finished before the next goes out: [Note: gradients in flight] in engine/schedule/reduction_flight.py), plus
  autograd's gradient of the unit's largest parameter before it is added into its ``.grad`` view,
  unless its group takes autograd's gradient as it is ([Note: a gradient autograd hands over] in
  engine/sharding/grad_buffer.py: a sharded group of one unpadded parameter, as an embedding or a head).
A group of ``IN_PLACE_NUMEL`` elements or more is a bucket of its own; smaller ones share
buckets of B ([Note: buckets] in engine/schedule/buckets.py). Not counted: activations and logits (the
test runs 16 tokens: together with the fp32 gradient shards the first step allocates, 0.3-1.4%
of the peak), and host-side allocator slack. Reductions that finish at once (a fast network;
the fake process group of the simulation) hold one bucket where the replay assumes the engine's
bound of two: the same at the 1-layer shapes the test runs.

Offload (the placements of DESIGN.md's offload section): ``offload_optimizer=cpu`` moves the fp32
gradient shard, the fp32 master and the Adam state to the host, 16 Ψ_t / N bytes per rank
(with c = 4 the host needs its own master); the device keeps the compute parameters.
``offload_param=cpu`` (stage 3) also keeps the compute shards on the host, c (Ψ - Ψ_p) / N, and
the device holds only the persistent parameters and the working set.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from hf_zero.comm.block_wire import QWZ_BLOCK
from hf_zero.config.live import live_zero3_config
from hf_zero.engine.schedule.buckets import IN_PLACE_NUMEL
from hf_zero.engine.policy import BUCKETS_IN_FLIGHT
from hf_zero.partition import ROOT_UNIT_NAME, build_flat_layout, is_persistent, plan_units
from hf_zero.skeleton import SkeletonTooLargeError, parameter_limit

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_STATE_BYTES = 8
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold
CATEGORIES = ("compute_params", "gradients", "fp32_master", "optimizer_state")


@dataclass(frozen=True)
class GroupStats:
    """One flat group of the engine's layout, as numbers."""

    unit: str
    trainable: bool
    persistent: bool
    numel: int
    padded_numel: int
    world_size: int  # of the layout: 1 under stage 0
    largest_param_numel: int = 0  # autograd makes this parameter's gradient whole before adding it in
    backward_reads_params: bool = True  # of the unit: False for a plain nn.Embedding (engine/schedule/unit.py)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size


@dataclass
class StateEstimate:
    """Model-state bytes of one rank for one stage and offload choice."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    world_size: int
    gpus_per_node: int
    device_bytes: int  # resident between steps
    working_bytes: int  # transient on top, during forward/backward
    host_bytes: int  # per rank
    breakdown: dict[str, int] = field(default_factory=dict)  # the no-offload categories
    compute_bytes: int = 2  # c: bytes per compute element
    # with activations given: the working set and the activations at the point their sum is largest
    working_and_activations: int | None = None

    @property
    def formula(self) -> str:
        """The device bytes as a formula in Ψ (all parameters trainable, none persistent)."""
        return device_formula(self.stage, self.compute_bytes, self.offload_optimizer, self.offload_param)

    @property
    def paper_formula(self) -> str:
        """The ZeRO paper's figure for the same row (mixed precision, Adam: K = 12), or "-"."""
        if self.offload_optimizer or self.offload_param:
            return "-"
        return {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[self.stage]

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes * self.gpus_per_node


def group_stats(model: nn.Module, world_size: int, stage: int,
                persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
                wrap_modules: Sequence[str] | None = None) -> list[GroupStats]:
    """The engine's flat groups for ``model`` (one optimizer param group assumed): the same
    rules as ``ZeroUnit``, without allocating anything."""
    threshold = persistence_threshold if stage == 3 else 0
    layout_world = 1 if stage == 0 else world_size
    stats = []
    for spec in plan_units(model, wrap_modules).units:
        reads = not (isinstance(spec.module, nn.Embedding) and type(spec.module).forward is nn.Embedding.forward)
        buckets: dict[tuple[bool, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, param in spec.params:
            kind = (param.requires_grad, is_persistent(param, stage == 3, threshold))
            buckets.setdefault(kind, []).append((name, param))
        for (trainable, persistent), named in buckets.items():
            layout = build_flat_layout(named, layout_world, persistent=persistent)
            stats.append(GroupStats(spec.name, trainable, persistent, layout.numel, layout.padded_numel, layout_world,
                                    max(p.numel() for _, p in named), reads))
    return stats


def _state_bytes(groups: Iterable[GroupStats], stage: int, compute_bytes: int) -> dict[str, int]:
    mem = dict.fromkeys(CATEGORIES, 0)
    for g in groups:
        sharded = stage == 3 and not g.persistent
        mem["compute_params"] += (g.shard_numel if sharded else g.padded_numel) * compute_bytes
        if not g.trainable:
            continue
        if stage == 0:
            mem["gradients"] += g.padded_numel * compute_bytes + (g.padded_numel * 4 if compute_bytes != 4 else 0)
        else:
            mem["gradients"] += g.shard_numel * 4
        mem["fp32_master"] += g.shard_numel * 4 if compute_bytes != 4 else 0
        mem["optimizer_state"] += g.shard_numel * ADAM_STATE_BYTES
    return mem


def model_state_bytes(model: nn.Module, world_size: int, stage: int, dtype: str = "bf16",
                      persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
                      wrap_modules: Sequence[str] | None = None) -> dict[str, int]:
    """What ``engine.memory_report()`` shows for these categories after an optimizer step with
    Adam (see [Note: memory formulas])."""
    groups = group_stats(model, world_size, stage, persistence_threshold, wrap_modules)
    return _state_bytes(groups, stage, _compute_bytes(dtype))


def _compute_bytes(dtype: str) -> int:
    if dtype not in COMPUTE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(COMPUTE_BYTES)}")
    return COMPUTE_BYTES[dtype]


@dataclass(frozen=True)
class WorkingSettings:
    """The config keys that size working memory (DeepSpeed's defaults)."""

    reduce_bucket_size: int = 500_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000


@dataclass
class UnitSizes:
    """One unit as the stage-3 schedule sees it, in elements."""

    name: str
    gathered: int  # sharded groups, padded: gathered and freed around use
    grad_groups: list[int]  # trainable groups, padded, in the engine's order (non-persistent first)
    largest_grad: int  # the largest trainable parameter
    reads_params: bool  # its backward needs its parameters gathered

    @property
    def grads(self) -> int:
        return sum(self.grad_groups)


def unit_sizes(groups: list[GroupStats]) -> list[UnitSizes]:
    """The units of ``group_stats`` in the engine's order (the root last)."""
    units: dict[str, UnitSizes] = {}
    for g in sorted(groups, key=lambda g: g.persistent):  # stable: units keep their order
        u = units.setdefault(g.unit, UnitSizes(g.unit, 0, [], 0, g.backward_reads_params))
        u.gathered += g.padded_numel * (not g.persistent)
        if g.trainable:
            u.grad_groups.append(g.padded_numel)
            # A sharded group of one unpadded parameter takes autograd's gradient as its flat
            # gradient ([Note: a gradient autograd hands over] in engine/sharding/grad_buffer.py): no copy.
            adopted = not g.persistent and g.largest_param_numel == g.numel == g.padded_numel
            u.largest_grad = max(u.largest_grad, 0 if adopted else g.largest_param_numel)
    order = [g.unit for g in groups]
    return sorted(units.values(), key=lambda u: order.index(u.name))


class Stage3Replay:
    """[Note: stage-3 working memory]: the gathers, keeps and reductions of one stage-3 forward
    and backward (engine/schedule/hooks.py), on sizes only; ``peak`` is the most elements held above the
    states."""

    def __init__(self, units: list[UnitSizes], settings: WorkingSettings, compute_bytes: int = 1,
                 activations: Mapping[tuple[str, str], int] | None = None) -> None:
        self.root, self.order = units[-1], units[:-1]
        self.settings = settings
        self.compute_bytes = compute_bytes
        # (unit, phase) -> activation bytes while it runs: [Note: activations by unit] in activations.py;
        # a unit it does not name gets the largest figure
        self.activations = dict(activations or {})
        self.activations_elsewhere = max(self.activations.values(), default=0)
        self.peak_with_activations = 0  # bytes: the working set and the activations at one point
        self.after: dict[str, int] = {self.root.name: 0}  # gathered elements after a unit, forward order
        for i, unit in enumerate(self.order):
            self.after[unit.name] = sum(u.gathered for u in self.order[i + 1:])
        self.gathered: dict[str, int] = {}
        self.grads_held = 0  # full gradients not yet reduced, the in-flight buckets' included
        self.peak = 0

    def live(self) -> int:
        return sum(self.gathered.values())

    def note(self, unit: UnitSizes, phase: str, elements: int) -> None:
        """The working set of ``elements`` while ``unit`` runs its ``phase``."""
        self.peak = max(self.peak, elements)
        self.peak_with_activations = max(self.peak_with_activations, elements * self.compute_bytes
                                         + self.activations.get((unit.name, phase), self.activations_elsewhere))

    def gather(self, unit: UnitSizes) -> None:
        if unit.gathered:
            self.gathered[unit.name] = unit.gathered

    def prefetch(self, order: list[UnitSizes], backward: bool) -> None:
        """``GatherPlan.prefetch``: the next unit always, more while the bucket holds them,
        none past the live-parameter cap."""
        budget, first, live = self.settings.stage3_prefetch_bucket_size, True, self.live()
        if budget <= 0:
            return
        for unit in order:
            if not unit.gathered or (backward and not unit.reads_params):
                continue
            budget -= unit.gathered
            if (budget < 0 and not first) or live + unit.gathered > self.settings.stage3_max_live_parameters:
                break
            first = False
            if unit.name not in self.gathered:
                live += unit.gathered
                self.gather(unit)

    def keep_for_backward(self, unit: UnitSizes) -> bool:
        """``GatherPlan.keeps_for_backward`` ([Note: reuse distance])."""
        s = self.settings
        return (s.stage3_max_reuse_distance > 0 and unit.gathered > 0 and unit.reads_params
                and 2 * self.after[unit.name] < s.stage3_max_reuse_distance
                and self.live() <= s.stage3_max_live_parameters)

    def forward(self) -> None:
        self.gather(self.root)
        self.prefetch(self.order, backward=False)
        for i, unit in enumerate(self.order):
            self.gather(unit)
            self.prefetch(self.order[i + 1:], backward=False)
            self.note(unit, "forward", self.live())
            if not self.keep_for_backward(unit):
                self.gathered.pop(unit.name, None)
        self.note(self.root, "forward", self.live())  # the loss, after the last unit
        if not self.keep_for_backward(self.root):
            self.gathered.pop(self.root.name, None)

    def backward(self) -> None:
        """The root, then the units in reverse; a bucket is reduced once its units are done and
        the buckets before it have gone, and its gradients are freed when its reduction finishes
        (the oldest first once ``BUCKETS_IN_FLIGHT`` are out, or while they hold more than the
        new one)."""
        backward_order = self.order[::-1]
        buckets = _buckets([(u.name, n) for u in backward_order + [self.root] for n in u.grad_groups],
                           self.settings.reduce_bucket_size)
        done: set[str] = set()
        in_flight: list[int] = []  # elements of each bucket in flight
        for i, unit in enumerate([self.root] + backward_order):
            if unit.reads_params:
                self.gather(unit)
            self.prefetch(backward_order[i:], backward=True)  # the units after this one
            self.grads_held += unit.grads
            self.note(unit, "backward", self.live() + self.grads_held + unit.largest_grad)
            self.gathered.pop(unit.name, None)
            done.add(unit.name)
            while buckets and all(name in done for name, _ in buckets[0]):
                new = sum(n for _, n in buckets.pop(0))
                # [Note: gradients in flight] in engine/schedule/reduction_flight.py
                while in_flight and (len(in_flight) >= BUCKETS_IN_FLIGHT
                                     or sum(in_flight) > (BUCKETS_IN_FLIGHT - 1) * new):
                    self.grads_held -= in_flight.pop(0)
                in_flight.append(new)


def _buckets(groups: list[tuple[str, int]], bucket_numel: int) -> list[list[tuple[str, int]]]:
    """``engine.buckets.split_buckets`` on (unit, padded numel) pairs."""
    out: list[list[tuple[str, int]]] = []
    open_bucket: list[tuple[str, int]] = []
    for unit, numel in groups:
        if numel >= IN_PLACE_NUMEL:
            out.append([(unit, numel)])
            continue
        open_bucket.append((unit, numel))
        if sum(n for _, n in open_bucket) >= bucket_numel:
            out.append(open_bucket)
            open_bucket = []
    return out + ([open_bucket] if open_bucket else [])


def _working_and_activations(groups: list[GroupStats], stage: int, compute_bytes: int, settings: WorkingSettings,
                             activations: Mapping[tuple[str, str], int]) -> int:
    """The most bytes above the states at one point of the step, the activations included: at
    stage 3 the replay's sum at each unit ([Note: activations by unit] in activations.py); at
    stages 0-2, whose working set is not replayed, the two peaks added (an upper estimate)."""
    if stage == 3:
        replay = Stage3Replay(unit_sizes(groups), settings, compute_bytes, activations)
        replay.forward()
        replay.backward()
        return replay.peak_with_activations
    return _working_bytes(groups, stage, compute_bytes, settings) + max(activations.values(), default=0)


def _working_bytes(groups: list[GroupStats], stage: int, compute_bytes: int,
                   settings: WorkingSettings = WorkingSettings()) -> int:
    """Transient device bytes during forward/backward (see [Note: memory formulas])."""
    if stage == 3:
        replay = Stage3Replay(unit_sizes(groups), settings)
        replay.forward()
        replay.backward()
        return replay.peak * compute_bytes
    units: dict[str, int] = {}  # unit -> trainable padded numel
    for g in groups:
        units[g.unit] = units.get(g.unit, 0) + g.padded_numel * g.trainable
    total_trainable = sum(units.values())
    largest_trainable = max(units.values(), default=0)
    if stage == 1:
        return (total_trainable + min(total_trainable, settings.reduce_bucket_size)) * compute_bytes
    if stage == 2:
        bucket = min(total_trainable, settings.reduce_bucket_size + largest_trainable)
        return (2 * bucket + largest_trainable) * compute_bytes
    return 0


def _estimate(model: nn.Module, world: int, gpus_per_node: int, stage: int, compute_bytes: int,
              threshold: int, wrap_modules: Sequence[str] | None, offload_optimizer: bool,
              offload_param: bool, working: WorkingSettings, shard_size: int,
              activations: Mapping[tuple[str, str], int] | None = None, secondary_size: int = 1,
              secondary_element_bytes: float = 0.0) -> StateEstimate:
    groups = group_stats(model, shard_size, stage, threshold, wrap_modules)
    mem = _state_bytes(groups, stage, compute_bytes)
    device, host = sum(mem.values()), 0
    if offload_optimizer:
        trainable_shard = sum(g.shard_numel for g in groups if g.trainable)
        host += trainable_shard * (4 + 4 + ADAM_STATE_BYTES)
        device = mem["compute_params"]
    if offload_param:
        sharded = sum(g.shard_numel for g in groups if not g.persistent) * compute_bytes
        host += sharded
        device -= sharded
    # hpZ's secondary shards ([Note: secondary shards]): 1/P of every sharded group at the
    # gather's width, from the forward to the step, so working memory; offload_param refuses the key.
    secondary = (round(secondary_element_bytes * sum(g.shard_numel for g in groups if not g.persistent)
                       * shard_size / secondary_size)
                 if stage == 3 and secondary_size > 1 and not offload_param else 0)
    both = None if activations is None else _working_and_activations(groups, stage, compute_bytes, working, activations)
    return StateEstimate(stage, offload_optimizer, offload_param, world, gpus_per_node, device,
                         _working_bytes(groups, stage, compute_bytes, working) + secondary, host, mem, compute_bytes,
                         None if both is None else both + secondary)


def estimate_model_states(
    model: nn.Module | str | os.PathLike[str] | Mapping[str, Any],
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    dtype: str = "bf16",
    stages: Sequence[int] = (1, 2, 3),
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD,
    wrap_modules: Sequence[str] | None = None,
    working: WorkingSettings = WorkingSettings(),
    shard_group_size: int | None = None,
    activations: Mapping[tuple[str, str], int] | None = None,
    secondary_partition_size: int = 1,
    quantized_weights: bool = False,
) -> list[StateEstimate]:
    """Per-rank device and host bytes for model states under each stage in ``stages``, without
    offload, with ``offload_optimizer=cpu`` (stages 1-3) and with both offloads (stage 3); see
    [Note: memory formulas]. ``model`` is a module (any device, meta included), a Hugging Face
    config dict, or a path / Hub name of a config (built on the meta device: nothing is allocated).
    ``working`` holds the bucket and reuse settings that size the transient working memory.
    ``shard_group_size``: ``mics_shard_size`` (hybrid sharding): states are sharded over groups of
    that many ranks, not over the world. ``activations``: ``ActivationEstimate.by_unit``
    (hf_zero/activations.py), which fills each row's ``working_and_activations``.
    ``secondary_partition_size``: ``zero_hpz_partition_size``, whose secondary shards the stage-3
    rows without offload_param add to the working memory, in the compute dtype, or with
    ``quantized_weights`` (``zero_quantized_weights``) as int8 blocks.
    """
    if num_gpus_per_node < 1 or num_nodes < 1:
        raise ValueError(f"num_gpus_per_node and num_nodes must be >= 1, got {num_gpus_per_node}, {num_nodes}")
    module = model if isinstance(model, nn.Module) else meta_model(model)
    world = num_gpus_per_node * num_nodes
    shard_size = world if shard_group_size is None or shard_group_size <= 0 else shard_group_size
    if world % shard_size:
        raise ValueError(f"shard_group_size {shard_group_size} does not divide the world size {world}")
    secondary_size = secondary_partition_size if 1 < secondary_partition_size < world else 1  # as initialize
    if world % secondary_size:
        raise ValueError(f"secondary_partition_size {secondary_partition_size} does not divide the world size {world}")
    compute_bytes = _compute_bytes(dtype)
    secondary_bytes = 1 + 4 / QWZ_BLOCK if quantized_weights else float(compute_bytes)
    estimates = []
    for stage in stages:
        choices = [(False, False)] + ([(True, False)] if stage > 0 else []) + ([(True, True)] if stage == 3 else [])
        for offload_optimizer, offload_param in choices:
            estimates.append(_estimate(module, world, num_gpus_per_node, stage, compute_bytes,
                                       persistence_threshold, wrap_modules, offload_optimizer, offload_param,
                                       working, shard_size, activations, secondary_size, secondary_bytes))
    return estimates


# A config is a file from anywhere: one edited to 2,000,000 layers would build for hours. The
# largest published models have a few hundred layers and under 100,000 parameter tensors.
MAX_SKELETON_LAYERS = 10_000
MAX_SKELETON_PARAMETERS = 1_000_000


def _check_skeleton_size(config: Any) -> None:
    for part in (config, config.get_text_config()):  # a multimodal config keeps its layers in its text part
        layers = getattr(part, "num_hidden_layers", None)
        if isinstance(layers, int) and layers > MAX_SKELETON_LAYERS:
            raise SkeletonTooLargeError(
                f"the config describes {layers} layers (num_hidden_layers), more than {MAX_SKELETON_LAYERS:,}: "
                "the config was edited or damaged; nothing was built")


def meta_model(source: str | os.PathLike[str] | Mapping[str, Any], dtype: torch.dtype | None = None) -> nn.Module:
    """A Hugging Face model built from its config on the meta device (shapes only), in ``dtype``
    when given (else transformers' default). A config of more than ``MAX_SKELETON_LAYERS``
    layers is refused before the build, and a build is stopped past ``MAX_SKELETON_PARAMETERS``
    parameter tensors (:class:`SkeletonTooLargeError`, a ``ValueError``)."""
    import transformers
    from transformers import AutoConfig

    if isinstance(source, Mapping):
        values = dict(source)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    elif os.path.isfile(os.fspath(source)):
        config_dict = transformers.PretrainedConfig.get_config_dict(os.fspath(source))[0]
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    else:
        config = AutoConfig.from_pretrained(os.fspath(source))
    _check_skeleton_size(config)
    classes = [getattr(transformers, name, None) for name in (getattr(config, "architectures", None) or [])]
    classes += [transformers.AutoModelForCausalLM, transformers.AutoModel]
    last_error: Exception | None = None
    # While a stage-3 config is alive, from_config builds on the meta device by itself (sharded
    # initialisation), and inside a meta device context it would fail drawing its seed.
    with (contextlib.nullcontext() if live_zero3_config() is not None else torch.device("meta"),
          parameter_limit(MAX_SKELETON_PARAMETERS, "beyond any published model: the config was edited or damaged")):
        for cls in classes:
            if cls is None:
                continue
            try:
                build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
                return build(config) if dtype is None else build(config, dtype=dtype)
            except SkeletonTooLargeError:
                raise
            except (ValueError, KeyError) as error:
                last_error = error
    raise ValueError(f"no transformers model class builds config {type(config).__name__}: {last_error}")


def human_bytes(nbytes: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def device_formula(stage: int, compute_bytes: int, offload_optimizer: bool, offload_param: bool) -> str:
    """hf_zero's device bytes per rank in Ψ: c bytes per compute element (4 fp32, 2 bf16/fp16);
    in fp32 the master is the parameter itself, and gradients are reduced into fp32 shards."""
    c = compute_bytes
    if offload_param:
        return "0 (persistent only)"
    if offload_optimizer:  # the gradient shard, master and moments go to the host
        return f"{c}Ψ" if stage < 3 else f"{c}Ψ/N"
    master = 0 if c == 4 else 4
    if stage == 0:
        return f"{c + c + master + 8 + (4 if c != 4 else 0)}Ψ"
    if stage in (1, 2):
        return f"{c}Ψ + {4 + master + 8}Ψ/N"
    return f"{c + 4 + master + 8}Ψ/N"


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (the header first) as aligned columns with a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def deepspeed_zero3_estimate(model: nn.Module, num_gpus_per_node: int, num_nodes: int, offload_optimizer: bool,
                             offload_param: bool, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(device, host) bytes per rank that DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live``
    prints for this offload choice (its ``zero_init=1`` rows): its formula restated from
    deepspeed/runtime/zero/stage3.py, 4 bytes of the largest module's own parameters on the device
    plus 18Ψ/N (2Ψ/N with the optimizer offloaded, nothing more with the parameters too), the host
    its buffer factor over 18Ψ or 16Ψ per node. tests/unit/test_estimator.py checks it against
    DeepSpeed's function. Each tied parameter counts once (by identity: DeepSpeed's ``data_ptr``
    is 0 for every tensor of a meta-device model)."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    gpus, largest_bytes = num_gpus_per_node * num_nodes, 4 * largest
    if offload_param:
        return largest_bytes, int(total * 18 / num_nodes * additional_buffer_factor)
    if offload_optimizer:
        return largest_bytes + int(2 * total / gpus), int(total * 16 / num_nodes * additional_buffer_factor)
    return largest_bytes + int(18 * total / gpus), int(largest * 4 * num_gpus_per_node * additional_buffer_factor)


def format_table(estimates: list[StateEstimate], model: nn.Module | None = None) -> str:
    """The estimates as a text table, one row per stage and offload choice, with the formula each
    device figure follows, and under it the ZeRO paper's formulas; with ``model``, the device and
    host figures DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live`` gives the stage-3 rows."""
    header = ("stage", "offload_optimizer", "offload_param", "device/rank", "formula", "+working", "host/rank",
              "host/node") + (("DeepSpeed's estimate: device, host/node",) if model is not None else ())
    rows: list[tuple[str, ...]] = [header]
    for e in estimates:
        row = (str(e.stage), "cpu" if e.offload_optimizer else "none", "cpu" if e.offload_param else "none",
               human_bytes(e.device_bytes), e.formula, human_bytes(e.working_bytes), human_bytes(e.host_bytes),
               human_bytes(e.host_bytes_per_node))
        if model is not None:
            if e.stage == 3:
                device, host = deepspeed_zero3_estimate(model, e.gpus_per_node, e.world_size // e.gpus_per_node,
                                                        e.offload_optimizer, e.offload_param)
                row += (f"{human_bytes(device)}, {human_bytes(host)}",)
            else:
                row += ("-",)
        rows.append(row)
    return text_table(rows) + "\n" + PAPER_FOOTNOTE


PAPER_FOOTNOTE = ("formula: hf_zero's device bytes (Ψ parameters, N ranks), where the ZeRO paper has 16Ψ (stage 0), "
                  "4Ψ + 12Ψ/N (1), 2Ψ + 14Ψ/N (2) and 16Ψ/N (3) for mixed-precision Adam; +working: the engine's "
                  "gathered parameters and unreduced gradients during the forward and backward, no activations "
                  "(--seq adds them)")


def format_peak_table(estimates: list[StateEstimate], activation_peak: int) -> str:
    """Per stage and offload choice, the device's peak per rank: the states, plus the engine's
    working set and the step's activations where their sum is largest (``working_and_activations``)."""
    header = ("stage", "offload_optimizer", "offload_param", "states", "+working", "+activations",
              "+both, at one point", "peak/rank")
    rows = [header] + [
        (str(e.stage), "cpu" if e.offload_optimizer else "none", "cpu" if e.offload_param else "none",
         human_bytes(e.device_bytes), human_bytes(e.working_bytes), human_bytes(activation_peak),
         human_bytes(_both(e, activation_peak)), human_bytes(e.device_bytes + _both(e, activation_peak)))
        for e in estimates
    ]
    return text_table(rows)


def _both(estimate: StateEstimate, activation_peak: int) -> int:
    if estimate.working_and_activations is None:
        return estimate.working_bytes + activation_peak
    return estimate.working_and_activations


def describe(module: nn.Module, world_size: int, wrap_modules: Sequence[str] | None = None) -> str:
    """One line: parameter counts and the unit sizes the working memory depends on."""
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    plan = plan_units(module, wrap_modules)
    units = [u.numel for u in plan.units if u.name != ROOT_UNIT_NAME]
    return (f"{type(module).__name__}: {total / 1e6:.2f}M parameters ({trainable / 1e6:.2f}M trainable), "
            f"{len(units)} units of up to {max(units, default=0) / 1e6:.2f}M, root unit "
            f"{plan.root.numel / 1e6:.2f}M; {world_size} ranks")
