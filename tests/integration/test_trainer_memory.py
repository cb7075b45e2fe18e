"""Through an unmodified run_clm-shaped Trainer script (trainer_memory/clm_script.py, which loads
the model with run_clm's ``from_pretrained`` keywords) on a 134M-parameter Llama, 2 ranks, fp32:
hf_zero ZeRO-3 with the README's recipe peaks at most 0.75x the resident memory per rank of the
same script under DDP, with the same losses. (Measured 0.72x; 0.82x before the backward bounded
its reductions in flight and stopped holding the embedding, 0.80x with the first of those
undone; 1.30x before sharded loading took run_clm's keywords.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.trainer_memory.runs import build_model, run_mode, write_configs

STEPS = 4
MAX_RATIO = 0.75


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = Path(tmp_path_factory.mktemp("trainer_memory"))
    params = build_model(work / "model")
    assert params > 130e6  # a real-sized model: model states dominate the runtime's own memory
    configs = write_configs(work)
    return {mode: run_mode(mode, work / "model", work, STEPS, configs, timeout=420) for mode in ("ddp", "hf_zero3")}


def test_stage3_trainer_peak_is_at_most_0_75x_ddp_with_the_same_losses(runs):
    ddp, zero = runs["ddp"], runs["hf_zero3"]
    assert ddp["ok"], ddp.get("error")
    assert zero["ok"], zero.get("error")
    print(f"peak MB per rank: DDP {ddp['peak_rss_mb']}, hf_zero stage 3 {zero['peak_rss_mb']}")
    assert len(zero["loss"]) == len(ddp["loss"]) == STEPS
    assert zero["loss"] == pytest.approx(ddp["loss"], abs=2e-4)  # the Trainer logs 4 decimals
    assert max(zero["peak_rss_mb"]) <= MAX_RATIO * max(ddp["peak_rss_mb"]), (zero["peak_rss_mb"], ddp["peak_rss_mb"])
