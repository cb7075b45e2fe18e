"""Activation memory and tokens/s per rank against sequence length, for sequence_parallel_size
S = 1, 2, 4 (Ulysses: docs/how-it-works.md "Long sequences"), and the longest sequence that fits
a memory budget.

Each S runs hf_zero ZeRO-3 on S real gloo ranks (one sequence-parallel group, one sequence per
step) training a small Llama (sdpa attention) from its config. "Activation memory" is what
autograd keeps for the backward at the end of the forward: the bytes of every distinct storage
saved for backward that is not a parameter's, counted by a saved-tensors hook on rank 0. That is
the part of a step's peak that grows with the sequence. "Step peak" is the growth of the resident
peak (VmHWM) of rank 0 over its forward and backward, above what it held before the step
(activations, the logits and the engine's gathered parameters and gradient buckets), measured
with every large allocation its own mapping; "hf-zero estimate" is what ``hf-zero estimate --seq``
traces for the same run's activations ([Note: traced activations] in hf_zero/activations.py).
Peak RSS (which includes the interpreter, torch and the model) is reported beside them.

    python benchmarks/bench_sequence_parallel.py                          # 1K-8K, S = 1, 2, 4
    python benchmarks/bench_sequence_parallel.py --lengths 8192 --budget-mib 256
    python benchmarks/bench_sequence_parallel.py --lengths 8192 --tiled-loss-tokens 1024
    python benchmarks/bench_sequence_parallel.py --lengths 8192 --tiled-loss-tokens 1024 --tiled-mlp-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _harness import environment
from _harness import markdown_table
from _harness import write_rows

from hf_zero.simulate import rank_env, reset_peak, rss

RESULTS = Path(__file__).parent / "results" / "bench_sequence_parallel.jsonl"


def _config(args: argparse.Namespace):  # noqa: ANN202
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.lengths))


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(args), attn_implementation="sdpa")


def traced_mib(args: argparse.Namespace, size: int, length: int) -> float:
    """What ``hf-zero estimate --seq`` reports as the activations' peak for this run."""
    from hf_zero.activations import ActivationSettings, estimate_activations

    settings = ActivationSettings(seq_len=length, dtype="fp32", sequence_parallel_size=size,
                                  tiled_loss_tokens=args.tiled_loss_tokens, tiled_mlp_tokens=args.tiled_mlp_tokens)
    return estimate_activations(_config(args), settings).peak / 2**20


class SavedActivations:
    """Bytes of the distinct non-parameter storages autograd saves for the backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    torch.set_num_threads(max(1, args.threads // size))
    import torch.distributed as dist

    import hf_zero

    model = _model(args)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "sequence_parallel_size": size, "tiled_loss_tokens": args.tiled_loss_tokens,
              "tiled_mlp_tokens": args.tiled_mlp_tokens,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, _, _, _ = hf_zero.initialize(model=model, config=config)
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))
        times, activations, step_peak = [], 0, 0
        for step in range(args.steps + 1):
            saved = SavedActivations(model)
            before = reset_peak()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            peak = rss("VmHWM") - before
            engine.step()
            dist.barrier()
            if step:  # the first step warms up
                times.append(time.perf_counter() - start)
                step_peak = max(step_peak, peak)
            activations = max(activations, saved.nbytes)
        rows.append({"length": length, "activation_mib": activations / 2**20, "step_s": min(times),
                     "step_peak_mib": step_peak / 2**20,
                     "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_size(size: int, args: argparse.Namespace) -> list[dict[str, object]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(size, port, args, out), nprocs=size, join=True, start_method="spawn")
        rows = json.loads(Path(out).read_text())
    return [dict(row, sequence_parallel_size=size, tokens_per_s=row["length"] / row["step_s"],
                 traced_peak_mib=traced_mib(args, size, row["length"])) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="sequence lengths (comma-separated)")
    parser.add_argument("--sizes", default="1,2,4", help="sequence_parallel_size values (comma-separated)")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="report the longest length whose activation memory per rank fits this many MiB")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per length, after one warm-up step")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tiled-loss-tokens", type=int, default=0,
                        help="tiled_loss_tokens for every run (0: the logits and loss untiled)")
    parser.add_argument("--tiled-mlp-tokens", type=int, default=0,
                        help="tiled_mlp_tokens for every run (0: the MLPs untiled)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="host threads shared by the ranks")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    # every large allocation its own mapping, returned at free: the resident peak follows the tensors
    os.environ.update({k: v for k, v in rank_env().items() if k.startswith("MALLOC_")})
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = [row for size in sizes for row in run_size(size, args)]
    base = {row["length"]: row["activation_mib"] for row in rows if row["sequence_parallel_size"] == 1}
    table = [[row["sequence_parallel_size"], row["length"], f"{row['activation_mib']:.1f}",
              f"{row['activation_mib'] / base[row['length']]:.3f}x" if row["length"] in base else "-",
              f"{row['tokens_per_s']:.0f}", f"{row['step_peak_mib']:.0f}", f"{row['traced_peak_mib']:.0f}",
              f"{row['peak_rss_mib']:.0f}"] for row in rows]
    print(markdown_table(["S", "sequence", "activation MiB / rank", "x S=1", "tokens/s", "step peak MiB / rank",
                          "hf-zero estimate MiB", "peak RSS MiB / rank"], table))
    if args.budget_mib is not None:
        for size in sizes:
            fits = [row["length"] for row in rows if row["sequence_parallel_size"] == size
                    and row["activation_mib"] <= args.budget_mib]
            print(f"S={size}: longest sequence within {args.budget_mib:g} MiB of activations: "
                  f"{max(fits) if fits else 'none of those tried'}")
    write_rows(RESULTS, [dict(row, model=vars(args) | {"lengths": args.lengths}, environment=environment(("transformers",)))
                         for row in rows])


if __name__ == "__main__":
    sys.exit(main())
