"""Count the bytes every engine sends through ``torch.distributed``, the same way for all.

[Note: logical collective size]
Each collective is counted at the size of the *full logical tensor* it produces or consumes, the
unit hf_zero's ``engine.comm_stats()`` uses and the ZeRO paper's 2Ψ / 3Ψ volumes are written in:

- all-gather: the gathered output (world_size x the local shard);
- reduce-scatter: the full input being reduced;
- all-reduce, broadcast, reduce: the tensor;
- all-to-all: the input; gather / scatter: world_size x the local tensor;
- a point-to-point send (``send`` / ``isend``): the tensor sent. hf_zero's reduce-scatter and
  all-gather on gloo are such exchanges ([Note: reduce-scatter on gloo], [Note: all-gather on
  gloo]): the wrapper sees (N-1)/N of the logical size its engine counter reports, in N-1 sends.

This is neither the input size (a 2-rank all-gather's input is half its output) nor wire
traffic: a ring all-reduce moves about twice what a reduce-scatter of the same tensor does, and
counts once here. ``ring_equivalent_bytes`` counts an all-reduce twice (reduce-scatter +
all-gather) for readers who want that view.

[Note: where the wrapper sits]
The wrapper replaces the module attributes of ``torch.distributed``, ``torch.distributed.
distributed_c10d`` and ``torch.distributed._functional_collectives`` (DTensor's collectives, used
by FSDP2's gradient clipping). It must be installed before any engine is imported: DeepSpeed
caches ``torch.distributed.all_gather_into_tensor`` when its backend is built. torch 2.13 made
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` aliases of ``all_gather_single`` /
``reduce_scatter_single``; a per-thread depth guard counts only the outermost call, so an alias
and its target never both count. What it cannot see: collectives issued from C++ (DDP's built-in
gradient all-reduce, so the DDP runner registers DDP's reference Python all-reduce hook;
``barrier``, which moves no model data). ``unwrapped_refs`` lists module attributes still bound
to an original function after the engines are imported: a non-empty list means a blind spot.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

_C10D_NAMES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all",
    "all_to_all_single", "gather", "scatter", "all_reduce_coalesced", "all_gather_coalesced",
    "_all_gather_base", "_reduce_scatter_base", "send", "isend",
)
_FUNCOL_NAMES = (
    "broadcast", "all_reduce", "all_gather_single", "all_gather_single_autograd", "all_gather_tensor",
    "all_gather_tensor_autograd", "reduce_scatter_single", "reduce_scatter_single_autograd",
    "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "all_reduce_coalesced",
    "all_gather_single_coalesced", "reduce_scatter_single_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd",
)

# Which argument holds the logical tensor(s), and by how many ranks it is multiplied.
# (argument name, multiply by the group size?)
_C10D_RULES: dict[str, tuple[str, bool]] = {
    "all_reduce": ("tensor", False), "broadcast": ("tensor", False), "reduce": ("tensor", False),
    "all_gather": ("tensor_list", False), "all_gather_into_tensor": ("output_tensor", False),
    "all_gather_single": ("output_tensor", False), "_all_gather_base": ("output_tensor", False),
    "all_gather_coalesced": ("output_tensor_lists", False),
    "reduce_scatter": ("input_list", False), "reduce_scatter_tensor": ("input", False),
    "reduce_scatter_single": ("input", False), "_reduce_scatter_base": ("input", False),
    "all_to_all": ("input_tensor_list", False), "all_to_all_single": ("input", False),
    "gather": ("tensor", True), "scatter": ("tensor", True), "all_reduce_coalesced": ("tensors", False),
    "send": ("tensor", False), "isend": ("tensor", False),
}


def kind_of(op: str) -> str:
    """all_gather / reduce_scatter / all_reduce / ... : the by-kind breakdown's key."""
    name = op.removeprefix("funcol.").lstrip("_")
    if name in ("send", "isend"):
        return "send"
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce", "gather", "scatter"):
        if name.startswith(kind):
            return kind
    return "other"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> tuple[int, int]:
    numel = sum(t.numel() for t in tensors)
    return numel, sum(t.numel() * t.element_size() for t in tensors)


def _funcol_group_size(group: Any, tag: str) -> int:
    try:
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        return int(c10d._get_group_size_by_name(funcol._resolve_group(group, tag)))
    except Exception:  # an unusual group spec: every group in this benchmark is the world
        return dist.get_world_size()


class CommCounter:
    """Calls, elements and bytes per collective name, since the last ``reset``."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self.originals: dict[int, str] = {}
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.by_op: dict[str, dict[str, int]] = defaultdict(lambda: {"calls": 0, "numel": 0, "bytes": 0})

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {op: dict(v) for op, v in sorted(self.by_op.items())}

    def _add(self, op: str, numel: int, nbytes: int) -> None:
        with self._lock:
            entry = self.by_op[op]
            entry["calls"] += 1
            entry["numel"] += numel
            entry["bytes"] += nbytes

    def _wrap(self, op: str, original: Callable, size_of: Callable[[inspect.BoundArguments], tuple[int, int]]
              ) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                try:
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    self._add(op, *size_of(bound))
                except TypeError:  # a bad call: let the original raise its own error
                    pass
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted.__hf_zero_bench_counted__ = True  # type: ignore[attr-defined]
        return counted

    def _c10d_size(self, name: str) -> Callable[[inspect.BoundArguments], tuple[int, int]]:
        arg, times_world = _C10D_RULES[name]

        def size_of(bound: inspect.BoundArguments) -> tuple[int, int]:
            numel, nbytes = _nbytes(_tensors(bound.arguments.get(arg)))
            if times_world:
                world = dist.get_world_size(bound.arguments.get("group"))
                numel, nbytes = numel * world, nbytes * world
            return numel, nbytes

        return size_of

    @staticmethod
    def _funcol_size(name: str) -> Callable[[inspect.BoundArguments], tuple[int, int]]:
        gathers = name.startswith("all_gather")

        def size_of(bound: inspect.BoundArguments) -> tuple[int, int]:
            args = bound.arguments
            numel, nbytes = _nbytes(_tensors(args.get("self", args.get("inputs"))))
            if gathers:
                world = _funcol_group_size(args.get("group"), args.get("tag", ""))
                numel, nbytes = numel * world, nbytes * world
            return numel, nbytes

        return size_of

    def install(self) -> None:
        """Wrap every collective (see [Note: where the wrapper sits]); idempotent."""
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        for name in _C10D_NAMES:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None or getattr(original, "__hf_zero_bench_counted__", False):
                continue
            self.originals[id(original)] = name
            wrapped = self._wrap(name, original, self._c10d_size(name))
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    setattr(module, name, wrapped)
        for name in _FUNCOL_NAMES:
            original = getattr(funcol, name, None)
            if original is None or getattr(original, "__hf_zero_bench_counted__", False):
                continue
            self.originals[id(original)] = f"funcol.{name}"
            setattr(funcol, name, self._wrap(f"funcol.{name}", original, self._funcol_size(name)))

    def unwrapped_refs(self) -> list[str]:
        """``module.attr`` names still bound to an original collective: traffic we would miss.

        funcol's ``legacy_*`` names are left out: they are keys of dynamo's remapping table,
        imported under those names for traced code only, and never called in eager mode."""
        found = []
        for mod_name, module in list(sys.modules.items()):
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for attr, value in items:
                if mod_name == "torch.distributed._functional_collectives" and attr.startswith("legacy_"):
                    continue
                if callable(value) and id(value) in self.originals:
                    found.append(f"{mod_name}.{attr}")
        return sorted(found)


def totals(by_op: dict[str, dict[str, int]]) -> dict[str, int]:
    """Bytes in all, by kind, and the ring-equivalent count (an all-reduce counted twice)."""
    by_kind: dict[str, int] = defaultdict(int)
    for op, entry in by_op.items():
        by_kind[kind_of(op)] += entry["bytes"]
    total = sum(by_kind.values())
    return {"bytes": total, "ring_equivalent_bytes": total + by_kind.get("all_reduce", 0),
            **{f"{kind}_bytes": value for kind, value in sorted(by_kind.items())}}


COUNTER = CommCounter()
