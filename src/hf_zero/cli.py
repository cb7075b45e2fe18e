"""The ``hf-zero`` command: ``demo`` (the main job) and ``check-config``."""

from __future__ import annotations

import argparse
import subprocess
import sys


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={args.nproc}", "-m", "hf_zero.demo", *rest,
    ]
    print("running:", " ".join(command), flush=True)
    return subprocess.call(command)


def _check_config(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.config import HfZeroConfig, HfZeroConfigError

    try:
        config = HfZeroConfig(args.path)
    except HfZeroConfigError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{args.path}: valid. Still \"auto\": {config.auto_keys() or 'nothing'}")
    return 0


def _export(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.checkpoint import CheckpointError, export_hf_model

    try:
        out = export_hf_model(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype,
                              max_shard_size=args.max_shard_size)
    except (CheckpointError, ValueError) as error:
        print(f"hf-zero export: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.ckpt_dir} to {out} ({args.dtype}): load it with from_pretrained({out!r})")
    return 0


def _estimate(args: argparse.Namespace, rest: list[str]) -> int:
    from hf_zero.estimator import describe, estimate_model_states, format_table, meta_model

    try:
        model = meta_model(args.model)
    except (OSError, ValueError) as error:
        print(f"hf-zero estimate: cannot build a model from {args.model!r}: {error}", file=sys.stderr)
        return 1
    world = args.gpus_per_node * args.nodes
    estimates = estimate_model_states(
        model, args.gpus_per_node, args.nodes, dtype=args.dtype, stages=args.stages,
        persistence_threshold=args.persistence_threshold,
    )
    print(describe(model, world))
    print(f"model states per rank ({args.dtype} compute, fp32 master and Adam state; "
          "+working is transient memory during forward/backward):")
    print(format_table(estimates))
    return 0


def _add_export_and_estimate(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder (from_pretrained loads it)")
    export.add_argument("ckpt_dir", help="the save_checkpoint directory (uses its 'latest'), or one checkpoint directory")
    export.add_argument("out_dir")
    export.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    export.add_argument("--max-shard-size", default="5GB", help="largest weights file, e.g. 5GB, 500MB (default 5GB)")
    export.set_defaults(func=_export)
    estimate = sub.add_parser("estimate", help="per-rank memory for model states under ZeRO stages 1-3 and offload")
    estimate.add_argument("--model", required=True, help="a model folder or config.json path, or a Hub name")
    estimate.add_argument("--gpus-per-node", type=int, default=1)
    estimate.add_argument("--nodes", type=int, default=1)
    estimate.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="compute dtype")
    estimate.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[0, 1, 2, 3])
    estimate.add_argument("--persistence-threshold", type=int, default=100_000,
                          help="stage3_param_persistence_threshold (default DeepSpeed's 100000)")
    estimate.set_defaults(func=_estimate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero: ZeRO for Hugging Face")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a real 2-process ZeRO-3 training run on CPU (extra flags go to hf_zero.demo)")
    demo.add_argument("--nproc", type=int, default=2)
    demo.set_defaults(func=_demo)
    check = sub.add_parser("check-config", help="validate a DeepSpeed/hf_zero JSON config")
    check.add_argument("path")
    check.set_defaults(func=_check_config)
    _add_export_and_estimate(sub)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args, rest)


if __name__ == "__main__":
    sys.exit(main())
