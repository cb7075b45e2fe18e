"""The host's Adam step: hf_zero's one-pass kernel ([Note: one pass on the host] in
hf_zero/kernels/cpu_one_pass.py) against its chunked path, torch's fused CPU AdamW and
DeepSpeed's ``DeepSpeedCPUAdam`` (its C++ op, built on first use with this machine's compiler,
when deepspeed is importable), with a plain fp32 copy as the memory-bandwidth bound, in one run.

hf_zero's two paths do the offloaded step's work: a bf16 gradient with a loss scale and a clip
coefficient in, the fp32 master and moments updated, a bf16 compute copy out (28 bytes per
parameter: read 2 + 4 + 4 + 4, write 4 + 4 + 4 + 2). torch's and DeepSpeed's take an fp32 gradient
and write no copy (28 bytes: read 4 x 4, write 3 x 4), which is what they can do. Contenders take
turns call by call (``_harness.measure``) at each thread count.

    python benchmarks/bench_host_adam.py                       # 16M and 64M, 1 thread and all
    python benchmarks/bench_host_adam.py --sizes 16M --threads 1 --repeats 10
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch
from _harness import host_kernel_args
from _harness import markdown_table
from _harness import timed_by_threads_and_size
from _harness import write_rows

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["HF_ZERO_HOST_ADAM"] = "chunked"  # kernels.fused_adam_ takes the chunked path; the one pass is called directly

from hf_zero import kernels  # noqa: E402
from hf_zero.kernels import cpu_one_pass  # noqa: E402

HPARAMS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)
GRAD_SCALE, CLIP = 1024.0, 0.5
BYTES = {"adam": 28, "copy": 8}


def _state(numel: int) -> dict[str, torch.Tensor]:
    return {"master": torch.randn(numel), "m": torch.randn(numel) * 0.1, "v": torch.rand(numel) * 0.01,
            "grad16": (torch.randn(numel) * GRAD_SCALE).bfloat16(), "out": torch.empty(numel, dtype=torch.bfloat16),
            "grad32": torch.randn(numel)}


def contenders(numel: int) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (bytes kind, the call)."""
    one, chunked, fused = _state(numel), _state(numel), _state(numel)

    def one_pass() -> None:
        cpu_one_pass.adam_one_pass_(one["master"], one["grad16"], one["m"], one["v"], adamw=True, grad_scale=GRAD_SCALE,
                                    clip_coef=CLIP, out=one["out"], **HPARAMS)

    calls: dict[str, tuple[str, Callable[[], object]]] = {
        "hf_zero one pass (bf16 grad, scale, clip, bf16 copy)": ("adam", one_pass),
        "hf_zero chunked (bf16 grad, scale, clip, bf16 copy)": ("adam", lambda: kernels.fused_adam_(
            chunked["master"], chunked["grad16"], chunked["m"], chunked["v"], adamw=True, grad_scale=GRAD_SCALE,
            clip_coef=CLIP, out=chunked["out"], **HPARAMS)),
        "torch _fused_adamw_ (fp32 grad, no copy)": ("adam", lambda: kernels.fused_adam_(
            fused["master"], fused["grad32"], fused["m"], fused["v"], adamw=True, **HPARAMS)),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # noqa: BLE001 - not installed, or its op cannot build here
        print(f"DeepSpeedCPUAdam left out: {type(error).__name__}: {error}"[:300])
    else:
        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel)
        ds = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01, adamw_mode=True)
        ds.step()  # builds the op (once per machine) and makes the state
        calls["DeepSpeedCPUAdam (fp32 grad, no copy)"] = ("adam", ds.step)
    src, dst = torch.randn(numel), torch.empty(numel)
    calls["copy_ fp32 (the bandwidth bound)"] = ("copy", lambda: dst.copy_(src))
    return calls


def main(argv: list[str] | None = None) -> int:
    args, context = host_kernel_args(__doc__, "bench_host_adam.jsonl", argv, repeats=20)
    device = torch.device("cpu")
    started = time.perf_counter()
    warm = torch.zeros(1 << 20)
    cpu_one_pass.adam_one_pass_(warm.clone(), warm.bfloat16(), warm.clone(), warm.clone(), adamw=True, grad_scale=1.0,
                                clip_coef=1.0, out=warm.bfloat16(), **HPARAMS)
    print(f"one-pass kernel built in {time.perf_counter() - started:.1f} s (compiled, or loaded from inductor's cache)")
    rows = []
    for threads, numel, calls, timings in timed_by_threads_and_size(args, contenders, device):
        copy_gbs = BYTES["copy"] * numel / timings["copy_ fp32 (the bandwidth bound)"].median_s / 1e9
        deepspeed = timings.get("DeepSpeedCPUAdam (fp32 grad, no copy)")
        for name, (kind, _) in calls.items():
            timing = timings[name]
            gbs = BYTES[kind] * numel / timing.median_s / 1e9
            rows.append({"bench": "host_adam", "numel": numel, "threads": threads, "impl": name,
                         "median_s": timing.median_s, "p20_s": timing.p20_s, "p80_s": timing.p80_s,
                         "gb_per_s": gbs, "of_copy_bandwidth": gbs / copy_gbs,
                         "vs_deepspeed": None if deepspeed is None else deepspeed.median_s / timing.median_s,
                         **context})
    write_rows(args.jsonl, rows)
    print(f"host Adam step on {context['device']['name']}, torch {context['torch']}, "
          f"median of {args.repeats} after {args.warmup} warm-up\n")
    print(markdown_table(["elements", "threads", "implementation", "median ms", "p20-p80 ms", "GB/s",
                          "of the copy's GB/s", "× DeepSpeedCPUAdam's speed"],
                         [[f"{r['numel'] >> 20}M", r["threads"], r["impl"], f"{r['median_s'] * 1e3:.2f}",
                           f"{r['p20_s'] * 1e3:.2f}-{r['p80_s'] * 1e3:.2f}", f"{r['gb_per_s']:.1f}",
                           f"{r['of_copy_bandwidth']:.2f}",
                           "" if r["vs_deepspeed"] is None else f"{r['vs_deepspeed']:.2f}"] for r in rows]))
    print(f"\n{len(rows)} rows appended to {args.jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
