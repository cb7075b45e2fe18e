"""Adam on the host in one pass over each byte: a kernel torch's inductor compiles for this CPU.

[Note: one pass on the host]
torch's fused CPU Adam takes an fp32 gradient and writes no 16-bit copy, so with a bf16 gradient,
a loss scale or a clip, and the compute copy to write (the offloaded step's usual case), the
step converts the gradient into a scratch chunk, steps, and casts the master out again
([Note: CPU chunking] in kernels/cpu.py): three passes over each chunk, through cache. The
kernel here reads the gradient, master and moments once and writes master, moments and the
copy once, 28 bytes per parameter with a bf16 gradient and copy: on a 2-core EPYC, 16M
parameters, 30.3 ms at one thread and 16.4 ms at two, against 56.2 and 33.7 ms chunked and
DeepSpeedCPUAdam's 29.8 and 17.4 ms with an fp32 gradient and no copy
(benchmarks/bench_host_adam.py, docs/benchmarks.md "The host's Adam").

It is generated and compiled by ``torch.compile`` (inductor's C++ backend: a C++ compiler on
the machine, as DeepSpeed's CPU Adam needs), once per process on the first shard of
``ONE_PASS_MIN_NUMEL`` elements or more; shapes are dynamic, so one kernel serves every shard,
and the hyperparameters are a tensor, so no step recompiles. The compiled code is cached on
disk by inductor (a later process loads it in seconds). ``dynamic_threads`` makes it run on
the thread count in effect at each call: the host step's own ([Note: host threads]). Shards
below that size keep the chunked path: a compile of 10-30 s is worth it for a model's
shards, not for a test's.

``HF_ZERO_HOST_ADAM`` chooses: ``auto`` (the default: one pass for large shards on a machine
with a GPU, where the host holds offloaded states, and where the compile succeeds; the chunked
path otherwise, so a CPU-only run compiles nothing), ``one_pass`` (every shard that needs it, and
a failed compile is an error), ``chunked`` (never compile). A failed compile under ``auto`` is
logged once with its reason and the chunked path used from then on.

The arithmetic is the reference's (kernels/reference.py), operation for operation; the compiler
may contract a multiply and an add into one rounding, so results agree to the kernels' tests'
tolerances, not bit for bit.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

logger = logging.getLogger("hf_zero")

HOST_ADAM_ENV = "HF_ZERO_HOST_ADAM"
CHOICES = ("auto", "one_pass", "chunked")
ONE_PASS_MIN_NUMEL = 1 << 20

_compiled: list[Callable[..., None]] = []  # the kernel once built
_failed: list[str] = []  # why the compile failed under auto


def host_adam_choice() -> str:
    """``HF_ZERO_HOST_ADAM``, checked."""
    choice = os.environ.get(HOST_ADAM_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{HOST_ADAM_ENV}={os.environ[HOST_ADAM_ENV]!r}: expected one of {', '.join(CHOICES)}")
    return choice


def wants_one_pass(numel: int) -> bool:
    """Whether a shard of ``numel`` elements that needs conversion or a copy steps in one pass."""
    choice = host_adam_choice()
    if choice == "auto":
        return numel >= ONE_PASS_MIN_NUMEL and not _failed and torch.cuda.is_available()
    return choice == "one_pass"


def _adam_one_pass(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   out: torch.Tensor | None, hp: torch.Tensor, adamw: bool) -> None:
    # hp: [grad_scale, clip_coef, decay, weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt,
    #      eps, -step_size]; reference._adam_update_ line by line.
    g = grad.float() / hp[0] * hp[1]
    p = master
    if adamw:
        p = p * hp[2]
    else:
        g = g + p * hp[3]
    m = torch.lerp(exp_avg, g, hp[4])
    v = exp_avg_sq * hp[5] + hp[6] * g * g
    denom = v.sqrt() / hp[7] + hp[8]
    p = p + hp[9] * (m / denom)
    master.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(p)


def _kernel() -> Callable[..., None]:
    if not _compiled:
        _compiled.append(torch.compile(_adam_one_pass, dynamic=True, fullgraph=True,
                                       options={"cpp.dynamic_threads": True}))
    return _compiled[0]


def adam_one_pass_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int, adamw: bool,
                   grad_scale: float, clip_coef: float, out: torch.Tensor | None) -> bool:
    """One Adam(W) step of flat CPU tensors in one pass ([Note: one pass on the host]); False
    when the kernel could not be built under ``auto`` (the caller steps another way)."""
    hp = torch.tensor([grad_scale, clip_coef, 1.0 - lr * weight_decay, weight_decay, 1.0 - beta1, beta2,
                       1.0 - beta2, (1.0 - beta2**step) ** 0.5, eps, -lr / (1.0 - beta1**step)], dtype=torch.float32)
    try:
        with torch.no_grad():
            _kernel()(master, grad, exp_avg, exp_avg_sq, out, hp, adamw)
    except Exception as error:  # noqa: BLE001 - a missing compiler, a failed build: fall back under auto
        if host_adam_choice() == "one_pass":
            raise RuntimeError(f"{HOST_ADAM_ENV}=one_pass: the host Adam kernel could not be compiled "
                               f"({type(error).__name__}: {error}). Fix: install a C++ compiler (g++), or "
                               f"unset {HOST_ADAM_ENV} to fall back to torch's fused Adam") from error
        _failed.append(f"{type(error).__name__}: {error}")
        logger.warning("hf_zero: the one-pass host Adam kernel could not be compiled (%s); the host step uses "
                       "torch's fused Adam in chunks instead (slower). Set %s=chunked to skip the attempt",
                       _failed[0][:500], HOST_ADAM_ENV)
        return False
    return True


