"""[Note: no CUDA graphs under stage 3]: ``engine.compile`` refuses every way of asking
``torch.compile`` for CUDA graphs at stage 3, before compiling anything, with an error that
names the problem and the fix; other modes, and CUDA graphs at stage 2, are compiled. On the CPU,
at world size 1 in this process: the refusal happens before any graph (or device) is involved."""

from __future__ import annotations

from typing import Any

import pytest

from hf_zero.engine.schedule.compiled_units import cuda_graphs_requested, is_compiled
from tests.distributed import scenarios as S

CUDA_GRAPHS = {
    "reduce-overhead": ("inductor", {"mode": "reduce-overhead"}),
    "max-autotune": ("inductor", {"mode": "max-autotune"}),
    "options": ("inductor", {"options": {"triton.cudagraphs": True}}),
    "backend": ("cudagraphs", {}),
}


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _engine(stage: int) -> Any:
    import hf_zero

    sc = S.scenario("llama", stage)
    engine, *_ = hf_zero.initialize(model=S.build_model(sc), config=S.make_config(sc))
    return engine


@pytest.mark.parametrize("name", list(CUDA_GRAPHS))
def test_stage3_refuses_cuda_graphs_before_compiling(no_launcher_env: None, name: str) -> None:
    backend, kwargs = CUDA_GRAPHS[name]
    engine = _engine(3)
    with pytest.raises(NotImplementedError) as refused:
        engine.compile(backend=backend, compile_kwargs=kwargs)
    message = str(refused.value)
    for words in ("CUDA graphs", "stage 3", cuda_graphs_requested(backend, kwargs),
                  "max-autotune-no-cudagraphs", "engine.compile"):
        assert words in message, (words, message)
    assert not any(is_compiled(unit.module) for unit in engine.units)  # refused before the first unit


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", None])
def test_modes_without_cuda_graphs_are_not_refused(mode: str | None) -> None:
    assert cuda_graphs_requested("inductor", {"mode": mode} if mode else {}) is None
    assert cuda_graphs_requested("inductor", {"options": {"triton.cudagraphs": False}}) is None
    assert cuda_graphs_requested("aot_eager", {"mode": "reduce-overhead"}) is None  # not inductor: no graphs


def test_stage2_compiles_with_cuda_graphs(no_launcher_env: None) -> None:
    engine = _engine(2)
    engine.compile(compile_kwargs={"mode": "reduce-overhead"})  # compiled lazily: nothing runs here
    assert engine.is_compiled
