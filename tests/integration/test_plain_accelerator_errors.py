"""What the runner's Accelerate door refuses, in this process (world size 1, no launcher): a
ZeRO config must never end as plain DDP, and what hf_zero cannot honour is an error that names
it ([Note: the runner's Accelerate door]). The 2-process runs are in test_plain_accelerate.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hf_zero.cli import _through_runner
from hf_zero.integrations import plain_accelerator


@pytest.fixture
def door(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "HF_ZERO_CONFIG",
                 "HF_ZERO_CONFIG_FILE", "HF_ZERO_GRADIENT_CLIPPING"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    plain_accelerator.enable()
    try:
        yield
    finally:
        plain_accelerator.disable()
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_the_plain_name_builds_an_hf_zero_accelerator(door: None) -> None:
    import accelerate
    from hf_zero.integrations.accelerate import HfZeroAccelerator

    accelerator = accelerate.Accelerator()
    assert isinstance(accelerator, HfZeroAccelerator) and accelerator.hf_zero_config.stage == 2


def test_an_accelerator_of_the_original_class_cannot_wrap_the_model(door: None) -> None:
    original = plain_accelerator._STATE["originals"][(plain_accelerator.accelerate, "Accelerator")]
    accelerator = original()
    with pytest.raises(RuntimeError, match="would wrap the model in plain .* without hf_zero"):
        accelerator.prepare(torch.nn.Linear(2, 2))


def test_another_backend_is_refused(door: None) -> None:
    import accelerate
    from accelerate.utils import DeepSpeedPlugin

    with pytest.raises(NotImplementedError, match="deepspeed_plugin"):
        accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin())


def test_clip_grad_norm_at_another_max_norm_is_an_error(door: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import accelerate
    from tests.tiny_models import batch_for_step, tiny_gpt2

    monkeypatch.setenv("HF_ZERO_GRADIENT_CLIPPING", "0.5")
    accelerator = accelerate.Accelerator()
    model = tiny_gpt2()
    loader = torch.utils.data.DataLoader(list(batch_for_step(0, 2)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    ids = next(iter(loader))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)  # the configured value: the engine's norm
    assert norm is not None and float(norm) > 0
    with pytest.raises(ValueError, match=r"max_norm=1.0.*gradient_clipping=0.5.*Set gradient_clipping to 1"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match=r"max_norm=inf.*gradient_clipping=0.5"):  # the script wants no clipping
        accelerator.clip_grad_norm_(model.parameters(), float("inf"))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_second_trained_model_is_refused(door: None) -> None:
    import accelerate
    from tests.tiny_models import batch_for_step, tiny_gpt2

    accelerator = accelerate.Accelerator()
    loader = torch.utils.data.DataLoader(list(batch_for_step(0, 2)), batch_size=2)
    first, second = tiny_gpt2(), tiny_gpt2(seed=1)
    accelerator.prepare(first, torch.optim.AdamW(first.parameters()), loader)
    frozen = accelerator.prepare_model(tiny_gpt2(seed=2), evaluation_mode=True)  # stage 2: evaluated as is
    assert not hasattr(frozen, "optimizer")
    with pytest.raises(NotImplementedError, match="trains one model"):
        accelerator.prepare(second, torch.optim.AdamW(second.parameters()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_hf_zero_launch_runs_the_script_through_the_runner() -> None:
    assert _through_runner(["--num_processes", "2", "train.py", "--lr", "1"]) == [
        "--num_processes", "2", "-m", "hf_zero.run", "train.py", "--lr", "1"]
    assert _through_runner(["-m", "pkg.train", "--x"]) == ["-m", "hf_zero.run", "-m", "pkg.train", "--x"]
    assert _through_runner(["-m", "hf_zero.run", "train.py"]) == ["-m", "hf_zero.run", "train.py"]


def test_the_logged_micro_batch_is_the_training_dataloaders(door: None) -> None:
    """An eval dataloader of a smaller batch, prepared beside the shuffled training one, is not
    the micro-batch the config resolves to (DeepSpeedPlugin's smallest-of-all rule logged it)."""
    import accelerate
    from tests.tiny_models import batch_for_step, tiny_gpt2

    rows = list(batch_for_step(0, 12))
    for order in ("train first", "eval first"):
        accelerator = accelerate.Accelerator()
        model = tiny_gpt2()
        train = torch.utils.data.DataLoader(rows, batch_size=3, shuffle=True)
        evaluation = torch.utils.data.DataLoader(rows, batch_size=2)
        loaders = (train, evaluation) if order == "train first" else (evaluation, train)
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()), *loaders)
        assert accelerator.hf_zero_engine.train_micro_batch_size_per_gpu() == 3, order
        assert accelerator.hf_zero_engine.config.get_value("train_batch_size") == 3, order
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
