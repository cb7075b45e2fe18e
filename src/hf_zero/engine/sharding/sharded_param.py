"""A clear error for a stage-3 parameter read while it is not gathered.

[Note: parameters read outside their unit]
Under stage 3 a module parameter is a view into its unit's flat buffer, whose storage is freed
outside the unit's forward and backward ([Note: views into flat buffers]). Code that reads such a
parameter outside the engine's protocol (a custom loss reading ``lm_head.weight`` after the
forward, ``model.get_input_embeddings()(ids)`` outside the root, an EMA callback after the step)
would otherwise get torch's "data is not allocated", an out-of-bounds error, or on CPU a crash.

While its unit is sharded, each plain ``nn.Parameter`` of it has its class switched to
:class:`ShardedParameter` (``gather`` switches it back, so the forward and backward run on plain
parameters at no cost). Its ``__torch_function__`` lets metadata through (shape, dtype, device,
``requires_grad``, ``.grad`` and ``.data`` assignments, views) and turns any other operation into
an error that names the parameter and says how to read it: ``engine.gathered_parameters``.

A metadata operation can still hand out a plain tensor over the freed storage (``param.data``,
``param.detach()``, ``param.view(...)``), and torch's CPU kernels read such a tensor's null
storage without a check: ``param.data.sum()`` was a SIGSEGV. Such a result is returned as a
:class:`ShardedView`, which carries the parameter's name and the same guard, so it gets the same
error (``copy.deepcopy(param)`` goes through ``param.data`` and gets it too). Once the unit is
gathered again, a view kept from before reads the values like any tensor.

Before raising, the guard asks the engine to gather the unit: a read inside the model's forward
gets the values ([Note: parameters read without their module] in hooks.py). The error is for
reads anywhere else.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

# Operations that touch no element of a parameter: metadata, attribute get/set, views.
_METADATA_OPS = frozenset({
    "__get__", "__set__", "__delete__", "size", "dim", "numel", "nelement", "element_size",
    "is_floating_point", "is_complex", "is_contiguous", "is_pinned", "requires_grad_", "data_ptr",
    "untyped_storage", "storage_offset", "stride", "__hash__", "detach", "detach_", "view",
    "view_as", "_is_view", "__len__", "to", "__format__", "__reduce_ex__", "__deepcopy__",
    "register_hook", "register_post_accumulate_grad_hook", "__setstate__", "_typed_storage",
})


class ShardedParameter(nn.Parameter):
    """The class of a stage-3 parameter while its unit is not gathered (see the note above)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _guarded_call(func, args, kwargs)


class ShardedView(torch.Tensor):
    """A tensor over a sharded parameter's freed storage (``param.data`` and other views): the
    same guard as :class:`ShardedParameter`, so reading its values is an error, not a crash."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _guarded_call(func, args, kwargs)


def _guarded_call(func: Any, args: tuple, kwargs: dict | None) -> Any:
    """Run ``func`` unless it needs the values of a freed parameter; wrap a plain view of one."""
    name = getattr(func, "__name__", "")
    if name not in _METADATA_OPS:
        freed = _freed(args, kwargs)
        if freed and _gathered_on_read(freed):
            freed = _freed(args, kwargs)
        if freed:
            raise RuntimeError(
                f"hf_zero: parameter {_names(freed)} is sharded by ZeRO stage 3 and is not gathered "
                f"here ({name or func} needs its values). Outside the engine's forward and backward, "
                "read it inside `with engine.gathered_parameters([param]):` (add modifier_rank=0 to "
                "write it)"
            )
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **(kwargs or {}))
        # Only a plain tensor can be a new view (``.to`` and ``detach_`` give the parameter
        # itself); checked here, where reading its storage runs no __torch_function__.
        if type(result) is torch.Tensor and result.numel() > 0 and result.untyped_storage().nbytes() == 0:
            return _guard_view(result, args, kwargs)
    return result


def _gathered_on_read(freed: list[torch.Tensor]) -> bool:
    """Ask the engine to gather the units of ``freed`` for this read ([Note: parameters read
    without their module] in hooks.py). Returns whether any was gathered."""
    gathered = False
    for tensor in freed:
        gather = getattr(tensor, "_hf_zero_gather_on_read", None)
        gathered = gather is not None and gather() or gathered
    return gathered


def _guard_view(result: torch.Tensor, args: tuple, kwargs: dict | None) -> torch.Tensor:
    """``result`` as a :class:`ShardedView` if it is a view of a sharded parameter's storage."""
    for arg in _flat(args, kwargs):
        if isinstance(arg, (ShardedParameter, ShardedView)) and torch._C._is_alias_of(result, arg):
            view = result.as_subclass(ShardedView)
            view._hf_zero_name = getattr(arg, "_hf_zero_name", "?")
            gather = getattr(arg, "_hf_zero_gather_on_read", None)
            if gather is not None:
                view._hf_zero_gather_on_read = gather
            return view
    return result


def _freed(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    """The arguments whose values are not there: a parameter of a unit that is sharded or whose
    gather is still in flight (its class changes back only when the gather has completed), or
    a view of a freed storage."""
    return [a for a in _flat(args, kwargs)
            if isinstance(a, ShardedParameter) and a.numel() > 0 or isinstance(a, ShardedView) and not _allocated(a)]


def _names(tensors: list[torch.Tensor]) -> str:
    return ", ".join(repr(getattr(t, "_hf_zero_name", "?")) for t in tensors)


def _allocated(param: torch.Tensor) -> bool:
    return param.numel() == 0 or param.untyped_storage().nbytes() > 0


def _flat(args: tuple, kwargs: dict | None) -> Iterable[Any]:
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def mark_sharded(params: Iterable[nn.Parameter]) -> None:
    """Switch plain parameters whose storage is freed to :class:`ShardedParameter`."""
    for param in params:
        if type(param) is nn.Parameter:
            param.__class__ = ShardedParameter


def mark_gathered(params: Iterable[nn.Parameter]) -> None:
    """Switch them back to plain ``nn.Parameter`` (the forward and backward pay nothing)."""
    for param in params:
        if type(param) is ShardedParameter:
            param.__class__ = nn.Parameter
