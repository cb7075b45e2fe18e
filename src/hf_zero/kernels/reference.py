"""Torch references: the specification every kernel backend is tested against.

Each function has the same signature and semantics as its public counterpart in
``hf_zero.kernels``. They are written for clarity, mirroring torch.optim's single-tensor Adam
line by line, and are also the fallback wherever no faster path exists. Tests and benchmarks
import them from here rather than keeping their own copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hf_zero.kernels.validate import check_adam_hparams
from hf_zero.kernels.validate import check_adam_tensors
from hf_zero.kernels.validate import check_blockwise
from hf_zero.kernels.validate import check_bucket
from hf_zero.kernels.validate import check_norm_tensors
from hf_zero.kernels.validate import check_step_factors


@torch.no_grad()  # an optimizer step: parameters change in place, autograd must not record it
def fused_adam_(
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
    """One Adam (``adamw=False``, L2 decay) or AdamW (decoupled decay) step, in place.

    ``grad`` is read as ``grad.float() / grad_scale * clip_coef`` and is never modified.
    ``step`` is 1-based (the bias correction of the first update uses step=1). When ``out`` is
    given it receives the updated master cast to ``out.dtype`` (the compute copy).

    ``factors`` ([Note: step factors]): a 3-element fp32 tensor on the tensors' device,
    ``[grad_scale, clip_coef, skip]``, used instead of the two arguments (which stay 1.0); when
    ``skip`` is not 0 nothing is changed.
    """
    check_adam_tensors(master, grad, exp_avg, exp_avg_sq, out)
    check_adam_hparams(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                       grad_scale=grad_scale, clip_coef=clip_coef)
    check_step_factors(factors, master, grad_scale, clip_coef)
    if factors is not None:
        _adam_with_factors(master, grad, exp_avg, exp_avg_sq, out, factors, lr=lr, beta1=beta1, beta2=beta2,
                           eps=eps, weight_decay=weight_decay, step=step, adamw=adamw)
        return
    # Out-of-place ops on g: grad.float() is grad itself when grad is fp32.
    g = grad.float()
    if grad_scale != 1.0:
        g = g / grad_scale
    if clip_coef != 1.0:
        g = g * clip_coef
    _adam_update_(master, g, exp_avg, exp_avg_sq, out, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, step=step, adamw=adamw)


def _adam_with_factors(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       out: torch.Tensor | None, factors: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, step: int, adamw: bool) -> None:
    """The step with device ``factors``: computed on copies, kept where ``skip`` is 0. The
    arithmetic is the float path's, with the scale and coefficient as 0-d tensors."""
    state = [master, exp_avg, exp_avg_sq] + ([out] if out is not None else [])
    new = [t.clone() for t in state]
    g = grad.float() / factors[0] * factors[1]
    _adam_update_(new[0], g, new[1], new[2], new[3] if out is not None else None, lr=lr, beta1=beta1,
                  beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, adamw=adamw)
    keep = factors[2] != 0
    for target, updated in zip(state, new):
        target.copy_(torch.where(keep, target, updated))


def _adam_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None, *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  adamw: bool) -> None:
    """Adam(W) on ``p`` with the fp32 gradient ``g`` (already unscaled and clipped), moments
    ``m`` and ``v``; ``out`` gets the new ``p``."""
    if weight_decay != 0.0:
        if adamw:
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)
    if out is not None:
        out.copy_(p)


def pack_for_reduce_scatter(
    grads: Sequence[torch.Tensor], world_size: int, out: torch.Tensor, scale: float = 1.0
) -> None:
    """Lay several units out rank-major in ``out``: for each rank r, r's chunk of every unit.

    Unit u of numel L_u contributes ``u[r*L_u/ws : (r+1)*L_u/ws]`` to rank r's segment, so a
    reduce-scatter of ``out`` hands rank r exactly its shard of every unit. Values are multiplied
    by ``scale`` in fp32 (the pre-divide) and rounded once to ``out.dtype``.
    """
    check_bucket("grads", grads, world_size, out)
    rank_major = out.view(world_size, -1)
    column = 0
    for grad in grads:
        chunk = grad.numel() // world_size
        src = grad.view(world_size, chunk)
        dst = rank_major[:, column : column + chunk]
        _scaled_copy_(dst, src, scale)
        column += chunk


def _scaled_copy_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = (src in fp32 * scale)`` rounded once to ``dst.dtype``, without a temporary where
    torch can compute in fp32 directly (the engine packs whole gradient buckets through here)."""
    if scale == 1.0:
        dst.copy_(src)
    elif dst.dtype == torch.float32:
        dst.copy_(src).mul_(scale)  # the widening copy is exact
    elif src.dtype in (dst.dtype, torch.float32):
        torch.mul(src, scale, out=dst)  # CPU/CUDA math in fp32 (opmath), one rounding
    else:
        dst.copy_(src.float() * scale)


def unpack_after_all_gather(buffer: torch.Tensor, world_size: int, outs: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`pack_for_reduce_scatter` (without the scale): rank-major ``buffer`` to units."""
    check_bucket("outs", outs, world_size, buffer)
    rank_major = buffer.view(world_size, -1)
    column = 0
    for unit in outs:
        chunk = unit.numel() // world_size
        unit.view(world_size, chunk).copy_(rank_major[:, column : column + chunk])
        column += chunk


# The reference's fp64 cast goes a slice at a time, so it never holds a second, fp64 copy of a shard.
NORM_SLICE_NUMEL = 1 << 20


def nonfinite_and_sqnorm(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(any element inf or nan, sum of squares) over all tensors, as 0-d device tensors: bool, fp32.

    The sum of squares is accumulated in fp64 and rounded once to fp32: an fp32 running sum over
    a shard of ~1e8 elements comes out ~2% low (see [Note: accurate norms] in ``cpu.py``).
    The flag is computed on its own rather than read off the norm: finite fp32 values near 1e20
    overflow the sum of squares to inf, which is not an overflow of the gradients themselves.
    """
    check_norm_tensors(tensors)
    device = tensors[0].device
    found = torch.zeros((), dtype=torch.bool, device=device)
    sqnorm = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        found |= ~torch.isfinite(tensor).all()
        for piece in tensor.reshape(-1).split(NORM_SLICE_NUMEL):
            sqnorm += torch.linalg.vector_norm(piece, dtype=torch.float64).square()
    return found, sqnorm.float()


# [Note: blockwise int8]
# ZeRO++'s quantized weight gathers (qwZ) send each shard as int8 codes with one fp32 scale per
# block of ``block`` consecutive elements of a row: scale = absmax / 127, code = round(x * 127 /
# absmax) (halves rounded up: floor(y + 0.5); an all-zero block has scale 0 and codes 0), value
# = code * scale rounded once to the output dtype. Every element is off by at most half
# a step, absmax / 254, of its own block. Each operation is one correctly rounded fp32 operation,
# so the Triton kernels (correctly rounded division, no contraction) give these bits exactly.
# Non-finite inputs are not specified: the weights a gather sends are finite.


@torch.no_grad()
def quantize_int8_blocks(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Rows of ``values`` [rows, n] to int8 ``codes`` [rows, n] and fp32 ``scales``
    [rows, ceil(n / block)] ([Note: blockwise int8])."""
    check_blockwise("values", values, codes, scales, block)
    if values.shape[1]:
        codes.copy_(_block_codes(values, scales, block, 127).to(torch.int8))


@torch.no_grad()
def dequantize_int8_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Inverse of :func:`quantize_int8_blocks`: ``out`` [rows, n] = codes x their block's scale,
    rounded once to ``out.dtype``."""
    check_blockwise("out", out, codes, scales, block)
    rows, numel = out.shape
    if not numel:
        return
    # A row (one rank's payload) at a time: the fp32 temporaries are 12 bytes an element of a row,
    # not of the gathered buffer (6.3 GB for a 525M-element embedding).
    for row in range(rows):
        widened = scales[row].repeat_interleave(block)[:numel]
        out[row].copy_(codes[row].to(torch.float32) * widened)


# [Note: blockwise int4]
# ZeRO++'s quantized gradient reduction (qgZ) sends 4-bit codes, as DeepSpeed's does: the same
# blocks and rounding as [Note: blockwise int8] with 7 in place of 127 (scale = absmax / 7, code =
# floor(x * 7 / absmax + 0.5) in [-7, 7]), stored as code + 8 in a nibble, two a byte: element
# 2i in the low nibble of byte i, 2i + 1 in the high one; an odd row's last high nibble holds 8
# (code 0). Every element is off by at most absmax / 14 of its own block.


@torch.no_grad()
def quantize_int4_blocks(values: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Rows of ``values`` [rows, n] to 4-bit codes, two a byte in uint8 ``packed``
    [rows, ceil(n / 2)], and fp32 ``scales`` [rows, ceil(n / block)] ([Note: blockwise int4])."""
    check_blockwise("values", values, packed, scales, block, bits=4)
    rows, numel = values.shape
    if not numel:
        return
    nibbles = (_block_codes(values, scales, block, 7, pad_to=2) + 8).to(torch.uint8).view(rows, -1, 2)
    packed.copy_(nibbles[:, :, 0] | (nibbles[:, :, 1] << 4))


@torch.no_grad()
def dequantize_int4_blocks(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Inverse of :func:`quantize_int4_blocks`: ``out`` [rows, n] = codes x their block's scale,
    rounded once to ``out.dtype``; a row at a time, as :func:`dequantize_int8_blocks`."""
    check_blockwise("out", out, packed, scales, block, bits=4)
    rows, numel = out.shape
    if not numel:
        return
    for row in range(rows):
        nibbles = torch.stack((packed[row] & 15, packed[row] >> 4), dim=1).view(-1)[:numel]
        widened = scales[row].repeat_interleave(block)[:numel]
        out[row].copy_((nibbles.to(torch.float32) - 8.0) * widened)


def _block_codes(values: torch.Tensor, scales: torch.Tensor, block: int, qmax: int, pad_to: int = 1) -> torch.Tensor:
    """fp32 codes in [-qmax, qmax] of each row of ``values``, ``scales`` written (absmax / qmax per
    block); the codes are cut to the row's length rounded up to ``pad_to``."""
    rows, numel = values.shape
    width = -(-numel // pad_to) * pad_to
    codes = torch.empty(rows, width, dtype=torch.float32, device=values.device)
    # A slice of blocks at a time: the fp32 temporaries are a few times QUANT_SLICE_NUMEL, not of
    # the whole input (a reduce-scatter's is every rank's gradients of a unit).
    step = max(block, QUANT_SLICE_NUMEL // block * block)
    for row in range(rows):
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            first, blocks = start // block, -(-(stop - start) // block)
            padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
            padded[:stop - start] = values[row, start:stop]
            padded = padded.view(blocks, block)
            absmax = padded.abs().amax(dim=1)
            scales[row, first:first + blocks] = absmax / float(qmax)
            # A tensor numerator: ``qmax / absmax`` is reciprocal-then-multiply in torch, two roundings.
            inverse = torch.where(absmax > 0, torch.full_like(absmax, float(qmax)) / absmax, torch.zeros_like(absmax))
            rounded = torch.floor(padded * inverse.unsqueeze(1) + 0.5).clamp_(-qmax, qmax).view(-1)
            end = width if stop == numel else stop
            codes[row, start:end] = rounded[:end - start]
    return codes


# Elements of a row quantized at once by the reference (a multiple of any block up to it).
QUANT_SLICE_NUMEL = 1 << 20
