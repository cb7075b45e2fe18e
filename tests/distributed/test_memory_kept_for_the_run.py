"""[Note: memory kept for the run] in hf_zero.host_memory: on the host, the shards a rank keeps for
the whole run (its parameter shards and its gradient shards, under hf_zero's Adam or a torch
optimizer rebuilt over them) are each in an anonymous mapping of its own, outside glibc's heap,
where the step's activations come and go.

What tells them apart: a block glibc serves from its heap lies inside the ``[heap]`` mapping, and
one it maps for a large malloc starts after the chunk header, so not at a page boundary (the
kernel merges adjacent anonymous mappings, so where a mapping starts cannot be seen). Memory
hf_zero mapped itself starts at a page boundary outside the heap."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.launch import run_distributed

MIB = 1 << 20


def _heap_range() -> tuple[int, int]:
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("[heap]"):
                lo, hi = line.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
    return 0, 0


def _in_own_mapping(tensor: Any, heap: tuple[int, int]) -> bool:
    import mmap

    from hf_zero.host_memory import is_lasting

    ptr = tensor.data_ptr()
    return is_lasting(tensor) and ptr % mmap.PAGESIZE == 0 and not heap[0] <= ptr < heap[1]


def _kept_tensors(world: int, optimizer_kind: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero

    torch.manual_seed(0)
    # Decoder layers of 1.05M parameters: their shards (2.1 MB at 2 ranks) are above the 1 MiB a
    # tensor needs to get a mapping of its own.
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                                         max_position_embeddings=64))
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    optimizer = None
    if optimizer_kind == "config":  # hf_zero's Adam
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    else:  # a torch optimizer, rebuilt over the shards: its state is made by torch in its first step
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = hf_zero.initialize(model=model, config=config, optimizer=optimizer)
    for step in range(2):
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step * world + engine.rank))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    heap = _heap_range()
    kinds: dict[str, list[bool]] = {"param shard": [], "gradient shard": []}
    for unit in engine.units:
        for group in unit.groups:
            shard = group.storage.shard
            if shard.numel() * shard.element_size() < MIB:
                continue
            kinds["param shard"].append(_in_own_mapping(shard, heap))
            kinds["gradient shard"].append(_in_own_mapping(group.grads.shard, heap))
    return kinds


@pytest.mark.parametrize("optimizer_kind", ["config", "torch"])
def test_what_a_rank_keeps_for_the_run_is_in_mappings_of_its_own(optimizer_kind):
    for kinds in run_distributed(_kept_tensors, 2, 2, optimizer_kind):
        for kind, in_own_mapping in kinds.items():
            assert in_own_mapping and all(in_own_mapping), (kind, in_own_mapping)
