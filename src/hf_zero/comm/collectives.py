"""Every collective hf_zero issues goes through :class:`Communicator`.

It is the only caller of ``torch.distributed`` collectives in the package, so that each one is
labelled for the profiler and counted: tests and benchmarks assert the communication volume from
these counters (stages 1-2 move 2 x params elements per step, stage 3 moves 3 x).

[Note: counting]
``numel`` is the *logical* size of a collective, the number of elements of the full tensor it
produces or consumes: the output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce or broadcast. That is the unit of the ZeRO paper's 2Ψ / 3Ψ volumes. ``bytes`` is the
same count times the element size (what a peer benchmark counting the full tensor would see).
World size 1 runs the same code with the collectives skipped and nothing counted.
"""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import timedelta
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from hf_zero.comm.exchange import ExchangeAllGather, ExchangeReduceScatter
from hf_zero.comm.process_group import leave_gloo_groups_at_exit
from hf_zero.comm.quantized_reduce import ReductionGroups, quantized_reduce_scatter, reduction_groups
from hf_zero.comm.quantized_reduce import release_groups as release_reduction_groups
from hf_zero.execution import (
    AsyncOrderError, Completion, WrongDeviceError, check_launch, execution_for, late_completion, rank_device,
)
from hf_zero.transfer import assert_not_host, mark_host


# The single-tensor collectives under the names of the installed torch: ``*_single`` from torch
# 2.13 on (where the older names warn that they are deprecated), the older names before.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle(Protocol):
    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


# [Note: two process groups]
# Gradient reductions go out on a group of their own, parameter gathers and everything else on
# the caller's group. Collectives on one group must be issued in the same order on every rank;
# when ranks take different paths through the model, the moment a rank's gradients are ready
# differs between ranks while its gathers follow the shared schedule (hooks.py), so with one
# group a reduction could pair with a gather. With two, each sequence is rank-invariant on its
# own. One gradient group is made per process group and reused by every engine; at exit it is
# destroyed with the others ([Note: leaving a gloo group]).
_GRAD_GROUPS: dict[object, dist.ProcessGroup] = {}


def _grad_group_key(group: dist.ProcessGroup | None) -> object:
    return group if group is not None else dist.group.WORLD  # a new object after re-initializing


def _make_grad_group(group: dist.ProcessGroup | None, timeout_s: float | None) -> None:
    key = _grad_group_key(group)
    if key not in _GRAD_GROUPS:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        _GRAD_GROUPS[key] = made = dist.new_group(ranks=ranks, **kwargs)
        if dist.get_backend(made) == "nccl":
            # Make the NCCL communicator now, at initialize, on every rank together: created
            # lazily, it would be made inside the first backward's first reduce-scatter.
            dist.all_reduce(torch.zeros(1, device=rank_device()), group=made)


# [Note: the host group]
# What the ranks decide together on the host (that they start a phase together, [Note: phases in
# step]; which parameters some rank used, [Note: parameters no rank used]) goes over a process
# group of host tensors, never over the compute device's: an all-gather of a device tensor whose
# result the host reads makes the host wait for everything the GPU has queued before it, and a
# list copied onto the device from pageable memory does too ([Note: host synchronisations] in
# hf_zero.execution.host_sync). Over gloo the exchange waits for the other ranks' hosts only, so
# the GPU's queue stays full while they agree. On gloo (and torch's fake group) that is the
# caller's group itself; on NCCL a gloo group over the same ranks, made once per process group at
# initialize (collective: every rank makes it, in the same order) and destroyed at exit with the
# others ([Note: leaving a gloo group]). Its buffers are allocated once per communicator and
# registered as host memory.
_HOST_GROUPS: dict[object, dist.ProcessGroup] = {}
_HOST_BACKENDS = ("gloo", "fake")


def _host_group(group: dist.ProcessGroup | None, timeout_s: float | None) -> dist.ProcessGroup | None:
    """The group of host tensors over the ranks of ``group`` ([Note: the host group])."""
    backend = dist.get_backend(group)
    if any(name in backend for name in _HOST_BACKENDS):  # "gloo", "fake", "cpu:gloo,cuda:nccl"
        return group
    key = _grad_group_key(group)
    if key not in _HOST_GROUPS:
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        _HOST_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo", **kwargs)
    return _HOST_GROUPS[key]


def host_groups() -> list[dist.ProcessGroup]:
    """The host groups hf_zero made beside a non-gloo default group (destroyed at exit)."""
    return list(_HOST_GROUPS.values())


# [Note: hybrid sharding]
# ``mics_shard_size`` S (DeepSpeed's MiCS, FSDP2's HSDP) splits the N ranks into N/S shard groups
# of S consecutive ranks (the GPUs of a node, as launchers number them) and S replica groups (the
# ranks at the same place in every shard group). Parameters, gradients and optimizer states are
# sharded S ways inside a shard group, exactly as over all ranks without it: every gather and
# every reduce-scatter stays on the fast links. A reduced gradient shard is then all-reduced across
# its replica group, the only traffic between nodes: 1/S of the gradients per step instead of the
# parameter gathers and reduce-scatters of the whole model. Every replica then holds the same
# gradient shard and takes the same optimizer step, so the replicas stay identical without
# exchanging parameters. What every rank must agree on (the config, the phases of a step, the
# initial weights, saves) still goes over all ranks; the averaging divides by N
# (grad_average.py); a checkpoint is written by the first shard group (save.py) and has S rank
# files. ``torch.distributed.new_group`` is collective over all ranks, so every rank makes every
# group, in one order; the meshes are kept per (group, S) and reused by every engine.
@dataclass(frozen=True)
class _Mesh:
    shard: dist.ProcessGroup  # this rank's shard group: gathers, norms
    replicas: dist.ProcessGroup  # the ranks holding the same shard in the other shard groups


_MESHES: dict[tuple[object, int], _Mesh] = {}


def _make_mesh(group: dist.ProcessGroup | None, shard_size: int, timeout_s: float | None) -> _Mesh:
    key = (_grad_group_key(group), shard_size)
    if key in _MESHES:
        return _MESHES[key]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    shard = shard_grads = replicas = None
    for start in range(0, len(ranks), shard_size):
        members = ranks[start:start + shard_size]
        made, made_grads = dist.new_group(ranks=members, **kwargs), dist.new_group(ranks=members, **kwargs)
        if me in members:
            shard, shard_grads = made, made_grads
    for offset in range(shard_size):
        members = ranks[offset::shard_size]
        made = dist.new_group(ranks=members, **kwargs)
        if me in members:
            replicas = made
    assert shard is not None and shard_grads is not None and replicas is not None
    _GRAD_GROUPS[_grad_group_key(shard)] = shard_grads  # [Note: two process groups], inside the shard group
    for made in (shard, shard_grads, replicas):
        if dist.get_backend(made) == "nccl":  # made now, together, not inside a backward hook
            dist.all_reduce(torch.zeros(1, device=rank_device()), group=made)
    _MESHES[key] = mesh = _Mesh(shard, replicas)
    return mesh


# [Note: node groups for hpZ]
# ``zero_hpz_partition_size`` P (DeepSpeed ZeRO++'s hpZ) splits the shard group into groups of P
# consecutive ranks, the GPUs of a node as launchers number them; a stage-3 group keeps a
# secondary shard of its gathered parameters over them (hf_zero.engine.sharding.param_storage,
# [Note: secondary shards]) and gathers from it inside the node. Made like the meshes: every rank
# makes every group, in one order, once per (group, P).
_NODE_GROUPS: dict[tuple[object, int], dist.ProcessGroup] = {}


def _make_node_group(group: dist.ProcessGroup | None, size: int, timeout_s: float | None) -> dist.ProcessGroup:
    key = (_grad_group_key(group), size)
    if key not in _NODE_GROUPS:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        mine = None
        for start in range(0, len(ranks), size):
            made = dist.new_group(ranks=ranks[start:start + size], **kwargs)
            if dist.get_rank() in ranks[start:start + size]:
                mine = made
        assert mine is not None
        if dist.get_backend(mine) == "nccl":  # made now, together, not inside a backward hook
            dist.all_reduce(torch.zeros(1, device=rank_device()), group=mine)
        _NODE_GROUPS[key] = mine
    return _NODE_GROUPS[key]


def _release_groups() -> None:
    _GRAD_GROUPS.clear()
    _MESHES.clear()
    _HOST_GROUPS.clear()
    _NODE_GROUPS.clear()
    release_reduction_groups()


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the collective, its label
    (the unit's group), and where the engine was (see [Note: collective errors])."""


_TIMEOUT_WORDS = ("timed out", "timeout")  # gloo: "Timed out waiting 3000ms for recv operation"


def _describe_failure(comm: "Communicator", kind: str, label: str, exc: BaseException) -> CollectiveError:
    """[Note: collective errors]
    A rank that stops answering (hung, crashed, or on another code path) leaves the others
    waiting in their next collective until the process group's timeout (``collective_timeout_s``
    / ``HF_ZERO_TIMEOUT`` when hf_zero creates the group; torch's default is 30 minutes). The
    error torch raises then says only which socket timed out; every collective of hf_zero goes
    through :class:`Communicator`, which re-raises it naming the collective, its label (the
    unit's flat group, or what else it moves), and where this rank was (the optimizer step and
    micro-step, or initialize/save/load), so each rank's log says what it was waiting for."""
    timed_out = any(word in str(exc).lower() for word in _TIMEOUT_WORDS)
    what = (f"got no answer within the {comm.timeout_s:g} s collective timeout" if timed_out and comm.timeout_s
            else "timed out" if timed_out else f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
    return CollectiveError(
        f"rank {comm.global_rank}: {kind} {label!r} {what} while at {comm.where()}: another rank stopped answering "
        "(crashed, hung, or took another code path; its own output says which). "
        + ("Raise the limit with collective_timeout_s in the config or HF_ZERO_TIMEOUT (seconds) if a rank "
           "is only slow." if timed_out else "")
    )


def _is_backend_failure(exc: RuntimeError) -> bool:
    """A failure of the collective itself, not one of hf_zero's own checks (which name what they
    found: a described failure, an asynchronous-order or a wrong-device error)."""
    return not isinstance(exc, (CollectiveError, AsyncOrderError, WrongDeviceError))


class _ReportingHandle:
    """An async collective's completion whose ``wait`` reports a failure like the blocking calls."""

    def __init__(self, work: Completion, comm: "Communicator", kind: str, label: str) -> None:
        self.work, self.comm, self.kind, self.label = work, comm, kind, label

    def wait(self, stream: object = None) -> None:
        try:
            self.work.wait(stream)
        except RuntimeError as exc:
            if not _is_backend_failure(exc):
                raise
            raise _describe_failure(self.comm, self.kind, self.label, exc) from exc

    def wait_on_host(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


# [Note: bytes between nodes]
# Each counted collective's ``bytes`` (its logical size, [Note: counting]) is split by where the
# data lives: of a group of g ranks of which l are on this rank's node, the chunks of the other
# g - l ranks are the part that crosses between nodes, ``bytes * (g - l) / g``, and the rest stays
# inside. That is what a gather receives from other nodes, what a reduce-scatter or all-reduce
# combines from them, whatever algorithm the backend runs. A node is ``LOCAL_WORLD_SIZE``
# consecutive ranks (torchrun's numbering); without it, every rank is on one node.
@dataclass
class CollectiveCounter:
    calls: int = 0
    numel: int = 0
    bytes: int = 0
    bytes_between_nodes: int = 0


@dataclass
class CommStats:
    by_kind: dict[str, CollectiveCounter] = field(
        default_factory=lambda: defaultdict(CollectiveCounter)
    )

    def add(self, kind: str, tensor: torch.Tensor, share_between_nodes: float = 0.0) -> None:
        """``share_between_nodes``: the part of the group on other nodes ([Note: bytes between nodes])."""
        counter = self.by_kind[kind]
        counter.calls += 1
        counter.numel += tensor.numel()
        nbytes = tensor.numel() * tensor.element_size()
        counter.bytes += nbytes
        counter.bytes_between_nodes += round(nbytes * share_between_nodes)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            kind: {"calls": c.calls, "numel": c.numel, "bytes": c.bytes,
                   "bytes_inside_node": c.bytes - c.bytes_between_nodes, "bytes_between_nodes": c.bytes_between_nodes}
            for kind, c in sorted(self.by_kind.items())
        }


def ranks_per_node(world_size: int) -> int:
    """``LOCAL_WORLD_SIZE`` as the launcher set it, or ``world_size`` (one node) without it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return min(local, world_size) if local > 0 else world_size


class Communicator:
    """Collectives over one process group, counted and labelled (see [Note: counting])."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float | None = None,
                 shard_size: int | None = None, node_size: int | None = None,
                 quantize_gradients: bool = False) -> None:
        """``group``: every rank of the run; ``shard_size``: shard over groups of that many ranks
        and replicate across them ([Note: hybrid sharding]); None shards over all of ``group``.
        ``node_size``: gathers may also go over groups of that many consecutive ranks of the
        shard group ([Note: node groups for hpZ]). ``quantize_gradients``: reduce-scatters go as
        4-bit blocks, inside each node first ([Note: quantized gradient reduction])."""
        self.initialized = dist.is_available() and dist.is_initialized()
        self.group = group  # agreement, phases, broadcasts, saves: every rank
        self.global_rank = dist.get_rank(group) if self.initialized else 0
        self.global_world_size = dist.get_world_size(group) if self.initialized else 1
        hybrid = shard_size is not None and 1 < shard_size < self.global_world_size
        if hybrid and self.global_world_size % shard_size:
            raise ValueError(
                f"hf_zero: zero_optimization.mics_shard_size {shard_size} does not divide the world size "
                f"{self.global_world_size}; write a divisor of it (the GPUs of one node), or -1 to shard over all ranks")
        mesh = _make_mesh(group, shard_size, timeout_s) if hybrid else None
        # Parameter gathers, gradient reduce-scatters and norms: the shard group.
        self.shard_group = mesh.shard if mesh is not None else group
        # Gradient shards are all-reduced across it after their reduce-scatter; None without replicas.
        self.replica_group = mesh.replicas if mesh is not None else None
        # The place in the shard group (which shard this rank owns) and the group's size.
        self.rank = dist.get_rank(self.shard_group) if self.initialized else 0
        self.world_size = dist.get_world_size(self.shard_group) if self.initialized else 1
        self.replicas = self.global_world_size // self.world_size
        if self.world_size > 1:  # see [Note: two process groups]
            _make_grad_group(self.shard_group, timeout_s)
        if node_size is not None and node_size > 1 and self.world_size % node_size:
            raise ValueError(
                f"hf_zero: zero_optimization.zero_hpz_partition_size {node_size} does not divide the {self.world_size} "
                "ranks the parameters are sharded over; write a divisor of it (the GPUs of one node)")
        # The ranks a secondary shard is gathered over ([Note: node groups for hpZ]); 1: none.
        self.node_size = min(node_size, self.world_size) if node_size is not None and node_size > 1 else 1
        self.node_group = (_make_node_group(self.shard_group, self.node_size, timeout_s)
                           if self.node_size > 1 and self.initialized else None)
        self.node_rank = self.rank % self.node_size
        # [Note: bytes between nodes]: per group, the part of its ranks on other nodes.
        self._ranks_per_node = ranks_per_node(self.global_world_size)
        self._share_between: dict[object, float] = {}
        # Phase check-ins and used-parameter flags: [Note: the host group].
        self.host_group = _host_group(group, timeout_s) if self.global_world_size > 1 else None
        self._host_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.global_world_size > 1:
            leave_gloo_groups_at_exit(release_own_references=_release_groups, host_groups=host_groups)
        self.stats = CommStats()
        # When a list: every collective issued, in issue order, as (kind, label): what
        # [Note: one order for both groups] is checked against.
        self.trace: list[tuple[str, str]] | None = None
        self.timeout_s = timeout_s  # the collective timeout hf_zero set, if it did (see [Note: collective errors])
        self.where: Callable[[], str] = lambda: "initialize"  # the engine points this at its counters
        self._reduce_scatter_by_exchange = self.world_size > 1 and dist.get_backend(self.grad_group) == "gloo"
        self.quantized_reduction: ReductionGroups | None = None
        if quantize_gradients and self.world_size > 1:
            if self.replica_group is not None:
                raise ValueError("hf_zero: zero_quantized_gradients with mics_shard_size: not supported (the config "
                                 "check refuses it)")
            local = self._ranks_per_node if self.world_size % self._ranks_per_node == 0 else self.world_size
            self.quantized_reduction = reduction_groups(self.shard_group, _grad_group_key(self.shard_group), local,
                                                        timeout_s)
        self._all_gather_by_exchange = self.world_size > 1 and dist.get_backend(self.shard_group) == "gloo"

    @contextmanager
    def _reporting(self, kind: str, label: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # torch's DistBackendError is one
            if not _is_backend_failure(exc):
                raise
            raise _describe_failure(self, kind, label, exc) from exc

    @contextmanager
    def during(self, activity: str) -> Iterator[None]:
        """Collective errors inside the block say ``activity`` as where this rank was (a save
        is not the optimizer step the engine's counters would name)."""
        outer = self.where
        self.where = lambda: activity
        try:
            yield
        finally:
            self.where = outer

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        return _GRAD_GROUPS.get(_grad_group_key(self.shard_group)) if self.world_size > 1 else None

    @property
    def active(self) -> bool:
        """False when collectives are skipped (world size 1)."""
        return self.global_world_size > 1

    @property
    def replica_index(self) -> int:
        """Which shard group this rank is in (0 without hybrid sharding): groups are consecutive."""
        return self.global_rank // self.world_size

    @property
    def data_parallel_size(self) -> int:
        """How many ranks' gradients a reduction averages: every rank, replicas included."""
        return self.global_world_size

    @staticmethod
    def _check(label: str, *tensors: torch.Tensor) -> None:
        """Collectives take compute-device tensors, never host-store memory (checked at world
        size 1 too, so single-process tests see the mistake): [Note: host-device transfers]."""
        for tensor in tensors:
            assert_not_host(tensor, f"collective {label!r}")
            check_launch(tensor, f"collective {label!r}", strict=late_completion())

    def share_between_nodes(self, group: dist.ProcessGroup | None) -> float:
        """The part of ``group``'s ranks on other nodes than this rank's ([Note: bytes between nodes])."""
        key = _grad_group_key(group)
        if key not in self._share_between:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            node = dist.get_rank() // self._ranks_per_node
            away = sum(1 for r in ranks if r // self._ranks_per_node != node)
            self._share_between[key] = away / len(ranks)
        return self._share_between[key]

    def _count(self, kind: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        self.stats.add(kind, tensor, self.share_between_nodes(group))
        if self.trace is not None:
            self.trace.append((kind, label))

    def count_issued_elsewhere(self, kind: str, label: str, tensor: torch.Tensor,
                               group: dist.ProcessGroup | None) -> None:
        """Count a collective issued outside this communicator on ``group``, a group of the same
        run (sequence parallelism's, inside autograd: hf_zero.sequence_parallel.exchange), so that
        ``comm_stats()`` holds every collective of a step."""
        self._count(kind, label, tensor, group)

    def reset_stats(self) -> None:
        self.stats = CommStats()

    def all_gather_into(
        self, output: torch.Tensor, shard: torch.Tensor, label: str, async_op: bool = False,
        after: tuple[Completion, ...] = (), within_node: bool = False,
    ) -> Handle:
        """``output`` (world_size x shard numel) receives every rank's ``shard``, rank-major.
        ``shard`` may be this rank's slice of ``output`` (in place). ``after``: completions the
        shard depends on (its copy from the host). ``within_node``: over this rank's node group
        instead (``node_size`` x shard numel, [Note: node groups for hpZ]). Runs on the
        all-gather stream ([Note: streams and events] in hf_zero.execution)."""
        self._check(label, output, shard)
        group = self.node_group if within_node else self.shard_group
        if within_node and self.node_size == 1:
            raise ValueError(f"all-gather {label!r} within the node: this communicator has no node groups")
        if self.active:
            self._count("all_gather", label, output, group)

        def issue(out: torch.Tensor, inp: torch.Tensor, async_: bool) -> object:
            if not self.active:
                if out.data_ptr() != inp.data_ptr():
                    out.copy_(inp)
                return None
            with record_function(f"hf_zero::all_gather::{label}"):  # failures: reported by _run
                if self._all_gather_by_exchange and out.device.type == "cpu":
                    work = ExchangeAllGather(out, inp, group)  # [Note: all-gather on gloo]
                    if not async_:
                        work.wait()
                        return None
                    return work
                return _ALL_GATHER(out, inp, group=group, async_op=async_)

        return self._run("all_gather", "all-gather", label, output, shard, issue, async_op, after)

    def reduce_scatter_into(
        self, shard: torch.Tensor, full: torch.Tensor, label: str, async_op: bool = False,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    ) -> Handle:
        """``shard`` receives this rank's chunk of the element-wise reduction (``op``: SUM, or AVG
        where the backend has it) of every rank's ``full``. Runs on the reduce-scatter stream
        ([Note: streams and events] in hf_zero.execution)."""
        self._check(label, shard, full)
        if self.quantized_reduction is not None and full.is_floating_point():
            return self._quantized_reduce_scatter(shard, full, label, async_op, op)
        exchange = self._reduce_scatter_by_exchange and full.device.type == "cpu"
        if exchange and op != dist.ReduceOp.SUM:
            raise NotImplementedError(
                f"hf_zero: reduce-scatter {label!r} with {op} on gloo: the gloo exchange sums only "
                "(this is a bug in hf_zero: the caller should have divided first)")
        if self.active:
            self._count("reduce_scatter", label, full, self.grad_group)
            if self.replica_group is not None:
                self._count("replica_all_reduce", label, shard, self.replica_group)

        def issue(out: torch.Tensor, inp: torch.Tensor, async_: bool) -> object:
            if not self.active:
                out.copy_(inp)
                return None
            with record_function(f"hf_zero::reduce_scatter::{label}"):  # failures: reported by _run
                if self.replica_group is not None:
                    self._reduce_scatter(out, inp, op, exchange, async_=False)
                    return self._across_replicas(out, op, label, async_)
                return self._reduce_scatter(out, inp, op, exchange, async_)

        return self._run("reduce_scatter", "reduce-scatter", label, shard, full, issue, async_op)

    def _quantized_reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, label: str, async_op: bool,
                                  op: dist.ReduceOp.RedOpType) -> Handle:
        """[Note: quantized gradient reduction]: complete when it returns; each all-to-all is
        counted with its 4-bit payload."""
        groups = self.quantized_reduction
        assert groups is not None
        divisor = self.world_size if op == dist.ReduceOp.AVG else 1

        def issue(out: torch.Tensor, inp: torch.Tensor, async_: bool) -> object:
            with record_function(f"hf_zero::quantized_reduce_scatter::{label}"):
                quantized_reduce_scatter(out, inp, groups, label, self._count, divisor)
            return None

        return self._run("reduce_scatter", "quantized reduce-scatter", label, shard, full, issue, async_op)

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: dist.ReduceOp.RedOpType,
                        exchange: bool, async_: bool) -> object:
        """Inside the shard group, on its gradient group."""
        if exchange:
            work = ExchangeReduceScatter(out, inp, self.grad_group)  # [Note: reduce-scatter on gloo]
            if not async_:
                work.wait()
                return None
            return work
        return _REDUCE_SCATTER(out, inp, op=op, group=self.grad_group, async_op=async_)

    def _across_replicas(self, shard: torch.Tensor, op: dist.ReduceOp.RedOpType, label: str, async_: bool) -> object:
        """A reduced gradient shard, all-reduced with the same shard of the other shard groups
        ([Note: hybrid sharding]). Issued right after the reduce-scatter it follows (which the
        host or the stream has waited for), so the replica group sees the reductions in the
        order the gradient group does, the same on every rank."""
        with record_function(f"hf_zero::replica_all_reduce::{label}"):
            return dist.all_reduce(shard, op=op, group=self.replica_group, async_op=async_)

    def _run(self, stream_kind: str, kind: str, label: str, output: torch.Tensor, input: torch.Tensor,
             issue: Callable[[torch.Tensor, torch.Tensor, bool], object], async_op: bool,
             after: tuple[Completion, ...] = ()) -> Handle:
        execution = execution_for(output.device)
        with self._reporting(kind, label):
            completion = execution.collective(stream_kind, f"{kind} {label!r}", output, input, issue,
                                              async_op, after)
        return _ReportingHandle(completion, self, kind, label)

    def all_reduce_(
        self, tensor: torch.Tensor, label: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        grads: bool = False, over_all_ranks: bool = False,
    ) -> torch.Tensor:
        """In place, on the shard group. ``grads``: a gradient reduction, on the gradient group
        ([Note: two process groups]); ``over_all_ranks``: on every rank, the replicas of hybrid
        sharding included."""
        self._check(label, tensor)
        if self.active:
            group = self.grad_group if grads else self.group if over_all_ranks else self.shard_group
            self._count("all_reduce", label, tensor, group)
            with record_function(f"hf_zero::all_reduce::{label}"), self._reporting("all-reduce", label):
                dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def all_reduce_into(self, tensor: torch.Tensor, label: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                        async_op: bool = False) -> Handle:
        """In place, a gradient reduction on the gradient group ([Note: two process groups]),
        on the reduce-scatter stream like the other gradient reductions ([Note: streams and
        events] in hf_zero.execution): stage 0's buckets, launched during the backward."""
        self._check(label, tensor)
        if self.active:
            self._count("all_reduce", label, tensor, self.grad_group)

        def issue(out: torch.Tensor, inp: torch.Tensor, async_: bool) -> object:
            if out.data_ptr() != inp.data_ptr():  # a private result under late completion
                out.copy_(inp)
            if not self.active:
                return None
            with record_function(f"hf_zero::all_reduce::{label}"):
                return dist.all_reduce(out, op=op, group=self.grad_group, async_op=async_)

        return self._run("reduce_scatter", "all-reduce", label, tensor, tensor, issue, async_op)

    def broadcast_(self, tensor: torch.Tensor, src: int, label: str) -> torch.Tensor:
        self._check(label, tensor)
        if self.active:
            self._count("broadcast", label, tensor, self.group)
            with record_function(f"hf_zero::broadcast::{label}"), self._reporting("broadcast", label):
                dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def exchange_on_host(self, values: tuple[int, ...] | list[int], phase: str) -> list[tuple[int, ...]]:
        """Every rank's ``values`` (a few integers, the same count on every rank) in one
        fixed-size all-gather over [Note: the host group], whose result the host reads without
        waiting for the compute device. Traced, not counted as model traffic."""
        if not self.active:
            return [tuple(values)]
        mine, everyone = self._host_buffer(len(values))
        mine.copy_(torch.tensor(values, dtype=torch.int64))
        if self.trace is not None:
            self.trace.append(("phase", phase))
        with record_function(f"hf_zero::phase::{phase}"), self._reporting("phase check", phase):
            _ALL_GATHER(everyone, mine, group=self.host_group)
        rows = everyone.view(self.global_world_size, len(values)).tolist()
        return [tuple(row) for row in rows]

    def any_on_host(self, flags: list[bool], label: str) -> list[bool]:
        """Per position, whether some rank's ``flags`` is set: an all-reduce over [Note: the host
        group] (the host reads it without waiting for the compute device)."""
        if not self.active:
            return list(flags)
        mine = mark_host(torch.tensor(flags, dtype=torch.int32))
        if self.trace is not None:
            self.trace.append(("host_any", label))
        with record_function(f"hf_zero::host_any::{label}"), self._reporting("all-reduce on the host", label):
            dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self.host_group)
        return [bool(v) for v in mine.tolist()]

    def _host_buffer(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's and every rank's int64 buffers for an exchange of ``count`` values, made
        once and registered as host memory ([Note: host-device transfers])."""
        found = self._host_buffers.get(count)
        if found is None:
            mine = mark_host(torch.zeros(count, dtype=torch.int64))
            everyone = mark_host(torch.zeros(self.global_world_size * count, dtype=torch.int64))
            found = self._host_buffers[count] = (mine, everyone)
        return found

    def all_gather_objects(self, obj: object) -> list[object]:
        """Small Python objects (RNG states, sizes) from every rank; not counted as model traffic."""
        if not self.active:
            return [obj]
        out: list[object] = [None] * self.global_world_size
        with self._reporting("all-gather of objects", type(obj).__name__):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.active:
            with self._reporting("barrier", "barrier"):
                dist.barrier(group=self.group)
