"""Adam on CPU through torch's fused CPU kernels (``torch._fused_adamw_`` / ``torch._fused_adam_``).

Those kernels are vectorised, multi-threaded and memory-bound, which makes them the fastest
correct CPU path (and the CPU-offload optimizer step). Two things they do not do, we add around
them without extra passes over DRAM:

- they take the gradient in the parameter's dtype and, given ``grad_scale``, write the unscaled
  gradient back into it; our ``grad`` is read-only and may be bf16/fp16;
- they do not write a 16-bit compute copy.

[Note: CPU chunking]
When the gradient needs converting or scaling, or ``out`` is given, the
shard is processed in chunks of ``CPU_CHUNK_NUMEL``: the fp32 gradient chunk is built in a small
scratch buffer, stepped, and the fresh master chunk is cast to ``out`` while both are still in
cache. Measured on a 2-core EPYC with 16M parameters, bf16 grad with unscale, clip and a bf16
out: 19 ms chunked vs 27 ms as whole-shard passes (fused Adam alone, fp32 grad: 11 ms). What is
left is mostly the fp32 -> bf16 conversion itself (~4 ms), which is compute-bound on this CPU.
Large offloaded shards take one pass instead where it can be compiled ([Note: one pass on the
host] in kernels/cpu_one_pass.py); this path is the fallback and the small shards'.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hf_zero.execution.host_sync import host_code
from hf_zero.kernels import cpu_one_pass

# 2 MiB of fp32 per chunk: the scratch gradient, master and out chunks stay within a 32 MiB L3.
CPU_CHUNK_NUMEL = 1 << 19


def has_fused_cpu_adam() -> bool:
    """torch >= 2.4 ships fused Adam/AdamW for CPU tensors."""
    return hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_")


def _fp32_grad_chunk(grad: torch.Tensor, scratch: torch.Tensor, grad_scale: float, clip_coef: float) -> torch.Tensor:
    """grad.float() / grad_scale * clip_coef, as the reference computes it, never touching grad."""
    if grad.dtype == torch.float32 and grad_scale == 1.0 and clip_coef == 1.0:
        return grad  # the fused kernels only write to grad when given a grad_scale
    scratch.copy_(grad)
    if grad_scale != 1.0:
        scratch.div_(grad_scale)
    if clip_coef != 1.0:
        scratch.mul_(clip_coef)
    return scratch


def fused_adam_cpu_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = True,
    grad_scale: float = 1.0,
    clip_coef: float = 1.0,
    out: torch.Tensor | None = None,
    factors: torch.Tensor | None = None,
) -> None:
    """Same contract as ``reference.fused_adam_``; arguments are already validated. The step
    ``factors`` are read here, on the host, where they already are ([Note: host synchronisations]
    in hf_zero.execution.host_sync)."""
    numel = master.numel()
    if numel == 0:
        return
    if factors is not None:
        with host_code():
            grad_scale, clip_coef, skip = factors.tolist()
        if skip:
            return
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    # The fused kernels read the (already incremented) step from a float tensor per parameter.
    state_steps = [torch.tensor(float(step), dtype=torch.float32)]
    hparams = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                   amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    master, grad, exp_avg, exp_avg_sq = (t.view(-1) for t in (master, grad, exp_avg, exp_avg_sq))
    needs_scratch = grad.dtype != torch.float32 or grad_scale != 1.0 or clip_coef != 1.0
    if not needs_scratch and out is None:
        fused([master], [grad], [exp_avg], [exp_avg_sq], [], state_steps, **hparams)
        return
    out_flat = out.view(-1) if out is not None else None
    if cpu_one_pass.wants_one_pass(numel) and cpu_one_pass.adam_one_pass_(
            master, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            step=step, adamw=adamw, grad_scale=grad_scale, clip_coef=clip_coef, out=out_flat):
        return  # [Note: one pass on the host] in kernels/cpu_one_pass.py
    # See [Note: CPU chunking].
    scratch = torch.empty(min(numel, CPU_CHUNK_NUMEL) if needs_scratch else 0, dtype=torch.float32)
    for start in range(0, numel, CPU_CHUNK_NUMEL):
        stop = min(numel, start + CPU_CHUNK_NUMEL)
        g = _fp32_grad_chunk(grad[start:stop], scratch[: stop - start], grad_scale, clip_coef)
        p = master[start:stop]
        fused([p], [g], [exp_avg[start:stop]], [exp_avg_sq[start:stop]], [], state_steps, **hparams)
        if out_flat is not None:
            out_flat[start:stop].copy_(p)


# [Note: landing 16-bit gradients on the host]
# torch's CPU add of a bf16/fp16 tensor into an
# fp32 one (``shard.add_(bf16, alpha=a)``) takes the element-at-a-time path for mixed dtypes,
# about 7x slower than the same add in fp32 (docs/benchmarks.md, "A 16-bit gradient landing on
# the host"). So the reduced 16-bit part is converted a chunk at a time into a cache-sized fp32
# scratch and added from there, or, into a shard that holds zeros, copied and scaled in place:
# within 1.2x of the fp32 add. Both give the values of the mixed add: the
# add computes ``dst + a * x`` with one rounding (a fused multiply-add), which for ``dst = 0`` is
# ``a * x``, what the scaling computes (up to the sign of a zero). The slow path is slow only out
# of cache: below LAND_DIRECT_NUMEL elements (1 MiB of fp32) the mixed add took 3-50 us from 1K to
# 256K elements on that machine, as fast as converting first or faster, and one op a part instead
# of two (a decoder layer's shard at world 8 is this small), so it is used as it is there.
LAND_CHUNK_NUMEL = CPU_CHUNK_NUMEL
LAND_DIRECT_NUMEL = 1 << 18


def add_scaled_cpu_(dst: torch.Tensor, src: torch.Tensor, alpha: float, *, dst_is_zero: bool = False) -> None:
    """``dst += alpha * src`` for an fp32 CPU ``dst`` and a CPU ``src`` of any float dtype, the
    same numel ([Note: landing 16-bit gradients on the host]); ``dst_is_zero``: ``dst`` holds
    zeros, so a large part may overwrite it."""
    d, x = dst.view(-1), src.reshape(-1)
    if x.dtype != d.dtype and d.numel() < LAND_DIRECT_NUMEL:
        d.add_(x, alpha=alpha)
        return
    if x.dtype == d.dtype:
        if dst_is_zero and alpha == 1.0:
            d.copy_(x)
        elif dst_is_zero:
            torch.mul(x, alpha, out=d)
        else:
            d.add_(x, alpha=alpha)
        return
    numel = d.numel()
    scratch = None if dst_is_zero else torch.empty(min(numel, LAND_CHUNK_NUMEL), dtype=d.dtype)
    for start in range(0, numel, LAND_CHUNK_NUMEL):
        stop = min(numel, start + LAND_CHUNK_NUMEL)
        if scratch is None:
            d[start:stop].copy_(x[start:stop])
            if alpha != 1.0:
                d[start:stop].mul_(alpha)
        else:
            part = scratch[: stop - start].copy_(x[start:stop])
            d[start:stop].add_(part, alpha=alpha)


# [Note: accurate norms]
# torch's CPU norm accumulates a whole tensor in a handful of fp32 lanes:
# the running sum grows until each square added loses its low bits, so a flat shard of 1e8
# gradients comes out 1-2% low. Each tensor is therefore reduced in rows of NORM_CHUNK_NUMEL
# elements (fp32 within a row) and the row results are summed in fp64; the total is rounded once
# to fp32. The error left grows with the row length: measured on 1e8 elements of spread
# magnitudes (tests/kernels/test_norm.py), relative 1.4e-2 for one fp32 pass, 1.9e-6 with rows of
# 16384, 3.9e-7 with 4096, 3.7e-8 with 1024 (the fp32 result's own rounding is up to 6e-8), and
# rows of 1024 cost no more time than the single pass (~10 ms on 2 cores).
NORM_CHUNK_NUMEL = 1 << 10


def _sqnorm_fp64(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements as a 0-d fp64 tensor, see [Note: accurate norms]."""
    small: list[torch.Tensor] = []  # whole tensors and tails, each at most one row
    rows: list[torch.Tensor] = []  # per-row norms of the large tensors
    for tensor in tensors:
        flat = tensor.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        full = flat.numel() // NORM_CHUNK_NUMEL * NORM_CHUNK_NUMEL
        if full:
            rows.append(torch.linalg.vector_norm(flat[:full].view(-1, NORM_CHUNK_NUMEL), dim=1))
        if full < flat.numel():
            small.append(flat[full:])
    if small:
        rows.append(torch.stack(torch._foreach_norm(small)))
    if not rows:  # only empty tensors
        return torch.zeros((), dtype=torch.float64)
    return torch.cat(rows).double().square().sum()


def nonfinite_and_sqnorm_cpu(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's result in one pass over the data in the usual case.

    An inf or nan element always makes the sum of squares non-finite, so a finite sum proves
    there is none; only a non-finite sum (a real overflow, or finite values near 1e20 whose squares
    overflow fp32) pays for the separate element-wise scan the reference does."""
    sqnorm = _sqnorm_fp64(tensors).float()
    with host_code():  # see [Note: host synchronisations] in hf_zero.execution.host_sync
        finite = bool(torch.isfinite(sqnorm))
    if finite:
        return torch.zeros((), dtype=torch.bool), sqnorm
    found = torch.zeros((), dtype=torch.bool)
    for tensor in tensors:
        found |= ~torch.isfinite(tensor).all()
    return found, sqnorm
