"""Config problems and the one error that carries all of them.

A bad config is reported once, with every problem found, so a user fixes the whole file in one
edit instead of discovering problems one run at a time (DeepSpeed stops at the first assert, or
says nothing at all for an unknown top-level key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigProblem", "HfZeroConfigError", "MISSING", "ProblemList", "MAX_ECHO_CHARS", "echo", "one_line"]

# [Note: bounded messages]
# A config is untrusted input: a key or value may be 100 MB long or hold newlines. Every piece of
# user text a message repeats goes through `echo`/`one_line`, so a problem is always one line of
# bounded length: at most MAX_ECHO_CHARS of the value, then "..." and its total length. The
# problem objects keep the full values for code that inspects them.
MAX_ECHO_CHARS = 200
# Rules and fixes are ours, but some quote a value (`device is '...'`); they get a wider bound.
_MAX_RULE_CHARS = 4 * MAX_ECHO_CHARS


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
        rule, fix = one_line(self.rule, _MAX_RULE_CHARS), one_line(self.fix, _MAX_RULE_CHARS)
        return f"{one_line(self.path)} = {echo(self.value)}: {rule}. Fix: {fix}"


class HfZeroConfigError(ValueError):
    """A config (or a ``resolve(...)`` call) broke one or more rules; ``.problems`` lists them all."""

    def __init__(self, problems: list[ConfigProblem], source: str = "<dict>") -> None:
        if not problems:
            raise ValueError("HfZeroConfigError needs at least one problem")
        self.problems: list[ConfigProblem] = list(problems)
        self.source = source
        noun = "problem" if len(problems) == 1 else "problems"
        lines = [f"hf_zero config {one_line(source)} has {len(problems)} {noun}:"]
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


def one_line(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` cut to `limit` characters (then "... (N characters)") with control characters escaped.

    See [Note: bounded messages]. Cut first, escape second: a 100 MB key costs a slice, not a loop.
    """
    kept = text[:limit]
    escaped = kept if kept.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in kept)
    return escaped if len(text) <= limit else f"{escaped}... ({len(text)} characters)"


def echo(value: Any) -> str:
    """`repr(value)` as a message repeats it: one line, bounded (see [Note: bounded messages])."""
    if isinstance(value, str) and len(value) > MAX_ECHO_CHARS:
        # repr of the head only: a 100 MB string is never copied whole.
        return f"{repr(value[:MAX_ECHO_CHARS])[:MAX_ECHO_CHARS]}... ({len(value)} characters)"
    return one_line(repr(value))
