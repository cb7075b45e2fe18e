"""Reduced 16-bit gradients land in fp32 gradient shards on the host without torch's mixed-dtype
add ([Note: landing 16-bit gradients on the host] in hf_zero.kernels.cpu), which is about 6x
slower on the CPU than converting first: on a real gloo group of 2, bf16, stages 2 and 3, with
the optimizer on the compute device (here the CPU) and offloaded, with and without gradient
accumulation, every Python-level ``Tensor.add_`` of a 16-bit tensor into an fp32 CPU tensor is
counted while the ranks train (on every thread: the offloaded landing may run on a worker), and
there is none; the first part of a step into a zeroed shard is a copy. The values are the mixed
add's: offloaded and not, the runs give the same parameters."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed

CASES = {
    "s2": dict(stage=2, offload=False, gas=1),
    "s2-offload": dict(stage=2, offload=True, gas=1),
    "s3": dict(stage=3, offload=False, gas=1),
    "s3-offload": dict(stage=3, offload=True, gas=1),
    "s3-offload-gas2": dict(stage=3, offload=True, gas=2),
}
STEPS = 3


class MixedAdds:
    """Counts ``Tensor.add_`` calls that add a 16-bit tensor into an fp32 CPU tensor."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "MixedAdds":
        self._original = torch.Tensor.add_
        counter, original = self, self._original

        def add_(self: torch.Tensor, other: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            if (isinstance(other, torch.Tensor) and self.dtype == torch.float32 and self.device.type == "cpu"
                    and other.dtype in (torch.bfloat16, torch.float16)):
                with counter._lock:
                    counter.count += 1
            return original(self, other, *args, **kwargs)

        torch.Tensor.add_ = add_
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.add_ = self._original


def _train(case: dict[str, Any]) -> dict[str, Any]:
    import hf_zero
    import hf_zero.kernels.cpu

    # The tiny model's parts are all small enough for the mixed add to be the faster one
    # (LAND_DIRECT_NUMEL): count as if every part were large.
    hf_zero.kernels.cpu.LAND_DIRECT_NUMEL = 0

    zero = {"reduce_bucket_size": 0, **({"offload_optimizer": {"device": "cpu"}} if case["offload"] else {})}
    sc = S.scenario("llama", case["stage"], case["gas"], dtype="bf16", zero=zero)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    with MixedAdds() as mixed:
        for step in range(STEPS * sc["gas"]):
            batch = S.learnable_batch(step, engine.world_size * sc["micro"])
            ids = batch[engine.rank * sc["micro"]:(engine.rank + 1) * sc["micro"]]
            engine.backward(S.model_loss(engine, "llama", ids))
            engine.step()
    return {"mixed_adds": mixed.count, "params": S.full_params(engine)}


def _every_case() -> dict[str, Any]:
    return {name: _train(case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def trained() -> list[dict[str, Any]]:
    return run_distributed(_every_case, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_no_16_bit_gradient_is_added_into_an_fp32_shard_as_it_is(trained, name: str) -> None:
    for rank in trained:
        assert rank[name]["mixed_adds"] == 0, (name, rank[name]["mixed_adds"])


@pytest.mark.parametrize("stage", [2, 3])
def test_offloaded_and_not_train_the_same(trained, stage: int) -> None:
    for rank in trained:
        plain, offload = rank[f"s{stage}"]["params"], rank[f"s{stage}-offload"]["params"]
        worst = max(abs(a - b) for name in plain for a, b in zip(offload[name], plain[name], strict=True))
        assert worst < 1e-6, worst
