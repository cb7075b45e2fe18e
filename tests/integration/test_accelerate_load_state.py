"""``accelerator.load_state()`` without a folder resumes the newest checkpoint of Accelerate's
automatic naming (``ProjectConfiguration(automatic_checkpoint_naming=True)``) under hf_zero, as
it does under DDP; in this process (world size 1, stage 2 from the environment)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_plain_accelerator_errors import door  # noqa: F401  (the fixture)


def _step(accelerator, model, optimizer, ids) -> None:
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


def _weights(accelerator, model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


@pytest.mark.usefixtures("door")
def test_load_state_without_a_folder_takes_the_newest_automatic_checkpoint(tmp_path) -> None:
    import accelerate
    from accelerate.utils import ProjectConfiguration

    from tests.tiny_models import batch_for_step, tiny_gpt2

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    accelerator = accelerate.Accelerator(project_config=project)
    model = tiny_gpt2()
    loader = torch.utils.data.DataLoader(list(batch_for_step(0, 2)), batch_size=2)  # fills the batch sizes
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    ids = next(iter(loader))
    for saves in range(2):  # checkpoint_0 after step 1, checkpoint_1 after step 2
        _step(accelerator, model, optimizer, ids)
        accelerator.save_state()
    saved = _weights(accelerator, model)
    _step(accelerator, model, optimizer, ids)
    assert any(not torch.equal(saved[k], v) for k, v in _weights(accelerator, model).items())
    accelerator.load_state()
    assert model.global_steps == 2
    assert all(torch.equal(saved[k], v) for k, v in _weights(accelerator, model).items())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
