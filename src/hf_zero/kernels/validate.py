"""Argument checks shared by every kernel backend.

Each backend (Triton, torch fused CPU, reference) trusts these checks and does pointer arithmetic
on flat contiguous memory, so a wrong dtype or a strided view must be refused here, with a message
that says what was expected, what was found and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

STATE_DTYPE = torch.float32
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_flat(name: str, tensor: torch.Tensor, numel: int, device: torch.device) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, expected {numel} (the numel of master)")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}; move it with .to({str(device)!r})")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (kernels address flat memory); pass {name}.contiguous()")


def _check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        expected = ", ".join(str(dtype) for dtype in allowed)
        raise TypeError(f"{name} has dtype {tensor.dtype}, expected one of: {expected}")


def check_adam_tensors(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Same numel, device and contiguity for all; fp32 master and moments; 16/32-bit grad and out."""
    for name, tensor in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_dtype(name, tensor, (STATE_DTYPE,))
    _check_dtype("grad", grad, GRAD_DTYPES)
    named = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out is not None:
        _check_dtype("out", out, OUT_DTYPES)
        named.append(("out", out))
    for name, tensor in named:
        _check_flat(name, tensor, master.numel(), master.device)


def check_adam_hparams(
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    grad_scale: float, clip_coef: float,
) -> None:
    """Ranges as torch.optim.Adam checks them, plus a 1-based integer step and a usable scale."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a python int >= 1 (1 on the first update), found {step!r}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), found {value}")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("clip_coef", clip_coef)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, found {value}")
    if not (math.isfinite(grad_scale) and grad_scale > 0.0):
        raise ValueError(f"grad_scale must be a finite number > 0 (the loss scale), found {grad_scale}")


def check_step_factors(factors: torch.Tensor | None, master: torch.Tensor, grad_scale: float,
                       clip_coef: float) -> None:
    """[Note: step factors] in hf_zero.kernels: three fp32 elements on master's device, and the
    float arguments they replace left at 1.0. Their values are not read: they are on the device."""
    if factors is None:
        return
    if factors.dtype != torch.float32 or factors.numel() != 3 or not factors.is_contiguous():
        raise ValueError(f"factors must be 3 contiguous fp32 elements [grad_scale, clip_coef, skip], found "
                         f"{factors.numel()} of {factors.dtype}")
    if factors.device != master.device:
        raise ValueError(f"factors is on {factors.device}, expected {master.device} like master")
    if grad_scale != 1.0 or clip_coef != 1.0:
        raise ValueError("pass grad_scale and clip_coef either as floats or in factors, not both "
                         f"(found grad_scale={grad_scale}, clip_coef={clip_coef} with factors)")


def _check_units(name: str, units: Sequence[torch.Tensor], world_size: int, device: torch.device) -> int:
    total = 0
    for index, unit in enumerate(units):
        if unit.numel() % world_size != 0:
            raise ValueError(
                f"{name}[{index}] has {unit.numel()} elements, not divisible by world_size={world_size}; "
                "pad each unit to a multiple of the world size first"
            )
        if unit.device != device:
            raise ValueError(f"{name}[{index}] is on {unit.device}, expected {device} like the buffer")
        if not unit.is_contiguous():
            raise ValueError(f"{name}[{index}] must be contiguous; pass .contiguous()")
        _check_dtype(f"{name}[{index}]", unit, GRAD_DTYPES)
        total += unit.numel()
    return total


def check_bucket(name: str, units: Sequence[torch.Tensor], world_size: int, buffer: torch.Tensor) -> None:
    """The rank-major buffer of a pack/unpack: contiguous, as long as all units together."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a python int >= 1, found {world_size!r}")
    _check_dtype("buffer", buffer, OUT_DTYPES)
    if not buffer.is_contiguous():
        raise ValueError("the rank-major buffer must be contiguous; pass .contiguous()")
    total = _check_units(name, units, world_size, buffer.device)
    if buffer.numel() != total:
        raise ValueError(f"the rank-major buffer has {buffer.numel()} elements, expected {total} (sum of {name})")


def check_norm_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """At least one tensor (it names the device of the result), all on one device, contiguous."""
    if len(tensors) == 0:
        raise ValueError("nonfinite_and_sqnorm needs at least one tensor (it fixes the result's device)")
    device = tensors[0].device
    for index, tensor in enumerate(tensors):
        _check_dtype(f"tensors[{index}]", tensor, GRAD_DTYPES)
        if tensor.device != device:
            raise ValueError(f"tensors[{index}] is on {tensor.device}, expected {device} like tensors[0]")
        if not tensor.is_contiguous():
            raise ValueError(f"tensors[{index}] must be contiguous; pass .contiguous()")


QUANT_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_blockwise(values_name: str, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    block: int, bits: int = 8) -> None:
    """Block quantization ([Note: blockwise int8], [Note: blockwise int4] in reference): ``values``
    [rows, n] and ``codes`` (int8 [rows, n], or for 4 bits uint8 [rows, ceil(n / 2)], two codes a
    byte) row-strided with unit stride inside a row, ``scales`` [rows, ceil(n / block)] fp32, all
    on one device."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 1, found {block!r}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, found {bits!r}")
    if bits == 4 and block < 2:
        raise ValueError(f"4-bit blocks pack two codes a byte: block must be at least 2, found {block}")
    _check_dtype(values_name, values, QUANT_VALUE_DTYPES)
    _check_dtype("codes", codes, (torch.int8,) if bits == 8 else (torch.uint8,))
    _check_dtype("scales", scales, (STATE_DTYPE,))
    for name, tensor in ((values_name, values), ("codes", codes), ("scales", scales)):
        if tensor.dim() != 2 or (tensor.numel() and tensor.stride(1) != 1):
            raise ValueError(f"{name} must be 2-D [rows, n] with unit stride inside a row, found shape "
                             f"{tuple(tensor.shape)} strides {tensor.stride()}")
        if tensor.device != values.device:
            raise ValueError(f"{name} is on {tensor.device}, expected {values.device} (the device of {values_name})")
    rows, numel = values.shape
    code_shape = (rows, numel if bits == 8 else math.ceil(numel / 2))
    if tuple(codes.shape) != code_shape:
        raise ValueError(f"codes has shape {tuple(codes.shape)}, expected {code_shape} "
                         f"({bits}-bit codes of {values_name} {tuple(values.shape)})")
    expected = (rows, math.ceil(numel / block))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales has shape {tuple(scales.shape)}, expected {expected}: one per block of {block}")
