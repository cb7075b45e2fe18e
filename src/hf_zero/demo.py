"""The main job: a real multi-process ZeRO training run of a small GPT-2-style model, on CPU over
gloo unless ``--device cuda`` asks for one GPU per rank over NCCL.

Run it with ``hf-zero demo`` (which starts ``torchrun``), or directly with
``torchrun --nproc_per_node 2 -m hf_zero.demo``. Each rank builds nothing by itself: rank 0
saves a freshly initialised model into a temporary folder (config.json and model.safetensors,
the layout ``save_pretrained`` writes), every rank loads it with ``from_pretrained`` (the real
loading path), rank 0 removes the folder, and
``hf_zero.initialize`` shards the model. The data is a
synthetic sparse Markov chain over the first ``--active-vocab`` tokens (each token has 4
possible successors), so the loss has somewhere to go within a short run: from ln(vocab) toward
ln(4), through ln(active vocab) once the model learns which tokens occur.

The summary says what the run showed: the loss curve, and each rank's model states against the
ZeRO formula for the stage (16Ψ/N bytes at stage 3 in fp32).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from hf_zero.cli import add_demo_arguments, check_demo_arguments, n_head
from hf_zero.log import LOGGER_NAME, VERBOSITY_ENV


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hf_zero.demo", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_demo_arguments(parser)
    args = parser.parse_args(argv)
    check_demo_arguments(parser, args)
    return args


def markov_successors(vocab: int, seed: int) -> torch.Tensor:
    """Each of ``vocab`` states' 4 possible successors."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, 4), generator=generator)


def markov_batch(successors: torch.Tensor, rows: int, seq: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(rows, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, successors.shape[0], (rows,), generator=generator)
    choice = torch.randint(0, 4, (rows, seq), generator=generator)
    for t in range(1, seq):
        tokens[:, t] = successors[tokens[:, t - 1], choice[:, t]]
    return tokens


def save_model(args: argparse.Namespace, path: str) -> None:
    """The folder ``save_pretrained`` would write, less its side effects: its ``unwrap_model``
    imports DeepSpeed whenever it is installed (which prints DeepSpeed's accelerator warning),
    and it draws a progress bar."""
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=n_head(args.n_embd), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,  # GPT-2's own ids (50256) are outside a small vocabulary
    )
    model = GPT2LMHeadModel(config)
    tied = set(model._tied_weights_keys or ())  # lm_head.weight is wte's: from_pretrained ties it back
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name not in tied}
    config.save_pretrained(path)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def zero_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {  # [Note: the demo's schedule]
            "warmup_num_steps": max(1, args.steps // 4), "warmup_min_ratio": 0.2,
            "total_num_steps": args.steps, "warmup_type": "linear"}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
    }


# [Note: the demo's schedule]
# The progress bar should look like healthy training: no logged loss above the first. Measured
# on the default run (2 ranks, stage 3, 40 steps): a 5-step warmup from 0 to lr 3e-3 spiked to
# 12.15 at step 11 (from 9.05, the same at stage 0, so the schedule and not the engine); lr 1e-3
# still bumped by 0.5 at the end of a 10-step warmup from 0. Starting the warmup at 0.2 of the
# lr removes the bump, and the first updates already lower the loss instead of leaving it within
# the batches' noise of the first step's: 9.05 -> 3.89, falling at every logged step but one or
# two of a few hundredths. tests/integration/test_demo.py pins it.


def train(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm
    from transformers import GPT2LMHeadModel

    import hf_zero
    from hf_zero.comm import default_device, ensure_process_group

    device = default_device()  # the CPU under --device cpu: main() hid CUDA before anything used it
    ensure_process_group(device)  # the barriers below need it before initialize
    if args.dtype == "bf16" and device.type == "cpu" and int(os.environ.get("RANK", "0")) == 0:
        warn_if_bf16_is_slow()
    model = load_saved_model(args, GPT2LMHeadModel)
    model.loss_type = "ForCausalLM"  # transformers infers it from the class name, and warns for GPT-2's
    engine, _, _, _ = hf_zero.initialize(model=model, config=zero_config(args))
    engine.reset_comm_stats()  # the summary counts the training steps' collectives, not initialize's
    world = engine.world_size
    successors = markov_successors(min(args.active_vocab, args.vocab), args.seed)
    losses, step_times = [], []
    bar = tqdm(range(args.steps), desc=f"ZeRO-{args.stage} x{world}", disable=engine.rank != 0)
    for step in bar:
        start = time.perf_counter()
        step_loss = 0.0
        for micro in range(args.grad_accum):
            seed = args.seed + 7919 * (step * args.grad_accum + micro) + engine.rank
            ids = markov_batch(successors, args.micro_batch, args.seq, seed).to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / args.grad_accum
        step_times.append(time.perf_counter() - start)
        losses.append(step_loss)
        bar.set_postfix(loss=f"{step_loss:.3f}", step_s=f"{step_times[-1]:.3f}")
    return summarize(args, engine, losses, step_times)


def load_saved_model(args: argparse.Namespace, model_class: Any) -> torch.nn.Module:
    """``model_class.from_pretrained`` of the model rank 0 saves into a fresh temporary folder,
    which rank 0 removes once every rank has loaded it (or failed to)."""
    rank = int(os.environ.get("RANK", "0"))
    folder = [tempfile.mkdtemp(prefix="hf_zero_demo_") if rank == 0 else None]
    try:
        if dist.is_initialized():
            dist.broadcast_object_list(folder, src=0)  # the ranks of a --standalone run share a disk
        if rank == 0:
            save_model(args, folder[0])
        if dist.is_initialized():
            dist.barrier()
        return from_pretrained_quietly(model_class, folder[0])
    finally:
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


def from_pretrained_quietly(model_class: Any, folder: str) -> torch.nn.Module:
    """``from_pretrained`` without its "Loading weights" bar, which every rank would draw."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return model_class.from_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def warn_if_bf16_is_slow() -> None:
    """Many CPUs have no native bf16 matrix multiply: a bf16 run is then many times slower."""
    a = torch.randn(256, 256)
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x @ x  # warm-up
        start = time.perf_counter()
        for _ in range(5):
            x @ x
        timings[dtype] = time.perf_counter() - start
    ratio = timings[torch.bfloat16] / timings[torch.float32]
    if ratio > 3:
        print(f"warning: a bf16 matrix multiply is {ratio:.0f}x slower than fp32 on this CPU (no native bf16 "
              "support): expect a slow run, or use --dtype fp32", flush=True)


def model_state_formula(stage: int, dtype: str, params: int, world: int) -> tuple[int, str]:
    """The ZeRO formula for this rank's model states in bytes (Adam, fp32 master), and its name:
    c bytes per compute element (4 fp32, 2 bf16)."""
    c = 4 if dtype == "fp32" else 2
    master = 0 if c == 4 else 4  # in fp32 the master is the parameter itself
    if stage == 0:
        return params * (c + c + master + 8) + (params * 4 if c != 4 else 0), "16Ψ" if c == 4 else "20Ψ"
    if stage in (1, 2):
        return c * params + (4 + master + 8) * params // world, "4Ψ + 12Ψ/N" if c == 4 else "2Ψ + 16Ψ/N"
    return (c + 4 + master + 8) * params // world, "16Ψ/N" if c == 4 else "18Ψ/N"


def summarize(args: argparse.Namespace, engine: Any, losses: list[float], step_times: list[float]) -> dict[str, Any]:
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_rank = engine.comm.all_gather_objects({
        "rank": engine.rank, "loss": losses, "memory": engine.memory_report(), "peak_rss_mib": peak_rss_mib,
    })
    timed = step_times[2:] or step_times
    tokens = args.micro_batch * args.grad_accum * args.seq * engine.world_size
    mean_losses = [statistics.fmean(r["loss"][i] for r in per_rank) for i in range(len(losses))]
    params = sum(p.numel() for p in engine.module.parameters())
    formula_bytes, formula = model_state_formula(args.stage, args.dtype, params, engine.world_size)
    total = engine.comm_stats()
    return {
        "stage": args.stage, "world_size": engine.world_size, "dtype": args.dtype, "device": str(engine.device),
        "params": params, "formula": formula, "formula_bytes": formula_bytes,
        "units": len(engine.units), "unit_rule": engine.unit_rule,
        "loss_first": mean_losses[0], "loss_last": mean_losses[-1],
        "step_time_median_s": statistics.median(timed), "tokens_per_s": tokens / statistics.median(timed),
        "comm": {
            "counts": f"collectives rank {engine.rank} issued over the {len(losses)} training steps "
                      "(initialize excluded): calls, elements and bytes per kind",
            "steps": len(losses), "total": total,
            "per_step": {kind: {k: v / len(losses) for k, v in c.items()} for kind, c in total.items()},
        },
        "per_rank": per_rank,
    }


def print_summary(summary: dict[str, Any]) -> None:
    mib = 1024 * 1024
    processes = f"{summary['world_size']} process{'es' if summary['world_size'] != 1 else ''}"
    print(f"\nhf_zero demo: ZeRO-{summary['stage']}, {processes} on {summary['device']}, {summary['dtype']}, "
          f"{summary['params']:,} parameters in {summary['units']} units ({summary['unit_rule']})")
    print(f"loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}   "
          f"step time median {summary['step_time_median_s']:.3f} s   {summary['tokens_per_s']:.0f} tokens/s")
    print("memory per rank (MiB): rank  params  grads  master  optim  total  peak RSS")
    for r in summary["per_rank"]:
        m = r["memory"]
        print(f"  {r['rank']:>4} {m['compute_params']/mib:7.2f} {m['gradients']/mib:6.2f} {m['fp32_master']/mib:7.2f} "
              f"{m['optimizer_state']/mib:6.2f} {m['total']/mib:6.2f} {r['peak_rss_mib']:9.1f}")
    states = [r["memory"]["compute_params"] + r["memory"]["gradients"] + r["memory"]["fp32_master"]
              + r["memory"]["optimizer_state"] for r in summary["per_rank"]]
    print(f"what this showed: the loss fell by {summary['loss_first'] - summary['loss_last']:.2f} over "
          f"{len(summary['per_rank'][0]['loss'])} steps; each rank holds {max(states)/mib:.2f} MiB of model "
          f"states, {max(states) / summary['formula_bytes']:.3f}x ZeRO-{summary['stage']}'s "
          f"{summary['formula']} = {summary['formula_bytes']/mib:.2f} MiB (Ψ = {summary['params']:,}, "
          f"N = {summary['world_size']}{padding_words(max(states), summary['formula_bytes'])})")


def padding_words(states: int, formula_bytes: int) -> str:
    """Why the states exceed the formula, when they do: each rank's shard is padded to equal size."""
    if states <= formula_bytes:
        return ""
    return f"; the {(states - formula_bytes) / 1024:.1f} KiB over it is padding to equal shards"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        hide_cuda()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if VERBOSITY_ENV not in os.environ:  # the summary says what initialize's INFO line would
        logging.getLogger(LOGGER_NAME).setLevel(logging.WARNING)
    summary = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print_summary(summary)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def hide_cuda() -> None:
    """Make this process see no GPU (torch reads ``CUDA_VISIBLE_DEVICES`` when CUDA is first
    used, which nothing here has done yet), so that the engine computes on the CPU over gloo."""
    if torch.cuda.is_initialized():
        raise RuntimeError("hf_zero.demo --device cpu: CUDA was initialised before the demo could hide it; "
                           "run the demo in a fresh process (hf-zero demo or torchrun -m hf_zero.demo)")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


if __name__ == "__main__":
    main()
