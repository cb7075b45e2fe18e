"""``hf-zero doctor``: what this machine gives hf_zero, then the CUDA suite.

It prints one line per fact (torch and its build, CUDA, the GPUs, NCCL, gloo, triton and the
backend hf_zero's kernels use, pinned host memory, transformers and accelerate), then runs the
CUDA suite (``tests/cuda_suite.py`` names its files) with pytest in the checkout hf_zero was
installed from, streaming its output, and ends with one verdict line and the duration.

[Note: what a pass is]
The suite skips loudly where it cannot run (tests/cuda_suite.py), so
pytest's exit status alone would call a machine without a GPU, or without compiled triton,
green. The doctor passes only when pytest exits 0, at least one test passed and none was
skipped; without CUDA it does not start pytest at all and exits 1.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUITE_MODULE = Path("tests") / "cuda_suite.py"
PASS_LOOKS_LIKE = "a pass looks like: 'CUDA suite PASSED: N passed in T s', with nothing skipped or failed"


@dataclass
class SuiteResult:
    """What one pytest run of the suite reported."""

    returncode: int
    counts: dict[str, int]  # "passed", "failed", "skipped", "error", ... from pytest's last line
    seconds: float
    not_run_reasons: list[str]  # "CUDA suite NOT RUN: ..." lines (loud skips)


# ---------------------------------------------------------------- facts
def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu_lines(torch: Any) -> list[str]:
    lines = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(f"  gpu {index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                     f"compute capability {props.major}.{props.minor}")
    return lines


def _nccl(torch: Any) -> str:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return "not in this torch build (gloo only)"
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError) as error:  # a CUDA build whose NCCL library cannot be loaded
        return f"built in, but its version cannot be read ({type(error).__name__}: {error})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _pinned_memory(torch: Any) -> str:
    if not torch.cuda.is_available():
        return "not available (pinning host memory needs a CUDA device)"
    try:
        block = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:
        return f"FAILED to pin 64 MiB ({error}): check the memlock limit (ulimit -l)"
    return f"yes (64 MiB pinned: {block.is_pinned()})"


def _triton(cuda: bool) -> str:
    from hf_zero.kernels import dispatch

    installed = _version("triton")
    if dispatch.TRITON_IMPORT_ERROR is not None:
        reason = f"{type(dispatch.TRITON_IMPORT_ERROR).__name__}: {dispatch.TRITON_IMPORT_ERROR}"
        return f"{installed}, not importable ({reason}): hf_zero's kernels run the torch paths"
    if dispatch.INTERPRET:
        return f"{installed}: TRITON_INTERPRET=1, so hf_zero's kernels run in Triton's interpreter on CPU tensors"
    if not cuda:
        return f"{installed}: importable, but with no CUDA device hf_zero's kernels run the torch paths"
    return f"{installed}: hf_zero's kernels run compiled on CUDA tensors"


def facts() -> tuple[list[str], str | None]:
    """The lines to print, and why torch cannot use a CUDA device (None: it can)."""
    import torch
    import torch.distributed as dist

    from hf_zero.version import __version__

    cuda = torch.cuda.is_available()
    build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    lines = [
        f"hf_zero      {__version__} ({Path(__file__).resolve().parent})",
        f"python       {sys.version.split()[0]} ({sys.executable})",
        f"torch        {torch.__version__} ({build})",
        f"CUDA         {f'available: {torch.cuda.device_count()} GPU(s)' if cuda else 'NOT available: ' + no_cuda_reason(torch)}",
        *(_gpu_lines(torch) if cuda else []),
        f"NCCL         {_nccl(torch)}",
        f"gloo         {'yes' if dist.is_available() and dist.is_gloo_available() else 'no'}",
        f"triton       {_triton(cuda)}",
        f"pinned host memory  {_pinned_memory(torch)}",
        f"transformers {_version('transformers')}, accelerate {_version('accelerate')}",
    ]
    return lines, None if cuda else no_cuda_reason(torch)


def no_cuda_reason(torch: Any) -> str:
    """Why torch sees no CUDA device, and what to do about it."""
    if torch.version.cuda is None:
        return ("this torch is a CPU-only build; install a CUDA build "
                "(pip install torch==2.13.0 from PyPI is one)")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" if hidden is not None and not hidden.strip() \
        else "it finds no GPU or no working driver (check nvidia-smi)"
    return f"torch is built for CUDA {torch.version.cuda}, but {where}"


# ---------------------------------------------------------------- the suite
def find_repo(repo: str | None) -> Path | None:
    """The checkout whose ``tests/cuda_suite.py`` holds the suite: ``repo``, else the one this
    hf_zero was installed from (``pip install -e``), else the working directory."""
    candidates = [Path(repo)] if repo else [Path(__file__).resolve().parents[2], Path.cwd()]
    return next((c for c in candidates if (c / SUITE_MODULE).is_file()), None)


def suite_files(repo: Path) -> list[str]:
    """``CUDA_SUITE_FILES`` from the checkout's tests/cuda_suite.py: the one list of the suite."""
    spec = importlib.util.spec_from_file_location("_hf_zero_cuda_suite", repo / SUITE_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CUDA_SUITE_FILES)


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def parse_counts(text: str) -> dict[str, int]:
    """The counts of pytest's summary line (the last line naming any), e.g. ``{"passed": 58}``."""
    for line in reversed(text.splitlines()):
        found = _COUNT.findall(line)
        if found and (" in " in line or "no tests ran" in line):
            return {kind.rstrip("s") if kind.startswith(("error", "warning")) else kind: int(n) for n, kind in found}
    return {}


def run_suite(repo: Path, files: list[str], extra_args: tuple[str, ...] = ()) -> SuiteResult:
    """Run ``files`` with pytest in ``repo``, printing its output as it comes."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *extra_args, *files]
    print("running:", " ".join(command), flush=True)
    start = time.perf_counter()
    with subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        lines = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    seconds = time.perf_counter() - start
    text = "".join(lines)
    not_run = sorted({m.strip() for m in re.findall(r"CUDA suite NOT RUN: [^\n]*?(?=; run on|\n)", text)})
    return SuiteResult(proc.returncode, parse_counts(text), seconds, not_run)


def verdict(result: SuiteResult) -> tuple[bool, str]:
    """Whether the run is a pass ([Note: what a pass is]), and the line that says so."""
    counts = ", ".join(f"{n} {kind}" for kind, n in result.counts.items()) or "no pytest summary"
    took = f"{counts} in {result.seconds:.0f} s"
    if result.returncode == 0 and result.counts.get("passed", 0) > 0 and not result.counts.get("skipped"):
        return True, f"CUDA suite PASSED: {took}"
    if result.not_run_reasons:
        return False, f"CUDA suite NOT a pass: {took}; " + "; ".join(result.not_run_reasons)
    if result.returncode == 0:
        return False, f"CUDA suite NOT a pass: {took}; a skipped test did not check its GPU path (reasons above)"
    return False, f"CUDA suite FAILED (pytest exit {result.returncode}): {took}"


def doctor(with_suite: bool = True, repo: str | None = None) -> int:
    lines, no_cuda = facts()
    print("\n".join(lines), flush=True)
    if not with_suite:
        return 0
    if no_cuda is not None:
        print(f"\nCUDA suite NOT RUN: no CUDA device: {no_cuda}\n{PASS_LOOKS_LIKE}", file=sys.stderr)
        return 1
    found = find_repo(repo)
    if found is None:
        print(f"\nCUDA suite NOT RUN: no {SUITE_MODULE} in {repo or 'the installed checkout nor the working directory'}:"
              " run hf-zero doctor in a clone of hf_zero (pip install -e .), or pass --repo", file=sys.stderr)
        return 1
    print(f"\n{PASS_LOOKS_LIKE}", flush=True)
    passed, line = verdict(run_suite(found, suite_files(found)))
    print(line, file=sys.stdout if passed else sys.stderr, flush=True)
    return 0 if passed else 1
