"""The CUDA suite's engine half: the engine on CUDA with NCCL against the single-process reference
(skipped without CUDA; tests/kernels/test_cuda.py is the kernel half).

One process per visible GPU (world size 1 on a one-GPU machine: still a real NCCL group, so a
host tensor handed to a collective fails here as it would at scale). Every stage in fp32, bf16
and fp16, CPU optimizer offload, parameter offload, offload ratio below 1; the checks and
tolerances are those of the CPU parity tests (parity_checks.py), with the reference computed on
the same GPU. The compiled Triton kernels must be the ones the engine steps with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import scenarios as S
from tests.distributed.launch import run_distributed
from tests.distributed.parity_checks import check_fp32_parity, check_low_precision_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _offload(optimizer: str = "none", params: str = "none", ratio: float = 1.0) -> dict[str, Any]:
    zero: dict[str, Any] = {}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer, **({"ratio": ratio} if ratio < 1 else {})}
    if params != "none":
        zero["offload_param"] = {"device": params}
    return zero


CASES = {f"stage{s}": S.scenario("llama", s, 2) for s in (0, 1, 2, 3)} | {
    f"bf16_stage{s}": S.scenario("gpt2", s, 2, dtype="bf16") for s in (0, 1, 2, 3)} | {
    f"fp16_stage{s}": S.scenario("gpt2", s, 2, dtype="fp16") for s in (1, 3)} | {
    "offload_optimizer_s2": S.scenario("llama", 2, 1, zero=_offload("cpu")),
    "offload_optimizer_s3": S.scenario("llama", 3, 1, zero=_offload("cpu")),
    "offload_param_s3": S.scenario("llama", 3, 1, zero=_offload(params="cpu")),
    "offload_both_s3": S.scenario("llama", 3, 1, zero=_offload("cpu", "cpu")),
    "ratio_s3": S.scenario("llama", 3, 1, zero=_offload("cpu", ratio=0.5)),
    "bf16_offload_optimizer_s3": S.scenario("llama", 3, 1, dtype="bf16", zero=_offload("cpu")),
}


def _worker(scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    import torch.distributed as dist

    import hf_zero
    from hf_zero import kernels

    results = S.run_scenarios(scenarios)
    # The kernels the engine's own device-resident state dispatches to (stage 3 without offload).
    sc = S.scenario("gpt2", 3)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    masters = [g.master for u in engine.units for g in u.groups if g.master is not None]
    backends = sorted({kernels.backend_for(m, op) for m in masters
                       for op in ("fused_adam_", "nonfinite_and_sqnorm", "pack_for_reduce_scatter")})
    return {"results": results, "backend": dist.get_backend(), "kernel_backends": backends,
            "master_devices": sorted({str(m.device.type) for m in masters})}


@pytest.fixture(scope="module")
def runs() -> tuple[int, list[dict[str, Any]]]:
    world = torch.cuda.device_count()
    return world, run_distributed(_worker, world, list(CASES.values()))


def test_cuda_engine_runs_on_nccl_with_the_triton_kernels(runs):
    from hf_zero.kernels import dispatch

    _, per_rank = runs
    for rank in per_rank:
        assert rank["backend"] == "nccl"
        assert rank["master_devices"] == ["cuda"]
    if dispatch.TRITON_IMPORT_ERROR is not None or dispatch.INTERPRET:
        pytest.skip("compiled triton is not available: the engine runs the torch paths")
    assert all(rank["kernel_backends"] == ["triton"] for rank in per_rank)


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_engine_matches_single_process_adamw(runs, name):
    world, per_rank = runs
    sc = CASES[name]
    results = [rank["results"][list(CASES).index(name)] for rank in per_rank]
    if sc["dtype"] == "fp32":
        check_fp32_parity(results, sc, world, device="cuda")
    else:
        check_low_precision_parity(results, sc, world, device="cuda")
