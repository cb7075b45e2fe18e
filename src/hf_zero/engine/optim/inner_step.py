"""The ``apply`` stage of [Note: the step pipeline]: the inner step, one kind per optimizer.

Which kind runs is decided once, when the optimizer is built (``ZeroOptimizer``):

- :class:`FlatAdamInnerStep`: hf_zero's fused Adam over each flat fp32 master shard, writing the
  16-bit compute copy in the same pass where it can;
- :class:`TorchInnerStep`: any element-wise torch optimizer rebuilt over the flat shards, which
  steps whole tensors (the unused parameters' elements are put back after it);
- :class:`WholeParamInnerStep`: a shape-aware optimizer, each parameter stepped whole by its
  owner ([Note: whole-parameter step]);
- :class:`NvmeInnerStep`: Adam over state held in files, tile by tile ([Note: NVMe optimizer
  offload]).

Each steps every group some rank used (``apply``), with the loss scale divided out and the clip
coefficient applied, and leaves the stepped groups' compute shards holding the new values. The
fused Adam and NVMe kinds also step one group alone, unscaled (``apply_group``): what the
[Note: overlapped offload step] runs on its worker.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.host_memory import hand_back_free_heap_pages
from hf_zero.engine.sharding.param_usage import unused_ranges

if TYPE_CHECKING:  # annotations only (optimizer imports this module)
    from hf_zero.engine.optim.optimizer import ZeroAdam
    from hf_zero.engine.optim.whole_param_step import WholeParamStep
    from hf_zero.offload import NvmeOptimizerStore


class InnerStep:
    """The inner step over ``inner``, the optimizer whose ``param_groups`` and ``state`` the
    ``ZeroOptimizer`` shows."""

    # Steps whole tensors, so the elements of parameters no rank used are put back after it.
    puts_back_unused = False
    # Takes the loss scale, the clip coefficient and the skip flag as device [Note: step factors]
    # (apply_on_device): [Note: a step the host does not wait for] in step_pipeline.py.
    skips_on_device = False

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.stepped = False  # whether apply ran once ([Note: memory kept for the run])

    def apply(self, groups: list[FlatParamGroup], used: list[list[bool]], scale: float, clip_coef: float) -> None:
        """Step the parameters some rank used (``used``: per group, per parameter) with the
        gradients divided by ``scale`` and multiplied by ``clip_coef``."""
        with _skipping_unused(groups, used, self.inner, put_back_partial=self.puts_back_unused):
            self._step(groups, scale, clip_coef)
        self._after_first_step()

    def _after_first_step(self) -> None:
        if not self.stepped:  # once, after the first step: [Note: memory kept for the run]
            hand_back_free_heap_pages()
        self.stepped = True

    def _step(self, groups: list[FlatParamGroup], scale: float, clip_coef: float) -> None:
        raise NotImplementedError

    def apply_on_device(self, groups: list[FlatParamGroup], used: list[list[bool]],
                        factors: torch.Tensor) -> Callable[[], None]:
        """As :meth:`apply`, with the scale, the coefficient and the skip flag in device
        ``factors``; returns what puts the host's records of the step back if it was skipped."""
        raise NotImplementedError(f"{type(self).__name__} reads the step factors on the host")

    def apply_group(self, group: FlatParamGroup) -> None:
        """The step of one group without loss scale or clipping (the overlapped offload step)."""
        raise NotImplementedError(
            f"{type(self).__name__}: the overlapped offload step needs hf_zero's Adam/AdamW or NVMe "
            "offload, which step one group at a time (see hf_zero.engine.optim.overlap_step.can_overlap)")

    def hyper_of(self, group: FlatParamGroup) -> dict[str, Any]:
        """The param group (hyperparameters) ``group``'s master steps in."""
        return next(h for h in self.inner.param_groups if any(p is group.master_state.tensor for p in h["params"]))

    def refresh_compute_copies(self, groups: list[FlatParamGroup]) -> None:
        for group in groups:
            if group.used_in_step:  # an unused group's master did not change
                self.refresh_compute_copy(group)

    def refresh_compute_copy(self, group: FlatParamGroup) -> None:
        """Write the updated master into the compute shard, unless the kernel already did (its
        ``out``) or the master is the compute shard."""
        master = group.master_state.tensor
        written = getattr(self.inner, "compute_copy", {})
        if master is not None and id(master) not in written and master.data_ptr() != group.storage.shard.data_ptr():
            group.storage.write_shard(master)


class FlatAdamInnerStep(InnerStep):
    """hf_zero's fused Adam/AdamW, one kernel call per run of each shard."""

    inner: ZeroAdam

    def __init__(self, inner: torch.optim.Optimizer, groups: list[FlatParamGroup]) -> None:
        super().__init__(inner)
        # Masters on the compute device: the kernels take the step factors there. A master on
        # the host (offload_optimizer) is stepped by the host, which reads them anyway.
        self.skips_on_device = all(not g.offload.optimizer_on_host for g in groups)

    def _step(self, groups: list[FlatParamGroup], scale: float, clip_coef: float) -> None:
        self.inner.step(grad_scale=scale, clip_coef=clip_coef)
        self.refresh_compute_copies(groups)

    def apply_on_device(self, groups: list[FlatParamGroup], used: list[list[bool]],
                        factors: torch.Tensor) -> Callable[[], None]:
        with _skipping_unused(groups, used, self.inner, put_back_partial=False):
            counts = self.inner.step(factors=factors)
            self.refresh_compute_copies(groups)
        self._after_first_step()
        return lambda: self.inner.put_back_counts(counts)

    def apply_group(self, group: FlatParamGroup) -> None:
        self.inner.step_master(group.master_state.tensor, self.hyper_of(group))
        self.refresh_compute_copy(group)


class TorchInnerStep(InnerStep):
    """A torch optimizer over the flat shards: the gradients are scaled in place first."""

    puts_back_unused = True

    def _step(self, groups: list[FlatParamGroup], scale: float, clip_coef: float) -> None:
        factor = clip_coef / scale
        if factor != 1.0:
            for group in groups:
                if group.grads.shard is not None:
                    group.grads.shard.mul_(factor)
        self.inner.step()
        self.refresh_compute_copies(groups)


class WholeParamInnerStep(InnerStep):
    """A shape-aware optimizer: see [Note: whole-parameter step]."""

    def __init__(self, inner: torch.optim.Optimizer, whole_params: WholeParamStep) -> None:
        super().__init__(inner)
        self.whole_params = whole_params

    def _step(self, groups: list[FlatParamGroup], scale: float, clip_coef: float) -> None:
        self.whole_params.step(clip_coef / scale)
        self.refresh_compute_copies(groups)


class NvmeInnerStep(InnerStep):
    """Adam over the NVMe store; each tile's new values go to the compute shard as it is written."""

    def __init__(self, inner: torch.optim.Optimizer, nvme: NvmeOptimizerStore) -> None:
        super().__init__(inner)
        self.nvme = nvme

    def _step(self, groups: list[FlatParamGroup], scale: float, clip_coef: float) -> None:
        for group in groups:
            if group.grads.shard is None or group.master_state.nvme_index is None or not group.used_in_step:
                continue
            self._step_group(group, scale, clip_coef)

    def apply_group(self, group: FlatParamGroup) -> None:
        self._step_group(group, 1.0, 1.0)

    def _step_group(self, group: FlatParamGroup, scale: float, clip_coef: float) -> None:
        self.nvme.step(group.master_state.nvme_index, group.grads.shard, group.storage.write_shard,
                       self.hyper_of(group), grad_scale=scale, clip_coef=clip_coef,
                       usage=(group.segments, group.params_used))


@contextlib.contextmanager
def _skipping_unused(groups: list[FlatParamGroup], used: list[list[bool]], inner: torch.optim.Optimizer,
                     put_back_partial: bool) -> Iterator[None]:
    """Inside the block, each group's ``params_used`` is this step's and the masters of groups
    no rank used have ``grad`` None, so any torch optimizer skips them. With ``put_back_partial``
    (an optimizer that steps whole tensors), the elements of unused parameters in a group that is
    stepped, and their element-wise state, are put back afterwards ([Note: parameters no rank
    used] in hf_zero.engine.sharding.param_usage)."""
    hidden, kept = [], []
    for group, group_used in zip(groups, used):
        group.params_used = group_used
        master = group.master_state.tensor
        if master is None:
            continue
        if not any(group_used) and master.grad is not None:
            hidden.append((master, master.grad))
            master.grad = None
        elif put_back_partial and not all(group_used):
            kept.append((group, _unused_elements(group, inner)))
    try:
        yield
    finally:
        for master, grad in hidden:
            master.grad = grad
        for group, saved in kept:
            _put_back(group, inner, saved)


def _unused_elements(group: FlatParamGroup, inner: torch.optim.Optimizer) -> list[tuple[str, int, torch.Tensor]]:
    """Copies of the unused parameters' elements of the master and of its element-wise state."""
    master = group.master_state.tensor
    tensors = {"": master, **{k: v for k, v in inner.state.get(master, {}).items()
                              if isinstance(v, torch.Tensor) and v.shape == master.shape}}
    return [(key, lo, tensor[lo:hi].clone()) for key, tensor in tensors.items()
            for lo, hi in unused_ranges(group.segments, group.params_used)]


def _put_back(group: FlatParamGroup, inner: torch.optim.Optimizer, saved: list[tuple[str, int, torch.Tensor]]) -> None:
    master = group.master_state.tensor
    state = inner.state.get(master, {})
    with torch.no_grad():
        for key, lo, values in saved:
            tensor = master if key == "" else state[key]
            tensor[lo:lo + values.numel()].copy_(values)
        for key, tensor in state.items():  # state the step created: an unused element's stays zero
            if isinstance(tensor, torch.Tensor) and tensor.shape == master.shape and not any(k == key for k, _, _ in saved):
                for lo, hi in unused_ranges(group.segments, group.params_used):
                    tensor[lo:hi].zero_()
