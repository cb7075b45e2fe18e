"""What checkpoint code reads and writes of an engine: one typed interface.

[Note: the engine as checkpoints see it]
Saving, loading and the NVMe streaming of checkpoints reach the engine only through
:class:`EngineState`: its identity (rank, world size, stage), its flat groups (through
:func:`flat_groups`, in the one order every rank shares), the optimizer and scheduler whose
state is saved, the module (buffers, the model description) and the step counters loading sets.
``ZeroEngine`` satisfies it structurally; nothing here imports the engine at run time, so the
checkpoint package stays below it in the import order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from hf_zero.comm import Communicator
    from hf_zero.config import HfZeroConfig
    from hf_zero.engine.sharding.flat_group import FlatParamGroup
    from hf_zero.engine.optim.optimizer import ZeroOptimizer
    from hf_zero.engine.schedule.unit import ZeroUnit


@runtime_checkable
class EngineState(Protocol):
    """The engine state checkpoints use (see [Note: the engine as checkpoints see it])."""

    module: nn.Module
    config: HfZeroConfig
    comm: Communicator
    units: list[ZeroUnit]
    optimizer: ZeroOptimizer | None
    lr_scheduler: Any  # a scheduler with state_dict()/load_state_dict(), or None
    stage: int
    global_steps: int
    micro_steps: int
    global_samples: int

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def layout(self) -> list[dict[str, Any]]: ...

    def out_of_step(self, phase: str) -> str | None: ...


def flat_groups(engine: EngineState) -> list[FlatParamGroup]:
    """Every flat group of every unit, in the order the manifest records them."""
    return [group for unit in engine.units for group in unit.groups]
