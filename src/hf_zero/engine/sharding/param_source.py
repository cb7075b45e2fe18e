"""Where the values of not-yet-materialised (meta) parameters come from.

A model loaded while a stage-3 config is alive has its parameters on the meta device and carries
a :class:`SafetensorsSource` (``model._hf_zero_param_source``). The flat groups then read, for
each parameter, only the element range they need (under stage 3: this rank's shard) straight
from the memory-mapped safetensors files, so the full model never exists in one process.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:
    from hf_zero.comm import Communicator

SOURCE_ATTRIBUTE = "_hf_zero_param_source"


class ParamSource(Protocol):
    def fill_(self, name: str, shape: tuple[int, ...], start: int, stop: int, out: torch.Tensor) -> None:
        """Write elements [start, stop) of the flattened parameter ``name`` into ``out``."""

    def has(self, name: str) -> bool: ...

    @property
    def description(self) -> str:
        """Where the values come from, for log lines."""


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

    def keys(self) -> list[str]:
        """Every tensor name in the files, as stored."""
        return list(self._entries)

    def stored_shape(self, name: str) -> tuple[int, ...] | None:
        key = self.key_for(name)
        return None if key is None else self._entries[key][2]

    @property
    def description(self) -> str:
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} files in {os.path.dirname(self.files[0])}"

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


class InitSource:
    """Parameter values made by the model's own initialisation, one module at a time: what
    ``from_config`` under a live stage-3 config reads from instead of files.

    [Note: sharded initialisation]
    A plain ``from_config`` builds and initialises every parameter on every rank. Here the model
    is built on the meta device; when a rank needs a range of a parameter, the module that owns
    it is copied (a meta copy, no values), given real storage and initialised by ``init_module``
    (transformers' ``_init_weights``), and the range is taken from the copy. At most one module's
    own parameters are real at a time, so no rank holds the whole model. Every rank must draw the
    same values: each module's initialisation runs under a seed made of one base seed (rank 0's,
    see :meth:`agree_across_ranks`) and the module's index, whatever order ranks read in.
    """

    def __init__(self, model: torch.nn.Module, init_module: Callable[[str, torch.nn.Module], Any],
                 base_seed: int) -> None:
        self.init_module = init_module
        self.base_seed = base_seed
        self._owner: dict[str, tuple[int, str, str]] = {}  # parameter -> (module index, module, attribute)
        self._modules = dict(model.named_modules())
        for index, (module_name, module) in enumerate(model.named_modules()):
            for attribute, _ in module.named_parameters(recurse=False):
                full = f"{module_name}.{attribute}" if module_name else attribute
                self._owner.setdefault(full, (index, module_name, attribute))
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def has(self, name: str) -> bool:
        return name in self._owner

    @property
    def description(self) -> str:
        return "the model's own initialisation"

    def agree_across_ranks(self, comm: Communicator, device: torch.device) -> None:
        """Take rank 0's base seed (ranks may have been seeded differently)."""
        seed = torch.tensor([self.base_seed], dtype=torch.int64, device=device)
        comm.broadcast_(seed, src=0, label="init_seed")
        self.base_seed = int(seed.item())

    def _initialised(self, module_name: str, index: int) -> dict[str, torch.Tensor]:
        if self._cached is None or self._cached[0] != module_name:
            self._cached = None  # drop the previous module's values first
            copy_ = _bare_copy(self._modules[module_name])
            copy_.to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(self.base_seed + index)
                self.init_module(module_name, copy_)
            self._cached = (module_name, dict(copy_.named_parameters(recurse=False)))
        return self._cached[1]

    def fill_(self, name: str, shape: tuple[int, ...], start: int, stop: int, out: torch.Tensor) -> None:
        index, module_name, attribute = self._owner[name]
        value = self._initialised(module_name, index)[attribute]
        out.copy_(value.detach().reshape(-1)[start:stop])


def _bare_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``module`` with new meta parameters of the same shapes in place of its
    own, its buffers, and its children replaced by ``Identity``: what its initialisation needs.
    Not a deep copy: some of the module's parameters may be sharded already (a Linear whose
    weight went to a sharded group and whose bias, small, to a persistent one, as in Qwen2's
    attention), and a sharded parameter's values cannot be read, not even to copy them."""
    import copy

    bare = copy.copy(module)
    bare._parameters = {
        name: None if param is None else torch.nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
        for name, param in module._parameters.items()}
    bare._buffers = dict(module._buffers)
    bare._modules = {name: torch.nn.Identity() for name in module._modules}
    return bare
