"""ZeroEngine: the model wrapped for ZeRO training, in the shape of DeepSpeed's engine."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch import nn

from hf_zero.comm import Communicator, check_in, out_of_step
from hf_zero.engine.full_state import gather_full_state_dict
from hf_zero.engine.sharding.buffer_pool import BufferPool
from hf_zero.engine.schedule.compiled_units import compile_units, is_compiled, training_without_cache
from hf_zero.engine.schedule.hooks import UnitProtocol
from hf_zero.engine.memory import format_memory_table, memory_report
from hf_zero.engine.optim.optimizer import ZeroOptimizer
from hf_zero.engine.policy import ShardingPolicy
from hf_zero.engine.schedule.rank_agreement import RankDisagreementError
from hf_zero.engine.schedule.timers import PhaseTimers
from hf_zero.engine.schedule.unit import ZeroUnit

if TYPE_CHECKING:
    from hf_zero.config import HfZeroConfig
    from hf_zero.sequence_parallel import SequenceParallel

logger = logging.getLogger("hf_zero")


class ZeroEngine(nn.Module):
    """The engine ``hf_zero.initialize`` returns.

    ``engine(*args, **kwargs)`` runs the model; ``engine.backward(loss)`` then ``engine.step()``
    every micro-step, as with DeepSpeed: gradients are reduced and the optimizer steps only at
    the gradient-accumulation boundary, and ``step`` is a no-op in between.
    """

    def __init__(
        self,
        module: nn.Module,
        config: HfZeroConfig,
        comm: Communicator,
        device: torch.device,
        units: list[ZeroUnit],
        unit_rule: str,
        optimizer: ZeroOptimizer | None,
        lr_scheduler: Any,
        buffers: BufferPool,
        policy: ShardingPolicy,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.comm = comm
        self.device = device
        self.autocast_dtype = config.autocast_dtype  # [Note: torch_autocast]; read once, not per forward
        self.units = units
        self.unit_rule = unit_rule
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.stage = config.stage  # reported (checkpoints, integrations); nothing decides on it
        self.policy = policy  # what is sharded and when: [Note: sharding policy]
        self.sequence_parallel = sequence_parallel  # [Note: sequence-parallel layout]; None without
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self._boundary_override: bool | None = None
        # Whether the last step() call reached the accumulation boundary (and so stepped, unless
        # the step turns out to have been skipped: was_step_applied).
        self._stepped_at_last_call = False
        self._last_step_time_s: float | None = None
        self._last_backward_end_s: float | None = None
        self._last_loss: torch.Tensor | None = None
        self._window_start = time.perf_counter()
        self._cache_hook = None  # set by compile(): see [Note: compiled units]
        # wall_clock_breakdown: None when off, so the hot path makes no timer calls at all.
        self._timers = PhaseTimers(device) if config.wall_clock_breakdown else None
        overlapped = optimizer.overlapped if optimizer is not None else None
        self.protocol = UnitProtocol(
            units,
            policy=policy,
            comm=comm,
            reduce_dtype=config.reduce_dtype,
            max_live_numel=int(config.zero.stage3_max_live_parameters),
            is_boundary=self.is_gradient_accumulation_boundary,
            timers=self._timers,
            reduce_bucket_numel=int(config.zero.reduce_bucket_size),
            grad_accum_dtype=config.grad_accum_dtype,
            buffers=buffers,
            on_grads_final=overlapped.submit if overlapped is not None else None,
            check_in=self.check_in,
        )
        self.protocol.install()
        comm.where = self._progress  # named by collective errors ([Note: collective errors])

    def out_of_step(self, phase: str) -> str | None:
        """How the ranks are out of step as they start ``phase`` (one of ``hf_zero.comm.phases.PHASES``),
        or None: [Note: phases in step]."""
        return out_of_step(self.comm, phase, self.global_steps, self.micro_steps)

    def check_in(self, phase: str, payload: int = 0) -> list[int]:
        """Raise :class:`RankDisagreementError` on every rank unless all start ``phase`` together;
        returns every rank's ``payload`` ([Note: phases in step])."""
        found = check_in(self.comm, phase, self.global_steps, self.micro_steps, payload)
        if found.problem is not None:
            raise RankDisagreementError(f"{phase} refused on every rank: {found.problem}")
        return found.payloads

    def _progress(self) -> str:
        return (f"optimizer step {self.global_steps + 1} (micro-step {self.micro_steps + 1}, "
                f"accumulation boundary {self.is_gradient_accumulation_boundary()})")

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        """This process's rank among all ranks (DeepSpeed's ``global_rank``)."""
        return self.comm.global_rank

    @property
    def world_size(self) -> int:
        """How many ranks train the model together (data x sequence parallel)."""
        return self.comm.global_world_size

    @property
    def sequence_parallel_size(self) -> int:
        """How many ranks share each sequence (``sequence_parallel_size``; 1 without)."""
        return 1 if self.sequence_parallel is None else self.sequence_parallel.layout.size

    @property
    def data_parallel_world_size(self) -> int:
        """How many different batches a step trains on: world / sequence_parallel_size."""
        return self.world_size // self.sequence_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which of those batches this rank sees: shard a dataloader by it."""
        return self.rank // self.sequence_parallel_size

    @property
    def seq_parallel_group(self) -> Any:
        """This rank's sequence-parallel process group (DeepSpeed's name), or None."""
        return None if self.sequence_parallel is None else self.sequence_parallel.layout.group

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.stage

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 without fp16); reads the last step's outcome ([Note: a step
        the host does not wait for])."""
        scaler = self.optimizer.loss_scaler if self.optimizer is not None else None
        if scaler is None:
            return 1.0
        self.optimizer.settle()
        return float(scaler.loss_scale)

    @property
    def skipped_steps(self) -> int:
        if self.optimizer is None:
            return 0
        self.optimizer.settle()
        scaler = self.optimizer.loss_scaler
        scaler_skipped = int(getattr(scaler, "skipped_steps", 0)) if scaler is not None else 0
        return scaler_skipped + self.optimizer.nonfinite_skipped_steps

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        self.optimizer.settle()  # a skipped step puts the scheduler's step back
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    # ------------------------------------------------------------------ training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._autocast():
            if self._timers is None or not torch.is_grad_enabled():  # evaluation is not timed
                return self.module(*args, **kwargs)
            self._timers.start("forward")
            try:
                return self.module(*args, **kwargs)
            finally:
                self._timers.stop("forward")

    def _autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast for the config's torch_autocast ([Note: torch_autocast] in
        hf_zero.config.hf_zero_config); otherwise nothing changes, an autocast the script opened
        around the call included."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Let an outer loop (Accelerate, the Trainer) decide where the boundary is."""
        self._boundary_override = is_boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss``: divided by the accumulation steps (unless ``scale_wrt_gas`` is
        False, as the Trainer does itself), multiplied by the fp16 loss scale."""
        if not loss.requires_grad:
            raise RuntimeError(
                "engine.backward got a loss that does not require grad: was the forward run "
                "under torch.no_grad() or with every parameter frozen?"
            )
        scaled = loss
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scaled = scaled / self.gradient_accumulation_steps()
        scaler = self.optimizer.loss_scaler if self.optimizer is not None else None
        if scaler is not None:  # on the device: [Note: the loss scale on the device]
            scaled = scaler.scale_loss(scaled)
        if self._timers is None:
            scaled.backward(retain_graph=retain_graph)
        else:
            self._timers.start("backward")
            try:
                scaled.backward(retain_graph=retain_graph)
            finally:
                self._timers.stop("backward")
        self._last_backward_end_s = time.perf_counter()
        self._last_loss = loss.detach()
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """At the accumulation boundary: unscale, clip, optimizer step, scheduler step, zero
        grads. In between: only count the micro-step."""
        self._stepped_at_last_call = False
        if self.is_gradient_accumulation_boundary():
            if self.optimizer is None:
                raise RuntimeError(
                    "engine.step() needs an optimizer: put an \"optimizer\" section in the config "
                    "or pass optimizer= to hf_zero.initialize"
                )
            # Whether some rank left a parameter without a gradient rides on the check-in.
            unused = self.check_in("optimizer step", payload=self.optimizer.unused_here())
            start = time.perf_counter()
            if self._timers is not None:
                self._timers.start("step")
            self.protocol.release_all()  # a unit kept gathered would go stale
            try:
                self.optimizer.step(some_rank_left_unused=any(unused))
            except FloatingPointError:  # a dropped step ([Note: non-finite steps]) still ends the boundary
                self._end_boundary(start)
                raise
            self._stepped_at_last_call = True
            self._step_scheduler(lr_kwargs)
            self._end_boundary(start)
            self._maybe_print_progress()
            # A step read since the last one had inf/nan gradients ([Note: a step the host does
            # not wait for]): this one was taken, and that one's error is raised now.
            self.optimizer.raise_deferred()
            return
        self.micro_steps += 1

    def _step_scheduler(self, lr_kwargs: dict[str, Any] | None) -> None:
        """The scheduler steps with an applied step. A step whose outcome the host has not read
        yet is taken as applied, and the scheduler's step is put back if it was not."""
        if self.lr_scheduler is None:
            return
        if self.optimizer.outcome_pending:
            self.optimizer.on_skipped(_scheduler_undo(self.lr_scheduler, self.optimizer))
        elif self.optimizer.overflow:
            return
        self.lr_scheduler.step(**(lr_kwargs or {}))

    def _end_boundary(self, start: float) -> None:
        """Count an optimizer step, applied or skipped (DeepSpeed counts skipped steps too), so
        that the accumulation boundaries after it fall where they would have."""
        if self._timers is not None:
            self._timers.stop("step")
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += 1
        self._last_step_time_s = time.perf_counter() - start

    def _maybe_print_progress(self) -> None:
        """``steps_per_print``: one line on rank 0 every N optimizer steps."""
        every = self.config.steps_per_print
        if not every or self.global_steps % every != 0:
            return
        breakdown = None
        if self._timers is not None:  # every rank starts a new window at the same step
            breakdown = self._timers.format(per=every)
            self._timers.reset()
        if self.rank != 0:
            return
        elapsed = time.perf_counter() - self._window_start
        self._window_start = time.perf_counter()
        loss = float(self._last_loss) if self._last_loss is not None else float("nan")
        norm = self.get_global_grad_norm()
        line = (f"step {self.global_steps} loss {loss:.4f} lr {self.get_lr()[0]:.3e} "
                f"grad_norm {norm if norm is not None else float('nan'):.4f} "
                f"step_time {elapsed / every:.3f}s samples/s {every * self.train_batch_size() / elapsed:.1f}")
        if self.config.fp16.enabled:
            line += f" loss_scale {self.loss_scale:g} skipped {self.skipped_steps}"
        if breakdown is not None:
            line += f" | per step: {breakdown}"
        logger.info("hf_zero: %s", line)

    # ------------------------------------------------------------------ torch.compile
    def compile(self, backend: str = "inductor", compile_kwargs: dict[str, Any] | None = None) -> None:
        """``torch.compile`` each unit's forward, as DeepSpeed's ``engine.compile()`` is called;
        see [Note: compiled units]. ``compile_kwargs`` go to ``torch.compile`` (``mode``,
        ``dynamic``, ``fullgraph``, ``options``); CUDA graphs are refused at stage 3 ([Note: no
        CUDA graphs under stage 3])."""
        kwargs = dict(compile_kwargs or {})
        kwargs.pop("backend", None)
        count = compile_units([u.module for u in self.units[:-1]], backend, kwargs,
                              shards_params=self.policy.shards_params)
        if count and self._cache_hook is None:
            self._cache_hook = training_without_cache(self.module)
        logger.info("hf_zero: compiled the forward of %d units with backend %s", count, backend)

    @property
    def is_compiled(self) -> bool:
        return len(self.units) > 1 and all(is_compiled(u.module) for u in self.units[:-1])

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` call took an optimizer step that stood (reads its outcome:
        [Note: a step the host does not wait for])."""
        return self._stepped_at_last_call and not self.optimizer.overflow

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        return None if self.optimizer is None else self.optimizer.global_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        for unit in self.units:
            for group in unit.groups:
                if self.policy.shards_optimizer_state:  # else the all-reduce's buffer stays
                    group.grads.release()

    # ------------------------------------------------------------------ full parameters
    def _units_of(self, params: Iterable[torch.Tensor] | None) -> list[ZeroUnit]:
        if params is None:
            return list(self.units)
        if isinstance(params, torch.Tensor):
            params = [params]
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for g in u.groups for p in g.params)]

    @contextlib.contextmanager
    def gathered_parameters(
        self, params: Iterable[torch.Tensor] | torch.Tensor | None = None, modifier_rank: int | None = None
    ) -> Iterator[None]:
        """Full parameters inside the block (stage 3 gathers them; other stages already have
        them). With ``modifier_rank``, that rank's changes are broadcast at exit and written into
        every rank's shard and fp32 master; without it, changes are discarded under stage 3."""
        units = self._units_of(params)
        for unit in units:  # exact: never the lower-dtype wire copy ([Note: lower-precision-safe modules])
            unit.unshard(exact=True)
        try:
            yield
        finally:
            if modifier_rank is not None:
                with torch.no_grad():
                    for unit in units:
                        for group in unit.groups:
                            self.comm.broadcast_(group.storage.full, src=modifier_rank, label=f"{group.label}.modify")
                            group.refresh_from_full()
            if self.policy.shards_params:
                for unit in units:
                    unit.reshard()

    # ------------------------------------------------------------------ reporting
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by category (see hf_zero.engine.memory)."""
        return memory_report(self.units, self.optimizer, self.module)

    def memory_table(self, unit: str = "auto", markdown: bool = False) -> str:
        """Every rank's :meth:`memory_report` as one table (categories x ranks, with totals).
        Collective: every rank must call it; each gets the same table."""
        reports = self.comm.all_gather_objects(self.memory_report())
        return format_memory_table(reports, unit=unit, markdown=markdown)

    def timers(self) -> dict[str, dict[str, float | int]]:
        """``wall_clock_breakdown``'s figures: for each of forward, backward, reduce, step and
        gather, ``seconds`` and ``count`` since the last ``steps_per_print`` line or
        :meth:`reset_timers`, and ``total_seconds`` / ``total_count`` since the start. See
        [Note: what each phase covers] in hf_zero.engine.schedule.timers."""
        if self._timers is None:
            raise RuntimeError(
                'engine.timers() needs "wall_clock_breakdown": true in the config; without it '
                "nothing is timed (steps_per_print still logs the step time)"
            )
        return self._timers.as_dict()

    def reset_timers(self) -> None:
        """Start a new timing window (``seconds`` and ``count`` back to zero)."""
        if self._timers is not None:
            self._timers.reset()

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes per collective kind since the last reset."""
        return self.comm.stats.as_dict()

    def reset_comm_stats(self) -> None:
        self.comm.reset_stats()

    def layout(self) -> list[dict[str, Any]]:
        """The flat layout of every group of every unit: what checkpoints record."""
        return [
            {"unit": u.name, "group": g.label, "trainable": g.kind.trainable,
             "persistent": g.kind.persistent, "param_group": g.kind.param_group_index,
             **g.layout.to_dict()}
            for u in self.units for g in u.groups
        ]

    # ------------------------------------------------------------------ checkpoints
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_16bit_model``: rank 0 writes ``save_dir/save_filename`` with
        ``torch.save``, the module's full state dict in the compute dtype (bf16 / fp16, or fp32
        when the run computes in fp32), gathered unit by unit. Collective: every rank must call
        it. At stage 3 it needs ``stage3_gather_16bit_weights_on_model_save``, as DeepSpeed's does;
        without it nothing is written and it returns False (``hf-zero export`` writes a model
        folder from any checkpoint instead)."""
        if self.policy.shards_params and not self.config.zero.stage3_gather_16bit_weights_on_model_save:
            logger.warning("hf_zero: save_16bit_model wrote nothing: at stage 3 it needs "
                           "stage3_gather_16bit_weights_on_model_save: true in zero_optimization, as under DeepSpeed; "
                           "or save a checkpoint and write a model folder with hf-zero export")
            return False
        state = gather_full_state_dict(self, dtype=self.config.compute_dtype)
        if exclude_frozen_parameters:
            frozen = {name for name, param in self.module.named_parameters() if not param.requires_grad}
            state = {name: value for name, value in state.items() if name not in frozen}
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: Any = None) -> str:
        """Write ``save_dir/<tag>/`` (default ``global_step<N>``) and ``save_dir/latest`` on every
        rank together; see hf_zero.checkpoint.save. Returns the checkpoint directory."""
        from hf_zero.checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        allow_unverified: bool = False,
    ) -> tuple[str | None, dict]:
        """Load a checkpoint saved at any world size and stage; returns ``(checkpoint directory,
        client_state)``. ``allow_unverified`` loads a checkpoint written without per-tensor
        checksums (an old format), at the risk its name says. See hf_zero.checkpoint.load. A
        DeepSpeed ZeRO checkpoint is converted once first, with hf_zero.checkpoint's
        ``import_deepspeed_checkpoint``; loading its folder here raises an error giving that call."""
        from hf_zero.checkpoint import load_checkpoint

        return load_checkpoint(
            self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            allow_unverified=allow_unverified,
        )


def _scheduler_undo(scheduler: Any, optimizer: ZeroOptimizer) -> Callable[[], None]:
    """What puts ``scheduler`` and the learning rates it writes back as they are now."""
    state = copy.deepcopy(scheduler.state_dict())
    lrs = [group["lr"] for group in optimizer.param_groups]

    def undo() -> None:
        scheduler.load_state_dict(state)
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr

    return undo
