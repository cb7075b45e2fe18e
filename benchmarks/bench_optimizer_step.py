"""Optimizer step time and optimizer memory per rank at ZeRO stage 2, world 2, in one run:
AdamW (flat shards), Adafactor and Muon with auxiliary AdamW (whole-parameter steps) on hf_zero,
and AdamW and Muon on DeepSpeed ZeRO-2 when deepspeed is importable.

    python benchmarks/bench_optimizer_step.py [--steps 8] [--json out.json]

DeepSpeed is a benchmark-only dependency (``DS_BUILD_OPS=0 pip install deepspeed``); it runs
on CPU with ``DS_ACCELERATOR=cpu`` (set here) over gloo. Its Muon is the config's
``"optimizer": {"type": "Muon"}`` (``deepspeed/runtime/zero/muon``), with every parameter
tagged ``use_muon`` by the same rule as hf_zero's (:func:`hf_zero.engine.optim.muon.muon_param_groups`);
its AdamW is a client ``torch.optim.AdamW`` (its fused Adam needs a build). DeepSpeed has no
shape-aware Adafactor (a ``torch.optim.Adafactor`` there would step flat partitions), so that
row is hf_zero's only.

Step time is ``engine.step()`` (clip, optimizer step, all-gather of updated shards) after each
backward, median over the steps after the first; the whole forward/backward/step is reported
beside it. Optimizer state is every tensor in the base optimizer's ``state`` on each rank;
hf_zero's whole-parameter step also keeps full-shape fp32 masters of the parameters a rank owns
(``owner masters``), counted apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tests.distributed.launch import run_distributed  # noqa: E402

WORLD = 2
MICRO = 2
SEQ = 32
VOCAB = 1000
MUON_LR, ADAM_LR = 2e-2, 1e-3
CLIP = 1.0
RUNS = [("hf_zero", "adamw"), ("hf_zero", "adafactor"), ("hf_zero", "muon"), ("deepspeed", "adamw"),
        ("deepspeed", "muon")]


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=64))


def _config(optimizer: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
                              "gradient_clipping": CLIP, "zero_optimization": {"stage": 2},
                              "steps_per_print": 10**9}
    if optimizer is not None:
        config["optimizer"] = optimizer
    return config


MUON_SECTION = {"type": "Muon", "params": {"lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": 0.95, "weight_decay": 0.0}}


def _hf_zero(optimizer_kind: str) -> tuple[Any, Any]:
    import hf_zero

    model = _model()
    if optimizer_kind == "muon":
        engine, optimizer, _, _ = hf_zero.initialize(model=model, config=_config(MUON_SECTION))
    else:
        passed = (torch.optim.AdamW(model.parameters(), lr=ADAM_LR) if optimizer_kind == "adamw"
                  else torch.optim.Adafactor(model.parameters(), lr=ADAM_LR))
        engine, optimizer, _, _ = hf_zero.initialize(model=model, config=_config(None), optimizer=passed)
    masters = 0
    if optimizer.whole_params is not None:
        masters = sum(m.numel() * m.element_size() for _, m in optimizer.whole_params.owned_masters())
    return engine, lambda: (optimizer.inner.state, masters)


def _deepspeed(optimizer_kind: str) -> tuple[Any, Any]:
    import deepspeed

    from hf_zero.engine.optim.muon import muon_param_groups

    model = _model()
    config = _config(None)
    if optimizer_kind == "muon":
        matrices = {id(p) for p in muon_param_groups(model, {}, {})[0]["params"]}
        for param in model.parameters():  # DeepSpeed reads the split from this attribute
            param.use_muon = id(param) in matrices
        config["optimizer"] = MUON_SECTION
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        config["zero_allow_untested_optimizer"] = True
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=ADAM_LR), config=config)
    base = getattr(optimizer, "optimizer", optimizer)
    return engine, lambda: (base.state, 0)


def _measure(engine_name: str, optimizer_kind: str, steps: int) -> dict[str, Any]:
    engine, read_state = (_hf_zero if engine_name == "hf_zero" else _deepspeed)(optimizer_kind)
    rank = torch.distributed.get_rank()
    step_s, total_s = [], []
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        before_step = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        step_s.append(end - before_step)
        total_s.append(end - start)
    state, masters = read_state()
    state_bytes = sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))
    return {"step_ms": statistics.median(step_s[1:]) * 1e3, "iteration_ms": statistics.median(total_s[1:]) * 1e3,
            "optimizer_state_mb": state_bytes / 2**20, "owner_masters_mb": masters / 2**20,
            "params_m": sum(p.numel() for p in engine.module.parameters()) / 1e6}


def _worker(runs: list[tuple[str, str]], steps: int) -> dict[str, Any]:
    return {f"{engine}/{kind}": _measure(engine, kind, steps) for engine, kind in runs}


def _deepspeed_unavailable() -> str | None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (benchmark-only: DS_BUILD_OPS=0 pip install deepspeed)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write the per-rank results here")
    args = parser.parse_args()
    missing = _deepspeed_unavailable()
    runs = [r for r in RUNS if r[0] == "hf_zero" or missing is None]
    if missing:
        print(f"DeepSpeed rows skipped: {missing}")
    ranks = run_distributed(_worker, WORLD, runs, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ranks, f, indent=1)
    print(f"GPT-2 {ranks[0]['hf_zero/adamw']['params_m']:.1f}M parameters, ZeRO stage 2, world {WORLD}, CPU/gloo, "
          f"median of {args.steps - 1} steps\n")
    print("| engine | optimizer | step ms (rank 0 / 1) | forward+backward+step ms | optimizer state MB per rank "
          "| owner masters MB per rank | step vs AdamW, same engine |")
    print("|---|---|---|---|---|---|---|")
    for engine, kind in runs:
        key = f"{engine}/{kind}"
        rows = [r[key] for r in ranks]
        adamw = statistics.mean(r[f"{engine}/adamw"]["step_ms"] for r in ranks)
        mean_step = statistics.mean(r["step_ms"] for r in rows)
        per_rank = lambda field, fmt: " / ".join(format(r[field], fmt) for r in rows)  # noqa: E731
        print(f"| {engine} | {kind} | {per_rank('step_ms', '.0f')} | {per_rank('iteration_ms', '.0f')} "
              f"| {per_rank('optimizer_state_mb', '.2f')} | {per_rank('owner_masters_mb', '.1f')} "
              f"| {mean_step / adamw:.2f}x |")
    if missing is None:
        for kind in ("adamw", "muon"):
            ours = statistics.mean(r[f"hf_zero/{kind}"]["step_ms"] for r in ranks)
            theirs = statistics.mean(r[f"deepspeed/{kind}"]["step_ms"] for r in ranks)
            print(f"\n{kind}: hf_zero step / DeepSpeed step = {ours / theirs:.2f}x", end="")
        print()


if __name__ == "__main__":
    main()
