"""The errors checkpoint code raises: each names the file and the problem."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, read or exported; nothing on disk was changed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, tag, ``latest`` file or a rank file does not exist."""


def listed(problems: list[str], most: int) -> str:
    """The first ``most`` problems joined by '; ', then how many more there are."""
    return "; ".join(problems[:most]) + (f"; and {len(problems) - most} more" if len(problems) > most else "")
