"""Kernel tests run twice: in this process, and again under Triton's interpreter in a subprocess.

[Note: two runs]
Triton fixes "interpreted or compiled" for every ``@triton.jit`` function when it
is decorated, its own library included (``tl.zeros`` and friends are jit functions decorated when
``triton.language`` is first imported). One process therefore cannot hold both modes, and other
test directories may import triton first. So the kernel test files are written against whatever
backend ``hf_zero.kernels`` picked in their process:

- ``python -m pytest tests``: CPU tensors run torch's fused CPU Adam and the reference;
- ``test_interpreter.py`` re-runs the same files in a subprocess with ``TRITON_INTERPRET=1``, so
  every CPU tensor goes through the Triton kernels. To see those results test by test, run
  ``TRITON_INTERPRET=1 python -m pytest tests/kernels`` yourself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield
