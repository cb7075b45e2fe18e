"""Turn what the user passed (a path, inline JSON, a Mapping) into a plain, private dict.

JSON is parsed with Python's json module, which reads ``Infinity`` as transformers / Accelerate
write it (``"steps_per_print": Infinity``). Text that is not strict JSON is read as hjson, as
DeepSpeed reads every config (``hjson.load``): comments (``//``, ``#``, ``/* */``), trailing
commas, unquoted keys. hjson comes second because it reads some strict JSON differently: an
unquoted ``Infinity`` starts a quoteless string that runs to the end of its line. Duplicate
keys are problems in both (DeepSpeed rejects them too), because the second one silently wins
otherwise.

A config is untrusted input: a file that is not UTF-8, JSON the parser cannot take (too deep for
its recursion, an integer of 5000 digits) and nesting deeper than MAX_DEPTH (a dict passed in
Python included, even one that contains itself) are problems like any other, never a traceback.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import MISSING, ProblemList, one_line

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_KEYS", "load_config"]

# DeepSpeed's deepest config is 3 levels (zero_optimization.offload_param.device); the opaque
# sections hf_zero passes through (compression_training, ...) reach about 6. 64 is far above any
# real config and far below Python's recursion limit (1000), which every later walk relies on.
# The checkpoint manifest has the same bound.
MAX_DEPTH = 64
# Bounds on the work a hostile file can cause before any rule is checked: DeepSpeed's configs are
# a few KB and under 200 keys; every key past the known ones costs a suggestion search.
MAX_CONFIG_BYTES = 1 << 20
MAX_KEYS = 10_000
_TOO_DEEP = f"nests more than {MAX_DEPTH} levels deep (no DeepSpeed config goes beyond a few)"
_TOO_DEEP_FIX = "flatten it: a config is a few levels of objects; check the file was not generated wrongly"


class _Object(dict[str, Any]):
    """A parsed JSON object that remembers keys it saw twice."""

    duplicates: list[str]


def _object_pairs(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _to_plain(value: Any, path: str, problems: ProblemList) -> Any:
    """Deep-copy into plain dicts and lists, so the caller's objects are never touched."""
    if isinstance(value, Mapping):
        for key in getattr(value, "duplicates", []):
            problems.add(_join(path, key), MISSING, "is given twice (the last one would silently win)", "keep one")
        plain: dict[str, Any] = {}
        for key, inner in value.items():
            if not isinstance(key, str):
                problems.add(_join(path, str(key)), inner, "keys must be strings", f"write the key as {str(key)!r}")
                continue
            plain[key] = _to_plain(inner, _join(path, key), problems)
        return plain
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    return value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _too_deep(value: Any) -> str | None:
    """The key path of the first container nested deeper than MAX_DEPTH, or None.

    Iterative, so a 100k-deep dict (or one that contains itself) costs MAX_DEPTH levels of a list,
    not a RecursionError.
    """
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, keys = stack.pop()
        if not isinstance(node, (Mapping, list, tuple)):
            continue
        if len(keys) >= MAX_DEPTH:  # the root is level 1, so this container is level MAX_DEPTH + 1
            return ".".join(keys).replace(".[", "[")
        if isinstance(node, Mapping):
            stack.extend((inner, (*keys, str(key))) for key, inner in node.items())
        else:
            stack.extend((inner, (*keys, f"[{i}]")) for i, inner in enumerate(node))
    return None


def _key_count(value: Any) -> int:
    """Keys in every object of a tree already bounded in depth (iterative, as _too_deep)."""
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            count += len(node)
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return count


def _parse(text: str, source: str, problems: ProblemList) -> Any:
    try:
        try:
            return json.loads(text, object_pairs_hook=_object_pairs)
        except json.JSONDecodeError as err:
            return _parse_hjson(text, source, err, problems)
    except RecursionError:  # each parser recurses once per level; past ~1000 it gives up
        problems.add(source, MISSING, _TOO_DEEP, _TOO_DEEP_FIX)
    except ValueError as err:  # e.g. an integer of more than 4300 digits (sys.set_int_max_str_digits)
        problems.add(source, MISSING, f"cannot be read as JSON: {one_line(str(err))}", "fix the value there")
    return None


def _parse_hjson(text: str, source: str, json_error: json.JSONDecodeError, problems: ProblemList) -> Any:
    """``text``, which is not strict JSON, read as hjson; when that fails too, one problem with
    both parsers' complaints (strict JSON's points at a typo in plain JSON, hjson's at one in a
    file with comments)."""
    import hjson  # imported only for a config that is not strict JSON

    try:
        return hjson.loads(text, object_pairs_hook=_object_pairs)
    except hjson.HjsonDecodeError as err:
        problems.add(
            source,
            MISSING,
            f"is not valid JSON: {json_error.msg} at line {json_error.lineno} column {json_error.colno} "
            f"(nor hjson, which DeepSpeed also reads: {err.msg} at line {err.lineno} column {err.colno})",
            "fix the JSON there (comments, trailing commas and unquoted keys are accepted, as in DeepSpeed)",
        )
    return None


def _read(path: Path, problems: ProblemList) -> Any:
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                problems.add(str(path), MISSING, "is not a regular file (a directory, a FIFO or a device)",
                             "pass the path of a JSON file")
                return None
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        fix = "check the path (relative paths start at the working directory)"
        problems.add(str(path), MISSING, "config file not found", fix)
        return None
    except OSError as err:
        rule = f"config file cannot be read: {err.strerror or err}"
        problems.add(str(path), MISSING, rule, "check the path and its permissions")
        return None
    if len(data) > MAX_CONFIG_BYTES:
        problems.add(str(path), MISSING, f"is larger than {MAX_CONFIG_BYTES >> 20} MiB (a DeepSpeed config is a few KB)",
                     "pass the config file itself; check the file was not generated wrongly")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        rule = f"is not UTF-8 text: byte 0x{data[err.start]:02x} at byte offset {err.start} (line {line})"
        problems.add(str(path), MISSING, rule, "save the file as UTF-8 (JSON files are UTF-8)")
        return None
    if not text.strip():
        problems.add(str(path), MISSING, "is empty", "write the settings as a JSON object ({} for DeepSpeed's defaults)")
        return None
    return _parse(text, str(path), problems)


def load_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str, ProblemList]:
    """Return (plain dict, source name for messages, problems)."""
    problems = ProblemList()
    if isinstance(config, Mapping):
        source, parsed = "<dict>", config
    elif isinstance(config, str) and config.lstrip().startswith("{"):
        # TrainingArguments accepts an inline JSON dict on the command line; so do we.
        source, parsed = "<inline JSON>", _parse(config, "<inline JSON>", problems)
    elif isinstance(config, (str, os.PathLike)):
        source = str(config)
        parsed = _read(Path(config), problems)
    else:
        raise TypeError(
            f"HfZeroConfig expects a path to a JSON file, a dict or an HfZeroConfig; got {type(config).__name__}"
        )
    if parsed is None:
        if not problems:  # the file holds JSON null
            problems.add(source, None, "the config is null", "write the settings as a JSON object {...}")
        return {}, source, problems
    if not isinstance(parsed, Mapping):
        problems.add(source, type(parsed).__name__, "the config must be a JSON object", "wrap the settings in {...}")
        return {}, source, problems
    deep = _too_deep(parsed)
    if deep is not None:  # before _to_plain, which recurses
        problems.add(deep, MISSING, _TOO_DEEP, _TOO_DEEP_FIX)
        return {}, source, problems
    keys = _key_count(parsed)
    if keys > MAX_KEYS:
        problems.add(source, MISSING, f"has {keys} keys, more than {MAX_KEYS} (a DeepSpeed config has a few dozen)",
                     "pass the config itself; check it was not generated wrongly")
        return {}, source, problems
    return _to_plain(parsed, "", problems), source, problems
