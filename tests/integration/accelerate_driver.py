"""Every run of test_accelerate.py inside ONE `accelerate launch` (2 CPU processes): the example
custom loop (recipes/examples/train_accelerate.py) under Accelerate's plain DDP, then under
hf_zero stages 1, 2 and 3 with a save_state at step 3, then each stage resumed from that state.

Usage: hf-zero launch --config_file YAML -m tests.integration.accelerate_driver PLAN.json (the
yaml's hf_zero section configures the stage-3 run through the environment).
PLAN: {"model_dir", "out", "stages": [...], "configs": {stage: path}, "zeropp_config": path}; rank 0
writes PLAN["out"].
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("train_accelerate", REPO / "recipes/examples/train_accelerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    example = _example()
    from hf_zero.integrations.accelerate import HfZeroPlugin, plugin_from_env

    # `hf-zero launch` put the yaml's hf_zero section into HF_ZERO_*: record it, and hide it from
    # the DDP and stage 1/2 runs (a plugin-less HfZeroAccelerator would read it).
    launched_env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("HF_ZERO_")}

    def args(name: str, *extra: str):
        return example.parse_args(["--model_name_or_path", plan["model_dir"],
                                   "--output_dir", os.path.join(plan["root"], name), "--max_grad_norm", "0.5", "--cpu", *extra])

    results = {"ddp": example.train(args("ddp"))}
    for stage in plan["stages"]:
        if stage == 3 and launched_env:  # the environment route: HfZeroAccelerator(hf_zero_plugin=None)
            os.environ.update(launched_env)
            plugin = plugin_from_env()
            results["z3-env-plugin"] = {"config": str(plugin.config), "gradient_clipping": plugin.gradient_clipping,
                                        "stage": plugin.hf_zero_config.stage}
            plugin = None  # HfZeroAccelerator builds its own from the environment
        else:
            plugin = HfZeroPlugin(config=plan["configs"][str(stage)], gradient_clipping=0.5)
        results[f"z{stage}"] = example.train(args(f"z{stage}", "--save_state_at", "3"), plugin)
        for name in launched_env:
            os.environ.pop(name, None)
        state = os.path.join(plan["root"], f"z{stage}", "state-3")
        plugin = HfZeroPlugin(config=plan["configs"][str(stage)], gradient_clipping=0.5)
        results[f"z{stage}-resumed"] = example.train(args(f"z{stage}-resumed", "--resume_from", state), plugin)
        del plugin
        gc.collect()
    if plan.get("zeropp_config"):  # ZeRO++'s keys through an explicit plugin, no resume
        plugin = HfZeroPlugin(config=plan["zeropp_config"], gradient_clipping=0.5)
        said = _Said()
        logging.getLogger("hf_zero").addHandler(said)
        results["z3-zeropp"] = {**example.train(args("z3-zeropp"), plugin), "log": said.messages}
        logging.getLogger("hf_zero").removeHandler(said)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(plan["out"]).write_text(json.dumps(results))


class _Said(logging.Handler):
    """What initialize says about the config (rank 0's INFO lines): which keys took effect."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


if __name__ == "__main__":
    main(sys.argv[1])
