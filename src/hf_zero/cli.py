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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-zero", description="hf_zero: ZeRO for Hugging Face")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a real 2-process ZeRO-3 training run on CPU (extra flags go to hf_zero.demo)")
    demo.add_argument("--nproc", type=int, default=2)
    demo.set_defaults(func=_demo)
    check = sub.add_parser("check-config", help="validate a DeepSpeed/hf_zero JSON config")
    check.add_argument("path")
    check.set_defaults(func=_check_config)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args, rest)


if __name__ == "__main__":
    sys.exit(main())
