"""Reading a checkpoint's rank files: checked once, then read slice by slice."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from safetensors import safe_open

from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from hf_zero.checkpoint.manifest import MANIFEST_NAME
from hf_zero.checkpoint.safetensors_io import TAG_DTYPES, read_header


class RankFiles:
    """The rank files of one checkpoint. :meth:`check` validates a file against the manifest
    (present, the size the manifest records, a readable header, written by the same save, the
    tensors expected); :meth:`read` returns a slice of one tensor without reading the rest
    (``safe_open(...).get_slice``). Handles stay open until :meth:`close`: export closes them
    after every unit so that no more than one unit's pages stay mapped."""

    def __init__(self, ckpt_dir: str, manifest: Mapping[str, Any]) -> None:
        self.ckpt_dir = ckpt_dir
        self.manifest = manifest
        self.headers: dict[int, dict[str, dict]] = {}
        self._open: dict[int, Any] = {}

    def path(self, index: int) -> str:
        files = self.manifest["files"]
        if not 0 <= index < len(files):
            raise CheckpointError(f"{os.path.join(self.ckpt_dir, MANIFEST_NAME)}: no rank file {index}")
        return os.path.join(self.ckpt_dir, files[index]["name"])

    def check(self, index: int, expected: Mapping[str, int]) -> None:
        """Raise a :class:`CheckpointError` naming the file unless it holds every tensor in
        ``expected`` (name -> numel)."""
        path = self.path(index)
        if index not in self.headers:
            self.headers[index] = self._check_file(index, path)
        header = self.headers[index]
        for name, numel in expected.items():
            spec = header.get(name)
            if spec is None:
                raise CheckpointError(f"{path}: tensor {name!r} is missing (the manifest expects it)")
            found = 1
            for dim in spec["shape"]:
                found *= dim
            if found != numel:
                raise CheckpointError(f"{path}: tensor {name!r} has {found} elements, the manifest expects {numel}")

    def _check_file(self, index: int, path: str) -> dict[str, dict]:
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{path}: rank file missing (the checkpoint is incomplete or was moved in part)")
        recorded = self.manifest["files"][index]["bytes"]
        size = os.path.getsize(path)
        if size != recorded:
            raise CheckpointError(f"{path}: {size} bytes on disk, the manifest records {recorded}: the file is truncated or was replaced")
        try:
            header, metadata = read_header(path)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
        if metadata.get("save_id") != self.manifest["save_id"]:
            raise CheckpointError(
                f"{path}: written by another save (save id {metadata.get('save_id')!r}, the manifest's is "
                f"{self.manifest['save_id']!r}): files from different checkpoints were mixed"
            )
        return header

    def dtype(self, index: int, name: str) -> torch.dtype:
        return TAG_DTYPES[self.headers[index][name]["dtype"]]

    def read(self, index: int, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        handle = self._open.get(index)
        if handle is None:
            handle = self._open[index] = safe_open(self.path(index), framework="pt", device="cpu")
        if lo is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[lo:hi]

    def close(self) -> None:
        self._open.clear()
