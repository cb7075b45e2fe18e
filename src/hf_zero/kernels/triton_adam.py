"""Fused Adam/AdamW over a flat fp32 shard: kernel and launcher.

One pass: read master, grad, exp_avg, exp_avg_sq; write master, exp_avg, exp_avg_sq and, when
asked, the 16-bit compute copy. For fp32 grads without ``out`` that is 28 bytes per parameter,
the bound the benchmark measures against.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hf_zero.kernels.triton_common import cast_rtne

# 2048 elements over 8 warps: 8 per thread, i.e. two 16-byte vector accesses per fp32 stream.
BLOCK_SIZE = 2048
NUM_WARPS = 8


@triton.jit
def _fused_adam_kernel(
    master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, factors_ptr, numel,
    grad_scale, clip_coef, decay, weight_decay, lerp_coeff, beta2, one_minus_beta2,
    step_size, bias_correction2_sqrt, eps,
    ADAMW: tl.constexpr, LERP_FROM_M: tl.constexpr, HAS_OUT: tl.constexpr, FACTORS_ON_DEVICE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """p, m, v, g as torch.optim.Adam(W) computes them, operation for operation:

    g = grad / grad_scale * clip_coef;  AdamW: p *= 1 - lr*wd;  Adam: g += wd*p
    m = lerp(m, g, 1-b1);  v = v*b2 + (1-b2)*g*g
    p -= step_size * m / (sqrt(v) / sqrt(1-b2^t) + eps),  step_size = lr / (1-b1^t)
    Rounding follows torch: an fma exactly where torch's kernels use one (lerp, add with alpha),
    none elsewhere (the launch disables contraction), correctly rounded division and sqrt.
    """
    # int64 offsets: a shard may exceed 2**31 elements.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    if FACTORS_ON_DEVICE:  # [grad_scale, clip_coef, skip] computed on the device: [Note: step factors]
        grad_scale = tl.load(factors_ptr)
        clip_coef = tl.load(factors_ptr + 1)
        # A skipped step reads and writes nothing: no element is in range.
        mask = offsets < tl.where(tl.load(factors_ptr + 2) == 0.0, numel, 0)
    else:
        mask = offsets < numel
    p = tl.load(master_ptr + offsets, mask=mask)
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(exp_avg_ptr + offsets, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    g = tl.div_rn(g, grad_scale) * clip_coef
    if ADAMW:
        p = p * decay
    else:
        g = tl.fma(weight_decay, p, g)  # torch's add(alpha=) is one fma on CPU and CUDA
    # torch's lerp: one fma, from m when the weight 1-b1 is < 0.5, else from g (see _lerp_args).
    m = tl.fma(lerp_coeff, g - m, m if LERP_FROM_M else g)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(master_ptr + offsets, p, mask=mask)
    tl.store(exp_avg_ptr + offsets, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offsets, cast_rtne(p, out_ptr.dtype.element_ty), mask=mask)


def _lerp_args(weight: float) -> tuple[float, bool]:
    """torch.lerp(m, g, w) as one fma: fma(w, g-m, m) for w < 0.5, else fma(w-1, g-m, g).

    Both torch's CPU and CUDA lerp are written this way; copying it keeps the exp_avg update
    bit-identical instead of one rounding apart, which matters after cancellation in g - m.
    """
    return (weight, True) if abs(weight) < 0.5 else (weight - 1.0, False)


def fused_adam_triton_(
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
    """Launcher; same contract as ``reference.fused_adam_``, arguments already validated."""
    numel = master.numel()
    if numel == 0:
        return
    # Scalars are derived in float64 on the host, as torch.optim does, and reach the kernel as fp32
    # (float() also keeps an int lr from being typed int32 by Triton).
    lerp_coeff, lerp_from_m = _lerp_args(1.0 - beta1)
    scalars = [float(x) for x in (
        grad_scale, clip_coef, 1.0 - lr * weight_decay, weight_decay, lerp_coeff, beta2, 1.0 - beta2,
        lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step), eps,
    )]
    # enable_fp_fusion=False: no FMA contraction, so the rounding follows torch's op by op.
    _fused_adam_kernel[(triton.cdiv(numel, BLOCK_SIZE),)](
        master, grad, exp_avg, exp_avg_sq, out if out is not None else master,
        factors if factors is not None else master, numel, *scalars,
        ADAMW=adamw, LERP_FROM_M=lerp_from_m, HAS_OUT=out is not None, FACTORS_ON_DEVICE=factors is not None,
        BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
