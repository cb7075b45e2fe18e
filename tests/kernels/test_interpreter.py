"""Re-run the kernel test files with TRITON_INTERPRET=1 in a fresh process: the Triton kernels.

See [Note: two runs] in conftest for why this cannot happen in the current process. The child
asserts, in test_backends.py, that CPU tensors really went through the interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.kernels import dispatch

HERE = Path(__file__).parent
FILES = ["test_fused_adam.py", "test_pack.py", "test_norm.py", "test_quant.py", "test_backends.py"]


@pytest.mark.skipif(dispatch.INTERPRET, reason="this process already runs the interpreter")
@pytest.mark.skipif(dispatch.TRITON_IMPORT_ERROR is not None, reason="triton is not importable")
def test_kernel_tests_pass_under_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(HERE.parents[1]),
               *(str(HERE / name) for name in FILES)]
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=HERE.parents[1], timeout=590)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "(no output)"
    assert run.returncode == 0, f"under TRITON_INTERPRET=1: {summary}\n{run.stdout[-12000:]}\n{run.stderr[-3000:]}"
    assert " passed" in summary and "failed" not in summary, summary
