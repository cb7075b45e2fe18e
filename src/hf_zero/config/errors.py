"""Config problems and the one error that carries all of them.

A bad config is reported once, with every problem found, so a user fixes the whole file in one
edit instead of discovering problems one run at a time (DeepSpeed stops at the first assert, or
says nothing at all for an unknown top-level key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigProblem", "HfZeroConfigError", "MISSING", "ProblemList"]


class _Missing:
    """Stands for "the key is not in the config" in a problem's `value` (None is a real value)."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<missing>"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config.

    path: dotted key path, e.g. ``zero_optimization.offload_param.device`` (or the name of a
        ``resolve(...)`` argument, or the config file for a load error).
    value: the offending value as found (``MISSING`` when the key is absent).
    rule: the rule the value breaks, in words.
    fix: what to write instead.
    """

    path: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path} = {self.value!r}: {self.rule}. Fix: {self.fix}"


class HfZeroConfigError(ValueError):
    """A config (or a ``resolve(...)`` call) broke one or more rules; ``.problems`` lists them all."""

    def __init__(self, problems: list[ConfigProblem], source: str = "<dict>") -> None:
        if not problems:
            raise ValueError("HfZeroConfigError needs at least one problem")
        self.problems: list[ConfigProblem] = list(problems)
        self.source = source
        noun = "problem" if len(problems) == 1 else "problems"
        lines = [f"hf_zero config {source} has {len(problems)} {noun}:"]
        lines += [f"  - {problem}" for problem in problems]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        # Keeps the error picklable (multiprocessing, pytest-xdist) despite the custom __init__.
        return (type(self), (self.problems, self.source))


class ProblemList(list[ConfigProblem]):
    """A list of problems with a shorthand `add` and `raise_if_any`."""

    def add(self, path: str, value: Any, rule: str, fix: str) -> None:
        self.append(ConfigProblem(path, value, rule, fix))

    def raise_if_any(self, source: str) -> None:
        if self:
            raise HfZeroConfigError(list(self), source)
