"""DeepSpeed's ``torch_autocast`` section on the Trainer ([Note: torch_autocast] in
hf_zero.config.hf_zero_config): the example Trainer script with ``--bf16``, under DDP (Accelerate's
autocast over fp32 weights) and under hf_zero with ``torch_autocast`` at stages 2 and 3, on 2 CPU
ranks. Before any update the forward is the same computation, so the first logged losses equal
DDP's where fp32 and bf16 weights each differ from it by several times the tolerance; over six
steps the curve stays within 1e-5 of DDP's. The bf16-weights run (``bf16.enabled``) is the
comparison the README quotes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import RECIPES, run_launch, script_args, torchrun, write_config

SCRIPT = str(RECIPES / "run_trainer.py")
# Step 1 is the forward of identical fp32 weights; step 2 follows one identical update. Measured
# on this model: the bf16 section's first loss is 8.6e-6 off DDP's, its curve up to 1.7e-5, and
# torch_autocast's six losses equal DDP's bit for bit; an fp32 forward fails the first bound.
SAME_FORWARD_RTOL = 1e-6
CURVE_RTOL = 1e-5  # the target is 1e-3; these runs do far better


def _losses(output_dir: Path) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [h["loss"] for h in history if "loss" in h]


@pytest.fixture(scope="module")
def curves(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("autocast")
    runs = {
        "ddp": [SCRIPT],
        "autocast-z3": ["-m", "hf_zero.run", SCRIPT, "--zero_config",
                        write_config(root / "ac3.json", 3, torch_autocast={"enabled": True})],
        "autocast-z2": ["-m", "hf_zero.run", SCRIPT, "--zero_config",
                        write_config(root / "ac2.json", 2, torch_autocast={"enabled": True})],
        "bf16-weights-z3": ["-m", "hf_zero.run", SCRIPT, "--zero_config", write_config(root / "bf3.json", 3)],
        "autocast-fp16-z3": ["-m", "hf_zero.run", SCRIPT, "--zero_config", root / "ac3.json"],
        "fp32-z3": ["-m", "hf_zero.run", SCRIPT, "--zero_config", write_config(root / "fp3.json", 3)],
    }
    out: dict[str, Any] = {}
    for name, head in runs.items():
        precision = {"autocast-fp16-z3": ["--fp16"], "fp32-z3": []}.get(name, ["--bf16"])
        proc = run_launch(torchrun(*map(str, head), *script_args("gpt2", model_dirs["gpt2"], str(root / name), *precision)))
        out[name] = _losses(root / name)
        out[f"{name}-log"] = proc.stdout + proc.stderr
    return out


@pytest.mark.parametrize("run", ["autocast-z3", "autocast-z2"])
def test_torch_autocast_trains_as_ddp_bf16_does(curves: dict[str, Any], run: str) -> None:
    ddp, got = curves["ddp"], curves[run]
    assert len(got) == len(ddp) == 6
    assert got[:2] == pytest.approx(ddp[:2], rel=SAME_FORWARD_RTOL), (got, ddp)
    assert got == pytest.approx(ddp, rel=CURVE_RTOL), (got, ddp)
    assert "compute dtype: torch.float32, forward under torch.autocast(torch.bfloat16)" in curves[f"{run}-log"]


def test_bf16_weights_are_another_computation(curves: dict[str, Any]) -> None:
    """What the section is for: with --bf16, the bf16 section computes with bf16 weights, which
    is not DDP's first forward."""
    ddp, weights = curves["ddp"], curves["bf16-weights-z3"]
    assert weights[0] != pytest.approx(ddp[0], rel=SAME_FORWARD_RTOL), (weights, ddp)
    assert "compute dtype: torch.bfloat16" in curves["bf16-weights-z3-log"]


def test_the_trainers_fp16_means_float16_autocast(curves: dict[str, Any]) -> None:
    """--fp16 with the same config (torch_autocast.dtype null): float16 autocast, with GradScaler's
    loss scale ([Note: torch_autocast]). Its first loss is the fp32 weights' forward in float16:
    neither fp32's nor bfloat16's (measured: 1.9e-6 and 2.9e-6 off them). On CPU DDP's --fp16 runs
    no autocast, so the float16 numerics are compared with torch's in
    tests/distributed/test_autocast_fp16.py."""
    log, fp32, half, bf16 = curves["autocast-fp16-z3-log"], curves["fp32-z3"], curves["autocast-fp16-z3"], curves["ddp"]
    assert "forward under torch.autocast(torch.float16)" in log
    assert "loss scaling: dynamic, start 65536, x2 after 1999 clean steps, /2 after 1 overflows" in log, log[-3000:]
    assert len(half) == 6 and all(math.isfinite(x) for x in half)
    assert half[0] != fp32[0] and half[0] != bf16[0], (half, fp32, bf16)
    assert half == pytest.approx(fp32, rel=1e-3), (half, fp32)
