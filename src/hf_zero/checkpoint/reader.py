"""Reading a checkpoint's rank files: verified once, then read slice by slice.

[Note: verified loads]
A load is all-or-nothing: nothing in the engine changes until every byte it will read has been
checked. Each rank file records in its safetensors metadata the rank whose shards it holds, the
number of rank files and the save it belongs to; the manifest records, per file, its size and
each tensor's dtype, shape and SHA-256 (hashed as the bytes were written, so saving reads
nothing twice). Before a load or an export applies anything, every tensor it will read is
checked: the file is the one the manifest lists at that rank (not swapped, not from another
save), the header's dtype and shape are the manifest's, the bytes hash to the recorded digest
(flipped bytes, swapped offsets, data from elsewhere), and parameters and optimizer state are
finite (a run that diverged before it saved). Every error names the file, the tensor and what
differed. A file is verified and read through one open: its header and the bytes hashed are
read from one handle, and the safetensors handle the data is read through is opened while that
one is held and is checked to be the same file (device and inode), so a file replaced between
the two (a re-save of the same tag, which publishes new files) is refused as changed during the
load instead of read unverified. A load opens every file it reads before it applies anything.
Verifying reads the data once more than loading does (the page cache usually serves the second
read). Whether data must be verified is the reader's decision, never the file's: a
tensor the manifest records no digest for (format 1) is refused unless the caller passed
``allow_unverified=True``, and even then its values are checked to be finite. Each file's path
is resolved inside the checkpoint folder before it is looked at (see [Note: confined paths]).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open

from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from hf_zero.checkpoint.manifest import BUFFER_PREFIX, MANIFEST_NAME
from hf_zero.checkpoint.paths import is_plain_name, resolve_inside
from hf_zero.checkpoint.safetensors_io import TAG_DTYPES, read_open_header

logger = logging.getLogger("hf_zero")
_VERIFY_CHUNK_BYTES = 16 << 20  # a multiple of every element size


def _nonfinite(path: str, name: str) -> CheckpointError:
    return CheckpointError(f"{path}: tensor {name!r} holds inf or nan values: the run had diverged when it was "
                           "saved; load an earlier checkpoint")


class RankFiles:
    """The rank files of one checkpoint. :meth:`check` verifies tensors of a file against the
    manifest (see [Note: verified loads]); :meth:`read` returns a slice of one tensor without
    reading the rest (``safe_open(...).get_slice``). Handles stay open until :meth:`close`;
    export calls :meth:`unmap` after every parameter so that no more than one parameter's pages
    stay mapped."""

    def __init__(self, ckpt_dir: str, manifest: Mapping[str, Any], allow_unverified: bool = False) -> None:
        self.ckpt_dir = ckpt_dir
        self.manifest = manifest
        self.allow_unverified = allow_unverified  # see [Note: verified loads]
        self._root = os.path.realpath(ckpt_dir)
        self._confined: set[int] = set()
        self.headers: dict[int, dict[str, dict]] = {}
        self._data_start: dict[int, int] = {}
        self._verified: set[tuple[int, str]] = set()
        self._held: dict[int, Any] = {}  # index -> the open file verified through
        self._identity: dict[int, tuple[int, int]] = {}  # index -> (device, inode) of that file
        self._open: dict[int, Any] = {}  # index -> the safetensors handle data is read through

    def path(self, index: int) -> str:
        files = self.manifest["files"]
        manifest_path = os.path.join(self.ckpt_dir, MANIFEST_NAME)
        if not 0 <= index < len(files):
            raise CheckpointError(f"{manifest_path}: no rank file {index}")
        name = files[index]["name"]
        if not is_plain_name(name):  # read_manifest refuses these; a manifest built by hand may not have been read
            raise CheckpointError(f"{manifest_path}: files[{index}].name {name!r:.80} is not a plain file name inside "
                                  "the checkpoint folder (no '/', no '..', not absolute)")
        path = os.path.join(self.ckpt_dir, name)
        if index not in self._confined:
            resolve_inside(self._root, name, path)
            self._confined.add(index)
        return path

    def check(self, index: int, expected: Mapping[str, int]) -> None:
        """Raise a :class:`CheckpointError` naming the file unless it holds every tensor in
        ``expected`` (name -> numel) intact: see [Note: verified loads]."""
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
            self._verify(index, path, name, spec)

    def all_tensor_names(self, index: int) -> list[str]:
        """The tensors the manifest lists for rank file ``index`` (format 2), else the header's."""
        recorded = self.manifest["files"][index].get("tensors")
        if recorded is not None:
            return list(recorded)
        path = self.path(index)
        if index not in self.headers:
            self.headers[index] = self._check_file(index, path)
        return list(self.headers[index])

    def _check_file(self, index: int, path: str) -> dict[str, dict]:
        if not os.path.isfile(path):
            raise CheckpointNotFoundError(f"{path}: rank file missing (the checkpoint is incomplete or was moved in part)")
        try:
            handle = open(path, "rb")
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be opened ({exc.strerror or exc})") from exc
        self._held[index] = handle
        status = os.fstat(handle.fileno())
        self._identity[index] = (status.st_dev, status.st_ino)
        recorded = self.manifest["files"][index]["bytes"]
        if status.st_size != recorded:
            raise CheckpointError(f"{path}: {status.st_size} bytes on disk, the manifest records {recorded}: the file is "
                                  "truncated or was replaced")
        try:
            header, metadata, data_start = read_open_header(handle, status.st_size)
            self._open[index] = safe_open(path, framework="pt", device="cpu")  # the reader accepts it too
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
        self._check_unchanged(index, path)
        if metadata.get("save_id") != self.manifest["save_id"]:
            raise CheckpointError(
                f"{path}: written by another save (save id {metadata.get('save_id')!r}, the manifest's is "
                f"{self.manifest['save_id']!r}): files from different checkpoints were mixed, or the checkpoint was "
                "saved again while it was read (then load it again)"
            )
        count = len(self.manifest["files"])
        if metadata.get("rank") != str(index) or metadata.get("world_size", str(count)) != str(count):
            raise CheckpointError(
                f"{path}: holds the shards of rank {metadata.get('rank')} of {metadata.get('world_size', '?')}, but "
                f"the manifest lists it as rank {index} of {count}: rank files were renamed or swapped"
            )
        self._data_start[index] = data_start
        return header

    def _verify(self, index: int, path: str, name: str, spec: Mapping[str, Any]) -> None:
        if (index, name) in self._verified:
            return
        recorded = (self.manifest["files"][index].get("tensors") or {}).get(name)
        if recorded is None:
            self._check_unverified(index, path, name, spec)
        else:
            if spec["dtype"] != recorded["dtype"] or list(spec["shape"]) != list(recorded["shape"]):
                raise CheckpointError(
                    f"{path}: tensor {name!r} is {spec['dtype']} {spec['shape']} in the file's header, the manifest "
                    f"records {recorded['dtype']} {recorded['shape']}: the header was altered"
                )
            digest, finite = self._hash(index, path, spec, check_finite=not name.startswith(BUFFER_PREFIX))
            if digest != recorded["sha256"]:
                raise CheckpointError(
                    f"{path}: tensor {name!r} does not match its checksum (SHA-256 {digest[:16]}..., the manifest "
                    f"records {recorded['sha256'][:16]}...): the file is corrupted; restore it from a copy or load another checkpoint"
                )
            if not finite:
                raise _nonfinite(path, name)
        self._verified.add((index, name))

    def _check_unverified(self, index: int, path: str, name: str, spec: Mapping[str, Any]) -> None:
        """A tensor without a recorded digest: refused unless the caller accepted the risk, and
        then at least finite."""
        if self.manifest.get("format_version") != 1:
            raise CheckpointError(f"{path}: tensor {name!r} is not listed in the manifest")
        if not self.allow_unverified:
            raise CheckpointError(
                f"{path}: tensor {name!r} has no checksum in the manifest, so it cannot be verified; load "
                "another checkpoint, or pass allow_unverified=True if this one is known to be intact"
            )
        logger.warning("hf_zero: %s: format 1 checkpoint, %s is not checksummed (allow_unverified=True)", path, name)
        _, finite = self._hash(index, path, spec, check_finite=not name.startswith(BUFFER_PREFIX))
        if not finite:
            raise _nonfinite(path, name)

    def _hash(self, index: int, path: str, spec: Mapping[str, Any], check_finite: bool) -> tuple[str, bool]:
        dtype = TAG_DTYPES[spec["dtype"]]
        check_finite = check_finite and dtype.is_floating_point
        lo, hi = spec["data_offsets"]
        digest, finite = hashlib.sha256(), True
        handle = self._held[index]
        handle.seek(self._data_start[index] + lo)
        remaining = hi - lo
        while remaining > 0:
            chunk = handle.read(min(remaining, _VERIFY_CHUNK_BYTES))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
            if check_finite and finite:
                finite = bool(torch.isfinite(torch.frombuffer(bytearray(chunk), dtype=dtype)).all())
        return digest.hexdigest(), finite

    def _check_unchanged(self, index: int, path: str) -> None:
        """The file at ``path`` is still the one verified (see [Note: verified loads])."""
        try:
            status = os.stat(path)
            now = (status.st_dev, status.st_ino)
        except OSError:
            now = None
        if now != self._identity[index]:
            raise CheckpointError(f"{path}: changed during the load (the checkpoint was saved again or replaced while "
                                  "it was read); nothing of it was used: load it again once the save has finished")

    def dtype(self, index: int, name: str) -> torch.dtype:
        return TAG_DTYPES[self.headers[index][name]["dtype"]]

    def read(self, index: int, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` (or all) of a tensor of a checked file, from the file checked."""
        handle = self._open.get(index)
        if handle is None:
            if index not in self._identity:
                raise CheckpointError(f"{self.path(index)}: read before it was checked")
            path = self.path(index)
            handle = self._open[index] = safe_open(path, framework="pt", device="cpu")
            self._check_unchanged(index, path)
        if lo is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[lo:hi]

    def unmap(self) -> None:
        """Drop the mapped handles (the pages read stay resident while a file is mapped); the
        files verified stay open, so a later read is checked to come from them."""
        self._open.clear()

    def close(self) -> None:
        self.unmap()
        for handle in self._held.values():
            handle.close()
        self._held.clear()


def check_every_tensor(files: RankFiles, indices: Iterable[int]) -> None:
    """Verify every tensor of the given rank files (export reads them all)."""
    for index in indices:
        names = files.all_tensor_names(index)
        files.check(index, {name: _numel(files, index, name) for name in names})


def _numel(files: RankFiles, index: int, name: str) -> int:
    recorded = (files.manifest["files"][index].get("tensors") or {}).get(name)
    shape = recorded["shape"] if recorded is not None else files.headers[index][name]["shape"]
    count = 1
    for dim in shape:
        count *= dim
    return count

