"""The CUDA suite skips loudly, never passes, on a machine that cannot run it.

A test skipped for want of a GPU must not read as a green run of the GPU paths: its reason says
that the suite did NOT run and the exact command that runs it, and a :class:`CudaSuiteNotRun`
warning puts the same line in pytest's warning summary, where CI output shows it.
"""

from __future__ import annotations

import warnings
from typing import NoReturn

import pytest
import torch

CUDA_SUITE_FILES = (
    "tests/distributed/test_cuda_engine.py",
    "tests/distributed/test_cuda_execution.py",
    "tests/kernels/test_cuda.py",
    "tests/distributed/test_fake_world.py",
)
CUDA_SUITE_COMMAND = "python -m pytest -q " + " ".join(CUDA_SUITE_FILES)


class CudaSuiteNotRun(UserWarning):
    """A CUDA test was skipped: the GPU paths it covers were not checked by this run."""


def not_run_reason(missing: str) -> str:
    return f"CUDA suite NOT RUN: {missing}; run on a GPU machine with {CUDA_SUITE_COMMAND}"


def skip_loudly(missing: str) -> NoReturn:
    """Skip the calling test (or every test of a module-scoped fixture) with a warning."""
    reason = not_run_reason(missing)
    warnings.warn(CudaSuiteNotRun(reason), stacklevel=2)
    pytest.skip(reason)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        skip_loudly("no CUDA device")
