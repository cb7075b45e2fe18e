"""Adam step throughput: hf_zero's fused_adam_ vs torch.optim.AdamW(fused=True) vs (foreach=True).

All contenders step the same flat fp32 shard (one parameter of N elements with an fp32 grad), in
the same run, taking turns step by step (see _harness.measure). The moments come from a pool of
one set per contender, and each contender moves to the next set at every step: where a set's
pages happen to sit (huge pages, cache colouring) varies by 10-20% on a CPU VM, and rotating
gives every contender the same mix instead of one fixed placement each. An
Adam step must read p, g, m, v and write p, m, v: 28 bytes per parameter, the bound GB/s is
counted against (30 with the bf16 compute copy that the engine also writes). On a GPU the table
adds the fraction of peak HBM bandwidth; on a CPU it measures the CPU path (torch's fused CPU
kernels under hf_zero's dispatch). Interpreter timings are refused: they say nothing about speed.

    python benchmarks/bench_kernels.py                                  # 1M, 16M, 128M parameters
    python benchmarks/bench_kernels.py --sizes 1M,16M --repeats 5       # quick
    python benchmarks/bench_kernels.py --peak-gbps 4800                 # H200 instead of H100 SXM
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from pathlib import Path

import torch
from _harness import device_info
from _harness import environment
from _harness import markdown_table
from _harness import measure
from _harness import parse_count
from _harness import write_rows

from hf_zero import kernels

H100_SXM_PEAK_GBPS = 3350.0
BYTES_PER_PARAM = 28  # read p, g, m, v + write p, m, v, fp32
HPARAMS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@dataclass
class Contender:
    """One implementation of an Adam step over the shard, ready to be called repeatedly."""

    name: str
    backend: str
    bytes_per_param: int
    step: Callable[[], None]


class MomentPool:
    """Moment sets (exp_avg, exp_avg_sq) that the contenders take in turn (see the docstring)."""

    def __init__(self, like: torch.Tensor, sets: int) -> None:
        self.sets = [(torch.zeros_like(like), torch.zeros_like(like)) for _ in range(sets)]

    def rotation(self, offset: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        calls = [offset]

        def next_set() -> tuple[torch.Tensor, torch.Tensor]:
            calls[0] += 1
            return self.sets[calls[0] % len(self.sets)]

        return next_set


def hf_zero_contender(master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None,
                      moments: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Contender:
    count = [0]

    def step() -> None:
        count[0] += 1  # a python int, as the engine passes it
        exp_avg, exp_avg_sq = moments()
        kernels.fused_adam_(master, grad, exp_avg, exp_avg_sq, step=count[0], adamw=True, out=out, **HPARAMS)

    name = "hf_zero fused_adam_" + (f" + {str(out.dtype).removeprefix('torch.')} out" if out is not None else "")
    extra = out.element_size() if out is not None else 0
    return Contender(name, kernels.backend_for(master), BYTES_PER_PARAM + extra, step)


def torch_contender(param: torch.nn.Parameter, flavour: str,
                    moments: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Contender:
    optimizer = torch.optim.AdamW([param], lr=HPARAMS["lr"], betas=(HPARAMS["beta1"], HPARAMS["beta2"]),
                                  eps=HPARAMS["eps"], weight_decay=HPARAMS["weight_decay"], **{flavour: True})
    state = optimizer.state[param]
    state["step"] = torch.tensor(0.0, device=param.device if flavour == "fused" else "cpu")

    def step() -> None:
        state["exp_avg"], state["exp_avg_sq"] = moments()  # the state torch.optim reads and updates
        optimizer.step()

    return Contender(f"torch AdamW({flavour}=True)", f"torch-{flavour}", BYTES_PER_PARAM, step)


def contenders(numel: int, device: torch.device) -> list[Contender]:
    master = torch.randn(numel, device=device)
    grad = torch.randn(numel, device=device) * 1e-2
    param = torch.nn.Parameter(master)  # shares master's storage: the same shard for everyone
    param.grad = grad
    out = torch.empty(numel, device=device, dtype=torch.bfloat16)
    pool = MomentPool(master, sets=4)
    return [
        torch_contender(param, "fused", pool.rotation(0)),
        hf_zero_contender(master, grad, None, pool.rotation(1)),
        hf_zero_contender(master, grad, out, pool.rotation(2)),
        torch_contender(param, "foreach", pool.rotation(3)),
    ]


def bench_size(numel: int, device: torch.device, args: argparse.Namespace) -> list[dict[str, object]]:
    entries = contenders(numel, device)
    timings = measure({c.name: c.step for c in entries}, device, repeats=args.repeats, warmup=args.warmup)
    baseline = timings["torch AdamW(fused=True)"].median_s
    rows: list[dict[str, object]] = []
    for contender in entries:
        timing = timings[contender.name]
        gb_per_s = contender.bytes_per_param * numel / timing.median_s / 1e9
        row = {"bench": "adam_step", "numel": numel, "impl": contender.name, "backend": contender.backend,
               "bytes_per_param": contender.bytes_per_param, "params_per_s": numel / timing.median_s,
               "gb_per_s": gb_per_s, "speedup_vs_torch_fused": baseline / timing.median_s, **asdict(timing)}
        if device.type == "cuda":
            row["peak_gbps"] = args.peak_gbps
            row["peak_fraction"] = gb_per_s / args.peak_gbps
        rows.append(row)
    return rows


def _count(numel: int) -> str:
    for suffix, unit in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if numel % unit == 0:
            return f"{numel // unit}{suffix}"
    return str(numel)


def table(rows: list[dict[str, object]], on_gpu: bool) -> str:
    headers = ["params", "implementation", "backend", "median ms", "p20-p80 ms", "Mparams/s", "GB/s",
               "vs AdamW(fused)"] + (["% of peak HBM"] if on_gpu else [])
    body = []
    for r in rows:
        cells = [_count(r["numel"]), r["impl"], r["backend"], f"{r['median_s'] * 1e3:.2f}",
                 f"{r['p20_s'] * 1e3:.2f}-{r['p80_s'] * 1e3:.2f}", f"{r['params_per_s'] / 1e6:,.0f}",
                 f"{r['gb_per_s']:.1f}", f"{r['speedup_vs_torch_fused']:.2f}x"]
        body.append(cells + ([f"{100 * r['peak_fraction']:.0f}%"] if on_gpu else []))
    return markdown_table(headers, body)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,16M,128M", help="comma-separated parameter counts (1M = 2**20)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per contender (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocations, autotune)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-gbps", type=float, default=H100_SXM_PEAK_GBPS,
                        help="peak memory bandwidth in GB/s for the %% of peak column (default: H100 SXM)")
    parser.add_argument("--jsonl", type=Path, default=Path(__file__).parent / "results" / "bench_kernels.jsonl",
                        help="rows are appended here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    sizes = [parse_count(text) for text in args.sizes.split(",")]
    if kernels.backend_for(torch.empty(1, device=device)) == "triton-interpret":
        print("TRITON_INTERPRET=1 is set: interpreter timings are not speed. Unset it and re-run.", file=sys.stderr)
        return 2
    context = {"device": device_info(device), **environment(), "config": {**vars(args), "jsonl": str(args.jsonl)}}
    rows = [row | context for numel in sizes for row in bench_size(numel, device, args)]
    write_rows(args.jsonl, rows)
    print(f"Adam step on {context['device']['name']} ({device.type}), torch {context['torch']}, "
          f"triton {context['triton']}, median of {args.repeats} after {args.warmup} warm-up\n")
    print(table(rows, device.type == "cuda"))
    print(f"\n{len(rows)} rows appended to {args.jsonl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
