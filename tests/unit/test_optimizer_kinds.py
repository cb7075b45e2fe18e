"""[Note: element-wise optimizers]: which optimizers run over flat shards, which are refused."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_zero.engine.optimizer_kinds import UnsupportedOptimizerError, check_optimizer


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]


class SignSGD(torch.optim.Optimizer):
    """Element-wise, but not a class hf_zero knows."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class DeclaredSignSGD(SignSGD):
    hf_zero_elementwise = True


class MyAdafactor(torch.optim.Adafactor):
    """A subclass keeps its base's shape-awareness."""


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad,
                                 torch.optim.RMSprop, DeclaredSignSGD])
def test_elementwise_optimizers_run_over_shards(cls: type, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        check_optimizer(cls(_params()), allow_untested=False)
    assert not caplog.records


@pytest.mark.parametrize("cls, phrase", [
    (torch.optim.Adafactor, "factors its second moment"),
    (MyAdafactor, "factors its second moment"),
    (torch.optim.Muon, "orthogonalises each 2-D weight"),
    (torch.optim.LBFGS, "closure"),
])
@pytest.mark.parametrize("allow_untested", [False, True])
def test_shape_aware_optimizers_are_refused_whatever_the_config(cls: type, phrase: str, allow_untested: bool) -> None:
    params = _params()[:1]  # Muon takes 2-D parameters only
    with pytest.raises(UnsupportedOptimizerError, match=rf"{cls.__qualname__}.*{phrase}.*silently differ.*AdamW.*DDP or FSDP2"):
        check_optimizer(cls(params), allow_untested=allow_untested)


def test_transformers_adafactor_is_refused_by_name() -> None:
    from transformers.optimization import Adafactor

    with pytest.raises(UnsupportedOptimizerError, match="transformers.optimization.Adafactor"):
        check_optimizer(Adafactor(_params(), lr=1e-3, relative_step=False), allow_untested=True)


def test_unknown_optimizer_needs_zero_allow_untested_optimizer(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(UnsupportedOptimizerError, match=r'SignSGD is not .*element-wise.*"zero_allow_untested_optimizer": true'):
        check_optimizer(SignSGD(_params()), allow_untested=False)
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        check_optimizer(SignSGD(_params()), allow_untested=True)
    assert [r.getMessage() for r in caplog.records if "zero_allow_untested_optimizer" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        check_optimizer(SignSGD(_params()), allow_untested=True, rank=1)
    assert not caplog.records  # one warning per run, from rank 0
