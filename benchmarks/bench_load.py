"""Load benchmark: wall time and peak resident memory per rank to load and initialise a model.

    python benchmarks/bench_load.py                       # 110M-parameter Llama, 2 ranks, 1 repeat
    python benchmarks/bench_load.py --repeats 3 --layers 24

One run builds a Llama from a config, saves it as safetensors shards with an index, lays out a
hub cache folder (``models--org--name/snapshots/<hash>/`` + ``refs/main``) and loads it, each way
in its own fresh process(es), offline:

- ``plain``: one process, ``from_pretrained(folder)`` (transformers 5 maps the files and reads
  weights on first use, so the first forward is part of the load);
- ``hf_zero_hub`` / ``hf_zero_folder``: a live stage-3 ``HfZeroConfig``, ``from_pretrained`` by
  hub id / by folder, ``hf_zero.initialize``;
- ``deepspeed``: ``HfDeepSpeedConfig`` (stage 3) kept alive, so ``from_pretrained`` runs under
  ``deepspeed.zero.Init``, then ``deepspeed.initialize`` (``DS_ACCELERATOR=cpu``, gloo);
- ``fsdp2``: transformers' own ``from_pretrained(distributed_config=DistributedConfig(fsdp_size=N))``
  when this transformers has it.

Each process first runs a tiny model's forward and backward, so library code pages are resident
before the measurement starts. Figures per rank: wall time of load + initialise, and the growth
of peak resident memory (VmHWM) from just before the load to after initialise and to after one
forward. Rows go to ``benchmarks/results/bench_load.jsonl``; the table gives ratios measured in
the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment, markdown_table, write_rows  # noqa: E402

REPO_ID = "bench/load-llama"
COMMIT = "0" * 40
RESULTS = Path(__file__).resolve().parent / "results" / "bench_load.jsonl"
MODES = ("plain", "hf_zero_hub", "hf_zero_folder", "deepspeed", "fsdp2")
ZERO3 = {"train_micro_batch_size_per_gpu": 1,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


# ------------------------------------------------------------------ worker (one rank)
def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def _warm_up() -> None:
    import torch
    import transformers

    torch.set_num_threads(1)
    tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 64, (2, 16))
    tiny(input_ids=ids, labels=ids).loss.backward()


def _load(mode: str, folder: str, world: int) -> Any:
    """The loaded and initialised model (something whose call runs a forward)."""
    import transformers

    if mode == "plain":
        return transformers.AutoModelForCausalLM.from_pretrained(folder)
    if mode.startswith("hf_zero"):
        import hf_zero

        _load.live = hf_zero.HfZeroConfig(ZERO3)  # alive while loading: sharded from_pretrained
        name = REPO_ID if mode == "hf_zero_hub" else folder
        model = transformers.AutoModelForCausalLM.from_pretrained(name)
        return hf_zero.initialize(model=model, config=_load.live)[0]
    if mode == "deepspeed":
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed(dist_backend="gloo")
        _load.live = HfDeepSpeedConfig(ZERO3)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        return deepspeed.initialize(model=model, config=ZERO3)[0]
    if mode == "fsdp2":
        from transformers.distributed import DistributedConfig

        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, distributed_config=DistributedConfig(fsdp_size=world))
    raise ValueError(mode)


def worker(mode: str, folder: str, out_dir: str) -> None:
    import torch

    _warm_up()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from the current resident size
    before = _rss_mb("VmRSS")
    start = time.perf_counter()
    model = _load(mode, folder, world)
    load_s = time.perf_counter() - start
    peak_init = _rss_mb("VmHWM") - before
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    row = {"rank": rank, "load_init_s": load_s, "peak_init_mb": peak_init,
           "peak_forward_mb": _rss_mb("VmHWM") - before, "loss": loss}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)


# ------------------------------------------------------------------ orchestration
def build_checkpoint(args: argparse.Namespace, root: Path) -> tuple[str, str, int]:
    """(folder, hub cache, parameter count)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128, max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    numel = sum(p.numel() for p in model.parameters())
    folder = root / "folder"
    model.save_pretrained(folder, max_shard_size=args.shard_size)
    del model
    repo = root / "cache" / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return str(folder), str(root / "cache"), numel


def run_mode(mode: str, folder: str, cache: str, nproc: int, work: Path) -> dict[str, Any]:
    out_dir = tempfile.mkdtemp(dir=work)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache, OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(name, None)
    procs = 1 if mode == "plain" else nproc
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
               __file__, "--worker", mode, folder, out_dir]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    ranks = [json.loads((Path(out_dir) / f"rank{r}.json").read_text())
             for r in range(procs) if (Path(out_dir) / f"rank{r}.json").exists()]
    if done.returncode != 0 or len(ranks) != procs:
        last = [line for line in (done.stderr or "").splitlines() if line.strip()][-3:]
        return {"mode": mode, "error": " | ".join(last)[-400:]}
    return {"mode": mode, "ranks": procs,
            "load_init_s": max(r["load_init_s"] for r in ranks),
            "peak_init_mb": max(r["peak_init_mb"] for r in ranks),
            "peak_forward_mb": max(r["peak_forward_mb"] for r in ranks),
            "loss": ranks[0]["loss"]}


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in rows if "error" not in r]
    if not good:
        return rows[-1]
    out = dict(good[0])
    for key in ("load_init_s", "peak_init_mb", "peak_forward_mb"):
        out[key] = statistics.median(r[key] for r in good)
    out["repeats"] = len(good)
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    def ratio(mode: str, key: str, base: str) -> str:
        a, b = rows.get(mode, {}).get(key), rows.get(base, {}).get(key)
        return f"{a / b:.2f}x" if a is not None and b else "n/a"

    lines = []
    for mode in MODES:
        row = rows.get(mode)
        if row is None:
            continue
        if "error" in row:
            lines.append([mode, "failed", "", "", "", "", "", row["error"][:120]])
            continue
        lines.append([mode, row["ranks"], f"{row['load_init_s']:.1f}", f"{row['peak_init_mb']:.0f}",
                      f"{row['peak_forward_mb']:.0f}", ratio(mode, "peak_forward_mb", "plain"),
                      ratio(mode, "peak_forward_mb", "deepspeed"), ratio(mode, "peak_forward_mb", "fsdp2")])
    headers = ["mode", "ranks", "load+init s", "peak +MiB after init", "peak +MiB after 1st forward",
               "vs plain", "vs DeepSpeed", "vs FSDP2"]
    return markdown_table(headers, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="150MB")
    parser.add_argument("--no-write", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        work = Path(tmp)
        folder, cache, numel = build_checkpoint(args, work)
        print(f"Llama, {numel / 1e6:.1f}M parameters ({numel * 4 / 2**20:.0f} MiB fp32), "
              f"{len(list(Path(folder).glob('*.safetensors')))} shards, {args.nproc} ranks", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes.split(",")}
        for _ in range(args.repeats):  # interleaved, so a slow spell hits every mode alike
            for mode in runs:
                runs[mode].append(run_mode(mode, folder, cache, args.nproc, work))
                print(json.dumps(runs[mode][-1]), flush=True)
    rows = {mode: median_row(r) for mode, r in runs.items()}
    print(table(rows))
    if not args.no_write:
        env = environment(["transformers", "deepspeed", "accelerate"])
        write_rows(RESULTS, [dict(r, params=numel, nproc=args.nproc, env=env) for r in rows.values()])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
