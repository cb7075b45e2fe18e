"""The errors checkpoint code raises: each names the file and the problem."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, read or exported; nothing on disk was changed."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, tag, ``latest`` file or a rank file does not exist."""
