"""What a stage-3 gather sends in place of the compute-dtype shard, and how the full buffer is
made from what arrives: a narrower float dtype, or ZeRO++'s int8 blocks.

[Note: quantized weight gathers]
With ``zero_quantized_weights`` (DeepSpeed ZeRO++'s qwZ) every stage-3 gather of a sharded group
sends each rank's shard as int8 codes with one fp32 scale per block of ``QWZ_BLOCK`` elements
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

import math

import torch

from hf_zero import kernels

# Elements per scale: 4 bytes of scale per 512 of int8 (0.8%), and half a step of error per block.
QWZ_BLOCK = 512


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


class Int8BlockWire:
    """The shard sent as int8 codes and per-block fp32 scales ([Note: quantized weight gathers]).

    A rank's payload is ``payload_bytes`` of uint8: its ``numel`` codes from byte 0, its scales
    from byte ``scales_offset`` (16-aligned, so the gathered buffer's rows view as fp32 in place).
    """

    def __init__(self, shard_numel: int, block: int = QWZ_BLOCK) -> None:
        self.numel = shard_numel
        self.block = block
        self.num_blocks = math.ceil(shard_numel / block)
        self.scales_offset = _align16(shard_numel)
        self.payload_bytes = self.scales_offset + _align16(4 * self.num_blocks)

    def _views(self, payloads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [rows, numel] int8, scales [rows, num_blocks] fp32) inside uint8 ``payloads``."""
        rows = payloads.view(-1, self.payload_bytes)
        codes = rows[:, :self.numel].view(torch.int8)
        scales = rows[:, self.scales_offset:self.scales_offset + 4 * self.num_blocks].view(torch.float32)
        return codes, scales

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        payload = torch.empty(self.payload_bytes, dtype=torch.uint8, device=shard.device)
        codes, scales = self._views(payload)
        kernels.quantize_int8_blocks(shard.view(1, -1), codes, scales, self.block)
        return payload

    def receive_buffer(self, full: torch.Tensor) -> torch.Tensor:
        ranks = full.numel() // self.numel
        return torch.empty(ranks * self.payload_bytes, dtype=torch.uint8, device=full.device)

    def decode(self, received: torch.Tensor, full: torch.Tensor) -> None:
        codes, scales = self._views(received)
        kernels.dequantize_int8_blocks(codes, scales, full.view(-1, self.numel), self.block)


GatherWire = CastWire | Int8BlockWire


def _align16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16
