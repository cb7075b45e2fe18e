"""The execution layer: on which device, stream and thread hf_zero's device work runs, and what
waits for what ([Note: streams and events], [Note: the launching thread's device],
[Note: late completion]). Nothing else in hf_zero creates streams, waits on events, copies
hf_zero's state with ``non_blocking=True`` or sets the current device. (The wall-clock timers
record timing events on the compute stream, and the Triton launchers copy a new index table
from pinned memory without blocking, and keep it: [Note: pointer tables] in
hf_zero.kernels.triton_common.)"""

from hf_zero.execution.completion import DONE, Completion
from hf_zero.execution.device import (
    WrongDeviceError, bind_device, bound_thread_initializer, check_launch, local_rank, rank_device, thread_binding,
)
from hf_zero.execution.late import (
    CHECK_ENV, AsyncOrderError, checking, late_completion, poison_, poison_before_free, read_environment,
)
from hf_zero.execution.streams import Execution, execution_for

__all__ = [
    "CHECK_ENV", "DONE", "AsyncOrderError", "Completion", "Execution", "WrongDeviceError", "bind_device",
    "bound_thread_initializer", "check_launch", "checking", "execution_for", "late_completion", "local_rank",
    "poison_", "poison_before_free", "rank_device", "read_environment", "thread_binding",
]
