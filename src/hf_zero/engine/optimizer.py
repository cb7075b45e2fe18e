"""The optimizer over this rank's flat fp32 master shards.

:class:`ZeroAdam` is the config's Adam/AdamW: one fused pass per shard (unscale, clip, weight
decay, moments, update, and the write of the 16-bit compute copy; see hf_zero.kernels).
:class:`ZeroOptimizer` wraps it, or any torch optimizer rebuilt over the shards, and runs the
step the way DeepSpeed's ZeRO optimizer does: fp16 overflow check and skip, global-norm clipping
over all shards of all ranks, the inner step, then the all-gather of updated parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch

from hf_zero.comm import Communicator
from hf_zero.engine.buckets import all_gather_updated
from hf_zero.engine.flat_group import FlatParamGroup
from hf_zero.engine.param_usage import Segment, advanced_steps, step_runs, unused_ranges
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.transfer import assert_not_host, is_host_store, mark_host, to_compute

if TYPE_CHECKING:  # annotations only (overlap_step imports this module at run time)
    from hf_zero.engine.loss_scaler import LossScaler
    from hf_zero.engine.overlap_step import OverlappedOffloadStep
    from hf_zero.engine.whole_param_step import WholeParamStep
    from hf_zero.offload import NvmeOptimizerStore

logger = logging.getLogger("hf_zero")

# torch.nn.utils.clip_grad_norm_ uses the same epsilon; matching it keeps parity exact.
CLIP_EPS = 1e-6


class ZeroAdam(torch.optim.Optimizer):
    """Adam / AdamW over flat fp32 shards, one fused kernel call per shard.

    ``decoupled_weight_decay=True`` is AdamW (DeepSpeed's default for both "Adam" and "AdamW",
    its ``adam_w_mode``); False is Adam with L2 regularisation added to the gradient.
    """

    hf_zero_elementwise = True  # see [Note: element-wise optimizers] in hf_zero.engine.optimizer_kinds
    per_slot_steps = True  # state["slot_steps"]: one step count per parameter ([Note: parameters no rank used])

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)
        self.compute_copy: dict[int, torch.Tensor] = {}  # id(master) -> 16-bit shard to refresh
        # id(master) -> its FlatParamGroup, whose ``segments`` and ``params_used`` say what a step
        # updates (set by ZeroOptimizer; a master without one steps whole): [Note: parameters
        # no rank used]
        self.usage: dict[int, FlatParamGroup] = {}

    @torch.no_grad()
    def step(self, closure: Callable | None = None, grad_scale: float = 1.0, clip_coef: float = 1.0):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for master in group["params"]:
                if master.grad is not None:
                    self.step_master(master, group, grad_scale, clip_coef)
        return loss

    @torch.no_grad()
    def step_master(self, master: torch.Tensor, group: dict[str, Any], grad_scale: float = 1.0,
                    clip_coef: float = 1.0) -> None:
        """One fused Adam step of one flat master shard with its param group's hyperparameters."""
        from hf_zero.kernels import fused_adam_

        state = self.state[master]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        owner = self.usage.get(id(master))
        segments, used = (owner.segments, owner.params_used) if owner else ([Segment(0, 0, master.numel())], [True])
        # A checkpoint from before per-parameter counts: every parameter at the shard's count.
        slot_steps = state.get("slot_steps") or [int(state["step"])] * len(used)
        state["slot_steps"] = advanced_steps(slot_steps, used)
        state["step"] += 1  # the steps this master took at all (what torch's state_dict shows)
        beta1, beta2 = group["betas"]
        out = self.compute_copy.get(id(master))
        for run in step_runs(segments, used, state["slot_steps"]):
            part = slice(run.lo, run.hi)
            fused_adam_(
                master[part], master.grad[part], state["exp_avg"][part], state["exp_avg_sq"][part],
                lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=run.step,
                adamw=group["decoupled_weight_decay"], grad_scale=grad_scale,
                clip_coef=clip_coef, out=None if out is None else out[part],
            )


class ZeroOptimizer(torch.optim.Optimizer):
    """What ``hf_zero.initialize`` returns as the optimizer: the sharded step.

    ``param_groups`` and ``state`` are the inner optimizer's, so torch LR schedulers (the
    Trainer's included) and checkpoints see the real hyperparameters. Call ``engine.step()``
    in a training loop; this object's :meth:`step` is what it runs at the accumulation boundary.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        groups: list[FlatParamGroup],
        comm: Communicator,
        gradient_clipping: float,
        policy: ShardingPolicy,
        allgather_bucket_numel: int = 0,
        *,
        loss_scaler: LossScaler | None = None,
        skip_nonfinite: bool = False,
        nvme: NvmeOptimizerStore | None = None,
        whole_params: WholeParamStep | None = None,
        overlapped: Callable[[ZeroOptimizer], OverlappedOffloadStep] | None = None,
    ) -> None:
        """``loss_scaler``: fp16's (None otherwise). ``skip_nonfinite``: skip a step with inf/nan
        gradients instead of raising ([Note: non-finite steps]). ``nvme``: the store holding the
        optimizer state when offload_optimizer.device is nvme. ``whole_params``: the step of a
        shape-aware optimizer ([Note: whole-parameter step]), whose optimizer is ``inner``.
        ``overlapped``: builds the [Note: overlapped offload step] of this optimizer."""
        # Deliberately not Optimizer.__init__: the param groups are the inner optimizer's, shared.
        self.inner = inner
        self.defaults = inner.defaults
        self.groups = [g for g in groups if g.kind.trainable]
        self.comm = comm
        self.gradient_clipping = gradient_clipping
        self.policy = policy  # [Note: sharding policy]
        self.allgather_bucket_numel = allgather_bucket_numel  # see [Note: buckets]
        self.loss_scaler = loss_scaler
        # [Note: non-finite steps] below: skip (bf16.check_grad_overflow) or raise
        self.skip_nonfinite = skip_nonfinite
        self.nonfinite_skipped_steps = 0
        self.overflow = False
        self.global_grad_norm: float | None = None
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._zero_grad_profile_name = "Optimizer.zero_grad#ZeroOptimizer.zero_grad"
        self.nvme = nvme
        self.whole_params = whole_params  # see [Note: whole-parameter step]
        if isinstance(inner, ZeroAdam):
            for g in self.groups:
                if g.master is not None:
                    inner.usage[id(g.master)] = g
                # The kernel writes the compute copy in the same pass, unless the master is on the
                # host (offloaded) or the shard in a file: then it is written after the step.
                separate = g.master is not None and g.master.data_ptr() != g.shard.data_ptr()
                if separate and not g.offload.optimizer_on_host and g.nvme_shard is None and not g.shard_on_host:
                    inner.compute_copy[id(g.master)] = g.shard
        # The overlapped step and this optimizer use each other (it steps this optimizer's groups,
        # this step finishes it): a cycle, broken by building it here, last, from the factory
        # given, over this finished optimizer.
        self.overlapped: OverlappedOffloadStep | None = overlapped(self) if overlapped is not None else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.policy.preset_stage}, inner={type(self.inner).__name__})"

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    # ------------------------------------------------------------------ the step
    def _grad_shards(self) -> list[torch.Tensor]:
        return [g.grad_shard for g in self.groups if g.grad_shard is not None]

    @property
    def device(self) -> torch.device:
        """The compute device: where collectives take their tensors."""
        return self.groups[0].full.device if self.groups else torch.device("cpu")

    def _local_norm_terms(self) -> torch.Tensor:
        """[squared norm, non-finite flag] of this rank's gradient shards, on the compute device.
        Shards on the host (offload_optimizer) are summed on the host and only the two numbers
        move (see [Note: host-device transfers])."""
        from hf_zero.kernels import nonfinite_and_sqnorm

        terms = torch.zeros(2, dtype=torch.float32, device=self.device)
        shards = self._grad_shards()
        for host in (False, True):
            group_shards = [s for s in shards if is_host_store(s) == host]
            if group_shards:
                found, sqnorm = nonfinite_and_sqnorm(group_shards)
                part = torch.stack([sqnorm.float(), found.float()])
                terms += to_compute(mark_host(part), self.device) if host else part
        return terms

    def _all_ranks_norm(self, local: torch.Tensor) -> tuple[float, bool, list[list[bool]]]:
        """This rank's [squared norm, non-finite flag] summed over ranks, and, per group, which
        parameters got a gradient on some rank: one all-reduce for all three ([Note: parameters
        no rank used] in hf_zero.engine.param_usage; torch's norm skips a None gradient, and an
        unused parameter's gradient here is zeros, so the norm is the same)."""
        assert_not_host(local, "the grad-norm all-reduce")  # packed below: the check must see it here
        flags = [float(received) for g in self.groups for received in g.grads_received]
        packed = torch.cat([local, torch.tensor(flags, dtype=torch.float32, device=self.device)])
        if not self.policy.shards_optimizer_state and self.comm.rank != 0:
            packed[:2] = 0  # all-reduced gradients are identical on every rank: count them once
        elif self.comm.replica_index != 0:
            # Every shard group holds the same reduced shards ([Note: hybrid sharding]): the norm
            # is the first group's; the flags go over every rank, since a parameter that only
            # another shard group's ranks used has a gradient here too and must step everywhere.
            packed[:2] = 0
        self.comm.all_reduce_(packed, label="grad_norm", over_all_ranks=True)
        used_flat = (packed[2:] > 0).tolist()
        used, start = [], 0
        for group in self.groups:
            used.append(used_flat[start:start + len(group.params)])
            start += len(group.params)
        return float(packed[0]), bool(packed[1] > 0), used

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.groups:
            group.zero_grad_shard()

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        self._opt_called = True  # what torch LR schedulers check to see the step happened first
        if self.overlapped is None:  # the overlapped step lands each group on its worker
            for group in self.groups:
                group.land_host_grads()  # [Note: gradients copied to the host]
        if self.overlapped is not None:
            # Whether this rank's worker got any group depends on its own path; the step's
            # collectives must not: every rank with the overlapped step configured finishes it
            # the same way (two all-reduces), stepping here what the worker did not get.
            self._finish_overlapped_step()
            return
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        sqnorm, nonfinite, used = self._all_ranks_norm(self._local_norm_terms())
        self.overflow = nonfinite
        if nonfinite:
            self.global_grad_norm = math.inf
            self.zero_grad()
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
                return
            self._nonfinite_step()
            return
        self.global_grad_norm = norm = math.sqrt(sqnorm) / scale
        clip_coef = 1.0
        if self.gradient_clipping > 0:
            clip_coef = min(1.0, self.gradient_clipping / (norm + CLIP_EPS))
        whole_tensors = self.nvme is None and self.whole_params is None and not isinstance(self.inner, ZeroAdam)
        with _skipping_unused(self.groups, used, self.inner, put_back_partial=whole_tensors):
            self._inner_step(scale, clip_coef)
        all_gather_updated(self.groups, self.comm, self.allgather_bucket_numel)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()

    # A torch scheduler re-pointed at this optimizer (see initialize) reads this marker, which
    # its constructor would have set by wrapping ``step``; our step is the tracked one.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def _inner_step(self, scale: float, clip_coef: float) -> None:
        if self.nvme is not None:
            self._nvme_step(scale, clip_coef)
            return
        if self.whole_params is not None:  # shape-aware: see [Note: whole-parameter step]
            self.whole_params.step(clip_coef / scale)
        elif isinstance(self.inner, ZeroAdam):
            self.inner.step(grad_scale=scale, clip_coef=clip_coef)
        else:
            factor = clip_coef / scale
            if factor != 1.0:
                for shard in self._grad_shards():
                    shard.mul_(factor)
            self.inner.step()
        for group in self.groups:
            if group.used_in_step:  # an unused group's master did not change
                self._refresh_compute_copy(group)

    def _refresh_compute_copy(self, group: FlatParamGroup) -> None:
        """Write the updated master into the compute shard, unless the kernel already did (its
        ``out``) or the master is the compute shard."""
        master = group.master
        written = getattr(self.inner, "compute_copy", {})
        if master is not None and id(master) not in written and master.data_ptr() != group.shard.data_ptr():
            group.write_compute_shard(master)

    def _hyper_of(self, group: FlatParamGroup) -> dict[str, Any]:
        """The param group (hyperparameters) ``group``'s master steps in."""
        return next(h for h in self.param_groups if any(p is group.master for p in h["params"]))

    def step_group_unscaled(self, group: FlatParamGroup) -> None:
        """The step of one group without loss scale or clipping (the overlapped offload step)."""
        if self.nvme is not None:
            self.nvme.step(group.nvme_index, group.grad_shard, group.write_compute_shard, self._hyper_of(group),
                           grad_scale=1.0, clip_coef=1.0, usage=(group.segments, group.params_used))
            return
        self.inner.step_master(group.master, self._hyper_of(group))
        self._refresh_compute_copy(group)

    def _finish_overlapped_step(self) -> None:
        """See [Note: overlapped offload step]: wait for the worker, step what it did not get,
        then report the norm and all-gather as the plain step does."""
        results = self.overlapped.wait()
        # Groups this rank did not use in full were held back ([Note: parameters no rank used]):
        # step those some rank used, each parameter as the ranks used it.
        _, _, used = self._all_ranks_norm(torch.zeros(2, dtype=torch.float32, device=self.device))
        for group, group_used in zip(self.groups, used):
            if id(group) in results:  # stepped on the worker: this rank used every parameter
                continue
            group.params_used = group_used
            if group.grad_shard is not None and any(group_used):
                results[id(group)] = self.overlapped.step_group(group)
        sqnorm = sum(sq for sq, _ in results.values())
        nonfinite = any(found for _, found in results.values())
        local = torch.tensor([sqnorm, float(nonfinite)], dtype=torch.float32, device=self.device)
        sqnorm, self.overflow, _ = self._all_ranks_norm(local)
        self.global_grad_norm = math.inf if self.overflow else math.sqrt(sqnorm)
        if self.overflow:  # some group on some rank: undo every group stepped, on every rank
            self.overlapped.roll_back()
            self.zero_grad()
            self._nonfinite_step()
            return
        self.overlapped.commit()
        all_gather_updated(self.groups, self.comm, self.allgather_bucket_numel)
        self.zero_grad()

    def _nonfinite_step(self) -> None:
        """A step whose gradients hold inf/nan on some rank, in fp32/bf16 (no loss scaler).

        [Note: non-finite steps]
        By the time this runs the step's gradients are dropped and nothing else changed on any
        rank: parameters, masters, moments and step counts are as before the step (the
        overlapped offload step restored the groups it had stepped: see [Note: overlapped
        offload step]), and the engine does not step the scheduler. Every rank reaches this
        together (the non-finite flag is all-reduced). Then, as configured: skip the step and
        count it (``bf16.check_grad_overflow``, DeepSpeed's key), or raise FloatingPointError.
        Either way the next step trains normally, without a ``zero_grad()``."""
        if self.skip_nonfinite:
            self.nonfinite_skipped_steps += 1
            logger.warning("hf_zero: step skipped: non-finite gradients (inf or nan); %d skipped so far",
                           self.nonfinite_skipped_steps)
            return
        raise FloatingPointError(_nonfinite_message(self.gradient_clipping))

    def _nvme_step(self, scale: float, clip_coef: float) -> None:
        for group in self.groups:
            if group.grad_shard is None or group.nvme_index is None or not group.used_in_step:
                continue
            self.nvme.step(group.nvme_index, group.grad_shard, group.write_compute_shard, self._hyper_of(group),
                           grad_scale=scale, clip_coef=clip_coef, usage=(group.segments, group.params_used))


@contextlib.contextmanager
def _skipping_unused(groups: list[FlatParamGroup], used: list[list[bool]], inner: torch.optim.Optimizer,
                     put_back_partial: bool) -> Iterator[None]:
    """Inside the block, each group's ``params_used`` is this step's and the masters of groups
    no rank used have ``grad`` None, so any torch optimizer skips them. With ``put_back_partial``
    (an optimizer that steps whole tensors), the elements of unused parameters in a group that is
    stepped, and their element-wise state, are put back afterwards ([Note: parameters no rank
    used] in hf_zero.engine.param_usage)."""
    hidden, kept = [], []
    for group, group_used in zip(groups, used):
        group.params_used = group_used
        master = group.master
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
    master = group.master
    tensors = {"": master, **{k: v for k, v in inner.state.get(master, {}).items()
                              if isinstance(v, torch.Tensor) and v.shape == master.shape}}
    return [(key, lo, tensor[lo:hi].clone()) for key, tensor in tensors.items()
            for lo, hi in unused_ranges(group.segments, group.params_used)]


def _put_back(group: FlatParamGroup, inner: torch.optim.Optimizer, saved: list[tuple[str, int, torch.Tensor]]) -> None:
    master = group.master
    state = inner.state.get(master, {})
    with torch.no_grad():
        for key, lo, values in saved:
            tensor = master if key == "" else state[key]
            tensor[lo:lo + values.numel()].copy_(values)
        for key, tensor in state.items():  # state the step created: an unused element's stays zero
            if isinstance(tensor, torch.Tensor) and tensor.shape == master.shape and not any(k == key for k, _, _ in saved):
                for lo, hi in unused_ranges(group.segments, group.params_used):
                    tensor[lo:hi].zero_()


def _nonfinite_message(gradient_clipping: float) -> str:
    clipping = (f"gradient_clipping ({gradient_clipping:g}) cannot help: it scales finite gradients, and an "
                "inf/nan norm has no finite scale" if gradient_clipping > 0
                else "gradient_clipping cannot fix inf/nan either")
    return (
        "non-finite gradients (inf or nan) on some rank; the step was dropped: parameters, optimizer state "
        "and scheduler are unchanged on every rank, and the next step trains normally (catch this error "
        "to go on, or set bf16.check_grad_overflow: true to skip such steps under bf16). "
        f"Look for an inf/nan loss, bad data or too high a learning rate; {clipping}"
    )
