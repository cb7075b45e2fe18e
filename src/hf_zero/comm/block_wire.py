"""Blockwise int8 and int4 payloads on the wire: what ZeRO++'s quantized collectives send.

One payload per row of ``numel`` elements: the row's codes from byte 0 (int8, or two 4-bit codes
a byte), then its fp32 scales (one per block of ``block`` elements, [Note: blockwise int8] and
[Note: blockwise int4] in hf_zero.kernels.reference) from the 16-aligned byte ``scales_offset``,
so that a buffer of several payloads, as a collective leaves it, views as codes and scales in
place. Stage-3 gathers send one 8-bit payload per rank ([Note: quantized weight gathers] in
hf_zero.engine.sharding.gather_wire); the quantized gradient reduction one 4-bit payload per
rank's chunk ([Note: quantized gradient reduction] in hf_zero.comm.quantized_reduce).
"""

from __future__ import annotations

import math

import torch

from hf_zero import kernels

# Elements per scale: 4 bytes of scale per 512 codes (0.8% at 8 bits, 1.6% at 4).
QWZ_BLOCK = 512


class BlockWire:
    """Rows of ``numel`` elements as ``bits``-bit codes and per-block fp32 scales,
    ``payload_bytes`` of uint8 a row (see the module docstring)."""

    def __init__(self, shard_numel: int, bits: int = 8, block: int = QWZ_BLOCK) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, found {bits!r}")
        self.numel = shard_numel
        self.bits = bits
        self.block = block
        self.num_blocks = math.ceil(shard_numel / block)
        self.code_bytes = shard_numel if bits == 8 else math.ceil(shard_numel / 2)
        self.scales_offset = _align16(self.code_bytes)
        self.payload_bytes = self.scales_offset + _align16(4 * self.num_blocks)
        if bits == 8:
            self._quantize, self._dequantize = kernels.quantize_int8_blocks, kernels.dequantize_int8_blocks
        else:
            self._quantize, self._dequantize = kernels.quantize_int4_blocks, kernels.dequantize_int4_blocks

    def _views(self, payloads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [rows, code_bytes] int8 or uint8, scales [rows, num_blocks] fp32) inside uint8
        ``payloads``."""
        rows = payloads.view(-1, self.payload_bytes)
        codes = rows[:, :self.code_bytes]
        if self.bits == 8:
            codes = codes.view(torch.int8)
        scales = rows[:, self.scales_offset:self.scales_offset + 4 * self.num_blocks].view(torch.float32)
        return codes, scales

    def encode(self, shard: torch.Tensor) -> torch.Tensor:
        return self.encode_rows(shard.view(1, -1))

    def receive_buffer(self, full: torch.Tensor) -> torch.Tensor:
        ranks = full.numel() // self.numel
        return torch.empty(ranks * self.payload_bytes, dtype=torch.uint8, device=full.device)

    def decode(self, received: torch.Tensor, full: torch.Tensor) -> None:
        codes, scales = self._views(received)
        self._dequantize(codes, scales, full.view(-1, self.numel), self.block)

    def encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every row of ``rows`` [R, numel] as a payload, back to back: R x ``payload_bytes``."""
        payloads = torch.empty(rows.shape[0] * self.payload_bytes, dtype=torch.uint8, device=rows.device)
        self.encode_rows_into(payloads, rows)
        return payloads

    def encode_rows_into(self, payloads: torch.Tensor, rows: torch.Tensor) -> None:
        """Like :meth:`encode_rows`, into ``payloads`` (uint8, R x ``payload_bytes``); ``rows``
        may be any row-strided view."""
        codes, scales = self._views(payloads)
        self._quantize(rows, codes, scales, self.block)

    def decode_sum(self, received: torch.Tensor, rows: int = 1) -> torch.Tensor:
        """fp32 [rows, numel]: ``received`` holds S x ``rows`` payloads, S senders' ``rows`` each;
        row r is the sum over the senders of their row r, decoded one payload at a time
        (temporaries of one row)."""
        codes, scales = self._views(received)
        total = torch.zeros(rows, self.numel, dtype=torch.float32, device=received.device)
        row = torch.empty(1, self.numel, dtype=torch.float32, device=received.device)
        for index in range(codes.shape[0]):
            self._dequantize(codes[index:index + 1], scales[index:index + 1], row, self.block)
            total[index % rows] += row[0]
        return total


def _align16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16
