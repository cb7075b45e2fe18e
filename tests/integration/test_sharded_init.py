"""``from_config`` under a live stage-3 config builds the model on the meta device and
``initialize`` initialises each rank's shards one module at a time (see [Note: sharded
initialisation] in hf_zero/engine/sharding/param_source.py): the weights have a plain build's
distribution, and every rank draws the same values whatever its own seed."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.distributed.launch import run_distributed

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=161, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _map_blocks_of_64kib() -> None:
    """This rank's glibc maps every block of 64 KiB or more on its own, so the resident peak
    follows the live tensors, not the heap's slack (0-15 MiB here, run to run). The ranks fork
    from a server whose allocator has started already, so ``MALLOC_MMAP_THRESHOLD_`` would come
    too late; hf_zero itself sets nothing (tests/distributed/test_buffer_pool.py)."""
    import ctypes

    ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD


def _build_sharded() -> dict[str, Any]:
    import transformers

    _map_blocks_of_64kib()

    import hf_zero
    from hf_zero.integrations._weights import gather_full_state_dict

    rank = int(os.environ["RANK"])
    live = hf_zero.HfZeroConfig(ZERO3)
    torch.manual_seed(rank)  # ranks seeded differently: rank 0's draw must win on both
    model = transformers.AutoModelForCausalLM.from_config(_config())
    on_meta = all(p.is_meta for p in model.parameters())
    engine, *_ = hf_zero.initialize(model=model, config=live)
    gathered = gather_full_state_dict(engine)
    out: dict[str, Any] = {"on_meta": on_meta}
    if rank == 0:
        # The same draw on one rank: a second lazy build under rank 0's seed, read whole.
        torch.manual_seed(0)
        alone = transformers.AutoModelForCausalLM.from_config(_config()).state_dict()
        out["max_diff_to_one_rank"] = max(float((gathered[k] - alone[k]).abs().max()) for k in alone)
        out["std"] = {k: float(v.std()) for k, v in gathered.items()}
        out["mean"] = {k: float(v.mean()) for k, v in gathered.items()}
    del engine, model, gathered
    out["biased"] = _biases_whole_weights_sharded()
    out.update(_peak_of_a_larger_build())
    return out


def _biases_whole_weights_sharded() -> dict[str, Any]:
    """Qwen2's attention projections have biases: with a persistence threshold between a bias and
    its weight, one Linear's weight is sharded while its bias stays whole in another group, so the
    bias is initialised after the weight was sharded. Returns the gathered q_proj's statistics
    and a checksum of the whole model (the same on every rank)."""
    import transformers

    import hf_zero
    from hf_zero.integrations._weights import gather_full_state_dict

    config = transformers.Qwen2Config(vocab_size=1001, hidden_size=64, intermediate_size=161, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    live = hf_zero.HfZeroConfig({**ZERO3, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}})
    engine, *_ = hf_zero.initialize(model=transformers.AutoModelForCausalLM.from_config(config), config=live)
    gathered = gather_full_state_dict(engine, rank0_only=False)
    q_proj = "model.layers.0.self_attn.q_proj."
    return {"weight_std": float(gathered[q_proj + "weight"].std()), "bias_max": float(gathered[q_proj + "bias"].abs().max()),
            "checksum": float(sum(v.double().abs().sum() for v in gathered.values())),
            "groups_kinds": sorted({g["persistent"] for g in engine.layout() if g["unit"] == "model.layers.0"})}


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def _peak_of_a_larger_build() -> dict[str, float]:
    """Peak resident growth of from_config + initialize for a 14.6M-parameter model (58 MiB)."""
    import transformers

    import hf_zero

    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=384, intermediate_size=1024,
                                      num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=3)
    live = hf_zero.HfZeroConfig(ZERO3)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from the current resident size
    before = _rss_mb("VmRSS")
    model = transformers.AutoModelForCausalLM.from_config(config)
    engine, *_ = hf_zero.initialize(model=model, config=live)
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {"peak_mb": _rss_mb("VmHWM") - before, "model_mb": sum(p.numel() for p in model.parameters()) * 4 / 2**20,
            "shard_mb": engine.memory_report()["compute_params"] / 2**20, "largest_module_mb": largest_module * 4 / 2**20}


def test_from_config_is_sharded_with_the_plain_distribution():
    from transformers import AutoModelForCausalLM

    results = run_distributed(_build_sharded, 2)  # see _map_blocks_of_64kib
    assert all(r["on_meta"] for r in results)
    for r in results:  # the shard, one module's initialisation, and a little working memory
        bound = r["shard_mb"] + r["largest_module_mb"] + 8
        assert bound < 0.75 * r["model_mb"]  # far enough below the whole model to tell them apart
        assert r["peak_mb"] < bound, f"+{r['peak_mb']:.1f} MiB per rank, bound {bound:.1f} MiB"
    r0 = results[0]
    assert r0["max_diff_to_one_rank"] == 0.0  # rank 1's half came from rank 0's seed too
    biased = [r["biased"] for r in results]
    assert biased[0]["groups_kinds"] == [False, True]  # the layer: sharded weights, whole biases and norms
    assert biased[0]["checksum"] == biased[1]["checksum"]
    assert biased[0]["bias_max"] == 0.0 and abs(biased[0]["weight_std"] - 0.02) < 0.002  # _init_weights' values
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(_config()).state_dict()
    assert set(r0["std"]) == set(plain)
    for name, value in plain.items():
        std, mean = float(value.std()), float(value.mean())
        if std == 0.0:  # norms: exactly ones
            assert r0["std"][name] == 0.0 and r0["mean"][name] == mean, name
        else:  # initializer_range 0.02 with >= 10k samples: the std is within a few percent
            assert abs(r0["std"][name] - std) < 0.05 * std, (name, r0["std"][name], std)
            assert abs(r0["mean"][name]) < 0.1 * std, name
