"""Both sides of the DeepSpeed migration test, run on real gloo process groups (CPU).

``deepspeed_phase`` trains tiny models with real DeepSpeed ZeRO (torch's AdamW, WarmupLR) on 2
processes, saves a checkpoint, records DeepSpeed's own view of every parameter's fp32 master and
Adam moments (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``), then resumes
that checkpoint in a fresh DeepSpeed engine and trains on: the reference curve.
``hf_zero_phases`` resumes the imported checkpoints under hf_zero at world sizes 3 and 2 on the
same global batches, plus runs that drop part of the state (the negative controls).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from tests.distributed.launch import in_group
from tests.tiny_models import BUILDERS, learnable_batch

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 2e-2, (0.9, 0.95), 1e-8, 0.1, 1.0
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": LR, "warmup_num_steps": 5,
                                            "warmup_type": "log"}}
SAVE_AT, STEPS = 3, 6
GLOBAL_ROWS = 6  # 2 ranks x 3 rows, 3 ranks x 2 rows: the same global batch at every world size
CLIENT_STATE = {"epoch": 2, "note": "from DeepSpeed", "history": [1.5, 2.5]}
# The DeepSpeed runs. GPT-2's sizes are odd (15, 45, 675...): at stage 2 its flat group ends in
# padding, at stage 3 every other parameter is padded on the last rank; its embeddings are tied.
# Stage 3 uses two param groups (decay / no decay) and small sub-groups, so several flat groups
# per rank. Llama in bf16 at stage 1 with fp32 gradient accumulation runs DeepSpeed's
# BF16_Optimizer (bf16_* files, masters saved with their padding); it is checked value by value,
# not on the curve (DeepSpeed and hf_zero round bf16 activations at different places).
DS_RUNS = {
    "ds_s2_gpt2": {"model": "gpt2", "stage": 2, "groups": False, "zero": {}, "bf16": False},
    "ds_s3_gpt2": {"model": "gpt2", "stage": 3, "groups": True, "zero": {"sub_group_size": 1500}, "bf16": False},
    "ds_s1_bf16_llama": {"model": "llama", "stage": 1, "groups": True, "zero": {}, "bf16": True},
}


def param_groups(model: torch.nn.Module, split: bool) -> list[dict[str, Any]]:
    """One group, or AdamW's usual two (no weight decay on biases and norms)."""
    if not split:
        return [{"params": list(model.parameters())}]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def rows_of(step: int, rank: int, world: int) -> torch.Tensor:
    micro = GLOBAL_ROWS // world
    return learnable_batch(step, GLOBAL_ROWS)[rank * micro:(rank + 1) * micro]


def mean_over_ranks(values: list[float]) -> list[float]:
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    return [sum(col) / len(col) for col in zip(*every)]


def _train(step_fn: Callable[[torch.Tensor], float], steps: range, rank: int, world: int) -> list[float]:
    return mean_over_ranks([step_fn(rows_of(step, rank, world)) for step in steps])


# ------------------------------------------------------------------ DeepSpeed
def _deepspeed_config(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // 2, "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": run["stage"], **run["zero"]},
        # torch's AdamW: DeepSpeed's fused CPU Adam would need a C++ build.
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
        "scheduler": SCHEDULER,
        **({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}} if run["bf16"] else {}),
    }


def _deepspeed_engine(run: dict[str, Any], seed: int) -> Any:
    import deepspeed

    model = BUILDERS[run["model"]](seed=seed)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, run["groups"]),
                                      config=_deepspeed_config(run))
    return engine


def _deepspeed_step(engine: Any) -> Callable[[torch.Tensor], float]:
    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step


def _deepspeed_view(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full fp32 master and moments of every parameter (collectives at stage 3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    view = {}
    for name, param in engine.module.named_parameters():
        view[f"{name}/param"] = safe_get_full_fp32_param(param).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            view[f"{name}/{key}"] = safe_get_full_optimizer_state(param, key).detach().clone()
    return view


def _deepspeed_run(root: str, name: str, run: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    save_dir = os.path.join(root, name)
    engine = _deepspeed_engine(run, seed=0)
    first = _train(_deepspeed_step(engine), range(SAVE_AT), rank, world)
    engine.save_checkpoint(save_dir, client_state=CLIENT_STATE)
    view = _deepspeed_view(engine)
    if rank == 0:
        torch.save(view, os.path.join(root, f"{name}.reference.pt"))
    if run["bf16"]:
        return {"first_losses": first}
    resumed = _deepspeed_engine(run, seed=1)  # other initial weights: the load must replace them
    resumed.load_checkpoint(save_dir)
    lrs = []
    losses = []
    for step in range(SAVE_AT, STEPS):
        lrs.append(resumed.get_lr()[0])
        losses += _train(_deepspeed_step(resumed), range(step, step + 1), rank, world)
    return {"first_losses": first, "resumed_losses": losses, "resumed_lrs": lrs}


def _skip_shm_build() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op at start (minutes, and a
    C++ compiler); training collectives go through torch.distributed (gloo) either way."""
    import importlib

    # ``import deepspeed.comm.torch as m`` would give PyTorch: deepspeed.comm re-exports it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def deepspeed_phase(root: str) -> dict[str, Any]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    _skip_shm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {name: _deepspeed_run(root, name, run) for name, run in DS_RUNS.items()}
    # DeepSpeed's own teardown also drops the references it keeps to its process groups; left to
    # the interpreter's exit, destroying them can abort the process after all work is done.
    deepspeed.comm.destroy_process_group()
    return results


# ------------------------------------------------------------------ hf_zero
# The resumes of each imported checkpoint: at world size 3 and at 2, each at another stage than
# the DeepSpeed run; "torch" passes a torch AdamW to hf_zero.initialize (as the Trainer does) and
# loads the import written for it; the other values of "variant" make a negative control (see
# test_deepspeed_migration.py).
RESUMES = {
    3: [("ds_s2_gpt2", 3, None), ("ds_s3_gpt2", 2, None), ("ds_s3_gpt2", 3, "torch"),
        ("ds_s2_gpt2", 3, "moments"), ("ds_s2_gpt2", 3, "step"), ("ds_s2_gpt2", 3, "scheduler"),
        ("ds_s3_gpt2", 2, "moments"), ("ds_s3_gpt2", 2, "step")],
    2: [("ds_s2_gpt2", 1, None), ("ds_s3_gpt2", 3, None), ("ds_s1_bf16_llama", 2, None)],
}
CONTROLS = ("moments", "step", "scheduler")


def _hf_zero_config(stage: int, world: int, optimizer: bool) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // world, "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "scheduler": SCHEDULER,
    }
    if not optimizer:
        del config["optimizer"]
    return config


def import_dir(root: str, name: str, variant: str | None) -> str:
    return os.path.join(root, f"{name}.hf_zero" + (".torch" if variant == "torch" else ""))


def _drop(engine: Any, what: str | None) -> None:
    """A negative control: forget part of the loaded state, as a faulty import would."""
    for state in engine.optimizer.inner.state.values():
        if what == "moments":
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
        elif what == "step":
            state["step"] = 0
            state["slot_steps"] = [0] * len(state["slot_steps"])


def _hf_zero_engine(run: dict[str, Any], stage: int, variant: str | None) -> Any:
    import hf_zero

    model = BUILDERS[run["model"]](seed=1)  # other initial weights: the load must replace them
    model.train()
    groups = param_groups(model, run["groups"])
    torch_optimizer = variant == "torch"
    kwargs = ({"optimizer": torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)}
              if torch_optimizer else {"model_parameters": groups})
    config = _hf_zero_config(stage, int(os.environ["WORLD_SIZE"]), optimizer=not torch_optimizer)
    engine, *_ = hf_zero.initialize(model=model, config=config, **kwargs)
    return engine


def _hf_zero_resume(root: str, name: str, stage: int, variant: str | None) -> dict[str, Any]:
    drop = variant if variant in CONTROLS else None
    engine = _hf_zero_engine(DS_RUNS[name], stage, variant)
    refused = ""
    try:
        engine.load_checkpoint(os.path.join(root, name))
    except Exception as error:  # the DeepSpeed folder itself: an error naming the conversion
        refused = f"{type(error).__name__}: {error}"
    path, client_state = engine.load_checkpoint(import_dir(root, name, variant),
                                                load_lr_scheduler_states=drop != "scheduler")
    with engine.gathered_parameters():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    loaded = {"client_state": client_state, "lr": engine.get_lr()[0], "refused": refused,
              "counters": [engine.global_steps, engine.micro_steps, engine.global_samples]}
    _drop(engine, drop)

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = _train(step, range(SAVE_AT, STEPS), engine.rank, engine.world_size)
    if engine.rank == 0 and drop is None:
        torch.save(params, os.path.join(root, f"{name}.w{engine.world_size}s{stage}{variant or ''}.params.pt"))
    return {**loaded, "losses": losses}


def _hf_zero_group(world: int) -> Callable[[str], list[dict[str, Any]]]:
    def phase(root: str) -> list[dict[str, Any]]:
        return [dict(_hf_zero_resume(root, name, stage, variant), name=name, stage=stage, variant=variant, world=world)
                for name, stage, variant in RESUMES[world]]
    return phase


def hf_zero_phases(root: str) -> dict[str, Any]:
    """Each world size's resumes (keys are strings: the results travel as JSON)."""
    return {str(world): in_group(world, _hf_zero_group(world), root) for world in RESUMES}
