"""Bytes through collectives per step and model-state bytes per rank for the two bf16 answers:
the ``bf16`` section (bf16 weights, fp32 masters) and ``torch_autocast`` (fp32 weights, DDP's
--bf16), the latter with its default ``lower_precision_safe_modules`` (Linear weights gathered and
reduced in bf16: [Note: lower-precision-safe modules] in hf_zero/engine/lower_precision.py) and
with the list empty (everything in fp32).

Each mode trains a Llama built from its config (SmolLM2-135M's shape by default: 30 layers of
576, 9 heads, 3 KV heads, a tied 49152-token embedding) with hf_zero on 2 gloo CPU ranks; the
counts are those of ``engine.comm_stats()`` over one step after a warm-up step (every
collective's full logical tensor), and ``engine.memory_report()`` after the backward.

    python benchmarks/bench_precision_traffic.py                 # stage 3, SmolLM2-135M shape
    python benchmarks/bench_precision_traffic.py --stages 2,3 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _harness import environment, markdown_table, write_rows

RESULTS = Path(__file__).parent / "results" / "bench_precision_traffic.jsonl"
MODES = {
    "bf16 section": {"bf16": {"enabled": True}},
    "torch_autocast": {"torch_autocast": {"enabled": True}},
    "torch_autocast, list []": {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": []}},
}


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        tie_word_embeddings=True))


def _rank(rank: int, size: int, port: int, args: argparse.Namespace, stage: int, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import hf_zero

    model = _model(args)
    numel = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, **MODES[mode],
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = hf_zero.initialize(model=model, config=config)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(rank))
    for step in range(2):  # the first step warms up
        engine.reset_comm_stats()
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        states = engine.memory_report()
        engine.step()
    stats = engine.comm_stats()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "stage": stage, "mode": mode, "params": numel,
            "gather_bytes": stats.get("all_gather", {}).get("bytes", 0),
            "reduce_bytes": sum(stats.get(k, {}).get("bytes", 0) for k in ("reduce_scatter", "all_reduce")),
            "state_bytes": states["total"],
        }))
    dist.destroy_process_group()


def run(stage: int, mode: str, args: argparse.Namespace) -> dict[str, object]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(2, port, args, stage, mode, out), nprocs=2, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="3", help="ZeRO stages (comma-separated)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    rows = [run(int(stage), mode, args) for stage in args.stages.split(",") for mode in MODES]
    table = []
    for row in rows:
        base = next(r for r in rows if r["stage"] == row["stage"] and r["mode"] == "bf16 section")
        total, base_total = row["gather_bytes"] + row["reduce_bytes"], base["gather_bytes"] + base["reduce_bytes"]
        table.append([row["stage"], row["mode"], f"{row['gather_bytes'] / row['params']:.2f}",
                      f"{row['reduce_bytes'] / row['params']:.2f}", f"{total / base_total:.2f}x",
                      f"{row['state_bytes'] / 2**20:.0f}", f"{row['state_bytes'] / base['state_bytes']:.2f}x"])
    print(markdown_table(["stage", "precision", "gathered B / param", "reduced B / param", "traffic x bf16 section",
                          "model states MiB / rank", "x bf16 section"], table))
    if not args.no_write:
        write_rows(RESULTS, [dict(row, model=vars(args), environment=environment(("transformers",))) for row in rows])


if __name__ == "__main__":
    sys.exit(main())
