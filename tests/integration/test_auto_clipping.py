"""``"gradient_clipping": "auto"`` in a custom Accelerate loop follows the script ([Note: "auto"
clipping follows the script] in hf_zero/integrations/_accelerator.py), in this process (world
size 1). Parity with DDP, with and without a ``clip_grad_norm_`` call, is in
test_plain_accelerate.py; here: where the boundary step runs, and the misuse it makes an error."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.test_plain_accelerator_errors import door  # noqa: F401  (the fixture)


def _prepared():
    import accelerate

    from tests.tiny_models import batch_for_step, tiny_gpt2

    accelerator = accelerate.Accelerator()  # HF_ZERO_STAGE=2: a plugin config, clipping "auto"
    model = tiny_gpt2()
    loader = torch.utils.data.DataLoader(list(batch_for_step(0, 2)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    return accelerator, model, optimizer, next(iter(loader))


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.usefixtures("door")
def test_the_boundary_step_waits_for_the_script() -> None:
    accelerator, model, optimizer, ids = _prepared()
    assert "gradient_clipping" in accelerator.hf_zero_config.auto_keys()
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    assert model.global_steps == 0  # not stepped inside backward
    optimizer.step()
    assert model.global_steps == 1 and model.optimizer.gradient_clipping == 0.0
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)  # steps here, clipped at 1e-3
    assert model.global_steps == 2 and model.get_global_grad_norm() > 1e-3
    assert math.isclose(float(norm), model.get_global_grad_norm(), rel_tol=1e-6)
    assert model.optimizer.gradient_clipping == 0.0  # for that step only
    optimizer.step()  # nothing left to step
    assert model.global_steps == 2
    _destroy_group()


@pytest.mark.usefixtures("door")
def test_a_boundary_without_optimizer_step_is_an_error() -> None:
    accelerator, model, _, ids = _prepared()
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    with pytest.raises(RuntimeError, match=r"before the last accumulation boundary's optimizer step.*optimizer\.step\(\)"):
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
    _destroy_group()
