"""The checkpoint manifest: names, the JSON encoding of run state, RNG states, model description.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding ``manifest.json`` and one safetensors
file per data rank (``rank-00000-of-00002.safetensors``...), and ``<save_dir>/latest`` names the
newest tag. The manifest is the only place that says how the files fit together; it is plain
JSON (no pickle anywhere), readable by ``json.load`` and by a person.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import math
import os
import random
import re
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError, listed
from hf_zero.checkpoint.paths import is_plain_name, resolve_inside
from hf_zero.checkpoint.safetensors_io import DTYPE_TAGS
from hf_zero.partition import PARAM_ALIGNMENT, round_up

FORMAT = "hf_zero.checkpoint"
FORMAT_VERSION = 2  # 2: per-tensor dtype, shape and SHA-256 in "files"; rank and world size in each file
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
BUFFER_PREFIX = "buffer/"
PARAM_KEY = "param"
OPTIM_PREFIX = "optim."
_SMALL_TENSOR_NUMEL = 4096  # larger non-elementwise optimizer/scheduler tensors are refused
# The dtypes a manifest may name (small tensors and dtype values in run state): those a
# safetensors file holds. A name is looked up here, never on the torch module, so a manifest
# cannot make decoding return torch.load or any other attribute of torch.
STATE_DTYPES: dict[str, torch.dtype] = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPE_TAGS}
# JSON nested deeper than this is refused with one error instead of a RecursionError; hf_zero
# writes about 6 levels, and client_state is held to the same bound when it is saved.
MAX_JSON_DEPTH = 64
_LATEST_BYTES = 4096  # a tag name is short; a larger 'latest' is not one


def rank_file_name(index: int, count: int) -> str:
    return f"rank-{index:05d}-of-{count:05d}.safetensors"


def tensor_name(label: str, key: str) -> str:
    return f"{label}/{key}"


def check_tag(tag: str) -> None:
    """The rule for tags, on save and on load (see [Note: confined paths])."""
    if tag == LATEST_NAME or not is_plain_name(tag):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not usable as a directory name: use letters, digits and "
            "_ . + = @ - (not starting with '.' or '-', and not 'latest'), e.g. 'global_step100'"
        )


# --------------------------------------------------------------------------- JSON encoding
def encode_state(value: Any, path: str) -> Any:
    """Run state (scheduler, optimizer hyperparameters and scalars) as JSON: tuples, non-string
    keys, torch dtypes and small tensors are tagged so :func:`decode_state` restores them exactly."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.Tensor, torch.dtype)):
        _check_state_dtype(value.dtype if isinstance(value, torch.Tensor) else value, path)
    if isinstance(value, torch.Tensor):
        if value.numel() > _SMALL_TENSOR_NUMEL:
            raise CheckpointError(f"{path}: a tensor of {value.numel()} elements is too large for the manifest")
        return {"__tensor__": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                               "data": value.detach().cpu().reshape(-1).tolist()}}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_state(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_state(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: encode_state(v, f"{path}.{k}") for k, v in value.items()}
        return {"__items__": [[encode_state(k, path), encode_state(v, f"{path}[{k!r}]")] for k, v in value.items()]}
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise CheckpointError(
        f"{path}: a {type(value).__name__} cannot be stored in a checkpoint manifest (JSON only; "
        "tensors larger than a few thousand elements belong in the model or optimizer state)"
    )


def _check_state_dtype(dtype: torch.dtype, path: str) -> None:
    """Saving writes only what loading decodes (see STATE_DTYPES)."""
    if dtype not in DTYPE_TAGS:
        raise CheckpointError(f"{path}: dtype {dtype} cannot be stored in a checkpoint manifest "
                              f"(one of {', '.join(STATE_DTYPES)})")


def _state_dtype(name: Any, path: str) -> torch.dtype:
    if not isinstance(name, str) or name not in STATE_DTYPES:
        raise ValueError(f"{path}: {name!r:.80} is not a dtype a checkpoint holds (one of {', '.join(STATE_DTYPES)})")
    return STATE_DTYPES[name]


def _decode_tensor(spec: Any, path: str) -> torch.Tensor:
    """A small tensor of run state, its dtype from the closed list and its size bounded."""
    if not isinstance(spec, dict):
        raise ValueError(f"{path}.__tensor__ is not an object")
    dtype = _state_dtype(spec.get("dtype"), f"{path}.__tensor__.dtype")
    shape, data = spec.get("shape"), spec.get("data")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{path}.__tensor__.shape is {shape!r:.80}, not a list of sizes")
    numel = math.prod(shape)
    if numel > _SMALL_TENSOR_NUMEL or not isinstance(data, list) or len(data) != numel:
        raise ValueError(f"{path}.__tensor__: data of {type(data).__name__} does not hold the {numel} elements of "
                         f"shape {shape} (at most {_SMALL_TENSOR_NUMEL} in a manifest)")
    if not all(isinstance(x, (int, float)) for x in data):  # bool is an int; strings and objects are not numbers
        raise ValueError(f"{path}.__tensor__.data holds something other than numbers")
    try:
        return torch.tensor(data, dtype=dtype).reshape(shape)
    except (RuntimeError, OverflowError) as exc:  # a value out of the dtype's range
        raise ValueError(f"{path}.__tensor__.data does not fit {spec['dtype']}: {exc}") from exc


def decode_state(value: Any, path: str = "state") -> Any:
    """The inverse of :func:`encode_state`. Only data comes out: tensors and dtypes from
    STATE_DTYPES, tuples, dicts; a malformed tag raises ValueError naming ``path``, which
    :func:`manifest_errors` turns into a :class:`CheckpointError` naming the manifest."""
    if isinstance(value, list):
        return [decode_state(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return _decode_tensor(value["__tensor__"], path)
    if "__dtype__" in value:
        return _state_dtype(value["__dtype__"], f"{path}.__dtype__")
    if "__tuple__" in value:
        if not isinstance(value["__tuple__"], list):
            raise ValueError(f"{path}.__tuple__ is not a list")
        return tuple(decode_state(v, f"{path}[{i}]") for i, v in enumerate(value["__tuple__"]))
    if "__items__" in value:
        return _decode_items(value["__items__"], path)
    return {k: decode_state(v, f"{path}.{k}") for k, v in value.items()}


def _decode_items(items: Any, path: str) -> dict[Any, Any]:
    if not isinstance(items, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in items):
        raise ValueError(f"{path}.__items__ is not a list of [key, value] pairs")
    decoded = {}
    for key, item in items:
        key = decode_state(key, path)
        if not isinstance(key, (str, int, float, bool, type(None))):
            raise ValueError(f"{path}.__items__ has a key of type {type(key).__name__}")
        decoded[key] = decode_state(item, f"{path}[{key!r}]")
    return decoded


def param_group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Mapping[str, Any]:
    """The param group ``param`` steps in (by identity: tensors compare element-wise)."""
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise RuntimeError(f"a {tuple(param.shape)} master is in no param group of {type(optimizer).__name__}; "
                       "load checkpoints into the engine hf_zero.initialize built, whose optimizer holds every master")


def optimizer_value_on(param: torch.Tensor, key: Any, value: Any, param_group: Mapping[str, Any]) -> Any:
    """A decoded optimizer-state value placed exactly as ``torch.optim.Optimizer.load_state_dict``
    places it (``_process_value_according_to_param_policy``), so a resumed optimizer steps as
    one torch loaded itself: ``step`` stays where it was decoded (the CPU) unless the group is
    ``fused`` or ``capturable``, whose kernels read it on the parameter's device as float32
    (a CPU step makes a CUDA fused AdamW fail on its first step after a resume); any other
    tensor goes to the parameter's device, cast to its dtype when the parameter is floating.
    ``param_group`` is the group after the saved hyperparameters were applied: torch reads the
    flags from the saved groups too. Containers are walked as torch walks them."""
    if isinstance(value, torch.Tensor):
        if key == "step":
            special = param_group.get("fused", False) or param_group.get("capturable", False)
            return value.to(dtype=torch.float32, device=param.device) if special else value
        if param.is_floating_point():
            return value.to(dtype=param.dtype, device=param.device)
        return value.to(device=param.device)
    if isinstance(value, dict):
        return {k: optimizer_value_on(param, k, v, param_group) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(optimizer_value_on(param, None, v, param_group) for v in value)
    return value


def check_plain_json(value: Any, path: str = "client_state", depth: int = 0) -> None:
    """Refuse anything ``json.dumps`` would refuse, or loading would (deeper than
    MAX_JSON_DEPTH), naming where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if depth >= MAX_JSON_DEPTH - 2 and isinstance(value, (list, tuple, dict)):  # the manifest adds 2 levels
        raise CheckpointError(f"{path} is nested more than {MAX_JSON_DEPTH - 2} levels deep; flatten it "
                              "(a checkpoint manifest is refused past that depth when it is read)")
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain_json(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{path} has a key {key!r} of type {type(key).__name__}; JSON keys are strings")
            check_plain_json(item, f"{path}[{key!r}]", depth + 1)
        return
    raise CheckpointError(
        f"{path} is a {type(value).__name__}, which is not JSON: client_state must hold only dicts "
        "with string keys, lists, strings, numbers, booleans and None (convert tensors with .tolist())"
    )


# --------------------------------------------------------------------------- RNG states
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def capture_rng() -> dict[str, Any]:
    """This process's random generators: torch CPU (and CUDA if initialised), random, numpy."""
    state: dict[str, Any] = {"torch_cpu": _b64(torch.get_rng_state().numpy().tobytes())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    version, internal, gauss = random.getstate()
    state["python"] = [version, list(internal), gauss]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def restore_rng(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(_bytes_tensor(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda_states = [_bytes_tensor(s) for s in state["torch_cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# --------------------------------------------------------------------------- the model
def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict`` holds (non-persistent ones excluded), each once."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, sub in module.named_modules():
        for name, buf in sub._buffers.items():
            if buf is None or name in sub._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            found.append((f"{prefix}.{name}" if prefix else name, buf))
    return found


def parameter_aliases(module: nn.Module) -> dict[str, str]:
    """Tied weights: every other name of a parameter -> its first name (the checkpoint's)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def tied_weight_patterns(module: nn.Module) -> list[str]:
    """The names transformers drops when it saves tied weights (``_tied_weights_keys`` of every
    submodule, prefixed; a dict in transformers 5, a list before)."""
    patterns: list[str] = []
    for prefix, sub in module.named_modules():
        tied = getattr(sub, "_tied_weights_keys", None) or {}
        patterns += [f"{prefix}.{k}" if prefix else k for k in tied]
    return patterns


def tied_weight_names(module: nn.Module) -> list[str]:
    """The parameter names (every name of every parameter) that a pattern of
    :func:`tied_weight_patterns` finds, with ``re.search`` as transformers matches them. They are
    resolved here, from the model's own patterns, so that export compares names exactly and
    never runs a pattern read from a manifest (see [Note: manifest names are data] in export.py)."""
    patterns = [re.compile(pattern) for pattern in tied_weight_patterns(module)]
    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    return [name for name in names if any(pattern.search(name) for pattern in patterns)]


def _json_of(obj: Any, **kwargs: Any) -> dict[str, Any] | None:
    to_json = getattr(obj, "to_json_string", None)
    if to_json is None:
        return None
    try:
        return json.loads(to_json(**kwargs))
    except (TypeError, ValueError):
        return None


def describe_model(module: nn.Module) -> dict[str, Any]:
    """What export needs to write a Hugging Face folder without the model's code."""
    config = getattr(module, "config", None)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    return {
        "class": type(module).__name__,
        "config": _json_of(config, use_diff=False) if config is not None else None,
        "generation_config": (_json_of(generation, use_diff=True)
                              if generation is not None and callable(can_generate) and can_generate() else None),
        "aliases": parameter_aliases(module),
        "tied_weight_names": tied_weight_names(module),
        "tied_weight_keys": tied_weight_patterns(module),  # what hf_zero before tied_weight_names reads
        "keys_to_ignore_on_save": list(getattr(module, "_keys_to_ignore_on_save", None) or []),
        "buffers": [{"name": n, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape)}
                    for n, b in persistent_buffers(module)],
    }


# --------------------------------------------------------------------------- reading
def _confined_tag_dir(save_dir: str, name: str) -> str | None:
    """The real path of ``save_dir/name`` when it is a complete checkpoint inside ``save_dir``
    (links that leave are skipped, not followed: see [Note: confined paths])."""
    if not is_plain_name(name) or name == LATEST_NAME:
        return None
    try:
        tag_dir = resolve_inside(os.path.realpath(save_dir), name, name)
        manifest = resolve_inside(tag_dir, MANIFEST_NAME, name)
    except (CheckpointError, OSError):
        return None
    return tag_dir if os.path.isfile(manifest) else None


def list_tags(save_dir: str) -> list[str]:
    """Complete checkpoints in ``save_dir`` (temporary directories of unfinished saves excluded)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(name for name in os.listdir(save_dir) if _confined_tag_dir(save_dir, name) is not None)


def _tags_note(save_dir: str) -> str:
    tags = list_tags(save_dir)
    return f"checkpoints present: {', '.join(tags)}" if tags else "no complete checkpoint is present"


def read_latest(load_dir: str, root: str) -> str | None:
    """The tag ``load_dir/latest`` names; None when there is no ``latest``. Its content must be
    a tag name and nothing else (see [Note: confined paths])."""
    latest = os.path.join(load_dir, LATEST_NAME)
    if not os.path.isfile(resolve_inside(root, LATEST_NAME, latest)):
        return None
    try:
        with open(latest, "rb") as handle:
            raw = handle.read(_LATEST_BYTES + 1)
    except OSError as error:  # unreadable (permissions, an I/O error): a refusal like any other
        raise CheckpointError(f"{latest}: cannot be read ({error.strerror or error}); make it readable, or pass "
                              f"tag=... ({_tags_note(load_dir)})") from error
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = repr(raw[:40])
    if not tag:
        raise CheckpointError(f"{latest}: empty; pass tag=... ({_tags_note(load_dir)})")
    if len(raw) > _LATEST_BYTES or tag == LATEST_NAME or not is_plain_name(tag):
        raise CheckpointError(
            f"{latest}: holds {tag[:80]!r}, which is not a tag name (a folder name of letters, digits and "
            "_ . + = @ -; no '/', no '..', not an absolute path): it was edited or damaged; write the tag "
            f"of a checkpoint in {load_dir} into it, or pass tag=... ({_tags_note(load_dir)})"
        )
    return tag


def resolve_checkpoint_dir(load_dir: str | os.PathLike[str], tag: str | None) -> str:
    """The directory of the checkpoint to read: ``load_dir/tag``, ``load_dir/<latest>``, or
    ``load_dir`` itself when it is a checkpoint directory (it holds a manifest). The tag (given
    or read from ``latest``) obeys the rule of saving, and the tag folder resolves inside
    ``load_dir`` (see [Note: confined paths])."""
    load_dir = os.path.abspath(os.fspath(load_dir))
    if not os.path.isdir(load_dir):
        raise CheckpointNotFoundError(f"{load_dir}: no such checkpoint directory")
    root = os.path.realpath(load_dir)
    if tag is None:
        tag = read_latest(load_dir, root)
        if tag is None:
            if os.path.isfile(resolve_inside(root, MANIFEST_NAME, os.path.join(load_dir, MANIFEST_NAME))):
                return load_dir
            raise CheckpointNotFoundError(
                f"{os.path.join(load_dir, LATEST_NAME)}: not found, so there is no default tag; pass tag=... "
                f"({_tags_note(load_dir)})"
            )
    tag = str(tag)
    check_tag(tag)
    ckpt_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(resolve_inside(root, tag, ckpt_dir)):
        raise CheckpointNotFoundError(f"{ckpt_dir}: no checkpoint with tag {tag!r} in {load_dir} ({_tags_note(load_dir)})")
    if not os.path.isfile(os.path.join(ckpt_dir, MANIFEST_NAME)):
        raise CheckpointError(f"{os.path.join(ckpt_dir, MANIFEST_NAME)}: missing, so {ckpt_dir} is not a complete checkpoint")
    return ckpt_dir


_REQUIRED = ("format_version", "tag", "save_id", "world_size", "stage", "groups", "files", "model")


def _json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iterative: no recursion limit to hit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _load_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except RecursionError as exc:  # the decoder's own limit, before MAX_JSON_DEPTH is checked
        raise CheckpointError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep: not a manifest hf_zero wrote") from exc
    if _json_depth_exceeds(data, MAX_JSON_DEPTH):
        raise CheckpointError(f"{path}: nested more than {MAX_JSON_DEPTH} levels deep: not a manifest hf_zero wrote")
    return data


def check_format_version(version: Any, path: str, allow_unverified: bool) -> None:
    """Integrity is the reader's decision, not the file's: a manifest without per-tensor
    checksums (format 1, or a newer one downgraded by an edit) is refused unless the caller
    accepts loading unverified data by name."""
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise CheckpointError(
            f"{path}: format version {version!r:.40} is not one this hf_zero reads (1 to {FORMAT_VERSION}); "
            + ("upgrade hf_zero" if newer else "the manifest was edited or damaged")
        )
    if version < 2 and not allow_unverified:
        raise CheckpointError(
            f"{path}: format version {version} records no checksums, so its rank files cannot be verified (flipped "
            "bytes, NaNs or substituted weights would load); re-save it, or pass allow_unverified=True "
            "(hf-zero export --allow-unverified) to load it without verification at your own risk"
        )


def read_manifest(ckpt_dir: str, allow_unverified: bool = False) -> dict[str, Any]:
    """The checked manifest of ``ckpt_dir``: its structure (types, counts, plain file names)
    and its format (see :func:`check_format_version`)."""
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    resolve_inside(os.path.realpath(ckpt_dir), MANIFEST_NAME, path)
    try:
        manifest = _load_json(path)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path}: missing, so {ckpt_dir} is not a complete checkpoint") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable or not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hf_zero checkpoint manifest (no \"format\": \"{FORMAT}\")")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise CheckpointError(f"{path}: manifest lacks {missing}")
    check_format_version(manifest["format_version"], path, allow_unverified)
    problems = structure_problems(manifest)
    if problems:
        shown = listed(problems, 5)
        raise CheckpointError(f"{path}: malformed manifest (edited by hand or damaged): {shown}")
    return manifest


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _group_problems(index: int, group: Any, file_count: int) -> list[str]:
    where = f"groups[{index}]"
    if not isinstance(group, dict):
        return [f"{where} is not an object"]
    kinds = {"group": str, "trainable": bool, "slots": list, "tensors": dict}
    problems = [f"{where}.{key} is missing or not a {kind.__name__}"
                for key, kind in kinds.items() if not isinstance(group.get(key), kind)]
    world, padded = group.get("world_size"), group.get("padded_numel")
    if not _is_int(world, 1) or not _is_int(padded):
        return problems + [f"{where}: world_size {world!r} / padded_numel {padded!r} are not counts"]
    if world != file_count:
        problems.append(f"{where}.world_size is {world}, but the manifest lists {file_count} rank files")
    if padded % world:
        problems.append(f"{where}.padded_numel {padded} does not split in {world} equal shards")
    slots = group.get("slots") if isinstance(group.get("slots"), list) else []
    for k, slot in enumerate(slots):
        ok = (isinstance(slot, dict) and isinstance(slot.get("name"), str) and isinstance(slot.get("shape"), list)
              and _is_int(slot.get("offset")) and _is_int(slot.get("numel")))
        if not ok or slot["offset"] + slot["numel"] > padded:
            problems.append(f"{where}.slots[{k}] is malformed or lies outside the group ({slot!r:.80})")
    return problems or _layout_problems(where, group, slots)


# [Note: slots where the layout puts them]
# A slot's offset decides which elements of the rank files are its weights, and no checksum
# covers that mapping (the checksums are of each rank file's tensors, not of where a parameter
# starts in them). So the offsets must be those build_flat_layout gives the slots in the order
# listed: each slot starts where the one before it ends, or at most at the next multiple of
# PARAM_ALIGNMENT (older checkpoints lay parameters back to back); its numel is its shape's
# product and the group's numel their sum; a name has one slot in the whole manifest.
# Overlapping or swapped offsets (two parameters reading each other's weights) fail the first
# rule. Not caught: names swapped between two slots of one shape, whose offsets stay valid (the
# order of the slots is not the model's to check: an import lists them in DeepSpeed's order).
def _layout_problems(where: str, group: dict[str, Any], slots: list[dict[str, Any]]) -> list[str]:
    """The slots laid out as :func:`hf_zero.partition.build_flat_layout` lays them out: see
    [Note: slots where the layout puts them]."""
    problems, end = [], 0
    for k, slot in enumerate(slots):
        shape = slot["shape"]
        if not all(_is_int(d) for d in shape) or math.prod(shape) != slot["numel"]:
            problems.append(f"{where}.slots[{k}] ({slot['name']!r:.60}) has numel {slot['numel']}, its shape "
                            f"{shape!r:.40} holds {math.prod(shape) if all(_is_int(d) for d in shape) else '?'}")
        elif not end <= slot["offset"] <= round_up(end, PARAM_ALIGNMENT):
            problems.append(f"{where}.slots[{k}] ({slot['name']!r:.60}) starts at {slot['offset']}: the layout puts it "
                            f"at {round_up(end, PARAM_ALIGNMENT)}, after the slot before it, which ends at {end}")
        end = slot["offset"] + slot["numel"]
    numel = group.get("numel")
    if not problems and numel is not None and numel != sum(slot["numel"] for slot in slots):
        problems.append(f"{where}.numel is {numel!r:.20}, its slots hold {sum(slot['numel'] for slot in slots)}")
    return problems


def structure_problems(manifest: dict[str, Any]) -> list[str]:
    """What makes a manifest unusable before any file is opened: wrong types, counts that
    disagree, slots outside their group (a hand edit, a half-written copy)."""
    files, groups = manifest["files"], manifest["groups"]
    if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and _is_int(f.get("bytes")) for f in files):
        return ["files must be a list of {\"name\", \"bytes\"} objects"]
    outside = [f"files[{i}].name {f['name']!r:.80}" for i, f in enumerate(files) if not is_plain_name(f["name"])]
    if outside:  # refused before any lookup: see [Note: confined paths]
        return [f"{', '.join(outside[:3])} is not a plain file name inside the checkpoint folder (no '/', no '..', "
                "not absolute)"]
    if not isinstance(groups, list):
        return ["groups must be a list"]
    if manifest["format_version"] >= 2 and not all(isinstance(f.get("tensors"), dict) for f in files):
        return ["files[*].tensors (dtype, shape, sha256 of each tensor) is missing"]
    problems = []
    for index, group in enumerate(groups):
        problems += _group_problems(index, group, len(files) if groups else 0)
    if not problems:
        counts = collections.Counter(slot["name"] for group in groups for slot in group["slots"])
        repeated = sorted(name for name, count in counts.items() if count > 1)
        if repeated:
            problems.append(f"slot names {repeated[:3]!r:.120} appear more than once (each parameter has one slot)")
    if not isinstance(manifest["model"], dict) or not isinstance(manifest["model"].get("class"), str):
        problems.append("model.class is missing")
    return problems


@contextlib.contextmanager
def manifest_errors(ckpt_dir: str) -> Iterator[None]:
    """Inside the block, a manifest that does not hold what it should (a key missing, a value of
    the wrong type) raises a :class:`CheckpointError` naming it instead of a bare KeyError."""
    try:
        yield
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CheckpointError(
            f"{os.path.join(ckpt_dir, MANIFEST_NAME)}: malformed manifest (edited by hand or damaged): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
