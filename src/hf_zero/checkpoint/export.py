"""Export a checkpoint to a plain Hugging Face model folder, one parameter at a time.

[Note: streamed export]
``zero_to_fp32`` builds the whole fp32 state dict in one process (PR #4025 needed more than 1 TB
of RAM for 80B). Here every output file's header is planned from the manifest alone (names,
shapes, the output dtype), then each parameter is assembled from its slices in the rank files,
cast, written and dropped (see [Note: streamed safetensors]), and the rank files are unmapped
after each parameter. Peak memory is about two copies of the largest parameter (its slices and
the assembled tensor), whatever the model's size: less than one unit.

Names are the model's parameter names (transformers' in-memory format, which ``from_pretrained``
loads). Tied weights are written once, under the name ``save_pretrained`` keeps: of the names of
one tied parameter, those matching the model's ``_tied_weights_keys`` are dropped (transformers'
rule, recorded at save time); a tie the model does not declare is written under every name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch

from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.checkpoint.manifest import (
    BUFFER_PREFIX, PARAM_KEY, manifest_errors, read_manifest, resolve_checkpoint_dir, tensor_name,
)
from hf_zero.checkpoint.reader import RankFiles, check_every_tensor
from hf_zero.checkpoint.reshard import SavedSlot, index_saved_slots, plan_pieces
from hf_zero.checkpoint.safetensors_io import TensorEntry, write_safetensors
from hf_zero.checkpoint.staging import staged_directory

logger = logging.getLogger("hf_zero")

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_EXPORT_FILES = {"model.safetensors.index.json", "config.json", "generation_config.json"}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or "5GB" / "500MB" / "2GiB" (GB = 10^9 as in transformers)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '5GB', '500MB', '2GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def export_names(slot_name: str, model: dict[str, Any]) -> list[str]:
    """The names one saved parameter is written under (see [Note: streamed export])."""
    names = sorted([slot_name] + [a for a, canonical in model.get("aliases", {}).items() if canonical == slot_name])
    if len(names) > 1:
        patterns = model.get("tied_weight_keys", [])
        matching = [n for n in names if any(re.search(p, n) for p in patterns)]
        if matching:
            dropped = set(matching[:-1]) if len(matching) == len(names) else set(matching)
            names = [n for n in names if n not in dropped]
    ignored = set(model.get("keys_to_ignore_on_save", []))
    return [n for n in names if n not in ignored]


class _Streamer:
    """Assembles one parameter at a time from its slices in the rank files."""

    def __init__(self, files: RankFiles, saved: dict[str, SavedSlot]) -> None:
        self.files = files
        self.saved = saved

    def parameter(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        slot = self.saved[name]
        pieces = plan_pieces([{"name": name, "offset": 0, "numel": slot.numel}], (0, slot.numel), self.saved)
        out = torch.empty(slot.numel, dtype=dtype)
        try:
            for piece in pieces:
                data = self.files.read(piece.file_index, tensor_name(piece.label, PARAM_KEY), piece.src_lo, piece.src_hi)
                out[piece.dst_lo:piece.dst_hi].copy_(data)
        finally:
            self.files.close()  # unmap: the pages read stay resident while a file is mapped
        return out.view(slot.shape)

    def buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        try:
            return self.files.read(0, BUFFER_PREFIX + name).to(dtype)
        finally:
            self.files.close()


def _plan_entries(manifest: dict[str, Any], streamer: _Streamer, dtype: torch.dtype) -> list[TensorEntry]:
    model = manifest["model"]
    entries: list[TensorEntry] = []
    for record in manifest["groups"]:
        for slot in record["slots"]:
            for out_name in export_names(slot["name"], model):
                entries.append(TensorEntry(out_name, dtype, tuple(slot["shape"]),
                                           lambda n=slot["name"]: streamer.parameter(n, dtype)))
    for buf in model.get("buffers", []):
        saved_dtype = getattr(torch, buf["dtype"])
        out_dtype = dtype if saved_dtype.is_floating_point else saved_dtype
        entries.append(TensorEntry(buf["name"], out_dtype, tuple(buf["shape"]),
                                   lambda n=buf["name"], d=out_dtype: streamer.buffer(n, d)))
    return entries


def _check_rank_files(files: RankFiles, manifest: dict[str, Any]) -> None:
    """Every tensor of every rank file verified (see [Note: verified loads]), and the ones
    export reads present with the manifest's sizes."""
    expected: dict[int, dict[str, int]] = {}
    for record in manifest["groups"]:
        shard_numel = record["padded_numel"] // record["world_size"]
        for index in range(record["world_size"]):
            expected.setdefault(index, {})[tensor_name(record["group"], PARAM_KEY)] = shard_numel
    buffers = manifest["model"].get("buffers", [])
    if buffers:
        expected.setdefault(0, {}).update({BUFFER_PREFIX + b["name"]: _numel(b["shape"]) for b in buffers})
    for index in sorted(expected):
        files.check(index, expected[index])
    check_every_tensor(files, range(len(manifest["files"])))


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _split(entries: list[TensorEntry], max_bytes: int) -> list[list[TensorEntry]]:
    """Greedy, in order, like transformers: a tensor larger than the limit gets a file of its own."""
    shards: list[list[TensorEntry]] = [[]]
    used = 0
    for entry in entries:
        if shards[-1] and used + entry.nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += entry.nbytes
    return shards


def _write_config(out_dir: str, manifest: dict[str, Any], dtype: torch.dtype) -> None:
    model = manifest["model"]
    if model.get("config") is None:
        logger.warning("hf_zero: the checkpoint has no Hugging Face config (a %s); export writes weights only", model["class"])
        return
    config = dict(model["config"], architectures=[model["class"]])
    config["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    _write_json(os.path.join(out_dir, "config.json"), config)
    if model.get("generation_config"):
        _write_json(os.path.join(out_dir, "generation_config.json"), model["generation_config"])


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def export_hf_model(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: int | str = "5GB",
    allow_unverified: bool = False,
) -> str:
    """Write ``out_dir`` as a Hugging Face model folder (``config.json``, ``model.safetensors`` or
    shards plus ``model.safetensors.index.json``) from the checkpoint ``ckpt_dir`` (a save
    directory with ``latest``, or one checkpoint directory) without the model's code and without
    holding more than one parameter in memory (see [Note: streamed export]). ``dtype`` is
    "fp32", "bf16" or "fp16". An existing ``out_dir`` is replaced only once the new export is
    complete (see [Note: staged export]). A checkpoint without per-tensor checksums (format 1)
    is refused unless ``allow_unverified=True`` (see [Note: verified loads]). Returns ``out_dir``."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    source = resolve_checkpoint_dir(ckpt_dir, tag)
    manifest = read_manifest(source, allow_unverified)
    files = RankFiles(source, manifest, allow_unverified)
    with manifest_errors(source):
        _check_rank_files(files, manifest)
        streamer = _Streamer(files, index_saved_slots(manifest["groups"]))
        entries = _plan_entries(manifest, streamer, torch_dtype)
    shards = _split(entries, parse_size(max_shard_size))
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.abspath(source).startswith(out_dir + os.sep) or os.path.abspath(source) == out_dir:
        raise CheckpointError(f"{out_dir}: the export directory contains the checkpoint {source}; choose another")
    try:
        with staged_directory(out_dir, _produced_by_export) as staging:
            _write_export(staging, shards, manifest, torch_dtype)
    except OSError as exc:  # a full disk, a read-only mount: see [Note: staged export]
        raise CheckpointError(
            f"export to {out_dir} failed: {exc.strerror or exc} ({type(exc).__name__}); "
            f"{'the previous export there is untouched' if os.path.isdir(out_dir) else 'nothing was written'} "
            "and the partial files were removed (the new export is written beside the old one, so it needs "
            "room for both)"
        ) from exc
    finally:
        files.close()
    return out_dir


def _produced_by_export(name: str) -> bool:
    """Entries of a previous export that a new one replaces (other files are carried over)."""
    return bool(_SHARD_RE.match(name)) or name in _EXPORT_FILES


def _write_export(out_dir: str, shards: list[list[TensorEntry]], manifest: dict[str, Any], dtype: torch.dtype) -> None:
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, entries in zip(names, shards):
        write_safetensors(os.path.join(out_dir, name), entries, {"format": "pt"})
    if len(shards) > 1:
        weight_map = {e.name: name for name, entries in zip(names, shards) for e in entries}
        total = sum(e.nbytes for entries in shards for e in entries)
        params = sum(s["numel"] for record in manifest["groups"] for s in record["slots"])
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map})
    _write_config(out_dir, manifest, dtype)
