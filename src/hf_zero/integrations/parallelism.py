"""Accelerate's ``ParallelismConfig`` on hf_zero: ``sp_size`` is ``sequence_parallel_size``.

[Note: parallelism_config]
Accelerate and transformers configure DeepSpeed's sequence parallelism (ALST/Ulysses) as
``ParallelismConfig(sp_size=S, sp_backend="deepspeed")``: passed to ``Accelerator``, set in
``TrainingArguments(parallelism_config=...)``, or written by ``accelerate config`` as
``parallelism_config_sp_size`` (``PARALLELISM_CONFIG_SP_SIZE`` with
``ACCELERATE_USE_PARALLELISM_CONFIG=true``). With an hf_zero config, hf_zero reads S from there
into the config's ``sequence_parallel_size`` and takes the parallelism config away from
Accelerate and the Trainer: theirs would route the batches and the loss through DeepSpeed's
adapters, and hf_zero shards the batch and computes the group's loss itself
(hf_zero.sequence_parallel). The data-parallel sizes may say what hf_zero does anyway (one of
them world / S); what it cannot run is refused by name: tensor and context parallelism, both
data-parallel sizes above 1 (hybrid sharding, hf_zero's ``mics_shard_size``), and an S that
disagrees with the config's own ``sequence_parallel_size``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

USE_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"


def parallelism_from_env() -> Any:
    """The ``ParallelismConfig`` ``accelerate launch`` describes in the environment, or None."""
    if os.environ.get(USE_ENV, "false").lower() != "true":
        return None
    from accelerate import ParallelismConfig

    return ParallelismConfig()  # reads PARALLELISM_CONFIG_* as Accelerator does


@contextlib.contextmanager
def hidden_from_accelerate() -> Iterator[None]:
    """Accelerator's ``__init__`` without the launcher's parallelism config, which it would build
    and validate (and refuse on CPU processes) though hf_zero runs it."""
    value = os.environ.pop(USE_ENV, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[USE_ENV] = value


def _size(parallelism: Any, name: str) -> int:
    return int(getattr(parallelism, name, None) or 1)


def with_sequence_parallel(raw: dict[str, Any], parallelism: Any, world_size: int | None) -> dict[str, Any]:
    """``raw`` (a ZeRO config dict) with ``parallelism``'s ``sp_size`` as its
    ``sequence_parallel_size`` ([Note: parallelism_config]); raises ValueError naming every
    part of ``parallelism`` hf_zero cannot run."""
    if parallelism is None:
        return raw
    size = _size(parallelism, "sp_size")
    problems = []
    if _size(parallelism, "tp_size") > 1:
        problems.append(f"tp_size {_size(parallelism, 'tp_size')}: hf_zero has no tensor parallelism yet; set tp_size "
                        "to 1 (ZeRO shards the model over every rank instead)")
    if _size(parallelism, "cp_size") > 1:
        problems.append(f"cp_size {_size(parallelism, 'cp_size')}: context parallelism is FSDP2's; hf_zero splits long "
                        "sequences with sp_size (Ulysses), so set sp_size to it and cp_size to 1")
    replicate, shard = _size(parallelism, "dp_replicate_size"), _size(parallelism, "dp_shard_size")
    if replicate > 1 and shard > 1:
        problems.append(f"dp_replicate_size {replicate} with dp_shard_size {shard} is hybrid sharding, which hf_zero "
                        f"configures as mics_shard_size: {shard} in its config; leave one of them at 1")
    elif world_size and max(replicate, shard) > 1 and max(replicate, shard) * size != world_size:
        problems.append(f"the data-parallel size {max(replicate, shard)} x sp_size {size} is not the world size "
                        f"{world_size}: leave dp_replicate_size and dp_shard_size at 1 (hf_zero shards over every rank)")
    configured = raw.get("sequence_parallel_size", 1)
    if size > 1 and configured not in (None, 1, size):
        problems.append(f"sp_size {size} disagrees with sequence_parallel_size {configured} in the hf_zero config; "
                        "set one of them")
    if problems:
        raise ValueError("parallelism_config: " + "; ".join(problems))
    return {**raw, "sequence_parallel_size": size} if size > 1 else raw
