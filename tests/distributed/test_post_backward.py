"""A unit's gradients land in its flat buffer in one pass, at its post-backward ([Note:
gradients landing in a fresh buffer] in hf_zero.engine.sharding.grad_buffer): in a stage-3
backward of a tiny Llama (world size 1, in this process: the same code with the collectives
skipped), the copies of gradients into the flat buffers are one ``_foreach_copy_`` per landing
group and none per parameter; with every gradient landing as it arrives instead (one copy each),
the run is the same bit for bit. (The parity tests compare the gradients with AdamW's.)"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import scenarios as S


class _CopyCounter(TorchDispatchMode):
    """The copies the backward makes into a flat gradient buffer, by op (dispatch modes reach
    autograd's backward too)."""

    def __init__(self, engine: Any) -> None:
        super().__init__()
        self.groups = [g for u in engine.units for g in u.trainable_groups]
        self.ops: Counter[str] = Counter()

    def _into_a_grad_buffer(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return ptr != 0 and any(g.grads.full.untyped_storage().data_ptr() == ptr for g in self.groups)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func._opname == "copy_" and self._into_a_grad_buffer(args[0]):
            self.ops["copy_"] += 1
        elif func._opname == "_foreach_copy_" and any(self._into_a_grad_buffer(t) for t in args[0]):
            self.ops["_foreach_copy_"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _engine(land_at_once_bytes: int | None = None, monkeypatch: pytest.MonkeyPatch | None = None) -> Any:
    import hf_zero
    from hf_zero.engine.sharding import grad_buffer

    if land_at_once_bytes is not None:
        monkeypatch.setattr(grad_buffer, "LAND_AT_ONCE_BYTES", land_at_once_bytes)
    sc = S.scenario("llama", 3, steps=2)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    return engine, sc


def _backward_copies(engine: Any, sc: dict[str, Any], step: int) -> Counter[str]:
    ids = S.learnable_batch(step, sc["micro"])
    loss = S.model_loss(engine, "llama", ids)
    with _CopyCounter(engine) as counter:
        engine.backward(loss)
    engine.step()
    return counter.ops


def test_a_units_gradients_land_in_one_pass(no_launcher_env) -> None:
    engine, sc = _engine()
    landing = _landing_groups(engine)  # the others adopt autograd's tensor: [Note: a gradient autograd hands over]
    assert landing and all(len(g.params) > 1 for g in landing)
    for step in range(2):
        copies = _backward_copies(engine, sc, step)
        assert copies["_foreach_copy_"] == len(landing), copies
        assert copies["copy_"] == 0, f"per-parameter copies in the backward: {copies}"


def _landing_groups(engine: Any) -> list[Any]:
    return [g for u in engine.units for g in u.trainable_groups if not g.grads.adopts_autograd_grad]


def test_large_gradients_land_as_they_arrive_and_train_alike(no_launcher_env, monkeypatch) -> None:
    """With every gradient "large", each lands on its own (one copy per parameter, no batch) and
    the run is the batched run's, bit for bit."""
    batched, sc = _engine()
    batched_params = S.full_params(batched)
    for step in range(2):
        _backward_copies(batched, sc, step)
    at_once, _ = _engine(land_at_once_bytes=0, monkeypatch=monkeypatch)
    assert S.full_params(at_once) == batched_params  # the same start
    params = sum(len(g.params) for g in _landing_groups(at_once))
    for step in range(2):
        copies = _backward_copies(at_once, sc, step)
        assert copies["copy_"] == params and copies["_foreach_copy_"] == 0, copies
    assert S.full_params(at_once) == S.full_params(batched)
