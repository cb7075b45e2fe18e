"""Bounds on a model built from a config file on the meta device.

A config is untrusted input (docs/failure-handling.md): one edited to 2,000,000 layers would
build for hours before anything could refuse it, so a build is counted as it registers its
parameters and stopped past a limit its caller chooses.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn


class SkeletonTooLargeError(ValueError):
    """A config that describes a model far larger than its caller can account for."""


@contextlib.contextmanager
def parameter_limit(limit: int, beyond: str) -> Iterator[None]:
    """Raise :class:`SkeletonTooLargeError` once a build inside registers more than ``limit``
    parameter tensors; ``beyond`` says what that limit is, for the message."""
    count = 0

    def count_one(module: nn.Module, name: str, param: Any) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise SkeletonTooLargeError(f"the config describes more than {limit:,} parameter tensors, {beyond}")

    handle = nn.modules.module.register_module_parameter_registration_hook(count_one)
    try:
        yield
    finally:
        handle.remove()
