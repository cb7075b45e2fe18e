"""The host's share of a training step: host syncs, ATen ops, Python calls and CPU time per
decoder layer, for plain eager torch, hf_zero and FSDP2 on a depth-faithful, width-tiny Llama.

Why: on a GPU, the engine's step on a small or mid-sized model is paced by the host (the Python
and dispatcher work that queues each kernel) and by host syncs (each one drains the queue; see
[Note: host synchronisations] in ``hf_zero/execution/host_sync.py``). The stand-in is
LlamaForCausalLM with Llama 1.1B's unit structure (22 decoder layers, grouped-query attention,
untied head) and tiny widths (hidden 64, intermediate 172, 4 heads, 2 KV heads, vocab 1024),
sequence 32, micro batch 1: the math is a few microseconds per op, so what the figures show is
what each contender costs per layer on the host, work that does not grow with the widths and
that a 1.1B model on a GPU pays about the same.

Each contender runs in its own subprocess (the fake group and the sync counter's patches never
meet another contender), as rank ``--rank`` (5) of a fake world of ``--world`` (8), one thread:

- ``eager``: the model in the compute dtype, ``torch.optim.AdamW``, ``clip_grad_norm_(1.0)``,
  ``zero_grad(set_to_none=True)``; no collectives.
- ``hf_zero``: ``hf_zero.initialize`` at ``--stage`` (3, every parameter sharded: persistence
  threshold 0), its AdamW and clipping, ``engine.backward``/``engine.step``.
- ``fsdp2``: ``fully_shard`` on each decoder layer, then the root; in bf16, the model in fp32 with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; AdamW over the DTensor shards.

AdamW (lr 1e-4, weight decay 0.1) and ``clip_grad_norm_`` are asked for ``foreach=True`` in eager
and FSDP2: that is torch's default on a GPU, while on the CPU its default is a loop of one op
per parameter, which would put 201 tensors' worth of ops into a step a GPU runs as a few.

Per phase (forward = the model call with its loss; backward = ``loss.backward``/
``engine.backward``; step = clipping, optimizer step and ``zero_grad``), after ``--warmup``
untimed steps:

- CPU ms: ``time.process_time`` per phase, median over the timed steps of ``--rounds`` (2)
  subprocesses per contender, ``--steps`` each, the contenders taking turns (the order reversed
  each round) so that a change in the machine's load lands on all alike; the whole step's median
  (p20-p80) and its ratio to eager's, measured in the same run (``x eager``).
- Host syncs: one more step under ``HostSyncCounter``; ``engine`` counts those made from
  hf_zero's own frames (so it is ``-`` for eager and FSDP2, whose torch frames are skipped and
  which are charged to this file's call of the phase); the rows hold ``by_place`` for both.
  AdamW's step counters, host tensors on a GPU run, are registered as host memory first
  (``hf_zero.transfer.mark_host``), so that their two reads per parameter are not counted here
  either; its ``torch.tensor(1.0, device="cpu")``, a host tensor on a GPU, still is (1 a step).
- ATen ops: one more step under a ``TorchDispatchMode`` (it is active in autograd's backward as
  well). Counted: every op on plain tensors that is not a view or metadata op (views, aliases,
  ``empty*`` allocations, ``sym_*``, profiler marks); ``_local_scalar_dense`` (a value read:
  ``host_read`` when it is of a host tensor or inside hf_zero's ``host_code()``, the CPU backend
  of its kernels, as HostSyncCounter tells them) and c10d ops (collectives) are counted apart.
  Ops on DTensors are left to DTensor, so what is
  counted is the local ops (and collectives) it runs. A custom op (FSDP2's copy-in/out) counts once.
- Python calls: one more step under ``sys.setprofile``: ``call`` events (Python frames, generator
  resumptions included) and ``c_call`` events (builtins) apart.

Every per-layer figure is the phase's total divided by the 22 decoder layers, for every
contender alike (the embedding, final norm and head are in the total).

    python benchmarks/bench_host_overhead.py                       # bf16, stage 3, 2 rounds x 10 steps
    python benchmarks/bench_host_overhead.py --steps 3 --warmup 1  # quick (about a minute on 2 cores)
    python benchmarks/bench_host_overhead.py --dtype fp32 --stage 2 --contenders eager,hf_zero

Caveats: the fake group completes every collective at once, with no peer and no network, so a
collective's cost is its host call only. CPU timings include the tiny matmuls' compute (one
thread, so no intra-op parallelism hides it) and bf16 math on a CPU without native bf16 is slow:
compare contenders in one run, not with a GPU's wall time. On the CPU, where host and compute
memory are one, every other value read counts as a sync. ``--device cuda`` also runs the counted
sync step under ``torch.cuda.set_sync_debug_mode("warn")``; that path is untested here, and there
Python calls are counted on the calling thread only before Python 3.12 (autograd's device threads
run backward hooks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _harness import device_info, environment, markdown_table, spread, write_rows
from torch.utils._python_dispatch import TorchDispatchMode

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results" / "bench_host_overhead.jsonl"
ROW_MARK = "BENCH_HOST_OVERHEAD_ROW "
CONTENDERS = ("eager", "hf_zero", "fsdp2")
PHASES = ("forward", "backward", "step")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 22, 64, 172, 4, 2, 1024
SEQ, MICRO_BATCH, CLIP, LR, WEIGHT_DECAY = 32, 1, 1.0, 1e-4, 0.1

PhaseHook = Callable[[str], contextlib.AbstractContextManager]


@dataclasses.dataclass
class Contender:
    """One way to train the stand-in: its three phases and what a row should say about it."""

    forward: Callable[[torch.Tensor], torch.Tensor]  # input ids -> loss
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    params: int
    info: dict[str, Any]
    # Tensors a GPU run keeps on the host (AdamW's step counters): reading them is no sync there.
    host_tensors: Callable[[], list[torch.Tensor]] = lambda: []


# ---------------------------------------------------------------------------- contenders
def build_model(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)  # every contender starts from the same weights
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.train()


def _torch_loop(model: torch.nn.Module, info: dict[str, Any]) -> Contender:
    """The plain torch training loop, shared by eager and FSDP2 (whose parameters are DTensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Contender(forward=lambda ids: model(input_ids=ids, labels=ids).loss,
                     backward=lambda loss: loss.backward(), step=step,
                     params=sum(p.numel() for p in model.parameters()),
                     info=info | {"optimizer": "torch.optim.AdamW(foreach=True)"},
                     host_tensors=lambda: [state["step"] for state in optimizer.state.values() if "step" in state])


def make_eager(args: argparse.Namespace, device: torch.device) -> Contender:
    return _torch_loop(build_model(DTYPES[args.dtype], device), {"weights": args.dtype})


def hf_zero_config(args: argparse.Namespace) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": args.stage}
    if args.stage == 3:  # shard every parameter, as FSDP2 does; the default would keep these tiny ones whole
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "bf16": {"enabled": args.dtype == "bf16"}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}}


def make_hf_zero(args: argparse.Namespace, device: torch.device) -> Contender:
    import hf_zero

    model = build_model(DTYPES[args.dtype], device)
    params = sum(p.numel() for p in model.parameters())
    config = hf_zero_config(args)
    engine, *_ = hf_zero.initialize(model=model, config=config)
    return Contender(forward=lambda ids: engine(input_ids=ids, labels=ids).loss, backward=engine.backward,
                     step=engine.step, params=params, info={"stage": args.stage, "engine_config": config})


def make_fsdp2(args: argparse.Namespace, device: torch.device) -> Contender:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_model(torch.float32, device)  # fp32 shards; bf16 is FSDP2's cast at the all-gather
    kwargs: dict[str, Any] = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if args.dtype == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return _torch_loop(model, {"weights": "fp32", "param_dtype": args.dtype,
                               "parameter_groups": f"{LAYERS} layers + root"})


MAKERS: dict[str, Callable[[argparse.Namespace, torch.device], Contender]] = {
    "eager": make_eager, "hf_zero": make_hf_zero, "fsdp2": make_fsdp2}


# ---------------------------------------------------------------------------- one step, observed
@contextlib.contextmanager
def _unobserved(phase: str) -> Iterator[None]:
    yield


def run_step(contender: Contender, ids: torch.Tensor, hook: PhaseHook = _unobserved) -> torch.Tensor:
    with hook("forward"):
        loss = contender.forward(ids)
    with hook("backward"):
        contender.backward(loss)
    with hook("step"):
        contender.step()
    return loss.detach()


class PhaseClock:
    """CPU and wall seconds of each phase, one sample per step."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.wall_s: dict[str, list[float]] = {phase: [] for phase in PHASES}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        cpu, wall = time.process_time(), time.perf_counter()
        yield
        self.cpu_s[phase].append(time.process_time() - cpu)
        self.wall_s[phase].append(time.perf_counter() - wall)

    def step_cpu_s(self) -> list[float]:
        return [sum(parts) for parts in zip(*self.cpu_s.values())]


def count_syncs(contender: Contender, ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """One step under HostSyncCounter; the syncs of each phase, all and hf_zero's own."""
    from hf_zero.execution.host_sync import HostSyncCounter
    from hf_zero.transfer import mark_host

    if device.type == "cpu":  # host tensors on a GPU run are not counted here either (nor in count_ops, after)
        for tensor in contender.host_tensors():
            mark_host(tensor)
    per_phase: dict[str, dict[str, int]] = {}
    cuda_warnings: list[str] = []
    debug = _cuda_sync_warnings(cuda_warnings) if device.type == "cuda" else contextlib.nullcontext()
    with debug, HostSyncCounter(device) as counter:

        @contextlib.contextmanager
        def hook(phase: str) -> Iterator[None]:
            before = len(counter.syncs)
            yield
            made = counter.syncs[before:]
            per_phase[phase] = {"all": len(made), "engine": sum(s.engine for s in made)}

        run_step(contender, ids, hook)
    return {"per_phase": per_phase, "all": len(counter.syncs), "engine": len(counter.engine_syncs),
            "by_place_engine": counter.by_place(), "by_place_all": counter.by_place(engine_only=False),
            "cuda_sync_warnings": len(cuda_warnings) if device.type == "cuda" else None}


@contextlib.contextmanager
def _cuda_sync_warnings(found: list[str]) -> Iterator[None]:
    """CUDA's own sync warnings over the counted step, to set beside the counter's figure (those
    raised on autograd's device threads go to stderr instead)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))


# Ops that launch no kernel although they are not views by their schema: allocations without a
# fill, metadata reads and edits, no-op resolutions.
_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "_reshape_alias",
    "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "is_pinned",
    "_has_compatible_shallow_copy_type", "set_", "resize_", "record_stream", "resolve_conj", "resolve_neg"})
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_COLLECTIVE_BOOKKEEPING = frozenset({"wait_tensor", "_wrap_tensor_autograd"})  # no transfer of their own
_PLAIN_DISPATCH = torch._C._disabled_torch_dispatch_impl


def _host_read(tensor: torch.Tensor, device: torch.device) -> bool:
    """A value read that waits for nothing, as HostSyncCounter tells it: of a host tensor, or
    inside hf_zero's ``host_code()`` (its kernels' CPU backend, host code over host memory)."""
    from hf_zero.execution import host_sync
    from hf_zero.transfer import is_host_store

    if getattr(getattr(host_sync, "_HOST_CODE", None), "depth", 0):
        return True
    return tensor.device.type == "cpu" and (device.type != "cpu" or is_host_store(tensor))


def op_kind(func: torch._ops.OpOverload) -> str:
    """``kernel``, ``view`` (no kernel), ``sync`` (a value read) or ``collective``."""
    namespace, name = func.namespace, func._opname
    if namespace in _COLLECTIVE_NAMESPACES:
        return "view" if name in _COLLECTIVE_BOOKKEEPING else "collective"
    if namespace == "profiler" or func.is_view or name in _NO_KERNEL:
        return "view"
    return "sync" if name == "_local_scalar_dense" else "kernel"


class OpCounter(TorchDispatchMode):
    """Counts the ops of plain tensors by phase and kind (see ``op_kind``; a value read of a host
    tensor is ``host_read``)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.phase: str | None = None
        self.kinds: dict[str, Counter[str]] = {phase: Counter() for phase in PHASES}
        self.ops: dict[str, Counter[str]] = {phase: Counter() for phase in PHASES}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(t.__torch_dispatch__ is not _PLAIN_DISPATCH for t in types):
            # A subclass (DTensor) handles it first; the local ops it runs come back through here.
            return NotImplemented
        if self.phase is not None:
            kind = op_kind(func)
            if kind == "sync" and _host_read(args[0], self.device):
                kind = "host_read"
            self.kinds[self.phase][kind] += 1
            if kind != "view":
                self.ops[self.phase][f"{func.namespace}.{func._opname}"] += 1
        return func(*args, **(kwargs or {}))


def count_ops(contender: Contender, ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    counter = OpCounter(device)

    @contextlib.contextmanager
    def hook(phase: str) -> Iterator[None]:
        counter.phase = phase
        try:
            yield
        finally:
            counter.phase = None

    with counter:
        run_step(contender, ids, hook)
    kinds = ("kernel", "view", "sync", "host_read", "collective")
    return {phase: {**{kind: counter.kinds[phase][kind] for kind in kinds},
                    "top": dict(counter.ops[phase].most_common(12))} for phase in PHASES}


def count_calls(contender: Contender, ids: torch.Tensor) -> dict[str, Any]:
    """Python ``call`` and builtin ``c_call`` events of each phase, over one step."""
    counts: dict[str, Counter[str]] = {phase: Counter() for phase in PHASES}
    current: list[str | None] = [None]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if current[0] is not None and event in ("call", "c_call"):
            counts[current[0]][event] += 1

    @contextlib.contextmanager
    def hook(phase: str) -> Iterator[None]:
        current[0] = phase
        try:
            yield
        finally:
            current[0] = None

    # Autograd's device threads (a GPU run) are reached by the all-threads form only (Python 3.12+).
    set_profile = getattr(threading, "setprofile_all_threads", sys.setprofile)
    set_profile(profile)
    try:
        run_step(contender, ids, hook)
    finally:
        set_profile(None)
    threads = "all" if set_profile is not sys.setprofile else "calling"
    return {"threads": threads, **{phase: dict(counts[phase]) for phase in PHASES}}


# ---------------------------------------------------------------------------- one contender (a subprocess)
def _settle(device: torch.device) -> None:
    if device.type == "cuda":  # outside the phases: steps do not overlap, the phases stay host time
        torch.cuda.synchronize(device)


def _timed(contender: Contender, ids: torch.Tensor, args: argparse.Namespace, device: torch.device
           ) -> tuple[PhaseClock, list[torch.Tensor]]:
    losses = []
    for _ in range(args.warmup):
        losses.append(run_step(contender, ids))
        _settle(device)
    clock = PhaseClock()
    for _ in range(args.steps):
        losses.append(run_step(contender, ids, clock))
        _settle(device)
    return clock, losses


def _per_layer(value: float) -> float:
    return value / LAYERS


def _timing_fields(clock: PhaseClock, warmup: int) -> dict[str, Any]:
    cpu_ms = {phase: statistics.median(clock.cpu_s[phase]) * 1e3 for phase in PHASES}
    return {"step_cpu_s": dataclasses.asdict(spread(clock.step_cpu_s(), warmup)), "cpu_ms": cpu_ms,
            "cpu_ms_per_layer": {phase: _per_layer(ms) for phase, ms in cpu_ms.items()},
            "wall_ms": {phase: statistics.median(clock.wall_s[phase]) * 1e3 for phase in PHASES},
            "samples": {"cpu_s": clock.cpu_s, "wall_s": clock.wall_s}}


def run_contender(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    # Every contender joins the same fake group (eager makes no collective), so all run alike.
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    device = torch.device(args.device)
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    start = time.perf_counter()
    contender = MAKERS[args.contender](args, device)
    setup_s = time.perf_counter() - start
    clock, losses = _timed(contender, ids, args, device)
    # The counted steps come after the timed ones: each counter slows the step it watches.
    syncs, ops = count_syncs(contender, ids, device), count_ops(contender, ids, device)
    calls = count_calls(contender, ids)
    loss_values = [float(loss) for loss in losses]  # after the timed steps: each read is a sync
    return {
        "bench": "host_overhead", "contender": args.contender, **contender.info, "params": contender.params,
        "layers": LAYERS, "seq": SEQ, "micro_batch": MICRO_BATCH, "world": args.world, "rank": args.rank,
        "dtype": args.dtype, "setup_s": setup_s, **_timing_fields(clock, args.warmup), "syncs": syncs, "ops": ops,
        "kernel_ops_per_layer": {phase: _per_layer(ops[phase]["kernel"]) for phase in PHASES}, "py_calls": calls,
        "py_calls_per_layer": {phase: _per_layer(calls[phase].get("call", 0)) for phase in PHASES},
        "losses": loss_values, "losses_finite": all(math.isfinite(x) for x in loss_values),
    }


# ---------------------------------------------------------------------------- the parent: every contender, one table
def child_command(args: argparse.Namespace, name: str) -> list[str]:
    return [sys.executable, __file__, "--contender", name, "--print-row", "--world", str(args.world),
            "--rank", str(args.rank), "--dtype", args.dtype, "--stage", str(args.stage), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--device", args.device]


def run_child(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One contender in a fresh process: its fake group and the counters' patches end with it."""
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # hf_zero computes on a GPU whenever it sees one
    try:
        run = subprocess.run(child_command(args, name), capture_output=True, text=True, timeout=args.timeout,
                             env=env)
    except subprocess.TimeoutExpired:
        return {"bench": "host_overhead", "contender": name, "error": f"did not finish in {args.timeout:g} s"}
    found = [line for line in run.stdout.splitlines() if line.startswith(ROW_MARK)]
    if run.returncode == 0 and found:
        return json.loads(found[-1][len(ROW_MARK):])
    tail = (run.stderr or run.stdout).strip().splitlines()[-20:]
    print(f"{name}: rc {run.returncode}\n" + "\n".join(tail), file=sys.stderr)
    return {"bench": "host_overhead", "contender": name, "error": f"rc {run.returncode}: {tail[-1:]}"}


def run_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--rounds`` turns of every contender, the order reversed each round, so that a change in
    the machine's load lands on every contender alike; each one's timed steps are pooled."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    for round_index in range(args.rounds):
        for name in args.contenders[::-1] if round_index % 2 else args.contenders:
            runs[name].append(run_child(args, name))
    return [pooled(found, args.warmup) for found in runs.values()]


def pooled(rows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The first round's row (the counts do not change from one round to the next) with the
    timing of every round's steps."""
    failed = [row for row in rows if "error" in row]
    if failed:
        return failed[0]
    clock = PhaseClock()
    for row in rows:
        for phase in PHASES:
            clock.cpu_s[phase] += row["samples"]["cpu_s"][phase]
            clock.wall_s[phase] += row["samples"]["wall_s"][phase]
    return rows[0] | _timing_fields(clock, warmup) | {
        "rounds": len(rows), "step_cpu_median_s_by_round": [row["step_cpu_s"]["median_s"] for row in rows]}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """What each contender costs against eager's step in the same run."""
    eager = next((r for r in rows if r["contender"] == "eager" and "error" not in r), None)
    for row in rows:
        if eager is None or "error" in row:
            continue
        row["step_cpu_over_eager"] = row["step_cpu_s"]["median_s"] / eager["step_cpu_s"]["median_s"]
        row["backward_ops_per_layer_above_eager"] = (row["kernel_ops_per_layer"]["backward"]
                                                     - eager["kernel_ops_per_layer"]["backward"])


def _label(row: dict[str, Any]) -> str:
    return f"hf_zero (stage {row['stage']})" if row["contender"] == "hf_zero" and "stage" in row else row["contender"]


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["contender", "syncs/step (engine)", "syncs/step (all)", "fwd ops/layer", "bwd ops/layer",
               "bwd ops/layer above eager", "step ops", "py calls/layer (fwd, bwd)", "CPU ms/step (p20-p80)",
               "x eager"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([_label(r), r["error"], *[""] * (len(headers) - 2)])
            continue
        per_layer, calls, cpu = r["kernel_ops_per_layer"], r["py_calls_per_layer"], r["step_cpu_s"]
        above, ratio = r.get("backward_ops_per_layer_above_eager"), r.get("step_cpu_over_eager")
        body.append([
            _label(r), r["syncs"]["engine"] if r["contender"] == "hf_zero" else "-", r["syncs"]["all"],
            f"{per_layer['forward']:.1f}", f"{per_layer['backward']:.1f}",
            f"{above:+.1f}" if above is not None else "-", r["ops"]["step"]["kernel"],
            f"{calls['forward']:.0f}, {calls['backward']:.0f}",
            f"{cpu['median_s'] * 1e3:.1f} ({cpu['p20_s'] * 1e3:.1f}-{cpu['p80_s'] * 1e3:.1f})",
            f"{ratio:.2f}x" if ratio is not None else "-"])
    return markdown_table(headers, body)


def phase_table(rows: list[dict[str, Any]]) -> str:
    """Where each step's host time, syncs and collectives fall."""
    headers = ["contender", *(f"{p} CPU ms/layer" for p in PHASES), *(f"{p} syncs" for p in PHASES),
               "collectives/step", "value reads (ops)/step"]
    body = []
    for r in rows:
        if "error" in r:
            continue
        ops = r["ops"]
        body.append([_label(r), *(f"{r['cpu_ms_per_layer'][p]:.3f}" for p in PHASES),
                     *(r["syncs"]["per_phase"][p]["all"] for p in PHASES),
                     sum(ops[p]["collective"] for p in PHASES), sum(ops[p]["sync"] for p in PHASES)])
    return markdown_table(headers, body)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8, help="world size of the fake group this process plays a rank of")
    p.add_argument("--rank", type=int, default=5)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--stage", type=int, choices=range(4), default=3, help="hf_zero's ZeRO stage")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2,
                   help="subprocesses per contender, taking turns with the others (timed steps pooled)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="a comma list of " + ", ".join(CONTENDERS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: untested path")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per contender's subprocess")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="rows are appended here")
    p.add_argument("--contender", choices=CONTENDERS, help=argparse.SUPPRESS)  # a child's one contender
    p.add_argument("--print-row", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.contenders = [name.strip() for name in args.contenders.split(",") if name.strip()]
    unknown = [name for name in args.contenders if name not in CONTENDERS]
    if unknown or not args.contenders:
        p.error(f"--contenders: unknown {unknown} (known: {', '.join(CONTENDERS)})")
    if not 0 <= args.rank < args.world:
        p.error(f"--rank {args.rank} is outside --world {args.world}")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error(f"need --steps >= 1, --warmup >= 0 and --rounds >= 1, found {args.steps}, {args.warmup} and "
                f"{args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.contender is not None:  # a child: one contender, its row on stdout for the parent
        row = run_contender(args)
        print(ROW_MARK + json.dumps(row), flush=True)
        return 0
    rows = run_rounds(args)
    add_ratios(rows)
    context = {"device": device_info(torch.device(args.device)) | {"torch_threads": 1},
               **environment(["transformers"]),
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    write_rows(args.out, [row | context for row in rows])
    print(f"{context['device']['name']} ({args.device}), torch {context['torch']}, fake world {args.world} "
          f"as rank {args.rank}, {args.dtype}, median of {args.rounds} x {args.steps} steps, each after "
          f"{args.warmup} warm-up; per layer = / {LAYERS} decoder layers\n")
    print(table(rows))
    print()
    print(phase_table(rows))
    print(f"\n{len(rows)} rows appended to {args.out}")
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
