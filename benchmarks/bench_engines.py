"""hf_zero stages 1-3 side by side with DDP, FSDP2 and DeepSpeed ZeRO 1-3, in one command.

Each engine runs the same workload (``engines/workload.py``: a GPT-2-style causal LM built from a
config under one seed, AdamW, clipping 1.0, a synthetic Markov-chain batch per (seed, rank, step)
made before the timed loop) as its own ``torchrun --nproc_per_node 2`` with 1 torch thread per
rank. Per engine it records step time (max over ranks per step; median and p20-p80 over the
steps after warm-up), tokens/s, peak RSS per rank, model-state bytes per rank, bytes through
collectives per step per rank and the loss at every step; prints every figure as a ratio to
DeepSpeed at the same stage and to FSDP2, and to the ZeRO formula; checks every loss curve
against DDP's; appends JSONL rows to ``results/bench_engines.jsonl``.

    python benchmarks/bench_engines.py                                   # all 8 engines, CPU
    python benchmarks/bench_engines.py --repeats 3                       # median of 3 medians
    python benchmarks/bench_engines.py --engines hf_zero3,ds3,fsdp2 --steps 30
    python benchmarks/bench_engines.py --engines hf_zero --overlap both  # overlap on vs off
    python benchmarks/bench_engines.py --engines hf_zero3,ds3 --zero stage3_max_reuse_distance=0
    python benchmarks/bench_engines.py --engines hf_zero3 --profile /tmp/traces
    python benchmarks/bench_engines.py --device cuda                     # NCCL, bf16, bigger model
    python benchmarks/bench_engines.py --sizes small,medium,smollm2      # three sizes, a scaling table
    python benchmarks/bench_engines.py --engines hf_zero3,fsdp2 --compile inductor  # eager vs compiled units

Engines: hf_zero1 hf_zero2 hf_zero3 ddp fsdp2 ds1 ds2 ds3 nocomm (groups: all, hf_zero, torch, ds).
``nocomm`` is the compute floor: each rank trains alone with no collective (its loss is not
checked against DDP's); every engine's step time is that floor plus what the engine adds.

How figures are counted (details in the engines/ modules' notes):

- Communication: the full logical tensor of each collective (all-gather output, reduce-scatter
  input, all-reduce tensor), the unit of hf_zero's ``engine.comm_stats()`` and of the ZeRO
  paper's 2Ψ / 3Ψ; the peers' collectives are wrapped at ``torch.distributed`` (new 2.13 names
  and funcol included); DDP runs its reference Python all-reduce hook so it is counted.
  An all-reduce counts Ψ here though a ring moves about 2Ψ (``ring_equivalent_bytes``).
- Model states: params + fp32 master + grads + optimizer state on one rank after the last
  backward, before the step, each storage counted once at its full size.
- Formulas (fp32; p = g = 4 bytes, K = 8 for Adam's two moments, the master *is* the param):
  stage 0 (DDP) 16Ψ; stage 1 (p+g)Ψ + KΨ/N; stage 2 pΨ + (g+K)Ψ/N; stage 3 (FSDP2 too)
  16Ψ/N. Communication: stage 0 Ψ (one all-reduce), stages 1-2 2Ψ, stage 3 3Ψ elements.
- Background CPU: /proc/stat busy time of the whole machine during the timed window, minus the
  ranks' own CPU time, over the window's CPU capacity. Above ``--max-background`` the figures
  are labelled as taken under load (``--retries`` reruns such a run).

DeepSpeed is a benchmark-only dependency, not in hf_zero's requirements:
``DS_BUILD_OPS=0 pip install deepspeed`` (0.19.8 here). It runs on CPU with ``DS_ACCELERATOR=cpu``
and gloo; its first start JIT-builds a small shared-memory comm op (~30 s, cached after). Without
it the other engines run and DeepSpeed is reported as unavailable.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _harness import device_info, environment, markdown_table, spread, write_rows

from engines import ENGINES, family_of, stage_of
from engines.probes import machine_cpu_s
from engines.trace_overlap import overlap as trace_overlap
from engines.workload import Workload, build_model, count_params

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "bench_engines.jsonl"
GROUPS = {
    "all": list(ENGINES), "hf_zero": ["hf_zero1", "hf_zero2", "hf_zero3"], "torch": ["ddp", "fsdp2"],
    "ds": ["ds1", "ds2", "ds3"], "deepspeed": ["ds1", "ds2", "ds3"],
}
CPU_DEFAULTS = dict(n_layer=4, n_embd=256, vocab=8192, seq=128, micro_batch=4, dtype="fp32")
CUDA_DEFAULTS = dict(n_layer=12, n_embd=768, vocab=32768, seq=1024, micro_batch=8, dtype="bf16")
LOSS_TOL = {"fp32": 1e-4, "bf16": 5e-2}
# ``--sizes``: named model shapes (GPT-2 blocks, tied embeddings). ``smollm2`` has the shape of
# SmolLM2-135M (30 layers, hidden 576, vocab 49152, tied); GPT-2's 4x MLP makes it 147M parameters.
SIZES = {
    "small": dict(n_layer=4, n_embd=256, vocab=8192),
    "medium": dict(n_layer=8, n_embd=512, vocab=8192),
    "smollm2": dict(n_layer=30, n_embd=576, vocab=49152),
}
MIB = 2**20


# ---------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="all", help="comma list of engines or groups (all, hf_zero, torch, ds)")
    p.add_argument("--steps", type=int, default=20, help="steps per run, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="leading steps left out of every figure")
    p.add_argument("--repeats", type=int, default=1, help="runs per engine (interleaved); median of medians")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--nproc", type=int, default=None, help="ranks per run (CPU default 2; CUDA: GPUs)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    for name in ("n-layer", "n-embd", "vocab", "seq", "micro-batch"):
        p.add_argument(f"--{name}", type=int, default=None, help="model/batch size (defaults depend on --device)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="CPU default fp32, CUDA bf16")
    p.add_argument("--sizes", default=None, metavar="NAMES",
                   help=f"comma list of model sizes run one after the other, then a scaling table: names "
                        f"({', '.join(f'{k}: {v}' for k, v in SIZES.items())}) or LAYERSxHIDDENxVOCAB; "
                        "overrides --n-layer/--n-embd/--vocab")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak TFLOP/s of one device for MFU (CUDA default: 989, H100 SXM bf16; "
                        "CPU: none, MFU not shown)")
    p.add_argument("--overlap", choices=["auto", "on", "off", "both"], default="auto",
                   help="hf_zero zero_optimization.overlap_comm (auto: leave it unset; both: run each)")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="also run each hf_zero engine with engine.compile(backend=BACKEND) (each unit's forward "
                        "under torch.compile), labelled hf_zeroN/compiled; the warm-up steps take the compilation")
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage3_param_persistence_threshold for hf_zero and DeepSpeed alike (default theirs: 1e5)")
    p.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra zero_optimization key for hf_zero and DeepSpeed alike, JSON value "
                        "(repeatable), e.g. --zero stage3_max_reuse_distance=0")
    p.add_argument("--fsdp-reshard-after-forward", choices=["auto", "true", "false"], default="auto",
                   help="FSDP2 reshard_after_forward (auto: FSDP2's default, blocks True / root False)")
    p.add_argument("--ddp-builtin-allreduce", action="store_true",
                   help="DDP's C++ all-reduce instead of the counted Python hook (comm then reads 0)")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="export a torch.profiler chrome trace of a few extra hf_zero steps per rank")
    p.add_argument("--loss-tol", type=float, default=None, help="max |loss - DDP loss| (fp32 1e-4, bf16 5e-2)")
    p.add_argument("--max-background", type=float, default=0.05,
                   help="background CPU fraction above which a run is labelled as under load")
    p.add_argument("--retries", type=int, default=0, help="reruns of a run taken under load")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                   help="before each run, wait up to this long for the machine's other load to drop "
                        "below --max-background")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file the rows are appended to")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--verbose", action="store_true", help="show each run's output")
    args = p.parse_args(argv)
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 989.0
    if args.nproc is None:
        args.nproc = max(1, torch.cuda.device_count()) if args.device == "cuda" else 2
    problems = []
    if args.steps <= args.warmup:
        problems.append(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.repeats < 1:
        problems.append(f"--repeats must be >= 1, found {args.repeats}")
    if args.sizes is not None:
        try:
            args.sizes = {name: size_of(name) for name in args.sizes.split(",")}
        except ValueError as exc:
            problems.append(str(exc))
    if args.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu")
    if problems:
        p.error("; ".join(problems))
    return args


def size_of(name: str) -> dict[str, int]:
    """A ``--sizes`` entry: a name from SIZES or LAYERSxHIDDENxVOCAB."""
    if name in SIZES:
        return SIZES[name]
    parts = name.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--sizes: {name!r} is neither a size name ({', '.join(SIZES)}) nor LAYERSxHIDDENxVOCAB")
    return dict(zip(("n_layer", "n_embd", "vocab"), map(int, parts)))


def zero_extra(items: list[str]) -> dict[str, Any]:
    """``--zero KEY=VALUE`` items as a dict (values parsed as JSON, else kept as strings)."""
    extra: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--zero expects KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def select_engines(spec: str) -> list[str]:
    chosen: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        names = GROUPS.get(item, [item])
        unknown = [n for n in names if n not in ENGINES]
        if unknown:
            raise SystemExit(f"unknown engine {item!r}; expected one of {', '.join(ENGINES)} or a group "
                             f"({', '.join(GROUPS)})")
        chosen += [n for n in names if n not in chosen]
    return chosen


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(n_layer=args.n_layer, n_embd=args.n_embd, vocab=args.vocab, seq=args.seq,
                    micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup, dtype=args.dtype,
                    device=args.device, seed=args.seed)


# ---------------------------------------------------------------------------------- runs
@dataclass
class Variant:
    """One engine with its options: what a row of the table is."""

    label: str
    engine: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> str:
        return family_of(self.engine)

    @property
    def stage(self) -> int | None:
        return stage_of(self.engine)


def variants(engines: list[str], args: argparse.Namespace) -> list[Variant]:
    out = []
    raf = {"auto": None, "true": True, "false": False}[args.fsdp_reshard_after_forward]
    for engine in engines:
        options: dict[str, Any] = {}
        family = family_of(engine)
        if family in ("hf_zero", "deepspeed") and args.persistence_threshold is not None:
            options["persistence_threshold"] = args.persistence_threshold
        if family in ("hf_zero", "deepspeed") and args.zero:
            options["zero_extra"] = zero_extra(args.zero)
        if family == "fsdp2":
            options["fsdp_reshard_after_forward"] = raf
        if family == "ddp":
            options["ddp_builtin_allreduce"] = args.ddp_builtin_allreduce
        if family == "hf_zero" and args.overlap == "both":
            out += [Variant(f"{engine}/overlap_{o}", engine, {**options, "overlap": o}) for o in ("on", "off")]
            continue
        if family == "hf_zero" and args.overlap in ("on", "off"):
            options["overlap"] = args.overlap
        out.append(Variant(engine, engine, options))
        if family == "hf_zero" and args.compile:
            out.append(Variant(f"{engine}/compiled", engine, {**options, "compile": args.compile}))
    return out


def deepspeed_unavailable() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (benchmark-only dependency: DS_BUILD_OPS=0 pip install deepspeed)"
    return None


def run_env(args: argparse.Namespace, family: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR)] + [p for p in [env.get("PYTHONPATH")] if p])
    # One ninja for DeepSpeed's JIT op: the interpreter's own (another one re-hashes and rebuilds).
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if family == "deepspeed" and args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def busy_fraction(seconds: float = 2.0) -> float | None:
    """The whole machine's busy CPU fraction over ``seconds`` (this process sleeps meanwhile)."""
    start = machine_cpu_s()
    time.sleep(seconds)
    end = machine_cpu_s()
    if not start or not end or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def wait_quiet(limit_s: float, threshold: float) -> float | None:
    """Wait (at most ``limit_s``) until other processes use less than ``threshold`` of the CPUs."""
    deadline = time.monotonic() + limit_s
    busy = busy_fraction()
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        time.sleep(5)
        busy = busy_fraction()
    return busy


def launch(variant: Variant, workload: Workload, args: argparse.Namespace, work_dir: Path, repeat: int
           ) -> dict[str, Any]:
    """One torchrun; the worker's raw per-rank figures, or {"error": ...}."""
    tag = f"{variant.label.replace('/', '_')}_r{repeat}"
    spec = {
        "engine": variant.engine, "options": variant.options, "workload": workload.to_dict(),
        "threads": args.threads, "out": str(work_dir / f"{tag}.json"), "label": tag,
        "profile_dir": str(Path(args.profile).resolve()) if args.profile and repeat == 0 else None,
    }
    spec_path = work_dir / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work_dir / f"{tag}.log"
    # --standalone: the rendezvous store binds a free port itself. A port picked here and handed over
    # can be taken by another process in between (seen in CI as a DDP run failing after 5 s).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "engines.worker", "--spec", str(spec_path)]
    started = time.perf_counter()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(command, env=run_env(args, variant.family), cwd=BENCH_DIR, timeout=args.timeout,
                                  stdout=None if args.verbose else log, stderr=subprocess.STDOUT if not args.verbose else None)
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    elapsed = time.perf_counter() - started
    out = Path(spec["out"])
    if returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        return {"error": f"torchrun exit {returncode} after {elapsed:.0f} s", "log_tail": tail, "log": str(log_path)}
    raw = json.loads(out.read_text())
    raw["wall_s"] = elapsed
    return raw


# ---------------------------------------------------------------------------------- figures
def background_frac(ranks: list[dict[str, Any]]) -> float | None:
    window = ranks[0]["window"]
    start, end = window["machine_start"], window["machine_end"]
    if not start or not end:
        return None
    busy, total = end[0] - start[0], end[1] - start[1]
    own = sum(r["window"]["cpu_s"] for r in ranks)
    return max(0.0, (busy - own) / total) if total > 0 else None


def _median_int(values: list[int]) -> int:
    return int(statistics.median(values))


def summarize_run(raw: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """One run's figures from every rank's raw numbers."""
    ranks = sorted(raw["ranks"], key=lambda r: r["rank"])
    world = raw["world_size"]
    timed = slice(workload.warmup, workload.steps)
    step_s = [max(r["fwd_bwd_s"][i] + r["opt_s"][i] for r in ranks) for i in range(workload.steps)][timed]
    fwd_bwd = [max(r["fwd_bwd_s"][i] for r in ranks) for i in range(workload.steps)][timed]
    opt = [max(r["opt_s"][i] for r in ranks) for i in range(workload.steps)][timed]
    timing = spread(step_s, workload.warmup)
    engine_counted = ranks[0]["engine_comm"][-1] is not None

    def comm_of(r: dict[str, Any], key: str = "comm", field_: str = "bytes") -> int:
        return _median_int([c[field_] for c in r[key][timed]])

    comm_key = "engine_comm" if engine_counted else "comm"
    summary = {
        "world_size": world,
        "step_time_median_s": timing.median_s, "step_time_p20_s": timing.p20_s, "step_time_p80_s": timing.p80_s,
        "step_time_min_s": timing.min_s, "step_time_max_s": max(step_s), "step_times_s": step_s,
        "fwd_bwd_time_median_s": statistics.median(fwd_bwd), "opt_step_time_median_s": statistics.median(opt),
        "tokens_per_s": workload.tokens_per_step(world) / timing.median_s,
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
        "rss_base_mib_per_rank": [r["rss_base_mib"] for r in ranks],
        "rss_after_init_mib_per_rank": [r["rss_after_init_mib"] for r in ranks],
        "model_state_bytes_per_rank": [r["model_state"]["total"] for r in ranks],
        "model_state_breakdown_per_rank": [r["model_state"] for r in ranks],
        "model_state_post_step_per_rank": [r["model_state_post_step"]["total"] for r in ranks],
        "model_state_detail_rank0": ranks[0]["model_state_detail"],
        "engine_buffers_bytes_per_rank": [r["engine_buffers_bytes"] for r in ranks],
        "engine_buffers_resident_bytes_per_rank": [r["engine_buffers_resident_bytes"] for r in ranks],
        "comm_counted_by": "engine.comm_stats()" if engine_counted else "torch.distributed wrapper",
        "comm_bytes_per_step_per_rank": [comm_of(r, comm_key) for r in ranks],
        "comm_ring_equivalent_bytes_per_step_per_rank": [comm_of(r, comm_key, "ring_equivalent_bytes") for r in ranks],
        "comm_bytes_wrapper_per_step_per_rank": [comm_of(r) for r in ranks],
        "comm_bytes_wrapper_per_step_by_kind_rank0": {k.removesuffix("_bytes"): v for k, v in ranks[0]["comm"][-1].items()
                                                      if k.endswith("_bytes") and k != "ring_equivalent_bytes"},
        "comm_bytes_per_step_by_op_rank0": {op: v["bytes"] for op, v in ranks[0][comm_key][-1]["by_op"].items()},
        "comm_calls_per_step_by_op_rank0": {op: v["calls"] for op, v in ranks[0][comm_key][-1]["by_op"].items()},
        "comm_bytes_init_per_rank": [r["comm_init"]["bytes"] for r in ranks],
        "unwrapped_refs": sorted({ref for r in ranks for ref in r["unwrapped_refs"]}),
        "loss": [statistics.fmean(r["loss"][i] for r in ranks) for i in range(workload.steps)],
        "loss_per_rank": [r["loss"] for r in ranks],
        "background_cpu_frac": background_frac(ranks),
        "rank_cpu_util": [r["window"]["cpu_s"] / r["window"]["wall_s"] for r in ranks],
        "run_wall_s": raw.get("wall_s"),
        "engine_info": ranks[0]["info"],
        "profile_traces": [r["profile_trace"] for r in ranks if r.get("profile_trace")],
    }
    if any("cuda_max_allocated_bytes" in r for r in ranks):
        summary["cuda_max_allocated_bytes_per_rank"] = [r.get("cuda_max_allocated_bytes") for r in ranks]
    return summary


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one variant: step-time figures are the median of the runs' medians (p20/p80 and
    min over every timed step of every run); the rest is deterministic and comes from the run
    with the median step time."""
    medians = [r["step_time_median_s"] for r in runs]
    middle = sorted(runs, key=lambda r: r["step_time_median_s"])[(len(runs) - 1) // 2]
    pooled = spread([s for r in runs for s in r["step_times_s"]])
    out = dict(middle)
    out.update(
        step_time_median_s=statistics.median(medians), step_time_medians_s=medians,
        step_time_p20_s=pooled.p20_s, step_time_p80_s=pooled.p80_s, step_time_min_s=pooled.min_s,
        step_time_max_s=max(r["step_time_max_s"] for r in runs),
        fwd_bwd_time_median_s=statistics.median(r["fwd_bwd_time_median_s"] for r in runs),
        opt_step_time_median_s=statistics.median(r["opt_step_time_median_s"] for r in runs),
        background_cpu_frac_per_repeat=[r["background_cpu_frac"] for r in runs], repeats=len(runs),
        profile_traces=[t for r in runs for t in r["profile_traces"]],
    )
    out["tokens_per_s"] = middle["tokens_per_s"] * middle["step_time_median_s"] / out["step_time_median_s"]
    return out


def formulas(stage: int, psi: int, world: int, dtype: str) -> dict[str, float]:
    """ZeRO model-state and communication bytes per rank (see the module docstring)."""
    p = g = 2 if dtype == "bf16" else 4
    k = 12 if dtype == "bf16" else 8  # bf16: fp32 master + 2 moments; fp32: the param is the master
    state = {0: (p + g + k) * psi, 1: (p + g) * psi + k * psi / world, 2: p * psi + (g + k) * psi / world,
             3: (p + g + k) * psi / world}[stage]
    comm = {0: 1, 1: 2, 2: 2, 3: 3}[stage] * psi * p
    return {"model_state_formula_bytes": state, "comm_formula_bytes": comm}


def formula_stage(variant: Variant) -> int:
    return {"ddp": 0, "fsdp2": 3}.get(variant.family, variant.stage or 0)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


KEY_FIGURES = {
    "step_time": lambda s: s["step_time_median_s"],
    # Peak memory: ru_maxrss on a CPU run, torch.cuda.max_memory_allocated on a GPU run.
    "peak_rss": lambda s: max(s.get("cuda_max_allocated_bytes_per_rank") or s["peak_rss_mib_per_rank"]),
    "model_state": lambda s: max(s["model_state_bytes_per_rank"]),
    "comm": lambda s: max(s["comm_bytes_per_step_per_rank"]),
}


def add_comparisons(rows: dict[str, dict[str, Any]], variants_: list[Variant], psi: int, workload: Workload,
                    loss_tol: float) -> None:
    """Ratios to DeepSpeed at the same stage and to FSDP2, to the formulas, and the loss check."""
    by_label = {v.label: v for v in variants_}
    ds_of = {v.stage: v.label for v in variants_ if v.family == "deepspeed" and rows.get(v.label, {}).get("ok")}
    fsdp = next((v.label for v in variants_ if v.family == "fsdp2" and rows.get(v.label, {}).get("ok")), None)
    ddp = next((v.label for v in variants_ if v.family == "ddp" and rows.get(v.label, {}).get("ok")), None)
    for label, row in rows.items():
        if not row.get("ok"):
            continue
        variant, s = by_label[label], row["figures"]
        ds_label = ds_of.get(variant.stage) if variant.family in ("hf_zero", "deepspeed") else None
        ratios: dict[str, Any] = {}
        for name, get in KEY_FIGURES.items():
            ratios[f"{name}_vs_deepspeed"] = _ratio(get(s), get(rows[ds_label]["figures"])) if ds_label else None
            ratios[f"{name}_vs_fsdp2"] = _ratio(get(s), get(rows[fsdp]["figures"])) if fsdp else None
        f = formulas(formula_stage(variant), psi, s["world_size"], workload.dtype)
        ratios["model_state_vs_formula"] = _ratio(KEY_FIGURES["model_state"](s), f["model_state_formula_bytes"])
        ratios["comm_vs_formula"] = _ratio(KEY_FIGURES["comm"](s), f["comm_formula_bytes"])
        if variant.family == "hf_zero":
            row["targets"] = targets(ratios)
        row.update(ratios=ratios, deepspeed_reference=ds_label, fsdp2_reference=fsdp, formula_stage=formula_stage(variant),
                   **f)
        if ddp is None or variant.family == "floor":  # the floor's ranks do not average gradients
            row.update(loss_max_abs_diff_vs_ddp=None, loss_match=None)
            continue
        reference = rows[ddp]["figures"]["loss_per_rank"]
        diff = max(abs(a - b) for mine, ref in zip(s["loss_per_rank"], reference) for a, b in zip(mine, ref))
        row.update(loss_max_abs_diff_vs_ddp=diff, loss_tolerance=loss_tol, loss_match=diff <= loss_tol)


def add_throughput(rows: dict[str, dict[str, Any]], psi: int, workload: Workload, peak_tflops: float | None) -> None:
    """Model TFLOP/s per rank (PaLM's count, ``Workload.flops_per_token``) and MFU against the
    device's dense peak when it is known."""
    for row in rows.values():
        if not row.get("ok"):
            continue
        s = row["figures"]
        s["model_tflops_per_s_per_rank"] = s["tokens_per_s"] * workload.flops_per_token(psi) / s["world_size"] / 1e12
        s["mfu"] = s["model_tflops_per_s_per_rank"] / peak_tflops if peak_tflops else None


# (name, ratio, rule, bound). The byte targets allow 0.1%: scalar collectives (a grad-norm
# all-reduce of 4 vs 8 bytes) and step counters should not decide a comparison.
TARGETS = (
    ("step_time <= 0.8x DeepSpeed", "step_time_vs_deepspeed", "at_most", 0.8),
    ("step_time <= FSDP2", "step_time_vs_fsdp2", "at_most", 1.0),
    ("model_state <= DeepSpeed", "model_state_vs_deepspeed", "at_most", 1.001),
    # At most the ZeRO formula (+5%): hf_zero's stage 1 sits below it, as it keeps only its
    # fp32 gradient shard once the boundary's reduce-scatter is done.
    ("model_state <= formula (+5%)", "model_state_vs_formula", "at_most", 1.05),
    ("comm <= DeepSpeed", "comm_vs_deepspeed", "at_most", 1.001),
    # At most the ZeRO volume (+2%): stage 3 moves 3Ψ when every unit is re-gathered for its
    # backward and 2Ψ when the reuse distance keeps the forward's gathers (DeepSpeed's defaults).
    ("comm <= 2Ψ/3Ψ (+2%)", "comm_vs_formula", "at_most", 1.02),
)


def targets(ratios: dict[str, float | None]) -> dict[str, bool | None]:
    """Issue 8's targets for an hf_zero row: True met, False missed, None no reference."""
    out: dict[str, bool | None] = {}
    for name, key, rule, bound in TARGETS:
        value = ratios.get(key)
        if value is None:
            out[name] = None
        elif rule == "at_most":
            out[name] = value <= bound + 1e-12
        else:
            out[name] = abs(value - 1) <= bound
    return out


# ---------------------------------------------------------------------------------- output
def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def results_table(rows: dict[str, dict[str, Any]]) -> str:
    headers = ["engine", "step s median [p20–p80]", "×DS", "×FSDP2", "tok/s", "TFLOP/s/rank [MFU]", "peak mem MiB", "×DS", "×FSDP2",
               "model states MiB", "×DS", "×FSDP2", "×formula", "comm MiB/step", "×DS", "×FSDP2", "×formula",
               "max |Δloss| vs DDP", "bg CPU"]
    body = []
    for label, row in rows.items():
        if not row.get("ok"):
            body.append([label, row["status"].upper() + ": " + row["reason"][:80]] + [""] * (len(headers) - 2))
            continue
        s, r = row["figures"], row["ratios"]
        loss = "—" if row["loss_max_abs_diff_vs_ddp"] is None else f"{row['loss_max_abs_diff_vs_ddp']:.1e}"
        if row["loss_match"] is False:
            loss += " MISMATCH"
        bg = [b for b in s["background_cpu_frac_per_repeat"] if b is not None]
        body.append([
            label, f"{s['step_time_median_s']:.3f} [{s['step_time_p20_s']:.3f}–{s['step_time_p80_s']:.3f}]",
            _x(r["step_time_vs_deepspeed"]), _x(r["step_time_vs_fsdp2"]), f"{s['tokens_per_s']:.0f}",
            f"{s['model_tflops_per_s_per_rank']:.3f}" + (f" [{s['mfu']:.1%}]" if s["mfu"] is not None else ""),
            f"{KEY_FIGURES['peak_rss'](s) / (MIB if 'cuda_max_allocated_bytes_per_rank' in s else 1):.0f}",
            _x(r["peak_rss_vs_deepspeed"]), _x(r["peak_rss_vs_fsdp2"]),
            f"{max(s['model_state_bytes_per_rank']) / MIB:.2f}", _x(r["model_state_vs_deepspeed"]),
            _x(r["model_state_vs_fsdp2"]), _x(r["model_state_vs_formula"]),
            f"{max(s['comm_bytes_per_step_per_rank']) / MIB:.2f}", _x(r["comm_vs_deepspeed"]), _x(r["comm_vs_fsdp2"]),
            _x(r["comm_vs_formula"]), loss, f"{max(bg):.2f}" if bg else "—",
        ])
    return markdown_table(headers, body)


def comm_table(rows: dict[str, dict[str, Any]]) -> str:
    body = []
    for label, row in rows.items():
        if row.get("ok"):
            s = row["figures"]
            ops = ", ".join(f"{op} {b / MIB:.2f} MiB ×{s['comm_calls_per_step_by_op_rank0'][op]}"
                            for op, b in s["comm_bytes_per_step_by_op_rank0"].items())
            ring = max(s["comm_ring_equivalent_bytes_per_step_per_rank"]) / MIB
            body.append([label, s["comm_counted_by"], ops or "none", f"{ring:.2f}"])
    return markdown_table(["engine", "counted by", "collectives per step, rank 0 (logical size)",
                           "ring-equivalent MiB (all-reduce ×2)"], body)


def memory_table(rows: dict[str, dict[str, Any]]) -> str:
    body = []
    for label, row in rows.items():
        if row.get("ok"):
            s = row["figures"]
            parts = "; ".join(
                " + ".join(f"{b[c] / MIB:.2f}" for c in ("params", "master", "grads", "optim"))
                for b in s["model_state_breakdown_per_rank"])
            buffers = [f"{(res or 0) / MIB:.1f} of {b / MIB:.1f}" for b, res in
                       zip(s["engine_buffers_bytes_per_rank"], s["engine_buffers_resident_bytes_per_rank"]) if b]
            body.append([label, parts, ", ".join(buffers) or "—",
                         " / ".join(f"{x:.0f}" for x in s["peak_rss_mib_per_rank"]),
                         " / ".join(f"{x:.0f}" for x in s["rss_base_mib_per_rank"])])
    return markdown_table(["engine", "params + master + grads + optim MiB (per rank)",
                           "engine buffers resident MiB", "peak RSS MiB per rank", "RSS base MiB"], body)


def targets_table(rows: dict[str, dict[str, Any]]) -> str:
    body = []
    for label, row in rows.items():
        if row.get("ok") and row["family"] == "hf_zero":
            body.append([label] + ["—" if v is None else ("PASS" if v else "MISS") for v in row["targets"].values()])
    return markdown_table(["hf_zero"] + [name for name, *_ in TARGETS], body) if body else ""


def trace_table(traces: list[tuple[str, str]]) -> str:
    body = []
    for label, path in traces:
        o = trace_overlap(path)
        frac = "—" if o["comm_overlapped_frac"] is None else f"{o['comm_overlapped_frac']:.0%}"
        body.append([label, path, f"{o['comm_us'] / 1e3:.1f}", f"{o['overlap_us'] / 1e3:.1f}", frac])
    return markdown_table(["engine", "chrome trace", "collectives ms", "overlapped ms", "overlapped"], body)


def overlap_table(rows: dict[str, dict[str, Any]]) -> str:
    body = []
    for label, row in rows.items():
        if label.endswith("/overlap_on") and row.get("ok"):
            off = rows.get(label.replace("/overlap_on", "/overlap_off"))
            if off and off.get("ok"):
                on_s, off_s = row["figures"]["step_time_median_s"], off["figures"]["step_time_median_s"]
                body.append([label.split("/")[0], f"{on_s:.3f}", f"{off_s:.3f}", f"{on_s / off_s:.2f}"])
    return markdown_table(["engine", "overlap on s", "overlap off s", "on / off"], body) if body else ""


# ---------------------------------------------------------------------------------- main
def run_all(args: argparse.Namespace, variants_: list[Variant], workload: Workload, work_dir: Path
            ) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {v.label: [] for v in variants_}
    ds_reason = deepspeed_unavailable()
    for repeat in range(args.repeats):  # interleaved, so a change of load lands on every engine
        for variant in variants_:
            if variant.label in rows:
                continue
            if variant.family == "deepspeed" and ds_reason:
                rows[variant.label] = {"ok": False, "status": "unavailable", "reason": ds_reason}
                print(f"[bench_engines] {variant.label}: unavailable ({ds_reason})", flush=True)
                continue
            best = None
            for attempt in range(args.retries + 1):
                if args.wait_quiet > 0:
                    wait_quiet(args.wait_quiet, args.max_background)
                print(f"[bench_engines] {variant.label} run {repeat + 1}/{args.repeats}"
                      + (f" (retry {attempt})" if attempt else "") + f", load {os.getloadavg()[0]:.2f} ...",
                      end="", flush=True)
                raw = launch(variant, workload, args, work_dir, repeat)
                if "error" in raw:
                    print(f" FAILED: {raw['error']} (log: {raw['log']})\n{raw['log_tail']}", flush=True)
                    status = "unavailable" if variant.family == "deepspeed" else "failed"
                    rows[variant.label] = {"ok": False, "status": status, "reason": raw["error"],
                                           "log_tail": raw["log_tail"]}
                    best = None
                    break
                summary = summarize_run(raw, workload)
                bg = summary["background_cpu_frac"]
                print(f" step {summary['step_time_median_s']:.3f} s, background CPU {bg if bg is None else round(bg, 2)}",
                      flush=True)
                if best is None or (bg or 0) < (best["background_cpu_frac"] or 0):
                    best = summary
                if bg is None or bg <= args.max_background:
                    break
            if best is not None:
                runs[variant.label].append(best)
    for variant in variants_:
        if variant.label not in rows:
            rows[variant.label] = {"ok": True, "status": "ok", "figures": aggregate(runs[variant.label])}
    return rows


def finish_rows(rows: dict[str, dict[str, Any]], variants_: list[Variant], args: argparse.Namespace,
                workload: Workload, psi: int) -> list[dict[str, Any]]:
    env = environment(("transformers", "deepspeed"))
    device = device_info(torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"))
    device["torch_threads"] = args.threads
    device["ranks"] = args.nproc
    run_id = env["timestamp"]
    out = []
    for variant in variants_:
        row = rows[variant.label]
        row.update(benchmark="engines", run_id=run_id, engine=variant.label, engine_key=variant.engine,
                   family=variant.family, stage=variant.stage, options=variant.options)
        bg = [b for b in row.get("figures", {}).get("background_cpu_frac_per_repeat", []) if b is not None]
        row["under_load"] = bool(bg) and max(bg) > args.max_background
        out.append({**row, "device": device, "env": env, "workload": workload.to_dict(), "params": psi,
                    "repeats": args.repeats, "comm_counting": "logical: all-gather output, reduce-scatter input, "
                    "all-reduce/broadcast tensor"})
    return out


def scaling_table(by_size: dict[str, tuple[int, dict[str, dict[str, Any]]]]) -> str:
    """hf_zero's ratios to DeepSpeed at the same stage and to FSDP2, one row per (size, stage)."""
    headers = ["size", "Ψ", "engine", "step ×DS", "step ×FSDP2", "peak mem ×DS", "peak mem ×FSDP2",
               "model states ×formula", "comm ×formula"]
    body = []
    for size, (psi, rows) in by_size.items():
        for label, row in rows.items():
            if not label.startswith("hf_zero") or not row.get("ok"):
                continue
            r = row["ratios"]
            body.append([size, f"{psi / 1e6:.1f}M", label, _x(r["step_time_vs_deepspeed"]), _x(r["step_time_vs_fsdp2"]),
                         _x(r["peak_rss_vs_deepspeed"]), _x(r["peak_rss_vs_fsdp2"]), _x(r["model_state_vs_formula"]),
                         _x(r["comm_vs_formula"])])
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sizes is None:
        return run_size(args)[0]
    by_size: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {}
    worst = 0
    for size, shape in args.sizes.items():
        for key, value in shape.items():
            setattr(args, key, value)
        print(f"\n# size {size}: {shape}", flush=True)
        code, psi, rows = run_size(args)
        by_size[size] = (psi, rows)
        worst = max(worst, code)
    print("\n## Scaling: hf_zero against DeepSpeed (same stage) and FSDP2, per size\n")
    print(scaling_table(by_size))
    return worst


def run_size(args: argparse.Namespace) -> tuple[int, int, dict[str, dict[str, Any]]]:
    """One benchmark at the size in ``args``: the tables, the JSONL rows; (exit code, Ψ, rows)."""
    workload = workload_of(args)
    variants_ = variants(select_engines(args.engines), args)
    psi = count_params(build_model(workload))
    tolerance = args.loss_tol if args.loss_tol is not None else LOSS_TOL[workload.dtype]
    print(f"[bench_engines] {len(variants_)} engine runs x {args.repeats}: GPT-2 {workload.n_layer} layers, "
          f"hidden {workload.n_embd}, vocab {workload.vocab}, seq {workload.seq}, micro batch {workload.micro_batch}, "
          f"{workload.dtype} on {args.device}, {args.nproc} ranks x {args.threads} thread(s), Ψ = {psi:,} params, "
          f"{workload.steps} steps ({workload.warmup} warm-up)", flush=True)
    work_dir = Path(tempfile.mkdtemp(prefix="bench_engines_"))
    rows = run_all(args, variants_, workload, work_dir)
    add_comparisons(rows, variants_, psi, workload, tolerance)
    add_throughput(rows, psi, workload, args.peak_tflops)
    final = finish_rows(rows, variants_, args, workload, psi)

    print("\n## Results (ratios: ×DS = / DeepSpeed at the same stage, ×FSDP2 = / FSDP2, ×formula = / ZeRO formula)\n")
    print(results_table(rows))
    print("\n## Communication per step (logical sizes: all-gather output, reduce-scatter input, all-reduce tensor)\n")
    print(comm_table(rows))
    print("\n## Model states after the last backward, before the step\n")
    print(memory_table(rows))
    for title, table in (("## hf_zero against issue 8's targets", targets_table(rows)),
                         ("## Overlap on vs off", overlap_table(rows))):
        if table:
            print(f"\n{title}\n\n{table}")
    traces = [(label, t) for label, row in rows.items() if row.get("ok") for t in row["figures"]["profile_traces"]]
    if traces:
        print("\n## Profiler traces (collective time that ran while the main thread computed)\n")
        print(trace_table(traces))
    loaded = [label for label, row in rows.items() if row.get("under_load")]
    if loaded:
        print(f"\nUNDER LOAD (background CPU > {args.max_background}): {', '.join(loaded)}: their timings are noisy.")
    blind = sorted({ref for row in rows.values() if row.get("ok") for ref in row["figures"]["unwrapped_refs"]})
    if blind:
        print(f"\nWARNING: collectives the counter cannot see: {', '.join(blind)}")
    if not args.no_write:
        write_rows(args.out, final)
        print(f"\n[bench_engines] {len(final)} rows appended to {args.out}")
    mismatched = [label for label, row in rows.items() if row.get("loss_match") is False]
    failed = [label for label, row in rows.items() if row.get("status") == "failed"]
    if mismatched:
        banner = "!" * 78
        print(f"\n{banner}\nLOSS MISMATCH vs DDP (tolerance {tolerance:g}): {', '.join(mismatched)}\n"
              f"A faster engine that trains differently is a bug.\n{banner}")
    if failed:
        print(f"\nFAILED: {', '.join(failed)} (logs kept under {work_dir})")
    if not mismatched and not failed:
        shutil.rmtree(work_dir, ignore_errors=True)
    return (2 if mismatched else (1 if failed else 0)), psi, rows


if __name__ == "__main__":
    sys.exit(main())
