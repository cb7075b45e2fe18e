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
        if getattr(func, "__name__", "") not in _METADATA_OPS:
            freed = [a for a in _flat(args, kwargs) if isinstance(a, ShardedParameter) and not _allocated(a)]
            if freed:
                names = ", ".join(repr(getattr(p, "_hf_zero_name", "?")) for p in freed)
                raise RuntimeError(
                    f"hf_zero: parameter {names} is sharded by ZeRO stage 3 and is not gathered here "
                    f"({getattr(func, '__name__', func)} needs its values). Outside the engine's forward "
                    "and backward, read it inside `with engine.gathered_parameters([param]):` "
                    "(add modifier_rank=0 to write it)"
                )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


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
