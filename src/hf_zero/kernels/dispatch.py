"""Pick a backend per call and run it: Triton on CUDA, torch's fused CPU Adam, the reference.

[Note: interpreter mode]
Triton decides at ``@triton.jit`` decoration time whether a kernel is
compiled or interpreted, from the ``TRITON_INTERPRET`` environment variable. This module imports
the kernel modules once, when it is imported, and reads the variable at the same moment, so the
dispatch and the kernels always agree: with ``TRITON_INTERPRET=1`` set before ``hf_zero.kernels``
is first imported, every CPU tensor goes through the interpreter (how the tests check the Triton
code without a GPU) and CUDA tensors take the reference; setting it later has no effect on this
process.

If triton cannot be imported, every op runs its torch path instead (the reference, or torch's
fused Adam on CPU) and the first kernel call logs that once at INFO.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from collections.abc import Sequence
from types import ModuleType

import torch

from hf_zero.execution import check_launch, late_completion
from hf_zero.kernels import cpu
from hf_zero.kernels import reference
from hf_zero.kernels.validate import check_adam_hparams
from hf_zero.kernels.validate import check_adam_tensors
from hf_zero.kernels.validate import check_blockwise
from hf_zero.kernels.validate import check_bucket
from hf_zero.kernels.validate import check_norm_tensors
from hf_zero.kernels.validate import check_step_factors

logger = logging.getLogger("hf_zero")

BACKENDS = ("triton", "triton-interpret", "torch-fused-cpu", "reference")
OPS = ("fused_adam_", "pack_for_reduce_scatter", "unpack_after_all_gather", "nonfinite_and_sqnorm",
       "quantize_int8_blocks", "dequantize_int8_blocks", "quantize_int4_blocks", "dequantize_int4_blocks")


def _env_flag(name: str) -> bool:
    # The same spellings triton's own knobs accept as true.
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "on", "yes", "y")


def _import_triton() -> tuple[dict[str, ModuleType], BaseException | None]:
    """The kernel modules, or the reason triton is unusable (a broken install fails in many ways)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means "no Triton", never a crash
        return {}, exc
    # Past this point an exception is our bug, not a missing dependency: let it raise.
    from hf_zero.kernels import triton_adam
    from hf_zero.kernels import triton_norm
    from hf_zero.kernels import triton_pack
    from hf_zero.kernels import triton_quant

    return {"adam": triton_adam, "pack": triton_pack, "norm": triton_norm, "quant": triton_quant}, None


INTERPRET = _env_flag("TRITON_INTERPRET")
_TRITON, TRITON_IMPORT_ERROR = _import_triton()
_fallback_logged = False


def _log_fallback_once() -> None:
    global _fallback_logged
    if TRITON_IMPORT_ERROR is None or _fallback_logged:
        return
    _fallback_logged = True
    logger.info(
        "hf_zero.kernels: triton is not importable (%s: %s); running the torch paths instead "
        "(reference kernels, torch fused Adam on CPU). Install triton for the GPU kernels.",
        type(TRITON_IMPORT_ERROR).__name__, TRITON_IMPORT_ERROR,
    )


def backend_for(tensor: torch.Tensor, op: str = "fused_adam_") -> str:
    """Which backend ``op`` runs on for tensors like ``tensor``: one of ``BACKENDS``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    _log_fallback_once()
    if _TRITON and INTERPRET and tensor.device.type == "cpu":
        # Host tensors only: the pack and norm kernels read raw pointers from a table, which the
        # interpreter would dereference on the host even for device memory.
        return "triton-interpret"
    if _TRITON and not INTERPRET and tensor.device.type == "cuda":
        return "triton"
    if op == "fused_adam_" and tensor.device.type == "cpu" and cpu.has_fused_cpu_adam():
        return "torch-fused-cpu"
    return "reference"


def _check_device(tensor: torch.Tensor, op: str) -> None:
    """Every kernel launches on the calling thread's device ([Note: the launching thread's
    device] in hf_zero.execution); host steps of offloaded state run on any thread."""
    from hf_zero.transfer import is_host_store

    if tensor.device.type == "cuda" or not is_host_store(tensor):
        check_launch(tensor, f"kernel {op}", strict=late_completion())


def _adam_impl(backend: str) -> Callable[..., None]:
    if backend in ("triton", "triton-interpret"):
        return _TRITON["adam"].fused_adam_triton_
    return cpu.fused_adam_cpu_ if backend == "torch-fused-cpu" else reference.fused_adam_


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
    """Adam/AdamW step in place on flat fp32 ``master``/moments; see ``reference.fused_adam_``.

    [Note: step factors]
    The loss scale and the clip coefficient are known on the host only once the global gradient
    norm has been read back, which makes the host wait for the whole backward. ``factors`` is
    instead a 3-element fp32 tensor on the compute device, ``[grad_scale, clip_coef, skip]``,
    computed there by the step's measure (hf_zero.engine.optim.step_pipeline): the Triton kernel
    loads it, and a non-zero ``skip`` (some gradient on some rank was inf/nan) masks every load
    and store, so the step changes nothing; the CPU backend reads it on the host, where it is;
    the reference computes with it as tensors. ``grad_scale`` and ``clip_coef`` stay 1.0 then."""
    check_adam_tensors(master, grad, exp_avg, exp_avg_sq, out)
    hparams = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                   grad_scale=grad_scale, clip_coef=clip_coef)
    check_adam_hparams(**hparams)
    check_step_factors(factors, master, grad_scale, clip_coef)
    _check_device(master, "fused_adam_")
    impl = _adam_impl(backend_for(master, "fused_adam_"))
    impl(master, grad, exp_avg, exp_avg_sq, adamw=adamw, out=out, factors=factors, **hparams)


def pack_for_reduce_scatter(
    grads: Sequence[torch.Tensor], world_size: int, out: torch.Tensor, scale: float = 1.0
) -> None:
    """Units rank-major into ``out``, times ``scale``, cast; see ``reference.pack_for_reduce_scatter``."""
    check_bucket("grads", grads, world_size, out)
    _check_device(out, "pack_for_reduce_scatter")
    backend = backend_for(out, "pack_for_reduce_scatter")
    if backend == "reference":
        reference.pack_for_reduce_scatter(grads, world_size, out, scale)
    else:
        _TRITON["pack"].pack_for_reduce_scatter_triton(grads, world_size, out, scale, interpret=INTERPRET)


def unpack_after_all_gather(buffer: torch.Tensor, world_size: int, outs: Sequence[torch.Tensor]) -> None:
    """Rank-major ``buffer`` back into units; see ``reference.unpack_after_all_gather``."""
    check_bucket("outs", outs, world_size, buffer)
    backend = backend_for(buffer, "unpack_after_all_gather")
    if backend == "reference":
        reference.unpack_after_all_gather(buffer, world_size, outs)
    else:
        _TRITON["pack"].unpack_after_all_gather_triton(buffer, world_size, outs, interpret=INTERPRET)


def nonfinite_and_sqnorm(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(found inf/nan: 0-d bool, sum of squares: 0-d fp32); see ``reference.nonfinite_and_sqnorm``."""
    check_norm_tensors(tensors)
    _check_device(tensors[0], "nonfinite_and_sqnorm")
    backend = backend_for(tensors[0], "nonfinite_and_sqnorm")
    if backend == "reference":
        if tensors[0].device.type == "cpu":
            return cpu.nonfinite_and_sqnorm_cpu(tensors)
        return reference.nonfinite_and_sqnorm(tensors)
    return _TRITON["norm"].nonfinite_and_sqnorm_triton(tensors, interpret=INTERPRET)


@torch.no_grad()
def quantize_int8_blocks(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Rows of ``values`` to int8 codes and one fp32 scale per block; see
    ``reference.quantize_int8_blocks`` ([Note: blockwise int8])."""
    check_blockwise("values", values, codes, scales, block)
    _run_blockwise("quantize_int8_blocks", values, (values, codes, scales, block))


@torch.no_grad()
def dequantize_int8_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Codes times their block's scale into ``out``; see ``reference.dequantize_int8_blocks``."""
    check_blockwise("out", out, codes, scales, block)
    _run_blockwise("dequantize_int8_blocks", out, (codes, scales, out, block))


@torch.no_grad()
def quantize_int4_blocks(values: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """Rows of ``values`` to 4-bit codes, two a byte, and one fp32 scale per block; see
    ``reference.quantize_int4_blocks`` ([Note: blockwise int4])."""
    check_blockwise("values", values, packed, scales, block, bits=4)
    _run_blockwise("quantize_int4_blocks", values, (values, packed, scales, block))


@torch.no_grad()
def dequantize_int4_blocks(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Codes times their block's scale into ``out``; see ``reference.dequantize_int4_blocks``."""
    check_blockwise("out", out, packed, scales, block, bits=4)
    _run_blockwise("dequantize_int4_blocks", out, (packed, scales, out, block))


def _run_blockwise(op: str, tensor: torch.Tensor, args: tuple[torch.Tensor | int, ...]) -> None:
    """A checked block-quantization op on the backend ``tensor`` picks: ``reference.<op>`` or
    ``triton_quant.<op>_triton`` (same arguments)."""
    _check_device(tensor, op)
    if backend_for(tensor, op) == "reference":
        getattr(reference, op)(*args)
    else:
        getattr(_TRITON["quant"], f"{op}_triton")(*args)


def add_scaled_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, *, dst_is_zero: bool = False) -> None:
    """``dst += alpha * src`` (``dst`` fp32, ``src`` any float dtype, on one device): a reduced
    gradient part into its gradient shard. On the CPU a 16-bit ``src`` is converted in chunks
    ([Note: landing 16-bit gradients on the host] in ``cpu``); elsewhere torch's add, which
    reads mixed dtypes at full speed. ``dst_is_zero``: ``dst`` holds zeros and may be
    overwritten instead."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        cpu.add_scaled_cpu_(dst, src, alpha, dst_is_zero=dst_is_zero)
    else:
        dst.add_(src, alpha=alpha)

