"""Value kinds: the type rule of one config key, and the normalisation DeepSpeed applies to it.

Each kind's `coerce(value)` returns the normalised value or raises `BadValue(rule, fix)`. The
rules are strict where DeepSpeed is loose in ways that hide mistakes (`"stage": "3"`, `"enabled":
"true"`, `1` for a boolean) and as loose as DeepSpeed where it is harmless: an integer written as a
float (`5e8`) is an integer, as pydantic reads it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BadValue",
    "Kind",
    "Bool",
    "Int",
    "Float",
    "FloatOrList",
    "Choice",
    "Str",
    "StrList",
    "Betas",
    "Anything",
    "Opaque",
    "Section",
    "StepsPerPrint",
]


class BadValue(Exception):
    """Raised by a kind when a value breaks its rule."""

    def __init__(self, rule: str, fix: str) -> None:
        super().__init__(rule)
        self.rule = rule
        self.fix = fix


def _number_in_string(value: str) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _plain(number: float) -> str:
    """`5e8` -> `500000000`, `0.0003` -> `0.0003`: how to write a number in the fix text."""
    return str(int(number)) if float(number).is_integer() else repr(float(number))


class Kind:
    """Base class; `label` is the type as written in the docs and errors."""

    label = "value"

    def coerce(self, value: Any) -> Any:
        raise NotImplementedError


class Bool(Kind):
    label = "bool"

    def coerce(self, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            word = value.strip().lower()
            raise BadValue("must be a JSON boolean, not a string", f"write {word} without quotes")
        if isinstance(value, (int, float)) and value in (0, 1):
            word = "true" if value else "false"
            raise BadValue("must be true or false, not a number", f"write {word}")
        raise BadValue(f"must be true or false, got {type(value).__name__}", "write true or false")


class Int(Kind):
    label = "int"

    def coerce(self, value: Any) -> int:
        if isinstance(value, bool):
            raise BadValue("must be an integer, not a boolean", "write a whole number")
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value) and value.is_integer():
                return int(value)  # 5e8 in JSON is a float; DeepSpeed (pydantic) reads it as int.
            example = int(value) if math.isfinite(value) else 1
            raise BadValue("must be a whole number", f"write a whole number, e.g. {example}")
        if isinstance(value, str):
            number = _number_in_string(value)
            if number is not None and number.is_integer():
                raise BadValue("must be a number, not a string", f"use {_plain(number)} (without quotes)")
        raise BadValue(f"must be an integer, got {type(value).__name__}", "write a whole number")


class Float(Kind):
    label = "float"

    def coerce(self, value: Any) -> float | int:
        if isinstance(value, bool):
            raise BadValue("must be a number, not a boolean", "write a number")
        if isinstance(value, (int, float)):
            if isinstance(value, float) and not math.isfinite(value):
                raise BadValue("must be a finite number", "write a finite number")
            return value  # kept as written (0 stays 0) so to_dict() round-trips.
        if isinstance(value, str):
            number = _number_in_string(value)
            if number is not None:
                raise BadValue("must be a number, not a string", f"use {value.strip()} (without quotes)")
        raise BadValue(f"must be a number, got {type(value).__name__}", "write a number")


class FloatOrList(Kind):
    """A number, or one number per optimizer parameter group (DeepSpeed's warmup LRs)."""

    label = "float | list[float]"

    def coerce(self, value: Any) -> float | int | list[float | int]:
        if isinstance(value, (list, tuple)) and value:
            return [Float().coerce(v) for v in value]
        return Float().coerce(value)


class Choice(Kind):
    """One of a fixed set of strings; `case_insensitive` where DeepSpeed upper/lower-cases it."""

    def __init__(self, choices: Sequence[str], *, case_insensitive: bool = False) -> None:
        self.choices = tuple(choices)
        self.case_insensitive = case_insensitive
        self.label = " | ".join(f'"{c}"' for c in self.choices)

    def coerce(self, value: Any) -> str:
        if not isinstance(value, str):
            raise BadValue(f"must be one of {list(self.choices)}", f"write one of {list(self.choices)}")
        folded = {c.lower(): c for c in self.choices}
        if value in self.choices or (self.case_insensitive and value.lower() in folded):
            return value
        guess = folded.get(value.lower()) or _closest(value, self.choices)
        fix = f"did you mean {guess!r}?" if guess else f"write one of {list(self.choices)}"
        raise BadValue(f"must be one of {list(self.choices)}", fix)


class Str(Kind):
    label = "str"

    def coerce(self, value: Any) -> str:
        if isinstance(value, str):
            return value
        raise BadValue(f"must be a string, got {type(value).__name__}", "write a quoted string")


class StrList(Kind):
    label = "list[str]"

    def coerce(self, value: Any) -> list[str]:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise BadValue("must be a list of strings", 'write e.g. ["LlamaDecoderLayer"]')


class Betas(Kind):
    """Adam's (beta1, beta2): two numbers in [0, 1)."""

    label = "[float, float]"

    def coerce(self, value: Any) -> list[float]:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise BadValue("must be a list of two numbers", "write e.g. [0.9, 0.999]")
        betas = [Float().coerce(v) for v in value]
        if not all(0.0 <= b < 1.0 for b in betas):
            raise BadValue("each beta must be in [0, 1)", "write e.g. [0.9, 0.999]")
        return betas


class Anything(Kind):
    """Any JSON value: keys DeepSpeed passes through to a library (apex, torch) unread."""

    label = "any"

    def coerce(self, value: Any) -> Any:
        return value


class Opaque(Kind):
    """A dict hf_zero does not look inside (a DeepSpeed feature it does not implement)."""

    label = "dict"

    def coerce(self, value: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        raise BadValue(f"must be a JSON object, got {type(value).__name__}", "write a {...} object")


class Section(Opaque):
    """A dict whose keys are themselves in the key table."""


class StepsPerPrint(Kind):
    """An int >= 1, or 0 / null / Infinity for never (Accelerate writes Infinity)."""

    label = "int | null | Infinity"

    def coerce(self, value: Any) -> int | float | None:
        if value is None or (isinstance(value, float) and value == math.inf):
            return value
        number = Int().coerce(value)
        if number < 0:
            raise BadValue("must be >= 0 (0, null or Infinity mean never)", "write 1 or more, or null")
        return number


def _closest(word: str, candidates: Sequence[str]) -> str | None:
    # difflib's ratio is 2*matches/(len(a)+len(b)) <= 2*len(b)/(len(a)+len(b)): a word over 2.4x the
    # longest candidate can never reach 0.6, and indexing a 100 MB key would take seconds.
    if not candidates or len(word) > 2.4 * max(len(c) for c in candidates):
        return None
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def closest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate most like `word` (difflib, cutoff 0.6), or None."""
    return _closest(word, candidates)
