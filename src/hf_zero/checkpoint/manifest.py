"""The checkpoint manifest: names, the JSON encoding of run state, RNG states, model description.

A checkpoint is a directory ``<save_dir>/<tag>/`` holding ``manifest.json`` and one safetensors
file per data rank (``rank-00000-of-00002.safetensors``...), and ``<save_dir>/latest`` names the
newest tag. The manifest is the only place that says how the files fit together; it is plain
JSON (no pickle anywhere), readable by ``json.load`` and by a person.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from hf_zero.checkpoint.errors import CheckpointError, CheckpointNotFoundError

FORMAT = "hf_zero.checkpoint"
FORMAT_VERSION = 2  # 2: per-tensor dtype, shape and SHA-256 in "files"; rank and world size in each file
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
BUFFER_PREFIX = "buffer/"
PARAM_KEY = "param"
OPTIM_PREFIX = "optim."
_SMALL_TENSOR_NUMEL = 4096  # larger non-elementwise optimizer/scheduler tensors are refused
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]*$")


def rank_file_name(index: int, count: int) -> str:
    return f"rank-{index:05d}-of-{count:05d}.safetensors"


def tensor_name(label: str, key: str) -> str:
    return f"{label}/{key}"


def check_tag(tag: str) -> None:
    if tag == LATEST_NAME or not _TAG_RE.match(tag):
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


def decode_state(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        spec = value["__tensor__"]
        dtype = getattr(torch, spec["dtype"])
        return torch.tensor(spec["data"], dtype=dtype).reshape(spec["shape"])
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__tuple__" in value:
        return tuple(decode_state(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {decode_state(k): decode_state(v) for k, v in value["__items__"]}
    return {k: decode_state(v) for k, v in value.items()}


def optimizer_value_on(device: torch.device, key: str, value: Any) -> Any:
    """A decoded optimizer-state value, placed as torch keeps it: the 0-d ``step`` on the CPU
    (unless capturable), other tensors with the parameter they belong to."""
    return value.to(device) if isinstance(value, torch.Tensor) and key != "step" else value


def check_plain_json(value: Any, path: str = "client_state") -> None:
    """Refuse anything ``json.dumps`` would refuse, naming where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain_json(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{path} has a key {key!r} of type {type(key).__name__}; JSON keys are strings")
            check_plain_json(item, f"{path}[{key!r}]")
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
        "tied_weight_keys": tied_weight_patterns(module),
        "keys_to_ignore_on_save": list(getattr(module, "_keys_to_ignore_on_save", None) or []),
        "buffers": [{"name": n, "dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape)}
                    for n, b in persistent_buffers(module)],
    }


# --------------------------------------------------------------------------- reading
def list_tags(save_dir: str) -> list[str]:
    """Complete checkpoints in ``save_dir`` (temporary directories of unfinished saves excluded)."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(
        name for name in os.listdir(save_dir)
        if not name.startswith(".") and os.path.isfile(os.path.join(save_dir, name, MANIFEST_NAME))
    )


def _tags_note(save_dir: str) -> str:
    tags = list_tags(save_dir)
    return f"checkpoints present: {', '.join(tags)}" if tags else "no complete checkpoint is present"


def resolve_checkpoint_dir(load_dir: str | os.PathLike[str], tag: str | None) -> str:
    """The directory of the checkpoint to read: ``load_dir/tag``, ``load_dir/<latest>``, or
    ``load_dir`` itself when it is a checkpoint directory (it holds a manifest)."""
    load_dir = os.path.abspath(os.fspath(load_dir))
    if not os.path.isdir(load_dir):
        raise CheckpointNotFoundError(f"{load_dir}: no such checkpoint directory")
    if tag is None:
        latest = os.path.join(load_dir, LATEST_NAME)
        if not os.path.isfile(latest):
            if os.path.isfile(os.path.join(load_dir, MANIFEST_NAME)):
                return load_dir
            raise CheckpointNotFoundError(
                f"{latest}: not found, so there is no default tag; pass tag=... ({_tags_note(load_dir)})"
            )
        with open(latest, encoding="utf-8") as handle:
            tag = handle.read().strip()
        if not tag:
            raise CheckpointError(f"{latest}: empty; pass tag=... ({_tags_note(load_dir)})")
    ckpt_dir = os.path.join(load_dir, str(tag))
    if not os.path.isdir(ckpt_dir):
        raise CheckpointNotFoundError(f"{ckpt_dir}: no checkpoint with tag {tag!r} in {load_dir} ({_tags_note(load_dir)})")
    if not os.path.isfile(os.path.join(ckpt_dir, MANIFEST_NAME)):
        raise CheckpointError(f"{os.path.join(ckpt_dir, MANIFEST_NAME)}: missing, so {ckpt_dir} is not a complete checkpoint")
    return ckpt_dir


_REQUIRED = ("format_version", "tag", "save_id", "world_size", "stage", "groups", "files", "model")


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"{path}: missing, so {ckpt_dir} is not a complete checkpoint") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable or not JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an hf_zero checkpoint manifest (no \"format\": \"{FORMAT}\")")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise CheckpointError(f"{path}: manifest lacks {missing}")
    if not isinstance(manifest["format_version"], int) or manifest["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {manifest['format_version']!r} is not one this hf_zero reads "
            f"(1 to {FORMAT_VERSION}); upgrade hf_zero"
        )
    problems = structure_problems(manifest)
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
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
    for k, slot in enumerate(group.get("slots") if isinstance(group.get("slots"), list) else []):
        ok = (isinstance(slot, dict) and isinstance(slot.get("name"), str) and isinstance(slot.get("shape"), list)
              and _is_int(slot.get("offset")) and _is_int(slot.get("numel")))
        if not ok or slot["offset"] + slot["numel"] > padded:
            problems.append(f"{where}.slots[{k}] is malformed or lies outside the group ({slot!r:.80})")
    return problems


def structure_problems(manifest: dict[str, Any]) -> list[str]:
    """What makes a manifest unusable before any file is opened: wrong types, counts that
    disagree, slots outside their group (a hand edit, a half-written copy)."""
    files, groups = manifest["files"], manifest["groups"]
    if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and _is_int(f.get("bytes")) for f in files):
        return ["files must be a list of {\"name\", \"bytes\"} objects"]
    if not isinstance(groups, list):
        return ["groups must be a list"]
    if manifest["format_version"] >= 2 and not all(isinstance(f.get("tensors"), dict) for f in files):
        return ["files[*].tensors (dtype, shape, sha256 of each tensor) is missing"]
    problems = []
    for index, group in enumerate(groups):
        problems += _group_problems(index, group, len(files) if groups else 0)
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
