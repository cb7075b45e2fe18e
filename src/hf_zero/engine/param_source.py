"""Where the values of not-yet-materialised (meta) parameters come from.

A model loaded while a stage-3 config is alive has its parameters on the meta device and carries
a :class:`SafetensorsSource` (``model._hf_zero_param_source``). The flat groups then read, for
each parameter, only the element range they need (under stage 3: this rank's shard) straight
from the memory-mapped safetensors files, so the full model never exists in one process.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

import torch

SOURCE_ATTRIBUTE = "_hf_zero_param_source"


class ParamSource(Protocol):
    def fill_(self, name: str, shape: tuple[int, ...], start: int, stop: int, out: torch.Tensor) -> None:
        """Write elements [start, stop) of the flattened parameter ``name`` into ``out``."""

    def has(self, name: str) -> bool: ...


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a local model folder: the sharded index's files, or model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(
        f"{model_dir} has no model.safetensors or model.safetensors.index.json; hf_zero's sharded "
        "loading reads safetensors only (re-save the model with save_pretrained(safe_serialization=True))"
    )


# safetensors dtype names (the format's header) -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsSource:
    """Parameter values read lazily from safetensors files, by parameter name.

    [Note: reading without mmap]
    ``safetensors.safe_open`` memory-maps the file, and mapped pages a process has read count in
    its resident set: a rank reading its half of the weights would hold them twice (its shard,
    and the mapped file pages). The format is simple (an 8-byte header length, a JSON header with
    each tensor's dtype, shape and byte offsets, then the raw little-endian data), so this reads
    the byte range of each request with ``readinto`` straight into the destination shard when
    the dtypes match (one temporary of the request's size when they do not). File pages then live
    in the page cache, not in the process.

    A name missing from the files is looked up again without, then with, the model's
    ``base_model_prefix`` (a head model loaded from its base model's checkpoint, and back)."""

    def __init__(self, files: list[str], base_model_prefix: str = "") -> None:
        self.files = files
        self.prefix = base_model_prefix
        self._entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int]] = {}
        for path in files:
            self._read_header(path)

    def _read_header(self, path: str) -> None:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
            header_len = int.from_bytes(raw, "little")
            try:
                header = json.loads(f.read(header_len))
            except ValueError as error:
                raise ValueError(f"{path}: unreadable safetensors header ({error})") from error
        data_start = 8 + header_len
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {key} has dtype {info['dtype']}, which hf_zero cannot load")
            self._entries[key] = (path, dtype, tuple(info["shape"]), data_start + info["data_offsets"][0])

    def key_for(self, name: str) -> str | None:
        if name in self._entries:
            return name
        if self.prefix and name.startswith(self.prefix + "."):
            stripped = name[len(self.prefix) + 1:]
            if stripped in self._entries:
                return stripped
        if self.prefix and f"{self.prefix}.{name}" in self._entries:
            return f"{self.prefix}.{name}"
        return None

    def has(self, name: str) -> bool:
        return self.key_for(name) is not None

    def first_floating_dtype(self) -> torch.dtype | None:
        """The dtype of the checkpoint's first floating-point tensor (what ``dtype="auto"`` reads)."""
        return next((dtype for _, dtype, _, _ in self._entries.values() if dtype.is_floating_point), None)

    def fill_(self, name: str, shape: tuple[int, ...], start: int, stop: int, out: torch.Tensor) -> None:
        key = self.key_for(name)
        if key is None:
            raise KeyError(f"parameter {name!r} is not in {self.files}")
        path, dtype, stored, data_offset = self._entries[key]
        if stored != tuple(shape):
            raise ValueError(f"{key} has shape {stored} in {path}, the model expects {tuple(shape)}")
        same = out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        target = out if same else torch.empty(stop - start, dtype=dtype)
        element = torch.empty((), dtype=dtype).element_size()
        buffer = target.view(torch.uint8).numpy() if target.numel() else None
        with open(path, "rb", buffering=0) as f:
            f.seek(data_offset + start * element)
            read = f.readinto(memoryview(buffer)) if buffer is not None else 0
        if read != (stop - start) * element:
            raise ValueError(f"{path} is truncated: {key} needs {(stop - start) * element} bytes at "
                             f"offset {data_offset + start * element}, got {read}")
        if not same:
            out.copy_(target)
