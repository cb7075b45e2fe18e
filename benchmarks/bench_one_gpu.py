"""What hf_zero's execution layer costs on one GPU: a Llama-shaped model's ZeRO step against the
same model's compute-only step, measured in the same run.

- ``--world 8 --rank 5``: the step of rank 5 of a world of 8, played by this one process through
  torch's fake process group (every gather, reduce-scatter, copy, kernel and memory path of a
  world-8 rank runs; the collectives complete at once without a peer, so no network time is in
  the figure and the values are not a real world's). Stage 3, bf16 by default.
- ``--world 1 --offload-optimizer cpu --largest``: the largest of ``--model`` (a comma list, tried
  in order, each in a fresh process) that trains on this GPU with the optimizer on the host: its
  tokens/s and its ratio to the compute-only step. A 7B model in bf16 needs about 14 GB of
  parameters on the GPU and about 112 GB of host memory (fp32 master, moments and gradients).

The compute-only step is the same model (same shapes, dtype, batch) as plain torch: forward and
backward, no engine, no collectives and no optimizer. ``engine / compute-only`` is what the engine
and its optimizer step add. Each contender runs its warm-up and timed steps in turn (the engine
first, then the compute-only model, so neither's memory limits the other), timed by the shared
harness (CUDA events on a GPU); rows go to ``results/bench_one_gpu.jsonl``. ``--fsdp2`` adds
FSDP2 in the same harness (``fully_shard`` per decoder layer, same dtype and batch), and
``--sync-debug warn`` runs the engine's timed steps under ``torch.cuda.set_sync_debug_mode`` and
lists the synchronising calls made from hf_zero's files. No step reads its loss on the host
while it is timed.

    python benchmarks/bench_one_gpu.py --model llama-1b --world 8 --rank 5                 # (b)
    python benchmarks/bench_one_gpu.py --model llama-1b --world 8 --rank 5 --fsdp2 --sync-debug warn
    python benchmarks/bench_one_gpu.py --model llama-1b --world 8 --rank 5 --micro-batch 4 --fsdp2
    python benchmarks/bench_one_gpu.py --model llama-7b,llama-3b,llama-1b --world 1 \\
        --offload-optimizer cpu --largest                                                  # (c)
    CUDA_VISIBLE_DEVICES= python benchmarks/bench_one_gpu.py --model tiny --device cpu --seq 32 \\
        --persistence-threshold 0 --steps 3 --warmup 1                                     # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from _harness import device_info, environment, markdown_table, measure, write_rows

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "bench_one_gpu.jsonl"
ROW_MARK = "BENCH_ONE_GPU_ROW "


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """A Llama architecture, by its published shape."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 32000


SHAPES = {
    "tiny": LlamaShape(hidden=64, layers=2, intermediate=172, heads=4, kv_heads=2, vocab=256),
    "llama-1b": LlamaShape(hidden=2048, layers=22, intermediate=5632, heads=32, kv_heads=4),  # TinyLlama-1.1B
    "llama-3b": LlamaShape(hidden=3200, layers=26, intermediate=8640, heads=32, kv_heads=32),  # OpenLLaMA-3B
    "llama-7b": LlamaShape(hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32),  # Llama-2-7B
    "llama-13b": LlamaShape(hidden=5120, layers=40, intermediate=13824, heads=40, kv_heads=40),  # Llama-2-13B
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_model(shape: LlamaShape, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """Initialised directly on ``device`` in the compute dtype: a 7B model never exists in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": args.stage}
    if args.persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = args.persistence_threshold
    if args.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": args.offload_optimizer}
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": args.clip, "bf16": {"enabled": args.dtype == "bf16"}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1}}}


def _step_fn(forward_backward: Callable[[torch.Tensor], torch.Tensor], batch: torch.Tensor,
             losses: list[torch.Tensor]) -> Callable[[], None]:
    """A step whose loss is kept on the device: read inside the step, it would make the host wait
    for the GPU there, and the timing would include a drained queue the engine did not ask for."""
    def step() -> None:
        losses.append(forward_backward(batch))

    return step


def _finite(losses: list[torch.Tensor]) -> bool:
    return all(math.isfinite(float(loss)) for loss in losses)  # after the timing: each read waits


@contextlib.contextmanager
def _sync_debug(mode: str, device: torch.device, found: list[str]) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` over the block; with "warn", the synchronising
    calls made from hf_zero's files are collected (the model's own are left out: transformers'
    causal mask reads whether position_ids pack several sequences)."""
    if mode == "off" or device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(f"{w.filename}:{w.lineno}" for w in caught
                 if "synchroniz" in str(w.message) and f"{os.sep}hf_zero{os.sep}" in w.filename)


def fsdp2_step(shape: LlamaShape, args: argparse.Namespace, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """FSDP2 in the same harness: ``fully_shard`` per decoder layer and on the root over this
    process's (fake) world, fp32 shards with bf16 parameters and fp32 reductions under
    ``--dtype bf16`` (what hf_zero's fp32 masters are to its bf16 compute), AdamW (fused on a
    GPU), ``clip_grad_norm_`` with ``--clip``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(shape, argparse.Namespace(**{**vars(args), "dtype": "fp32"}), device)
    kwargs: dict[str, Any] = {"mesh": init_device_mesh(device.type, (dist.get_world_size() if dist.is_initialized() else 1,))}
    if args.dtype == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                  fused=device.type == "cuda")

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _peak_memory(device: torch.device, fn: Callable[[], None]) -> int | None:
    """One more call of ``fn``; the peak of allocated device memory during it (None on the CPU)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def run_one(shape_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The engine's step, then the compute-only step, of one model in this process."""
    import hf_zero

    if args.world > 1:  # this process is rank args.rank of a fake world
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    device = torch.device(args.device)
    shape = SHAPES[shape_name]
    batch = torch.randint(0, shape.vocab, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    model = build_model(shape, args, device)
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    engine, *_ = hf_zero.initialize(model=model, config=engine_config(args))
    init_s = time.perf_counter() - start
    del model

    def engine_step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    engine_losses: list[torch.Tensor] = []
    engine_syncs: list[str] = []
    with _sync_debug(args.sync_debug, device, engine_syncs):
        timed = measure({"engine": _step_fn(engine_step, batch, engine_losses)}, device,
                        repeats=args.steps, warmup=args.warmup)["engine"]
    engine.reset_comm_stats()
    row: dict[str, Any] = {"engine_peak_bytes": _peak_memory(device, _step_fn(engine_step, batch, engine_losses))}
    row.update(memory_report=engine.memory_report(), comm_per_step=engine.comm_stats())
    engine = None  # its memory goes before the compute-only model is built
    if device.type == "cuda":
        torch.cuda.empty_cache()

    reference = build_model(shape, args, device)

    def compute_step(ids: torch.Tensor) -> torch.Tensor:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        reference.zero_grad(set_to_none=True)
        return loss.detach()

    compute_losses: list[torch.Tensor] = []
    try:
        compute = measure({"compute": _step_fn(compute_step, batch, compute_losses)}, device,
                          repeats=args.steps, warmup=args.warmup)["compute"]
        row["compute_peak_bytes"] = _peak_memory(device, _step_fn(compute_step, batch, compute_losses))
    except torch.OutOfMemoryError as exc:
        compute, row["compute_error"] = None, f"out of memory: {str(exc).splitlines()[0]}"
    reference = None  # its memory goes before FSDP2's model is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.fsdp2:
        row.update(_fsdp2_row(shape, args, device, batch, timed))
    tokens = args.micro_batch * args.seq
    row.update({
        "bench": "one_gpu_step", "model": shape_name, "shape": dataclasses.asdict(shape), "params": params,
        "world": args.world, "rank": args.rank, "stage": args.stage, "offload_optimizer": args.offload_optimizer,
        "tokens_per_step": tokens, "init_s": init_s, "engine": dataclasses.asdict(timed),
        "engine_tokens_per_s": tokens / timed.median_s,
        "engine_losses_finite": _finite(engine_losses), "sync_debug": args.sync_debug,
        "engine_syncs_from_hf_zero": engine_syncs if args.sync_debug == "warn" else None,
        "compute": dataclasses.asdict(compute) if compute is not None else None,
        "compute_tokens_per_s": tokens / compute.median_s if compute is not None else None,
        "engine_over_compute": timed.median_s / compute.median_s if compute is not None else None,
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    })
    return row


def _fsdp2_row(shape: LlamaShape, args: argparse.Namespace, device: torch.device, batch: torch.Tensor,
               engine: Any) -> dict[str, Any]:
    """FSDP2's step in the same harness, and hf_zero's against it."""
    losses: list[torch.Tensor] = []
    try:
        step = fsdp2_step(shape, args, device)
        timed = measure({"fsdp2": _step_fn(step, batch, losses)}, device, repeats=args.steps,
                        warmup=args.warmup)["fsdp2"]
        peak = _peak_memory(device, _step_fn(step, batch, losses))
    except torch.OutOfMemoryError as exc:
        return {"fsdp2": None, "fsdp2_error": f"out of memory: {str(exc).splitlines()[0]}"}
    return {"fsdp2": dataclasses.asdict(timed), "fsdp2_peak_bytes": peak, "fsdp2_losses_finite": _finite(losses),
            "engine_over_fsdp2": engine.median_s / timed.median_s}


def run_largest(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    """Each model of ``--model`` in a fresh process, in order, until one trains."""
    rows = []
    base = [a for a in argv if a != "--largest"]
    for name in args.model.split(","):
        command = [sys.executable, __file__, *base, "--model", name, "--print-row"]
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            error = f"did not finish in {args.timeout:g} s"
        else:
            found = [line for line in run.stdout.splitlines() if line.startswith(ROW_MARK)]
            if run.returncode == 0 and found:
                rows.append(json.loads(found[-1][len(ROW_MARK):]) | {"largest_of": args.model})
                break
            error = f"rc {run.returncode}: {(run.stderr or run.stdout).strip().splitlines()[-1:]}"
        rows.append({"bench": "one_gpu_step", "model": name, "largest_of": args.model, "error": error})
        print(f"{name}: did not train ({rows[-1]['error']})", file=sys.stderr)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["model", "params", "world/rank", "offload", "engine ms (p20-p80)", "compute-only ms",
               "engine / compute", "FSDP2 ms", "engine / FSDP2", "tokens/s", "GPU peak GiB (engine/compute)"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["model"], "", "", "", r["error"], "", "", "", "", "", ""])
            continue
        e, c, f = r["engine"], r["compute"], r.get("fsdp2")
        gib = lambda b: f"{b / 2**30:.1f}" if b else "-"  # noqa: E731
        body.append([r["model"], f"{r['params'] / 1e6:,.0f}M", f"{r['world']}/{r['rank']}", r["offload_optimizer"],
                     f"{e['median_s'] * 1e3:.1f} ({e['p20_s'] * 1e3:.1f}-{e['p80_s'] * 1e3:.1f})",
                     f"{c['median_s'] * 1e3:.1f}" if c else r.get("compute_error", "-"),
                     f"{r['engine_over_compute']:.2f}x" if c else "-",
                     f"{f['median_s'] * 1e3:.1f}" if f else r.get("fsdp2_error", "-"),
                     f"{r['engine_over_fsdp2']:.2f}x" if f else "-", f"{r['engine_tokens_per_s']:,.0f}",
                     f"{gib(r['engine_peak_bytes'])}/{gib(r.get('compute_peak_bytes'))}"])
    return markdown_table(headers, body)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b", help=f"one of {', '.join(SHAPES)} (a comma list with --largest)")
    p.add_argument("--world", type=int, default=8, help="world size; above 1 this process plays --rank of a fake group")
    p.add_argument("--rank", type=int, default=None, help="default: 5 in a world above 1, else 0")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--offload-optimizer", choices=["none", "cpu"], default="none")
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage3_param_persistence_threshold (default: DeepSpeed's 1e5 elements; 0 shards every "
                        "parameter, which the tiny smoke model needs)")
    p.add_argument("--largest", action="store_true", help="try --model's list in order, report the first that trains")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing in both contenders")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: the overlapped offload step)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp2", action="store_true", help="also FSDP2 in the same harness (fully_shard per decoder layer)")
    p.add_argument("--sync-debug", choices=["off", "warn", "error"], default="off",
                   help="the engine's timed steps under torch.cuda.set_sync_debug_mode (warn: the row lists "
                        "the synchronising calls from hf_zero's files)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per model with --largest")
    p.add_argument("--jsonl", type=Path, default=DEFAULT_OUT, help="rows are appended here")
    p.add_argument("--print-row", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [m for m in args.model.split(",") if m not in SHAPES]
    if unknown or ("," in args.model and not args.largest):
        p.error(f"--model: {unknown or args.model} (known: {', '.join(SHAPES)}; a list needs --largest)")
    if args.rank is None:
        args.rank = 5 if args.world > 5 else 0
    if not 0 <= args.rank < args.world:
        p.error(f"--rank {args.rank} is outside --world {args.world}")
    if args.device == "cpu" and torch.cuda.is_available():
        p.error("hf_zero computes on the GPU whenever it sees one: for a CPU run set CUDA_VISIBLE_DEVICES=")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.largest:
        rows = run_largest(args, argv)
    else:
        rows = [run_one(args.model, args)]
        if args.print_row:  # a --largest parent collects and writes it
            print(ROW_MARK + json.dumps(rows[0]), flush=True)
            return 0
    context = {"device": device_info(torch.device(args.device)), **environment(["transformers"]),
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    write_rows(args.jsonl, [row | context for row in rows])
    print(f"{context['device']['name']} ({args.device}), torch {context['torch']}, median of {args.steps} "
          f"after {args.warmup} warm-up\n")
    print(table(rows))
    print(f"\n{len(rows)} rows appended to {args.jsonl}")
    return 0 if rows and "error" not in rows[-1] else 1


if __name__ == "__main__":
    sys.exit(main())
