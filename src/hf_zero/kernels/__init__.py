"""The engine's hot loops: fused Adam/AdamW, reduce-scatter bucketing, non-finite check and norm,
blockwise int8 and int4 quantization.

Layers, one way: ``validate`` (argument checks) <- ``reference`` (torch specification, also the
fallback) <- ``cpu`` (torch fused CPU Adam) <- ``triton_*`` (kernel + launcher per op) <-
``dispatch`` (picks a backend per call). ``backend_for(tensor, op)`` says which one runs:

- ``"triton"``: CUDA tensors;
- ``"triton-interpret"``: CPU tensors when ``TRITON_INTERPRET=1`` was set before this package was
  first imported (see [Note: interpreter mode] in ``dispatch``);
- ``"torch-fused-cpu"``: Adam on CPU tensors (``torch._fused_adamw_`` / ``torch._fused_adam_``, or
  ``cpu_one_pass``'s compiled kernel where a 16-bit gradient or copy would take extra passes);
- ``"reference"``: everything else: pack, unpack, norm and quantization on CPU, and every op on
  a GPU when triton cannot be imported.
"""

from hf_zero.kernels import reference
from hf_zero.kernels.dispatch import BACKENDS
from hf_zero.kernels.dispatch import OPS
from hf_zero.kernels.dispatch import add_scaled_
from hf_zero.kernels.dispatch import backend_for
from hf_zero.kernels.dispatch import dequantize_int4_blocks
from hf_zero.kernels.dispatch import dequantize_int8_blocks
from hf_zero.kernels.dispatch import fused_adam_
from hf_zero.kernels.dispatch import nonfinite_and_sqnorm
from hf_zero.kernels.dispatch import pack_for_reduce_scatter
from hf_zero.kernels.dispatch import quantize_int4_blocks
from hf_zero.kernels.dispatch import quantize_int8_blocks
from hf_zero.kernels.dispatch import unpack_after_all_gather

__all__ = [
    "BACKENDS",
    "OPS",
    "add_scaled_",
    "backend_for",
    "dequantize_int4_blocks",
    "dequantize_int8_blocks",
    "fused_adam_",
    "nonfinite_and_sqnorm",
    "pack_for_reduce_scatter",
    "quantize_int4_blocks",
    "quantize_int8_blocks",
    "reference",
    "unpack_after_all_gather",
]
