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
rule, resolved to names at save time); a tie the model does not declare is written under every
name. What the manifest says is checked first (see [Note: manifest names are data]).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import string
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from hf_zero.checkpoint.errors import CheckpointError, listed
from hf_zero.checkpoint.manifest import (
    BUFFER_PREFIX, MANIFEST_NAME, PARAM_KEY, STATE_DTYPES, manifest_errors, parameter_aliases, persistent_buffers,
    read_manifest, resolve_checkpoint_dir, tensor_name,
)
from hf_zero.checkpoint.reader import RankFiles, check_every_tensor
from hf_zero.checkpoint.reshard import SavedSlot, index_saved_slots, plan_pieces
from hf_zero.checkpoint.safetensors_io import TensorEntry, write_safetensors
from hf_zero.checkpoint.staging import staged_directory
from hf_zero.skeleton import parameter_limit

logger = logging.getLogger("hf_zero")

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SHARD_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_EXPORT_FILES = {"model.safetensors.index.json", "config.json", "generation_config.json"}
_PLAIN_PATTERN_CHARS = frozenset(string.ascii_letters + string.digits + "_.")
_MAX_PATTERN_CHARS = 512
_MAX_LISTED = 10  # problems or differences shown in one error
_SKIP_HINT = ("if you trust this checkpoint (its model changed after it was built from its config: resized "
              "embeddings, an added head, adapters), pass check_model=False (hf-zero export --skip-model-check) "
              "to export the names and shapes it records")

# [Note: manifest names are data]
# The manifest is untrusted input (docs/failure-handling.md) and export has no model to hold it
# against, so nothing in it is executed or looked up by name, and what it says is checked before
# anything is written:
# - Tied weights are recorded as names (``tied_weight_names``: the model's own
#   ``_tied_weights_keys`` patterns resolved at save time) and compared exactly. A manifest
#   written before holds only the patterns; those are accepted when they are plain dotted names
#   and matched as ``re.search`` matches them ('.' any character) by a shift-and scan, one pass
#   over the name: a pattern from a file never reaches a regex engine, where ``(.*.*)*Q``
#   backtracks for minutes.
# - Types, shapes and dtypes (from a closed list, never ``getattr(torch, name)``) are validated
#   in one error that lists every problem.
# - Names and shapes are compared with the model the config describes: its class, looked up
#   among transformers' PreTrainedModel subclasses only, built on the meta device. The config's
#   dtype and attention/experts implementation are left out of that build: no shape depends on
#   them, and transformers would look a dtype name up on torch and fetch a kernel by name.


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or "5GB" / "500MB" / "2GiB" (GB = 10^9 as in transformers)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '5GB', '500MB', '2GiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def plain_pattern(pattern: Any) -> bool:
    """Whether export matches this ``tied_weight_keys`` entry of an old manifest."""
    return (isinstance(pattern, str) and 0 < len(pattern) <= _MAX_PATTERN_CHARS
            and set(pattern) <= _PLAIN_PATTERN_CHARS)


def pattern_found_in(pattern: str, name: str) -> bool:
    """``re.search(pattern, name)`` for a plain pattern ('.' any character but a newline, the
    rest literal), without a regex engine: shift-and, one pass over ``name`` (bit i of ``state``
    set: the pattern's first i + 1 characters end at the current character)."""
    if not pattern:
        return True
    accepts: dict[str, int] = {}
    anything = 0
    for i, char in enumerate(pattern):
        if char == ".":
            anything |= 1 << i
        else:
            accepts[char] = accepts.get(char, 0) | 1 << i
    whole, state = 1 << (len(pattern) - 1), 0
    for char in name:
        state = ((state << 1) | 1) & (accepts.get(char, 0) | (anything if char != "\n" else 0))
        if state & whole:
            return True
    return False


def _tied_names(model: dict[str, Any], names: list[str]) -> set[str]:
    """Those of ``names`` that ``save_pretrained`` drops from a tie (see [Note: manifest names are data])."""
    if "tied_weight_names" in model:
        return set(model["tied_weight_names"]) & set(names)
    patterns = model.get("tied_weight_keys", [])
    refused = [p for p in patterns if not plain_pattern(p)]
    if refused:  # export_hf_model refuses them first; the matcher equals re.search on plain names only
        raise ValueError(f"model.tied_weight_keys holds {refused[0]!r:.80}, not a plain parameter name")
    return {n for n in names if any(pattern_found_in(p, n) for p in patterns)}


def export_names(slot_name: str, model: dict[str, Any]) -> list[str]:
    """The names one saved parameter is written under (see [Note: streamed export])."""
    names = sorted([slot_name] + [a for a, canonical in model.get("aliases", {}).items() if canonical == slot_name])
    if len(names) > 1:
        tied = _tied_names(model, names)
        matching = [n for n in names if n in tied]
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
            self.files.unmap()  # the pages read stay resident while a file is mapped
        return out.view(slot.shape)

    def buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        try:
            return self.files.read(0, BUFFER_PREFIX + name).to(dtype)
        finally:
            self.files.unmap()


def _plan_entries(manifest: dict[str, Any], streamer: _Streamer, dtype: torch.dtype) -> list[TensorEntry]:
    model = manifest["model"]
    entries: list[TensorEntry] = []
    for record in manifest["groups"]:
        for slot in record["slots"]:
            for out_name in export_names(slot["name"], model):
                entries.append(TensorEntry(out_name, dtype, tuple(slot["shape"]),
                                           lambda n=slot["name"]: streamer.parameter(n, dtype)))
    for buf in model.get("buffers", []):
        saved_dtype = STATE_DTYPES[buf["dtype"]]  # a closed list: see [Note: manifest names are data]
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


# --------------------------------------------------------------------------- checking the manifest
def _is_string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in value)


def _listed(items: list[str]) -> str:
    return listed(items, _MAX_LISTED)


def _slot_problems(groups: list[dict[str, Any]]) -> list[str]:
    """Each slot's shape holds its elements (types and ranges are read_manifest's checks)."""
    return [f"groups[{g}].slots[{k}] ({slot['name']!r:.80}): shape {slot['shape']!r:.80} does not hold its "
            f"{slot['numel']} elements"
            for g, group in enumerate(groups) for k, slot in enumerate(group["slots"])
            if not _is_shape(slot["shape"]) or math.prod(slot["shape"]) != slot["numel"]]


def _name_list_problems(model: dict[str, Any]) -> list[str]:
    problems = [f"model.{key} is {model[key]!r:.80}, not a list of strings"
                for key in ("tied_weight_names", "tied_weight_keys", "keys_to_ignore_on_save")
                if key in model and not _is_string_list(model[key])]
    if "tied_weight_names" in model or problems:
        return problems
    return [f"model.tied_weight_keys[{i}] is {pattern!r:.80}, not a plain parameter name (letters, digits, '_' "
            f"and '.', 1 to {_MAX_PATTERN_CHARS} characters): export runs no pattern from a file; re-save the "
            "checkpoint with this hf_zero, which records the tied names themselves"
            for i, pattern in enumerate(model.get("tied_weight_keys", [])) if not plain_pattern(pattern)]


def _alias_problems(aliases: Any, saved: set[str]) -> list[str]:
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        return [f"model.aliases is {aliases!r:.80}, not an object of parameter names"]
    return [f"model.aliases[{alias!r:.80}] is {canonical!r:.80}, which is not a saved parameter"
            for alias, canonical in aliases.items() if canonical not in saved]


def _buffer_problems(buffers: Any) -> list[str]:
    if not isinstance(buffers, list):
        return [f"model.buffers is {buffers!r:.80}, not a list"]
    problems = []
    for i, buf in enumerate(buffers):
        if not isinstance(buf, dict) or not isinstance(buf.get("name"), str):
            problems.append(f"model.buffers[{i}] is {buf!r:.80}, not an object with a name")
            continue
        dtype = buf.get("dtype")
        if not isinstance(dtype, str) or dtype not in STATE_DTYPES:
            problems.append(f"model.buffers[{i}].dtype is {dtype!r:.40}, not a dtype a checkpoint holds "
                            f"(one of {', '.join(STATE_DTYPES)})")
        if not _is_shape(buf.get("shape")):
            problems.append(f"model.buffers[{i}].shape is {buf.get('shape')!r:.80}, not a list of sizes "
                            "(integers >= 0)")
    return problems


def _repeated_names(manifest: dict[str, Any]) -> list[str]:
    """Every exported name once: a name recorded twice would be two tensors of one file."""
    model = manifest["model"]
    names = ([s["name"] for group in manifest["groups"] for s in group["slots"]] + list(model.get("aliases", {}))
             + [b["name"] for b in model.get("buffers", [])])
    seen: set[str] = set()
    repeated: list[str] = []
    for name in names:
        if name in seen:
            repeated.append(name)
        seen.add(name)
    return [f"{name!r:.80} is recorded more than once (as a parameter, an alias or a buffer)" for name in repeated]


def _export_problems(manifest: dict[str, Any]) -> list[str]:
    model = manifest["model"]
    saved = {s["name"] for group in manifest["groups"] for s in group["slots"]}
    problems = (_slot_problems(manifest["groups"]) + _name_list_problems(model)
                + _alias_problems(model.get("aliases", {}), saved) + _buffer_problems(model.get("buffers", [])))
    problems += [f"model.{key} is {model.get(key)!r:.80}, not an object" for key in ("config", "generation_config")
                 if not isinstance(model.get(key), (dict, type(None)))]
    return problems or _repeated_names(manifest)  # names are compared once their types are right


def check_export_manifest(manifest: dict[str, Any], path: str) -> None:
    """What export reads from the model description, validated in one error before anything is
    written (see [Note: manifest names are data])."""
    problems = _export_problems(manifest)
    if problems:
        raise CheckpointError(f"{path}: malformed manifest (edited by hand or damaged); nothing was written: "
                              f"{_listed(problems)}")


# --------------------------------------------------------------------------- checking against the model
def _model_class(name: str) -> tuple[type[nn.Module] | None, str]:
    """The transformers model class ``name`` names, or None and why not. Only transformers'
    PreTrainedModel subclasses are looked up (its lazy module imports its own submodules only):
    a name read from a file imports nothing else."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    if not name.isidentifier() or name.startswith("_"):
        return None, f"{name[:80]!r} is not a transformers model class"
    try:
        cls = getattr(transformers, name, None)
    except Exception as exc:  # that model's module failed to import: an optional dependency is missing
        return None, f"transformers could not import {name} ({type(exc).__name__}: {exc!s:.200})"
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None, f"{name[:80]!r} is not a transformers model class"
    return cls, ""


_UNSHAPED_KEYS = frozenset({"attn_implementation", "_attn_implementation", "_attn_implementation_internal",
                            "experts_implementation", "_experts_implementation", "_experts_implementation_internal"})


def _shape_config(value: Any) -> Any:
    """The config without what changes no shape but names something transformers looks up or
    fetches: a dtype name (``getattr(torch, name)``), an attention or experts implementation (a
    kernel from the Hub). See [Note: manifest names are data]."""
    if isinstance(value, list):
        return [_shape_config(item) for item in value]
    if not isinstance(value, dict):
        return value
    return {key: _shape_config(item) for key, item in value.items()
            if key not in _UNSHAPED_KEYS and not (key in ("dtype", "torch_dtype") and isinstance(item, str))}


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """The skeleton is built for its names only: the config warnings were shown when the model was built."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def _skeleton(cls: type[nn.Module], config: dict[str, Any], limit: int, path: str) -> nn.Module:
    """The model ``config`` describes, on the meta device (no memory for its weights)."""
    try:
        budget = parameter_limit(limit, "far more than the checkpoint holds")
        with _quiet_transformers(), budget, torch.device("meta"):
            return cls._from_config(cls.config_class.from_dict(_shape_config(config)))  # type: ignore[attr-defined]
    except Exception as exc:  # transformers' own code on values from a file: any error is the file's
        raise CheckpointError(
            f"{path}: model.config does not build a {cls.__name__} to check the checkpoint's names and shapes "
            f"against ({type(exc).__name__}: {exc!s:.300}); nothing was written; {_SKIP_HINT}"
        ) from exc


def _saved_state(manifest: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every name the checkpoint records (tied names included) and its shape."""
    model = manifest["model"]
    state = {s["name"]: tuple(s["shape"]) for group in manifest["groups"] for s in group["slots"]}
    state.update({alias: state[canonical] for alias, canonical in model.get("aliases", {}).items()})
    state.update({b["name"]: tuple(b["shape"]) for b in model.get("buffers", [])})
    return state


def _model_state(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """What a save of ``module`` records: the rule of describe_model and save_checkpoint."""
    state = {name: tuple(p.shape) for name, p in module.named_parameters(remove_duplicate=False)}
    state.update({name: tuple(b.shape) for name, b in persistent_buffers(module)})
    return state


def _state_differences(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> list[str]:
    differences = []
    for name in sorted(expected.keys() | found.keys()):
        want, got = expected.get(name), found.get(name)
        if got is None:
            differences.append(f"{name}: missing (the model has {list(want or ())})")
        elif want is None:
            differences.append(f"{name} {list(got)}: not in the model")
        elif want != got:
            differences.append(f"{name}: the model has {list(want)}, the checkpoint {list(got)}")
    return differences


def _tied_with(aliases: dict[str, str]) -> dict[str, frozenset[str]]:
    groups: dict[str, set[str]] = {}
    for alias, canonical in aliases.items():
        groups.setdefault(canonical, {canonical}).add(alias)
    return {name: frozenset(group) for group in groups.values() for name in group}


def _tie_differences(expected: dict[str, str], found: dict[str, str]) -> list[str]:
    """Names that share a weight differently: an alias edited in would export one weight under a
    name whose own weight the checkpoint no longer holds."""
    want, got = _tied_with(expected), _tied_with(found)
    return [f"{name}: shares its weight with {sorted(got.get(name, {name}) - {name})} in the checkpoint, "
            f"with {sorted(want.get(name, {name}) - {name})} in the model"
            for name in sorted(want.keys() | got.keys()) if want.get(name) != got.get(name)]


def check_against_model(manifest: dict[str, Any], path: str) -> None:
    """The checkpoint's names, shapes and ties equal those of the model its config describes
    (see [Note: manifest names are data]); a warning when no model definition is at hand."""
    model = manifest["model"]
    if model.get("config") is None:
        cls, why = None, "the checkpoint has no Hugging Face config"
    else:
        cls, why = _model_class(model["class"])
    if cls is None:
        logger.warning("hf_zero: export cannot check the checkpoint's parameter names and shapes against a model "
                       "definition (%s); they are written as %s records them", why, path)
        return
    named, expected = model["config"].get("model_type"), getattr(cls.config_class, "model_type", "")
    if expected and named != expected:
        raise CheckpointError(
            f"{path}: model.config names model_type {named!r}, but its class {cls.__name__} is a {expected!r} model: "
            "the manifest was edited or damaged, and the folder written would not load with AutoModel; nothing "
            "was written"
        )
    saved = _saved_state(manifest)
    # A build registers each parameter once (a tied one twice): 4x the checkpoint's names and a
    # margin stop only a config that describes a far larger model.
    skeleton = _skeleton(cls, model["config"], 4 * len(saved) + 1024, path)
    differences = (_state_differences(_model_state(skeleton), saved)
                   + _tie_differences(parameter_aliases(skeleton), model.get("aliases", {})))
    if differences:
        raise CheckpointError(
            f"{path}: the checkpoint's parameters do not match the {cls.__name__} its config describes "
            f"({len(differences)} difference{'s' if len(differences) > 1 else ''}: {_listed(differences)}): the "
            f"manifest was edited or damaged, or the model was changed after it was built from its config; nothing "
            f"was written; {_SKIP_HINT}"
        )


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


def _check_config_loads(staging: str, out_dir: str, manifest: dict[str, Any]) -> None:
    """The config written loads with ``AutoConfig`` as the config of the class named (checked in
    the staging folder, so a previous export stays in place when it does not)."""
    if manifest["model"].get("config") is None:
        return
    try:
        from transformers import AutoConfig
    except ImportError:
        return
    cls, _ = _model_class(manifest["model"]["class"])
    try:
        with _quiet_transformers():
            config = AutoConfig.from_pretrained(staging, trust_remote_code=False)
    except Exception as exc:  # transformers' own code on values from a file: any error is the file's
        raise CheckpointError(
            f"export to {out_dir}: the config.json written does not load with AutoConfig ({type(exc).__name__}: "
            f"{exc!s:.300}); the manifest's model.config was edited or damaged; "
            f"{'the previous export there is untouched' if os.path.isdir(out_dir) else 'nothing was written'}"
        ) from exc
    if cls is not None and not isinstance(config, cls.config_class):
        raise CheckpointError(
            f"export to {out_dir}: the config.json written loads as a {type(config).__name__}, not the "
            f"{cls.config_class.__name__} of {cls.__name__}; the manifest's model.config was edited or damaged; "
            f"{'the previous export there is untouched' if os.path.isdir(out_dir) else 'nothing was written'}"
        )


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _check_apart(out_dir: str, source: str) -> None:
    """The export folder and the checkpoint must not hold each other, followed through links: an
    export into its own checkpoint (or a link to it) would replace or hard-link the files it reads."""
    out_real, source_real = os.path.realpath(out_dir), os.path.realpath(source)
    if out_real == source_real or source_real.startswith(out_real + os.sep):
        raise CheckpointError(f"{out_dir}: the export directory contains the checkpoint {source}; choose another")
    if out_real.startswith(source_real + os.sep):
        raise CheckpointError(f"{out_dir}: the export directory is inside the checkpoint {source}; choose a folder "
                              "outside it")


def export_hf_model(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str = "fp32",
    max_shard_size: int | str = "5GB",
    allow_unverified: bool = False,
    check_model: bool = True,
) -> str:
    """Write ``out_dir`` as a Hugging Face model folder (``config.json``, ``model.safetensors`` or
    shards plus ``model.safetensors.index.json``) from the checkpoint ``ckpt_dir`` (a save
    directory with ``latest``, or one checkpoint directory) without the model's code and without
    holding more than one parameter in memory (see [Note: streamed export]). ``dtype`` is
    "fp32", "bf16" or "fp16". An existing ``out_dir`` is replaced only once the new export is
    complete (see [Note: staged export]). A checkpoint without per-tensor checksums (format 1)
    is refused unless ``allow_unverified=True`` (see [Note: verified loads]). The manifest's names,
    shapes and ties are compared with the transformers model its config describes (built on the
    meta device) unless ``check_model=False``, for a model changed after it was built from its
    config (see [Note: manifest names are data]). Returns ``out_dir``."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(EXPORT_DTYPES)}")
    torch_dtype = EXPORT_DTYPES[dtype]
    source = resolve_checkpoint_dir(ckpt_dir, tag)
    manifest = _checked_manifest(source, allow_unverified, check_model)
    files = RankFiles(source, manifest, allow_unverified)
    with manifest_errors(source):
        _check_rank_files(files, manifest)
        streamer = _Streamer(files, index_saved_slots(manifest["groups"]))
        entries = _plan_entries(manifest, streamer, torch_dtype)
    shards = _split(entries, parse_size(max_shard_size))
    out_dir = os.path.abspath(os.fspath(out_dir))
    _check_apart(out_dir, source)
    try:
        with staged_directory(out_dir, _produced_by_export) as staging:
            _write_export(staging, shards, manifest, torch_dtype)
            _check_config_loads(staging, out_dir, manifest)
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


def _checked_manifest(source: str, allow_unverified: bool, check_model: bool) -> dict[str, Any]:
    """The manifest, refused before anything is written unless what export reads from it holds
    (see [Note: manifest names are data])."""
    try:
        manifest = read_manifest(source, allow_unverified)
    except CheckpointError as exc:
        raise type(exc)(f"{exc}; nothing was written") from exc
    path = os.path.join(source, MANIFEST_NAME)
    check_export_manifest(manifest, path)
    if check_model:
        check_against_model(manifest, path)
    else:
        logger.warning("hf_zero: export writes the parameter names and shapes %s records without comparing them "
                       "with a model (check_model=False)", path)
    return manifest


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
