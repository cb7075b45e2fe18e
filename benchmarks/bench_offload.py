"""Offload: hf_zero's offloaded step against its own non-offloaded step and against DeepSpeed's
offload, on the same model and machine, in one command.

Every variant is its own ``torchrun --nproc_per_node 2`` of ``engines.worker`` on the workload of
``bench_engines.py`` (GPT-2 4 layers, hidden 256 on the CPU by default; ``--n-layer``/``--n-embd``
for a bigger one), through the same launcher, timed loop, repeats and background-load check
(everything but the variants and the comparisons is ``bench_engines``' code):

- hf_zero stage 2 and 3: no offload, ``offload_optimizer`` cpu, ``offload_optimizer`` nvme
  (``nvme_path`` a fresh temp dir under ``--nvme-dir``); stage 3 also ``offload_param`` cpu plus
  ``offload_optimizer`` cpu, and ``offload_param`` nvme (``max_in_cpu`` 0: every shard in a
  file) plus ``offload_optimizer`` nvme;
- DeepSpeed, the same variants where DeepSpeed can run them here (see below).

Gradient clipping is the workload's (1.0) unless ``--clip`` says otherwise; hf_zero overlaps its
offloaded step with the backward only without clipping (``--clip 0``; README, "The step overlaps
the backward"). The rows record the git commit and uncommitted ``src/`` paths at the start and
the end of the run: each torchrun imports hf_zero as the working tree is when it starts.

Per variant: step time (max over ranks; median and p20-p80 after warm-up), the optimizer-step
time (``engine.step()``: clip, Adam, gather/copy back), forward+backward time, peak RSS per rank,
model-state bytes of rank 0 on the device / in host memory / in NVMe files (hf_zero's
``memory_report``; on a CPU machine "device" and host are the same RAM, so that split is the
engine's accounting, while NVMe bytes really leave the process), and the loss at every step,
checked against the same engine and stage without offload (fp32 tolerance 1e-4). Ratios:
offloaded / not offloaded (same engine, same stage) and hf_zero / DeepSpeed (same stage, same
offload). Also, in the same run, the Adam step on one flat fp32 shard (``--adam-sizes``):
``hf_zero.kernels.fused_adam_`` on CPU tensors (the offloaded step's kernel) against
``torch.optim.AdamW(fused=True)`` and DeepSpeed's ``DeepSpeedCPUAdam``, through
``bench_kernels``' contenders and the harness' interleaved ``measure``. Rows are appended to
``results/bench_offload.jsonl``.

    python benchmarks/bench_offload.py                                    # everything, CPU
    python benchmarks/bench_offload.py --repeats 3 --wait-quiet 120       # the README figures
    python benchmarks/bench_offload.py --variants hf_zero2,hf_zero2/opt_cpu --steps 8
    python benchmarks/bench_offload.py --n-layer 8 --n-embd 512           # a bigger model
    python benchmarks/bench_offload.py --no-engines --adam-sizes 1M,16M   # the Adam step only

DeepSpeed on this machine (0.19.8, ``DS_ACCELERATOR=cpu``, gloo; a benchmark-only dependency):

- CPU optimizer offload needs its ``DeepSpeedCPUAdam`` op (``csrc/adam/cpu_adam.cpp``), which
  DeepSpeed JIT-builds with the C++ compiler and ninja on first use (about 95 s on 2 cores, then
  cached in ``~/.cache/torch_extensions``). It builds and runs here, so DeepSpeed's offload runs
  with it, as DeepSpeed intends. Where it cannot be built, the row says why and DeepSpeed runs
  with the client ``torch.optim.AdamW`` under ``zero_force_ds_cpu_optimizer: false`` instead
  (``--ds-offload-adam torch`` forces that).
- NVMe offload (ZeRO-Infinity: optimizer swapping in stage 3, parameter swapping) needs the
  ``async_io`` op, which links libaio. This machine has no libaio-dev (headers and
  ``libaio.so``), so ``AsyncIOBuilder().is_compatible()`` is False and the op cannot be built:
  the ds3 nvme rows are "unavailable" with DeepSpeed's own message (``apt-get install
  libaio-dev`` would enable them; the precheck then passes and the rows run).
- In stages 1-2 DeepSpeed has no NVMe optimizer swapping: ``stage_1_and_2.py`` turns any
  ``offload_optimizer.device`` other than none into CPU offload. ds2/opt_nvme would be CPU
  offload under another name, so it is reported as "not comparable" and not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _harness import device_info, environment, markdown_table, measure, parse_count, write_rows

import bench_engines
import bench_kernels
from bench_engines import (LOSS_TOL, Variant, busy_fraction, deepspeed_unavailable, finish_rows, run_all,
                           run_env, wait_quiet, workload_of)
from engines.workload import build_model, count_params

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "bench_offload.jsonl"
MIB = 2**20

# offload kind -> runner options (nvme_path is added per run). "none" is the reference.
OFFLOADS: dict[str, dict[str, str]] = {
    "none": {},
    "opt_cpu": {"offload_optimizer": "cpu"},
    "opt_nvme": {"offload_optimizer": "nvme"},
    # pipeline_read + pipeline_write: tiles read ahead and written behind the step
    "opt_nvme_pipelined": {"offload_optimizer": "nvme", "nvme_pipeline": True},
    "param_cpu+opt_cpu": {"offload_param": "cpu", "offload_optimizer": "cpu"},
    # max_in_cpu 0: every parameter shard in a file (the default 1e9 elements keeps a small model's
    # shards in host memory).
    "param_nvme+opt_nvme": {"offload_param": "nvme", "offload_optimizer": "nvme", "max_in_cpu": 0},
}
# (engine, offload kind) in table order; parameter offload is stage 3 only.
PLAN = [(engine, kind) for engine in ("hf_zero2", "hf_zero3", "ds2", "ds3") for kind in OFFLOADS
        if not (kind.startswith("param") and engine.endswith("2"))]
_DS2_NVME = ("DeepSpeed ZeRO-1/2 has no NVMe optimizer swapping: stage_1_and_2.py sets cpu_offload for any "
             "offload_optimizer.device other than none, so this would be CPU offload under another name")
NOT_COMPARABLE = {("ds2", "opt_nvme"): _DS2_NVME, ("ds2", "opt_nvme_pipelined"): _DS2_NVME}


def label_of(engine: str, kind: str) -> str:
    return engine if kind == "none" else f"{engine}/{kind}"


# ---------------------------------------------------------------------------------- arguments
# bench_engines' options that choose or tune its engines; the variants here are fixed by PLAN.
ENGINE_ONLY_OPTIONS = ("--engines", "--overlap", "--persistence-threshold", "--fsdp-reshard-after-forward",
                       "--ddp-builtin-allreduce")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This benchmark's own options; the run options (sizes, steps, repeats, load checks) are
    ``bench_engines``' parser's, with its defaults and checks."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run options shared with bench_engines.py (see its --help): --steps --warmup --repeats --device "
               "--nproc --threads --n-layer --n-embd --vocab --seq --micro-batch --dtype --seed --loss-tol "
               "--max-background --retries --wait-quiet --timeout --profile --verbose")
    p.add_argument("--variants", default="all",
                   help=f"comma list of labels ({', '.join(label_of(*v) for v in PLAN)}) or all, hf_zero, ds")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(),
                   help="where the nvme_path temp dirs are made (point it at an NVMe drive)")
    p.add_argument("--clip", type=float, default=None,
                   help="gradient clipping for every variant (default: the workload's 1.0; 0 turns it off, "
                        "which lets hf_zero's offloaded step overlap the backward)")
    p.add_argument("--ds-offload-adam", choices=["auto", "ds_cpu_adam", "torch"], default="auto",
                   help="DeepSpeed's offloaded optimizer: its CPU Adam op (auto: when it builds) or torch AdamW")
    p.add_argument("--adam-sizes", default="1M,16M", help="flat shard sizes for the Adam step ('' to skip)")
    p.add_argument("--adam-threads", default=None, help="torch threads for the Adam step (default: 1 and all cores)")
    p.add_argument("--adam-repeats", type=int, default=20, help="timed Adam steps per contender")
    p.add_argument("--no-engines", action="store_true", help="the Adam step only")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file the rows are appended to")
    p.add_argument("--no-write", action="store_true", help="print only")
    args, rest = p.parse_known_args(argv)
    misplaced = [a for a in rest if a.split("=")[0] in ENGINE_ONLY_OPTIONS]
    if misplaced:
        p.error(f"{', '.join(misplaced)}: bench_engines.py's engine options; here use --variants")
    shared = vars(bench_engines.parse_args(rest))
    for key in shared.keys() - {"out", "no_write", "engines"}:
        setattr(args, key, shared[key])
    return args


def select(spec: str) -> list[tuple[str, str]]:
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    labels = {label_of(*v): v for v in PLAN}
    unknown = wanted - set(labels) - {"all", "hf_zero", "ds"}
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; expected labels from {', '.join(labels)} "
                         "or all, hf_zero, ds")
    return [v for label, v in labels.items()
            if "all" in wanted or label in wanted or ("hf_zero" in wanted and label.startswith("hf_zero"))
            or ("ds" in wanted and label.startswith("ds"))]


# ---------------------------------------------------------------------------------- DeepSpeed prechecks
_DS_PROBE = """
import json
out = {}
try:
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load(verbose=False)
    out["cpu_adam"] = None
except Exception as error:
    out["cpu_adam"] = f"{type(error).__name__}: {error}"
from deepspeed.ops.op_builder import AsyncIOBuilder
out["async_io"] = None if AsyncIOBuilder().is_compatible(verbose=True) else "not compatible"
print("DS_PROBE " + json.dumps(out))
"""


def deepspeed_ops(args: argparse.Namespace) -> dict[str, str | None]:
    """Whether DeepSpeed's CPU Adam op loads (JIT-building it if needed) and its async_io op can
    be built: None when fine, else why (DeepSpeed's own warnings, verbatim)."""
    if deepspeed_unavailable():
        return {"cpu_adam": deepspeed_unavailable(), "async_io": deepspeed_unavailable()}
    proc = subprocess.run([sys.executable, "-c", _DS_PROBE], env=run_env(args, "deepspeed"), cwd=BENCH_DIR,
                          capture_output=True, text=True, timeout=args.timeout)
    text = proc.stdout + proc.stderr
    found = [line for line in text.splitlines() if line.startswith("DS_PROBE ")]
    if not found:
        return {"cpu_adam": f"probe failed: {text[-500:]}", "async_io": f"probe failed: {text[-500:]}"}
    result = json.loads(found[0].removeprefix("DS_PROBE "))
    if result["async_io"]:
        warnings = [line.split("[0m", 1)[-1].strip() for line in text.splitlines()
                    if ("async_io" in line or "libaio" in line) and not line.startswith("DS_PROBE")]
        result["async_io"] = ("DeepSpeed's async_io op (ZeRO-3 NVMe swapping) cannot be built: "
                              "AsyncIOBuilder().is_compatible() is False: " + " | ".join(dict.fromkeys(warnings)))
    return result


# ---------------------------------------------------------------------------------- variants
def variants(plan: list[tuple[str, str]], args: argparse.Namespace, ds_ops: dict[str, str | None], nvme_root: Path
             ) -> tuple[list[Variant], dict[str, dict[str, Any]]]:
    """Every planned variant, and rows for those that cannot run here (with the reason)."""
    out: list[Variant] = []
    skipped: dict[str, dict[str, Any]] = {}
    for engine, kind in plan:
        label = label_of(engine, kind)
        options: dict[str, Any] = dict(OFFLOADS[kind])
        if "nvme" in kind:
            options["nvme_path"] = str(nvme_root / label.replace("/", "_"))
            Path(options["nvme_path"]).mkdir(parents=True, exist_ok=True)
        out.append(Variant(label, engine, options))
        if (engine, kind) in NOT_COMPARABLE:
            skipped[label] = {"ok": False, "status": "not_comparable", "reason": NOT_COMPARABLE[(engine, kind)]}
        elif engine.startswith("ds") and "nvme" in kind and ds_ops.get("async_io"):
            skipped[label] = {"ok": False, "status": "unavailable", "reason": ds_ops["async_io"]}
        elif engine.startswith("ds") and "offload_optimizer" in options:
            use_torch = args.ds_offload_adam == "torch" or (args.ds_offload_adam == "auto" and ds_ops.get("cpu_adam"))
            options["offload_adam"] = "torch" if use_torch else "ds_cpu_adam"
    return out, skipped


# ---------------------------------------------------------------------------------- figures
def placement(row: dict[str, Any], family: str) -> dict[str, int | None]:
    """Rank 0's model-state bytes on the device, in host memory and in NVMe files. DeepSpeed's
    tensors are all "cpu" on a CPU machine, so only its total is known."""
    s = row["figures"]
    device = s["model_state_breakdown_per_rank"][0]["total"]
    detail = s["model_state_detail_rank0"]
    if family != "hf_zero":
        return {"device_bytes": device, "host_bytes": None, "nvme_bytes": None}
    host = sum(v for k, v in detail.items() if k.startswith("offload:memory_report.host_"))
    return {"device_bytes": device, "host_bytes": host, "nvme_bytes": detail.get("offload:memory_report.nvme", 0)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _loss_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(abs(x - y) for mine, ref in zip(a["loss_per_rank"], b["loss_per_rank"]) for x, y in zip(mine, ref))


FIGURES = {
    "step_time": lambda s: s["step_time_median_s"],
    "opt_step_time": lambda s: s["opt_step_time_median_s"],
    "fwd_bwd_time": lambda s: s["fwd_bwd_time_median_s"],
    "peak_rss": lambda s: max(s["peak_rss_mib_per_rank"]),
}


def add_comparisons(rows: dict[str, dict[str, Any]], variants_: list[Variant], tolerance: float) -> None:
    """Ratios to the same engine without offload and hf_zero to DeepSpeed, and the loss checks."""
    planned = {label_of(*v): v for v in PLAN}
    key = {v.label: planned[v.label] for v in variants_}
    by_key = {k: label for label, k in key.items() if rows[label].get("ok")}
    for label, row in rows.items():
        if not row.get("ok"):
            continue
        engine, kind = key[label]
        s = row["figures"]
        base = by_key.get((engine, "none"))
        peer = by_key.get((engine.replace("hf_zero", "ds"), kind)) if engine.startswith("hf_zero") else None
        ratios = {}
        for name, get in FIGURES.items():
            ratios[f"{name}_vs_no_offload"] = _ratio(get(s), get(rows[base]["figures"])) if base else None
            ratios[f"{name}_vs_deepspeed"] = _ratio(get(s), get(rows[peer]["figures"])) if peer else None
        family = "hf_zero" if engine.startswith("hf_zero") else "deepspeed"
        row.update(offload=kind, ratios=ratios, no_offload_reference=base, deepspeed_reference=peer,
                   **placement(row, family))
        diff = _loss_diff(s, rows[base]["figures"]) if base else None
        row.update(loss_max_abs_diff_vs_no_offload=diff, loss_tolerance=tolerance,
                   loss_match=None if diff is None else diff <= tolerance,
                   loss_max_abs_diff_vs_deepspeed=_loss_diff(s, rows[peer]["figures"]) if peer else None)


# ---------------------------------------------------------------------------------- Adam step
def adam_contenders(numel: int, device: torch.device, with_deepspeed: bool) -> list[bench_kernels.Contender]:
    """bench_kernels' torch fused AdamW and hf_zero fused_adam_ on one shard, plus
    DeepSpeedCPUAdam (what DeepSpeed's CPU offload steps with) on a shard of the same size."""
    chosen = [c for c in bench_kernels.contenders(numel, device)
              if c.name in ("torch AdamW(fused=True)", "hf_zero fused_adam_")]
    if with_deepspeed:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param = torch.nn.Parameter(torch.randn(numel))
        param.grad = torch.randn(numel) * 1e-2
        h = bench_kernels.HPARAMS
        optimizer = DeepSpeedCPUAdam([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                     weight_decay=h["weight_decay"], adamw_mode=True)
        chosen.append(bench_kernels.Contender("DeepSpeedCPUAdam", "deepspeed-cpu_adam",
                                              bench_kernels.BYTES_PER_PARAM, optimizer.step))
    return chosen


def adam_rows(args: argparse.Namespace, ds_ops: dict[str, str | None]) -> list[dict[str, Any]]:
    """The Adam step on one flat CPU shard per size and thread count (see the module docstring)."""
    sizes = [parse_count(t) for t in args.adam_sizes.split(",") if t.strip()]
    threads = sorted({int(t) for t in (args.adam_threads or f"1,{os.cpu_count() or 1}").split(",")})
    with_ds = ds_ops.get("cpu_adam") is None
    if with_ds:  # the op loads in this process: DeepSpeed must pick its CPU accelerator first
        os.environ.update({k: v for k, v in run_env(args, "deepspeed").items() if k in ("DS_ACCELERATOR", "PATH")})
    rows, device, saved = [], torch.device("cpu"), torch.get_num_threads()
    for count in threads:
        torch.set_num_threads(count)  # DeepSpeed's op shares torch's OpenMP runtime
        for numel in sizes:
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet, args.max_background)
            busy = busy_fraction(1.0)
            entries = adam_contenders(numel, device, with_ds)
            timings = measure({c.name: c.step for c in entries}, device, repeats=args.adam_repeats, warmup=3)
            baseline = timings["torch AdamW(fused=True)"].median_s
            for c in entries:
                t = timings[c.name]
                rows.append({"benchmark": "offload_adam_step", "numel": numel, "threads": count, "impl": c.name,
                             "backend": c.backend, "median_s": t.median_s, "p20_s": t.p20_s, "p80_s": t.p80_s,
                             "min_s": t.min_s, "repeats": t.repeats, "warmup": t.warmup,
                             "gb_per_s": c.bytes_per_param * numel / t.median_s / 1e9,
                             "speedup_vs_torch_fused": baseline / t.median_s, "busy_cpu_frac_before": busy})
    torch.set_num_threads(saved)
    return rows


# ---------------------------------------------------------------------------------- output
def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:.1f}"


def _e(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def results_table(rows: dict[str, dict[str, Any]]) -> str:
    headers = ["variant", "step s median [p20–p80]", "×no-offload", "×DS", "opt step ms", "×no-offload", "×DS",
               "fwd+bwd s", "peak RSS MiB", "×no-offload", "device / host / nvme MiB (rank 0)",
               "max |Δloss| vs no-offload", "vs DS", "bg CPU"]
    body = []
    for label, row in rows.items():
        if not row.get("ok"):
            body.append([label, f"{row['status'].upper()}: {row['reason'][:140]}"] + [""] * (len(headers) - 2))
            continue
        s, r = row["figures"], row["ratios"]
        loss = _e(row["loss_max_abs_diff_vs_no_offload"]) + (" MISMATCH" if row["loss_match"] is False else "")
        bg = [b for b in s["background_cpu_frac_per_repeat"] if b is not None]
        body.append([
            label, f"{s['step_time_median_s']:.3f} [{s['step_time_p20_s']:.3f}–{s['step_time_p80_s']:.3f}]",
            _x(r["step_time_vs_no_offload"]), _x(r["step_time_vs_deepspeed"]),
            f"{s['opt_step_time_median_s'] * 1e3:.1f}", _x(r["opt_step_time_vs_no_offload"]),
            _x(r["opt_step_time_vs_deepspeed"]), f"{s['fwd_bwd_time_median_s']:.3f}",
            f"{FIGURES['peak_rss'](s):.0f}", _x(r["peak_rss_vs_no_offload"]),
            f"{_mib(row['device_bytes'])} / {_mib(row['host_bytes'])} / {_mib(row['nvme_bytes'])}",
            loss, _e(row["loss_max_abs_diff_vs_deepspeed"]),
            f"{max(bg):.2f}" if bg else "—",
        ])
    return markdown_table(headers, body)


def ratio_table(rows: dict[str, dict[str, Any]]) -> str:
    """One line per hf_zero variant: its cost of offloading, DeepSpeed's, and the two engines' ratio."""
    body = []
    for label, row in rows.items():
        if row.get("ok") and label.startswith("hf_zero"):
            r, peer = row["ratios"], rows.get(row["deepspeed_reference"] or "", {})
            ds = peer.get("ratios", {}) if peer.get("ok") else {}
            body.append([row["stage"], row["offload"], _x(r["step_time_vs_no_offload"]),
                         _x(ds.get("step_time_vs_no_offload")), _x(r["step_time_vs_deepspeed"]),
                         _x(r["opt_step_time_vs_deepspeed"]), _x(r["peak_rss_vs_deepspeed"])])
    return markdown_table(["stage", "offload", "hf_zero step ×no-offload", "DeepSpeed step ×no-offload",
                           "step hf_zero / DS", "opt step hf_zero / DS", "peak RSS hf_zero / DS"], body)


def adam_table(rows: list[dict[str, Any]]) -> str:
    body = [[f"{r['numel'] / 2**20:g}M", r["threads"], r["impl"], f"{r['median_s'] * 1e3:.2f}",
             f"{r['p20_s'] * 1e3:.2f}–{r['p80_s'] * 1e3:.2f}", f"{r['gb_per_s']:.1f}",
             f"{r['speedup_vs_torch_fused']:.2f}x", _x(r["busy_cpu_frac_before"])]
            for r in rows]
    return markdown_table(["params", "threads", "implementation", "median ms", "p20–p80 ms", "GB/s",
                           "speed vs AdamW(fused)", "busy CPU before"], body)


def source_state() -> dict[str, Any]:
    """The commit, and the uncommitted paths under src/: the figures are of the working tree."""
    def git(*command: str) -> str:
        proc = subprocess.run(["git", *command], cwd=BENCH_DIR.parent, capture_output=True, text=True)
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else ""  # porcelain lines start with a space

    return {"commit": git("rev-parse", "HEAD") or None,
            "uncommitted_src": [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()]}


def filesystem_of(path: str) -> str:
    """The mount (device and type) holding ``path``, from /proc/mounts."""
    best = ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, fstype = line.split()[:3]
            if os.path.realpath(path).startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[2]):
                best = (dev, fstype, mount)
    except OSError:
        pass
    return f"{best[0]} ({best[1]}) at {best[2] or '?'}"


# ---------------------------------------------------------------------------------- main
def run_engines(args: argparse.Namespace, ds_ops: dict[str, str | None], env_rows: dict[str, Any]
                ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], Path]:
    workload = workload_of(args)
    if args.clip is not None:
        workload = dataclasses.replace(workload, clip=args.clip)
    psi = count_params(build_model(workload))
    work_dir = Path(tempfile.mkdtemp(prefix="bench_offload_"))
    nvme_root = Path(tempfile.mkdtemp(prefix="bench_offload_nvme_", dir=args.nvme_dir))
    variants_, skipped = variants(select(args.variants), args, ds_ops, nvme_root)
    print(f"[bench_offload] {len(variants_) - len(skipped)} runs x {args.repeats}: GPT-2 {workload.n_layer} layers, "
          f"hidden {workload.n_embd}, Ψ = {psi:,}, {workload.steps} steps ({workload.warmup} warm-up), "
          f"{args.nproc} ranks x {args.threads} thread(s); nvme_path under {filesystem_of(str(nvme_root))}", flush=True)
    ran = run_all(args, [v for v in variants_ if v.label not in skipped], workload, work_dir)
    rows = {v.label: ran.get(v.label) or skipped[v.label] for v in variants_}
    tolerance = args.loss_tol if args.loss_tol is not None else LOSS_TOL[workload.dtype]
    add_comparisons(rows, variants_, tolerance)
    final = finish_rows(rows, variants_, args, workload, psi)
    for row in final:
        row.update(benchmark="offload", nvme_filesystem=filesystem_of(str(nvme_root)), **env_rows)
    shutil.rmtree(nvme_root, ignore_errors=True)
    return final, rows, work_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ds_ops = deepspeed_ops(args)
    print(f"[bench_offload] DeepSpeed CPU Adam op: {ds_ops['cpu_adam'] or 'builds and loads'}; "
          f"async_io (NVMe): {ds_ops['async_io'] or 'available'}", flush=True)
    context: dict[str, Any] = {"deepspeed_ops": ds_ops, "ds_offload_adam": args.ds_offload_adam,
                               "source": source_state()}
    final, rows, work_dir = ([], {}, None) if args.no_engines else run_engines(args, ds_ops, context)
    adam = adam_rows(args, ds_ops) if args.adam_sizes.strip() else []  # last: it imports DeepSpeed here
    # Each torchrun imports hf_zero from the working tree as it is then: a commit landing mid-run
    # means the variants ran different code, which the rows must say.
    context["source_at_end"] = source_state()
    context["source_changed_during_run"] = context["source_at_end"] != context["source"]
    for row in final:
        row.update({key: context[key] for key in ("source_at_end", "source_changed_during_run")})
    env = environment(("transformers", "deepspeed"))
    run_id = final[0]["run_id"] if final else env["timestamp"]
    adam = [{**r, "run_id": run_id, "device": device_info(torch.device("cpu")), "env": env, **context} for r in adam]
    if rows:
        print("\n## Offload (×no-offload: same engine and stage without offload; "
              "×DS: DeepSpeed, same stage and offload)\n")
        print(results_table(rows))
        print("\n## Ratios (same stage; DS = DeepSpeed with the same offload)\n")
        print(ratio_table(rows))
    if adam:
        print("\n## Adam step on one flat fp32 CPU shard (the offloaded optimizer's kernel)\n")
        print(adam_table(adam))
    if not args.no_write:
        write_rows(args.out, final + adam)
        print(f"\n[bench_offload] {len(final) + len(adam)} rows appended to {args.out}")
    if context["source_changed_during_run"]:
        print(f"\nSOURCE CHANGED DURING THE RUN: {context['source']} -> {context['source_at_end']}; "
              "the variants may have run different code.")
    loaded = [label for label, row in rows.items() if row.get("under_load")]
    if loaded:
        print(f"\nUNDER LOAD (background CPU > {args.max_background}): {', '.join(loaded)}: their timings are noisy.")
    mismatched = [label for label, row in rows.items() if row.get("loss_match") is False]
    failed = [label for label, row in rows.items() if "log_tail" in row]  # a run that started and failed
    if mismatched:
        print(f"\nLOSS MISMATCH vs the same run without offload: {', '.join(mismatched)}")
    if failed:
        print(f"\nFAILED: {', '.join(failed)} (logs kept under {work_dir})")
    elif work_dir is not None and not mismatched:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 2 if mismatched else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
