"""The NVMe optimizer store's throughput against a plain sequential copy on the same disk.

The disk: one thread writes a file of ``--size-mib`` MiB in 1 MiB blocks with ``O_DIRECT`` and
reads it back (``dd oflag=direct`` / ``iflag=direct``). The store: ``NvmeOptimizerStore`` with one
group whose three fp32 states are each ``--size-mib`` MiB, stepped ``--steps`` times; a step reads
and writes every state once (6 x size bytes). Its I/O rate is those bytes over the step's time
less the same Adam on in-memory tensors (measured beside it), per setting: direct or buffered
(page cache: reads served from memory, the number a cached file gives), one or two I/O threads,
``pipeline_read``/``pipeline_write`` off or on.

    python benchmarks/bench_nvme_io.py                       # 256 MiB per state, temp dir
    python benchmarks/bench_nvme_io.py --dir /mnt/nvme --size-mib 1024 --tile-mib 64
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _harness import environment, markdown_table, write_rows

from hf_zero.kernels import fused_adam_
from hf_zero.offload.nvme import NvmeOptimizerStore
from hf_zero.offload.nvme_io import AioSettings

RESULTS = Path(__file__).parent / "results" / "bench_nvme_io.jsonl"
BLOCK = 1 << 20
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def sequential_copy(directory: str, nbytes: int) -> tuple[float, float]:
    """GB/s of one thread writing then reading ``nbytes`` with O_DIRECT in 1 MiB blocks."""
    path = os.path.join(directory, "sequential.bin")
    block = mmap.mmap(-1, BLOCK)  # page-aligned
    block.write(os.urandom(BLOCK))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, BLOCK):
            os.pwrite(fd, block, offset)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for offset in range(0, nbytes, BLOCK):
            os.preadv(fd, [block], offset)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.remove(path)
        block.close()
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def adam_seconds(numel: int, tile: int, steps: int) -> float:
    """The store's Adam alone, tile by tile on in-memory tensors: what a step computes."""
    master, avg, sq, grad = (torch.randn(numel) for _ in range(4))
    best = float("inf")
    for step in range(steps):
        start = time.perf_counter()
        for lo in range(0, numel, tile):
            hi = min(numel, lo + tile)
            fused_adam_(master[lo:hi], grad[lo:hi], avg[lo:hi], sq[lo:hi], lr=HYPER["lr"], beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0, step=step + 1, adamw=True, grad_scale=1.0, clip_coef=1.0)
        best = min(best, time.perf_counter() - start)
    return best


def store_seconds(directory: str, numel: int, tile: int, steps: int, aio: AioSettings) -> tuple[float, bool]:
    root = tempfile.mkdtemp(dir=directory)
    store = NvmeOptimizerStore(root, 0, [numel], tile, aio)
    try:
        store.store_master(0, torch.randn(numel))
        grad = torch.randn(numel)
        times = []
        for _ in range(steps + 1):  # the first step warms up
            start = time.perf_counter()
            store.step(0, grad, lambda values, start: None, HYPER, grad_scale=1.0, clip_coef=1.0)
            times.append(time.perf_counter() - start)
        return min(times[1:]), store.direct
    finally:
        store.close()
        os.rmdir(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--size-mib", type=int, default=256, help="MiB per optimizer state (and of the copy)")
    parser.add_argument("--tile-mib", type=int, default=16, help="sub_group_size, in MiB of fp32")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting (best kept)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for Adam")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numel, tile = args.size_mib * 2**18, args.tile_mib * 2**18
    disk_write, disk_read = sequential_copy(args.dir, args.size_mib * 2**20)
    adam = adam_seconds(numel, tile, args.steps)
    moved = 6 * numel * 4
    rows = []
    for direct in (True, False):
        for io_threads in (1, 2):
            for pipeline in (False, True):
                aio = AioSettings(block_size=BLOCK, threads=io_threads, pipeline=pipeline, direct=direct)
                seconds, used_direct = store_seconds(args.dir, numel, tile, args.steps, aio)
                io_s = max(seconds - adam, 1e-9)
                rows.append({"direct": used_direct, "io_threads": io_threads, "pipeline": pipeline,
                             "step_s": seconds, "adam_s": adam, "io_gb_s": moved / io_s / 1e9,
                             "step_gb_s": moved / seconds / 1e9, "disk_write_gb_s": disk_write,
                             "disk_read_gb_s": disk_read})
    disk = (disk_write + disk_read) / 2
    print(f"disk, one thread, O_DIRECT, 1 MiB blocks: write {disk_write:.2f} GB/s, read {disk_read:.2f} GB/s; "
          f"Adam alone {adam * 1e3:.0f} ms per step of {numel / 2**20:.0f}M elements")
    print(markdown_table(
        ["I/O", "threads", "pipeline", "step s", "I/O GB/s (step less Adam)", "x disk (mean of read, write)"],
        [["direct" if r["direct"] else "page cache", r["io_threads"], "on" if r["pipeline"] else "off",
          f"{r['step_s']:.3f}", f"{r['io_gb_s']:.2f}", f"{r['io_gb_s'] / disk:.2f}x"] for r in rows]))
    if not args.no_write:
        write_rows(RESULTS, [dict(row, size_mib=args.size_mib, tile_mib=args.tile_mib, environment=environment())
                             for row in rows])


if __name__ == "__main__":
    sys.exit(main())
