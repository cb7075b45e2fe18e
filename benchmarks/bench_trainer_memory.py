"""Peak resident memory per rank of an unmodified run_clm-shaped Trainer script: DDP, hf_zero
ZeRO-3 and DeepSpeed ZeRO-3 (when deepspeed is importable), in one run, with their losses.

    python benchmarks/bench_trainer_memory.py [--layers 12 --hidden 768 --intermediate 2048
        --vocab 32000] [--steps 8] [--modes ddp,hf_zero3,deepspeed3] [--sample-s 0.2]
        [--zero KEY=VALUE ...] [--json rows.json]

Both ZeRO runs read the README's ZeRO-3 recipe, ``recipes/examples/zero3.json`` ("auto" values
filled from the Trainer's arguments; ``--zero KEY=VALUE`` overrides a ``zero_optimization``
setting for both). The model is a Llama built from a config and saved in 150 MB shards (an
untied lm_head; 134M parameters at the defaults), fp32, micro batch 2 x 128 tokens, clipping
1.0, 2 ranks on CPU (gloo). The script (``tests/integration/trainer_memory/clm_script.py``)
loads the model with run_clm's ``from_pretrained`` keywords, trains, and saves as run_clm does.
Every rank's peak is ``ru_maxrss`` at exit; with ``--sample-s`` the resident memory over time
is kept too (in ``--json``). DeepSpeed is a benchmark-only dependency (``DS_BUILD_OPS=0 pip
install deepspeed``; ``DS_ACCELERATOR=cpu`` is set for it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.trainer_memory.runs import MODES, WORLD, build_model, run_mode, write_configs  # noqa: E402


def table(rows: dict[str, dict[str, Any]]) -> str:
    ddp = max(rows["ddp"]["peak_rss_mb"]) if rows.get("ddp", {}).get("ok") else None
    lines = ["| engine | peak MB per rank (rank 0 / 1) | max vs DDP | max loss gap to DDP |", "|---|---|---|---|"]
    for mode, row in rows.items():
        if not row.get("ok"):
            lines.append(f"| {mode} | failed or skipped: {row.get('error', '')[-300:]!r} | | |")
            continue
        peak = max(row["peak_rss_mb"])
        ratio = f"{peak / ddp:.2f}x" if ddp else "-"
        gap = (f"{max(abs(a - b) for a, b in zip(row['loss'], rows['ddp']['loss'], strict=True)):.1e}"
               if ddp and len(row["loss"]) == len(rows["ddp"]["loss"]) else "-")
        lines.append(f"| {mode} | {' / '.join(f'{p:.0f}' for p in row['peak_rss_mb'])} | {ratio} | {gap} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=0.0, help="also sample RSS every this many seconds")
    parser.add_argument("--zero", action="append", default=[], metavar="KEY=VALUE",
                        help="a zero_optimization setting for hf_zero and DeepSpeed alike (JSON value)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    zero_extra = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.zero)}
    work = Path(tempfile.mkdtemp(prefix="bench_trainer_memory-"))
    try:
        params = build_model(work / "model", args.layers, args.hidden, args.intermediate, args.vocab)
        configs = write_configs(work, zero_extra)
        rows: dict[str, dict[str, Any]] = {}
        for mode in args.modes.split(","):
            if mode == "deepspeed3" and importlib.util.find_spec("deepspeed") is None:
                rows[mode] = {"ok": False, "error": "deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)"}
                continue
            rows[mode] = run_mode(mode, work / "model", work, args.steps, configs, args.sample_s, timeout=1800)
        print(f"Llama of {params / 1e6:.0f}M parameters (untied lm_head), fp32, {WORLD} ranks, CPU, {args.steps} steps, "
              "micro batch 2 x 128 tokens\n")
        print(table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
