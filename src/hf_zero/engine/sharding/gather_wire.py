"""What a stage-3 gather sends in place of the compute-dtype shard, and how the full buffer is
made from what arrives: a narrower float dtype, or ZeRO++'s int8 blocks.

[Note: quantized weight gathers]
With ``zero_quantized_weights`` (DeepSpeed ZeRO++'s qwZ) every stage-3 gather of a sharded group
sends each rank's shard as int8 codes with one fp32 scale per block of ``QWZ_BLOCK`` elements (hf_zero.comm.block_wire)
([Note: blockwise int8] in hf_zero.kernels.reference), one payload of ``codes | scales`` bytes per
rank, and every rank dequantizes the gathered payloads into the full buffer in the compute dtype.
A bf16 shard goes out at 1 + 4 / QWZ_BLOCK bytes an element instead of 2 (0.51x), an fp32 one
instead of 4 (0.25x). Each gathered weight is then off by at most half a step of its block
(absmax / 254), the forward and the backward's re-gather see the same values (the shard does not
change between them), and only the wire copy is rounded: the shard a rank owns, its master and
every checkpoint stay exact, and a gather that must be exact (``gathered_parameters``, a save,
an export) is made in the compute dtype, as for [Note: lower-precision-safe modules] in
hf_zero.engine.lower_precision. Such a shard is never lent to the gathered buffer ([Note: the
shard lent to the gathered buffer]): the buffer holds dequantized values, not the shard's.
"""

from __future__ import annotations

import torch

from hf_zero.comm.block_wire import BlockWire


class CastWire:
    """The shard sent in a narrower float dtype and widened on arrival
    ([Note: lower-precision-safe modules])."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        return shard.to(self.dtype)

    def receive_buffer(self, full: torch.Tensor) -> torch.Tensor:
        return torch.empty(full.numel(), dtype=self.dtype, device=full.device)

    def decode(self, received: torch.Tensor, full: torch.Tensor) -> None:
        full.copy_(received)


GatherWire = CastWire | BlockWire
