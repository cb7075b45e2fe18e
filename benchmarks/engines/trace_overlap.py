"""How much of the collectives in a ``--profile`` chrome trace ran while compute did.

Collectives are the backend's own spans (``gloo:*`` / ``nccl:*``); compute is every ``aten::*``
span of the main thread (CPU) or every kernel that is not a collective (GPU). The overlap is the
length of the intersection of the two unions, counting only collectives that ran off the main
thread (an async op on gloo's threads, or a GPU stream): one on the main thread was synchronous.

    python -m engines.trace_overlap /tmp/traces/hf_zero3_r0_rank0.json   (from benchmarks/)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(path: str) -> dict[str, Any]:
    """Collective time, compute time and their overlap (microseconds) in one trace."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    main_tid = Counter(e["tid"] for e in events if e.get("cat") == "cpu_op").most_common(1)[0][0]

    def span(e: dict[str, Any]) -> tuple[float, float]:
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])

    is_comm = lambda e: e["name"].split(":")[0] in ("gloo", "nccl") or "nccl" in e["name"].lower()  # noqa: E731
    comm = _union([span(e) for e in events if is_comm(e)])
    # A collective recorded on the main thread ran synchronously: nothing overlapped it there.
    comm_async = _union([span(e) for e in events if is_comm(e) and e["tid"] != main_tid])
    compute = _union([span(e) for e in events if not is_comm(e) and (
        (e.get("cat") == "kernel") or (e["tid"] == main_tid and e["name"].startswith("aten::")))])
    comm_us = sum(end - start for start, end in comm)
    both = _intersection_us(comm_async, compute)
    return {"trace": path, "comm_us": comm_us, "compute_us": sum(e - s for s, e in compute), "overlap_us": both,
            "comm_overlapped_frac": both / comm_us if comm_us else None}


if __name__ == "__main__":
    for trace in sys.argv[1:]:
        print(json.dumps(overlap(trace)))
