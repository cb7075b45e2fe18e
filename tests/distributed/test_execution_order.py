"""The execution layer's ordering and device rules, checked on the CPU.

- Late completion ([Note: late completion] in hf_zero.execution.late): an asynchronous
  collective's output is poison until its wait, its input is checked at the wait, and a training
  run whose wait is moved after the read it guards fails under the mode.
- The launching thread's device ([Note: the launching thread's device]): a script that creates
  the process group itself gets its thread bound by hf_zero.initialize; the overlapped offload
  step's worker thread is bound; an unbound thread's launch is refused.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed


# ---------------------------------------------------------------------------------- late completion
def _collectives_under_late_completion() -> dict[str, Any]:
    import torch.distributed as dist

    from hf_zero.comm import Communicator
    from hf_zero.execution import AsyncOrderError, bind_device, checking

    dist.init_process_group("gloo")
    bind_device(torch.device("cpu"))
    comm, rank = Communicator(), dist.get_rank()
    out: dict[str, Any] = {}
    with checking(True):
        shard = torch.full((4,), float(rank + 1))
        full = torch.empty(8)
        handle = comm.all_gather_into(full, shard, label="probe", async_op=True)
        out["before_wait_all_nan"] = bool(torch.isnan(full).all())
        handle.wait()
        out["after_wait"] = full.tolist()

        grads = torch.arange(8, dtype=torch.float32) * (rank + 1)
        received = torch.empty(4)
        handle = comm.reduce_scatter_into(received, grads, label="probe_rs", async_op=True)
        grads.add_(1.0)  # written while in flight: the GPU could have read either value
        try:
            handle.wait()
            out["written_input"] = "accepted"
        except AsyncOrderError as exc:
            out["written_input"] = str(exc)

        grads = torch.ones(8)
        handle = comm.reduce_scatter_into(received, grads, label="probe_free", async_op=True)
        grads.untyped_storage().resize_(0)  # freed while in flight
        try:
            handle.wait()
            out["freed_input"] = "accepted"
        except AsyncOrderError as exc:
            out["freed_input"] = str(exc)
    return out


def test_async_collective_output_is_poison_until_wait_and_inputs_are_checked() -> None:
    results = run_distributed(_collectives_under_late_completion, 2)
    for result in results:
        assert result["before_wait_all_nan"]
        assert result["after_wait"] == [1.0] * 4 + [2.0] * 4
        assert "was written while the operation was in flight" in result["written_input"]
        assert "was freed while the operation was in flight" in result["freed_input"]


def _train_with_wait_moved(sc: dict[str, Any], late: bool, mutation: str) -> list[float] | str:
    """Stage 3 with one wait moved after what it guards (``mutation``):

    - ``read_prefetch``: a prefetched unit's forward reads its parameters without waiting for
      the prefetch's all-gather (the wait happens only when the unit is released);
    - ``free_grads``: a gradient buffer is freed before its reduce-scatter is waited.
    Without late completion, what they do depends on timing: on gloo the first read garbage
    here and the second crashed a rank (SIGSEGV, a send reading freed memory); on a GPU either
    can pass for thousands of steps. Under late completion each fails the same way every time,
    with the operation named."""
    from hf_zero.engine.sharding.grad_buffer import GradBuffer
    from hf_zero.engine.schedule.unit import ZeroUnit
    from hf_zero.engine.sharding.param_storage import StorageState
    from hf_zero.execution import checking

    if mutation == "read_prefetch":
        original_unshard = ZeroUnit.unshard

        def unshard_trusting_prefetch(self: ZeroUnit, async_op: bool = False) -> None:
            if self.param_state is StorageState.GATHERING:
                return  # the mutation: no wait before the read
            original_unshard(self, async_op)

        ZeroUnit.unshard = unshard_trusting_prefetch  # type: ignore[method-assign]
    elif mutation == "free_grads":
        original_finish = GradBuffer.finish_reduce

        def finish_freeing_first(self: GradBuffer, pending: Any) -> None:
            # The mutation: the reduce-scatter's input freed before its wait (its memory only:
            # GradBuffer.release would also end the reduction, which finish_reduce refuses).
            self.buffers.release(self.full)
            original_finish(self, pending)

        GradBuffer.finish_reduce = finish_freeing_first  # type: ignore[method-assign]
    with checking(late):
        try:
            return [sum(step) for step in S.train_engine(sc)["losses"]]
        except FloatingPointError as exc:  # the poison reached the gradients: the step refuses them
            return str(exc)
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {exc}"


# Prefetching on, one collective per group (the in-place reduce-scatter of each group's buffer).
_MOVED_WAIT = S.scenario("gpt2", 3, steps=2, zero={"reduce_bucket_size": 0, "stage3_max_reuse_distance": 0})


@pytest.mark.parametrize("late", [False, True])
def test_without_a_moved_wait_both_modes_train(late: bool) -> None:
    for losses in run_distributed(_train_with_wait_moved, 2, _MOVED_WAIT, late, "none"):
        assert isinstance(losses, list) and all(math.isfinite(loss) for loss in losses), losses


def test_a_prefetch_read_before_its_wait_fails_under_late_completion() -> None:
    for result in run_distributed(_train_with_wait_moved, 2, _MOVED_WAIT, True, "read_prefetch"):
        # The forward read poison; the first step's gradients are NaN on every rank and refused.
        assert isinstance(result, str) and "non-finite gradients" in result, result


def test_a_gradient_buffer_freed_before_its_wait_fails_under_late_completion() -> None:
    for result in run_distributed(_train_with_wait_moved, 2, _MOVED_WAIT, True, "free_grads"):
        assert isinstance(result, str) and "AsyncOrderError" in result and "was freed" in result, result


# ---------------------------------------------------------------------------------- devices
def _user_made_group(sc: dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed-style script: it creates the process group itself and never sets a device."""
    import torch.distributed as dist

    from hf_zero.execution import thread_binding

    dist.init_process_group("gloo")
    before = thread_binding()
    losses = S.train_engine(sc)["losses"]
    after = thread_binding()
    return {"before": None if before is None else before.index, "after": after.index, "losses": losses}


def test_a_user_made_group_gets_its_thread_bound_to_the_local_rank() -> None:
    sc = S.scenario("llama", 3, steps=2)
    results = run_distributed(_user_made_group, 2, sc)
    for rank, result in enumerate(results):
        assert result["before"] is None
        assert result["after"] == rank  # LOCAL_RANK: cuda:rank on a GPU machine
        assert all(math.isfinite(x) for step in result["losses"] for x in step)


def test_an_unbound_thread_launching_device_work_is_refused() -> None:
    from hf_zero.execution import WrongDeviceError, bind_device, check_launch, checking

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            check_launch(torch.zeros(1), "probe", strict=True)
        except WrongDeviceError as exc:
            errors.append(exc)

    with checking(True):
        thread = threading.Thread(target=worker, name="unbound")
        thread.start()
        thread.join()
        bind_device(torch.device("cpu"))
        check_launch(torch.zeros(1), "probe", strict=True)  # the bound main thread may
    assert len(errors) == 1 and "bound to no device" in str(errors[0])


@pytest.mark.parametrize("index_offset, refused", [(0, False), (1, True)])
def test_a_thread_bound_to_the_ranks_gpu_may_compute_on_the_cpu(index_offset: int, refused: bool) -> None:
    """The offloaded optimizer step runs CPU kernels on a worker bound to the rank's GPU (found on
    an H200: the check compared the device type too and refused every NVMe/CPU-offload step). A
    binding to another GPU index is still refused. The GPU binding is recorded as bind_device
    records it; torch.cuda.set_device itself needs a GPU."""
    from hf_zero.execution import WrongDeviceError, check_launch, checking
    from hf_zero.execution import device as execution_device

    outcome: list[BaseException | None] = []

    def worker() -> None:
        execution_device._thread.binding = execution_device.Binding(
            "cuda", execution_device.local_rank() + index_offset)
        try:
            check_launch(torch.zeros(1), "fused_adam_", strict=True)
            outcome.append(None)
        except WrongDeviceError as exc:
            outcome.append(exc)

    with checking(True):
        thread = threading.Thread(target=worker, name="hf_zero-offload-step_0")
        thread.start()
        thread.join()
    assert len(outcome) == 1 and (outcome[0] is not None) == refused, outcome


def _overlapped_step_on_bound_worker(sc: dict[str, Any]) -> dict[str, Any]:
    import hf_zero
    from hf_zero.transfer import is_host_store

    result = S.train_engine(sc)
    model = S.build_model(sc)
    engine, *_ = hf_zero.initialize(model=model, config=S.make_config(sc))
    overlapped = engine.optimizer.overlapped
    kept = [g for u in engine.units for g in u.trainable_groups if not g.offload.optimizer_on_host]
    master_copy, _ = overlapped._snapshot(kept[0])
    return {"overlap": result["overlap_per_step"], "kept_groups": len(kept),
            "undo_copy_on_host": is_host_store(master_copy), "losses": result["losses"]}


def test_overlapped_step_runs_device_groups_on_a_bound_thread_with_host_undo_copies() -> None:
    """offload_optimizer ratio 0.5 without clipping: the groups kept on the device step on the
    worker thread, which must be bound to the rank's device; their undo copies live on the host."""
    sc = S.scenario("llama", 3, 1, clip=0.0, steps=2,
                    zero={"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "reduce_bucket_size": 2000})
    for result in run_distributed(_overlapped_step_on_bound_worker, 2, sc):
        assert result["kept_groups"] > 0
        assert any(step["started_in_backward"] for step in result["overlap"])
        assert result["undo_copy_on_host"]
        assert all(math.isfinite(x) for step in result["losses"] for x in step)


@pytest.mark.parametrize("late", [False, True])
def test_host_copies_complete_before_their_readers(late: bool) -> None:
    """Parameter offload at world size 1: every gathered unit's input is a host -> device copy
    (its completion is the gather's ``after``), and the result equals the run without offload."""
    from hf_zero.execution import checking

    plain = S.scenario("gpt2", 3, steps=2)
    offloaded = S.scenario("gpt2", 3, steps=2, zero={"offload_param": {"device": "cpu"}})
    with checking(late):
        a = S.train_engine(plain)
        b = S.train_engine(offloaded)
    assert a["losses"] == b["losses"]
