"""The optimizer over this rank's flat fp32 master shards.

:class:`ZeroAdam` is the config's Adam/AdamW: one fused pass per shard (unscale, clip, weight
decay, moments, update, and the write of the 16-bit compute copy; see hf_zero.kernels).
:class:`ZeroOptimizer` wraps it, or any torch optimizer rebuilt over the shards, and runs the
step the way DeepSpeed's ZeRO optimizer does: fp16 overflow check and skip, global-norm clipping
over all shards of all ranks, the inner step, then the all-gather of updated parameters. The
stages of that step are in hf_zero.engine.optim.step_pipeline ([Note: the step pipeline]); the inner
step's kinds in hf_zero.engine.optim.inner_step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from hf_zero.comm import Communicator
from hf_zero.engine.sharding.flat_group import FlatParamGroup
from hf_zero.engine.optim.inner_step import (
    FlatAdamInnerStep,
    InnerStep,
    NvmeInnerStep,
    TorchInnerStep,
    WholeParamInnerStep,
)
from hf_zero.engine.sharding.param_usage import Segment, advanced_steps, step_runs
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.engine.optim.step_pipeline import StepOutcome, StepPipeline
from hf_zero.offload.threads import running_on

if TYPE_CHECKING:  # annotations only (overlap_step imports this module at run time)
    from hf_zero.engine.optim.loss_scaler import LossScaler
    from hf_zero.engine.optim.overlap_step import OverlappedOffloadStep
    from hf_zero.engine.optim.whole_param_step import WholeParamStep
    from hf_zero.offload import NvmeOptimizerStore


class ZeroAdam(torch.optim.Optimizer):
    """Adam / AdamW over flat fp32 shards, one fused kernel call per shard.

    ``decoupled_weight_decay=True`` is AdamW (DeepSpeed's default for both "Adam" and "AdamW",
    its ``adam_w_mode``); False is Adam with L2 regularisation added to the gradient.
    """

    hf_zero_elementwise = True  # see [Note: element-wise optimizers] in hf_zero.engine.optim.optimizer_kinds
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
    def step(self, closure: Callable | None = None, grad_scale: float = 1.0, clip_coef: float = 1.0,
             factors: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        """Step every master with a gradient. With device [Note: step factors] (``factors``)
        instead of the two floats, returns the step counts as they were before, for
        :meth:`put_back_counts` (the step may turn out to have been skipped on the device)."""
        loss = closure() if closure is not None else None
        before: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for group in self.param_groups:
            for master in group["params"]:
                if master.grad is not None:
                    before.append(self.step_master(master, group, grad_scale, clip_coef, factors))
        return before if factors is not None else loss

    def put_back_counts(self, before: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """The step whose counts ``before`` holds changed nothing on the device: its step counts
        go back too (a master's state made by that step goes away)."""
        for master, counts in before:
            state = self.state[master]
            if counts["step"] == 0 and counts["slot_steps"] is None:  # made by that step
                self.state.pop(master, None)
                continue
            state["step"] = counts["step"]
            if counts["slot_steps"] is None:
                state.pop("slot_steps", None)
            else:
                state["slot_steps"] = counts["slot_steps"]

    @torch.no_grad()
    def step_master(self, master: torch.Tensor, group: dict[str, Any], grad_scale: float = 1.0,
                    clip_coef: float = 1.0, factors: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """One fused Adam step of one flat master shard with its param group's hyperparameters;
        returns the master and its step counts before the step."""
        from hf_zero.kernels import fused_adam_

        state = self.state[master]
        if not state:
            state["step"] = 0
            # In the heap, unlike the shards: [Note: memory kept for the run] in hf_zero.host_memory.
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        before = {"step": state["step"], "slot_steps": state.get("slot_steps")}
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
                clip_coef=clip_coef, out=None if out is None else out[part], factors=factors,
            )
        return master, before


class ZeroOptimizer(torch.optim.Optimizer):
    """What ``hf_zero.initialize`` returns as the optimizer: the sharded step.

    ``param_groups`` and ``state`` are the inner optimizer's, so torch LR schedulers (the
    Trainer's included) and checkpoints see the real hyperparameters. Call ``engine.step()``
    in a training loop; this object's :meth:`step` is what it runs at the accumulation boundary:
    [Note: the step pipeline] in hf_zero.engine.optim.step_pipeline.
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
        overlapped: Callable[[StepPipeline], OverlappedOffloadStep] | None = None,
    ) -> None:
        """``loss_scaler``: fp16's (None otherwise). ``skip_nonfinite``: skip a step with inf/nan
        gradients instead of raising ([Note: non-finite steps]). ``nvme``: the store holding the
        optimizer state when offload_optimizer.device is nvme. ``whole_params``: the step of a
        shape-aware optimizer ([Note: whole-parameter step]), whose optimizer is ``inner``.
        ``overlapped``: builds the [Note: overlapped offload step] over this optimizer's pipeline."""
        # Deliberately not Optimizer.__init__: the param groups are the inner optimizer's, shared.
        self.inner = inner
        self.defaults = inner.defaults
        self.groups = [g for g in groups if g.kind.trainable]
        self.comm = comm
        self.policy = policy  # [Note: sharding policy]
        self.loss_scaler = loss_scaler
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
            _bind_flat_adam(inner, self.groups)
        self.pipeline = StepPipeline(
            self.groups, comm, policy, _choose_inner_step(inner, self.groups, nvme, whole_params),
            gradient_clipping=gradient_clipping, allgather_bucket_numel=allgather_bucket_numel,
            loss_scaler=loss_scaler, skip_nonfinite=skip_nonfinite)
        self.overlapped: OverlappedOffloadStep | None = overlapped(self.pipeline) if overlapped is not None else None

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
        self.settle()  # the step counts of a step taken on the device: [Note: a step the host does not wait for]
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.settle()
        self.inner.load_state_dict(state_dict)

    def settle(self) -> None:
        """Read the outcome of a step taken on the device, if one is pending (a wait for the
        device): [Note: a step the host does not wait for] in hf_zero.engine.optim.step_pipeline."""
        self.pipeline.settle()

    @property
    def outcome_pending(self) -> bool:
        """The last step was taken on the device and the host has not read its outcome yet."""
        return self.pipeline.pending is not None

    def on_skipped(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if the pending step turns out to have been skipped."""
        self.pipeline.on_skipped(undo)

    def raise_deferred(self) -> None:
        """Raise the FloatingPointError of an earlier step whose outcome was read since."""
        self.pipeline.raise_deferred()

    def unused_here(self) -> int:
        """How many parameters got no gradient on this rank since the last step (the step's
        check-in carries it: [Note: phases in step])."""
        return self.pipeline.unused_here()

    # ------------------------------------------------------------------ what the last step did
    @property
    def gradient_clipping(self) -> float:
        return self.pipeline.gradient_clipping

    @gradient_clipping.setter
    def gradient_clipping(self, value: float) -> None:  # the Accelerate integration clips one step
        self.pipeline.gradient_clipping = value

    @property
    def overflow(self) -> bool:
        """The last step was dropped (fp16 overflow, or inf/nan: [Note: non-finite steps])."""
        return self.pipeline.outcome not in (None, StepOutcome.STEPPED)

    @property
    def skipped(self) -> bool:
        """The last step was skipped and training goes on without it: an fp16 overflow, or
        inf/nan gradients under ``bf16.check_grad_overflow``. Under the raise policy of [Note:
        non-finite steps] a dropped step is reported by its ``FloatingPointError``, not as a
        skip, so the answer is known without reading the step's outcome off the device."""
        if self.pipeline.loss_scaler is None and not self.pipeline.skip_nonfinite:
            return False
        return self.overflow

    @property
    def global_grad_norm(self) -> float | None:
        """The last step's gradient norm over all ranks, unscaled (inf for a dropped step)."""
        return self.pipeline.grad_norm

    def global_grad_norm_tensor(self) -> torch.Tensor | None:
        """:attr:`global_grad_norm` as a 0-d tensor, without waiting for the device to read it
        when the last step's outcome is still pending."""
        return self.pipeline.grad_norm_tensor()

    @property
    def nonfinite_skipped_steps(self) -> int:
        return self.pipeline.nonfinite_skipped_steps

    @property
    def device(self) -> torch.device:
        """The compute device: where collectives take their tensors."""
        return self.pipeline.device

    # ------------------------------------------------------------------ the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pipeline.zero_grad()

    @torch.no_grad()
    def step(self, closure: Callable | None = None, some_rank_left_unused: bool | None = None) -> None:  # type: ignore[override]
        """The sharded step. ``some_rank_left_unused``: whether some rank has a parameter
        without a gradient (the engine's check-in says; None: asked over the host group)."""
        self._opt_called = True  # what torch LR schedulers check to see the step happened first
        with running_on(self.pipeline.host_threads):  # [Note: host threads]
            if self.overlapped is not None:
                # Whether this rank's worker got any group depends on its own path; the step's
                # collectives must not: every rank with the overlapped step configured finishes it
                # the same way (two all-reduces), stepping here what the worker did not get.
                self.overlapped.finish(some_rank_left_unused)
                return
            self.pipeline.run(some_rank_left_unused)

    # A torch scheduler re-pointed at this optimizer (see initialize) reads this marker, which
    # its constructor would have set by wrapping ``step``; our step is the tracked one.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def _bind_flat_adam(inner: ZeroAdam, groups: list[FlatParamGroup]) -> None:
    """Tell the fused Adam which parameters of each master a step updates and which compute
    shard its kernel writes in the same pass."""
    for g in groups:
        if g.master_state.tensor is not None:
            inner.usage[id(g.master_state.tensor)] = g
        # The kernel writes the compute copy in the same pass, unless the master is on the
        # host (offloaded) or the shard in a file: then it is written after the step.
        separate = g.master_state.tensor is not None and g.master_state.tensor.data_ptr() != g.storage.shard.data_ptr()
        if separate and not g.offload.optimizer_on_host and g.storage.nvme_shard is None and not g.storage.shard_on_host:
            inner.compute_copy[id(g.master_state.tensor)] = g.storage.shard


def _choose_inner_step(inner: torch.optim.Optimizer, groups: list[FlatParamGroup], nvme: NvmeOptimizerStore | None,
                       whole_params: WholeParamStep | None) -> InnerStep:
    """The ``apply`` stage of this optimizer's steps, decided once."""
    if nvme is not None:
        return NvmeInnerStep(inner, nvme)
    if whole_params is not None:
        return WholeParamInnerStep(inner, whole_params)
    if isinstance(inner, ZeroAdam):
        return FlatAdamInnerStep(inner, groups)
    return TorchInnerStep(inner)
