"""Shared benchmark harness: warm-up excluded, median and spread, JSONL rows with device and versions.

Every benchmark in this folder times through ``measure`` and writes through ``write_rows``, so a
row always says what ran where: device, torch/triton/hf_zero versions, threads, and the config.
A comparison is a ratio of two measurements taken in the same run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``repeats`` timed calls, after ``warmup`` untimed ones."""

    median_s: float
    p20_s: float
    p80_s: float
    min_s: float
    repeats: int
    warmup: int


def _timed_call_cuda(fn: Callable[[], object]) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


def _timed_call_host(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(samples: Sequence[float], warmup: int = 0) -> Timing:
    """Median, p20, p80 and min of samples timed elsewhere (a subprocess, another rank), in the
    same ``Timing`` shape ``measure`` returns. ``warmup`` records how many were dropped before."""
    if not samples:
        raise ValueError("spread() needs at least one sample")
    return _timing(list(samples), warmup)


def _timing(samples: list[float], warmup: int) -> Timing:
    if len(samples) == 1:
        p20 = p80 = samples[0]
    else:
        deciles = statistics.quantiles(samples, n=10, method="inclusive")
        p20, p80 = deciles[1], deciles[7]
    return Timing(statistics.median(samples), p20, p80, min(samples), len(samples), warmup)


def measure(fns: Mapping[str, Callable[[], object]], device: torch.device, *, repeats: int, warmup: int
            ) -> dict[str, Timing]:
    """Time each of ``fns``: CUDA events on a GPU (device time), perf_counter on the host.

    The functions take turns, one call each per round, so a change in machine load (a shared CPU,
    GPU clocks) lands on every contender alike and their ratio stays meaningful.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, found repeats={repeats}, warmup={warmup}")
    timed_call = _timed_call_cuda if device.type == "cuda" else _timed_call_host
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed_call(fn))
    return {name: _timing(times, warmup) for name, times in samples.items()}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: torch.device) -> dict[str, object]:
    """What ran the benchmark, in enough detail to compare rows across machines."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "sm_count": props.multi_processor_count}
    return {"type": "cpu", "name": _cpu_name(), "logical_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def _version(package: str) -> str | None:
    # Package metadata only: importing triton here would break "triton only in kernels/".
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(extra_packages: Sequence[str] = ()) -> dict[str, object]:
    """Versions and machine state; ``extra_packages`` adds their installed versions (None when
    absent), read from package metadata without importing them."""
    return {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "hf_zero": _version("hf-zero"),
        **{package: _version(package) for package in extra_packages},
        "python": platform.python_version(),
        "platform": platform.platform(),
        # A shared machine's other load is the first suspect when CPU numbers move between runs.
        "loadavg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_rows(path: Path, rows: Sequence[dict[str, object]]) -> None:
    """Append rows as JSON lines (one file accumulates runs; each row is self-describing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_count(text: str) -> int:
    """'1M' -> 1048576, '16m' -> 16777216, '128M', '4K', '1G' or a plain integer."""
    text = text.strip()
    scale = {"k": 2**10, "m": 2**20, "g": 2**30}.get(text[-1:].lower(), 1)
    digits = text[:-1] if scale != 1 else text
    try:
        count = int(digits) * scale
    except ValueError:
        raise ValueError(f"expected a count like 1M, 16M, 4096; found {text!r}") from None
    if count < 1:
        raise ValueError(f"a count must be >= 1, found {text!r}")
    return count


def host_kernel_args(doc: str, jsonl_name: str, argv: list[str] | None,
                     repeats: int) -> tuple[argparse.Namespace, dict[str, object]]:
    """The arguments of a host-kernel benchmark (sizes, threads, repeats, warm-up, results file)
    and the context every row records."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M", help="comma-separated element counts (1M = 2**20)")
    parser.add_argument("--threads", default=f"1,{len(os.sched_getaffinity(0))}", help="torch thread counts")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--jsonl", type=Path, default=Path(__file__).parent / "results" / jsonl_name)
    args = parser.parse_args(argv)
    context = {"device": device_info(torch.device("cpu")), **environment(),
               "config": {**vars(args), "jsonl": str(args.jsonl)}}
    return args, context


def timed_by_threads_and_size(args: argparse.Namespace,
                              contenders: Callable[[int], Mapping[str, tuple[object, Callable[[], object]]]],
                              device: torch.device) -> Iterator[tuple[int, int, Mapping[str, Any], dict[str, Timing]]]:
    """(threads, numel, contenders, timings) for each of ``args.threads`` and ``args.sizes``, the
    contenders (name -> (what the caller keeps, the call)) taking turns call by call."""
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        torch.set_num_threads(threads)
        for numel in (parse_count(text) for text in args.sizes.split(",")):
            calls = contenders(numel)
            timings = measure({name: call for name, (_, call) in calls.items()}, device,
                              repeats=args.repeats, warmup=args.warmup)
            yield threads, numel, calls, timings

