"""Optimizers hf_zero cannot step exactly over flat shards are refused before any step; element-wise
ones (known, declared, or let through by zero_allow_untested_optimizer) train as in one process."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hf_zero.checkpoint import CheckpointError
from hf_zero.engine.optim.optimizer_kinds import declare_elementwise
from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed


class SignSGD(torch.optim.Optimizer):
    """An element-wise optimizer torch does not ship: p -= lr * sign(grad)."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class DeclaredSignSGD(SignSGD):
    hf_zero_elementwise = True


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _params_for(optimizer_cls, model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """torch's Muon takes 2-D parameters only."""
    muon = isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Muon)
    return [p for p in model.parameters() if not muon or p.ndim == 2]


def _initialize(optimizer_cls, stage: int = 2, allow_untested: bool | None = None, callable_form: bool = False):
    import hf_zero

    model = S.build_model(S.scenario("gpt2", stage))
    config = S.make_config(S.scenario("gpt2", stage, optimizer="none"))
    if allow_untested is not None:
        config["zero_allow_untested_optimizer"] = allow_untested
    if callable_form:
        optimizer = lambda groups: optimizer_cls(groups, lr=1e-2)  # noqa: E731
    else:
        optimizer = optimizer_cls(_params_for(optimizer_cls, model), lr=1e-2)
    return model, hf_zero.initialize(model=model, config=config, optimizer=optimizer)


class MyAdafactor(torch.optim.Adafactor):
    """A subclass may read more than its base: only the exact classes are stepped whole."""


class MyMuon(torch.optim.Muon):
    """The same for Muon."""


@pytest.mark.parametrize("cls", [MyMuon, MyAdafactor])
@pytest.mark.parametrize("allow_untested", [False, True])
def test_shape_aware_optimizer_is_refused_even_when_untested_ones_are_allowed(no_launcher_env, cls, allow_untested):
    with pytest.raises(ValueError, match=rf"\.{cls.__name__} is a shape-aware optimizer.*torch\.optim\.AdamW"):
        _initialize(cls, allow_untested=allow_untested)


def test_shape_aware_optimizer_built_by_a_callable_is_refused(no_launcher_env):
    with pytest.raises(ValueError, match="Adafactor is shape-aware and a callable builds it .*pass the optimizer instance"):
        _initialize(torch.optim.Adafactor, callable_form=True)


def test_torch_and_transformers_adafactor_are_accepted_for_the_whole_parameter_step(no_launcher_env):
    from transformers.optimization import Adafactor

    for cls in (torch.optim.Adafactor, lambda params, lr: Adafactor(params, lr=lr, relative_step=False)):
        _, (_, optimizer, _, _) = _initialize(cls)
        assert optimizer.whole_params is not None
        assert any(p.dim() == 2 for g in optimizer.param_groups for p in g["params"])  # whole, not flat


def test_checkpoint_without_per_parameter_state_needs_load_optimizer_states_false(no_launcher_env, tmp_path):
    """A whole-parameter run's checkpoint keeps the optimizer state by parameter name; one
    without it (saved before hf_zero wrote it) is refused, naming the way out, and changes nothing."""
    import json

    _, (engine, _, _, _) = _initialize(torch.optim.Adafactor)
    ckpt = engine.save_checkpoint(str(tmp_path))
    manifest_path = tmp_path / os.path.basename(ckpt) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["whole_param_state"]
    manifest_path.write_text(json.dumps(manifest))
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1.0)
    before = S.full_params(engine)
    with pytest.raises(CheckpointError, match="no per-parameter optimizer state for Adafactor.*load_optimizer_states=False"):
        engine.load_checkpoint(str(tmp_path))
    assert S.full_params(engine) == before
    engine.load_checkpoint(str(tmp_path), load_optimizer_states=False)
    assert S.full_params(engine) != before


class AdamW(SignSGD):
    """Named like torch's, from another package: bitsandbytes' 8-bit AdamW is spelt this way."""


AdamW.__module__ = "bitsandbytes.optim.adamw"


def test_bitsandbytes_class_named_like_torch_is_refused_even_when_untested_ones_are_allowed(no_launcher_env):
    with pytest.raises(ValueError, match=r"bitsandbytes\.optim\.adamw\.AdamW is a shape-aware"):
        _initialize(AdamW, allow_untested=True)


def test_unknown_optimizer_needs_zero_allow_untested_optimizer(no_launcher_env):
    with pytest.raises(ValueError, match=r"SignSGD is not a known element-wise optimizer.*zero_allow_untested_optimizer"):
        _initialize(SignSGD)


def test_untested_allowed_or_declared_elementwise_optimizer_is_accepted_with_a_warning_only_when_untested(
        no_launcher_env, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        _initialize(SignSGD, allow_untested=True)
    assert sum("SignSGD is stepped over flat 1-D shards" in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        _initialize(DeclaredSignSGD)
        _initialize(declare_elementwise(type("DecoratedSignSGD", (SignSGD,), {})))
        _initialize(torch.optim.Adagrad)
    assert not [r for r in caplog.records if "flat 1-D shards" in r.getMessage()]


def _refusal_on_every_rank(stage: int) -> list[str]:
    """Each rank's error for Muon and Adafactor subclasses, and whether the model's parameters were touched."""
    messages = []
    for cls in (MyAdafactor, MyMuon):
        model = S.build_model(S.scenario("gpt2", stage))
        before = [p.detach().clone() for p in model.parameters()]
        try:
            import hf_zero

            hf_zero.initialize(model=model, config=S.make_config(S.scenario("gpt2", stage, optimizer="none")),
                               optimizer=cls(_params_for(cls, model), lr=1e-2))
            messages.append("accepted")
        except ValueError as exc:
            unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
            messages.append(f"{exc} | unchanged={unchanged}")
    return messages


def test_refusal_before_any_step_on_every_rank_of_a_gloo_group():
    for rank_messages in run_distributed(_refusal_on_every_rank, 2, 3):
        assert len(rank_messages) == 2
        for name, message in zip(("MyAdafactor", "MyMuon"), rank_messages, strict=True):
            assert f"{name} is a shape-aware optimizer" in message and "ZeRO stage 3" in message
            assert message.endswith("unchanged=True")
