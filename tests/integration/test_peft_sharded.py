"""LoRA on a sharded base: a PEFT model built on a model loaded under a live stage-3 config
(parameters on the meta device) trains at every stage with only its adapters trainable;
``save_pretrained`` writes the trained adapter weights, and loading them onto a plain base model
reproduces the trained outputs (see initialize._keep_adapters_gathered and
deferred_load.initialise_new_adapters)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed.launch import run_distributed

peft = pytest.importorskip("peft")

IDS_SHAPE = (2, 9)


def _lora_config() -> Any:
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _train_lora(base_dir: str, out_root: str) -> dict[str, Any]:
    import transformers
    from safetensors.torch import load_file

    import hf_zero

    ids = torch.randint(0, 97, IDS_SHAPE, generator=torch.Generator().manual_seed(0))
    results: dict[str, Any] = {}
    for stage in (1, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        live = hf_zero.HfZeroConfig(config)
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        base_on_meta = all(p.is_meta for p in base.parameters())
        model = peft.get_peft_model(base, _lora_config())
        lora_numel = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        engine, optimizer, *_ = hf_zero.initialize(model=model, config=live)
        trainable_numel = sum(g.layout.numel for u in engine.units for g in u.groups if g.kind.trainable)
        engine.train()
        for _ in range(3):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
        out_dir = os.path.join(out_root, f"stage{stage}")
        model.save_pretrained(out_dir)  # PEFT's own save, as a user calls it
        del live
        saved = load_file(os.path.join(out_dir, "adapter_model.safetensors")) if engine.rank == 0 else {}
        results[str(stage)] = {
            "base_on_meta": base_on_meta, "lora_numel": lora_numel, "trainable_numel": trainable_numel,
            "saved_numel": sum(v.numel() for v in saved.values()),
            "lora_b_max": max((float(v.abs().max()) for k, v in saved.items() if "lora_B" in k), default=0.0),
            "logits": logits.tolist()}
    return results


def test_lora_on_a_sharded_base_trains_saves_and_reloads(tmp_path):
    import transformers

    from tests.tiny_models import tiny_llama

    base_dir, out_root = str(tmp_path / "base"), str(tmp_path / "adapters")
    tiny_llama(seed=5).save_pretrained(base_dir)
    ranks = run_distributed(_train_lora, 2, base_dir, out_root)
    ids = torch.randint(0, 97, IDS_SHAPE, generator=torch.Generator().manual_seed(0))
    for stage, r in ranks[0].items():
        assert r["base_on_meta"] == (stage == "3"), stage  # stage 3 loads sharded
        assert r["trainable_numel"] == r["lora_numel"] > 0, stage  # only the adapters train
        assert r["saved_numel"] == r["lora_numel"], stage  # real tensors, not empty ones
        assert r["lora_b_max"] > 1e-3, stage  # lora_B starts at zero: these are trained values
        reloaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(base_dir), os.path.join(out_root, f"stage{stage}"))
        with torch.no_grad():
            expected = reloaded.eval()(input_ids=ids).logits
        assert float((torch.tensor(r["logits"]) - expected).abs().max()) < 1e-5, stage
