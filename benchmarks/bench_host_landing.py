"""A reduced 16-bit gradient landing in an fp32 host gradient shard: torch's mixed-dtype add
against hf_zero's ``kernels.add_scaled_`` ([Note: landing 16-bit gradients on the host] in
hf_zero/kernels/cpu.py), with the fp32 add and the bf16 -> fp32 copy as the bounds, in one run.

Every contender lands the same bf16 part of N elements into an fp32 shard on the CPU (alpha
1/2, what a 16-bit reduction over 2 ranks leaves to divide), taking turns call by call
(``_harness.measure``), at each thread count. The bytes moved per element are 10 for an add
(read 4 + 2, write 4) and 6 for a copy into zeros (read 2, write 4).

    python benchmarks/bench_host_landing.py                       # 16M and 64M, 1 thread and all
    python benchmarks/bench_host_landing.py --sizes 16M --threads 1 --repeats 10
"""

from __future__ import annotations

import sys

import torch
from _harness import host_kernel_args
from _harness import markdown_table
from _harness import timed_by_threads_and_size
from _harness import write_rows

from hf_zero import kernels

ALPHA = 0.5


def contenders(numel: int) -> dict[str, tuple[int, object]]:
    """name -> (bytes per element, the call)."""
    src = torch.randn(numel).bfloat16()
    src_fp32 = src.float()
    dst = torch.randn(numel)
    return {
        "torch add_ (bf16 into fp32)": (10, lambda: dst.add_(src, alpha=ALPHA)),
        "hf_zero add_scaled_": (10, lambda: kernels.add_scaled_(dst, src, ALPHA)),
        "hf_zero add_scaled_ into zeros": (6, lambda: kernels.add_scaled_(dst, src, ALPHA, dst_is_zero=True)),
        "torch add_ (fp32 into fp32)": (12, lambda: dst.add_(src_fp32, alpha=ALPHA)),
        "torch copy_ (bf16 to fp32)": (6, lambda: dst.copy_(src)),
    }


def main(argv: list[str] | None = None) -> int:
    args, context = host_kernel_args(__doc__, "bench_host_landing.jsonl", argv, repeats=20)
    device = torch.device("cpu")
    rows = []
    for threads, numel, calls, timings in timed_by_threads_and_size(args, contenders, device):
        mixed = timings["torch add_ (bf16 into fp32)"].median_s
        for name, (bytes_per_element, _) in calls.items():
            timing = timings[name]
            rows.append({"bench": "host_landing", "numel": numel, "threads": threads, "impl": name,
                         "median_s": timing.median_s, "p20_s": timing.p20_s, "p80_s": timing.p80_s,
                         "gb_per_s": bytes_per_element * numel / timing.median_s / 1e9,
                         "vs_mixed_add": mixed / timing.median_s, **context})
    write_rows(args.jsonl, rows)
    print(f"16-bit gradient landing on {context['device']['name']}, torch {context['torch']}, "
          f"median of {args.repeats} after {args.warmup} warm-up\n")
    print(markdown_table(["elements", "threads", "implementation", "median ms", "p20-p80 ms", "GB/s", "× faster than the mixed add"],
                         [[f"{r['numel'] >> 20}M", r["threads"], r["impl"], f"{r['median_s'] * 1e3:.2f}",
                           f"{r['p20_s'] * 1e3:.2f}-{r['p80_s'] * 1e3:.2f}", f"{r['gb_per_s']:.1f}",
                           f"{r['vs_mixed_add']:.2f}"] for r in rows]))
    print(f"\n{len(rows)} rows appended to {args.jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
