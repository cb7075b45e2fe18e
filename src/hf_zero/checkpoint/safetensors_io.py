"""Streaming safetensors files: written tensor by tensor, read range by range.

[Note: streamed safetensors]
``safetensors.torch.save_file`` serialises every tensor into one in-memory buffer before it
writes, so a file costs twice its size in RAM. A safetensors file is an 8-byte little-endian
header length, a JSON header (dtype, shape and byte range of each tensor) and the raw bytes back
to back; when every tensor's dtype and shape are known up front the header can be written first
and each tensor's bytes appended as it is produced. Saving then holds no copy of the rank's
state, and export holds one parameter at a time. Files written here are read back with
``safetensors.safe_open`` (``get_slice`` reads only the requested range).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Iterator

import torch

from hf_zero.checkpoint.errors import CheckpointError

DTYPE_TAGS: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
TAG_DTYPES = {tag: dtype for dtype, tag in DTYPE_TAGS.items()}
_HEADER_ALIGNMENT = 8  # safetensors pads its own headers with spaces to this boundary


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file to write: known before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    # Called once, when the entry's bytes are written: the tensor, or its flat elements in
    # consecutive chunks (state streamed from NVMe files, a tile at a time).
    produce: Callable[[], torch.Tensor | Iterator[torch.Tensor]]

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * element_bytes(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorEntry":
        """The entry of a tensor already in memory; a dtype safetensors lacks is refused."""
        if tensor.dtype not in DTYPE_TAGS:
            raise CheckpointError(f"{name}: dtype {tensor.dtype} cannot be stored in safetensors")
        return cls(name, tensor.dtype, tuple(tensor.shape), lambda t=tensor: t)


def encode_header(entries: Iterable[TensorEntry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPE_TAGS:
            raise TypeError(f"safetensors cannot store {entry.name} of dtype {entry.dtype}")
        header[entry.name] = {
            "dtype": DTYPE_TAGS[entry.dtype], "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(raw)) + raw


def _write_flat(handle, flat: torch.Tensor, digest: "hashlib._Hash") -> None:
    if flat.numel():
        data = memoryview(flat.view(torch.uint8).numpy())
        digest.update(data)
        handle.write(data)


def write_tensor_bytes(handle, entry: TensorEntry, tensor: torch.Tensor, digest: "hashlib._Hash") -> None:
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
        raise ValueError(
            f"{entry.name}: produced {tensor.dtype} {tuple(tensor.shape)}, the header promised "
            f"{entry.dtype} {entry.shape}"
        )
    _write_flat(handle, tensor.detach().reshape(-1).contiguous().cpu(), digest)


def write_chunk_bytes(handle, entry: TensorEntry, chunks: Iterator[torch.Tensor], digest: "hashlib._Hash") -> None:
    """An entry's elements in order, a chunk at a time; together they must be exactly the entry."""
    written = 0
    for chunk in chunks:
        if chunk.dtype != entry.dtype or written + chunk.numel() > entry.numel:
            raise ValueError(f"{entry.name}: a chunk of {chunk.dtype} {chunk.numel()} elements after {written} does "
                             f"not fit the header's {entry.dtype} {entry.shape}")
        flat = chunk.detach().reshape(-1).contiguous().cpu()
        _write_flat(handle, flat, digest)
        written += flat.numel()
    if written != entry.numel:
        raise ValueError(f"{entry.name}: produced {written} elements, the header promised {entry.numel}")


def write_safetensors(path: str, entries: list[TensorEntry], metadata: dict[str, str] | None = None,
                      digests: dict[str, str] | None = None) -> int:
    """Write ``entries`` to ``path`` one tensor at a time (see [Note: streamed safetensors]),
    flushed to disk before returning. Returns the file's size in bytes; ``digests``, when
    given, receives the SHA-256 of each tensor's bytes as written (see [Note: verified loads])."""
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tensor names in {path}")
    with open(path, "wb") as handle:
        handle.write(encode_header(entries, metadata))
        for entry in entries:
            digest = hashlib.sha256()
            produced = entry.produce()
            if isinstance(produced, torch.Tensor):
                write_tensor_bytes(handle, entry, produced, digest)
            else:
                write_chunk_bytes(handle, entry, produced, digest)
            if digests is not None:
                digests[entry.name] = digest.hexdigest()
        handle.flush()
        os.fsync(handle.fileno())
    return os.path.getsize(path)


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_header(path: str) -> tuple[dict[str, dict], dict[str, str]]:
    """The tensors (name -> dtype, shape, data_offsets) and the metadata of a safetensors file,
    checked against the file's size so a truncated file is reported, not half-read."""
    header, metadata, _ = read_header_and_data_start(path)
    return header, metadata


def read_header_and_data_start(path: str) -> tuple[dict[str, dict], dict[str, str], int]:
    """:func:`read_header`, and where the data starts (tensor offsets count from there)."""
    with open(path, "rb") as handle:
        return read_open_header(handle, os.fstat(handle.fileno()).st_size)


def read_open_header(handle: BinaryIO, size: int) -> tuple[dict[str, dict], dict[str, str], int]:
    """:func:`read_header_and_data_start` of a file already open (``size`` bytes long)."""
    handle.seek(0)
    head = handle.read(8)
    if len(head) < 8:
        raise ValueError(f"{size} bytes: too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", head)
    if 8 + header_len > size:
        raise ValueError(f"header of {header_len} bytes runs past the end of the file ({size} bytes)")
    header = json.loads(handle.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    for name, spec in header.items():
        _check_spec(name, spec)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + header_len + end != size:
        raise ValueError(f"{size} bytes, but its header describes {8 + header_len + end}: the file is truncated or padded")
    return header, metadata, 8 + header_len


def _check_spec(name: str, spec: object) -> None:
    """A header entry safetensors itself would accept: a known dtype, a shape, and a byte range
    exactly the size of that shape in that dtype."""
    ok = (isinstance(spec, dict) and spec.get("dtype") in TAG_DTYPES and isinstance(spec.get("shape"), list)
          and isinstance(spec.get("data_offsets"), list) and len(spec["data_offsets"]) == 2
          and all(isinstance(v, int) and v >= 0 for v in spec["shape"] + spec["data_offsets"]))
    if not ok:
        raise ValueError(f"tensor {name!r} has a malformed header entry {spec!r}")
    numel = 1
    for dim in spec["shape"]:
        numel *= dim
    lo, hi = spec["data_offsets"]
    if hi - lo != numel * element_bytes(TAG_DTYPES[spec["dtype"]]):
        raise ValueError(f"tensor {name!r}: bytes [{lo}, {hi}) do not hold {spec['dtype']} {spec['shape']}")
