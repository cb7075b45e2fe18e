"""On PYTHONPATH of every rank of a bench_trainer_memory run (DDP, hf_zero and DeepSpeed alike):
at exit, write this process's peak resident memory (``ru_maxrss``) and, when
``TRAINER_MEMORY_SAMPLE_S`` is set, its resident memory sampled every that many seconds, to
``$TRAINER_MEMORY_OUT/rank<RANK>.json``. It changes nothing in the run, except that
``destroy_process_group`` hands the GIL away after destroying a gloo group, as hf_zero does
([Note: leaving a gloo group]), so the DDP run cannot deadlock at exit."""

import atexit
import json
import os
import resource
import threading
import time

_OUT = os.environ.get("TRAINER_MEMORY_OUT")
_samples: list[tuple[float, float]] = []


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sample(period: float) -> None:
    start = time.monotonic()
    while True:
        _samples.append((round(time.monotonic() - start, 2), round(_rss_mb(), 1)))
        time.sleep(period)


def _write() -> None:
    rank = os.environ.get("RANK", "0")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    with open(os.path.join(_OUT, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": int(rank), "peak_rss_mb": peak_mb, "samples": _samples}, f)


if _OUT and "RANK" in os.environ:  # the ranks, not the launcher
    atexit.register(_write)
    period = float(os.environ.get("TRAINER_MEMORY_SAMPLE_S", "0") or 0)
    if period > 0:
        threading.Thread(target=_sample, args=(period,), daemon=True).start()
    try:
        from hf_zero.comm.process_group import let_gloo_workers_finish_after_destroy

        let_gloo_workers_finish_after_destroy()
    except ImportError:
        pass
